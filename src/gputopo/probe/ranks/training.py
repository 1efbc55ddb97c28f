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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gputopo.probe.ranks.amp import AmpStep, autocast_dtype_hook, plant_overflow
from gputopo.probe.ranks.context import (
    CORRUPT_DELTA,
    RankContext,
    all_finite,
    checksum,
    chunks,
    fresh_model,
    hang_or_crash,
    optimizer,
    wait_for_others,
)
from gputopo.probe.ranks.models import synthetic_batch

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
    model = fresh_model(ctx, ctx.device)
    opt = optimizer(model.parameters(), float(ctx.spec["lr"]))
    amp = AmpStep.for_spec(ctx.spec, ctx.device)  # --precision: autocast, and a GradScaler for fp16
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(steps):
        images, labels = chunks(ctx, step)
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
    measures how far an equally valid run strays from it. Run 2 is run only when a check's curve leaves
    the fixed tolerance (``second_run_if_needed``): until then ``second_losses`` is ``None``."""

    first: dict[str, Any]
    second_losses: list[float] | None
    second_device: str

    def metrics(self) -> dict[str, Any]:
        """Reference losses of both runs, for the judge (``ref2_losses`` empty when run 2 was not needed)."""
        return {
            "ref_losses": self.first["losses"],
            "ref2_losses": self.second_losses if self.second_losses is not None else [],
            "ref2_run": self.second_losses is not None,
            "ref_wall_s": self.first["wall_s"],
            "ref2_device": self.second_device if self.second_losses is not None else None,
            "ref_scaler": self.first.get("amp", {}).get("scaler"),
        }


def _second_rank(ctx: RankContext) -> int:
    return 1 if ctx.world > 1 else 0


def reference_runs(ctx: RankContext, group: Any = None) -> References | None:
    """Reference run 1 in rank 0 (the others wait); run 2 waits until a check needs it.

    Collective: every rank calls it; rank 0 gets the ``References``, the others ``None``.
    """
    first = reference_run(ctx, "run 1", per_chunk_backward=False) if ctx.rank == 0 else None
    wait_for_others(ctx, group)
    if ctx.rank != 0:
        return None
    assert first is not None
    return References(first, None, f"{ctx.device.type} rank {_second_rank(ctx)}")


def second_run_if_needed(
    ctx: RankContext, refs: References | None, losses: list[float] | None, tol: float, group: Any = None
) -> None:
    """Reference run 2 (in rank 1, rank 0 when it is alone), only when it can change a verdict.

    Run 2 sets the noise floor, and the judge allows a gap of ``max(NOISE_FACTOR x floor, ABS_TOL +
    tol x |reference|)`` (``verdict.allowed_gap``): it can only widen the fixed tolerance. A check whose
    every step is within the fixed tolerance of run 1 passes the curve whatever run 2 says, so run 2 is
    run only for a curve that leaves it (and then once for the launch: ``refs`` keeps it). Collective
    over the set: rank 0 decides (``losses``, ``refs``: its own), every rank learns it through one
    all-reduce of a flag on the CPU group. On GPUs, run 2 on a second device also folds that device's
    kernel nondeterminism into the noise floor.
    """
    from gputopo.probe.judge.verdict import judge_curve

    need = 0
    if ctx.rank == 0 and refs is not None and refs.second_losses is None:
        need = int(not judge_curve(list(losses or []), refs.first["losses"], [], tol).ok)
    flag = torch.tensor([need], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.wait_group if ctx.wait_group is not None else group)
    if not int(flag):
        return
    second_rank = _second_rank(ctx)
    second = reference_run(ctx, "run 2", per_chunk_backward=True) if ctx.rank == second_rank else None
    path = ctx.out_dir / "reference-run2.json"
    if second is not None and second_rank != 0:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(second["losses"]))
        os.replace(tmp, path)
    wait_for_others(ctx, group)
    if ctx.rank == 0 and refs is not None:
        refs.second_losses = second["losses"] if second is not None else json.loads(path.read_text())


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
    model = fresh_model(ctx, ctx.device)
    amp = AmpStep.for_spec(ctx.spec, ctx.device)
    model.register_forward_pre_hook(autocast_dtype_hook(amp))  # replicas share the hook
    inspector = _ReplicaInspector(ctx, model)
    if ctx.is_cuda:
        wrapped = _cuda_data_parallel(
            ctx, model, inspector, list(devices) if devices is not None else list(range(ctx.world))
        )
    else:
        wrapped = CpuDataParallel(model, ctx.world, inspector)
    opt = optimizer(model.parameters(), float(ctx.spec["lr"]))
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
        if not all_finite([p.grad for p in model.parameters()]):
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
    model = fresh_model(ctx, ctx.device)
    amp = AmpStep.for_spec(ctx.spec, ctx.device)
    ddp = DistributedDataParallel(
        model, device_ids=[ctx.device.index] if ctx.is_cuda else None, process_group=group
    )
    state = {"step": 0, "done": 0}
    if ctx.fault("corrupt", "ddp"):
        # The hook's state is the group its all-reduce uses: None would mean the world group
        # (default_hooks._allreduce_fut), which in the rank pool holds other sets' ranks, and hangs.
        ddp.register_comm_hook(group, _corrupting_hook(ctx, state))
    opt = optimizer(ddp.parameters(), float(ctx.spec["lr"]))
    losses = torch.zeros(steps, dtype=torch.float64, device=ctx.device)
    desync_steps: list[dict[str, Any]] = []
    nonfinite_grad_steps: list[int] = []
    started = time.perf_counter()
    for step in range(steps):
        state["step"] = step
        images, labels = chunks(ctx, step)
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
        finite = all_finite([p.grad for p in model.parameters()])
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
