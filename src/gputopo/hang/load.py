"""Finding Flight Recorder dumps and loading them without running anything they contain.

A pickle can run code when loaded (``REDUCE`` on any importable callable). torch's dumps hold only plain
containers and scalars: checked on real dumps of torch 2.14.1 (``_dump_fr_trace``, gloo ranks), whose
opcodes are all of PROTO, EMPTY_DICT/LIST, MARK, SETITEMS, APPENDS, BINUNICODE, BININT*, LONG1, TUPLE2,
NEWTRUE/NEWFALSE, NONE, BINPUT/BINGET, STOP; no GLOBAL, REDUCE or BUILD. (torch writes them with its own
pickler over ``c10::IValue`` dicts, lists, strings, ints, doubles, bools and tuples: FlightRecorder.cpp,
``getCollectiveTrace``/``dump``.) So the unpickler here resolves no global at all: every class, function
and extension code is refused, which leaves dict, list, tuple, set, str, bytes, int, float, bool and None.
JSON dumps (``_dump_fr_trace_json``) are read with ``json`` and preferred when both exist for a rank.

A dump that is truncated, corrupt, too big or not a dump at all is named and skipped; a pickle that asks
for a class is refused outright (``UnsafeDumpError``, exit 2): nothing it names is imported or called.
"""

from __future__ import annotations

import gc
import io
import json
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputopo.errors import InputError

# A rank's dump with 2000 entries and their stacks is about 1 MiB as pickle; 256 MiB is far beyond any
# real one and still loads in seconds. Bigger files are named and skipped, never read.
MAX_DUMP_BYTES = 256 * 1024 * 1024

# No job has a million ranks; a larger rank number (in a file name or a dump's group record) is damage,
# and believing it would make a world of that many ranks.
MAX_RANKS = 1 << 20

# torch names the default dumps TORCH_FR_DUMP_TEMP_FILE<rank> (and its loader takes the trailing digits
# as the rank: torch/distributed/flight_recorder/components/loader.py, read_dump); JSON dumps are named
# by whoever wrote them, so ``<prefix><rank>.json`` is accepted too.
_DUMP_NAME = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)(?P<ext>\.json|\.pkl|\.pickle)?$")
# Files gputopo itself writes beside the dumps.
_NOT_DUMPS = re.compile(r"^(gputopo-|run-record|ras|stacks-|\.)", re.IGNORECASE)


# pg name -> (desc, collective_seq_id -> the entries with that id), collectives only
GroupIndex = dict[str, tuple[str, dict[int, list[dict[str, Any]]]]]
# pg name -> that group's point-to-point entries (``is_p2p``), in the order recorded
P2pIndex = dict[str, list[dict[str, Any]]]

# What loading may cost in memory, as a multiple of the file's size (plus a floor for small files): a
# real dump holds about one container per 16-50 bytes and loads to about 5x its size (measured on
# torch 2.14 gloo dumps, pickle and JSON); a crafted one of nothing but empty lists (``]]]]``, ``[[[[``)
# would load to 30-60x. Each container or short string costs a Python object of 50-70 bytes, so the
# count of their opening bytes bounds the memory before anything is parsed.
MEMORY_FACTOR = 10
MEMORY_FLOOR = 1 << 20
_OBJECT_BYTES = 64
# How deep a dump's values may nest: an entry's sizes are lists of int lists, its frames a list of dicts.
MAX_DEPTH = 3


class UnsafeDumpError(InputError):
    """A pickle that asks to import or call something: refused, nothing in it ran (exit 2)."""


class CraftedDumpError(InputError):
    """A file built to cost memory or nest without end, not a dump torch wrote (exit 2)."""


@dataclass(frozen=True)
class Dump:
    """One rank's Flight Recorder dump, as torch wrote it (entries are torch's own dicts)."""

    rank: int
    path: Path
    format: str  # "pickle" | "json"
    version: str
    comm_lib_version: str | None
    pg_config: dict[str, Any]
    pg_status: dict[str, Any]
    entries: list[dict[str, Any]]
    groups: GroupIndex = field(default_factory=dict)  # index_entries(entries)
    p2p: P2pIndex = field(default_factory=dict)  # point-to-point entries by group name
    host: str | None = None  # torch 2.14's dumps carry neither; kept for dumps that do
    pid: int | None = None

    @property
    def has_stacks(self) -> bool:
        """Whether the entries carry Python stacks (pickle dumps do, JSON dumps do not)."""
        return any("frames" in e for e in self.entries[-1:])


@dataclass(frozen=True)
class Skipped:
    """A file that looked like a dump and could not be used, and why (in words)."""

    path: Path
    rank: int | None
    why: str


