"""Mixed precision inside the ranks: autocast, the GradScaler, and what they did at every step.

Runs in rank processes only (it imports torch at the top, as ``training`` does). ``AmpStep`` wraps the
three places a training step touches precision: the forward pass (``autocast``), the backward pass
(``backward``: scaled for fp16) and the optimizer step (``step``: through the GradScaler for fp16),
recording per step the scale, whether the scaler skipped the step, and the first non-finite value.
``training_check`` runs one dp or ddp check at one precision against a reference at the same precision.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gputopo.probe.judge.precision import (
    AUTOCAST_DTYPE,
    DEFAULT_PRECISION,
    INIT_SCALE,
    check_id,
)

FP32_CURVE = "fp32:losses"  # the key of the lone fp32 reference curve in ``training_check``'s cache


@contextmanager
def tf32_mode(enabled: bool) -> Iterator[None]:
    """TF32 matmuls and convolutions on (``tf32``) or off (every other precision) for the block.

    torch 2.9 and later set TF32 through ``fp32_precision``; reading the older ``allow_tf32`` flags after
    the new API was used raises (torch/backends/cuda/__init__.py, "mix of the legacy and new APIs"), so
    the older flags are touched only where the new API is missing, as the rank's numerics pinning does.
    """
    backends = torch.backends
    if hasattr(backends, "fp32_precision"):
        knobs = [backends.cuda.matmul, backends.cudnn.conv]
        before = [k.fp32_precision for k in knobs]
        for k in knobs:
            k.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            for k, value in zip(knobs, before, strict=True):
                k.fp32_precision = value
    else:  # pragma: no cover - torch before 2.9
        before_flags = (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32)
        backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = enabled
        try:
            yield
        finally:
            backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = before_flags


def _nonfinite_kind(tensors: list[torch.Tensor]) -> str | None:
    """``"nan"``, ``"inf"`` or ``None`` for a list of tensors (NaN wins: it is the worse news)."""
    if not tensors:
        return None
    flat = [t.detach() for t in tensors]
    # One pass for the common answer: a float64 sum is finite exactly when every element is (float64
    # cannot overflow on any float32, fp16 or bf16 tensor a model holds); only then look for which.
    if bool(torch.isfinite(torch.stack([t.sum(dtype=torch.float64) for t in flat])).all()):
        return None
    if bool(torch.stack([t.isnan().any() for t in flat]).any()):
        return "nan"
    if bool(torch.stack([t.isinf().any() for t in flat]).any()):
        return "inf"
    return None


class AmpStep:
    """One training run's precision: autocast for the forward, a GradScaler for fp16, and its record."""

    def __init__(self, precision: str, device: torch.device, init_scale: float = INIT_SCALE) -> None:
        self.precision = precision
        self.device = device
        dtype_name = AUTOCAST_DTYPE[precision]
        self.dtype = getattr(torch, dtype_name) if dtype_name else None
        # torch.amp.GradScaler(device) is the device-generic scaler, CPU included: torch 2.3's
        # torch.cuda.amp.GradScaler is already a thin subclass of it (pytorch.org/docs/2.3 source), and
        # pytorch commit b5bf757 ("Deprecate device-specific GradScaler autocast API") turned the
        # torch.cuda/torch.cpu spellings into FutureWarning aliases. pyproject's torch>=2.14 has both.
        self.init_scale = float(init_scale)
        self.scaler = (
            torch.amp.GradScaler(device.type, init_scale=self.init_scale) if precision == "fp16" else None
        )
        self.scales: list[float] = []
        self.skipped_steps: list[int] = []
        self.first_nonfinite: dict[str, Any] | None = None

    @classmethod
    def for_spec(cls, spec: dict[str, Any], device: torch.device) -> AmpStep:
        """The precision the rank's spec names (fp32 when it names none)."""
        return cls(
            str(spec.get("precision") or DEFAULT_PRECISION), device, spec.get("init_scale") or INIT_SCALE
        )

    @contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward pass of one step: autocast to fp16/bf16, TF32 on for tf32 only."""
        with tf32_mode(self.precision == "tf32"):
            if self.dtype is None:
                yield
            else:
                with torch.autocast(device_type=self.device.type, dtype=self.dtype):
                    yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the scaled loss (fp16) or the loss itself; TF32 applies to the backward too."""
        with tf32_mode(self.precision == "tf32"):
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(
        self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], step: int, loss: Any
    ) -> None:
        """Apply the step (through the scaler for fp16) and record scale, skip and first non-finite value.

        A skipped step is read from the scale: ``GradScaler.update`` multiplies it by ``backoff_factor``
        (0.5) exactly when the step had inf/NaN gradients and ``step`` skipped ``optimizer.step()``
        (torch/amp/grad_scaler.py), and it only grows on steps that were applied.
        """
        if self.first_nonfinite is None:
            loss_kind = _nonfinite_kind([loss.detach().reshape(1)]) if torch.is_tensor(loss) else None
            grad_kind = _nonfinite_kind([p.grad for p in params if p.grad is not None])
            if loss_kind or grad_kind:
                where = "loss" if loss_kind else "gradients"
                self.first_nonfinite = {"step": step, "where": where, "value": loss_kind or grad_kind}
        if self.scaler is None:
            optimizer.step()
            return
        before = float(self.scaler.get_scale())
        self.scaler.step(optimizer)
        self.scaler.update()
        after = float(self.scaler.get_scale())
        self.scales.append(after)
        if after < before:
            self.skipped_steps.append(step)

    def metrics(self) -> dict[str, Any]:
        """What the run recorded, for the check's metrics."""
        out: dict[str, Any] = {
            "precision": self.precision,
            "device": self.device.type,
            "autocast_dtype": AUTOCAST_DTYPE[self.precision],
            "first_nonfinite": self.first_nonfinite,
        }
        if self.scaler is not None:
            out["scaler"] = {
                "init_scale": self.init_scale,
                "scales": self.scales,
                "skipped_steps": self.skipped_steps,
            }
        return out


