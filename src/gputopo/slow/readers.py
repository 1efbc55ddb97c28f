"""The three sources ``gputopo slow`` reads, each turned into ``judge.Series``.

NCCL Inspector (NVIDIA/nccl ``plugins/profiler/inspector``, at 5067397): the plugin writes one JSON
object per line into ``<NCCL_INSPECTOR_DUMP_DIR>/<hostname>-pid<pid>.log`` (``inspector.cc``,
``inspectorStateDumpJSON``). Each object (``inspector_json.cc``, ``inspectorCommInfoDumpColl``) is
``{"header": {...}, "metadata": {...}, "coll_perf": {...}}``:
- ``header`` (``inspectorCommInfoHeader``): ``id`` (the communicator's hash, ``0x%lx``: the identity;
  ``comm_name`` repeats across communicators and is "unknown" where NCCL has none), ``comm_name``, ``rank``
  (the rank in that communicator), ``n_ranks``, ``nnodes``;
- ``metadata`` (``inspectorCommInfoMetaHeader``): ``inspector_output_format_version`` ("v4.0"),
  ``dump_timestamp_us``, ``hostname`` (gethostname), ``pid`` (getpid);
- ``coll_perf`` (``inspectorCompletedColl``): ``coll`` (ncclFuncToString), ``coll_sn`` (counted per
  communicator), ``coll_msg_size_bytes``, ``coll_exec_time_us``, ``coll_timing_source``, ``coll_algobw_gbs``,
  ``coll_busbw_gbs`` (``coll_sn`` is the profiler's ``coll.seqNumber``: per communicator and function).
  Point-to-point lines carry ``p2p_perf`` instead and are not judged here.
A killed job leaves a truncated last line: skipped and counted.

Flight Recorder: each entry's ``process_group`` (name, desc), ``collective_seq_id`` and
``time_created_ns`` (torch 2.14's gloo recorder keeps no start or end times, only creation).

nccl-tests ``-J`` (NVIDIA/nccl-tests ``src/util.cu``, ``writeBenchmarkLineTerminator``, at a0b82b2): each
``results[]`` entry has ``size`` and ``out_of_place_per_iter``/``in_place_per_iter`` with
``per_process_max_times_us`` (one list of per-iteration times per process); ``config.devices[]``
(``writeDeviceReport`` writes it inside ``config``, one ``jsonRankInfo`` per process) names each
process's ``rank``, ``pid``, ``hostname`` and ``device``. The slow process is the one whose times are
longest, as ``tools/analyze_perf_json.py`` (``print_straggler``; ``node_groups`` reads
``data['config']['devices']``) reads them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path
from typing import Any

from gputopo.errors import InputError
from gputopo.inputs import read_capped
from gputopo.slow.judge import Series, mid, size_bucket

# An Inspector log of a long job is big: 10,000 operations are about 4.5 MB per rank.
MAX_INSPECTOR_BYTES = 512 * 1024 * 1024
MAX_NCCL_TESTS_BYTES = 64 * 1024 * 1024
INSPECTOR_SUFFIX = ".log"

# One operation's identity within its communicator, as written:
# b'"coll":"AllReduce","coll_sn":12,"coll_msg_size_bytes":4096'. Hashing it whole is cheaper than
# parsing it; its parts are read once per joined operation, not once per line.
_KEY = re.compile(rb'"coll":"([^"\\]*)","coll_sn":(\d+),"coll_msg_size_bytes":(\d+)')


@dataclass
class InspectorFile:
    """One process's records: its host and PID, its rank in each communicator (id -> (rank, n_ranks,
    comm_name)), and per communicator id each operation's execution time in us."""

    host: str
    pid: int
    comms: dict[bytes, tuple[int, int, str]] = field(default_factory=dict)
    execs: dict[bytes, dict[bytes, int]] = field(default_factory=dict)


@dataclass
class InspectorRead:
    files: list[InspectorFile] = field(default_factory=list)
    truncated: int = 0  # a last line cut short (a killed job)
    bad: int = 0  # other lines that are not an Inspector collective record
    p2p: int = 0
    versions: list[str] = field(default_factory=list)  # in the order first met

    @property
    def operations(self) -> int:
        return sum(len(d) for f in self.files for d in f.execs.values())


