"""The all-reduce sweep inside the ranks: nccl-tests' method (warm-up, timed iterations, algbw and
busbw) and an exact ``#wrong`` count on known integer-valued data."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from gputopo.probe.ranks.context import RankContext, barrier, hang_or_crash


def known_values(n: int, rank: int, device: torch.device) -> torch.Tensor:
    # Small integers: every partial sum is exact in float32, so any difference is a wrong element.
    return ((torch.arange(n, device=device) % 251) + 1).float() * (rank + 1)


def allreduce_check(ctx: RankContext, group: Any = None) -> dict[str, Any]:
    """nccl-tests-style sweep: warm-up, timed iterations, algbw/busbw, and exact ``#wrong`` per size.

    Collective over ``group`` (default: every rank); ``ctx.rank`` and ``ctx.world`` are the rank's place
    in that group.
    """
    sizes = [int(b) for b in ctx.spec["sweep_bytes"]]
    warmup, iters = (5, 20) if ctx.is_cuda else (2, 5)
    # nccl-tests' -n (timed iterations) and -w (warm-up), when the launch passes them.
    iters = int(ctx.spec.get("iters") or iters)
    warmup = int(ctx.spec.get("warmup_iters") or warmup)
    rows = []
    for i, size in enumerate(sizes):
        count = size // 4
        buf = torch.zeros(count, dtype=torch.float32, device=ctx.device)  # zeros stay zeros: no overflow
        for _ in range(warmup):
            dist.all_reduce(buf, group=group)
        ctx.sync()
        barrier(ctx, group)
        started = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf, group=group)
        ctx.sync()
        elapsed = torch.tensor(
            [(time.perf_counter() - started) / iters], dtype=torch.float64, device=ctx.device
        )
        dist.all_reduce(
            elapsed, op=dist.ReduceOp.MAX, group=group
        )  # the slowest rank sets the collective's time
        if ctx.rank == ctx.inject_rank and i == 0:
            hang_or_crash(ctx, "allreduce", f"{size} bytes")
        data = known_values(count, ctx.rank, ctx.device)
        if ctx.fault("corrupt", "allreduce") and ctx.rank == ctx.inject_rank:
            data[count // 2] += 1.0
        dist.all_reduce(data, group=group)
        expected = known_values(count, 0, ctx.device) * (ctx.world * (ctx.world + 1) // 2)
        wrong = (data != expected).sum().to(torch.int64)
        dist.all_reduce(wrong, group=group)  # #wrong summed over ranks, as nccl-tests reports it
        time_s = float(elapsed)
        algbw = size / time_s / 1e9
        rows.append(
            {
                "bytes": size,
                "count": count,
                "time_us": time_s * 1e6,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (ctx.world - 1) / ctx.world,
                "wrong": int(wrong),
            }
        )
        ctx.progress("allreduce", "size", i + 1, len(sizes), bytes=size)
    return {
        "ranks": ctx.world,
        "warmup_iters": warmup,
        "timed_iters": iters,
        "dtype": "float32",
        "rows": rows,
    }
