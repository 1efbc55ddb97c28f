"""The three sources ``gputopo slow`` reads, each turned into ``judge.Op``s.

NCCL Inspector (NVIDIA/nccl ``plugins/profiler/inspector``, at 5067397): the plugin writes one JSON
object per line into ``<NCCL_INSPECTOR_DUMP_DIR>/<hostname>-pid<pid>.log`` (``inspector.cc``,
``inspectorStateDumpJSON``). Each object (``inspector_json.cc``, ``inspectorCommInfoDumpColl``) is
``{"header": {...}, "metadata": {...}, "coll_perf": {...}}``:
- ``header`` (``inspectorCommInfoHeader``): ``id`` (the communicator's hash), ``comm_name``, ``rank``
  (the rank in that communicator), ``n_ranks``, ``nnodes``;
- ``metadata`` (``inspectorCommInfoMetaHeader``): ``inspector_output_format_version`` ("v4.0"),
  ``dump_timestamp_us``, ``hostname`` (gethostname), ``pid`` (getpid);
- ``coll_perf`` (``inspectorCompletedColl``): ``coll`` (ncclFuncToString), ``coll_sn`` (counted per
  communicator), ``coll_msg_size_bytes``, ``coll_exec_time_us``, ``coll_timing_source``, ``coll_algobw_gbs``,
  ``coll_busbw_gbs``. Point-to-point lines carry ``p2p_perf`` instead and are not judged here.
A killed job leaves a truncated last line: skipped and counted.

Flight Recorder: each entry's ``process_group`` (name, desc), ``collective_seq_id`` and
``time_created_ns`` (torch 2.14's gloo recorder keeps no start or end times, only creation).

nccl-tests ``-J`` (NVIDIA/nccl-tests ``src/util.cu``, ``writeBenchmarkLineTerminator``, at a0b82b2): each
``results[]`` entry has ``size`` and ``out_of_place_per_iter``/``in_place_per_iter`` with
``per_process_max_times_us`` (one list of per-iteration times per process); ``devices[]``
(``jsonRankInfo``) names each process's ``rank``, ``pid``, ``hostname`` and ``device``. The slow process
is the one whose times are longest, as ``tools/analyze_perf_json.py`` (``print_straggler``) reads them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from gputopo.errors import InputError
from gputopo.inputs import read_capped
from gputopo.slow.judge import Op

# An Inspector log of a long job is big: 10,000 operations are about 3.5 MB per rank.
MAX_INSPECTOR_BYTES = 512 * 1024 * 1024
MAX_NCCL_TESTS_BYTES = 64 * 1024 * 1024
INSPECTOR_SUFFIX = ".log"


# (communicator id, b'"coll":"AllReduce","coll_sn":12,"coll_msg_size_bytes":4096'), as written: one
# operation's identity; its parts are read once per operation, not once per line.
OpKey = tuple[bytes, bytes]
_KEY = re.compile(rb'"coll":"([^"\\]*)","coll_sn":(\d+),"coll_msg_size_bytes":(\d+)')


@dataclass
class InspectorFile:
    """One process's Inspector log: its host and PID, its rank in each communicator (id -> (rank,
    n_ranks, comm_name)), and each operation's execution time in us."""

    host: str
    pid: int
    comms: dict[bytes, tuple[int, int, str]] = field(default_factory=dict)
    execs: dict[OpKey, int] = field(default_factory=dict)


@dataclass
class InspectorRead:
    files: list[InspectorFile] = field(default_factory=list)
    truncated: int = 0  # a last line cut short (a killed job)
    bad: int = 0  # other lines that are not an Inspector collective record
    p2p: int = 0
    versions: set[str] = field(default_factory=set)

    @property
    def operations(self) -> int:
        return sum(len(f.execs) for f in self.files)


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
        _parse_inspector(read_capped(path, str(path), MAX_INSPECTOR_BYTES, "split the log"), out)
    return out


# The writer's own order (inspector_json.cc: inspectorCommInfoHeader, inspectorCommInfoMetaHeader,
# inspectorCompletedColl; compact, json.cc writes no spaces). A file the plugin wrote is one process's
# (<hostname>-pid<pid>.log), so its metadata is the same on every line and is read once, and so is each
# communicator's header. A file this pattern does not account for line by line (another version's
# order, another writer) is read with json instead: slower, same answer.
_HEAD = re.compile(rb'\{"header":\{"id":"([^"\\]*)"')
_PERF = re.compile(
    rb'"coll_perf":\{("coll":"[^"\\]*","coll_sn":\d+,"coll_msg_size_bytes":\d+),"coll_exec_time_us":(\d+)[,}]'
)
_ONE_HEAD = rb'\{"header":\{"id":"%s"(,[^{}]*)\},"metadata":\{[^{}]*\},"coll_perf"'
_META = re.compile(
    rb'"metadata":\{"inspector_output_format_version":"([^"\\]*)",[^{}]*"hostname":"((?:[^"\\]|\\.)*)",'
    rb'"pid":(\d+)\}'
)