def looks_like_inspector(path: Path) -> bool:
    """A file whose first line is an Inspector record: a JSON object with ``header`` and ``metadata``
    (read only its first 16 KiB)."""
    try:
        with path.open("rb") as f:
            head = f.read(16384)
    except OSError:
        return False
    first = head.lstrip().split(b"\n", 1)[0]
    return first.startswith(b"{") and b'"header":' in first and b'"metadata":' in first


def inspector_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix == INSPECTOR_SUFFIX and looks_like_inspector(p)
    )


def read_inspector(paths: Iterable[Path]) -> InspectorRead:
    out = InspectorRead()
    for path in paths:
        parse_inspector(read_capped(path, str(path), MAX_INSPECTOR_BYTES, "split the log"), out)
    return out


# One pattern over the line shape the writer emits (inspector_json.cc, inspectorCommInfoDumpColl: header
# (inspectorCommInfoHeader), metadata (inspectorCommInfoMetaHeader), coll_perf (inspectorCompletedColl),
# compact: json.cc writes no spaces; one object per line), with a second branch that takes any other line
# whole: those (point-to-point lines, another version's order, another writer) are read with json.
# Groups: communicator id, the rest of the header, the operation's identity, its execution time; or the
# other line. The spans between are skipped by character classes (the fastest loops Python's re has):
# one regex pass over the bytes; a comm_name with a "}" in it takes the json branch.
_LINE = re.compile(
    rb'\{"header":\{"id":"([^"\\]*)"(,[^}]*)\},"metadata":\{[^}]*\},'
    rb'"coll_perf":\{("coll":"[^"\\]*","coll_sn":\d+,"coll_msg_size_bytes":\d+),"coll_exec_time_us":(\d+),'
    rb"[^\n]*\n"
    rb"|([^\n]*)\n"
)
# The first record's metadata: the file's format version, host and PID (a file is one process's,
# <hostname>-pid<pid>.log; checked by counting that host and PID on every line the pattern took).
_META = re.compile(
    rb'"metadata":\{"inspector_output_format_version":"([^"\\]*)",[^}]*?'
    rb'("hostname":"((?:[^"\\]|\\.)*)","pid":(\d+)\})'
)


def parse_inspector(data: bytes, out: InspectorRead) -> None:
    """One file's bytes into ``out``: each process's records grouped by communicator id."""
    cut = data.rfind(b"\n") + 1
    tail = data[cut:]
    if tail.strip():
        try:
            json.loads(tail)
            data = data + b"\n"
        except (ValueError, RecursionError):
            out.truncated += 1
            data = data[:cut]
    rows = _LINE.findall(data)
    if not rows:
        return
    cids, heads, keys, execs, others = zip(*rows, strict=True)
    n_fast = len(cids) - cids.count(b"")
    files: dict[tuple[str, int], InspectorFile] = {}
    meta = _META.search(data) if n_fast else None
    fast = False
    if meta is not None:
        version, needle, host_b, pid_b = meta.groups()
        fast = data.count(needle) - sum(o.count(needle) for o in others if o) == n_fast
    if fast and meta is not None:
        ident = (json.loads(b'"' + host_b + b'"'), int(pid_b))
        f = files[ident] = InspectorFile(*ident)
        v = version.decode("utf-8", "replace")
        if v not in out.versions:
            out.versions.append(v)
        whole = n_fast == len(cids)
        ints = list(map(int, execs)) if whole else [int(e) if e else 0 for e in execs]
        ids = dict.fromkeys(cids)
        ids.pop(b"", None)
        for cid in ids:
            hd = json.loads(b'{"id":"' + cid + b'"' + heads[cids.index(cid)] + b"}")
            f.comms[cid] = (int(hd["rank"]), int(hd["n_ranks"]), str(hd.get("comm_name") or cid.decode()))
            if len(ids) == 1 and whole:
                f.execs[cid] = dict(zip(keys, ints, strict=True))
            else:
                sel = list(map(cid.__eq__, cids))
                f.execs[cid] = dict(zip(compress(keys, sel), compress(ints, sel), strict=False))
    else:  # no line fits the writer's shape, or they are not all one process's: every line with json
        others = tuple(data.split(b"\n"))
    for line in others:
        if line and line.strip():
            _add_doc(line, out, files)
    out.files.extend(files.values())


