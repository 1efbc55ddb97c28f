"""NCCL Inspector logs for the tests, written field by field as the plugin writes them.

The layout follows NVIDIA/nccl ``plugins/profiler/inspector`` at 5067397: one file per process named
``<hostname>-pid<pid>.log`` (``inspector.cc``, ``inspectorStateDumpJSON``), one compact JSON object per
line (``json.cc``: no spaces, doubles as ``%lf``; ``jsonNewline`` after each object), keys in the
writer's order: ``header`` (``inspectorCommInfoHeader``: id (``0x%lx`` of the communicator's hash),
comm_name ("unknown" where NCCL has none), rank (in that communicator), n_ranks, nnodes), ``metadata``
(``inspectorCommInfoMetaHeader``: inspector_output_format_version "v4.0", git_rev, rec_mechanism,
dump_timestamp_us, hostname, pid) and ``coll_perf`` (``inspectorCompletedColl``: coll, coll_sn,
coll_msg_size_bytes, coll_exec_time_us, coll_timing_source, coll_algobw_gbs, coll_busbw_gbs), or
``p2p_perf`` (``inspectorCompletedP2p``: p2p, p2p_sn, p2p_peer, p2p_msg_size_bytes, p2p_exec_time_us,
...) for point-to-point operations.

The timing model is a synchronous job. Each step runs its collectives in order, every rank computing
before each one; in each collective of a communicator instance every member waits for the last to
arrive, so a member's execution time is (last arrival - its arrival) + the operation's work, and every
member leaves at the same time. The late rank arrives ``late_frac`` x ``work_us`` late at each
collective, an eager rank ``eager_frac`` x ``work_us`` early (its kernel times are the longest). With
``tp`` set, the job has tensor-parallel groups of ``tp`` consecutive ranks (``tp_colls`` each step) and
data-parallel groups of the ranks with the same place in their TP group (an AllReduce after the TP
collectives): a TP group that waited for its straggler reaches the DP AllReduce late together.
"""

from __future__ import annotations

import random
from pathlib import Path

COMM_ID = "0x7f8c496ae9f661"

_LINE = (
    '{{"header":{{"id":"{cid}","comm_name":"{name}","rank":{crank},"n_ranks":{n},"nnodes":{nnodes}}},'
    '"metadata":{{"inspector_output_format_version":"v4.0","git_rev":"","rec_mechanism":'
    '"nccl_profiler_interface","dump_timestamp_us":{ts},"hostname":"{host}","pid":{pid}}},'
    '"coll_perf":{{"coll":"{coll}","coll_sn":{sn},"coll_msg_size_bytes":{size},"coll_exec_time_us":{ex},'
    '"coll_timing_source":"kernel_gpu","coll_algobw_gbs":{algo:.6f},"coll_busbw_gbs":{bus:.6f}}}}}'
)
_P2P = (
    '{{"header":{{"id":"{cid}","comm_name":"{name}","rank":{crank},"n_ranks":{n},"nnodes":{nnodes}}},'
    '"metadata":{{"inspector_output_format_version":"v4.0","git_rev":"","rec_mechanism":'
    '"nccl_profiler_interface","dump_timestamp_us":{ts},"hostname":"{host}","pid":{pid}}},'
    '"p2p_perf":{{"p2p":"Send","p2p_sn":{sn},"p2p_peer":{peer},"p2p_msg_size_bytes":{size},'
    '"p2p_exec_time_us":{ex},"p2p_timing_source":"kernel_gpu","p2p_algobw_gbs":1.000000,'
    '"p2p_busbw_gbs":1.000000}}}}'
)


