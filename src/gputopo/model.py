"""The data model: frozen dataclasses and enums, pure, shared by every command.

Names follow nvidia-smi and NVML (``pci_bus_id``, ``NV4``, ``PXB``, minor number) so a reader can look
them up. Unknown values are ``None``, never a made-up default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# Defaults every command shares, written once: one live NVML read's deadline (start-up, one GPU, one GPU
# pair; --nvml-timeout) and the health window between two samples (check's and doctor's --sample-s).
DEFAULT_NVML_TIMEOUT_S = 5.0
DEFAULT_HEALTH_WINDOW_S = 2.0
# `gputopo accept --budget`'s default (gputopo.accept re-exports it; here so the CLI reads it lightly).
DEFAULT_ACCEPT_BUDGET_S = 1800.0


class LinkKind(Enum):
    """How two devices are connected, as the codes of ``nvidia-smi topo -m`` say.

    Ordered from nearest to farthest: X < NV# < PIX < PXB < PHB < NODE < SYS (``rank``).
    ``SOC`` is the pre-2018 name of ``SYS`` and maps to ``SYS``.
    """

    SELF = "X"
    NVLINK = "NV#"
    PIX = "PIX"
    PXB = "PXB"
    PHB = "PHB"
    NODE = "NODE"
    SYS = "SYS"

    @property
    def rank(self) -> int:
        """Distance order: 0 for self, 6 for a path across CPU sockets."""
        return _RANK[self]

    @property
    def description(self) -> str:
        """What the code means, in the words of nvidia-smi's current legend."""
        return _DESCRIPTION[self]


_RANK = {kind: i for i, kind in enumerate(LinkKind)}

_DESCRIPTION = {
    LinkKind.SELF: "self",
    LinkKind.NVLINK: "a bonded set of # NVLinks",
    LinkKind.PIX: "at most a single PCIe bridge",
    LinkKind.PXB: "multiple PCIe bridges, without the PCIe host bridge",
    LinkKind.PHB: "PCIe and a PCIe host bridge (typically the CPU)",
    LinkKind.NODE: "PCIe and the interconnect between PCIe host bridges within a NUMA node",
    LinkKind.SYS: "PCIe and the SMP interconnect between NUMA nodes (QPI/UPI/Infinity Fabric)",
}

_NV_RE = re.compile(r"NV([1-9]\d{0,3})")
_PLAIN_CODES = {
    "X": LinkKind.SELF,
    "PIX": LinkKind.PIX,
    "PXB": LinkKind.PXB,
    "PHB": LinkKind.PHB,
    "NODE": LinkKind.NODE,
    "SYS": LinkKind.SYS,
    "SOC": LinkKind.SYS,
}


@dataclass(frozen=True)
class Link:
    """One matrix cell: the code as printed (``NV4``, ``SOC``), its kind, and the NVLink count."""

    code: str
    kind: LinkKind
    nvlinks: int | None = None

    @classmethod
    def from_code(cls, code: str) -> Link | None:
        """Parse a printed code; ``None`` if it is not a known link code."""
        if code in _PLAIN_CODES:
            return cls(code, _PLAIN_CODES[code])
        m = _NV_RE.fullmatch(code)
        if m:
            return cls(code, LinkKind.NVLINK, int(m.group(1)))
        return None


# What `gputopo topo` prints for a matrix cell its input did not show; read back, the cell stays unknown.
UNKNOWN_CELL = "?"


def is_link_code(code: str) -> bool:
    """True if ``code`` is a code ``nvidia-smi topo -m`` prints in a matrix cell."""
    return Link.from_code(code) is not None


@dataclass(frozen=True)
class PcieLink:
    """PCIe link generation and width, current and maximum (NVML)."""

    gen_current: int | None = None
    gen_max: int | None = None
    width_current: int | None = None
    width_max: int | None = None

    @property
    def degraded(self) -> bool:
        """True when the link runs below its maximum gen or width (normal when idle: GPUs downclock)."""
        pairs = ((self.gen_current, self.gen_max), (self.width_current, self.width_max))
        return any(c is not None and m is not None and c < m for c, m in pairs)


# Utilisation at or above which a GPU counts as busy for the PCIe link check.
BUSY_UTILIZATION_PCT = 10

# Why a GPU could not be read (``Gpu.state``); ``Gpu.error`` holds NVML's own words.
GPU_FAILING = "failing"  # lost, needs a reset, or gone: a hardware or driver problem on that GPU
GPU_NOT_ACCESSIBLE = "not accessible"  # NVML refused the handle for permission (cgroups, containers)
GPU_NOT_RESPONDING = "not responding"  # an NVML call about it did not return within the deadline