def _add_doc(line: bytes, out: InspectorRead, files: dict[tuple[str, int], InspectorFile]) -> None:
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        out.bad += 1
        return
    try:
        head = doc["header"]
        meta = doc["metadata"]
        perf = doc.get("coll_perf")
        if perf is None:
            if "p2p_perf" in doc:
                out.p2p += 1
            else:
                out.bad += 1
            return
        ident = (str(meta["hostname"]), int(meta["pid"]))
        comm = str(head["id"]).encode()
        key = b'"coll":%s,"coll_sn":%d,"coll_msg_size_bytes":%d' % (
            json.dumps(str(perf["coll"])).encode(),
            int(perf["coll_sn"]),
            int(perf.get("coll_msg_size_bytes") or 0),
        )
        ex = int(float(perf["coll_exec_time_us"]))
        f = files.get(ident)
        if f is None:
            f = files[ident] = InspectorFile(*ident)
        if comm not in f.comms:
            name = str(head.get("comm_name") or comm.decode())
            f.comms[comm] = (int(head["rank"]), int(head["n_ranks"]), name)
            v = str(meta.get("inspector_output_format_version"))
            if v not in out.versions:
                out.versions.append(v)
        f.execs.setdefault(comm, {})[key] = ex
    except (KeyError, TypeError, ValueError, AttributeError):
        out.bad += 1


@dataclass
class Joined:
    series: list[Series]
    incomplete: int = 0  # operations some member of the communicator did not record (not judged)
    communicators: int = 0


def comm_labels(read: InspectorRead) -> dict[bytes, str]:
    """Communicator id -> what is shown: its ``comm_name``, with the id beside it where several
    communicators share the name (every tensor-parallel group may be ``mesh_tp``; NCCL writes
    "unknown" for one without a name)."""
    names: dict[bytes, str] = {}
    for f in read.files:
        for cid, (_r, _n, name) in f.comms.items():
            names.setdefault(cid, name)
    count: dict[str, int] = {}
    for name in names.values():
        count[name] = count.get(name, 0) + 1
    return {cid: (name if count[name] == 1 else f"{name} ({cid.decode()})") for cid, name in names.items()}


def inspector_series(read: InspectorRead, rank_of: Mapping[tuple[str, int], int]) -> Joined:
    """Join the members' records of each communicator instance (by its id, never its name; as the
    plugin's own exporter groups by ``id, coll_sn, coll_msg_size_bytes``) into series per function and
    size bucket, in ``coll_sn`` order (NCCL counts ``coll_sn`` per communicator and function). A sparse
    join: each communicator looks only at its own members' records. Lateness = the median member's
    execution time minus the rank's own; the operation's own time is the shortest execution.
    ``rank_of`` maps (hostname, pid) to the global rank."""
    members: dict[bytes, list[tuple[int, dict[bytes, int]]]] = {}
    for f in read.files:
        r = rank_of.get((f.host, f.pid))
        if r is None:
            continue
        for cid, d in f.execs.items():
            members.setdefault(cid, []).append((r, d))
    labels = comm_labels(read)
    out = Joined([], communicators=len(members))
    for cid in sorted(members):
        mem = sorted(members[cid], key=lambda m: m[0])
        ranks = tuple(r for r, _ in mem)
        dicts = [d for _, d in mem]
        driver = list(min(dicts, key=len))
        if all(len(d) == len(driver) for d in dicts) and all(list(d) == driver for d in dicts):
            # Every member recorded the same operations in the same order (the common case): their
            # values side by side, no lookup per record.
            table: Iterable[tuple[int | None, ...]] = zip(*(d.values() for d in dicts), strict=True)
        else:
            gets = [d.get for d in dicts]
            table = ([g(key) for g in gets] for key in driver)
        groups: dict[tuple[bytes, int], tuple[list[int], list[list[float]], list[float], list[float]]] = {}
        for key, vals in zip(driver, table, strict=True):
            if None in vals:
                out.incomplete += 1
                continue
            parts = _KEY.match(key)
            if parts is None:
                continue
            coll, sn, size = parts.groups()
            group = groups.get((coll, int(size).bit_length()))
            if group is None:
                group = groups[(coll, int(size).bit_length())] = ([], [], [], [])
            ordered = sorted(vals)
            n = len(ordered)
            h = n // 2
            med = ordered[h] if n % 2 else (ordered[h - 1] + ordered[h]) / 2.0
            group[0].append(int(sn))
            group[1].append([(med - v) * 0.001 for v in vals])
            group[2].append(ordered[0] * 0.001)
            group[3].append(sum(vals) * 0.001)
        comm = cid.decode("utf-8", "replace")
        for (coll, bucket), (sns, rows, opt, busy) in sorted(groups.items()):
            order = sorted(range(len(sns)), key=sns.__getitem__)
            out.series.append(
                Series(
                    comm=comm,
                    label=labels.get(cid, comm),
                    name=coll.decode("utf-8", "replace"),
                    bucket=bucket,
                    ranks=ranks,
                    rows=[rows[i] for i in order],
                    optime_ms=[opt[i] for i in order],
                    busy_ms=[busy[i] for i in order],
                )
            )
    return out