def job_lines(
    ranks: int,
    ops: int,
    late_rank: int | None = None,
    late_frac: float = 0.0,
    noise: float = 0.01,
    work_us: float = 5000.0,
    seed: int = 0,
    hosts: int = 1,
    size: int = 1 << 26,
    eager_rank: int | None = None,
    eager_frac: float = 0.0,
    tp: int | None = None,
    names: str = "distinct",
    p2p: bool = False,
    tp_colls: tuple[str, ...] = ("AllGather", "ReduceScatter"),
    dp_per_step: int = 1,
) -> dict[tuple[str, int], list[str]]:
    """(hostname, pid) -> the lines of that process's log, ``ops`` steps.

    ``tp``: None for one world communicator (one AllReduce a step), else TP groups of ``tp`` ranks and
    DP groups across them (three collectives a step, two message sizes). ``names``: "distinct" (every
    communicator its own name), "shared" (every TP group ``mesh_tp``, every DP group ``mesh_dp``) or
    "unknown" (NCCL's name for a communicator without one). ``tp_colls``: the TP collectives of a
    step; ``dp_per_step``: DP AllReduces a step (more DP than TP windows make the straggler's TP mates
    outliers in most of their windows). ``p2p``: a Send line between steps (read
    with json, not judged)."""
    rng = random.Random(seed)
    per_host = max(1, ranks // hosts)
    proc = [(f"node{r // per_host:03d}", 10_000 + r) for r in range(ranks)]
    nnodes = (ranks + per_host - 1) // per_host
    out: dict[tuple[str, int], list[str]] = {p: [] for p in proc}
    # Phases of a step, each a list of communicator instances: (id, name, members, coll, message size).
    phases: list[list[tuple[str, str, list[int], str, int]]] = []
    if tp is None:
        world = "world" if names == "distinct" else "unknown"
        phases.append([(COMM_ID, world, list(range(ranks)), "AllReduce", size)])
    else:
        tp_groups = [list(range(g, min(g + tp, ranks))) for g in range(0, ranks, tp)]
        dp_groups = [list(range(i, ranks, tp)) for i in range(tp)]
        for coll in tp_colls:
            phases.append(
                [
                    (f"0x{0x51000 + g:x}a7", _name(names, "mesh_tp", g), members, coll, size // 4)
                    for g, members in enumerate(tp_groups)
                ]
            )
        for _ in range(dp_per_step):
            phases.append(
                [
                    (f"0x{0x9D000 + g:x}c3", _name(names, "mesh_dp", g), members, "AllReduce", size)
                    for g, members in enumerate(dp_groups)
                ]
            )
    sn: dict[tuple[str, str], int] = {}
    t = 1_748_030_377_748_202.0
    clock = [0.0] * ranks  # each rank's time, us
    for _step in range(ops):
        for phase in phases:
            # Compute before each collective: the late rank is late at every one, the eager one early.
            for r in range(ranks):
                clock[r] += work_us * (1 + rng.gauss(0, noise)) + rng.gauss(0, noise * work_us)
            if late_rank is not None:
                clock[late_rank] += late_frac * work_us
            if eager_rank is not None:
                clock[eager_rank] -= eager_frac * work_us
            for cid, name, members, coll, sz in phase:
                last = max(clock[r] for r in members)
                work = work_us * (1 + rng.gauss(0, noise))
                n = sn[(cid, coll)] = sn.get((cid, coll), 0) + 1
                for crank, r in enumerate(members):
                    ex = int(max(1.0, last - clock[r] + work + rng.gauss(0, noise * work_us * 0.1)))
                    algo = sz / ex / 1e3
                    out[proc[r]].append(
                        _LINE.format(
                            cid=cid,
                            name=name,
                            crank=crank,
                            n=len(members),
                            nnodes=nnodes,
                            ts=int(t + clock[r]),
                            host=proc[r][0],
                            pid=proc[r][1],
                            coll=coll,
                            sn=n,
                            size=sz,
                            ex=ex,
                            algo=algo,
                            bus=algo * 2 * (len(members) - 1) / len(members),
                        )
                    )
                    clock[r] = last + work
        if p2p:
            for r in range(ranks):
                out[proc[r]].append(
                    _P2P.format(
                        cid="0x" + "e" * 12,
                        name="pp",
                        crank=r,
                        n=ranks,
                        nnodes=nnodes,
                        ts=int(t + clock[r]),
                        host=proc[r][0],
                        pid=proc[r][1],
                        sn=_step + 1,
                        peer=(r + 1) % ranks,
                        size=4096,
                        ex=int(work_us / 10),
                    )
                )
    return out


def _name(names: str, kind: str, g: int) -> str:
    if names == "shared":
        return kind
    if names == "unknown":
        return "unknown"
    return f"{kind}_{g}"


def write_job(folder: Path, lines: dict[tuple[str, int], list[str]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for (host, pid), ls in lines.items():
        (folder / f"{host}-pid{pid}.log").write_text("\n".join(ls) + "\n")
    return folder


def ranks_of(lines: dict[tuple[str, int], list[str]]) -> dict[tuple[str, int], int]:
    """(hostname, pid) -> the global rank job_lines gave it (its PID is 10,000 + rank)."""
    return {(host, pid): pid - 10_000 for host, pid in lines}
