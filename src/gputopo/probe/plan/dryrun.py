"""``probe --dry-run``: the plan as data, without starting torch or CUDA (pure but for the environment).

Each launch lists its GPUs (NVML indices, and the UUIDs its ranks will see), its checks, and the
environment its ranks get that decides which device each uses and how NCCL behaves: exactly what
``launch.rank_environment`` will give them, filtered to those variables.
"""

from __future__ import annotations

from typing import Any

from gputopo.probe.plan.config import ProbeConfig
from gputopo.probe.plan.schedule import Plan

SCHEMA = "gputopo/probe-plan/v1"
# Variables that choose the device or tune NCCL/gloo: shown; the rest of the environment is not.
_SHOWN = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS")
_SHOWN_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_")


def plan_document(config: ProbeConfig, plan: Plan) -> dict[str, Any]:
    """The ``gputopo/probe-plan/v1`` document: device, the GPUs left out and why, and every launch.

    Every launch runs in one pool of ranks, one per GPU of the plan (``plan.gpus``; pool rank ``r``
    drives ``gpus[r]``), so each launch's ``env`` is the pool's and ``ranks`` says which pool ranks run it.
    """
    from gputopo.probe.plan.schedule import Job
    from gputopo.probe.plan.spec import rank_environment

    inv = config.inventory
    uuids = dict(zip(inv.gpus, inv.visible_ids, strict=False)) if inv.device == "cuda" else {}
    pool = plan.gpus
    env = rank_environment(config, Job(pool, ()), marker="dry-run")
    shown = {k: v for k, v in sorted(env.items()) if k in _SHOWN or k.startswith(_SHOWN_PREFIXES)}
    launches = []
    for number, rnd in enumerate(plan.rounds):
        for job in rnd:
            launches.append(
                {
                    "round": number,
                    "gpus": list(job.gpus),
                    "ranks": [pool.index(g) for g in job.gpus],
                    "uuids": [uuids.get(g) for g in job.gpus] if uuids else None,
                    "bus_ids": [inv.bus_id(g) for g in job.gpus] if uuids else None,
                    "checks": list(job.checks),
                    "env": shown,
                }
            )
    return {
        "schema": SCHEMA,
        "device": config.device,
        "backend": config.backend,
        "gpus_allowed": list(inv.gpus),
        "left_out": [{"gpu": g, "why": why} for g, why in sorted(inv.why_not.items())],
        "note": inv.note,
        "pool": {"gpus": list(pool), "uuids": [uuids.get(g) for g in pool] if uuids else None, "env": shown},
        "launches": launches,
    }


def plan_text(doc: dict[str, Any]) -> str:
    """The plan for people: one block per launch."""
    lines = [f"Probe plan ({doc['device']}, {doc['backend']}); nothing is started."]
    if doc.get("note"):
        lines.append(doc["note"])
    for left in doc["left_out"]:
        lines.append(f"GPU{left['gpu']} left out: {left['why']}")
    pool = ",".join(str(g) for g in doc["pool"]["gpus"])
    lines.append(f"one rank per GPU {pool}; every rank's environment:")
    for key, value in doc["pool"]["env"].items():
        lines.append(f"    {key}={value}")
    for launch in doc["launches"]:
        gpus = ",".join(str(g) for g in launch["gpus"])
        lines.append(f"round {launch['round']}: GPUs {gpus}: {' '.join(launch['checks'])}")
    return "\n".join(lines)