def inspector_world_ranks(read: InspectorRead) -> tuple[dict[tuple[str, int], int], bool]:
    """(hostname, pid) -> a global rank where no run record names them: the rank in the largest
    communicator every process is a member of (the job's world; the largest id among equals), else the
    processes' place in (hostname, pid) order. The flag says which: True for the world's ranks."""
    procs = sorted({(f.host, f.pid) for f in read.files})
    member_of: dict[bytes, set[tuple[str, int]]] = {}
    size: dict[bytes, int] = {}
    for f in read.files:
        for comm, (_r, n, _name) in f.comms.items():
            member_of.setdefault(comm, set()).add((f.host, f.pid))
            size[comm] = n
    whole = sorted((size[c], c) for c, m in member_of.items() if len(m) == len(procs))
    if whole:
        world = whole[-1][1]
        return {(f.host, f.pid): f.comms[world][0] for f in read.files if world in f.comms}, True
    return {p: i for i, p in enumerate(procs)}, False


def fr_series(
    entries_by_rank: Mapping[int, list[dict[str, Any]]], host_of: Mapping[int, str | None]
) -> list[Series]:
    """Series from Flight Recorder entries: one operation per (process group, collective sequence id),
    each rank's lateness its creation time minus the median member's *on the same host* (a host's ranks
    share one clock; different hosts' clocks are not aligned, so each host is judged on its own). The
    operation's time: from its earliest creation to the group's next operation's."""
    created: dict[tuple[str, str, int], dict[int, int]] = {}
    names: dict[tuple[str, str, int], str] = {}
    sizes: dict[tuple[str, str, int], int] = {}
    labels: dict[str, str] = {}
    for rank in sorted(entries_by_rank):
        host = host_of.get(rank) or "?"
        for e in entries_by_rank[rank]:
            if e.get("is_p2p"):
                continue
            seq = e.get("collective_seq_id")
            t = e.get("time_created_ns")
            pg = e.get("process_group")
            if (
                not isinstance(seq, int)
                or not isinstance(t, int)
                or not isinstance(pg, (list, tuple))
                or not pg
            ):
                continue
            key = (str(pg[0]), host, seq)
            created.setdefault(key, {})[rank] = t
            names.setdefault(key, str(e.get("profiling_name", "")).rpartition(":")[2] or "collective")
            sizes.setdefault(key, _fr_size(e))
            if len(pg) > 1 and isinstance(pg[1], str) and pg[1] and pg[1] != str(pg[0]):
                labels.setdefault(str(pg[0]), f"{pg[1]} ({pg[0]})")
    earliest_by_comm: dict[tuple[str, str], dict[int, int]] = {}
    for (pg, host, seq), ts in created.items():
        earliest_by_comm.setdefault((pg, host), {})[seq] = min(ts.values())
    gaps: dict[tuple[str, str, int], float] = {}
    for comm, by_seq in earliest_by_comm.items():
        seqs = sorted(by_seq)
        diffs = [(by_seq[b] - by_seq[a]) / 1e6 for a, b in zip(seqs, seqs[1:], strict=False) if b == a + 1]
        typical = mid(diffs) if diffs else 0.0
        for a in seqs:
            nxt = by_seq.get(a + 1)
            gaps[(*comm, a)] = (nxt - by_seq[a]) / 1e6 if nxt is not None else typical
    groups: dict[tuple[str, str, str, int, tuple[int, ...]], list[tuple[int, list[float], float, float]]] = {}
    for key in sorted(created):
        ts = created[key]
        pg, host, seq = key
        ranks = tuple(sorted(ts))
        med = mid([ts[r] for r in ranks])
        duration = max(gaps.get(key, 0.0), 0.0)
        groups.setdefault((pg, host, names[key], size_bucket(sizes[key]), ranks), []).append(
            (seq, [(ts[r] - med) / 1e6 for r in ranks], duration, duration * len(ts))
        )
    out = []
    for (pg, host, name, bucket, ranks), ops in groups.items():
        comm = pg if host == "?" else f"{pg}@{host}"
        label = labels.get(pg, pg)
        out.append(
            Series(
                comm=comm,
                label=label if host == "?" else f"{label}@{host}",
                name=name,
                bucket=bucket,
                ranks=ranks,
                rows=[o[1] for o in ops],
                optime_ms=[o[2] for o in ops],
                busy_ms=[o[3] for o in ops],
            )
        )
    return out