@dataclass(frozen=True)
class Loaded:
    """Every usable dump (one per rank, by rank) and every skipped file."""

    dumps: tuple[Dump, ...]
    skipped: tuple[Skipped, ...] = ()
    notes: tuple[str, ...] = field(default=())


class _PlainUnpickler(pickle.Unpickler):
    """Resolves no global: the C unpickler asks ``find_class`` for every class, function and extension
    code (GLOBAL, STACK_GLOBAL, INST, EXT*), so refusing here refuses all of them before any is imported."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


class _Refused(Exception):
    pass


def safe_loads(data: bytes, path: Path) -> Any:
    """Unpickle ``data`` admitting only plain containers and scalars.

    Raises ``UnsafeDumpError`` naming ``path`` and what was asked for; ``pickle.UnpicklingError``,
    ``EOFError`` and friends for a truncated or corrupt file."""
    try:
        # BufferedReader, not a bare BytesIO: the C unpickler prefetches through ``peek``, which BytesIO
        # lacks; without it every opcode is a read() call and loading is 8x slower (measured).
        return _PlainUnpickler(io.BufferedReader(io.BytesIO(data), buffer_size=1 << 20)).load()
    except _Refused as exc:
        raise UnsafeDumpError(
            f"{path}: the pickle asks for {exc} (a Flight Recorder dump holds only plain data): refused, "
            "nothing in it was run",
            "dumps from torch never contain classes; where did this file come from? "
            "Prefer JSON dumps (torch._C._distributed_c10d._dump_fr_trace_json)",
        ) from None


def find_dump_files(spec: Path) -> list[tuple[int, Path]]:
    """(rank, path) for every dump ``spec`` names: a folder (its files named ``<prefix><rank>``, not
    searched recursively) or a file prefix (``/tmp/trace_rank_`` -> ``/tmp/trace_rank_0``, ...), or one
    dump file. Raises ``InputError`` when ``spec`` names nothing."""
    if spec.is_dir():
        candidates = sorted(p for p in spec.iterdir() if p.is_file())
        prefix = None
    elif spec.is_file():
        m = _DUMP_NAME.match(spec.name)
        if m is None:
            raise InputError(
                f"{spec}: the file name does not end in a rank number",
                "Flight Recorder dumps are named <prefix><rank> (TORCH_FR_DUMP_TEMP_FILE<rank>)",
            )
        return [(int(m["rank"]), spec)]
    else:
        parent = spec.parent if str(spec.parent) else Path(".")
        if not parent.is_dir():
            raise InputError(f"{spec}: no such folder or file prefix", "give the dump folder or prefix")
        prefix = spec.name
        candidates = sorted(p for p in parent.iterdir() if p.is_file() and p.name.startswith(prefix))
        if not candidates:
            # Neither a path nor the prefix of any file: a typo, bad input (exit 2), not "no dumps".
            raise InputError(
                f"{spec}: no such folder, file or file prefix",
                "give the run folder (gputopo run prints it) or a dump prefix such as /tmp/trace_rank_",
            )
    found: list[tuple[int, Path]] = []
    for p in candidates:
        if _NOT_DUMPS.match(p.name) and prefix is None:
            continue
        m = _DUMP_NAME.match(p.name)
        if m is None or (prefix is not None and m["prefix"] != prefix) or int(m["rank"]) >= MAX_RANKS:
            continue
        found.append((int(m["rank"]), p))
    return found


def load_dumps(specs: list[Path], max_bytes: int = MAX_DUMP_BYTES) -> Loaded:
    """Every dump the ``specs`` name, loaded safely; one per rank (JSON preferred over pickle)."""
    by_rank: dict[int, list[Path]] = {}
    for spec in specs:
        for rank, path in find_dump_files(spec):
            if path not in by_rank.setdefault(rank, []):
                by_rank[rank].append(path)
    if not by_rank:
        raise NothingToAnalyse(
            f"{', '.join(str(s) for s in specs)}: no Flight Recorder dumps (files named <prefix><rank>)",
            "dumps appear on a watchdog timeout with TORCH_NCCL_DUMP_ON_TIMEOUT=1 and TORCH_FR_BUFFER_SIZE "
            "set (`gputopo run` sets both), at TORCH_FR_DUMP_TEMP_FILE<rank>",
        )
    dumps: list[Dump] = []
    skipped: list[Skipped] = []
    notes: list[str] = []
    with paused_gc():
        for rank in sorted(by_rank):
            result = load_one(rank, _choose(rank, by_rank[rank], notes), max_bytes)
            if isinstance(result, Skipped):
                skipped.append(result)
            else:
                dumps.append(result)
    versions = {d.version for d in dumps}
    if len(versions) > 1:
        groups = {v: [d.rank for d in dumps if d.version == v] for v in sorted(versions)}
        said = "; ".join(f"{v}: ranks {_ranks(rs)}" for v, rs in groups.items())
        raise InputError(
            f"the dumps come from different Flight Recorder versions ({said})",
            "they are from different jobs or torch installs; give the folder of one job",
        )
    return Loaded(tuple(dumps), tuple(skipped), tuple(notes))


class NothingToAnalyse(InputError):
    """No dump at all where the user pointed (exit 3)."""

    exit_code = 3


def _choose(rank: int, paths: list[Path], notes: list[str]) -> Path:
    if len(paths) == 1:
        return paths[0]
    json_paths = [p for p in paths if p.suffix == ".json"]
    others = [p for p in paths if p.suffix != ".json"]
    if len(json_paths) == 1 and len(others) == 1:
        notes.append(f"rank {rank}: both {json_paths[0].name} and {others[0].name}; read the JSON one")
        return json_paths[0]
    raise InputError(
        f"rank {rank} has several dumps: {', '.join(str(p) for p in paths)}",
        "give the folder or prefix of one job's dumps",
    )


def load_one(rank: int, path: Path, max_bytes: int = MAX_DUMP_BYTES) -> Dump | Skipped:
    """One dump, or why it was skipped. Raises ``UnsafeDumpError`` for a pickle that names a class."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            return Skipped(path, rank, f"{size / 2**20:.0f} MiB, over the {max_bytes / 2**20:.0f} MiB cap")
        data = path.read_bytes()
    except OSError as exc:
        return Skipped(path, rank, f"cannot read ({exc.strerror or exc})")
    if not data:
        return Skipped(path, rank, "empty file (the rank died while dumping?)")
    is_json = path.suffix == ".json" or data[:1] in (b"{", b"[")
    check_budget(data, is_json, path)
    try:
        doc = json.loads(data) if is_json else safe_loads(data, path)
    except UnsafeDumpError:
        raise
    except RecursionError:
        raise _crafted(path, "nests deeper than Python's parser goes") from None
    except json.JSONDecodeError as exc:
        return Skipped(path, rank, f"not valid JSON (truncated?) at byte {exc.pos}")
    except Exception as exc:  # noqa: BLE001 -- any way a damaged file fails to load means: skip it, say why
        what = "truncated" if isinstance(exc, EOFError) or "truncated" in str(exc) else "corrupt"
        kind = "JSON" if is_json else "pickle"
        return Skipped(path, rank, f"{what} {kind} ({type(exc).__name__}: {str(exc)[:80]})")
    return _as_dump(rank, path, "json" if is_json else "pickle", doc)


