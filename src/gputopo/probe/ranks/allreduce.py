"""The all-reduce sweep inside the ranks: nccl-tests' method (warm-up, timed iterations, algbw and
busbw) and an exact ``#wrong`` count on known integer-valued data."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from gputopo.probe.ranks.context import RankContext, barrier, hang_or_crash

# The exact check's values: element i of rank r is ((KNOWN_STRIDE*i + r) % KNOWN_PERIOD) + 1, an integer in
# 1..KNOWN_PERIOD. Every partial sum of any reduction order over n ranks is then an integer of at most
# KNOWN_PERIOD*n, and float32 holds every integer up to 2**24 exactly (24-bit significand), so the
# all-reduce is exact for n <= MAX_EXACT_RANKS = 2**24 // KNOWN_PERIOD = 1,048,576 ranks. (The values
# used before, (i % 251 + 1) * (r + 1), summed to 251*n*(n+1)/2 and stopped being exact past 365 ranks.)
# Consecutive ranks differ in every element, so a rank's contribution that is missing, doubled or moved
# changes the sum.
KNOWN_PERIOD = 16
KNOWN_STRIDE = 7  # coprime with the period: neighbouring elements differ too
MAX_EXACT_RANKS = 2**24 // KNOWN_PERIOD


def known_values(n: int, rank: int, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s ``n`` small integers for the exact all-reduce check (float32).

    Element i depends on i only through ``i % KNOWN_PERIOD``, so one period is computed and repeated:
    the same values as the formula over all ``n`` at a fraction of the arithmetic.
    """
    i = torch.arange(KNOWN_PERIOD, device=device, dtype=torch.int64)
    return _repeat(((i * KNOWN_STRIDE + rank) % KNOWN_PERIOD + 1).to(torch.float32), n)


def _repeat(period: torch.Tensor, n: int) -> torch.Tensor:
    """``period`` repeated to ``n`` elements (a fresh, contiguous tensor)."""
    return period.repeat(-(-n // len(period)))[:n].clone()


def known_sum(n: int, world: int, device: torch.device) -> torch.Tensor:
    """The exact element-wise sum of ``known_values`` over ranks ``0..world-1`` (float32, exact up to
    ``MAX_EXACT_RANKS``; ``ValueError`` past it): every whole period of ranks adds 1+2+...+16 = 136 to
    each element, the remaining ranks are added one by one in int64."""
    if world > MAX_EXACT_RANKS:
        raise ValueError(f"the exact all-reduce check supports up to {MAX_EXACT_RANKS} ranks, not {world}")
    periods, rest = divmod(world, KNOWN_PERIOD)
    i = torch.arange(KNOWN_PERIOD, device=device, dtype=torch.int64)  # one period of elements, repeated
    whole = periods * KNOWN_PERIOD * (KNOWN_PERIOD + 1) // 2
    total = torch.full((KNOWN_PERIOD,), whole, dtype=torch.int64, device=device)
    for r in range(rest):
        total += (i * KNOWN_STRIDE + r) % KNOWN_PERIOD + 1
    return _repeat(total.to(torch.float32), n)


def allreduce_check(ctx: RankContext, group: Any = None) -> dict[str, Any]:
    """nccl-tests-style sweep: warm-up, timed iterations, algbw/busbw, and exact ``#wrong`` per size.

    Collective over ``group`` (default: every rank); ``ctx.rank`` and ``ctx.world`` are the rank's place
    in that group.
    """
    sizes = [int(b) for b in ctx.spec["sweep_bytes"]]
    # On CPU stand-ins gloo's times say nothing about GPU links and are never judged: one warm-up and one
    # timed all-reduce per size show a figure; the exact check below runs at every size all the same.
    warmup, iters = (5, 20) if ctx.is_cuda else (1, 1)
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
        expected = known_sum(count, ctx.world, ctx.device)
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
