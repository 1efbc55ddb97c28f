"""A fake NVML: named machines that answer pynvml's calls without a GPU or a driver.

``FakeNvml`` implements the pynvml functions gputopo uses (``gputopo.system.nvml.NvmlBackend``) with
pynvml's names, arguments and return shapes, and raises pynvml's own ``NVMLError`` subclasses, so the
error handling in ``gputopo.system.nvml`` is exercised as it runs against a real driver.

Use it from any test::

    from fake_nvml import FakeNvml

    with FakeNvml.pcie_box(processes={0: [(4242, 1024)]}).installed():
        topo = read_live()

Machines: ``nvlink_box()`` (8x RTX A6000, NV4 bridge pairs 0-1 2-3 4-5 6-7, two sockets),
``nvswitch_box()`` (4x H100 SXM, NV18 all-to-all through NVSwitch), ``pcie_box()`` (8x L40S on PCIe
switches across two sockets: PIX, PXB, PHB, NODE, SYS; GPU2 busy at x8 of x16), ``lost_gpu_box()``
(``nvlink_box`` whose GPU5 fell off the bus: GpuIsLost), ``no_driver()`` (libnvidia-ml.so missing).
``FakeGpu`` fields are mutable, so a test can tweak one GPU (``fake.gpus[3].unsupported.add(...)``).
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

NVSWITCH = "nvswitch"
_MIB = 1024 * 1024
_FABRIC_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
_VERSION_MISMATCH = 25  # NVML_ERROR_ARGUMENT_VERSION_MISMATCH
_SWITCHES = 4  # NVSwitch chips on the fake HGX baseboard; links are spread over them round-robin


@dataclass(frozen=True)
class FakeLink:
    """One NVLink: its far end is a GPU index or ``NVSWITCH``; ``up`` is the link state."""

    remote: int | str
    up: bool = True


@dataclass
class FakeGpu:
    """One fake GPU. ``pcie_path`` is (socket, root complex, upper switch, leaf switch): two GPUs' common
    prefix decides NVML's topology level. ``unsupported`` names pynvml functions that answer NotSupported
    for this GPU; ``lost`` makes every call about it raise GpuIsLost."""

    name: str
    bus_id: str
    uuid: str
    minor: int
    pcie_path: tuple[int, int, int, int]
    cpus: tuple[int, ...] = ()
    numa_nodes: tuple[int, ...] = ()
    gpu_numa_id: int | None = None
    pcie: tuple[int, int, int, int] = (4, 4, 16, 16)  # gen current, gen max, width current, width max
    memory_total_mib: int = 49140
    memory_used_mib: int = 0
    utilization_pct: int = 0
    links: tuple[FakeLink, ...] = ()
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)
    health: FakeHealth = field(default_factory=lambda: FakeHealth())
    mig_devices: tuple[str, ...] | None = None  # MIG device UUIDs when MIG is on; None: a GPU without MIG


@dataclass
class FakeHealth:
    """What the health queries of one fake GPU answer: a sound GPU by default. Counters are NVML's totals;
    ``fields`` maps an NVML field id to its value (a missing id answers NOT_SUPPORTED in its own return
    code); ``nvlink_errors`` maps a link to (replay, recovery, crc flit, crc data); ``fabric`` is (state,
    status, clique, health mask) or ``None`` where the GPU has no fabric (NOT_SUPPORTED)."""

    ecc_mode: tuple[int, int] = (1, 1)
    ecc_errors: dict[tuple[str, str], int] = field(
        default_factory=dict
    )  # (corrected|uncorrected, volatile|aggregate)
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    retired_pages: dict[str, int] | None = None  # sbe/dbe counts on pre-Ampere GPUs; None: Ampere and later
    retired_pending: bool = False
    clocks_event_reasons: int = 0
    temperature_c: int = 34
    power_mw: int = 71000
    power_limit_mw: int = 700000
    pcie_replays: int = 0
    persistence: bool = True
    vbios: str = "96.00.99.00.01"
    serial: str | None = None  # the board serial; None: NOT_SUPPORTED
    fields: dict[Any, int] = field(
        default_factory=lambda: {230: 0}
    )  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: none
    nvlink_errors: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)
    fabric: tuple[int, int, int, int] | None = None
    # The newer fabric and platform answers (system/nvml/fabric.py). ``fabric_uuid``: the cluster UUID
    # (8-4-4-4-12); ``fabric_summary``: NVML_GPU_FABRIC_HEALTH_SUMMARY_* (``None``: a driver that knows
    # only the v2 struct and answers ARGUMENT_VERSION_MISMATCH for v3); ``fabric_cliques``: the v4
    # ``(type, id)`` list (``None``: a driver without nvmlDeviceGetGpuFabricInfo_v4); ``platform``:
    # (chassis serial, slot, tray index, host id, peer type, module id) or ``None`` (NOT_SUPPORTED);
    # ``c2c``: the C2C mode or ``None`` (NOT_SUPPORTED).
    fabric_uuid: str = "00000000-0000-0000-0000-000000000000"
    fabric_summary: int | None = None
    fabric_cliques: tuple[tuple[int, int], ...] | None = None
    platform: tuple[str, int, int, int, int, int] | None = None
    c2c: bool | None = None
    xid_events: bool = True
    unrepairable_memory: bool | None = None  # None: NOT_SUPPORTED (older drivers, most GPUs)


@dataclass(frozen=True)
class FakeHandle:
    """What ``nvmlDeviceGetHandleByIndex`` returns."""

    index: int


@dataclass(frozen=True)
class FakeMigHandle:
    """What ``nvmlDeviceGetMigDeviceHandleByIndex`` returns: a MIG device, known by its UUID."""

    uuid: str


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _too_old_driver() -> Exception:
    """What the installed pynvml raises for an unversioned call the driver lacks: newer bindings raise
    NVMLLibraryMismatchError, 12.535.x (which has no such class) plain FunctionNotFound."""
    mismatch = getattr(pynvml, "NVMLLibraryMismatchError", None)
    if mismatch is not None:
        return mismatch("Unversioned function called and the pyNVML version ...")
    return _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


def _bus(n: int) -> str:
    return f"00000000:{n:02X}:00.0"


class FakeNvml:
    """A configurable fake of the pynvml module (the subset gputopo calls).

    ``processes`` / ``graphics_processes`` map a GPU index to ``[(pid, used_mib or None)]``.
    ``p2p_overrides`` maps ``(a, b, "read"|"write"|"nvlink"|"atomics")`` to a ``NVML_P2P_STATUS_*``.
    ``init_error`` is the ``NVML_ERROR_*`` code ``nvmlInit`` fails with. ``remote_type_supported=False``
    is a driver without ``nvmlDeviceGetNvLinkRemoteDeviceType``; ``process_api_v3=False`` a driver older
    than the v3 process query (pynvml then raises ``NVMLLibraryMismatchError``). ``health=True`` answers
    the health and Xid event queries from each GPU's ``FakeHealth``; by default they answer
    FUNCTION_NOT_FOUND, as a driver without them does (the machines' goldens were made that way).
    ``calls`` counts every NVML function looked up, so a test can count the reads.
    """

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        processes: dict[int, list[tuple[int, int | None]]] | None = None,
        graphics_processes: dict[int, list[tuple[int, int | None]]] | None = None,
        p2p_overrides: dict[tuple[int, int, str], int] | None = None,
        driver_version: str = "550.54.15",
        cuda_driver_version: int = 12040,
        init_error: int | None = None,
        remote_type_supported: bool = True,
        process_api_v3: bool = True,
        health: bool = False,
        absent: frozenset[str] = frozenset(),
    ) -> None:
        self.gpus = gpus
        self.processes = processes or {}
        self.graphics_processes = graphics_processes or {}
        self.p2p_overrides = p2p_overrides or {}
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.init_error = init_error
        self.remote_type_supported = remote_type_supported
        self.process_api_v3 = process_api_v3
        self.health = health
        self.absent = absent
        """pynvml functions these bindings lack (an older nvidia-ml-py): looking one up fails."""
        self.init_count = 0
        self.shutdown_count = 0
        self._handles: dict[int, FakeHandle] = {}
        self.calls: Counter[str] = Counter()
        """How often each NVML function was called (looked up) on this fake: tests count the reads."""
        self.event_sets: dict[int, list[tuple[int, int]]] = {}
        """Event sets: each holds the (GPU index, Xid) events a test queued with ``queue_xid``."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml"):
            if name in object.__getattribute__(self, "absent"):
                raise AttributeError(name)
            object.__getattribute__(self, "calls")[name] += 1
        return object.__getattribute__(self, name)

    # -- installing -------------------------------------------------------------------------------

    @contextmanager
    def installed(self) -> Iterator[FakeNvml]:
        """Make gputopo's NVML seam call this fake inside the ``with`` block."""
        from gputopo.system import nvml

        with nvml.use_backend(self):
            yield self

    @property
    def open_sessions(self) -> int:
        """Inits not yet matched by a shutdown (0 after every well-behaved caller)."""
        return self.init_count - self.shutdown_count

    # -- named machines ---------------------------------------------------------------------------

    @classmethod
    def nvlink_box(cls, **options: Any) -> FakeNvml:
        """8x RTX A6000 with NVLink bridges (NV4) on pairs 0-1, 2-3, 4-5, 6-7; GPUs 0-3 on socket 0
        (CPUs 0-31, NUMA 0), 4-7 on socket 1 (CPUs 32-63, NUMA 1), each GPU on its own root complex,
        so NODE within a socket and SYS across (the seed machine of docs/design.md)."""
        buses = (0x1A, 0x1B, 0x3D, 0x3E, 0x88, 0x89, 0xB1, 0xB2)
        gpus = []
        for i, bus in enumerate(buses):
            socket = i // 4
            gpus.append(
                FakeGpu(
                    name="NVIDIA RTX A6000",
                    bus_id=_bus(bus),
                    uuid=f"GPU-a6000000-0000-0000-0000-00000000000{i}",
                    minor=i,
                    pcie_path=(socket, i, 0, 0),
                    cpus=tuple(range(32 * socket, 32 * socket + 32)),
                    numa_nodes=(socket,),
                    links=tuple(FakeLink(i ^ 1) for _ in range(4)),
                )
            )
        return cls(gpus, **options)

    @classmethod
    def nvswitch_box(cls, **options: Any) -> FakeNvml:
        """4x H100 80GB HBM3 (SXM), 18 NVLinks each to the NVSwitches: NV18 between every pair. Two
        sockets with hyperthreads: GPUs 0-1 CPUs 0-47,96-143 NUMA 0; GPUs 2-3 CPUs 48-95,144-191 NUMA 1."""
        buses = (0x18, 0x2A, 0x9A, 0xAB)
        gpus = []
        for i, bus in enumerate(buses):
            socket = i // 2
            cpus = tuple(range(48 * socket, 48 * socket + 48)) + tuple(
                range(96 + 48 * socket, 144 + 48 * socket)
            )
            gpus.append(
                FakeGpu(
                    name="NVIDIA H100 80GB HBM3",
                    bus_id=_bus(bus),
                    uuid=f"GPU-h1000000-0000-0000-0000-00000000000{i}",
                    minor=i,
                    pcie_path=(socket, i, 0, 0),
                    cpus=cpus,
                    numa_nodes=(socket,),
                    pcie=(5, 5, 16, 16),
                    memory_total_mib=81559,
                    links=tuple(FakeLink(NVSWITCH) for _ in range(18)),
                    health=FakeHealth(fabric=(_FABRIC_COMPLETED, 0, 7, 0)),
                )
            )
        return cls(gpus, **options)

    @classmethod
    def pcie_box(cls, **options: Any) -> FakeNvml:
        """8x L40S on PCIe, two sockets (CPUs 0-15,32-47 NUMA 0 / 16-31,48-63 NUMA 1), no NVLink.

        GPUs 0,1 share a leaf switch (PIX); GPU2 is under a sibling leaf (PXB to 0,1); GPU3 under another
        upper switch of the same root complex (PHB); GPU4 on another root complex of socket 0 (NODE);
        GPUs 5,6 share a leaf on socket 1 (PIX), GPU7 another root complex there (NODE); socket 0 to
        socket 1 is SYS. Idle GPUs sit at Gen1 x16 (max Gen4 x16); GPU2 is busy (97%) at Gen4 x8.
        """
        paths = [
            (0, 0, 0, 0),
            (0, 0, 0, 0),
            (0, 0, 0, 1),
            (0, 0, 1, 2),
            (0, 1, 2, 3),
            (1, 2, 3, 4),
            (1, 2, 3, 4),
            (1, 3, 4, 5),
        ]
        buses = (0x17, 0x18, 0x31, 0x4B, 0x65, 0xCA, 0xCB, 0xE3)
        gpus = []
        for i, (path, bus) in enumerate(zip(paths, buses, strict=True)):
            socket = path[0]
            gpus.append(
                FakeGpu(
                    name="NVIDIA L40S",
                    bus_id=_bus(bus),
                    uuid=f"GPU-140s0000-0000-0000-0000-00000000000{i}",
                    minor=i,
                    pcie_path=path,
                    cpus=tuple(range(16 * socket, 16 * socket + 16))
                    + tuple(range(32 + 16 * socket, 48 + 16 * socket)),
                    numa_nodes=(socket,),
                    pcie=(1, 4, 16, 16),
                    memory_total_mib=46068,
                )
            )
        busy = gpus[2]
        busy.pcie = (4, 4, 8, 16)
        busy.utilization_pct = 97
        busy.memory_used_mib = 30211
        return cls(gpus, **options)

    @classmethod
    def lost_gpu_box(cls, **options: Any) -> FakeNvml:
        """``nvlink_box`` after GPU5 fell off the bus: every query about it raises GpuIsLost, and its
        bridge partner GPU4 sees its 4 NVLinks down."""
        fake = cls.nvlink_box(**options)
        fake.gpus[5].lost = True
        fake.gpus[4].links = tuple(FakeLink(5, up=False) for _ in range(4))
        return fake

    @classmethod
    def no_driver(cls, **options: Any) -> FakeNvml:
        """A machine without the NVIDIA driver: ``nvmlInit`` fails with LibraryNotFound."""
        options.setdefault("init_error", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        return cls([], **options)

    # -- helpers ----------------------------------------------------------------------------------

    def _check_init(self) -> None:
        if self.open_sessions <= 0:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: FakeHandle, fn: str) -> FakeGpu:
        self._check_init()
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.unsupported:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    @staticmethod
    def _mask(ids: tuple[int, ...], words: int) -> list[int]:
        mask = [0] * words
        for i in ids:
            if i // 64 < words:
                mask[i // 64] |= 1 << (i % 64)
        return mask

    @staticmethod
    def _pci(bus_id: str) -> SimpleNamespace:
        domain, bus, devfn = bus_id.split(":")
        return SimpleNamespace(
            busId=bus_id.encode(),
            busIdLegacy=f"{domain[-4:]}:{bus}:{devfn}".encode(),
            domain=int(domain, 16),
            bus=int(bus, 16),
            device=int(devfn.split(".")[0], 16),
        )

    def _level(self, a: FakeGpu, b: FakeGpu) -> int:
        shared = 0
        for x, y in zip(a.pcie_path, b.pcie_path, strict=True):
            if x != y:
                break
            shared += 1
        return {
            4: pynvml.NVML_TOPOLOGY_SINGLE,
            3: pynvml.NVML_TOPOLOGY_MULTIPLE,
            2: pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
            1: pynvml.NVML_TOPOLOGY_NODE,
            0: pynvml.NVML_TOPOLOGY_SYSTEM,
        }[shared]

    def _nvlinked(self, a: int, b: int) -> bool:
        ga, gb = self.gpus[a], self.gpus[b]
        if any(link.up and link.remote == b for link in ga.links):
            return True
        return any(lk.up and lk.remote == NVSWITCH for lk in ga.links) and any(
            lk.up and lk.remote == NVSWITCH for lk in gb.links
        )

    def _pair(self, h1: FakeHandle, h2: FakeHandle, fn: str) -> tuple[FakeGpu, FakeGpu]:
        return self._gpu(h1, fn), self._gpu(h2, fn)

    def _procs(
        self, table: dict[int, list[tuple[int, int | None]]], handle: FakeHandle, fn: str
    ) -> list[Any]:
        self._gpu(handle, fn)
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=None if mib is None else mib * _MIB)
            for pid, mib in table.get(handle.index, [])
        ]

    # -- pynvml's functions -----------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise _err(self.init_error)
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._check_init()
        self.shutdown_count += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check_init()
        return self.cuda_driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._handles.setdefault(index, FakeHandle(index))  # one handle per GPU, as NVML's

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(self, handle: FakeHandle | FakeMigHandle) -> str:
        if isinstance(handle, FakeMigHandle):
            return handle.uuid
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> SimpleNamespace:
        return self._pci(self._gpu(handle, "nvmlDeviceGetPciInfo").bus_id)

    def nvmlDeviceGetMinorNumber(self, handle: FakeHandle) -> int:
        return self._gpu(handle, "nvmlDeviceGetMinorNumber").minor

    def nvmlDeviceGetCpuAffinity(self, handle: FakeHandle, cpuSetSize: int) -> list[int]:
        return self._mask(self._gpu(handle, "nvmlDeviceGetCpuAffinity").cpus, cpuSetSize)

    def nvmlDeviceGetMemoryAffinity(self, handle: FakeHandle, nodeSetSize: int, scope: int) -> list[int]:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryAffinity")
        if scope != pynvml.NVML_AFFINITY_SCOPE_NODE:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._mask(gpu.numa_nodes, nodeSetSize)

    def nvmlDeviceGetNumaNodeId(self, handle: FakeHandle) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNumaNodeId")
        if gpu.gpu_numa_id is None:  # only where GPU memory is a NUMA node (Grace Hopper)
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.gpu_numa_id

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrPcieLinkGeneration").pcie[0]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return self._gpu(handle, "nvmlDeviceGetMaxPcieLinkGeneration").pcie[1]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: FakeHandle) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrPcieLinkWidth").pcie[2]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: FakeHandle) -> int:
        return self._gpu(handle, "nvmlDeviceGetMaxPcieLinkWidth").pcie[3]

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> SimpleNamespace:
        # Both versions report the same here; the C fake driver (tests/fakedriver) tells them apart.
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        total, used = gpu.memory_total_mib * _MIB, gpu.memory_used_mib * _MIB
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> SimpleNamespace:
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=gpu.utilization_pct, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        if not self.process_api_v3:
            self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
            raise _too_old_driver()
        return self._procs(self.processes, handle, "nvmlDeviceGetComputeRunningProcesses")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        if not self.process_api_v3:
            self._gpu(handle, "nvmlDeviceGetGraphicsRunningProcesses")
            raise _too_old_driver()
        return self._procs(self.graphics_processes, handle, "nvmlDeviceGetGraphicsRunningProcesses")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeHandle) -> list[Any]:
        return self._procs(self.processes, handle, "nvmlDeviceGetComputeRunningProcesses_v2")

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: FakeHandle) -> list[Any]:
        return self._procs(self.graphics_processes, handle, "nvmlDeviceGetGraphicsRunningProcesses_v2")

    def _link(self, device: FakeHandle, link: int, fn: str) -> FakeLink:
        gpu = self._gpu(device, fn)
        if not gpu.links:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.links):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.links[link]

    def nvmlDeviceGetNvLinkState(self, device: FakeHandle, link: int) -> int:
        up = self._link(device, link, "nvmlDeviceGetNvLinkState").up
        return pynvml.NVML_FEATURE_ENABLED if up else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: FakeHandle, link: int) -> SimpleNamespace:
        remote = self._link(device, link, "nvmlDeviceGetNvLinkRemotePciInfo").remote
        if remote == NVSWITCH:
            return self._pci(_bus(0xC0 + link % _SWITCHES))
        assert isinstance(remote, int)
        return self._pci(self.gpus[remote].bus_id)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: FakeHandle, link: int) -> int:
        remote = self._link(handle, link, "nvmlDeviceGetNvLinkRemoteDeviceType").remote
        if not self.remote_type_supported:
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return (
            pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
            if remote == NVSWITCH
            else pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
        )

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: FakeHandle, device2: FakeHandle) -> int:
        a, b = self._pair(device1, device2, "nvmlDeviceGetTopologyCommonAncestor")
        return self._level(a, b)

    def nvmlDeviceGetP2PStatus(self, device1: FakeHandle, device2: FakeHandle, p2pIndex: int) -> int:
        a, b = self._pair(device1, device2, "nvmlDeviceGetP2PStatus")
        if not isinstance(p2pIndex, int) or not 0 <= p2pIndex <= pynvml.NVML_P2P_CAPS_INDEX_ATOMICS:
            # what ctypes does with a wrong argument (pynvml 13's NVML_P2P_CAPS_INDEX_READ is a tuple)
            raise TypeError(f"p2pIndex must be an int capability index, got {p2pIndex!r}")
        cap = ("read", "write", "nvlink", "atomics", "pci")[p2pIndex]
        ia, ib = device1.index, device2.index
        if (ia, ib, cap) in self.p2p_overrides:
            return self.p2p_overrides[(ia, ib, cap)]
        if self._nvlinked(ia, ib):
            return pynvml.NVML_P2P_STATUS_OK
        if cap in ("nvlink", "atomics"):
            return pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
        if self._level(a, b) == pynvml.NVML_TOPOLOGY_SYSTEM:
            return pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED
        return pynvml.NVML_P2P_STATUS_OK

    def nvmlDeviceGetMigMode(self, device: FakeHandle) -> list[int]:
        gpu = self._gpu(device, "nvmlDeviceGetMigMode")
        if gpu.mig_devices is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        on = int(bool(gpu.mig_devices))
        return [on, on]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: FakeHandle) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetMaxMigDeviceCount")
        if gpu.mig_devices is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: FakeHandle, index: int) -> Any:
        gpu = self._gpu(device, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not gpu.mig_devices or index >= len(gpu.mig_devices):
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeMigHandle(gpu.mig_devices[index])

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        self._gpu(handle, "nvmlDeviceGetMPSComputeRunningProcesses")
        raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # no MPS server on the fake machines

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: FakeHandle) -> list[Any]:
        return self.nvmlDeviceGetMPSComputeRunningProcesses(handle)

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._check_init()
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND) from None

    # -- health ------------------------------------------------------------------------------------

    def _health(self, handle: FakeHandle, fn: str) -> FakeHealth:
        gpu = self._gpu(handle, fn)
        if not self.health:
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return gpu.health

    def nvmlDeviceGetVbiosVersion(self, handle: FakeHandle) -> str:
        return self._health(handle, "nvmlDeviceGetVbiosVersion").vbios

    def nvmlDeviceGetSerial(self, handle: FakeHandle) -> str:
        serial = self._health(handle, "nvmlDeviceGetSerial").serial
        if serial is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return serial

    def nvmlDeviceGetEccMode(self, handle: FakeHandle) -> list[int]:
        return list(self._health(handle, "nvmlDeviceGetEccMode").ecc_mode)

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, errorType: int, counterType: int) -> int:
        h = self._health(handle, "nvmlDeviceGetTotalEccErrors")
        error = "uncorrected" if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "corrected"
        counter = "volatile" if counterType == pynvml.NVML_VOLATILE_ECC else "aggregate"
        return h.ecc_errors.get((error, counter), 0)

    def nvmlDeviceGetRemappedRows(self, device: FakeHandle) -> tuple[int, int, int, int]:
        h = self._health(device, "nvmlDeviceGetRemappedRows")
        if h.remapped_rows is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return h.remapped_rows

    def nvmlDeviceGetRetiredPages(self, device: FakeHandle, sourceFilter: int) -> list[int]:
        h = self._health(device, "nvmlDeviceGetRetiredPages")
        if h.retired_pages is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        dbe = sourceFilter == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        return [0x1000 * (n + 1) for n in range(h.retired_pages.get("dbe" if dbe else "sbe", 0))]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: FakeHandle) -> int:
        h = self._health(device, "nvmlDeviceGetRetiredPagesPendingStatus")
        if h.retired_pages is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_FEATURE_ENABLED if h.retired_pending else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return self._health(handle, "nvmlDeviceGetCurrentClocksEventReasons").clocks_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return self._health(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clocks_event_reasons

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        return self._health(handle, "nvmlDeviceGetTemperature").temperature_c

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._health(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        return self._health(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        return self._health(handle, "nvmlDeviceGetPcieReplayCounter").pcie_replays

    def nvmlDeviceGetUnrepairableMemoryFlag_v1(self, handle: FakeHandle) -> int:
        flag = self._health(handle, "nvmlDeviceGetUnrepairableMemoryFlag_v1").unrepairable_memory
        if flag is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(flag)

    def nvmlDeviceGetPersistenceMode(self, handle: FakeHandle) -> int:
        on = self._health(handle, "nvmlDeviceGetPersistenceMode").persistence
        return pynvml.NVML_FEATURE_ENABLED if on else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, fieldIds: list[Any]) -> list[Any]:
        """A field id, or a (field id, scope) pair as pynvml takes it: ``fields`` keys are ids, or
        (id, link) for the NVLink-scoped counters."""
        h = self._health(handle, "nvmlDeviceGetFieldValues")
        out = []
        for fid in fieldIds:
            known = fid in h.fields
            out.append(
                SimpleNamespace(
                    fieldId=fid[0] if isinstance(fid, tuple) else fid,
                    nvmlReturn=pynvml.NVML_SUCCESS if known else pynvml.NVML_ERROR_NOT_SUPPORTED,
                    valueType=3,  # NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                    value=SimpleNamespace(ullVal=h.fields.get(fid, 0)),
                )
            )
        return out

    def nvmlDeviceGetNvLinkErrorCounter(self, device: FakeHandle, link: int, counter: int) -> int:
        self._link(device, link, "nvmlDeviceGetNvLinkErrorCounter")
        h = self._health(device, "nvmlDeviceGetNvLinkErrorCounter")
        order = (
            pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
            pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
            pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
        )
        return h.nvlink_errors.get(link, (0, 0, 0, 0))[order.index(counter)]

    def _fabric(self, device: FakeHandle, info: Any, fn: str) -> None:
        h = self._health(device, fn)
        if h.fabric is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        target = info._obj  # ctypes.byref(struct): the struct the caller passed
        if hasattr(target, "version"):
            # NVML_STRUCT_VERSION: the size in the low bits, the version in the top byte (nvml.h).
            version, size = target.version >> 24, target.version & 0xFFFFFF
            if (
                size != ctypes.sizeof(target)
                or version not in (2, 3)
                or (version == 3 and h.fabric_summary is None)
            ):
                raise _err(_VERSION_MISMATCH)
        target.state, target.status, target.cliqueId = h.fabric[0], h.fabric[1], h.fabric[2]
        target.clusterUuid[:] = list(bytes.fromhex(h.fabric_uuid.replace("-", "")))
        if hasattr(target, "healthMask"):
            target.healthMask = h.fabric[3]
        if hasattr(target, "healthSummary"):
            target.healthSummary = h.fabric_summary or 0

    def nvmlDeviceGetGpuFabricInfoV(self, device: FakeHandle, gpuFabricInfo: Any) -> None:
        self._fabric(device, gpuFabricInfo, "nvmlDeviceGetGpuFabricInfoV")

    def nvmlDeviceGetGpuFabricInfo(self, device: FakeHandle, gpuFabricInfo: Any) -> None:
        self._fabric(device, gpuFabricInfo, "nvmlDeviceGetGpuFabricInfo")

    def nvmlDeviceGetGpuFabricInfo_v4(self, device: FakeHandle, gpuFabricInfo: Any) -> None:
        h = self._health(device, "nvmlDeviceGetGpuFabricInfo_v4")
        if h.fabric is None or h.fabric_cliques is None:
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        target = gpuFabricInfo._obj
        target.state, target.status, target.healthMask = h.fabric[0], h.fabric[1], h.fabric[3]
        target.clusterUuid[:] = list(bytes.fromhex(h.fabric_uuid.replace("-", "")))
        target.healthSummary = h.fabric_summary or 0
        target.numCliques = len(h.fabric_cliques)
        for slot, (kind, ident) in enumerate(h.fabric_cliques):
            target.cliques[slot].type, target.cliques[slot].id = kind, ident

    def nvmlDeviceGetPlatformInfo(self, device: FakeHandle, platformInfo: Any) -> None:
        h = self._health(device, "nvmlDeviceGetPlatformInfo")
        if h.platform is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        target = platformInfo._obj
        if target.version != (ctypes.sizeof(target) | 2 << 24):
            raise _err(_VERSION_MISMATCH)
        serial, slot, tray, host, peer, module = h.platform
        raw = serial.encode()[:16].ljust(16, b"\0")
        target.chassisSerialNumber[:] = list(raw)
        target.slotNumber, target.trayIndex, target.hostId = slot, tray, host
        target.peerType, target.moduleId = peer, module

    def nvmlDeviceGetC2cModeInfoV(self, handle: FakeHandle) -> Any:
        h = self._health(handle, "nvmlDeviceGetC2cModeInfoV")
        if h.c2c is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(isC2cEnabled=int(h.c2c))

    # -- Xid events --------------------------------------------------------------------------------

    def queue_xid(self, gpu: int, xid: int) -> None:
        """Make every event set with ``gpu`` registered report Xid ``xid`` on its next wait."""
        for events in self.event_sets.values():
            events.append((gpu, xid))

    def nvmlEventSetCreate(self) -> int:
        self._check_init()
        key = len(self.event_sets) + 1
        self.event_sets[key] = []
        return key

    def nvmlEventSetFree(self, eventSet: int) -> None:
        self.event_sets.pop(eventSet, None)

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeHandle) -> int:
        h = self._health(handle, "nvmlDeviceGetSupportedEventTypes")
        return pynvml.nvmlEventTypeXidCriticalError if h.xid_events else 0

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, eventTypes: int, eventSet: int) -> None:
        self._gpu(handle, "nvmlDeviceRegisterEvents")

    def nvmlEventSetWait_v2(self, eventSet: int, timeoutms: int) -> Any:
        events = self.event_sets.get(eventSet)
        if not events:
            raise _err(pynvml.NVML_ERROR_TIMEOUT)
        gpu, xid = events.pop(0)
        return SimpleNamespace(
            device=self._handles.get(gpu, FakeHandle(gpu)),
            eventType=pynvml.nvmlEventTypeXidCriticalError,
            eventData=xid,
        )

    def nvmlEventSetWait(self, eventSet: int, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)