def _fr_size(e: dict[str, Any]) -> int:
    sizes = e.get("input_sizes") or []
    n = 0
    for shape in sizes if isinstance(sizes, list) else []:
        if isinstance(shape, list):
            count = 1
            for d in shape:
                count *= d if isinstance(d, int) else 1
            n += count
    return n


@dataclass
class NcclTestsProcess:
    index: int
    host: str | None
    pid: int | None
    device: int | None
    avg_us: float
    lateness_us: float  # the median over iterations of (its time - the iteration's median process time)


@dataclass
class NcclTestsSize:
    size: int
    processes: list[NcclTestsProcess]
    median_us: float  # the median over iterations of the iteration's median process time


def looks_like_nccl_tests(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("results"), list) and "config" in doc


def nccl_tests_devices(doc: dict[str, Any]) -> list[Any]:
    """The processes' devices: ``config.devices`` as nccl-tests writes them (``src/util.cu``,
    ``writeDeviceReport`` writes ``devices`` inside ``config``, one ``jsonRankInfo`` per process; NVIDIA's
    ``tools/analyze_perf_json.py`` reads ``data['config']['devices']``), else a top-level ``devices``."""
    config = doc.get("config")
    devices = config.get("devices") if isinstance(config, dict) else None
    if not isinstance(devices, list):
        devices = doc.get("devices")
    return devices if isinstance(devices, list) else []


def read_nccl_tests(path: Path) -> tuple[list[NcclTestsSize], dict[str, Any]]:
    """Per message size, each process's lateness: its row of ``per_process_max_times_us`` (out-of-place,
    else in-place) minus the per-iteration median row, the median over iterations (a single spike does
    not decide). ``analyze_perf_json.print_straggler`` compares the processes' mean times the same way."""
    doc = load_json_file(path, MAX_NCCL_TESTS_BYTES)
    if not looks_like_nccl_tests(doc):
        raise InputError(f"{path}: not an nccl-tests -J file (no results/config)", _HINT)
    devices = nccl_tests_devices(doc)
    sizes = []
    for r in doc["results"]:
        if not isinstance(r, dict):
            continue
        per = r.get("out_of_place_per_iter") or r.get("in_place_per_iter") or {}
        rows = per.get("per_process_max_times_us") if isinstance(per, dict) else None
        if not isinstance(rows, list) or len(rows) < 2:
            continue
        clean = [
            [float(t) for t in times if isinstance(t, (int, float)) and not isinstance(t, bool)]
            if isinstance(times, list)
            else []
            for times in rows
        ]
        idx = [i for i, vals in enumerate(clean) if vals]
        if len(idx) < 2:
            continue
        n_iter = min(len(clean[i]) for i in idx)
        iter_med = [mid([clean[i][t] for i in idx]) for t in range(n_iter)]
        procs = []
        for i in idx:
            vals = clean[i]
            dev = devices[i] if len(devices) == len(rows) and isinstance(devices[i], dict) else {}
            procs.append(
                NcclTestsProcess(
                    index=i,
                    host=dev.get("hostname") if isinstance(dev.get("hostname"), str) else None,
                    pid=dev.get("pid") if isinstance(dev.get("pid"), int) else None,
                    device=dev.get("device") if isinstance(dev.get("device"), int) else None,
                    avg_us=sum(vals) / len(vals),
                    lateness_us=mid([vals[t] - iter_med[t] for t in range(n_iter)]),
                )
            )
        sizes.append(NcclTestsSize(size=int(r.get("size") or 0), processes=procs, median_us=mid(iter_med)))
    return sizes, doc


_HINT = (
    "give a run folder, an Inspector dump folder (NCCL_INSPECTOR_DUMP_DIR), Flight Recorder dumps, "
    "or an nccl-tests -J file"
)


def load_json_file(path: Path, cap: int) -> Any:
    from gputopo.inputs import parse_json

    return parse_json(read_capped(path, str(path), cap), str(path), _HINT)
