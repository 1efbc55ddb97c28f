"""Property tests for the ``topo -m`` / ``-p2p`` parsers on damaged pastes.

Two promises are checked on random mutations of the captured pastes (plus two inline pastes, so the
properties run even without ``../shared``): the parsers raise nothing but ``ParseError``, and a paste
damaged in one place is refused, or warned about, or read with exactly its original cells. That second
property is what "never a silently wrong cell" means in practice.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import fixture_dir
from gputopo.errors import ParseError
from gputopo.model import Topology, is_link_code
from gputopo.topology.parse_smi import parse_p2p_text, parse_topo_text

INLINE_TOPO = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV4\tNODE\tSYS\tPIX\t0-31\t0\t\tN/A\n"
    "GPU1\tNV4\t X \tNODE\tSYS\tPIX\t0-31\t0\t\tN/A\n"
    "GPU2\tNODE\tNODE\t X \tSYS\tNODE\t0-31\t0\t\tN/A\n"
    "GPU3\tSYS\tSYS\tSYS\t X \tSYS\t32-63\t1\t\tN/A\n"
    "NIC0\tPIX\tPIX\tNODE\tSYS\t X \t\t\t\t\n"
    "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
    "\nNIC Legend:\n\n  NIC0: mlx5_0\n"
)
INLINE_P2P = " \tGPU0\tGPU1\tGPU2\t\n GPU0\tX\tOK\tCNS\t\n GPU1\tOK\tX\tGNS\t\n GPU2\tCNS\tGNS\tX\t\n"


def _texts(pattern: str) -> list[str]:
    root = fixture_dir()
    if root is None:
        return []
    return [path.read_text(encoding="utf-8") for path in sorted((root / "topo").glob(pattern))]


TOPO_TEXTS = [INLINE_TOPO, INLINE_TOPO.expandtabs(8), *_texts("*.txt"), *_texts("mp/*.txt")]
P2P_TEXTS = [INLINE_P2P, *_texts("p2p/*.txt")]
CLEAN = [(text, topo) for text in TOPO_TEXTS if not (topo := parse_topo_text(text)).warnings]

# Characters that matter to the parser, and some that only a broken paste brings.
PASTE_CHARS = "\t \n\r X0123456789-,/:GPUNICSYODEHBXVmlx_A[]<>&;" + "Χ×\x1b\u00a0\u200b\ufffd"
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def _damaged(draw: st.DrawFn, sources: list[str], max_steps: int = 5) -> str:
    """A paste from ``sources`` with up to ``max_steps`` kinds of damage applied in turn."""
    text = draw(st.sampled_from(sources))
    for step in draw(st.lists(st.integers(0, 9), min_size=1, max_size=max_steps)):
        text = _apply(draw, step, text)
    return text


def _apply(draw: st.DrawFn, step: int, text: str) -> str:
    lines = text.split("\n")
    if step == 0:  # delete a line
        del lines[draw(st.integers(0, len(lines) - 1))]
    elif step == 1:  # duplicate a line
        i = draw(st.integers(0, len(lines) - 1))
        lines.insert(i, lines[i])
    elif step == 2:  # swap two lines
        i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
    elif step == 3:  # delete a few characters
        i = draw(st.integers(0, len(text)))
        return text[:i] + text[i + draw(st.integers(1, 4)) :]
    elif step == 4:  # insert paste debris
        i = draw(st.integers(0, len(text)))
        return text[:i] + draw(st.text(PASTE_CHARS, min_size=1, max_size=4)) + text[i:]
    elif step == 5:  # insert anything at all
        i = draw(st.integers(0, len(text)))
        return text[:i] + draw(st.text(min_size=1, max_size=3)) + text[i:]
    elif step == 6:  # truncate
        return text[: draw(st.integers(0, len(text)))]
    elif step == 7:  # tabs lost, expanded, or squeezed
        return draw(st.sampled_from([text.expandtabs(8), text.replace("\t", " "), text.replace("\t", "")]))
    elif step == 8:  # indent everything, or switch to CRLF
        return draw(st.sampled_from(["".join("    " + x + "\n" for x in lines), text.replace("\n", "\r\n")]))
    else:  # a line's tokens hand-realigned in a different order
        i = draw(st.integers(0, len(lines) - 1))
        lines[i] = "  ".join(draw(st.permutations(lines[i].split())))
    return "\n".join(lines)


def _check_well_formed(topo: Topology) -> None:
    labels, cells = topo.matrix.labels, topo.matrix.cells
    assert len(set(labels)) == len(labels) and len(cells) == len(labels)
    for i, row in enumerate(cells):
        assert len(row) == len(labels)
        for j, cell in enumerate(row):
            assert cell is None or (is_link_code(cell) and (cell == "X") == (i == j)), (i, j, cell)
    assert [g.label for g in topo.gpus] == [x for x in labels if x.startswith("GPU")]
    assert len(topo.gpus) + len(topo.nics) == len(labels)


@FUZZ
@given(_damaged(TOPO_TEXTS))
def test_damaged_topo_pastes_raise_only_parse_error(text: str) -> None:
    try:
        topo = parse_topo_text(text)
    except ParseError as exc:
        assert exc.message and exc.hint
        return
    _check_well_formed(topo)


@FUZZ
@given(_damaged(P2P_TEXTS + TOPO_TEXTS[:2]))
def test_damaged_p2p_pastes_raise_only_parse_error(text: str) -> None:
    try:
        labels, cells = parse_p2p_text(text)
    except ParseError as exc:
        assert exc.message and exc.hint
        return
    assert all(len(row) == len(labels) for row in cells) and len(cells) == len(labels)
    assert all((cell == "X") == (i == j) for i, row in enumerate(cells) for j, cell in enumerate(row))


@FUZZ
@given(st.text(max_size=400))
def test_arbitrary_text_raises_only_parse_error(text: str) -> None:
    try:
        _check_well_formed(parse_topo_text(text))
    except ParseError as exc:
        assert exc.message
    try:
        labels, cells = parse_p2p_text(text)
    except ParseError as exc:
        assert exc.message
    else:
        assert len(cells) == len(labels)


@FUZZ
@given(st.data())
def test_one_damage_is_refused_or_warned_or_changes_no_cell(data: st.DataObject) -> None:
    original, expected = data.draw(st.sampled_from(CLEAN))
    step = data.draw(st.sampled_from([0, 1, 2, 3, 4, 7, 9]))
    text = _apply(data.draw, step, original)
    try:
        topo = parse_topo_text(text)
    except ParseError:
        return
    if topo.warnings:
        return
    assert set(topo.matrix.labels) == set(expected.matrix.labels)
    for a in topo.matrix.labels:
        for b in topo.matrix.labels:
            assert topo.matrix.code(a, b) == expected.matrix.code(a, b), (a, b)
