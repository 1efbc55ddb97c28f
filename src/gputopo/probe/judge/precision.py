"""Numeric precision of the training checks: the choices, what each needs, and how a run is judged.

Pure: no torch here. The ranks (``gputopo.probe.ranks.amp``) apply a precision; the parent judges what they
recorded with ``judge_precision``, which wraps the dp/ddp judges of ``verdict``.

Precisions, as ``--precision`` names them:

- ``fp32``: plain float32, TF32 off (the default, and the yardstick the others are compared with).
- ``tf32``: float32 tensors with TF32 tensor-core matmuls and convolutions (CUDA, compute capability
  8.0 or newer); on CPU stand-ins it runs as fp32, and says so.
- ``fp16``: ``torch.autocast`` to float16 with a ``torch.amp.GradScaler`` on the device, as AMP scripts do.
- ``bf16``: ``torch.autocast`` to bfloat16, no scaler (bf16 has float32's exponent range).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
DEFAULT_PRECISION = "fp32"

# torch dtype names each precision autocasts to (``None``: no autocast).
AUTOCAST_DTYPE = {"fp32": None, "tf32": None, "fp16": "float16", "bf16": "bfloat16"}

# Machine epsilon (2**-mantissa bits) of the narrowest type the forward pass computes in. TF32 keeps 10
# mantissa bits, as float16 does.
EPSILON = {"fp32": 2.0**-23, "tf32": 2.0**-10, "fp16": 2.0**-10, "bf16": 2.0**-7}

# The loss-curve judge's relative floor (``verdict.REL_TOL`` for fp32). Under autocast the logits are
# rounded to the narrow type before the float32 cross-entropy, so two valid float orders of the same step
# can differ by a few of its ulps; 4 epsilons leaves room for that without hiding a real split error.
FP32_REL_TOL = 1e-3
ULPS_OF_NOISE = 4

# Native bf16 (tensor cores and cuDNN bf16 convolutions) starts with Ampere, compute capability 8.0.
# torch.cuda.is_bf16_supported() answers True below that too: its default including_emulation=True
# falls back to "can a bfloat16 tensor be created on the device" (torch/cuda/__init__.py,
# _check_bf16_tensor_supported), which succeeds on Volta and Turing, where bf16 math is emulated.
NATIVE_BF16_CAPABILITY = (8, 0)
# TF32 tensor cores also start with Ampere; below it the TF32 switches change nothing.
NATIVE_TF32_CAPABILITY = (8, 0)

# GradScaler: torch's defaults (init_scale 2**16, halved on every step with inf/NaN gradients).
INIT_SCALE = 65536.0
# Below a scale of 1 the scaler no longer lifts small fp16 gradients at all, and it only got there by
# halving 16 times from 2**16: the gradients are non-finite whatever the scale, not merely out of range.
SCALE_FLOOR = 1.0
# The ranks calibrate the starting scale on the first step only (``ranks.precision.calibrate_scale``) and
# start this many halvings below the largest finite one. Two were too few: with small per-rank batches
# (BatchNorm over two values per channel at the last stage) the gradients grew 8x within three steps, so
# the healthy reference's third step sat exactly on the fp16 limit and overflowed or not depending on the
# CPU's float16 kernels (it overflowed on an AMD EPYC host). Four halvings (16x) leave room for
# that growth; a lower start costs nothing in a probe of a few steps (fp16's subnormals reach 6e-8).
CALIBRATION_HEADROOM_HALVINGS = 4
# "Most steps": at least half of the steps after the scaler's first calibration, and at least two.
OVERFLOW_FRACTION = 0.5
MIN_OVERFLOW_SKIPS = 2

_OVERFLOW_REFERENCE_REMEDY = (
    "The single-device reference overflowed too, so this is the training setup, not the GPUs: lower the "
    "learning rate (--lr) or the GradScaler's initial scale, use bf16 instead of fp16 on Ampere or newer "
    "GPUs (compute capability 8.0+, no scaler needed), and look at the model for layers that produce huge "
    "activations (missing normalisation, exp/log without clamping)."
)
_OVERFLOW_SET_REMEDY = (
    "The GradScaler kept skipping steps on this set while the single-device reference trained normally, "
    "so the gradients became non-finite on the way between the GPUs or on one of them. Run `gputopo probe "
    "--mode p2p` and `--mode allreduce` on this set, check the IOMMU/ACS settings and `dmesg` for Xid "
    "errors. If the reference runs close to the limit as well, lower the learning rate or the initial "
    "scale, or use bf16 on Ampere or newer GPUs."
)


def split_check(check: str) -> tuple[str, str]:
    """``"dp@fp16"`` -> ``("dp", "fp16")``; a plain check name is fp32: ``"dp"`` -> ``("dp", "fp32")``."""
    base, _, precision = check.partition("@")
    return base, precision or DEFAULT_PRECISION


def check_id(base: str, precision: str) -> str:
    """The check's name in a run: the base name for fp32 (so default runs look as before), else ``base@p``."""
    return base if precision == DEFAULT_PRECISION else f"{base}@{precision}"


