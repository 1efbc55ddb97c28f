"""NCCL Inspector logs for the tests, written field by field as the plugin writes them.

The layout follows NVIDIA/nccl ``plugins/profiler/inspector`` at 5067397: one file per process named
``<hostname>-pid<pid>.log`` (``inspector.cc``, ``inspectorStateDumpJSON``), one compact JSON object per
line (``json.cc``: no spaces; ``jsonNewline`` after each object), keys in the writer's order:
``header`` (``inspectorCommInfoHeader``: id, comm_name, rank, n_ranks, nnodes), ``metadata``
(``inspectorCommInfoMetaHeader``: inspector_output_format_version "v4.0", git_rev, rec_mechanism,
dump_timestamp_us, hostname, pid) and ``coll_perf`` (``inspectorCompletedColl``: coll, coll_sn,
coll_msg_size_bytes, coll_exec_time_us, coll_timing_source, coll_algobw_gbs, coll_busbw_gbs).

The timing model is a synchronous collective: each rank arrives at ``arrival``; the kernel can finish
only after the last one arrived, so a rank's execution time is (last arrival - its arrival) + the
operation's own work; the rank that arrived last has the shortest execution time.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COMM_ID = "0x7f8c496ae9f661"


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
) -> dict[tuple[str, int], list[str]]:
    """(hostname, pid) -> the lines of that process's log."""
    rng = random.Random(seed)
    per_host = max(1, ranks // hosts)
    proc = [(f"node{r // per_host:03d}", 10_000 + r) for r in range(ranks)]
    out: dict[tuple[str, int], list[str]] = {p: [] for p in proc}
    t = 1_748_030_377_748_202
    for sn in range(1, ops + 1):
        work = work_us * (1 + rng.gauss(0, noise))
        arrival = [rng.gauss(0, noise * work_us) for _ in range(ranks)]
        if late_rank is not None:
            arrival[late_rank] += late_frac * work_us
        last = max(arrival)
        t += int(work * 3)
        for r in range(ranks):
            exec_us = int(max(1.0, last - arrival[r] + work + rng.gauss(0, noise * work_us * 0.1)))
            algobw = size / exec_us / 1e3
            doc = {
                "header": {"id": COMM_ID, "comm_name": "world", "rank": r, "n_ranks": ranks, "nnodes": hosts},
                "metadata": {
                    "inspector_output_format_version": "v4.0",
                    "git_rev": "",
                    "rec_mechanism": "nccl_profiler_interface",
                    "dump_timestamp_us": t,
                    "hostname": proc[r][0],
                    "pid": proc[r][1],
                },
                "coll_perf": {
                    "coll": "AllReduce",
                    "coll_sn": sn,
                    "coll_msg_size_bytes": size,
                    "coll_exec_time_us": exec_us,
                    "coll_timing_source": "kernel_gpu",
                    "coll_algobw_gbs": round(algobw, 6),
                    "coll_busbw_gbs": round(algobw * 2 * (ranks - 1) / ranks, 6),
                },
            }
            out[proc[r]].append(json.dumps(doc, separators=(",", ":")))
    return out


def write_job(folder: Path, lines: dict[tuple[str, int], list[str]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for (host, pid), ls in lines.items():
        (folder / f"{host}-pid{pid}.log").write_text("\n".join(ls) + "\n")
    return folder