@dataclass(frozen=True)
class GpuFabric:
    """A GPU's place in the NVLink fabric and the rack, as NVML reads it (system/nvml/fabric.py); every
    field ``None`` where the driver or GPU does not say. ``state`` in words (``completed``, ``in
    progress``, ``not started``, ``not supported``), ``status`` the registration's ``nvmlReturn_t``,
    ``cluster_uuid`` the 8-4-4-4-12 form, ``health_summary`` in words (``healthy``, ``unhealthy``,
    ``limited capacity``), ``cliques`` the v4 ``[type, id]`` pairs; the platform's ``chassis_serial``
    (the rack), ``slot``, ``tray_index``, ``host_id``, ``peer_type``, ``module_id``; ``c2c`` the C2C mode.
    ``domain`` is the NVLink domain ``<cluster_uuid>.<clique_id>`` (topology.nvlink_domain), ``None`` for
    a GPU in none."""

    state: str | None = None
    status: int | None = None
    cluster_uuid: str | None = None
    clique_id: int | None = None
    domain: str | None = None
    health_mask: int | None = None
    health_summary: str | None = None
    cliques: tuple[tuple[int, int], ...] | None = None
    chassis_serial: str | None = None
    slot: int | None = None
    tray_index: int | None = None
    host_id: int | None = None
    peer_type: int | None = None
    module_id: int | None = None
    c2c: bool | None = None


@dataclass(frozen=True)
class Gpu:
    """One GPU. ``index`` is nvidia-smi's (PCI bus order), which is what ``GPU<index>`` labels use.

    Live-only fields stay ``None`` when read from text or when NVML does not support them.
    ``error`` is set when the GPU could not be read (e.g. "GPU is lost"), and ``state`` says how:
    ``GPU_FAILING`` (also when ``state`` is ``None``, as in older snapshots), ``GPU_NOT_ACCESSIBLE`` or
    ``GPU_NOT_RESPONDING``; the rest of the machine still renders. ``mig_enabled`` is NVML's current MIG
    mode and ``mig_devices`` the UUIDs of its MIG devices: CUDA and NCCL cannot use the GPU as a whole then.
    ``nvlink_bridge`` is ``False`` for a GPU that has NVLinks of which none is active or names a far end (a
    PCIe card without its bridge), ``True`` when one does, ``None`` without NVLink or when unknown.
    """

    index: int
    name: str | None = None
    pci_bus_id: str | None = None
    uuid: str | None = None
    cpu_affinity: str | None = None
    numa_affinity: str | None = None
    gpu_numa_id: str | None = None
    minor_number: int | None = None
    pcie: PcieLink | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    compute_pids: tuple[int, ...] | None = None
    utilization_pct: int | None = None
    error: str | None = None
    state: str | None = None
    mig_enabled: bool | None = None
    mig_devices: tuple[str, ...] = ()
    nvlink_bridge: bool | None = None
    fabric: GpuFabric | None = None

    @property
    def label(self) -> str:
        """The matrix label, ``GPU<index>``."""
        return f"GPU{self.index}"

    @property
    def failing(self) -> bool:
        """True when the GPU itself is in trouble (lost, reset required): hardware advice applies."""
        return self.error is not None and self.state in (None, GPU_FAILING)

    @property
    def unavailable_reason(self) -> str | None:
        """Why no job can use this GPU from here (``None`` when one can): failing, not accessible, not
        responding, or MIG enabled."""
        if self.error is not None:
            return f"{self.state or GPU_FAILING}: {self.error}"
        if self.mig_enabled:
            n = len(self.mig_devices)
            return f"MIG enabled ({n} MIG device{'s' if n != 1 else ''}; NCCL cannot use the GPU as a whole)"
        return None

    @property
    def pcie_below_max_while_busy(self) -> bool:
        """True when the PCIe link runs below its max gen/width while the GPU works.

        Idle GPUs lower their link gen to save power, which is normal; only a busy GPU on a slow link
        points at a bad slot, riser or BIOS setting.
        """
        busy = self.utilization_pct is not None and self.utilization_pct >= BUSY_UTILIZATION_PCT
        return busy and self.pcie is not None and self.pcie.degraded