def expand_checks(checks: tuple[str, ...], precisions: tuple[str, ...]) -> tuple[str, ...]:
    """One dp and one ddp check per precision, in the given order; other checks once."""
    out: list[str] = []
    for check in checks:
        if check in ("dp", "ddp"):
            out.extend(check_id(check, p) for p in precisions)
        else:
            out.append(check)
    return tuple(out)


def rel_tol(precision: str) -> float:
    """The loss-curve judge's relative floor for ``precision``."""
    return max(FP32_REL_TOL, ULPS_OF_NOISE * EPSILON[precision])


def bf16_native(capability: tuple[int, int]) -> bool:
    """True when a GPU of compute capability ``capability`` computes bf16 natively (8.0 and newer)."""
    return tuple(capability) >= NATIVE_BF16_CAPABILITY


def unsupported_reason(precision: str, device: str, capabilities: list[tuple[int, int]]) -> str | None:
    """Why ``precision`` must not run on these devices (``None``: it runs).

    bf16 below compute capability 8.0 runs through emulation (no bf16 tensor cores or cuDNN bf16
    convolutions), so a pass would say nothing about training there; it is skipped and reported as
    emulated. TF32 below 8.0 would silently be fp32. CPU stand-ins run everything (torch has CPU
    autocast for bf16 and fp16 and a CPU GradScaler).
    """
    if device != "cuda":
        return None
    old = sorted({f"{c[0]}.{c[1]}" for c in capabilities if tuple(c) < NATIVE_BF16_CAPABILITY})
    if not old:
        return None
    where = f"compute capability {', '.join(old)} (below 8.0)"
    if precision == "bf16":
        return (
            f"bf16 would be emulated on {where}: no native bf16 tensor cores or cuDNN bf16 convolutions, "
            "although torch.cuda.is_bf16_supported() says True; use fp16 with a GradScaler there"
        )
    if precision == "tf32":
        return f"no TF32 tensor cores on {where}: the run would be plain fp32"
    return None


def stand_in_note(precision: str, device: str) -> str | None:
    """What a precision means on CPU stand-ins, for the check's detail."""
    if device == "cuda":
        return None
    if precision == "tf32":
        return "CPU stand-ins: TF32 is a CUDA tensor-core mode, so this ran as fp32"
    if precision in ("fp16", "bf16"):
        return f"CPU stand-ins: CPU autocast to {AUTOCAST_DTYPE[precision]}"
    return None


# --- overflow ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScalerJudgement:
    """What a GradScaler's record says: calibration skips at the start, later skips, the lowest scale."""

    steps: int
    calibration_skips: int
    later_skips: int
    min_scale: float | None
    overflow: bool
    why: str


def judge_scaler(scales: list[float], skipped_steps: list[int], steps: int) -> ScalerJudgement:
    """Judge a GradScaler's per-step record (``scales[i]``: the scale after step ``i``).

    The scaler starts high (2**16) and halves on each step whose gradients overflow, skipping that step,
    so a few skips at the very start are it finding its scale: they are counted apart. Overflow is: no
    step applied at all, the scale below ``SCALE_FLOOR``, or, after calibration, at least
    ``MIN_OVERFLOW_SKIPS`` skips making up ``OVERFLOW_FRACTION`` or more of the remaining steps.
    """
    skipped = sorted(set(skipped_steps))
    calibration = 0
    while calibration < len(skipped) and skipped[calibration] == calibration:
        calibration += 1
    later = len(skipped) - calibration
    after = steps - calibration
    min_scale = min(scales) if scales else None
    if steps and len(skipped) >= steps:
        return ScalerJudgement(steps, calibration, later, min_scale, True, f"all {steps} steps skipped")
    if min_scale is not None and min_scale < SCALE_FLOOR:
        why = f"the scale fell to {min_scale:g} (floor {SCALE_FLOOR:g})"
        return ScalerJudgement(steps, calibration, later, min_scale, True, why)
    if later >= MIN_OVERFLOW_SKIPS and after > 0 and later / after >= OVERFLOW_FRACTION:
        first = skipped[calibration]
        why = f"{later} of the {after} steps after calibration skipped, from step {first}"
        return ScalerJudgement(steps, calibration, later, min_scale, True, why)
    why = f"{len(skipped)} of {steps} steps skipped ({calibration} while calibrating)"
    return ScalerJudgement(steps, calibration, later, min_scale, False, why)


