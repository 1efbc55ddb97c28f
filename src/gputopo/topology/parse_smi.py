"""Saved ``nvidia-smi topo -m`` text (and ``topo -p2p``) read into the model.

What people save is rarely the raw output. The layout facts this module relies on come from the
collected samples described in ``TOPO-FORMAT.md``:

* Raw output is tab-separated; most pastes have the tabs expanded to 8-column stops. The header
  starts with a tab, rows start with their label (``GPU3``, ``NIC0`` or an RDMA name such as
  ``mlx5_0``), then one cell per device, then on GPU rows ``CPU Affinity``, ``NUMA Affinity`` and,
  after two tabs, ``GPU NUMA ID``. Newer drivers pad the affinity columns with spaces instead.
* Pastes add damage around that: ANSI codes (or their ``[4m`` leftovers), HTML entities and tags,
  Markdown fences, indentation of the whole block, a Greek chi for the self ``X``, header labels run
  together, columns cropped by a terminal, values run together, files cut short.

The parser is strict about link cells and forgiving about everything around them. A cell is read as
printed, or left ``None`` (not shown in the text) with a warning, or the whole text is refused with a
``ParseError`` naming the line. A link code is never guessed without a warning, and a row whose cells
do not line up with the header (the self ``X`` not under its own label) is refused, because every
cell after the slip would be wrong.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from gputopo.errors import ParseError
from gputopo.model import P2P_STATUS_CODES, UNKNOWN_CELL, Gpu, Matrix, Nic, Topology, is_link_code

__all__ = ["parse_p2p_text", "parse_topo_text"]

TAB_STOP = 8

CPU, NUMA, GPU_NUMA = "cpu", "numa", "gpu_numa"
_CANON = (CPU, NUMA, GPU_NUMA)
_COLUMN_NAMES = {CPU: "CPU Affinity", NUMA: "NUMA Affinity", GPU_NUMA: "GPU NUMA ID"}
# Header words that start each affinity column label, and the words that complete it.
_TAIL_LABEL_WORDS = {
    "CPU": (CPU, ("Affinity",)),
    "NUMA": (NUMA, ("Affinity",)),
    "GPU": (GPU_NUMA, ("NUMA", "ID")),
}
# Raw output separates the affinity values by tabs, with an empty field before GPU NUMA ID
# ("0-63\t0\t\tN/A"), so in tab-stop terms the columns sit in fields 0, 1 and 3.
_FIELD_COLUMNS = {0: CPU, 1: NUMA, 3: GPU_NUMA}

# Indices as nvidia-smi prints them: no leading zeros, so "GPU00" can never alias "GPU0".
_INDEX = r"(?:0|[1-9]\d{0,4})"
_GPU_RE = re.compile(rf"GPU({_INDEX})")
_NIC_RE = re.compile(rf"NIC{_INDEX}")
# RDMA device names used as column labels by drivers before ~515 (mlx5_0, mlx4_0, rocep49s0, ...).
_RDMA_RE = re.compile(r"[a-z][a-z0-9_]{0,30}")
_FUSED_PART = rf"GPU{_INDEX}|NIC{_INDEX}|[a-z][a-z0-9]{{0,15}}?_(?:bond_)?\d{{1,5}}"
_FUSED_PART_RE = re.compile(_FUSED_PART)
_FUSED_LABELS_RE = re.compile(rf"(?:{_FUSED_PART}){{2,}}")
_NIC_LEGEND_RE = re.compile(rf"\s*(NIC{_INDEX})\s*:\s*(\S+)\s*")

_NUMBER = r"\d{1,9}"
_STRICT_LIST_RE = re.compile(rf"{_NUMBER}(?:-{_NUMBER})?(?:,{_NUMBER}(?:-{_NUMBER})?)*")
_LOOSE_LIST_RE = re.compile(r"[\d,-]*\d[\d,-]*")
_NOT_APPLICABLE = "N/A"

_SELF = "X"
# Characters pasted in place of the self X (fonts, web pages and translation tools swap them in).
_SELF_LOOKALIKES = frozenset("xΧχХх×Ｘｘ╳✕✗")
_PLAIN_CODES = ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC")
_P2P_CODES = frozenset(P2P_STATUS_CODES)
_MAX_CODE_CHARS = 8

_ANSI_RE = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
# What is left of an ANSI code when a copy dropped the ESC byte: "[4m", "[0m", "[1;4m".
_ANSI_LEFTOVER_RE = re.compile(r"\[(?:\d{1,3}(?:;\d{1,3})*)?m")
_HTML_TAG_RE = re.compile(r"</?[A-Za-z][A-Za-z0-9]*(?:\s[^<>]*)?/?>")
_INVISIBLE = dict.fromkeys(map(ord, "\ufeff\u200b\u200c\u200d\u2060\x1b"), None)
_QUOTE_RE = re.compile(r"\s*>(?= |$) ?")

_BINARY_SAMPLE_CHARS = 65536
_TOPO_HINT = "check that the file is the output of `nvidia-smi topo -m`, pasted whole"
# Other vendors' look-alike outputs; compiled only when a text fails to parse.
_LOOKALIKES = (
    (r"(?m)MarsLink|mx-smi|MetaX|Node Affinity|^\s*HT\s*=", "MetaX `mx-smi topo`"),
    (r"(?m)MTLink|mthreads|Moore Threads|^\s*MT[x#]\s*=", "Moore Threads `mthreads-gmi`"),
    (r"(?m)xpu-smi|Xe Link|Multi-Die Fabric|GPU \d+/\d+|^\s*MDF\s*=", "Intel `xpu-smi topology`"),
    (r"ppu-smi|PPUDirect", "Alibaba `ppu-smi topo`"),
    (r"rocm-smi|ROCm|XGMI|Weight between two GPUs", "AMD `rocm-smi`"),
)


# The two immutable records are NamedTuples rather than frozen dataclasses: cheaper to define at import,
# which topo's start-up budget counts.
class _Line(NamedTuple):
    """One line after cleaning; ``no`` is its 1-based number in the text as given."""

    no: int
    text: str


class _Tok(NamedTuple):
    """A whitespace-separated token and where it sits once tabs are expanded.

    ``rel_*`` count from the line's first visible character (raw output's column 0 even when the
    whole block was indented); ``abs_*`` count from the start of the line.
    """

    text: str
    rel_start: int
    rel_end: int
    abs_start: int
    abs_end: int


@dataclass
class _Header:
    """The header line: device labels, then the affinity column labels and where they start."""

    line_no: int
    labels: list[str]
    tail: list[str] | None
    tail_starts: dict[str, int]
    fused: list[str] = field(default_factory=list)
    cut: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class _Row:
    """One matrix row as printed: its cells (self normalised to X) and the tokens after them."""

    line_no: int
    label: str
    cells: list[str | None]
    tail: list[_Tok]
    after_cells_rel: int
    after_cells_abs: int
    cut: bool = False


class _Warnings:
    """Warnings gathered per topic, so one problem on eight rows reads as one line."""

    def __init__(self) -> None:
        self._topics: dict[str, list[str]] = {}

    def add(self, template: str, who: str = "") -> None:
        """Record ``template`` (which may hold ``{who}``) for the subject ``who``."""
        subjects = self._topics.setdefault(template, [])
        if who and who not in subjects:
            subjects.append(who)

    def render(self) -> tuple[str, ...]:
        """The warnings as sentences, in the order their topics first appeared."""
        # str.replace, not str.format: templates quote pasted text, which may hold braces.
        return tuple(t.replace("{who}", _names(subjects)) for t, subjects in self._topics.items())


def _names(names: Sequence[str]) -> str:
    """``GPU0, GPU1, GPU2`` for short lists, ``GPU4, GPU5, ..., mlx5_9 (22)`` for long ones."""
    if len(names) <= 6:
        return ", ".join(names)
    return f"{', '.join(names[:3])}, ..., {names[-1]} ({len(names)} in all)"


# --- cleaning -------------------------------------------------------------------------------------


def _prepare(text: str, what: str) -> list[_Line]:
    """Split ``text`` into cleaned lines; refuse text that is empty, binary or JSON."""
    if not isinstance(text, str):
        raise ParseError(f"expected text, got {type(text).__name__}", hint=_TOPO_HINT)
    if not text.strip():
        raise ParseError("the text is empty", hint=f"save the output of `{what}` and pass that file")
    if _looks_binary(text):
        raise ParseError(
            "the data is binary, not text", hint=f"pass a text file holding the output of `{what}`"
        )
    stripped = text.lstrip("\ufeff \t\r\n")
    if stripped.startswith("{") or (stripped.startswith("[") and _is_json(stripped)):
        raise ParseError(
            "the text is JSON, not `nvidia-smi` output",
            hint="a JSON snapshot from `gputopo topo --json` is read by giving its file to --input",
        )
    raw_lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return [_Line(no, _clean(line)) for no, line in enumerate(raw_lines, start=1)]


def _looks_binary(text: str) -> bool:
    """NUL bytes, or many control or undecodable characters (a decoder replaced them with U+FFFD)."""
    if "\x00" in text:
        return True
    sample = text[:_BINARY_SAMPLE_CHARS]
    bad = sum(
        1
        for ch in sample
        if ch == "\ufffd" or (unicodedata.category(ch) == "Cc" and ch not in "\t\n\r\x0b\x0c\x1b")
    )
    return bad > max(8, len(sample) // 20)


def _is_json(text: str) -> bool:
    """True when ``text`` parses as JSON (only asked for text starting with ``[``)."""
    import json  # rare path; kept out of topo's start-up

    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _clean(line: str) -> str:
    """Remove what terminals, web pages and Markdown add around the output; keep tabs and spacing.

    Fences, prompts and prose need no handling here: lines that are neither header nor row are skipped.
    """
    line = _ANSI_RE.sub("", line)
    line = line.translate(_INVISIBLE)
    line = _ANSI_LEFTOVER_RE.sub("", line)
    if "<" in line or "&" in line:
        import html  # only pastes from web pages need it; kept out of topo's start-up

        line = html.unescape(_HTML_TAG_RE.sub("", line))
    line = line.replace("\xa0", " ")
    for _ in range(3):
        quoted = _QUOTE_RE.match(line)
        if not quoted:
            break
        line = line[quoted.end() :]
    return line.rstrip()


def _tokens(line: str) -> list[_Tok]:
    """Whitespace-separated tokens with their columns (see ``_Tok``)."""
    body = line.lstrip()
    rel = list(re.finditer(r"\S+", body.expandtabs(TAB_STOP)))
    absolute = list(re.finditer(r"\S+", line.expandtabs(TAB_STOP)))
    return [
        _Tok(r.group(), r.start(), r.end(), a.start(), a.end()) for r, a in zip(rel, absolute, strict=True)
    ]


# --- tokens ---------------------------------------------------------------------------------------


def _is_label(token: str) -> bool:
    """A device label as ``topo -m`` prints one: ``GPU3``, ``NIC10`` or an RDMA name (``mlx5_0``)."""
    if _GPU_RE.fullmatch(token) or _NIC_RE.fullmatch(token):
        return True
    return bool(_RDMA_RE.fullmatch(token)) and any(ch.isdigit() for ch in token)


def _is_code(token: str) -> bool:
    """A link code (``X``, ``NV12``, ``SOC``, ...); long tokens are refused before int() sees them."""
    return len(token) <= _MAX_CODE_CHARS and is_link_code(token)


def _is_self_like(token: str) -> bool:
    """The self cell, or a character pasted in its place."""
    return token == _SELF or token in _SELF_LOOKALIKES


def _is_cell(token: str) -> bool:
    """Anything that can stand in a matrix cell of ``topo -m`` (or of ``gputopo topo``'s own output)."""
    return _is_code(token) or _is_self_like(token) or token == UNKNOWN_CELL


def _gpu_index(label: str) -> int | None:
    """The nvidia-smi index of a ``GPU<n>`` label, ``None`` for other labels."""
    m = _GPU_RE.fullmatch(label)
    return int(m.group(1)) if m else None


def _is_value(token: str) -> bool:
    """An affinity value as printed: a CPU/NUMA list (possibly cut) or ``N/A``."""
    return token == _NOT_APPLICABLE or bool(_LOOSE_LIST_RE.fullmatch(token))


def _is_whole_list(token: str) -> bool:
    """A complete list such as ``0-31,64-95`` or ``3,1,7,5``: no dangling separator, no descending range."""
    if not _STRICT_LIST_RE.fullmatch(token):
        return False
    for part in token.split(","):
        low, _, high = part.partition("-")
        if high and int(high) < int(low):
            return False
    return True


def _lookalike_hint(lines: Sequence[_Line]) -> str | None:
    """A hint naming the tool when the text looks like another vendor's ``topo`` or like ``-p2p``."""
    text = "\n".join(line.text for line in lines)
    for pattern, tool in _LOOKALIKES:
        if re.search(pattern, text):
            return f"this looks like {tool} output; gputopo reads NVIDIA's `nvidia-smi topo -m`"
    if re.search(r"(?m)^\s*(?:GNS|CNS|TNS)\s+=|Status Ok", text):
        return "this looks like `nvidia-smi topo -p2p` output; save `nvidia-smi topo -m` for --input"
    return None


def _hint(lines: Sequence[_Line]) -> str:
    """The hint for errors about this text: the look-alike tool if recognised, else the generic one."""
    return _lookalike_hint(lines) or _TOPO_HINT


# --- header ---------------------------------------------------------------------------------------


def _parse_header(line: _Line) -> _Header | None:
    """The header if ``line`` is one: device labels (first a GPU), then affinity labels, no cells."""
    toks = _tokens(line.text)
    labels: list[str] = []
    fused: list[str] = []
    i = 0
    while i < len(toks):
        text = toks[i].text
        if _is_label(text):
            labels.append(text)
        elif _FUSED_LABELS_RE.fullmatch(text):
            labels.extend(m.group() for m in _FUSED_PART_RE.finditer(text))
            fused.append(text)
        else:
            break
        i += 1
    if not labels or not _GPU_RE.fullmatch(labels[0]):
        return None
    rest = toks[i:]
    if any(_is_cell(t.text) for t in rest):
        return None
    header = _Header(line.no, labels, [], {}, fused)
    parsed = _parse_tail_labels(rest)
    if parsed is None:
        header.tail = None
    else:
        header.tail = [key for key, _, _ in parsed]
        header.tail_starts = {key: start for key, start, _ in parsed}
        header.cut = [(word, key) for key, _, word in parsed if word]
    return header


def _parse_tail_labels(words: Sequence[_Tok]) -> list[tuple[str, int, str]] | None:
    """``(column, start, cut_text)`` for each affinity label; ``None`` when the words are not labels.

    ``cut_text`` is set when a label is incomplete (``CPU`` for ``CPU Affinity``, cut by a crop).
    """
    out: list[tuple[str, int, str]] = []
    i = 0
    while i < len(words):
        first = words[i]
        if first.text not in _TAIL_LABEL_WORDS:
            return None
        key, rest = _TAIL_LABEL_WORDS[first.text]
        seen = [first.text]
        i += 1
        cut = ""
        for expected in rest:
            if i < len(words) and words[i].text == expected:
                seen.append(expected)
                i += 1
            elif i == len(words) - 1 and expected.startswith(words[i].text):
                seen.append(words[i].text)
                cut = " ".join(seen)
                i += 1
                break
            else:
                cut = " ".join(seen)
                break
        out.append((key, first.abs_start, cut))
    keys = [key for key, _, _ in out]
    if len(set(keys)) != len(keys) or keys != sorted(keys, key=_CANON.index):
        return None
    return out


# --- rows -----------------------------------------------------------------------------------------


def _is_row(toks: Sequence[_Tok], known: Sequence[str]) -> bool:
    """A matrix row: a known label, or any label followed by a cell."""
    if not toks:
        return False
    first = toks[0].text
    if first in known:
        return True
    return _is_label(first) and len(toks) > 1 and _is_cell(toks[1].text)


def _parse_row(
    line: _Line, toks: list[_Tok], n_cols: int | None, self_col: int | None, warnings: _Warnings, hint: str
) -> _Row:
    """Split a row into cells and the tokens after them, and check the self cell is in its column.

    ``n_cols`` is the header's column count (``None`` without a header: take every cell);
    ``self_col`` is the column of this row's own label (``None`` when the header has no such column).
    """
    label = toks[0].text
    limit = n_cols if n_cols is not None else len(toks)
    cell_toks: list[_Tok] = []
    k = 1
    while k < len(toks) and len(cell_toks) < limit and _is_cell(toks[k].text):
        cell_toks.append(toks[k])
        k += 1
    tail = toks[k:]
    if tail and n_cols is not None and len(cell_toks) == n_cols - 1 and _GPU_RE.fullmatch(label):
        split = _split_fused_cell(tail[0], line, label, hint)
        if split is not None:
            code_tok, value_tok = split
            warnings.add(
                f"{{who}}: the last cell ran into the CPU affinity ('{tail[0].text}'); "
                f"read as {code_tok.text} and '{value_tok.text}'",
                label,
            )
            cell_toks.append(code_tok)
            tail = [value_tok, *tail[1:]]
    for tok in tail:
        if _is_cell(tok.text):
            raise ParseError(
                f"{label}: the row has more cells than the header has columns ('{tok.text}' after "
                f"column {len(cell_toks)})",
                line.no,
                hint,
            )
        if not _is_value(tok.text):
            what = (
                "an nvidia-smi link code"
                if n_cols is None or len(cell_toks) < n_cols
                else "a CPU or NUMA affinity value"
            )
            raise ParseError(f"{label}: '{tok.text}' is not {what}", line.no, hint)

    cells: list[str | None] = []
    for col, tok in enumerate(cell_toks):
        if tok.text == UNKNOWN_CELL:
            warnings.add("cells shown as '?' (unknown in a saved `gputopo topo` output) stay unknown", "")
            cells.append(None)
        elif _is_self_like(tok.text):
            if col != self_col:
                where = "a column of its own" if self_col is None else f"column {self_col + 1}"
                raise ParseError(
                    f"{label}: the self cell X is in column {col + 1}, not in {where}; a cell is missing "
                    "or extra in this row or in the header",
                    line.no,
                    hint,
                )
            if tok.text != _SELF:
                warnings.add(
                    f"self cells printed as '{tok.text}' ({_char_name(tok.text)}) were read as X", ""
                )
            cells.append(_SELF)
        else:
            if col == self_col:
                raise ParseError(
                    f"{label}: expected the self cell X in column {col + 1}, found '{tok.text}'; a cell is "
                    "missing or extra in this row or in the header",
                    line.no,
                    hint,
                )
            cells.append(tok.text)
    after_rel = cell_toks[-1].rel_end if cell_toks else toks[0].rel_end
    after_abs = cell_toks[-1].abs_end if cell_toks else toks[0].abs_end
    return _Row(line.no, label, cells, tail, after_rel, after_abs)


def _char_name(text: str) -> str:
    """``U+03A7 GREEK CAPITAL LETTER CHI``: what a look-alike character really is."""
    return ", ".join(f"U+{ord(ch):04X} {unicodedata.name(ch, '?')}" for ch in text)


def _split_fused_cell(tok: _Tok, line: _Line, label: str, hint: str) -> tuple[_Tok, _Tok] | None:
    """Undo a last cell run into the CPU affinity (``PH0-115`` = ``PHB`` + ``0-115``).

    The cell is recovered only when exactly one split gives a whole CPU list after a link code, or
    after the start of exactly one plain code (characters lost in the paste). Returns ``None`` when
    the token does not start like a code; raises when it does but the split is ambiguous.
    """
    text = tok.text
    if not text[:1].isalpha() or not any(ch.isdigit() for ch in text):
        return None
    found: list[tuple[str, int]] = []
    ambiguous = False
    for cut in range(1, min(len(text), _MAX_CODE_CHARS + 1)):
        head, rest = text[:cut], text[cut:]
        if not _is_whole_list(rest):
            continue
        if _is_code(head) and head != _SELF:
            found.append((head, cut))
        elif head.isalpha():
            completions = [code for code in _PLAIN_CODES if code.startswith(head)]
            if "NV".startswith(head):
                completions.append("NV#")
            if len(completions) == 1:
                found.append((completions[0], cut))
            ambiguous = ambiguous or len(completions) > 1
    if not found and not ambiguous:
        return None
    if len(found) != 1 or ambiguous:
        raise ParseError(
            f"{label}: '{text}' is a link code run into the CPU affinity and cannot be split safely",
            line.no,
            hint,
        )
    code, cut = found[0]
    code_tok = _Tok(code, tok.rel_start, tok.rel_start + cut, tok.abs_start, tok.abs_start + cut)
    value_tok = _Tok(text[cut:], tok.rel_start + cut, tok.rel_end, tok.abs_start + cut, tok.abs_end)
    return code_tok, value_tok


# --- affinity columns -----------------------------------------------------------------------------


def _tab_fields(
    toks: Sequence[_Tok], after_cells: int, pos_of: Callable[[_Tok], tuple[int, int]]
) -> list[int] | None:
    """The tab field of each token, if the row reads as tab-separated output expanded to 8-column stops.

    Field 0 starts at the first stop after the last cell; every token must start on a stop, and each
    stop skipped is an empty field (an empty CPU affinity, or the blank field before GPU NUMA ID).
    """
    pos = (after_cells // TAB_STOP + 1) * TAB_STOP
    index = 0
    out: list[int] = []
    for tok in toks:
        start, end = pos_of(tok)
        while pos < start:
            pos += TAB_STOP
            index += 1
        if pos != start:
            return None
        out.append(index)
        pos = (end // TAB_STOP + 1) * TAB_STOP
        index += 1
    return out


def _place_values(row: _Row, header: _Header | None, warnings: _Warnings) -> dict[str, str]:
    """Which affinity column each value after the cells belongs to.

    In order of trust: the tab-stop layout of raw output; the header's own column starts (newer
    drivers pad with spaces); the count of values against the header's labels. Values that cannot be
    placed are left out (unknown), with a warning.
    """
    toks = row.tail
    expected = header.tail if header is not None else None
    if not toks:
        if expected and not row.cut:
            warnings.add("{who}: the row shows no affinity values", row.label)
        return {}

    for after, pos_of in (
        (row.after_cells_rel, lambda t: (t.rel_start, t.rel_end)),
        (row.after_cells_abs, lambda t: (t.abs_start, t.abs_end)),
    ):
        fields = _tab_fields(toks, after, pos_of)
        if fields is None or not all(f in _FIELD_COLUMNS for f in fields):
            continue
        keys = [_FIELD_COLUMNS[f] for f in fields]
        # A hand-aligned row can land on tab stops by chance; when its values match the header's
        # labels one for one, the count is the better witness.
        if expected is None or set(keys) <= set(expected) or len(toks) != len(expected):
            return _assign(row, keys, toks, expected, warnings)
        break

    if header is not None and header.tail_starts:
        by_start = {start: key for key, start in header.tail_starts.items()}
        keys_at = [by_start.get(t.abs_start) for t in toks]
        if all(keys_at) and keys_at == sorted(set(keys_at), key=_CANON.index):
            return _assign(row, [k for k in keys_at if k], toks, expected, warnings)

    known = expected or []
    if expected is not None and len(toks) == len(known):
        return _assign(row, list(known), toks, expected, warnings)
    if len(known) < len(toks) <= len(_CANON) and list(known) == list(_CANON[: len(known)]):
        return _assign(row, list(_CANON[: len(toks)]), toks, expected, warnings)
    if header is not None and expected and len(toks) < len(expected):
        split = _split_fused_values(toks, header)
        if split is not None:
            warnings.add(
                f"{{who}}: {_COLUMN_NAMES[split[1]]} and {_COLUMN_NAMES[split[2]]} ran together "
                f"('{split[3]}'); split where the header's columns put them",
                row.label,
            )
            return _assign(row, list(expected), split[0], expected, warnings)
    shown = " ".join(t.text for t in toks)
    warnings.add(
        f"{{who}}: cannot tell which affinity column '{shown}' belongs to; affinity left unknown", row.label
    )
    return {}


def _assign(
    row: _Row, keys: list[str], toks: Sequence[_Tok], expected: list[str] | None, warnings: _Warnings
) -> dict[str, str]:
    """Pair columns with values and say where the row and the header disagree."""
    values = {key: tok.text for key, tok in zip(keys, toks, strict=True)}
    if expected is None:
        warnings.add(
            "the header's affinity labels are missing or unreadable; values read in nvidia-smi's "
            "column order (CPU, NUMA, GPU NUMA ID)"
        )
        return values
    for key in keys:
        if key not in expected:
            warnings.add(
                f"the header does not name {_COLUMN_NAMES[key]}, but rows carry it ({{who}}); "
                "read by position",
                row.label,
            )
    present = [key for key in expected if key in values]
    if present:
        last = max(expected.index(key) for key in present)
        for key in expected[last + 1 :]:
            warnings.add(f"{{who}}: the row ends before its {_COLUMN_NAMES[key]}", row.label)
    return values


def _split_fused_values(toks: Sequence[_Tok], header: _Header) -> tuple[list[_Tok], str, str, str] | None:
    """Undo two affinity values printed without a gap (``0-31,64-950`` = ``0-31,64-95`` + ``0``).

    Only with column evidence: the values before the split must start at their header columns, and
    the split-off value and those after it must all sit the same distance from theirs. Accepted only
    when exactly one split passes; returns the tokens, the two columns and the fused text.
    """
    expected = header.tail or []
    starts = header.tail_starts
    if len(toks) != len(expected) - 1 or not all(key in starts for key in expected):
        return None
    found = []
    for i, tok in enumerate(toks):
        for cut in range(1, len(tok.text)):
            head, rest = tok.text[:cut], tok.text[cut:]
            if not (_is_whole_list(head) and (_is_whole_list(rest) or rest == _NOT_APPLICABLE)):
                continue
            head_tok = _Tok(head, tok.rel_start, tok.rel_start + cut, tok.abs_start, tok.abs_start + cut)
            rest_tok = _Tok(rest, tok.rel_start + cut, tok.rel_end, tok.abs_start + cut, tok.abs_end)
            candidate = [*toks[:i], head_tok, rest_tok, *toks[i + 1 :]]
            anchored = all(candidate[k].abs_start == starts[expected[k]] for k in range(i + 1))
            shifts = {candidate[k].abs_start - starts[expected[k]] for k in range(i + 1, len(candidate))}
            if anchored and len(shifts) == 1:
                found.append((candidate, expected[i], expected[i + 1], tok.text))
    return found[0] if len(found) == 1 else None


# --- the block ------------------------------------------------------------------------------------


@dataclass
class _Block:
    """The matrix found in the text: its header (``None`` when the paste lost it) and rows."""

    header: _Header | None
    rows: list[_Row]
    end: int


def _find_block(lines: Sequence[_Line], warnings: _Warnings, hint: str) -> _Block:
    """The first header followed by rows (or, failing that, rows without a header) and its rows."""
    first_header: _Header | None = None
    for i, line in enumerate(lines):
        header = _parse_header(line)
        if header is None:
            continue
        first_header = first_header or header
        if _next_is_row(lines, i + 1, header.labels):
            return _read_rows(lines, i + 1, header, warnings, hint)
    if first_header is not None:
        raise ParseError(
            "the matrix header is not followed by any rows (the paste is cut?)", first_header.line_no, hint
        )
    for i, line in enumerate(lines):
        toks = _tokens(line.text)
        if _is_row(toks, ()) and _GPU_RE.fullmatch(toks[0].text):
            warnings.add(
                "the matrix has no header line; columns taken in row order, as nvidia-smi prints them"
            )
            return _read_rows(lines, i, None, warnings, hint)
    raise ParseError(
        "no `nvidia-smi topo -m` matrix found (no header line such as 'GPU0 GPU1 ... CPU Affinity')",
        hint=hint,
    )


def _next_is_row(lines: Sequence[_Line], start: int, labels: Sequence[str]) -> bool:
    """True when the first non-blank line from ``start`` is a matrix row."""
    for line in lines[start:]:
        if line.text.strip():
            return _is_row(_tokens(line.text), labels)
    return False


def _read_rows(
    lines: Sequence[_Line], start: int, header: _Header | None, warnings: _Warnings, hint: str
) -> _Block:
    """Rows from ``start`` until a line that is not a row; blank lines between rows are skipped."""
    if header is not None:
        if len(set(header.labels)) != len(header.labels):
            dup = next(label for label in header.labels if header.labels.count(label) > 1)
            raise ParseError(f"the header names {dup} twice", header.line_no, hint)
        if header.fused:
            warnings.add(f"header labels ran together ('{header.fused[0]}'); split at each device name", "")
        for cut, key in header.cut:
            warnings.add(f"the header's '{cut}' label is cut; read as {_COLUMN_NAMES[key]}")
        if header.tail is None:
            warnings.add("the header's affinity labels are unreadable")
    labels = list(header.labels) if header is not None else []
    n_cols = len(labels) if header is not None else None
    rows: list[_Row] = []
    seen: dict[str, _Row] = {}
    end = start
    for i in range(start, len(lines)):
        line = lines[i]
        if not line.text.strip():
            continue
        toks = _tokens(line.text)
        again = _parse_header(line)
        # A lone known label followed by values ("GPU0 0 15") is a broken row, not a new header.
        if again is not None and (len(again.labels) > 1 or again.tail):
            if header is not None and again.labels == header.labels and not rows:
                warnings.add("the header line is repeated; the copy was skipped")
                end = i + 1
                continue
            break
        if not _is_row(toks, labels if header is not None else ()):
            break
        label = toks[0].text
        if header is None:
            self_col: int | None = len(rows) if label not in seen else list(seen).index(label)
        else:
            self_col = labels.index(label) if label in labels else None
        row = _parse_row(line, toks, n_cols, self_col, warnings, hint)
        end = i + 1
        if label in seen:
            if seen[label].cells == row.cells and [t.text for t in seen[label].tail] == [
                t.text for t in row.tail
            ]:
                warnings.add("{who}: the row appears twice; the copy was skipped", label)
                continue
            raise ParseError(f"{label}: a second, different row for the same device", line.no, hint)
        seen[label] = row
        rows.append(row)
    return _Block(header, rows, end)


# --- assembly -------------------------------------------------------------------------------------


def parse_topo_text(text: str, source: str = "text") -> Topology:
    """Read saved ``nvidia-smi topo -m`` output into a ``Topology`` (``live=False``).

    Cells are kept as printed (``SOC`` stays ``SOC``); the self cell is ``"X"``; a cell the text does
    not show is ``None``. Affinity values are kept as printed (``N/A`` included); an affinity the
    text does not show, or that nvidia-smi printed empty, is ``None``. ``warnings`` say what was
    recovered or guessed. Raises ``ParseError`` (naming the line) for text that cannot be read safely,
    and for text that is not ``topo -m`` output at all (with a hint naming the tool when it is
    another vendor's).
    """
    lines = _prepare(text, "nvidia-smi topo -m")
    hint = _hint(lines)
    warnings = _Warnings()
    block = _find_block(lines, warnings, hint)
    header, rows = block.header, block.rows
    if not rows:
        line_no = header.line_no if header is not None else None
        raise ParseError("the matrix has no readable rows", line_no, hint)

    labels = list(header.labels) if header is not None else [row.label for row in rows]
    matrix = _fill_matrix(labels, rows, warnings, hint)
    gpu_values: dict[str, dict[str, str]] = {}
    for row in rows:
        if _GPU_RE.fullmatch(row.label):
            gpu_values[row.label] = _place_values(row, header, warnings)
        elif row.tail:
            warnings.add("{who}: values after the cells of a NIC row were ignored", row.label)
    _check_affinity(gpu_values, warnings)
    gpus, nics = _devices(labels, gpu_values, _nic_legend(lines[block.end :], warnings), warnings)
    _note_other_matrices(lines[block.end :], warnings)
    return Topology(
        source=source,
        gpus=tuple(gpus),
        nics=tuple(nics),
        matrix=Matrix(tuple(labels), tuple(tuple(row) for row in matrix)),
        warnings=warnings.render(),
        live=False,
    )


def _fill_matrix(
    labels: list[str], rows: Sequence[_Row], warnings: _Warnings, hint: str
) -> list[list[str | None]]:
    """The cells of every row under ``labels``, ``None`` where the text shows none.

    Appends to ``labels`` the rows the header has no column for (a crop took them), and checks that
    every row shows the header's columns or is short for a reason that leaves no cell in doubt.
    """
    n_cols = len(labels)
    extra = [row.label for row in rows if row.label not in labels]
    labels += extra
    for label in extra:
        warnings.add(
            "the header has no column for {who} (cropped?); their links are read from their own rows only",
            label,
        )
    n_gpu_cols = sum(1 for label in labels[:n_cols] if _GPU_RE.fullmatch(label))
    in_header = [row for row in rows if row.label not in extra]
    # A terminal crop cuts every row at the same place; one short row alone is damage, not a crop.
    cropped = n_gpu_cols < n_cols and all(len(row.cells) == n_gpu_cols for row in in_header)
    by_label = {row.label: row for row in rows}
    matrix: list[list[str | None]] = [[None] * len(labels) for _ in labels]
    for r, label in enumerate(labels):
        row = by_label.get(label)
        if row is None:
            continue
        shown = len(row.cells)
        if shown > n_cols:
            raise ParseError(
                f"{label}: the row has {shown} cells but there are only {n_cols} rows to name the columns",
                row.line_no,
                hint,
            )
        if shown < n_cols and label not in extra:
            _check_short_row(row, n_cols, cropped, row is rows[-1], warnings, hint)
        for c, code in enumerate(row.cells):
            matrix[r][c] = code
    for label in labels:
        if label not in by_label:
            warnings.add("no row for {who}: the paste looks cut; their links are unknown", label)
    _check_symmetry(labels, matrix, warnings)
    _fill_from_mirror(labels, matrix, warnings)
    return matrix


def _fill_from_mirror(labels: Sequence[str], matrix: list[list[str | None]], warnings: _Warnings) -> None:
    """Fill cells a cut paste lost where the text still shows them: the matrix is symmetric (nvidia-smi
    prints the same path both ways), and a device's cell to itself is always ``X``. Says what was filled."""
    mirrored, diagonal = [], []
    for i, label in enumerate(labels):
        if matrix[i][i] is None:
            matrix[i][i] = "X"
            diagonal.append(label)
        for j in range(len(labels)):
            if i != j and matrix[i][j] is None and matrix[j][i] is not None:
                matrix[i][j] = matrix[j][i]
                mirrored.append(f"{label}/{labels[j]}")
    if mirrored:
        shown = ", ".join(mirrored[:4]) + (f" (and {len(mirrored) - 4} more)" if len(mirrored) > 4 else "")
        warnings.add(
            f"{len(mirrored)} cell(s) the text does not show were filled from their mirror, which it does "
            f"show (the matrix is symmetric): {shown}"
        )
    if diagonal:
        warnings.add(f"the self cell (X) of {_names(diagonal)} was not shown and was filled in")


def _devices(
    labels: Sequence[str],
    gpu_values: dict[str, dict[str, str]],
    nic_names: dict[str, str],
    warnings: _Warnings,
) -> tuple[list[Gpu], list[Nic]]:
    """GPUs and NICs in matrix order; a NIC label that is an RDMA name is its own name."""
    gpus: list[Gpu] = []
    nics: list[Nic] = []
    for label in labels:
        index = _gpu_index(label)
        if index is not None:
            values = gpu_values.get(label, {})
            gpus.append(
                Gpu(
                    index=index,
                    cpu_affinity=values.get(CPU),
                    numa_affinity=values.get(NUMA),
                    gpu_numa_id=values.get(GPU_NUMA),
                )
            )
        elif _NIC_RE.fullmatch(label):
            name = nic_names.get(label)
            if name is None:
                warnings.add("{who}: no NIC Legend entry, so the device name is unknown", label)
            nics.append(Nic(label=label, name=name))
        else:
            nics.append(Nic(label=label, name=label))
    return gpus, nics


def _check_short_row(
    row: _Row, n_cols: int, cropped: bool, is_last: bool, warnings: _Warnings, hint: str
) -> None:
    """Accept a row with fewer cells than the header only where the cause is clear, else refuse it.

    Clear causes: a terminal crop took the NIC columns from every row (GPU columns come first, so the
    cells shown are exactly the GPU columns); or the paste ends inside the last row.
    """
    shown = len(row.cells)
    if cropped:
        warnings.add(
            "{who}: the rows show only the GPU columns (cropped?); their NIC cells are unknown", row.label
        )
        return
    if is_last and not row.tail:
        warnings.add(
            f"{{who}}: the row is cut after {shown} of {n_cols} cells; the rest are unknown", row.label
        )
        row.cut = True
        return
    where = f" ('{row.tail[0].text}' stands where a link code belongs)" if row.tail else ""
    raise ParseError(
        f"{row.label}: the row has {shown} cells but the header has {n_cols} columns{where}",
        row.line_no,
        hint,
    )


def _check_symmetry(
    labels: Sequence[str], matrix: Sequence[Sequence[str | None]], warnings: _Warnings
) -> None:
    """Warn where a cell and its mirror disagree (every clean sample is symmetric)."""
    pairs = []
    for i in range(len(labels)):
        for j in range(i + 1, len(labels)):
            a, b = matrix[i][j], matrix[j][i]
            if a is not None and b is not None and a != b:
                pairs.append(f"{labels[i]}/{labels[j]} is {a} but {labels[j]}/{labels[i]} is {b}")
    if pairs:
        more = f" (and {len(pairs) - 3} more)" if len(pairs) > 3 else ""
        warnings.add(f"the matrix is not symmetric: {'; '.join(pairs[:3])}{more}; cells kept as printed")


def _check_affinity(values: dict[str, dict[str, str]], warnings: _Warnings) -> None:
    """Warn about affinity values a paste has visibly cut (``-31,64-95``, ``32-6``); keep them as printed.

    A CPU list that is the tail end of another GPU's list, cut inside a number (``2-63,96-127``
    beside ``32-63,96-127``), is flagged as possibly cut.
    """
    for key in (CPU, NUMA):
        column = {label: v[key] for label, v in values.items() if v.get(key) is not None}
        for label, value in column.items():
            if value == _NOT_APPLICABLE:
                continue
            if not _is_whole_list(value):
                warnings.add(
                    f"{{who}}: {_COLUMN_NAMES[key]} '{value}' looks cut by the paste; kept as printed", label
                )
            elif key == CPU and any(
                len(other) > len(value) and other.endswith(value) and other[-len(value) - 1].isdigit()
                for other in column.values()
            ):
                warnings.add(
                    f"{{who}}: {_COLUMN_NAMES[key]} '{value}' may be cut (another GPU shows a longer list "
                    "ending the same way); kept as printed",
                    label,
                )


def _nic_legend(lines: Sequence[_Line], warnings: _Warnings) -> dict[str, str]:
    """``NICk: name`` entries printed after the matrix (the first one wins if a NIC is named twice)."""
    names: dict[str, str] = {}
    for line in lines:
        m = _NIC_LEGEND_RE.fullmatch(line.text)
        if not m:
            continue
        label, name = m.groups()
        if label in names and names[label] != name:
            warnings.add(f"the NIC Legend names {label} twice; kept '{names[label]}'")
            continue
        names.setdefault(label, name)
    return names


def _note_other_matrices(lines: Sequence[_Line], warnings: _Warnings) -> None:
    """Warn when a second matrix follows the one that was read."""
    for i, line in enumerate(lines):
        header = _parse_header(line)
        if header is not None and _next_is_row(lines, i + 1, header.labels):
            warnings.add(f"another matrix starts at line {line.no}; only the first one was read")
            return


# --- topo -p2p ------------------------------------------------------------------------------------


def parse_p2p_text(text: str) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """Read saved ``nvidia-smi topo -p2p {r|w|n|a|p}`` output: ``(labels, cells)``.

    ``labels`` are the GPU labels as printed; ``cells[i][j]`` is the status code from GPU i to GPU j
    (``OK``, ``CNS``, ``GNS``, ``TNS``, ``NS``, ``DR``, ``U``), ``"X"`` on the diagonal. The matrix must
    be whole: any missing, extra or unknown cell raises ``ParseError`` naming the line.
    """
    lines = _prepare(text, "nvidia-smi topo -p2p r")
    hint = (
        _lookalike_hint(lines)
        or "check that the file is the output of `nvidia-smi topo -p2p r`, pasted whole"
    )
    for i, line in enumerate(lines):
        header = _parse_header(line)
        if header is None or not _next_is_row(lines, i + 1, header.labels):
            continue
        if header.tail or header.tail is None or not all(_GPU_RE.fullmatch(x) for x in header.labels):
            raise ParseError(
                "the header names more than GPUs; this looks like `nvidia-smi topo -m` output",
                line.no,
                "read it with --input as a topology, or save `nvidia-smi topo -p2p r` instead",
            )
        if len(set(header.labels)) != len(header.labels):
            raise ParseError("the header names a GPU twice", line.no, hint)
        return _read_p2p_rows(lines[i + 1 :], tuple(header.labels), hint)
    raise ParseError("no `nvidia-smi topo -p2p` matrix found (no header line such as 'GPU0 GPU1')", hint=hint)


def _read_p2p_rows(
    lines: Sequence[_Line], labels: tuple[str, ...], hint: str
) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """The rows under a ``-p2p`` header, checked to form a whole matrix."""
    rows: dict[str, tuple[str, ...]] = {}
    last_no = 0
    for line in lines:
        toks = [t.text for t in _tokens(line.text)]
        if not toks:
            continue
        if toks[0] not in labels:
            break
        label, cells = toks[0], toks[1:]
        last_no = line.no
        if label in rows:
            raise ParseError(f"{label}: a second row for the same GPU", line.no, hint)
        if len(cells) != len(labels):
            raise ParseError(
                f"{label}: the row has {len(cells)} cells but the header has {len(labels)} columns",
                line.no,
                hint,
            )
        out = []
        for col, cell in enumerate(cells):
            own = col == labels.index(label)
            if _is_self_like(cell) and own:
                out.append(_SELF)
            elif cell in _P2P_CODES and not own:
                out.append(cell)
            elif _is_code(cell) and not _is_self_like(cell):
                raise ParseError(
                    f"{label}: '{cell}' is a `topo -m` link code, not a P2P status",
                    line.no,
                    "this looks like `nvidia-smi topo -m` output; read it with --input as a topology",
                )
            else:
                expected = "the self cell X" if own else "a P2P status (OK, CNS, GNS, TNS, NS, DR, U)"
                raise ParseError(
                    f"{label}: expected {expected} in column {col + 1}, found '{cell}'", line.no, hint
                )
        rows[label] = tuple(out)
    missing = [label for label in labels if label not in rows]
    if missing:
        raise ParseError(f"no row for {_names(missing)}: the paste looks cut", last_no or None, hint)
    return labels, tuple(rows[label] for label in labels)
