"""What every check in a rank shares: the rank's context, planted hangs and crashes, the seeded model
and batch chunks (the same in every rank, replica and reference run), checksums and barriers.

Runs inside the ranks only (it imports torch at the top)."""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gputopo.probe.ranks.models import build_model, synthetic_batch

CRASH_EXIT_CODE = 86  # an unusual code, so a test can tell the planted crash from any other failure


CORRUPT_DELTA = 1e-3  # small enough to leave the loss plausible, large enough to flip many bits


MOMENTUM = 0.9


@dataclass
class RankContext:
    """What a check knows about the rank it runs in, and where it writes."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    spec: dict[str, Any]
    out_dir: Path
    _progress_file: Any = field(default=None, repr=False)
    # In the rank pool: the job's id and this rank's rank in the pool (both added to progress rows), and
    # the folder of the pool ranks' NCCL logs (default: ``out_dir``).
    task: str | None = None
    pool_rank: int | None = None
    log_dir: Path | None = None
    # The group the set's idle ranks wait in while one rank drives the set's GPUs (gloo on GPUs, see
    # ``wait_for_others``); ``None``: the set's own group.
    wait_group: Any = field(default=None, repr=False)

    @property
    def is_cuda(self) -> bool:
        """True on GPUs."""
        return self.device.type == "cuda"

    def sync(self) -> None:
        """Wait for queued GPU work (a no-op on CPU), so wall-clock times measure the work."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def progress(self, check: str, stage: str, done: int = 0, total: int = 0, **extra: Any) -> None:
        """One progress line for the parent's bars and its hang diagnosis."""
        if self._progress_file is None:
            self._progress_file = open(self.out_dir / f"progress-rank{self.rank}.jsonl", "a")  # noqa: SIM115
        row = {
            "t": time.time(),
            "rank": self.rank,
            "check": check,
            "stage": stage,
            "done": done,
            "total": total,
        }
        if self.task is not None:
            row.update(task=self.task, pool_rank=self.pool_rank)
        row.update(extra)
        self._progress_file.write(json.dumps(row) + "\n")
        self._progress_file.flush()

    def fault(self, name: str, check: str) -> bool:
        """True when ``--inject name`` targets ``check`` in this run (the rank is checked by the caller)."""
        return self.spec.get("inject") == name and check in self.spec.get("inject_checks", ())

    @property
    def inject_rank(self) -> int:
        """The rank (or DP replica) that carries the planted fault."""
        return int(self.spec.get("inject_rank") or 0)

    @property
    def inject_step(self) -> int:
        """The training step at which a fault is planted: mid-run, so earlier steps show a healthy start."""
        return int(self.spec["steps"]) // 2


def hang_or_crash(ctx: RankContext, check: str, where: str) -> None:
    """Carry out a planted hang or crash: it stops here, in this rank, as a real one would."""
    if ctx.fault("hang", check):
        ctx.progress(check, "injected-hang", where=where)
        while True:  # only the parent's timeout ends this, as it must end a real hang
            time.sleep(3600)
    if ctx.fault("crash", check):
        ctx.progress(check, "injected-crash", where=where)
        sys.stderr.write(f"gputopo probe: injected crash in rank {ctx.rank} during {check} ({where})\n")
        sys.stderr.flush()
        os._exit(CRASH_EXIT_CODE)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor: the sum of its raw bits read as integers. Equal for bitwise-equal tensors.

    Any changed bit changes its tensor's sum, so comparing two models moves a few hundred bytes rather
    than the model, and the sums are computed where the tensors live (no copy to the host).
    """
    sums = [
        t.detach().reshape(-1).view(_SAME_SIZE_INT[t.element_size()]).sum(dtype=torch.int64) for t in tensors
    ]
    return torch.stack(sums)


def all_finite(tensors: Sequence[torch.Tensor | None]) -> bool:
    # A NaN or inf anywhere makes its tensor's float64 sum non-finite; float64 keeps large finite sums finite.
    present = [t.sum(dtype=torch.float64) for t in tensors if t is not None]
    return bool(torch.isfinite(torch.stack(present)).all()) if present else True


def optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)


def fresh_model(ctx: RankContext, device: torch.device) -> nn.Module:
    """The model at its seeded initial weights: the same in every rank, replica and reference run.

    A pool rank takes part in many sets, each wanting a fresh model several times (reference, dp, ddp):
    it builds (draws the initial weights of) each model once, on the CPU, and hands out copies, which is
    a memory copy instead of a random initialisation. The global RNG is seeded as it always was.
    """
    seed = int(ctx.spec["seed"])
    torch.manual_seed(seed)
    key = (ctx.spec["model"], seed)
    if key not in _PRISTINE:
        _PRISTINE[key] = build_model(ctx.spec["model"])
    return copy.deepcopy(_PRISTINE[key]).to(device)


# Per rank process: each model as built, before any training (``fresh_model``).
_PRISTINE: dict[tuple[str, int], nn.Module] = {}


def chunks(ctx: RankContext, step: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    images, labels = synthetic_batch(int(ctx.spec["seed"]), step, int(ctx.spec["batch_size"]) * ctx.world)
    return images.chunk(ctx.world), labels.chunk(ctx.world)


def barrier(ctx: RankContext, group: Any = None) -> None:
    """A barrier over ``group`` (default: every rank; NCCL wants the device named)."""
    if ctx.is_cuda:
        dist.barrier(group=group, device_ids=[ctx.device.index])
    else:
        dist.barrier(group=group)


def wait_for_others(ctx: RankContext, group: Any = None) -> None:
    """Wait, on the CPU, for the set's ranks while one of them (or two) drives GPUs on its own.

    A barrier of an NCCL group is a one-element all-reduce on this rank's GPU (torch.distributed.barrier's
    docstring): its kernel busy-waits on a GPU that rank 0 is timing (P2P, DataParallel, the speed table's
    one-GPU and DataParallel rows) and, without MPS, time-slices against that work. The set's gloo group
    (``ctx.wait_group``) waits in the CPU instead; without one (CPU ranks, whose groups are gloo), the
    set's group.
    """
    if ctx.wait_group is not None:
        dist.barrier(group=ctx.wait_group)
    else:
        barrier(ctx, group)