def _reference_kept_training(scaler: dict[str, Any] | None, steps: int) -> str:
    """What a reference that did not overflow did, in words that cannot read as a contradiction."""
    if not scaler:
        return "the single-device reference did not overflow"
    skipped = sorted(set(scaler.get("skipped_steps") or []))
    scales = scaler.get("scales") or []
    last = f", scale {scales[-1]:g}" if scales else ""
    if not skipped:
        return f"the single-device reference skipped no step ({steps} of {steps} applied{last})"
    which = ", ".join(str(s) for s in skipped)
    plural = "s" if len(skipped) > 1 else ""
    return (
        f"the single-device reference kept training: it skipped only step{plural} {which} "
        f"({len(skipped)} of {steps}{last}), the GradScaler's normal back-off, not overflow"
    )


def overflow_finding(metrics: dict[str, Any]) -> tuple[str, str] | None:
    """``(detail, remedy)`` when the run's GradScaler record shows overflow; ``None`` otherwise."""
    scaler = metrics.get("scaler")
    if not scaler:
        return None
    steps = len(metrics.get("losses") or scaler.get("scales") or [])
    mine = judge_scaler(scaler["scales"], scaler["skipped_steps"], steps)
    if not mine.overflow:
        return None
    ref_scaler = metrics.get("ref_scaler")
    ref = judge_scaler(ref_scaler["scales"], ref_scaler["skipped_steps"], steps) if ref_scaler else None
    first = metrics.get("first_nonfinite")
    where = (
        f"; first non-finite value: {first['value']} in the {first['where']} at step {first['step']}"
        if first
        else ""
    )
    detail = f"fp16 GradScaler overflow: {mine.why}{where}"
    if ref is not None and ref.overflow:
        return detail + f"; the single-device reference too ({ref.why})", _OVERFLOW_REFERENCE_REMEDY
    return detail + "; " + _reference_kept_training(ref_scaler, steps), _OVERFLOW_SET_REMEDY


# --- judging a precision run ---------------------------------------------------------------------------


def fp32_gap(losses: list[float], fp32_ref: list[float] | None) -> float | None:
    """The largest finite gap between a run's losses and the fp32 single-device reference."""
    if not fp32_ref:
        return None
    gaps = [
        abs(a - b) for a, b in zip(losses, fp32_ref, strict=False) if math.isfinite(a) and math.isfinite(b)
    ]
    return max(gaps) if gaps else None


def judge_precision(check: str, metrics: dict[str, Any]) -> Any:
    """Judge a dp/ddp run at its precision: ``verdict.judge_dp``/``judge_ddp`` with the precision's
    noise floor, steps the GradScaler skipped not counted as NaN, ``overflow`` first, the fp32 gap added.
    """
    from dataclasses import replace

    from gputopo.probe.judge import verdict

    base, precision = split_check(check)
    if metrics.get("unsupported"):
        return verdict.skipped(check, metrics["unsupported"], metrics)
    skipped = set((metrics.get("scaler") or {}).get("skipped_steps") or [])
    m = {
        **metrics,
        "rel_tol": rel_tol(precision),
        # A step whose non-finite gradients the scaler caught and skipped changed no weight.
        "nonfinite_grad_steps": [s for s in metrics.get("nonfinite_grad_steps", []) if s not in skipped],
    }
    gap = fp32_gap(m["losses"], m.get("fp32_ref_losses"))
    m["fp32_gap"] = gap
    result = verdict.judge_dp(m) if base == "dp" else verdict.judge_ddp(m)
    result = replace(result, name=check)
    extra = [t for t in (stand_in_note(precision, m.get("device", "cpu")),) if t]
    if gap is not None and precision != DEFAULT_PRECISION:
        extra.append(f"largest loss gap to the fp32 reference {gap:.3g}")
    found = overflow_finding(m)
    if found is not None:
        detail, remedy = found
        if result.verdict == verdict.FAIL and result.kind != "overflow":
            detail += f"; also {result.kind}: {result.detail}"
        return verdict.fail(check, "overflow", "; ".join([detail, *extra]), remedy, result.metrics)
    if extra:
        result = replace(result, detail="; ".join([result.detail, *extra]))
    return result
