"""What a set is chosen by (``Constraints``) and which GPUs that leaves out before any search, each
with its reason (``exclusions``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gputopo.errors import UsageError
from gputopo.model import Topology
from gputopo.recommend.evidence import ProbeEvidence
from gputopo.topology.bandwidth import Assumptions

DEFAULT_MAX_USED_MIB = 1024


DEFAULT_TOP = 5


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """What the user asked for: set size ``n``, optional ``sets`` to pack, and what to leave out."""

    n: int
    sets: int | None = None
    exclude: tuple[int, ...] = ()
    allow_busy: bool = False
    max_used_mib: int = DEFAULT_MAX_USED_MIB
    top: int = DEFAULT_TOP
    assumptions: Assumptions = field(default_factory=Assumptions)
    evidence: ProbeEvidence | None = None
    # The GPUs a scheduler's preset CUDA_VISIBLE_DEVICES allows (nvidia-smi numbering), and the reason
    # every other GPU is left out; ``None`` when nothing is preset (or --ignore-visible-devices).
    allowed: tuple[int, ...] | None = None
    outside_allowed: str = "outside CUDA_VISIBLE_DEVICES"
    # GPUs with a health problem (``health.judge.Judgement.unhealthy_gpus``), each with the problem in
    # words; left out unless ``allow_unhealthy``. Empty when health was not read (``--input``).
    unhealthy: tuple[tuple[int, str], ...] = ()
    allow_unhealthy: bool = False
    # GPUs whose driver asks to keep peer-to-peer work off them (NVML recovery action DRAIN_P2P), each with
    # the finding: left out of every set of two or more GPUs (unless ``allow_unhealthy``); one GPU may.
    no_p2p: tuple[tuple[int, str], ...] = ()
    # GPU pairs whose PCIe path crosses a bridge where ACS redirects peer traffic, with those bridges
    # (``fabric.redirected``, live machines only): a set holding one ranks after an equally fast set without.
    redirected: tuple[tuple[int, int, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class Exclusion:
    """A GPU left out of every set, and why (``--exclude``, failing, busy, probe)."""

    gpu: int
    why: str


def exclusions(topo: Topology, constraints: Constraints) -> tuple[Exclusion, ...]:
    """GPUs no set may use, each with its reasons: ``--exclude``, failing, not accessible, not responding,
    MIG enabled, a health problem (unless ``allow_unhealthy``), busy, failed alone in a probe."""
    known = set(topo.gpu_indices)
    for g in constraints.exclude:
        if g not in known:
            raise UsageError(
                f"--exclude {g}: there is no GPU{g} on {topo.source}", f"GPUs there: {_list(sorted(known))}"
            )
    alone = {
        f.gpus[0]: f.why
        for f in (constraints.evidence.failed if constraints.evidence else ())
        if len(f.gpus) == 1
    }
    sick = dict(constraints.unhealthy)
    no_p2p = dict(constraints.no_p2p)
    out = []
    for gpu in sorted(topo.gpus, key=lambda g: g.index):
        why = []
        if gpu.index in constraints.exclude:
            why.append("excluded by --exclude")
        if constraints.allowed is not None and gpu.index not in constraints.allowed:
            why.append(constraints.outside_allowed)
        # Failing, not accessible from here, not responding, or MIG enabled (CUDA sees MIG devices, not
        # the GPU, and NCCL does not run on them): no set can use it.
        unavailable = gpu.unavailable_reason
        if unavailable:
            why.append(unavailable)
        if gpu.index in alone:
            why.append(alone[gpu.index])
        if not constraints.allow_busy:
            if gpu.compute_pids:
                pids = ", ".join(str(pid) for pid in gpu.compute_pids[:4]) + (
                    ", ..." if len(gpu.compute_pids) > 4 else ""
                )
                plural = "es" if len(gpu.compute_pids) > 1 else ""
                why.append(f"busy: {len(gpu.compute_pids)} compute process{plural} (pid {pids})")
            if gpu.memory_used_mib is not None and gpu.memory_used_mib > constraints.max_used_mib:
                why.append(
                    f"busy: {gpu.memory_used_mib} MiB in use (over --max-used-mib {constraints.max_used_mib})"
                )
        if gpu.index in sick and not constraints.allow_unhealthy and not unavailable:
            why.append(f"health: {sick[gpu.index]}")
        elif (
            gpu.index in no_p2p and constraints.n > 1 and not constraints.allow_unhealthy and not unavailable
        ):
            why.append(f"the driver asks to keep P2P work off it, so no multi-GPU set: {no_p2p[gpu.index]}")
        if why:
            out.append(Exclusion(gpu.index, "; ".join(why)))
    return tuple(out)


def _list(gpus: Sequence[int]) -> str:
    return ", ".join(str(g) for g in gpus)