def autocast_dtype_hook(amp: AmpStep) -> Any:
    """A forward pre-hook that sets the autocast dtype in the thread running the module.

    ``nn.DataParallel`` runs each replica in a thread of its own and re-enters autocast there with the
    enabled flag only (torch/nn/parallel/parallel_apply.py: ``torch.amp.autocast(device_type,
    enabled=autocast_enabled)``), while the autocast dtype is thread-local (aten/src/ATen/autocast_mode.cpp,
    default float16 on CUDA): without this, bf16 autocast around DataParallel runs the replicas in fp16.
    """

    def hook(module: nn.Module, args: Any) -> None:
        if amp.dtype is not None and torch.is_autocast_enabled(amp.device.type):
            torch.set_autocast_dtype(amp.device.type, amp.dtype)

    return hook


def plant_overflow(ctx: Any, check: str, output: torch.Tensor, step: int, who: int) -> None:
    """``--inject overflow``: from the middle step on, the gradient reaching ``output`` of rank (or DP
    replica) ``who`` is infinite, as an fp16 overflow in that rank's backward would make it."""
    if ctx.fault("overflow", check) and who == ctx.inject_rank and step >= ctx.inject_step:
        output.register_hook(lambda g: torch.full_like(g, float("inf")))


def with_precision(ctx: Any, precision: str, init_scale: float | None = None) -> Any:
    """A copy of the rank context for one precision: the spec names it (and the GradScaler's starting
    scale), and the planted fault reaches the check only if the launch aimed it at this precision's check."""
    inject_checks = [
        base for base in ("dp", "ddp") if check_id(base, precision) in ctx.spec.get("inject_checks", ())
    ]
    inject_checks += [c for c in ctx.spec.get("inject_checks", ()) if c not in ("dp", "ddp") and "@" not in c]
    spec = {**ctx.spec, "precision": precision, "inject_checks": inject_checks, "init_scale": init_scale}
    return replace(ctx, spec=spec)


def device_capabilities(ctx: Any, devices: list[int] | None = None) -> list[tuple[int, int]]:
    """Compute capability of each of the set's CUDA devices (``None``: every visible one; empty on CPU)."""
    if not ctx.is_cuda:
        return []
    return [tuple(torch.cuda.get_device_capability(i)) for i in devices or range(torch.cuda.device_count())]
