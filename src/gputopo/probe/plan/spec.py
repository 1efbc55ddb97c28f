"""What one job's ranks are given: the spec they read (options, checks, where a planted fault goes)
and the environment they start in (device visibility, threads, the run's marker). Pure: built from the
config and the plan, without starting anything (``--dry-run`` shows it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputopo.probe.plan.config import ProbeConfig
from gputopo.probe.plan.schedule import Job

MARKER_ENV = "GPUTOPO_PROBE_RUN"


# Which checks a planted fault reaches. A hang or crash ends the launch, so it goes into the first
# distributed check only (see ``inject_checks``).
_FAULT_CHECKS = {
    "nan": ("dp", "ddp"),
    "overflow": ("dp", "ddp"),
    "corrupt": ("p2p", "dp", "ddp", "allreduce"),
    "sdc": ("gpu",),
    "slow": ("gpu",),
}


_HALTING_SITES = ("dp", "ddp", "allreduce")
# Where a hang or crash goes when the set runs none of those: the per-GPU check.
_LAST_HALTING_SITE = "gpu"


@dataclass(frozen=True)
class FaultSite:
    """Where a planted fault goes in one job: which checks, and which ranks of its set."""

    checks: tuple[str, ...] = ()
    rank: int | None = None
    ranks: tuple[int, ...] | None = None


def inject_checks(fault: str | None, checks: tuple[str, ...]) -> tuple[str, ...]:
    """The checks of a set that carry the planted fault ``fault``."""
    if fault is None:
        return ()
    if fault in _FAULT_CHECKS:
        # By base name: ``dp@fp16`` is the dp check at another precision (gputopo.probe.judge.precision).
        return tuple(c for c in checks if c.partition("@")[0] in _FAULT_CHECKS[fault])
    first = next((c for c in checks if c.partition("@")[0] in _HALTING_SITES), None)
    if first is None and _LAST_HALTING_SITE in checks:
        first = _LAST_HALTING_SITE
    return (first,) if first else ()


def fault_site(config: ProbeConfig, gpus: tuple[int, ...], set_checks: tuple[str, ...]) -> FaultSite:
    """Where ``--inject`` goes in the set ``gpus`` whose checks are ``set_checks``.

    Without ``--inject-gpus`` every set gets the fault in rank ``--inject-rank``. With it, only the sets
    holding every GPU named get it, in the rank of the last one named, and the p2p check corrupts only
    the copies between the named GPUs.
    """
    fault = config.inject.value if config.inject else None
    if fault is None:
        return FaultSite()
    named = config.inject_gpus
    if named:
        if not set(named) <= set(gpus):
            return FaultSite()
        ranks = tuple(gpus.index(g) for g in named)
        return FaultSite(inject_checks(fault, set_checks), ranks[-1], ranks)
    return FaultSite(inject_checks(fault, set_checks), config.inject_rank)


def job_spec(
    config: ProbeConfig,
    job: Job,
    checks: tuple[str, ...],
    out_dir: Path,
    set_checks: tuple[str, ...] | None = None,
    ranks: tuple[int, ...] | None = None,
    job_id: str = "job",
) -> dict[str, Any]:
    """What the ranks of ``job`` read: the run's options, the checks to run, and the fault's site.

    ``set_checks`` are every check of the job's set in this run (a set's checks may be split over
    several jobs; a hang goes into the set's first distributed check only); ``ranks`` the pool ranks
    that run it, in the set's order.
    """
    site = fault_site(config, job.gpus, set_checks if set_checks is not None else checks)
    return {
        "id": job_id,
        "device": config.device,
        "gpus": list(job.gpus),
        "ranks": list(ranks if ranks is not None else range(len(job.gpus))),
        "checks": list(checks),
        "model": config.model,
        "batch_size": config.batch_size,
        "steps": config.steps,
        "lr": config.lr,
        "seed": config.seed,
        "timeout_s": config.timeout_s,
        "sweep_bytes": list(config.sweep_bytes),
        "iters": config.iters,
        "inject": config.inject.value if site.checks else None,
        "inject_rank": site.rank,
        "inject_ranks": list(site.ranks) if site.ranks is not None else None,
        "inject_checks": [c for c in site.checks if c in checks],
        "out_dir": str(out_dir),
        # The per-GPU check's matmul precision: the first --precision.
        "precision": config.precisions[0],
    }


def rank_environment(config: ProbeConfig, job: Job, marker: str) -> dict[str, str]:
    """The launcher's (and so every pool rank's) environment: device visibility, threads, the marker.

    ``job.gpus`` is the pool's union of GPUs: every rank sees all of them (pool rank ``r`` drives the
    ``r``-th), so the rank that runs DataParallel for a set can reach that set's devices.
    """
    env = dict(os.environ)
    env[MARKER_ENV] = marker
    env["PYTHONUNBUFFERED"] = "1"
    if config.device == "cuda":
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so CUDA numbers GPUs as nvidia-smi does
        visible = config.visible_devices(job.gpus)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks must not start CUDA on a GPU machine
        # One thread per rank: ranks already fill the cores, and oversubscription slows every step.
        env["OMP_NUM_THREADS"] = "1"
        # glibc hands every allocation over 128 KiB (a batch, an activation, a gradient) back to the
        # kernel when it is freed and faults it in again, zeroed, at the next step: on 8 stand-ins that
        # was a quarter of the doctor's CPU, as system time. Kept in the heap up to glibc's largest
        # threshold, and the heap not trimmed, the next step reuses the pages (mallopt(3), "Environment
        # variables"; another libc ignores the names). A user's own setting is kept.
        for name, value in CPU_RANK_MALLOC.items():
            env.setdefault(name, value)
    return env


# glibc's malloc tunables for CPU ranks (``rank_environment``): 32 MiB is the largest mmap threshold glibc
# accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), and a trim threshold of 1 GiB keeps freed pages.
CPU_RANK_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
