"""Whether NVIDIA GPUs are present without asking NVML: the driver's device files and its procfs entries.

When NVML cannot start (driver/library mismatch, the module not loaded, a crashed driver) these still say
whether the machine has GPUs: ``/dev/nvidia0``, ``/dev/nvidia1``, ... (one per GPU; ``nvidiactl`` and
``nvidia-uvm`` are not GPUs) and ``/proc/driver/nvidia/gpus/<bus id>/`` (one folder per GPU the kernel
module bound). ``GPUTOPO_DEV_ROOT`` moves the device folder (tests, containers with the host's /dev
mounted elsewhere); procfs is read through ``system.sysfs``'s view (``GPUTOPO_PROCFS_ROOT``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEV_ENV = "GPUTOPO_DEV_ROOT"
_GPU_NODE = re.compile(r"nvidia(\d+)$")


@dataclass(frozen=True)
class NvidiaDevices:
    """The GPU device files (``/dev/nvidiaN``) and the bus ids under ``/proc/driver/nvidia/gpus``."""

    device_files: tuple[str, ...]
    proc_gpus: tuple[str, ...]
    module: str | None = None

    @property
    def count(self) -> int:
        return max(len(self.device_files), len(self.proc_gpus))

    def words(self) -> str:
        parts = []
        if self.device_files:
            parts.append(f"{len(self.device_files)} /dev/nvidia[0-9]* device files")
        if self.proc_gpus:
            parts.append(f"{len(self.proc_gpus)} GPUs in /proc/driver/nvidia/gpus")
        return " and ".join(parts) or "no NVIDIA device files"


def _names(folder: Path) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def read_nvidia_devices() -> NvidiaDevices:
    """What the device files and procfs say (empty where neither exists or they cannot be listed)."""
    from gputopo.system.sysfs import view

    dev = Path(os.environ.get(DEV_ENV) or "/dev")
    nvidia = view().proc_path("driver", "nvidia")
    files = tuple(f"/dev/{n}" for n in _names(dev) if _GPU_NODE.match(n))
    gpus = tuple(_names(nvidia / "gpus"))
    return NvidiaDevices(files, gpus, _module_version(nvidia / "version"))


def _module_version(path: Path) -> str | None:
    """The loaded kernel module's version from ``/proc/driver/nvidia/version`` ("NVRM version: NVIDIA UNIX
    x86_64 Kernel Module  570.86.15  ..."): what a library of another version fails against."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            first = fh.readline(4096)
    except OSError:
        return None
    m = re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+(?:\.\d+)+)", first)
    return m.group(1) if m else None
