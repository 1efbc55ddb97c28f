"""Process lists for kill-stale and NVML's name for a pid."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gputopo.system.nvml.answer import _MIB, DeviceFailed, _text
from gputopo.system.nvml.session import Device, Session

# --- Process lists for kill-stale (kept together, apart from the topology reads above) ---------------
#
# kill-stale must tell "NVML listed no process" from "NVML would not say": on a MIG GPU a caller without
# the privilege gets NO_PERMISSION for the whole list, and reading that as an empty list would call every
# process on the GPU invisible. So these calls keep the error instead of folding it into ``None``.

ProcessListKind = Literal["compute", "graphics", "mps"]

_LIST_FUNCTIONS: dict[str, str] = {
    "compute": "nvmlDeviceGetComputeRunningProcesses",
    "graphics": "nvmlDeviceGetGraphicsRunningProcesses",
    "mps": "nvmlDeviceGetMPSComputeRunningProcesses",
}


@dataclass(frozen=True)
class ProcessList:
    """One of a GPU's process lists: ``entries`` (pid, used MiB or ``None``) when NVML answered, else
    ``None`` with ``refused`` saying why (NVML's error text)."""

    kind: ProcessListKind
    entries: tuple[tuple[int, int | None], ...] | None
    refused: str | None = None


def process_list(dev: Device, kind: ProcessListKind) -> ProcessList:
    """The GPU's ``kind`` process list (compute, graphics, or MPS clients), errors kept.

    The unversioned call needs the v3 struct (driver >= 510); older drivers answer the ``_v2`` one. A GPU
    without graphics or MPS support has no such contexts, so NOT_SUPPORTED for those two is an empty list;
    for the compute list, and for any list on NO_PERMISSION, the list is unknown. A GPU that stopped
    answering raises ``DeviceFailed``.
    """
    session = dev.session
    base = _LIST_FUNCTIONS[kind]
    for name in (base, base + "_v2"):
        # A GPU that stopped answering raises DeviceFailed (the per-call rule: only a GPU that is gone fails).
        answer = dev._a(name)
        if session.missing(answer):
            continue  # bindings or driver without this version; a newer bindings' mismatch error too
        if answer.why is not None:
            if kind != "compute" and answer.code == session.code("NVML_ERROR_NOT_SUPPORTED"):
                return ProcessList(kind, ())
            return ProcessList(kind, None, answer.why)
        out = []
        for p in answer.value or ():
            used = getattr(p, "usedGpuMemory", None)
            out.append((int(p.pid), int(used) // _MIB if used is not None else None))
        return ProcessList(kind, tuple(out))
    if kind == "compute":
        return ProcessList(kind, None, "this driver cannot list compute processes")
    return ProcessList(kind, ())


def process_name(s: Session, pid: int) -> str | None:
    """NVML's name for ``pid`` (``nvmlSystemGetProcessName``), ``None`` when it cannot give one.

    The pid is in NVML's PID namespace. NVML appears to look the name up in the caller's ``/proc`` (in a
    container without the host's /proc, nvidia-smi shows host pids with no names: NVIDIA/nvidia-docker#1460
    and #1483), so a name that agrees is weak evidence on its own; kill-stale also requires the process to
    hold a GPU device file.
    """
    try:
        answer = s.query(f"pid {pid}", "nvmlSystemGetProcessName", pid)
    except DeviceFailed:
        return None
    return _text(answer.value) if answer.ok else None
