"""Real Flight Recorder dumps from real CPU ranks (gloo), one scenario per run.

Run as a script: ``python tests/helpers/fr_dumps.py SCENARIO OUT_DIR [WORLD]``. It starts WORLD ranks
(spawned processes, gloo over a FileStore, ``TORCH_FR_BUFFER_SIZE`` set), lets them run a few
collectives and then the scenario's fault, and each rank that is still alive writes its own dump with
torch's dump API: ``OUT_DIR/rank_trace<rank>`` (pickle, the default dump's shape, what
``TORCH_FR_DUMP_TEMP_FILE<rank>`` holds) and ``OUT_DIR/json/rank_trace<rank>.json``
(``_dump_fr_trace_json``, which carries no stacks).

How each fault behaves under gloo, measured with torch 2.14.1:
- ``never``: the last rank never calls the collective (it "stalls in the data loader"); the others wait
  in ``all_reduce`` until gloo's timeout (``COLLECTIVE_TIMEOUT_S``) raises, then dump.
- ``op``: the last rank calls ``broadcast`` where the others call ``all_reduce``; all time out.
- ``size``: the last rank all-reduces twice as many elements. gloo's receiving neighbour aborts the
  process (``EnforceNotMet ... Received data size doesn't match``: SIGABRT, no dump), the others see the
  connection close and dump. So a size mismatch under gloo always comes with a missing dump.
- ``size_small``: the last rank all-reduces half as many elements; now that rank itself aborts
  (``EnforceNotMet ... 8 vs 4``) and leaves no dump: the culprit's dump is the one missing
  (pytorch#196968), and only "rank 2: no dump" while the others wait can point at it.
- ``dtype``: the last rank all-reduces int32 where the others use float32, same byte count: gloo does not
  notice and the collective completes (with garbage); only the recorder shows it.
- ``crash``: the last rank exits (code 3) before the collective: no dump; the others see the connection
  reset and dump.
- ``ok``: everybody completes everything.
- ``subgroup``: ranks 0 and 1 form a second group; rank 1 never calls its all_reduce there, while the
  default group is fine.
- ``moe``: what an expert-parallel step does, healthy: ``all_to_all_single`` with uneven splits (rank r
  sends r+1 elements to every peer), ``scatter`` and ``gather`` from rank 0, ``all_gather``; then the
  last rank never enters the next all_reduce (a real hang after the uneven ones). gloo 2.14 records
  ``all_to_all_single`` as ``gloo:all_to_all`` with each rank's own sizes, and scatter's input (gather's
  output) only on the root (measured).
- ``subgroups4``: 4 ranks, ``new_subgroups(group_size=2)``: groups {0,1} (named ``1``) and {2,3} (``2``)
  (gloo records each rank's as ``pg_config['']``). Both all-reduce once; then {0,1} all-reduces again
  and completes, while in {2,3} rank 3 never enters it (rank 2 waits). Groups that share one name on
  different ranks come from ``split_group``, which gloo on CPU cannot make (torch 2.14.1, measured:
  "No device associated with the default pg, not safe to split any process groups", and
  ``init_process_group(device_id=cpu)`` is refused: "must be an accelerator with an index"); that case
  is built in torch's NCCL format (``tests/nccl_dumps.py``). gloo records no send/recv either.
- ``skip``: a training loop of two all_reduces per step (the loss, then the gradients, same sizes,
  different lines); rank 2 skips the gradients' all_reduce in step 2, then every rank calls barrier:
  rank 2 makes one all_reduce fewer, and from its skip on its calls come from the other line.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

COLLECTIVE_TIMEOUT_S = 2
SCENARIOS = (
    "never",
    "op",
    "size",
    "size_small",
    "dtype",
    "crash",
    "ok",
    "subgroup",
    "moe",
    "subgroups4",
    "skip",
)
SKIP_STEPS = 4
PREFIX = "rank_trace"
WARMUP_STEPS = 3


def train_step(dist, torch, t):
    """The collective every healthy rank calls (named so the recorded stack says so)."""
    dist.all_reduce(t)


def stall_in_data_loader(seconds):
    """The rank that never enters the collective: busy elsewhere."""
    time.sleep(seconds)


def wrong_op_broadcast(dist, t):
    dist.broadcast(t, 0)


def reduce_loss(dist, t):
    dist.all_reduce(t)


def reduce_grads(dist, t):
    dist.all_reduce(t)


def expert_exchange(dist, torch, rank, world):
    """An MoE layer's token exchange: rank r sends r+1 elements to each peer (uneven splits)."""
    send = [rank + 1] * world
    recv = [r + 1 for r in range(world)]
    out = torch.empty(sum(recv))
    dist.all_to_all_single(out, torch.ones(sum(send)), recv, send)
    got = torch.empty(2)
    dist.scatter(got, [torch.ones(2) for _ in range(world)] if rank == 0 else None, src=0)
    dist.gather(torch.ones(2), [torch.empty(2) for _ in range(world)] if rank == 0 else None, dst=0)
    dist.all_gather([torch.empty(2) for _ in range(world)], torch.ones(2))