@dataclass(frozen=True)
class Nic:
    """A network device as ``topo -m`` shows it: ``label`` as printed (``NIC0`` or ``mlx5_0``)."""

    label: str
    name: str | None = None


# NVML/nvidia-smi peer-to-peer status codes (``nvidia-smi topo -p2p``) and what they mean.
P2P_STATUS_CODES = {
    "OK": "status OK",
    "CNS": "chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "topology not supported",
    "NS": "not supported",
    "DR": "disabled by regkey",
    "U": "unknown",
}

P2P_CAPABILITIES = ("read", "write", "nvlink", "atomics")


@dataclass(frozen=True)
class NvlinkPeer:
    """NVLinks from ``gpu`` to ``peer`` (both nvidia-smi indices): how many are up and how many down.

    On an NVSwitch system a GPU's links go to the switches, which reach every peer: each of its pairs
    counts all of them. ``switch_up``/``switch_down`` say how many of ``links_up``/``links_down`` are such
    switch links of ``gpu`` (the same for each of its peers), so a link down is pinned on the GPU once,
    not on every pair."""

    gpu: int
    peer: int
    links_up: int
    links_down: int = 0
    switch_up: int = 0
    switch_down: int = 0


@dataclass(frozen=True)
class Matrix:
    """The link matrix as printed: header ``labels`` and ``cells`` (``"X"`` on the diagonal).

    A cell is ``None`` when the source did not show it (a cropped or truncated paste).
    """

    labels: tuple[str, ...]
    cells: tuple[tuple[str | None, ...], ...]

    def index_of(self, label: str) -> int:
        """Position of ``label`` in the matrix; ``KeyError`` when absent."""
        try:
            return self.labels.index(label)
        except ValueError:
            raise KeyError(label) from None

    def code(self, a: str, b: str) -> str | None:
        """The printed code between two labels (``None`` if unknown)."""
        return self.cells[self.index_of(a)][self.index_of(b)]

    def link(self, a: str, b: str) -> Link | None:
        """The parsed link between two labels (``None`` if unknown)."""
        code = self.code(a, b)
        return Link.from_code(code) if code is not None else None


@dataclass(frozen=True)
class Topology:
    """A machine: its GPUs, NICs, link matrix, and live details where NVML had them.

    ``source`` says where it came from (``nvml``, ``nvidia-smi``, a file path, ``sample:NAME``).
    ``p2p`` maps a capability (``read``, ``write``, ``nvlink``, ``atomics``) to a GPU x GPU matrix of
    status codes (``X`` on the diagonal, ``None`` where NVML could not answer), in the order of
    ``gpus``. ``warnings`` say what was
    recovered or guessed while reading. ``node`` and ``check`` are the node's facts for ``gputopo nodes``
    (its Slurm or short host name, the last fresh ``gputopo check`` judgement), on the live machine only.
    """

    source: str
    gpus: tuple[Gpu, ...]
    nics: tuple[Nic, ...]
    matrix: Matrix
    warnings: tuple[str, ...] = ()
    nvlinks: tuple[NvlinkPeer, ...] | None = None
    p2p: dict[str, tuple[tuple[str | None, ...], ...]] | None = field(default=None, hash=False)
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    live: bool = False
    node: str | None = None
    check: dict[str, Any] | None = field(default=None, hash=False)
    # ``gputopo accept``'s stored verdict and whether it still holds (``accept.record.status``), or None.
    accept: dict[str, Any] | None = field(default=None, hash=False)

    def gpu(self, index: int) -> Gpu:
        """The GPU with nvidia-smi index ``index``; ``KeyError`` when absent."""
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)

    def gpu_link(self, a: int, b: int) -> Link | None:
        """The link between two GPUs by nvidia-smi index (``None`` if unknown)."""
        return self.matrix.link(f"GPU{a}", f"GPU{b}")

    @property
    def gpu_indices(self) -> tuple[int, ...]:
        """nvidia-smi indices of all GPUs, in matrix order."""
        return tuple(g.index for g in self.gpus)


# What the machine offers a launch (``system.launcher`` reads it; ``launch.line`` builds the torchrun line).
@dataclass(frozen=True)
class LaunchTools:
    """What the machine offers the launch: ``torchrun`` (the argv that starts it, ``None`` without torch),
    whether that torch knows ``--numa-binding`` (``None``: torch not found), and whether ``numactl`` is
    on PATH."""

    torchrun: tuple[str, ...] | None = ("torchrun",)
    torch_version: str | None = None
    numa_binding: bool | None = None
    numactl: bool = False