def _parse_inspector(data: bytes, out: InspectorRead) -> None:
    cut = data.rfind(b"\n") + 1
    tail = data[cut:]
    if tail.strip():
        try:
            json.loads(tail)
            data = data + b"\n"
        except (ValueError, RecursionError):
            out.truncated += 1
            data = data[:cut]
    if not data.strip():
        return
    n_lines = sum(1 for line in data.split(b"\n") if line.strip()) if b"\n\n" in data else data.count(b"\n")
    if _fast(data, n_lines, out):
        return
    files: dict[tuple[str, int], InspectorFile] = {}
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError):
            out.bad += 1
            continue
        _add_doc(doc, out, files)
    out.files.extend(files.values())


def _fast(data: bytes, n_lines: int, out: InspectorRead) -> bool:
    first_end = data.find(b"\n")
    meta = _META.search(data, 0, first_end)
    if meta is None or data.count(b'"p2p_perf":'):
        return False  # point-to-point lines interleave with the collectives': line by line
    version, host_b, pid_b = meta.groups()
    # One process per file (the plugin names it <hostname>-pid<pid>.log): its first and last lines agree.
    last = data.rfind(b"\n", 0, len(data) - 1) + 1
    if data.find(b'"hostname":"' + host_b + b'","pid":' + pid_b + b"}", last) < 0:
        return False
    perf = _PERF.findall(data)
    if len(perf) != n_lines:
        return False
    ids = _HEAD.findall(data)
    if len(ids) != n_lines:
        return False
    f = InspectorFile(host=json.loads(b'"' + host_b + b'"'), pid=int(pid_b))
    if perf:
        keys, execs = zip(*perf, strict=True)
        for comm in set(ids):
            m = re.search(_ONE_HEAD % re.escape(comm), data)
            if m is None:
                return False
            head = json.loads(b'{"id":"' + comm + b'"' + m.group(1) + b"}")
            f.comms[comm] = (
                int(head["rank"]),
                int(head["n_ranks"]),
                str(head.get("comm_name") or comm.decode()),
            )
        f.execs = dict(zip(zip(ids, keys, strict=True), map(int, execs), strict=True))
    out.versions.add(version.decode("utf-8", "replace"))
    out.files.append(f)
    return True