def _rank_main(rank: int, world: int, scenario: str, out: str, store_file: str) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    t = torch.ones(8)
    for _ in range(WARMUP_STEPS):
        train_step(dist, torch, t)
    dist.broadcast(t, 0)
    last = rank == world - 1
    sub = dist.new_group([0, 1]) if scenario == "subgroup" else None
    if scenario == "subgroups4":
        sub, _ = dist.new_subgroups(group_size=2)
    try:
        if scenario == "never" and last:
            stall_in_data_loader(COLLECTIVE_TIMEOUT_S + 2)
        elif scenario == "op" and last:
            wrong_op_broadcast(dist, t)
        elif scenario == "size" and last:
            train_step(dist, torch, torch.ones(16))
        elif scenario == "size_small" and last:
            train_step(dist, torch, torch.ones(4))
        elif scenario == "dtype" and last:
            train_step(dist, torch, torch.ones(8, dtype=torch.int32))
        elif scenario == "crash" and last:
            os._exit(3)
        elif scenario == "subgroup":
            train_step(dist, torch, t)  # the default group completes
            if rank == 0:
                dist.all_reduce(t, group=sub)
            elif rank == 1:
                stall_in_data_loader(COLLECTIVE_TIMEOUT_S + 2)
        elif scenario == "moe":
            expert_exchange(dist, torch, rank, world)
            if last:
                stall_in_data_loader(COLLECTIVE_TIMEOUT_S + 2)
            else:
                train_step(dist, torch, t)
        elif scenario == "subgroups4":
            dist.all_reduce(t, group=sub)
            if rank == 3:
                stall_in_data_loader(COLLECTIVE_TIMEOUT_S + 2)
            else:
                dist.all_reduce(t, group=sub)
        elif scenario == "skip":
            for step in range(SKIP_STEPS):
                reduce_loss(dist, t)
                if not (rank == 2 and step == 2):
                    reduce_grads(dist, t)
            dist.barrier()
        else:
            train_step(dist, torch, t)
    except RuntimeError:
        pass  # gloo's timeout or a peer gone: the moment a real job would dump
    Path(out, PREFIX + str(rank)).write_bytes(_dump_fr_trace())
    Path(out, "json", f"{PREFIX}{rank}.json").write_bytes(_dump_fr_trace_json())
    os._exit(0)  # skip gloo's teardown, which can wait on peers that are gone


def make_dumps(scenario: str, out: str | Path, world: int = 3) -> list[int | None]:
    """Run ``scenario`` on ``world`` CPU ranks; dumps land in ``out``. Returns each rank's exit code."""
    import multiprocessing

    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario}")
    out = Path(out)
    (out / "json").mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    store = out / ".store"
    store.unlink(missing_ok=True)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, scenario, str(out), str(store))) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    store.unlink(missing_ok=True)
    return [p.exitcode for p in procs]


if __name__ == "__main__":
    codes = make_dumps(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)
    print(" ".join(str(c) for c in codes))
