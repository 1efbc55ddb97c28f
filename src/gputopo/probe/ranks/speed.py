"""The speed table, measured inside the ranks: samples per second of one GPU, DataParallel, DDP and
DDP with AMP, all at the same global batch (``--batch-size`` per GPU times the set's size).

Runs in rank processes only (imports torch at the top). Each configuration trains the same model on one
fixed synthetic batch (built once, already on the device, so data generation is not timed) for a few
warm-up steps and then ``--steps`` timed steps. Judging and the table are ``gputopo.probe.judge.speed``'s job.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gputopo.probe.judge.speed import CONFIGS
from gputopo.probe.ranks.context import MOMENTUM, barrier, fresh_model, wait_for_others
from gputopo.probe.ranks.models import synthetic_batch
from gputopo.probe.ranks.training import CpuDataParallel

WARMUP_STEPS_CUDA = 3  # cuDNN picks kernels and the caching allocator fills on the first steps
WARMUP_STEPS_CPU = 1


class _NoInspection:
    """CpuDataParallel's inspector with nothing to check: the speed table times training, not checks."""

    def after_replicate(self, replicas: Any) -> None:
        pass

    def before_apply(self) -> None:
        pass

    def after_apply(self, outputs: Any) -> None:
        pass


def amp_dtype(device: torch.device) -> torch.dtype:
    """AMP's dtype: float16 with a GradScaler on GPUs (the seed's setup, and what every GPU generation
    has); bfloat16, CPU autocast's own default, on CPU stand-ins."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def _train(
    ctx: Any,
    module: torch.nn.Module,
    params: Any,
    images: torch.Tensor,
    labels: torch.Tensor,
    steps: int,
    warmup: int,
    amp: bool,
) -> float:
    """Seconds for ``steps`` training steps after ``warmup`` untimed ones."""

    opt = torch.optim.SGD(params, lr=float(ctx.spec["lr"]), momentum=MOMENTUM)
    dtype = amp_dtype(ctx.device)
    scaler = torch.amp.GradScaler(ctx.device.type) if amp and dtype == torch.float16 else None
    started = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            ctx.sync()
            started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=ctx.device.type, dtype=dtype, enabled=amp):
            loss = F.cross_entropy(module(images), labels)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    ctx.sync()
    return time.perf_counter() - started


def speed_check(ctx: Any, group: Any = None, devices: list[int] | None = None) -> dict[str, Any]:
    """Time the four configurations under torch's default numerics with cuDNN autotuning
    (``numerics.speed_numerics``: TF32 where torch allows it, no deterministic kernels), as users' training
    runs; the correctness checks before and after keep the pinned numerics. Rank 0 returns the rows, the
    others ``{}``."""
    from gputopo.probe.ranks.numerics import SPEED_NUMERICS, speed_numerics

    with speed_numerics() as flags:
        out = _timed(ctx, group, devices)
    if out:
        out.update(numerics=SPEED_NUMERICS, numerics_flags=flags)
    return out


def _timed(ctx: Any, group: Any = None, devices: list[int] | None = None) -> dict[str, Any]:
    """Time the four configurations (collective over ``group``, the set's ranks; ``devices``: the set's
    CUDA devices, default 0..world-1). Rank 0 returns the rows, the others ``{}``."""
    from torch.nn.parallel import DistributedDataParallel

    steps = int(ctx.spec["steps"])
    warmup = WARMUP_STEPS_CUDA if ctx.is_cuda else WARMUP_STEPS_CPU
    global_batch = int(ctx.spec["batch_size"]) * ctx.world
    images, labels = synthetic_batch(int(ctx.spec["seed"]), 0, global_batch)
    times: dict[str, float] = {}

    def single_and_dp() -> None:
        x, y = images.to(ctx.device), labels.to(ctx.device)
        model = fresh_model(ctx, ctx.device)
        times[CONFIGS[0]] = _train(ctx, model, model.parameters(), x, y, steps, warmup, amp=False)
        ctx.progress("speed", CONFIGS[0], 1, len(CONFIGS))
        model = fresh_model(ctx, ctx.device)
        if ctx.is_cuda:
            ids = list(devices) if devices is not None else list(range(ctx.world))
            wrapped: torch.nn.Module = torch.nn.DataParallel(model, device_ids=ids, output_device=ids[0])
        else:
            wrapped = CpuDataParallel(model, ctx.world, _NoInspection())  # type: ignore[arg-type]
        times[CONFIGS[1]] = _train(ctx, wrapped, model.parameters(), x, y, steps, warmup, amp=False)
        ctx.progress("speed", CONFIGS[1], 2, len(CONFIGS))

    if ctx.rank == 0:  # one process drives one GPU, then all of them through DataParallel
        single_and_dp()
    wait_for_others(ctx, group)
    x = images.chunk(ctx.world)[ctx.rank].to(ctx.device)
    y = labels.chunk(ctx.world)[ctx.rank].to(ctx.device)
    for k, (config, amp) in enumerate(((CONFIGS[2], False), (CONFIGS[3], True))):
        model = fresh_model(ctx, ctx.device)
        ddp = DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.is_cuda else None, process_group=group
        )
        barrier(ctx, group)
        elapsed = torch.tensor(
            [_train(ctx, ddp, ddp.parameters(), x, y, steps, warmup, amp)], dtype=torch.float64
        )
        elapsed = elapsed.to(ctx.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the time
        times[config] = float(elapsed)
        ctx.progress("speed", config, 3 + k, len(CONFIGS))
    if ctx.rank != 0:
        return {}
    precision = {CONFIGS[3]: str(amp_dtype(ctx.device)).removeprefix("torch.")}
    rows = [
        {
            "config": config,
            "devices": 1 if config == CONFIGS[0] else ctx.world,
            "global_batch": global_batch,
            "timed_steps": steps,
            "time_s": times[config],
            "samples_per_s": global_batch * steps / times[config],
            "autocast_dtype": precision.get(config),
        }
        for config in CONFIGS
    ]
    return {
        "ranks": ctx.world,
        "device": ctx.device.type,
        "warmup_steps": warmup,
        "dp_path": "torch.nn.DataParallel"
        if ctx.is_cuda
        else "DataParallel algorithm on CPU (CpuDataParallel)",
        "rows": rows,
    }