def check_budget(data: bytes, is_json: bool, path: Path) -> None:
    """Refuse, before parsing, a file whose objects would cost more than ``MEMORY_FACTOR`` times its size:
    every container and short string is a Python object of 50-70 bytes, and its opening byte is counted
    (in a pickle: EMPTY_LIST/DICT/TUPLE, MARK, TUPLE1-3 and SHORT_BINUNICODE; a string that happens to
    hold those bytes only makes the count larger, so a real dump passes with room to spare)."""
    # one pass in C: the bytes left after deleting the counted ones
    opening = b"[{" if is_json else b"]})(\x85\x86\x87\x8c"
    objects = len(data) - len(data.translate(None, opening))
    if objects * _OBJECT_BYTES > MEMORY_FACTOR * len(data) + MEMORY_FLOOR:
        raise _crafted(
            path,
            f"holds about {objects} containers in {len(data)} bytes (would take about "
            f"{objects * _OBJECT_BYTES // 2**20} MiB to load; a dump torch wrote has one per 16 bytes "
            "or more)",
        )


def _crafted(path: Path, why: str) -> CraftedDumpError:
    return CraftedDumpError(
        f"{path}: not a Flight Recorder dump: it {why}; refused",
        "dumps come from torch's writer (TORCH_FR_DUMP_TEMP_FILE<rank>); where did this file come from?",
    )


