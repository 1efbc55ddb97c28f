"""The checks themselves; this module runs inside the ranks (``worker``) and nowhere else.

It imports torch at the top because only rank processes import it: the CLI never does. Every check
measures and records; judging is ``verdict``'s job, in the parent, so it is testable on plain data.

The CUDA path and the CPU path are one path: the same code with ``device`` ``cuda:<local rank>`` and NCCL,
or ``cpu`` and gloo. The one difference is DataParallel, whose primitives (replicate, scatter, gather)
exist only for CUDA: on CPU the same four steps run through ``CpuDataParallel``, built from autograd
copies, ``chunk`` and ``cat``, so the loss curve, the replica check and the fault hooks are exercised
by the CPU tests as they run on GPUs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gputopo.probe.amp import AmpStep, autocast_dtype_hook, plant_overflow
from gputopo.probe.models import build_model, synthetic_batch

CRASH_EXIT_CODE = 86  # an unusual code, so a test can tell the planted crash from any other failure
CORRUPT_DELTA = 1e-3  # small enough to leave the loss plausible, large enough to flip many bits
P2P_BYTES = 64 << 20
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


def _all_finite(tensors: Sequence[torch.Tensor | None]) -> bool:
    # A NaN or inf anywhere makes its tensor's float64 sum non-finite; float64 keeps large finite sums finite.
    present = [t.sum(dtype=torch.float64) for t in tensors if t is not None]
    return bool(torch.isfinite(torch.stack(present)).all()) if present else True


def _optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)


def _fresh_model(ctx: RankContext, device: torch.device) -> nn.Module:
    # Same seed, same initial weights in every rank, replica and reference run.
    torch.manual_seed(int(ctx.spec["seed"]))
    return build_model(ctx.spec["model"]).to(device)


def _chunks(ctx: RankContext, step: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    images, labels = synthetic_batch(int(ctx.spec["seed"]), step, int(ctx.spec["batch_size"]) * ctx.world)
    return images.chunk(ctx.world), labels.chunk(ctx.world)


# --- reference --------------------------------------------------------------------------------------


def reference_run(ctx: RankContext, label: str, per_chunk_backward: bool) -> dict[str, Any]:
    """Train on one device with the global batch split into the chunks DP replicas and DDP ranks see.

    Each chunk goes through the model on its own, so BatchNorm sees the same statistics as in a replica
    or rank. Two float orders of the same arithmetic are possible, and the two reference runs use one
    each: the gradient of the mean of the chunk losses in one backward pass (DataParallel's order), or
    one backward pass per chunk with the gradients summed and then divided by the chunk count (DDP's
    order). How far these two drift apart is the noise floor the probes are judged against: on small
    batches with BatchNorm, training amplifies last-bit differences within a few steps.
    """
    key = (label, per_chunk_backward, ctx.world, str(ctx.device), *(ctx.spec[k] for k in _REFERENCE_KEYS))
    # --precision: a reference at another precision (or GradScaler start) is another curve.
    key += (ctx.spec.get("precision") or "fp32", ctx.spec.get("init_scale"))
    if key in _REFERENCE_CACHE:
        ctx.progress("reference", label, int(ctx.spec["steps"]), int(ctx.spec["steps"]), cached=True)
        return _REFERENCE_CACHE[key]
    steps = int(ctx.spec["steps"])
    model = _fresh_model(ctx, ctx.device)
    opt = _optimizer(model.parameters(), float(ctx.spec["lr"]))
    amp = AmpStep.for_spec(ctx.spec, ctx.device)  # --precision: autocast, and a GradScaler for fp16
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(steps):
        images, labels = _chunks(ctx, step)
        opt.zero_grad(set_to_none=True)
        chunk_losses = []
        for x, y in zip(images, labels, strict=True):
            with amp.autocast():
                loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
            if per_chunk_backward:
                amp.backward(loss)
            chunk_losses.append(loss)
        mean = sum(chunk_losses) / len(chunk_losses)
        if per_chunk_backward:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(len(chunk_losses))
        else:
            amp.backward(mean)
        amp.step(opt, list(model.parameters()), step, mean)
        losses.append(float(mean.detach()))
        ctx.progress("reference", label, step + 1, steps)
    ctx.sync()
    result = {
        "losses": losses,
        "wall_s": time.perf_counter() - started,
        "params": [p.detach().clone() for p in model.parameters()],
        "amp": amp.metrics(),
    }
    _REFERENCE_CACHE[key] = result
    return result


# A pool rank probes many sets of the same size; their reference runs are the same computation on the
# same device (model, seed, data, chunking), so a rank runs each one once. Nothing planted reaches them.
_REFERENCE_KEYS = ("model", "seed", "steps", "batch_size", "lr")
_REFERENCE_CACHE: dict[tuple[Any, ...], dict[str, Any]] = {}


@dataclass
class References:
    """The two reference runs: run 1 (DataParallel's float order) is the yardstick, run 2 (DDP's order)
    measures how far an equally valid run strays from it."""

    first: dict[str, Any]
    second_losses: list[float]
    second_device: str

    def metrics(self) -> dict[str, Any]:
        """Reference losses of both runs, for the judge."""
        return {
            "ref_losses": self.first["losses"],
            "ref2_losses": self.second_losses,
            "ref_wall_s": self.first["wall_s"],
            "ref2_device": self.second_device,
            "ref_scaler": self.first.get("amp", {}).get("scaler"),
        }


def reference_runs(ctx: RankContext, group: Any = None) -> References | None:
    """Both reference runs at once: run 1 in rank 0, run 2 in rank 1 (rank 0 again when it is alone).

    Collective: every rank calls it; rank 0 gets the ``References``, the others ``None``. On GPUs, run 2
    on a second device also folds that device's kernel nondeterminism into the noise floor.
    """
    second_rank = 1 if ctx.world > 1 else 0
    first = reference_run(ctx, "run 1", per_chunk_backward=False) if ctx.rank == 0 else None
    second = reference_run(ctx, "run 2", per_chunk_backward=True) if ctx.rank == second_rank else None
    path = ctx.out_dir / "reference-run2.json"
    if ctx.rank == second_rank and second_rank != 0:
        assert second is not None
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(second["losses"]))
        os.replace(tmp, path)
    barrier(ctx, group)
    if ctx.rank != 0:
        return None
    assert first is not None
    second_losses = second["losses"] if second is not None else json.loads(path.read_text())
    return References(first, second_losses, f"{ctx.device.type} rank {second_rank}")


def barrier(ctx: RankContext, group: Any = None) -> None:
    """A barrier over ``group`` (default: every rank; NCCL wants the device named)."""
    if ctx.is_cuda:
        dist.barrier(group=group, device_ids=[ctx.device.index])
    else:
        dist.barrier(group=group)


def _max_abs_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x.detach().to(y.device) - y).abs().max()) for x, y in zip(a, b, strict=True))


# --- dp -----------------------------------------------------------------------------------------------


class _ReplicaInspector:
    """Checks every replica against the master right after the broadcast, and plants dp faults.

    Shared by ``ProbeDataParallel`` (CUDA) and ``CpuDataParallel`` (CPU), so both paths run the same
    check and the same fault hooks.
    """

    def __init__(self, ctx: RankContext, master: nn.Module) -> None:
        self.ctx = ctx
        self.master = master
        self.names = [name for name, _ in master.named_parameters()]
        self.step = 0
        self.mismatches: list[dict[str, int]] = []

    def after_replicate(self, replicas: list[list[torch.Tensor]]) -> None:
        if self.ctx.fault("corrupt", "dp") and self.step == self.ctx.inject_step:
            with torch.no_grad():
                target = replicas[min(self.ctx.inject_rank, len(replicas) - 1)][0]
                target.view(-1)[0] += CORRUPT_DELTA
        want = checksum(list(self.master.parameters()))
        for k, tensors in enumerate(replicas):
            if not torch.equal(checksum(tensors).to(want.device), want):
                bad = sum(
                    not torch.equal(t.detach().to(m.device), m.detach())
                    for t, m in zip(tensors, self.master.parameters(), strict=True)
                )
                self.mismatches.append({"step": self.step, "replica": k, "tensors": int(bad)})

    def before_apply(self) -> None:
        if self.step == self.ctx.inject_step:
            hang_or_crash(self.ctx, "dp", f"replica {self.ctx.inject_rank}, step {self.step}")

    def after_apply(self, outputs: list[torch.Tensor]) -> None:
        if self.ctx.fault("nan", "dp") and self.step == self.ctx.inject_step:
            outputs[min(self.ctx.inject_rank, len(outputs) - 1)].register_hook(
                lambda g: torch.full_like(g, float("nan"))
            )
        target = min(self.ctx.inject_rank, len(outputs) - 1)
        plant_overflow(self.ctx, "dp", outputs[target], self.step, self.ctx.inject_rank)


def _replica_tensors(master: nn.Module, replica: nn.Module, names: list[str]) -> list[torch.Tensor]:
    # DataParallel's replicas hold their parameters as plain attributes, not as Parameters.
    out = []
    for name in names:
        owner, _, attr = name.rpartition(".")
        out.append(getattr(replica.get_submodule(owner) if owner else replica, attr))
    return out


def _cuda_data_parallel(
    ctx: RankContext, model: nn.Module, inspector: _ReplicaInspector, devices: Sequence[int]
) -> nn.Module:
    """``nn.DataParallel`` itself, with the inspector in its replicate and parallel_apply steps."""

    class ProbeDataParallel(nn.DataParallel):
        def replicate(self, module: nn.Module, device_ids: Sequence[int]) -> list[nn.Module]:  # type: ignore[override]
            replicas = super().replicate(module, device_ids)
            inspector.after_replicate([_replica_tensors(module, r, inspector.names) for r in replicas])
            return replicas

        def parallel_apply(self, replicas: Any, inputs: Any, kwargs: Any) -> list[Any]:  # type: ignore[override]
            inspector.before_apply()
            outputs = super().parallel_apply(replicas, inputs, kwargs)
            inspector.after_apply(outputs)
            return outputs

    return ProbeDataParallel(model, device_ids=list(devices), output_device=devices[0])


class CpuDataParallel(nn.Module):
    """DataParallel's algorithm on CPU, where its CUDA primitives do not exist.

    replicate: autograd copies of the master's parameters (their gradients sum back into the master, as
    DataParallel's broadcast does); scatter: ``chunk``; parallel_apply: each replica on its chunk through
    ``torch.func.functional_call``; gather: ``cat``.
    """

    def __init__(self, module: nn.Module, replicas: int, inspector: _ReplicaInspector) -> None:
        super().__init__()
        self.module = module
        self.replicas = replicas
        self.inspector = inspector

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        chunks = images.chunk(self.replicas)
        params = [
            {name: p.clone() for name, p in self.module.named_parameters()} for _ in range(self.replicas)
        ]
        self.inspector.after_replicate([list(p.values()) for p in params])
        self.inspector.before_apply()
        # Replica 0 shares the master's buffers and the others get copies, as DataParallel's broadcast does.
        master_buffers = dict(self.module.named_buffers())
        outputs = []
        for k, (p, chunk) in enumerate(zip(params, chunks, strict=True)):
            buffers = master_buffers if k == 0 else {n: b.clone() for n, b in master_buffers.items()}
            outputs.append(torch.func.functional_call(self.module, (p, buffers), (chunk,)))
        self.inspector.after_apply(outputs)
        return torch.cat(outputs)


def dp_check(ctx: RankContext, refs: References, devices: Sequence[int] | None = None) -> dict[str, Any]:
    """DataParallel over the set's devices (run in rank 0, which sees them all) against the reference.

    ``devices`` are the set's local CUDA device indices (default: one per rank, from 0).
    """
    steps = int(ctx.spec["steps"])
    model = _fresh_model(ctx, ctx.device)
    amp = AmpStep.for_spec(ctx.spec, ctx.device)
    model.register_forward_pre_hook(autocast_dtype_hook(amp))  # replicas share the hook
    inspector = _ReplicaInspector(ctx, model)
    if ctx.is_cuda:
        wrapped = _cuda_data_parallel(
            ctx, model, inspector, list(devices) if devices is not None else list(range(ctx.world))
        )
    else:
        wrapped = CpuDataParallel(model, ctx.world, inspector)
    opt = _optimizer(model.parameters(), float(ctx.spec["lr"]))
    losses: list[float] = []
    nonfinite_grad_steps: list[int] = []
    started = time.perf_counter()
    for step in range(steps):
        inspector.step = step
        images, labels = synthetic_batch(int(ctx.spec["seed"]), step, int(ctx.spec["batch_size"]) * ctx.world)
        opt.zero_grad(set_to_none=True)
        with amp.autocast():
            loss = F.cross_entropy(wrapped(images.to(ctx.device)), labels.to(ctx.device))
        amp.backward(loss)
        if not _all_finite([p.grad for p in model.parameters()]):
            nonfinite_grad_steps.append(step)
        amp.step(opt, list(model.parameters()), step, loss)
        losses.append(float(loss.detach()))
        ctx.progress("dp", "step", step + 1, steps)
    ctx.sync()
    wall_s = time.perf_counter() - started
    return {
        "replicas": ctx.world,
        "path": "torch.nn.DataParallel" if ctx.is_cuda else "DataParallel algorithm on CPU (CpuDataParallel)",
        "losses": losses,
        "nonfinite_grad_steps": nonfinite_grad_steps,
        "replica_mismatches": inspector.mismatches,
        "param_max_abs_diff_vs_ref": _max_abs_diff(list(model.parameters()), refs.first["params"]),
        "wall_s": wall_s,
        **refs.metrics(),
        **amp.metrics(),
    }


# --- ddp ----------------------------------------------------------------------------------------------


def _corrupting_hook(ctx: RankContext, state: dict[str, int]) -> Callable[..., Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # Left unannotated: DDP rejects a hook whose annotations are not the real types, and this module's
    # postponed annotations would turn them into strings.
    def hook(process_group, bucket):  # type: ignore[no-untyped-def]
        fut = allreduce_hook(process_group, bucket)
        if ctx.rank != ctx.inject_rank or state["step"] != ctx.inject_step or state["done"]:
            return fut
        state["done"] = 1

        def perturb(done: Any) -> torch.Tensor:
            reduced = done.value()
            reduced.view(-1)[0] += CORRUPT_DELTA
            return reduced

        return fut.then(perturb)

    return hook


def ddp_check(ctx: RankContext, refs: References | None, group: Any = None) -> dict[str, Any]:
    """DistributedDataParallel, one rank per device; parameters compared across ranks after every step.

    Only rank 0 gets the reference (``refs``); the others pass ``None``.
    """
    from torch.nn.parallel import DistributedDataParallel

    steps = int(ctx.spec["steps"])
    model = _fresh_model(ctx, ctx.device)
    amp = AmpStep.for_spec(ctx.spec, ctx.device)
    ddp = DistributedDataParallel(
        model, device_ids=[ctx.device.index] if ctx.is_cuda else None, process_group=group
    )
    state = {"step": 0, "done": 0}
    if ctx.fault("corrupt", "ddp"):
        # The hook's state is the group its all-reduce uses: None would mean the world group
        # (default_hooks._allreduce_fut), which in the rank pool holds other sets' ranks, and hangs.
        ddp.register_comm_hook(group, _corrupting_hook(ctx, state))
    opt = _optimizer(ddp.parameters(), float(ctx.spec["lr"]))
    losses = torch.zeros(steps, dtype=torch.float64, device=ctx.device)
    desync_steps: list[dict[str, Any]] = []
    nonfinite_grad_steps: list[int] = []
    started = time.perf_counter()
    for step in range(steps):
        state["step"] = step
        images, labels = _chunks(ctx, step)
        if ctx.rank == ctx.inject_rank and step == ctx.inject_step:
            hang_or_crash(ctx, "ddp", f"step {step}")
        opt.zero_grad(set_to_none=True)
        with amp.autocast():
            out = ddp(images[ctx.rank].to(ctx.device))
            loss = F.cross_entropy(out, labels[ctx.rank].to(ctx.device))
        if ctx.fault("nan", "ddp") and ctx.rank == ctx.inject_rank and step == ctx.inject_step:
            out.register_hook(lambda g: torch.full_like(g, float("nan")))
        plant_overflow(ctx, "ddp", out, step, ctx.rank)
        amp.backward(loss)
        finite = _all_finite([p.grad for p in model.parameters()])
        amp.step(opt, list(model.parameters()), step, loss)
        losses[step] = loss.detach()
        # One small all-gather per step: both checksums and the finite flag of every rank.
        mine = torch.cat([checksum(list(model.parameters())), torch.tensor([int(finite)], device=ctx.device)])
        rows = [torch.empty_like(mine) for _ in range(ctx.world)]
        dist.all_gather(rows, mine, group=group)
        table = torch.stack(rows).cpu()
        off = [r for r in range(ctx.world) if not torch.equal(table[r, :-1], table[0, :-1])]
        if off:
            desync_steps.append({"step": step, "ranks": off})
        if not bool(table[:, -1].all()):
            nonfinite_grad_steps.append(step)
        ctx.progress("ddp", "step", step + 1, steps)
    ctx.sync()
    wall_s = time.perf_counter() - started
    rank_losses = [torch.empty_like(losses) for _ in range(ctx.world)]
    dist.all_gather(rank_losses, losses, group=group)
    per_rank = torch.stack(rank_losses).cpu()
    if refs is None:
        return {}
    return {
        "ranks": ctx.world,
        "backend": dist.get_backend(group),
        "losses": per_rank.mean(dim=0).tolist(),
        "rank_losses": per_rank.tolist(),
        "desync_steps": desync_steps,
        "nonfinite_grad_steps": nonfinite_grad_steps,
        "param_max_abs_diff_vs_ref": _max_abs_diff(list(model.parameters()), refs.first["params"]),
        "wall_s": wall_s,
        **refs.metrics(),
        **amp.metrics(),
    }


# --- all-reduce ---------------------------------------------------------------------------------------


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


# --- numerics -----------------------------------------------------------------------------------------


def pin_numerics(torch_module: Any = torch) -> dict[str, Any]:
    """Make every rank and the reference compute the same way, and say how: the judge compares their
    curves, so kernel-choice noise must not read as ``diverged``.

    Deterministic algorithms (``warn_only``: some ResNet backward kernels, e.g. CUDA adaptive average
    pooling, have no deterministic version and would otherwise raise; see the list under
    ``torch.use_deterministic_algorithms``), deterministic cuDNN without benchmark autotuning, and no TF32.
    torch 2.9 and later take TF32 through ``fp32_precision``; mixing that with the older ``allow_tf32``
    flags is an error when read back, so the older flags are used only where the new API is missing.
    """
    torch_module.use_deterministic_algorithms(True, warn_only=True)
    backends = torch_module.backends
    backends.cudnn.deterministic = True
    backends.cudnn.benchmark = False
    tf32: dict[str, Any]
    if hasattr(backends, "fp32_precision"):
        backends.fp32_precision = "ieee"
        backends.cuda.matmul.fp32_precision = "ieee"
        backends.cudnn.conv.fp32_precision = "ieee"
        backends.cudnn.rnn.fp32_precision = "ieee"
        tf32 = {
            "api": "fp32_precision",
            "matmul": backends.cuda.matmul.fp32_precision,
            "cudnn_conv": backends.cudnn.conv.fp32_precision,
            "cudnn_rnn": backends.cudnn.rnn.fp32_precision,
        }
    else:
        backends.cuda.matmul.allow_tf32 = False
        backends.cudnn.allow_tf32 = False
        tf32 = {
            "api": "allow_tf32",
            "matmul_allow_tf32": backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": backends.cudnn.allow_tf32,
        }
    return {
        "deterministic_algorithms": bool(torch_module.are_deterministic_algorithms_enabled()),
        "deterministic_warn_only": bool(torch_module.is_deterministic_algorithms_warn_only_enabled()),
        "cudnn_deterministic": bool(backends.cudnn.deterministic),
        "cudnn_benchmark": bool(backends.cudnn.benchmark),
        "tf32": tf32,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


# --- NCCL transports ----------------------------------------------------------------------------------


def nccl_transports(ctx: RankContext) -> list[dict[str, Any]]:
    """Which transport each NCCL connection of this launch used, from the ranks' INIT logs (rank 0 reads
    every rank's file; they share ``out_dir``). Empty on gloo."""
    from gputopo.probe.environment import parse_transport_lines, summarize_transports

    connections = []
    log_dir = ctx.log_dir or ctx.out_dir
    ranks = ctx.spec.get("ranks")  # in the pool: only the set's ranks' logs (named by pool rank)
    for path in sorted(log_dir.glob("nccl-rank*.log")):
        if ranks is not None and int(path.stem.removeprefix("nccl-rank")) not in ranks:
            continue
        connections += parse_transport_lines(path.read_text(errors="replace").splitlines())
    return summarize_transports(connections)


# --- p2p ----------------------------------------------------------------------------------------------

P2P_WARMUP_COPIES = 5
P2P_TIMED_COPIES = 20  # p2pBandwidthLatencyTest and nvbandwidth time tens of copies; one is ~1 ms on NVLink
P2P_LATENCY_BYTES = 4
P2P_LATENCY_COPIES = 100
# Cycles of the spin kernel queued before the timed copies, so the GPU starts them only once the host has
# queued them all and the events time the copies, not Python (p2pBandwidthLatencyTest's delay kernel).
SPIN_CYCLES = 50_000_000
PATH_P2P = "p2p"
PATH_STAGED = "staged"


def pair_pattern(nbytes: int, seed: int, src: int, dst: int) -> torch.Tensor:
    """The random bytes copied from GPU ``src`` to ``dst``: different for every pair and direction, so a
    copy that lands in the wrong buffer, or not at all, cannot match by accident."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + src * 1_009 + dst + 1)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def sentinel_of(pattern: torch.Tensor) -> torch.Tensor:
    """The pattern's complement: every byte differs from the byte the copy should write there."""
    return torch.bitwise_not(pattern)


class CopyEngine:
    """How the p2p check makes, waits for and times copies between devices.

    This base works on any device with host timing and no synchronisation (CPU tensors), which is how the
    tests drive the data check; ``CudaEngine`` is the GPU one. Subclasses may override ``copy`` only.
    """

    timing = "host clock (perf_counter)"

    def device(self, index: int) -> torch.device:
        """The torch device of local device ``index``."""
        return torch.device("cpu")

    def can_access_peer(self, src: int, dst: int) -> bool:
        """Whether ``src`` can write ``dst``'s memory directly (CUDA's cudaDeviceCanAccessPeer)."""
        return True

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One copy, queued (on GPUs it may still be running when this returns)."""
        dst.copy_(src)

    def sync(self, *indices: int) -> None:
        """Wait until everything queued on these devices is done."""

    def time_copies(
        self, directions: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, copies: int
    ) -> float:
        """Seconds for ``copies`` rounds, each making every (dst, src) copy once, after ``warmup`` rounds."""
        for _ in range(warmup):
            for dst, src in directions:
                self.copy(dst, src)
        started = time.perf_counter()
        for _ in range(copies):
            for dst, src in directions:
                self.copy(dst, src)
        return time.perf_counter() - started


class CudaEngine(CopyEngine):
    """Copies with ``Tensor.copy_`` and times them with CUDA events, as p2pBandwidthLatencyTest does.

    torch runs a cross-device copy on the source device's current stream, after a two-way barrier with the
    destination device's current stream (aten/src/ATen/native/cuda/Copy.cu, copy_device_to_device). Each
    direction therefore gets a stream of its own on both devices, or the two directions of a
    bidirectional measurement would wait for each other through those barriers.
    """

    timing = "CUDA events"

    def device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    def can_access_peer(self, src: int, dst: int) -> bool:
        # cudaDeviceCanAccessPeer. Without peer access a device-to-device copy still succeeds: the CUDA
        # Programming Guide ("Peer-to-Peer Memory Copy") says only with peer access enabled does the copy
        # no longer go through the host, so a passing copy alone proves no peer-to-peer path.
        return bool(torch.cuda.can_device_access_peer(src, dst))

    def sync(self, *indices: int) -> None:
        for index in indices:
            torch.cuda.synchronize(index)

    def _round(
        self, directions: list[tuple[torch.Tensor, torch.Tensor]], streams: list[tuple[Any, Any]]
    ) -> None:
        for (dst, src), (on_src, on_dst) in zip(directions, streams, strict=True):
            before = torch.cuda.current_device()
            previous = [torch.cuda.current_stream(src.device), torch.cuda.current_stream(dst.device)]
            torch.cuda.set_stream(on_dst)
            torch.cuda.set_stream(on_src)
            try:
                self.copy(dst, src)
            finally:
                for stream in previous:
                    torch.cuda.set_stream(stream)
                torch.cuda.set_device(before)

    def time_copies(
        self, directions: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, copies: int
    ) -> float:
        streams = [(torch.cuda.Stream(src.device), torch.cuda.Stream(dst.device)) for dst, src in directions]
        devices = sorted({t.device.index for pair in directions for t in pair})
        for _ in range(warmup):
            self._round(directions, streams)
        self.sync(*devices)
        timer = streams[0][0]
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(timer):
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(SPIN_CYCLES)
            start.record(timer)
        for on_src, on_dst in streams:
            on_src.wait_event(start)
            on_dst.wait_event(start)
        for _ in range(copies):
            self._round(directions, streams)
        for on_src, _ in streams[1:]:
            done = torch.cuda.Event()
            done.record(on_src)
            timer.wait_event(done)
        stop.record(timer)
        stop.synchronize()
        self.sync(*devices)
        return start.elapsed_time(stop) / 1e3  # milliseconds


def checked_copy(
    engine: CopyEngine, dst: torch.Tensor, src: torch.Tensor, expected: torch.Tensor, devices: tuple[int, ...]
) -> int:
    """Copy ``src`` into ``dst`` and count the bytes of ``dst`` that differ from ``expected`` (host).

    ``dst`` first gets ``expected``'s complement from the host and the devices are synchronised, so a
    write that never lands (an IOMMU fault drops it) leaves a byte that cannot compare equal, whatever
    the allocator left in that memory before. The comparison reads ``dst`` back with a plain
    device-to-host copy, not through the path under test.
    """
    dst.copy_(sentinel_of(expected))
    engine.sync(*devices)
    engine.copy(dst, src)
    engine.sync(*devices)
    return int((dst.cpu() != expected).sum())


class _Corrupting(CopyEngine):
    """``--inject corrupt``: a copy into a chosen destination lands with one byte changed."""

    def __init__(self, inner: CopyEngine, hit: Callable[[torch.Tensor], bool]) -> None:
        self.inner = inner
        self.hit = hit
        self.timing = inner.timing

    def device(self, index: int) -> torch.device:
        return self.inner.device(index)

    def can_access_peer(self, src: int, dst: int) -> bool:
        return self.inner.can_access_peer(src, dst)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.inner.copy(dst, src)
        if self.hit(dst):
            dst.view(-1)[0] ^= 0x5A

    def sync(self, *indices: int) -> None:
        self.inner.sync(*indices)

    def time_copies(
        self, directions: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, copies: int
    ) -> float:
        return self.inner.time_copies(directions, warmup, copies)


def p2p_matrix(
    engine: CopyEngine,
    devices: Sequence[int],
    labels: Sequence[int],
    *,
    nbytes: int = P2P_BYTES,
    seed: int = 0,
    warmup: int = P2P_WARMUP_COPIES,
    copies: int = P2P_TIMED_COPIES,
    latency_copies: int = P2P_LATENCY_COPIES,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Every ordered pair of ``devices`` from this one process: data-checked copies there and back,
    bandwidth one way and both ways, and small-copy latency.

    ``labels[k]`` is the GPU index reported for ``devices[k]``. A pair without peer access is still
    copied and checked (torch then stages the copy through host memory) but marked ``staged``: its
    numbers say nothing about a peer-to-peer path.
    """
    pairs: dict[tuple[int, int], dict[str, Any]] = {}
    unordered = list(combinations(range(len(devices)), 2))
    for n, (a, b) in enumerate(unordered):
        buffers = {}
        for i, j in ((a, b), (b, a)):
            src_dev, dst_dev = devices[i], devices[j]
            pattern = pair_pattern(nbytes, seed, labels[i], labels[j])
            src = pattern.to(engine.device(src_dev))
            there = torch.empty(nbytes, dtype=torch.uint8, device=engine.device(dst_dev))
            back = torch.empty(nbytes, dtype=torch.uint8, device=engine.device(src_dev))
            both = (src_dev, dst_dev)
            wrong_there = checked_copy(engine, there, src, pattern, both)
            wrong_back = checked_copy(engine, back, there, pattern, both)
            seconds = engine.time_copies([(there, src)], warmup, copies)
            small_seconds = engine.time_copies(
                [(there[:P2P_LATENCY_BYTES], src[:P2P_LATENCY_BYTES])], warmup, latency_copies
            )
            can = engine.can_access_peer(src_dev, dst_dev)
            pairs[(i, j)] = {
                "src": labels[i],
                "dst": labels[j],
                "can_access_peer": can,
                "path": PATH_P2P if can else PATH_STAGED,
                "wrong_bytes_there": wrong_there,
                "wrong_bytes_roundtrip": wrong_back,
                "unidir_gbps": nbytes * copies / seconds / 1e9 if seconds > 0 else None,
                "latency_us": small_seconds / latency_copies * 1e6,
            }
            buffers[(i, j)] = (there, src)
        seconds = engine.time_copies([buffers[(a, b)], buffers[(b, a)]], warmup, copies)
        both_ways = 2 * nbytes * copies / seconds / 1e9 if seconds > 0 else None
        pairs[(a, b)]["bidir_gbps"] = pairs[(b, a)]["bidir_gbps"] = both_ways
        del buffers
        if progress is not None:
            progress(n + 1, len(unordered))
    order = [pairs[(i, j)] for i in range(len(devices)) for j in range(len(devices)) if i != j]
    return {
        "gpus": list(labels),
        "bytes": nbytes,
        "warmup_copies": warmup,
        "timed_copies": copies,
        "latency_bytes": P2P_LATENCY_BYTES,
        "latency_copies": latency_copies,
        "timing": engine.timing,
        "check": "sentinel-filled destination, every byte compared on the host, there and back",
        "pairs": order,
    }


def p2p_check(
    ctx: RankContext,
    devices: Sequence[int] | None = None,
    engine: CopyEngine | None = None,
    nbytes: int = P2P_BYTES,
) -> dict[str, Any]:
    """The p2p matrix over the set's devices, driven from this one process (rank 0, which sees them all).

    ``devices`` are local device indices (default: one per rank); the reported labels are the set's GPU
    indices. ``--inject corrupt`` changes a byte of every copy into the injected rank's device.
    """
    devices = list(devices) if devices is not None else list(range(ctx.world))
    labels = [int(g) for g in ctx.spec["gpus"]][: len(devices)]
    engine = engine or CudaEngine()
    if ctx.fault("corrupt", "p2p"):
        target = engine.device(devices[min(ctx.inject_rank, len(devices) - 1)])
        engine = _Corrupting(engine, lambda t: t.device == target and t.numel() > P2P_LATENCY_BYTES)
    return p2p_matrix(
        engine,
        devices,
        labels,
        nbytes=nbytes,
        seed=int(ctx.spec.get("seed", 0)),
        progress=lambda done, total: ctx.progress("p2p", "pair", done, total),
    )