def _add_doc(doc: Any, out: InspectorRead, files: dict[tuple[str, int], InspectorFile]) -> None:
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
        out.versions.add(str(meta.get("inspector_output_format_version")))
        proc = (str(meta["hostname"]), int(meta["pid"]))
        f = files.setdefault(proc, InspectorFile(*proc))
        comm = str(head["id"]).encode()
        f.comms[comm] = (int(head["rank"]), int(head["n_ranks"]), str(head.get("comm_name") or head["id"]))
        ident = b'"coll":%s,"coll_sn":%d,"coll_msg_size_bytes":%d' % (
            json.dumps(str(perf["coll"])).encode(),
            int(perf["coll_sn"]),
            int(perf.get("coll_msg_size_bytes") or 0),
        )
        key = (comm, ident)
        f.execs[key] = int(float(perf["coll_exec_time_us"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        out.bad += 1


def inspector_ops(read: InspectorRead, rank_of: Mapping[tuple[str, int], int]) -> list[Op]:
    """Join the ranks' records of one operation (communicator id, ``coll``, ``coll_sn``: NCCL counts
    ``coll_sn`` per communicator and function) into operations; lateness = the longest execution time
    minus the rank's own. ``rank_of`` maps (hostname, pid) to the global rank."""
    placed = sorted(
        ((rank_of[(f.host, f.pid)], f) for f in read.files if (f.host, f.pid) in rank_of), key=lambda x: x[0]
    )
    if not placed:
        return []
    keys: set[OpKey] = set()
    for _, f in placed:
        keys.update(f.execs)
    order = list(keys)
    names = {c: name for _, f in placed for c, (_r, _n, name) in f.comms.items()}
    everyone = tuple(r for r, _ in placed)
    # One column per rank in the keys' order (C-level lookups), then one row per operation.
    columns = [list(map(f.execs.get, order)) for _, f in placed]
    to_ms = (0.001).__mul__
    ops = []
    for key, row in zip(order, zip(*columns, strict=True), strict=True):
        if None in row:
            pairs = [(r, e) for r, e in zip(everyone, row, strict=True) if e is not None]
            ranks = tuple(r for r, _ in pairs)
            got: tuple[int, ...] = tuple(e for _, e in pairs)
        else:
            ranks, got = everyone, row  # type: ignore[assignment]
        longest = max(got)
        comm, ident = key
        parts = _KEY.match(ident)
        if parts is None:
            continue
        coll, sn, size = parts.groups()
        ops.append(
            Op(
                comm=names.get(comm, comm.decode()),
                name=coll.decode(),
                seq=int(sn),
                size=int(size),
                ranks=ranks,
                lateness=tuple(map(to_ms, map(longest.__sub__, got))),
                duration_ms=longest / 1000.0,
                busy_ms=sum(got) / 1000.0,
            )
        )
    return ops


def inspector_world_ranks(read: InspectorRead) -> dict[tuple[str, int], int]:
    """(hostname, pid) -> rank in the largest communicator, the job's world where there is no run
    record to name global ranks."""
    sizes = [(n, comm) for f in read.files for comm, (_r, n, _name) in f.comms.items()]
    if not sizes:
        return {}
    world = max(sizes)[1]
    return {(f.host, f.pid): f.comms[world][0] for f in read.files if world in f.comms}


def fr_ops(
    entries_by_rank: Mapping[int, list[dict[str, Any]]], host_of: Mapping[int, str | None]
) -> list[Op]:
    """Operations from Flight Recorder entries: one per (process group, collective sequence id), each
    rank's lateness its creation time minus the earliest rank's *on the same host* (a host's ranks share
    one clock; different hosts' clocks are not aligned, so each host is judged on its own)."""
    created: dict[tuple[str, str, int], dict[int, int]] = {}
    names: dict[tuple[str, str, int], str] = {}
    sizes: dict[tuple[str, str, int], int] = {}
    for rank, entries in entries_by_rank.items():
        host = host_of.get(rank) or "?"
        for e in entries:
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
    earliest_by_comm: dict[tuple[str, str], dict[int, int]] = {}
    for (pg, host, seq), ts in created.items():
        earliest_by_comm.setdefault((pg, host), {})[seq] = min(ts.values())
    gaps: dict[tuple[str, str, int], float] = {}
    for comm, by_seq in earliest_by_comm.items():
        seqs = sorted(by_seq)
        diffs = [(by_seq[b] - by_seq[a]) / 1e6 for a, b in zip(seqs, seqs[1:], strict=False) if b == a + 1]
        typical = median(diffs) if diffs else 0.0
        for a in seqs:
            nxt = by_seq.get(a + 1)
            gaps[(*comm, a)] = (nxt - by_seq[a]) / 1e6 if nxt is not None else typical
    ops = []
    for key, ts in created.items():
        first = min(ts.values())
        pg, host, seq = key
        duration = max(gaps.get(key, 0.0), 0.0)
        ranks = tuple(sorted(ts))
        ops.append(
            Op(
                comm=pg if host == "?" else f"{pg}@{host}",
                name=names[key],
                seq=seq,
                size=sizes[key],
                ranks=ranks,
                lateness=tuple((ts[r] - first) / 1e6 for r in ranks),
                duration_ms=duration,
                busy_ms=duration * len(ts),
            )
        )
    return ops


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


@dataclass
class NcclTestsSize:
    size: int
    processes: list[NcclTestsProcess]


def looks_like_nccl_tests(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("results"), list) and "config" in doc


def read_nccl_tests(path: Path) -> tuple[list[NcclTestsSize], dict[str, Any]]:
    """Per message size, each process's mean time over its iterations (``per_process_max_times_us``,
    out-of-place), as ``analyze_perf_json.print_straggler`` takes it."""
    doc = load_json_file(path, MAX_NCCL_TESTS_BYTES)
    if not looks_like_nccl_tests(doc):
        raise InputError(f"{path}: not an nccl-tests -J file (no results/config)", _HINT)
    devices = doc.get("devices") if isinstance(doc.get("devices"), list) else []
    sizes = []
    for r in doc["results"]:
        if not isinstance(r, dict):
            continue
        per = r.get("out_of_place_per_iter") or r.get("in_place_per_iter") or {}
        rows = per.get("per_process_max_times_us") if isinstance(per, dict) else None
        if not isinstance(rows, list) or len(rows) < 2:
            continue
        procs = []
        for i, times in enumerate(rows):
            vals = [float(t) for t in times if isinstance(t, (int, float))] if isinstance(times, list) else []
            if not vals:
                continue
            dev = devices[i] if len(devices) == len(rows) and isinstance(devices[i], dict) else {}
            procs.append(
                NcclTestsProcess(
                    index=i,
                    host=dev.get("hostname") if isinstance(dev.get("hostname"), str) else None,
                    pid=dev.get("pid") if isinstance(dev.get("pid"), int) else None,
                    device=dev.get("device") if isinstance(dev.get("device"), int) else None,
                    avg_us=sum(vals) / len(vals),
                )
            )
        if len(procs) >= 2:
            sizes.append(NcclTestsSize(size=int(r.get("size") or 0), processes=procs))
    return sizes, doc


_HINT = (
    "give a run folder, an Inspector dump folder (NCCL_INSPECTOR_DUMP_DIR), Flight Recorder dumps, "
    "or an nccl-tests -J file"
)


def load_json_file(path: Path, cap: int) -> Any:
    from gputopo.inputs import parse_json

    return parse_json(read_capped(path, str(path), cap), str(path), _HINT)
