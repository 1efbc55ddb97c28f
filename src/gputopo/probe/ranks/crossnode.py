"""The inter-node tests, inside the ranks of a multi-node launch (``worker`` calls ``run`` when the spec
has a ``cross`` section). What to test next is decided by ``gputopo.probe.judge.nodes``, the same way in every
rank, from results every rank holds; this module only measures.

Each test is an all-reduce over the ranks of some nodes: first the exact check (small integers whose
sums are exact in float32, so any differing element is a wrong one, as nccl-tests counts ``#wrong``),
then a timed sweep. In the sweep every rank also times each all-reduce it waits in: the rank that
arrived last waited least, which is how ``nodes.stragglers`` finds the node the others waited for.

Every rank leaves its last progress in the rendezvous store (the c10d ``TCPStore`` torch's elastic
agents already run at ``--rdzv-endpoint``), so when something hangs, node rank 0's parent can read how
far each rank of every node got without any of them answering.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gputopo.probe.judge import nodes
from gputopo.probe.judge.progress import FINISHED_STEP
from gputopo.probe.ranks.allreduce import known_sum, known_values
from gputopo.probe.ranks.compat import new_group_in_order
from gputopo.probe.shared import COLLECTIVE_TIMEOUT_GRACE_S

# The planted "slow" fault: this long asleep before each timed collective, like a node that is late to
# every all-reduce (a throttled GPU, a busy CPU). Long against CPU scheduling noise, short for a drill.
SLOW_DELAY_S = 0.05
STORE_PREFIX = "gputopo"
STORE_TIMEOUT_S = 30


def store_key(run_id: str, rank: int | str) -> str:
    """Where global rank ``rank`` leaves its last progress in the rendezvous store."""
    return f"{STORE_PREFIX}/{run_id}/rank/{rank}"


def beat_key(run_id: str) -> str:
    """A counter every rank adds to with each progress row: the run is alive while it moves."""
    return f"{STORE_PREFIX}/{run_id}/beat"


def world_key(run_id: str) -> str:
    """Where rank 0 leaves the world size, so a reader knows how many ranks to look for."""
    return f"{STORE_PREFIX}/{run_id}/world"


class Progress:
    """A rank's progress: a line in its node's progress file (the node's parent watches it for liveness)
    and the last one in the rendezvous store (node rank 0's parent reads every rank's on a hang)."""

    def __init__(self, spec: dict[str, Any], rank: int, local_rank: int, log: Any) -> None:
        host, port = spec["cross"]["store_host"], int(spec["cross"]["store_port"])
        self.store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False
        )
        self.run_id = spec["cross"]["run_id"]
        self.rank = rank
        self.log = log
        self.seq = 0
        self.step = -1  # the step of the plan the rank is in (-1: before the first)
        self.base = {
            "rank": rank,
            "node": spec["cross"]["node_rank"],
            "host": spec["cross"]["host"],
            "local_rank": local_rank,
            "gpu": spec["gpus"][local_rank],
        }

    def __call__(self, stage: str, test: dict[str, Any] | None = None, **extra: Any) -> None:
        # ``seq`` counts how far the rank got; a planted fault is said where it happens without counting
        # as a step forward, so the store reads as a real hang would leave it.
        if not stage.startswith("injected"):
            self.seq += 1
        row = {
            **self.base,
            "seq": self.seq,
            "step": self.step,
            "t": time.time(),
            "stage": stage,
            "test": test.get("id") if test else None,
            "nodes": test.get("nodes") if test else None,
            **extra,
        }
        self.store.set(store_key(self.run_id, self.rank), json.dumps(row))
        # One counter for the whole run: every node's agent watches it, so a node whose ranks sit a step
        # out while others test is not taken for hung (multinode.JoinWatch).
        self.store.add(beat_key(self.run_id), 1)
        line = {"t": row["t"], "pool_rank": self.rank, "rank": self.rank, "task": None, "check": "cross"}
        line.update(stage=stage, done=self.seq, total=0, test=row["test"], nodes=row["nodes"])
        self.log.write(json.dumps(line) + "\n")
        self.log.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def group_test(
    spec: dict[str, Any],
    test: dict[str, Any],
    ranks: list[int],
    group: Any,
    device: torch.device,
    progress: Progress,
) -> dict[str, Any] | None:
    """Run one test in this rank; the group's first rank returns the result, the others ``None``."""
    me = ranks.index(dist.get_rank())
    world = len(ranks)
    inject = spec["cross"].get("inject")
    progress("enter", test)
    if inject == "hang":
        progress("injected-hang", test)
        while True:  # only the parents' --timeout ends this, as it must end a real hang
            time.sleep(3600)
    if inject == "crash":
        progress("injected-crash", test)
        sys.stderr.write(f"gputopo probe: injected crash in rank {dist.get_rank()} during {test['id']}\n")
        sys.stderr.flush()
        os._exit(86)
    if inject == "mnnvl":
        fail_as_nccl_without_imex(spec, world, progress, test)
    progress("collective", test)
    # The exact check first: a wrong sum is found before any timing.
    count = 1 << 16
    data = known_values(count, me, device)
    if inject == "corrupt":
        data[count // 2] += 1.0
    dist.all_reduce(data, group=group)
    expected = known_sum(count, world, device)
    wrong = (data != expected).sum().to(torch.int64)
    dist.all_reduce(wrong, group=group)
    rows = []
    waited = 0.0
    waits = 0
    iters = int(spec.get("iters") or (20 if device.type == "cuda" else 5))
    warmup = 5 if device.type == "cuda" else 2
    for size in spec["sweep_bytes"]:
        buf = torch.zeros(int(size) // 4, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(buf, group=group)
        _sync(device)
        dist.barrier(group=group)
        started = time.perf_counter()
        for _ in range(iters):
            if inject == "slow":
                time.sleep(SLOW_DELAY_S)
            entered = time.perf_counter()
            dist.all_reduce(buf, group=group)
            _sync(device)  # so the wait is the collective's, on GPUs too
            waited += time.perf_counter() - entered
            waits += 1
        elapsed = torch.tensor([(time.perf_counter() - started) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        algbw = int(size) / float(elapsed) / 1e9
        rows.append(
            {
                "bytes": int(size),
                "time_us": float(elapsed) * 1e6,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (world - 1) / world if world > 1 else 0.0,
            }
        )
        progress("size", test, bytes=int(size))
    mean_wait = torch.tensor([waited / max(waits, 1)], dtype=torch.float64, device=device)
    all_waits = [torch.zeros_like(mean_wait) for _ in range(world)]
    dist.all_gather(all_waits, mean_wait, group=group)
    progress("done", test)
    if me != 0:
        return None
    waits_ms = [float(w) * 1e3 for w in all_waits]
    most = max(waits_ms)
    lateness: dict[str, float] = {}
    late_rank: dict[str, int] = {}
    for local, global_rank in enumerate(ranks):
        node = str(spec["cross"]["layout"][global_rank]["node"])
        late = most - waits_ms[local]
        if late >= lateness.get(node, -1.0):
            lateness[node] = late
            late_rank[node] = global_rank
    return {
        **test,
        "ranks": ranks,
        "wrong": int(wrong),
        "rows": rows,
        "busbw_gbps": max((r["busbw_gbps"] for r in rows), default=None),
        "lateness_ms": {k: round(v, 3) for k, v in lateness.items()},
        "late_rank": late_rank,
        "wait_ms": [round(w, 3) for w in waits_ms],
    }


def fail_as_nccl_without_imex(
    spec: dict[str, Any], world: int, progress: Progress, test: dict[str, Any]
) -> None:
    """The ``mnnvl`` drill: write the NCCL log of a rank whose NVLink domain has no IMEX channel where the
    probe points NCCL_DEBUG_FILE (``nccl-rank<r>.log``), then fail as the communicator's creation does."""
    from gputopo.probe.judge.mnnvl import drill_log

    rank = dist.get_rank()
    lines = drill_log(socket.gethostname(), os.getpid(), rank, world)
    with open(Path(spec["out_dir"]) / f"nccl-rank{rank}.log", "a") as f:
        f.write("\n".join(lines) + "\n")
    progress("injected-mnnvl", test)
    # As torch reports an NCCL error: the result's name, then NCCL's last WARN (ncclGetLastError).
    last = lines[-1].split("NCCL WARN ", 1)[1]
    raise RuntimeError(f"NCCL error: unhandled system error (injected), Last error: {last}")


def run(spec: dict[str, Any], rank: int, world: int, local_rank: int, device: torch.device, log: Any) -> None:
    """Every rank: agree on who is where, then test groups of nodes until ``nodes.next_step`` is done;
    each node's first rank writes the whole record for its parent (``cross.json``)."""
    cross = spec["cross"]
    progress = Progress(spec, rank, local_rank, log)
    if rank == 0:
        progress.store.set(world_key(cross["run_id"]), str(world))
    mine = {
        "rank": rank,
        "node": cross["node_rank"],
        "host": cross["host"],
        "local_rank": local_rank,
        "gpu": spec["gpus"][local_rank],
        "nic": (cross.get("nics") or {}).get(str(spec["gpus"][local_rank])),
        "local": cross.get("local") if local_rank == 0 else None,
    }
    # The rendezvous numbers the nodes its own way (torch's DynamicRendezvousHandler gives group ranks
    # by sorted(state.participants), agents' host_pid descriptors), not by --node-rank: every rank says
    # which node it is, and the layout is built from that.
    table: list[Any] = [None] * world
    progress("gather")
    dist.all_gather_object(table, mine)
    layout = nodes.Layout.from_table(table, int(cross["nnodes"]))
    cross["layout"] = [dict(r) for r in layout.ranks]
    try:
        results = run_tests(spec, rank, world, device, layout, progress)
    except Exception as exc:
        # A peer went away (or the fault is here): leave what every rank had reached when it happened,
        # for the parent, before the store may go away with the agent that hosts it.
        write_lost(Path(spec["out_dir"]), progress, world, exc)
        raise
    record = {
        "nnodes": int(cross["nnodes"]),
        "ranks": [{k: v for k, v in r.items() if k != "local"} for r in layout.ranks],
        "local": {str(r["node"]): r["local"] for r in table if r["local_rank"] == 0},
        "tests": results,
    }
    if local_rank == 0:
        out = Path(spec["out_dir"]) / "cross.json"
        tmp = out.with_name(".cross.json.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, out)
    progress.step = FINISHED_STEP
    progress("finished")


def write_lost(out_dir: Path, progress: Progress, world: int, exc: Exception) -> None:
    """``lost-rank<r>.json``: the error and every rank's last progress, as far as the store still answers."""
    seen: dict[str, Any] = {}
    try:
        progress.store.set_timeout(timedelta(seconds=5))
        for r in range(world):
            key = store_key(progress.run_id, r)
            if progress.store.check([key]):
                seen[str(r)] = json.loads(progress.store.get(key))
    except Exception:  # noqa: BLE001 - the store's host is gone too: keep what was read
        pass
    tmp = out_dir / f".lost-rank{progress.rank}.tmp"
    tmp.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}", "progress": seen}))
    os.replace(tmp, out_dir / f"lost-rank{progress.rank}.json")


def run_tests(
    spec: dict[str, Any],
    rank: int,
    world: int,
    device: torch.device,
    layout: nodes.Layout,
    progress: Progress,
) -> list[dict[str, Any]]:
    """Test groups of nodes, step by step, until ``nodes.next_step`` says the run is done."""
    results: list[dict[str, Any]] = []
    groups: dict[tuple[int, ...], Any] = {}
    while (step := nodes.next_step(layout, results)) is not None:
        progress.step += 1
        for test in step:
            test["id"] = f"t{len(results) + step.index(test)}"
            key = tuple(layout.test_ranks(test))
            if key not in groups:
                # new_group is entered by every rank, for every group, in the same order (its docstring).
                # The world group serves only when its rank order is the test's (node by node).
                same = list(key) == list(range(world))
                # A subgroup's timeout is its own (new_group falls back to the backend default, 10 min for
                # NCCL, not init_process_group's): the parent must always be the one to call a hang.
                timeout = timedelta(seconds=float(spec["timeout_s"]) + COLLECTIVE_TIMEOUT_GRACE_S)
                groups[key] = None if same else new_group_in_order(key, timeout=timeout)
        mine_result = None
        for test in step:
            ranks = layout.test_ranks(test)
            if rank in ranks:
                mine_result = group_test(spec, test, ranks, groups[tuple(ranks)], device, progress)
        gathered: list[Any] = [None] * world
        progress("gather")
        dist.all_gather_object(gathered, mine_result)
        results += sorted((r for r in gathered if r is not None), key=lambda r: int(r["id"][1:]))
    return results
