"""kill-stale's JSON document (``gputopo/stale/v1``): pure, a ``StaleRun`` in, plain data out. Used by
``gputopo kill-stale --json`` and by doctor's stale section."""

from __future__ import annotations

from typing import Any

from gputopo.procs.stale import HolderOutcome, StaleRun

SCHEMA = "gputopo/stale/v1"


def stale_document(run: StaleRun) -> dict[str, Any]:
    """The ``--json`` document (schema ``gputopo/stale/v1``)."""
    return {
        "schema": SCHEMA,
        "dry_run": run.dry_run,
        "source": run.source,
        "device_glob": run.device_glob,
        "device_files": list(run.device_files),
        "policy": {
            "all": run.policy.all,
            "all_users": run.policy.all_users,
            "pids": sorted(run.policy.pids) if run.policy.pids is not None else None,
            "older_than_s": run.policy.older_than_s,
            "grace_s": run.grace_s,
        },
        "nvml": {
            "available": run.nvml.available,
            "sees_pid_namespace": run.nvml.sees_pid_namespace,
            "pids_usable": run.nvml.process_pids_usable,
            "pid_note": run.nvml.pid_note,
            "refused": {str(g): why for g, why in sorted(run.nvml.refused.items())},
        },
        "holders": [_holder_doc(h) for h in run.holders],
        "summary": {
            "holders": len(run.holders),
            "stale": sum(1 for h in run.holders if h.assessment.stale),
            "protected": sum(1 for h in run.holders if h.assessment.protected),
            "targeted": len(run.targeted),
            "not_stopped": len(run.not_stopped),
            "memory_freed_mib": run.memory_freed_mib,
        },
        "notes": list(run.notes),
    }


def _holder_doc(h: HolderOutcome) -> dict[str, Any]:
    a = h.assessment
    holder = a.holder
    info = holder.info
    return {
        "pid": info.pid,
        "create_time_s": info.create_time_s,
        "ppid": info.ppid,
        "user": info.user,
        "uid": info.uid,
        "name": info.name,
        "command": info.command,
        "status": info.status,
        "age_s": holder.age_s,
        "devices": list(holder.devices),
        "gpus": list(holder.gpus) if holder.gpus is not None else None,
        "gpu_basis": holder.gpu_basis,
        "kind": a.job.kind if a.job is not None else None,
        "marks": a.job.marks if a.job is not None else None,
        "parent": a.job.parent if a.job is not None else None,
        # Why it is stale (its reasons), else why it is not.
        "why": "; ".join(a.reasons) if a.reasons else (a.job.why if a.job is not None else None),
        "notes": list(a.notes),
        "gpu_memory_mib": holder.gpu_memory_mib,
        "nvml_listed": holder.nvml_listed,
        "stale": a.stale,
        "reasons": list(a.reasons),
        "protected": a.protected,
        "protected_reasons": list(a.protected_reasons),
        "spared_reasons": list(a.spared_reasons),
        "targeted": a.targeted,
        "target_pid": a.target.pid if a.target is not None else None,
        "action": h.action,
        "result": h.result.value if h.result is not None else None,
        "gone": h.gone,
        "detail": h.detail,
        "memory_freed_mib": h.memory_freed_mib,
    }