def _as_dump(rank: int, path: Path, fmt: str, doc: Any) -> Dump | Skipped:
    if not isinstance(doc, dict):
        return Skipped(path, rank, "not a Flight Recorder dump (not a dict)")
    entries = doc.get("entries")
    if entries is None and ("version" in doc or "pg_config" in doc):
        # torch's JSON writer leaves 'entries' out when the buffer is empty (FlightRecorderDetail.hpp,
        # dump_json: ``if (!entries.empty()) result[entries_key_str] = entries;``): a rank that recorded
        # nothing, whose dump says "never entered", not "no dump".
        entries = []
    if not isinstance(entries, list):
        return Skipped(path, rank, "not a Flight Recorder dump (no 'entries' list)")
    pg_config = doc.get("pg_config") if isinstance(doc.get("pg_config"), dict) else {}
    pg_status = doc.get("pg_status") if isinstance(doc.get("pg_status"), dict) else {}
    if not _flat_tables(pg_config) or not _flat_tables(pg_status):
        raise _crafted(path, "nests its pg_config or pg_status deeper than torch writes them")
    indexed = index_entries(entries, path)
    if indexed is None:
        return Skipped(path, rank, "not a Flight Recorder dump (an entry lacks its group or sequence id)")
    groups, p2p = indexed
    host = doc.get("hostname") or doc.get("host_name")
    pid = doc.get("pid")
    return Dump(
        rank=rank,
        path=path,
        format=fmt,
        version=str(doc.get("version", "")),
        comm_lib_version=doc.get("comm_lib_version")
        if isinstance(doc.get("comm_lib_version"), str)
        else None,
        pg_config=pg_config,
        pg_status=pg_status,
        entries=entries,
        groups=groups,
        p2p=p2p,
        host=host if isinstance(host, str) else None,
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
    )


def _flat_tables(table: dict[Any, Any]) -> bool:
    """pg_config / pg_status: a dict of dicts of scalars, as torch writes them."""
    for v in table.values():
        if not isinstance(v, dict):
            return False
        for x in v.values():
            if isinstance(x, (list, dict, tuple, set)):
                return False
    return True


_SCALARS = (str, int, float, bool, type(None))


def _shallow(e: dict[str, Any]) -> bool:
    """Whether the fields the matching compares nest no deeper than torch writes them: sizes are lists of
    int lists, dtypes lists of names (comparing or showing a deeper value recurses; a crafted one could
    recurse without end). Frames are checked where they are read (``match._frames``): only the stuck
    calls' frames are."""
    for key in ("input_sizes", "output_sizes"):
        v = e.get(key)
        if v is not None and not (
            v.__class__ is list and all(t.__class__ is list and all(x.__class__ is int for x in t) for t in v)
        ):
            return False
    for key in ("input_dtypes", "output_dtypes"):
        v = e.get(key)
        if v is not None and not (v.__class__ is list and all(x.__class__ is str for x in v)):
            return False
    return True


def deep_entry(dumps: Any) -> Dump | None:
    """The first dump with an entry nested deeper than torch writes one (``_shallow``), or ``None``. Run
    only when the matching met a recursion or an unhashable value (``match.match_dumps``), so the
    common path pays nothing for it."""
    for d in dumps:
        for e in d.entries:
            if not _shallow(e):
                return d
    return None


def shallow_entry(e: dict[str, Any]) -> bool:
    return _shallow(e)


def crafted_entry(d: Dump) -> CraftedDumpError:
    return _crafted(d.path, "has an entry nested deeper than torch writes one")


def index_entries(entries: list[Any], path: Path | None = None) -> tuple[GroupIndex, P2pIndex] | None:
    """The collectives by group and sequence id, and the point-to-point entries by group, or ``None``
    when an entry lacks what the matching cannot do without: a ``(name, desc)`` group and an integer
    sequence id. One pass, since a job's dumps hold 100 000s of entries; an entry nested deeper than
    torch writes one is found by the matching (``deep_entry``)."""
    out: GroupIndex = {}
    p2p: P2pIndex = {}
    try:
        for e in entries:
            name, desc = e["process_group"]
            if e.get("is_p2p"):
                if name.__class__ is not str:
                    return None
                p2p.setdefault(name, []).append(e)
                continue
            seq = e["collective_seq_id"]
            if seq.__class__ is not int or name.__class__ is not str:
                return None
            slot = out.get(name)
            if slot is None:
                slot = out[name] = (str(desc), {})
            same = slot[1].get(seq)
            if same is None:
                slot[1][seq] = [e]
            else:
                same.append(e)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return out, p2p


def make_dump(
    rank: int,
    path: Path,
    entries: list[dict[str, Any]],
    pg_config: dict[str, Any] | None = None,
    pg_status: dict[str, Any] | None = None,
    fmt: str = "pickle",
    version: str = "2.10",
) -> Dump:
    """A ``Dump`` of entries already in memory (tests, torch's control plane), indexed as a file's is."""
    indexed = index_entries(entries, path)
    if indexed is None:
        raise InputError(f"{path}: an entry lacks its group or sequence id", "give torch's own dump")
    return Dump(rank, path, fmt, version, None, pg_config or {}, pg_status or {}, entries, *indexed)


@contextmanager
def paused_gc(freeze: bool = False) -> Iterator[None]:
    """No garbage collection while 100 000s of dicts are made and kept: each collection would walk
    them all again (torch's own loader does the same, flight_recorder/components/loader.py). With
    ``freeze``, what was made is moved out of the collector's sight before it runs again (``gc.freeze``:
    for a process that exits after the report; dumps hold no reference cycles)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was:
            gc.enable()


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks)
