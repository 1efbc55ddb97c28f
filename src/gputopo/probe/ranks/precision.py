"""dp and ddp at a precision inside the ranks: reference runs per precision (an fp32 one beside a
narrower one) and fp16's starting loss scale, found by bisection on a throwaway model."""

from __future__ import annotations

import math
from typing import Any

import torch

from gputopo.probe.judge.precision import (
    CALIBRATION_HEADROOM_HALVINGS,
    DEFAULT_PRECISION,
    INIT_SCALE,
    SCALE_FLOOR,
    rel_tol,
    split_check,
    unsupported_reason,
)
from gputopo.probe.ranks import training
from gputopo.probe.ranks.amp import FP32_CURVE, AmpStep, _nonfinite_kind, device_capabilities, with_precision
from gputopo.probe.ranks.context import chunks, fresh_model, wait_for_others


def training_check(
    ctx: Any,
    base: str,
    precision: str,
    refs: dict[str, Any],
    group: Any = None,
    devices: list[int] | None = None,
) -> dict[str, Any]:
    """One dp or ddp check at ``precision`` against references at the same precision (collective).

    ``refs`` caches the reference runs per precision across the launch's checks. An fp32 reference is
    always run too (both runs when the launch has fp32 checks, else run 1 alone), so a narrower
    precision's loss curve can be compared with fp32's. dp runs in rank 0
    while the others wait; ddp in every rank. Rank 0 returns the metrics.
    """
    why = unsupported_reason(precision, ctx.device.type, device_capabilities(ctx, devices))
    if why is not None:
        return {"precision": precision, "device": ctx.device.type, "unsupported": why}
    fp32_checked = any(
        split_check(c) in (("dp", DEFAULT_PRECISION), ("ddp", DEFAULT_PRECISION)) for c in ctx.spec["checks"]
    )
    for p in dict.fromkeys((DEFAULT_PRECISION if fp32_checked else precision, precision)):
        if p not in refs:
            scale = calibrate_scale(with_precision(ctx, p), group) if p == "fp16" else None
            refs[f"{p}:init_scale"] = scale
            refs[p] = training.reference_runs(with_precision(ctx, p, scale), group)
    if precision != DEFAULT_PRECISION and not fp32_checked and FP32_CURVE not in refs:
        # No fp32 check in this launch: one fp32 reference run (rank 0) is enough for the gap.
        fp32 = with_precision(ctx, DEFAULT_PRECISION)
        refs[FP32_CURVE] = (
            training.reference_run(fp32, "fp32", per_chunk_backward=False)["losses"]
            if ctx.rank == 0
            else None
        )
        wait_for_others(ctx, group)
    sub = with_precision(ctx, precision, refs[f"{precision}:init_scale"])
    metrics: dict[str, Any] = {}
    if base == "dp":
        if ctx.rank == 0:
            metrics = training.dp_check(sub, refs[precision], devices)
        wait_for_others(ctx, group)
    else:
        metrics = training.ddp_check(sub, refs[precision], group)
    # The second reference run only where it can change the verdict (training.second_run_if_needed).
    training.second_run_if_needed(sub, refs[precision], metrics.get("losses"), rel_tol(precision), group)
    if ctx.rank == 0:
        metrics.update(refs[precision].metrics())
    if ctx.rank == 0 and precision != DEFAULT_PRECISION:
        fp32_ref = refs.get(DEFAULT_PRECISION)
        metrics["fp32_ref_losses"] = fp32_ref.first["losses"] if fp32_ref is not None else refs[FP32_CURVE]
    return metrics


def calibrate_scale(ctx: Any, group: Any = None) -> float:
    """The GradScaler's starting scale for this launch: the largest power of two up to 2**16 at which
    the first step's gradients are finite, divided by 2**CALIBRATION_HEADROOM_HALVINGS (later steps'
    gradients grow), found on a throwaway copy of the model. Collective:
    each rank searches on its own chunk of the first batch (as DDP ranks and reference run 2
    backpropagate chunk by chunk), and the smallest wins, so all runs start alike.

    GradScaler starts at 2**16 and halves on each overflowing step, skipping it. In a probe of a few
    steps that start-up search could use up the whole run, and a planted or real overflow from the
    middle step would hide inside it; starting where the search would end leaves every step judgeable.
    Overflow is monotone in the scale, so a bisection over the 17 exponents needs five passes, not the
    scaler's one step per halving.
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    model = fresh_model(ctx, ctx.device)
    images, labels = chunks(ctx, 0)
    x, y = images[ctx.rank].to(ctx.device), labels[ctx.rank].to(ctx.device)
    amp = AmpStep("fp16", ctx.device)

    def finite_at(exponent: int) -> bool:
        model.zero_grad(set_to_none=True)
        with amp.autocast():
            loss = F.cross_entropy(model(x), y)
        (loss.float() * 2.0**exponent).backward()
        return _nonfinite_kind([p.grad for p in model.parameters() if p.grad is not None]) is None

    top = int(math.log2(INIT_SCALE))
    if finite_at(top):
        best = top
    else:
        low, high = -1, top  # finite_at(low) is assumed (scale below 1), finite_at(high) is false
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if finite_at(mid) else (low, mid)
        best = low
    scale = max(2.0 ** (best - CALIBRATION_HEADROOM_HALVINGS), SCALE_FLOOR)
    found = torch.tensor([scale], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(found, op=dist.ReduceOp.MIN, group=group)
    return float(found)
