"""Who holds the GPU device files: parsing ``lsof -F`` output and building ``Holder`` records (pure).

The machine is read in ``gputopo.system.lsof`` into the plain data of ``gputopo.process_facts`` (the scan,
each process's facts, lsof's parsed ``-F`` output); this module only turns what was read into data:

- ``build_holders`` joins the open device files with the process facts (``ProcessInfo``) and what
  NVML says (``NvmlView``): which GPU each ``/dev/nvidiaN`` is (through NVML's minor number) and how
  much GPU memory each process uses.

A process is named by ``(pid, create_time)`` (``ProcessRef``), never by a bare pid, so a pid that the
kernel reuses for a new process is never mistaken for the old one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gputopo.process_facts import (  # noqa: F401 - the scan's types, as procs' callers know them
    HolderScan,
    OpenDevices,
    ProcessInfo,
    ProcessRef,
    parse_lsof_fields,
)

_GPU_DEVICE_RE = re.compile(r"nvidia(\d+)")


@dataclass(frozen=True)
class GpuMemoryUse:
    """One NVML process entry: a pid (in NVML's PID namespace) with a context on a GPU, its GPU memory
    (``None`` when NVML hides it), and the list it came from (``compute``, ``graphics`` or ``mps``)."""

    pid: int
    gpu_index: int
    used_memory_mib: int | None
    kind: str = "compute"


@dataclass(frozen=True)
class NvmlView:
    """What NVML says that kill-stale uses; every field is ``None`` when NVML is unavailable.

    ``processes`` are the compute, graphics and MPS client entries on all GPUs; ``minors`` maps a GPU
    index to the minor number N of its ``/dev/nvidiaN``. ``refused`` maps a GPU to why one of its lists is
    unknown: there, "not listed" proves nothing. ``pid_map`` maps NVML's pids to this PID namespace's
    (``procs.pidmap``), ``None`` when they cannot be matched; ``sees_pid_namespace`` says whether NVML's
    pids are this namespace's own, and ``pid_note`` how that was decided.
    """

    processes: tuple[GpuMemoryUse, ...] | None = None
    minors: Mapping[int, int] | None = None
    sees_pid_namespace: bool | None = None
    pid_map: Mapping[int, int] | None = None
    refused: Mapping[int, str] = field(default_factory=dict)
    pid_note: str | None = None

    @property
    def available(self) -> bool:
        """True when NVML answered at all."""
        return self.minors is not None or self.processes is not None

    @property
    def process_pids_usable(self) -> bool:
        """True when NVML's process list can be matched against this namespace's pids."""
        return self.processes is not None and (self.pid_map is not None or self.sees_pid_namespace is True)

    def local_pid(self, nvml_pid: int) -> int | None:
        """This namespace's pid for one of NVML's, ``None`` when it cannot be matched."""
        if self.pid_map is not None:
            return self.pid_map.get(nvml_pid)
        return nvml_pid if self.sees_pid_namespace is True else None

    def gpu_of_minor(self, minor: int) -> int | None:
        """The GPU index whose device file is ``/dev/nvidia<minor>``; ``None`` when unknown."""
        if self.minors is None:
            return None
        for index, m in self.minors.items():
            if m == minor:
                return index
        return None

    def gpus_by_pid(self) -> dict[int, tuple[int, ...]]:
        """``{local pid: GPU indices NVML lists it on}``, empty unless NVML's pids can be matched."""
        found: dict[int, set[int]] = {}
        if not self.process_pids_usable or self.processes is None:
            return {}
        for entry in self.processes:
            pid = self.local_pid(entry.pid)
            if pid is not None:
                found.setdefault(pid, set()).add(entry.gpu_index)
        return {pid: tuple(sorted(g)) for pid, g in found.items()}

    def memory_by_pid(self) -> dict[int, dict[int, int | None]]:
        """``{local pid: {gpu_index: used_memory_mib}}``, empty unless NVML's pids can be matched."""
        usage: dict[int, dict[int, int | None]] = {}
        if not self.process_pids_usable or self.processes is None:
            return usage
        for entry in self.processes:
            pid = self.local_pid(entry.pid)
            if pid is None:
                continue
            per_gpu = usage.setdefault(pid, {})
            previous = per_gpu.get(entry.gpu_index)
            # A process can appear as both a compute and a graphics user of one GPU with the same memory.
            if entry.gpu_index not in per_gpu or (previous is None and entry.used_memory_mib is not None):
                per_gpu[entry.gpu_index] = entry.used_memory_mib
        return usage


@dataclass(frozen=True)
class Holder:
    """A process holding GPU device files, with what is known about it.

    ``gpus`` are the GPUs it uses, ``None`` when unknown; ``gpu_basis`` says where they come from:
    ``"nvml"`` (NVML lists a context of it, or of its parent, there), or ``"device files"`` (the
    ``/dev/nvidiaN`` it holds, mapped through NVML's minor numbers; a process that opened every GPU, such
    as an NVML client or a CUDA process without ``CUDA_VISIBLE_DEVICES``, shows them all).
    ``gpu_memory_mib`` is ``None`` when NVML cannot tell. ``nvml_listed`` is ``None`` when NVML's lists
    cannot settle it (unavailable, another PID namespace, or a list it refused).
    """

    info: ProcessInfo
    devices: tuple[str, ...]
    gpus: tuple[int, ...] | None
    gpu_memory_mib: int | None
    nvml_listed: bool | None
    age_s: float | None
    gpu_basis: str | None = None

    @property
    def pid(self) -> int:
        """The holder's pid."""
        return self.info.pid

    @property
    def gpu_devices(self) -> tuple[str, ...]:
        """The held files that are per-GPU devices (``/dev/nvidiaN``), not ``nvidiactl`` or ``nvidia-uvm``."""
        return tuple(d for d in self.devices if device_minor(d) is not None)


def device_minor(path: str) -> int | None:
    """The minor number N of a per-GPU device file named ``nvidiaN``; ``None`` for any other file."""
    m = _GPU_DEVICE_RE.fullmatch(os.path.basename(path))
    return int(m.group(1)) if m else None


def build_holders(
    scan: HolderScan, nvml: NvmlView, gpus: frozenset[int] | None = None
) -> tuple[list[Holder], list[str]]:
    """Join open devices, process facts and NVML into ``Holder`` records, sorted by pid.

    ``gpus`` keeps only holders of those GPU indices; a holder whose GPUs are unknown is never kept, and a
    note says so. A holder that exited between the device scan and reading its facts is dropped and said
    so in the returned notes.
    """
    memory = nvml.memory_by_pid()
    listed_on = nvml.gpus_by_pid()
    usable = nvml.process_pids_usable
    holders: list[Holder] = []
    notes: list[str] = []
    for opened in sorted(scan.open_devices, key=lambda o: o.pid):
        info = scan.processes.get(opened.pid)
        if info is None:
            notes.append(f"pid {opened.pid} ({opened.command or '?'}) exited during the scan")
            continue
        file_gpus = _gpus_of(opened.paths, nvml)
        held_gpus, basis = _gpus_of_holder(info, file_gpus, listed_on, nvml, scan)
        if gpus is not None:
            if held_gpus is None:
                notes.append(
                    f"pid {info.pid} ({info.name or '?'}): its GPUs are unknown "
                    f"({_unknown_why(opened.paths, nvml)}), so --gpus does not select it"
                )
                continue
            if not gpus.intersection(held_gpus):
                continue
        per_gpu = memory.get(opened.pid)
        listed: bool | None = None
        if usable:
            if opened.pid in listed_on:
                listed = True
            elif not nvml.refused:
                listed = False
        holders.append(
            Holder(
                info=info,
                devices=tuple(sorted(opened.paths)),
                gpus=held_gpus,
                gpu_memory_mib=_total_mib(per_gpu),
                nvml_listed=listed,
                age_s=(
                    max(0.0, scan.scan_time_s - info.create_time_s)
                    if info.create_time_s is not None
                    else None
                ),
                gpu_basis=basis if held_gpus is not None else None,
            )
        )
    return holders, notes


def _gpus_of_holder(
    info: ProcessInfo,
    file_gpus: tuple[int, ...] | None,
    listed_on: Mapping[int, tuple[int, ...]],
    nvml: NvmlView,
    scan: HolderScan,
) -> tuple[tuple[int, ...] | None, str | None]:
    """A holder's GPUs and their basis: NVML's lists when its pids are usable, else the device files.

    Under NVML: the GPUs listing the holder, or else its parent (a forked DataLoader worker has no context
    of its own but works for its parent's); plus, for GPUs whose list NVML refused, the device files it
    holds there. A holder NVML lists nowhere, with every list answered, has no GPU context: ``()``.
    """
    if not nvml.process_pids_usable:
        return file_gpus, "device files"
    found = set(listed_on.get(info.pid, ()))
    if not found and info.ppid is not None and info.ppid != 1 and info.ppid in scan.processes:
        found = set(listed_on.get(info.ppid, ()))
    basis = "nvml"
    if nvml.refused:
        refused = set(nvml.refused)
        if file_gpus is None:
            if not found:
                return None, None
        elif refused.intersection(file_gpus):
            found |= refused.intersection(file_gpus)
            basis = "nvml and device files"
    return tuple(sorted(found)), basis


def _unknown_why(paths: Sequence[str], nvml: NvmlView) -> str:
    minors = [m for m in (device_minor(p) for p in paths) if m is not None]
    unmapped = [m for m in minors if nvml.gpu_of_minor(m) is None]
    if nvml.minors is None:
        return "NVML gives no minor numbers"
    if unmapped:
        return "no GPU has minor number " + ",".join(str(m) for m in unmapped)
    return "NVML refused a process list it would be on"


def _gpus_of(paths: Sequence[str], nvml: NvmlView) -> tuple[int, ...] | None:
    """GPU indices of the per-GPU device files among ``paths``; ``None`` when a minor cannot be mapped."""
    found: list[int] = []
    for path in paths:
        minor = device_minor(path)
        if minor is None:
            continue
        index = nvml.gpu_of_minor(minor)
        if index is None:
            return None
        if index not in found:
            found.append(index)
    return tuple(sorted(found))


def _total_mib(per_gpu: Mapping[int, int | None] | None) -> int | None:
    """Total GPU memory over a process's GPUs; ``None`` if NVML did not list it or hid any figure."""
    if not per_gpu or any(v is None for v in per_gpu.values()):
        return None
    return sum(v for v in per_gpu.values() if v is not None)
