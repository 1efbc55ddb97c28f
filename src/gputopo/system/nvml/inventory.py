"""Inventory reads of one GPU: name, UUID, PCI, affinity, memory, MIG, processes, NVLinks (what ``topo``
draws); and the pair reads of the session (PCIe path, P2P status)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from gputopo.model import PcieLink
from gputopo.system.nvml.answer import (
    _MIB,
    DeviceReads,
    _bus_id_of,
    _int_or_none,
    _text,
    bitmask_ids,
)

# NVML fills affinity masks in 64-bit words; asking for more words than the machine has CPUs is harmless,
# and 16 words (1024 CPUs) covers machines whose CPU ids have gaps (offline CPUs).
_MIN_CPU_SET_WORDS = 16
_NODE_SET_WORDS = 4

RemoteKind = Literal["gpu", "switch", "cpu"]


@dataclass(frozen=True)
class NvlinkEnd:
    """One NVLink of a GPU: its index, whether it is up, and what is on the other end.

    ``remote_bus_id`` is normalised like ``Gpu.pci_bus_id``; ``remote_kind`` is ``gpu``, ``switch`` (an
    NVSwitch), ``cpu`` (an IBM POWER NPU) or ``None`` when NVML cannot say (older drivers).
    """

    link: int
    up: bool
    remote_bus_id: str | None
    remote_kind: RemoteKind | None


class InventoryReads(DeviceReads):
    """What ``topo`` and the inventory read of a GPU. Each returns ``None`` when NVML does not support
    it and raises ``DeviceFailed`` when the GPU stops answering."""

    def name(self) -> str | None:
        """The product name, e.g. ``NVIDIA H100 80GB HBM3``."""
        return _text(self._q("nvmlDeviceGetName"))

    def uuid(self) -> str | None:
        """The GPU UUID, ``GPU-...``."""
        return _text(self._q("nvmlDeviceGetUUID"))

    def pci_bus_id(self) -> str | None:
        """The PCI bus id as nvidia-smi prints it, ``00000000:1B:00.0``."""
        info = self._q("nvmlDeviceGetPciInfo")
        return _bus_id_of(info)

    def minor_number(self) -> int | None:
        """N in ``/dev/nvidiaN``."""
        value = self._q("nvmlDeviceGetMinorNumber")
        return int(value) if value is not None else None

    def cpu_ids(self) -> tuple[int, ...] | None:
        """CPUs nearest the GPU (its NUMA node), as NVML's CPU affinity mask says; ``None`` if unknown."""
        words = max(_MIN_CPU_SET_WORDS, math.ceil((os.cpu_count() or 1) / 64))
        mask = self._q("nvmlDeviceGetCpuAffinity", words)
        ids = bitmask_ids(mask) if mask is not None else ()
        return ids or None

    def numa_nodes(self) -> tuple[int, ...] | None:
        """NUMA nodes whose memory is nearest the GPU (nvidia-smi's "NUMA Affinity"); ``None`` if unknown."""
        scope = self.session._errors.NVML_AFFINITY_SCOPE_NODE
        mask = self._q("nvmlDeviceGetMemoryAffinity", _NODE_SET_WORDS, scope)
        ids = bitmask_ids(mask) if mask is not None else ()
        return ids or None

    def gpu_numa_id(self) -> int | None:
        """The GPU's own NUMA node where GPU memory is a NUMA node (Grace Hopper); ``None`` elsewhere."""
        value = self._q("nvmlDeviceGetNumaNodeId")
        if value is None or int(value) < 0:
            return None
        return int(value)

    def pcie_link(self) -> PcieLink | None:
        """PCIe generation and width, current and maximum; ``None`` when NVML knows none of them."""
        link = PcieLink(
            gen_current=_int_or_none(self._q("nvmlDeviceGetCurrPcieLinkGeneration")),
            gen_max=_int_or_none(self._q("nvmlDeviceGetMaxPcieLinkGeneration")),
            width_current=_int_or_none(self._q("nvmlDeviceGetCurrPcieLinkWidth")),
            width_max=_int_or_none(self._q("nvmlDeviceGetMaxPcieLinkWidth")),
        )
        return None if link == PcieLink() else link

    def memory_mib(self) -> tuple[int | None, int | None]:
        """(total, used) GPU memory in MiB, ``used`` as nvidia-smi shows it.

        The v2 call first: NVML's current docs define v1 ``used`` as "Sum of Reserved and Allocated device
        memory" and v2 ``used`` as allocated memory, with the driver's reservation (about 0.5 GiB on an
        H100) in ``reserved``. (The R525 docs still said v2 ``used`` includes ``reserved``; drivers since
        report it apart, as nvidia-smi's "Reserved" line shows.) Drivers or bindings without v2: v1.
        """
        info = None
        version = getattr(self.session._errors, "nvmlMemory_v2", None)
        if version is not None:
            info = self._q("nvmlDeviceGetMemoryInfo", version=version)
        if info is None:
            info = self._q("nvmlDeviceGetMemoryInfo")
        if info is None:
            return None, None
        return int(info.total) // _MIB, int(info.used) // _MIB

    def mig_mode(self) -> bool | None:
        """Whether MIG is enabled now (NVML's current mode; a pending change needs a reset); ``None`` on
        GPUs and drivers without MIG."""
        modes = self._q("nvmlDeviceGetMigMode")
        if modes is None:
            return None
        return int(modes[0]) == int(getattr(self.session._errors, "NVML_DEVICE_MIG_ENABLE", 1))

    def mig_device_uuids(self) -> tuple[str, ...]:
        """UUIDs (``MIG-...``) of the MIG devices on this GPU, in slot order; empty without any."""
        slots = self._q("nvmlDeviceGetMaxMigDeviceCount")
        uuids: list[str] = []
        for slot in range(int(slots or 0)):
            # An empty slot answers NotFound (soft): skipped.
            mig = self._q("nvmlDeviceGetMigDeviceHandleByIndex", slot)
            if mig is None:
                continue
            uuid = _text(self.session._call(f"GPU{self.index}", "nvmlDeviceGetUUID", mig))
            if uuid is not None:
                uuids.append(uuid)
        return tuple(uuids)

    def utilization_pct(self) -> int | None:
        """GPU utilisation over NVML's last sample period, percent."""
        rates = self._q("nvmlDeviceGetUtilizationRates")
        return int(rates.gpu) if rates is not None else None

    def processes(self, kind: Literal["compute", "graphics"]) -> list[tuple[int, int | None]] | None:
        """(pid, used GPU memory in MiB or ``None``) of the processes with a context on this GPU.

        PIDs are in the PID namespace NVML sees, which can differ from ours in a container.
        """
        name = (
            "nvmlDeviceGetComputeRunningProcesses"
            if kind == "compute"
            else "nvmlDeviceGetGraphicsRunningProcesses"
        )
        procs = self._q(name)
        if procs is None:
            # The unversioned call needs the v3 struct (driver >= 510); older drivers answer the v2 one.
            procs = self._q(name + "_v2")
        if procs is None:
            return None
        out = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            out.append((int(p.pid), int(used) // _MIB if used is not None else None))
        return out

    def nvlink_ends(self) -> list[NvlinkEnd]:
        """Every NVLink the GPU has, up or down; empty for a GPU without NVLink."""
        e = self.session._errors
        kinds: dict[int, RemoteKind] = {
            e.NVML_NVLINK_DEVICE_TYPE_GPU: "gpu",
            e.NVML_NVLINK_DEVICE_TYPE_SWITCH: "switch",
            e.NVML_NVLINK_DEVICE_TYPE_IBMNPU: "cpu",
        }
        ends = []
        # Links are probed by index; an index the GPU does not have answers NotSupported/InvalidArgument.
        for link in range(e.NVML_NVLINK_MAX_LINKS):
            state = self._q("nvmlDeviceGetNvLinkState", link)
            if state is None:
                continue
            up = int(state) == e.NVML_FEATURE_ENABLED
            # A link that is down may have no far end to describe (NotFound: n/a, no warning).
            remote = _bus_id_of(self._q("nvmlDeviceGetNvLinkRemotePciInfo", link))
            kind = self._q("nvmlDeviceGetNvLinkRemoteDeviceType", link)
            ends.append(NvlinkEnd(link, up, remote, kinds.get(int(kind)) if kind is not None else None))
        return ends
