"""The one module that talks to NVML (the only ``pynvml`` import in gputopo).

NVML is loaded and initialised lazily, inside ``session()``, and shut down when the session ends; importing
this module does neither. Every pynvml error is turned into something of ours here, so nothing outside this
module ever sees one:

- a query the GPU or driver does not support (``NotSupported``, ``FunctionNotFound``, ``NoPermission``,
  ...) returns ``None``, which the rest of gputopo shows as n/a;
- a GPU that stopped answering (``GpuIsLost``, ``ResetRequired``, ``Unknown``, ...) raises ``DeviceFailed``
  for that GPU only, so the caller can mark it and keep reading the others;
- NVML that cannot start at all (no ``libnvidia-ml.so``, driver not loaded, driver/library mismatch)
  raises ``NvmlUnavailable``, a project error with exit code 3.

Tests swap the backend (the object the ``nvml*`` functions are called on) with ``use_backend(fake)``; the
real backend is the ``pynvml`` module itself. A fake implements the functions named in ``NvmlBackend``, with
pynvml's names, arguments and return shapes, and raises pynvml's own ``NVMLError`` subclasses.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gputopo.errors import UnavailableError
from gputopo.model import PcieLink

_MIB = 1024 * 1024

# NVML fills affinity masks in 64-bit words; asking for more words than the machine has CPUs is harmless,
# and 16 words (1024 CPUs) covers machines whose CPU ids have gaps (offline CPUs).
_MIN_CPU_SET_WORDS = 16
_NODE_SET_WORDS = 4

RemoteKind = Literal["gpu", "switch", "cpu"]


class NvmlBackend(Protocol):
    """The pynvml functions gputopo calls, with pynvml's signatures (the real backend is ``pynvml``)."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int: ...
    def nvmlDeviceGetCpuAffinity(self, handle: Any, cpuSetSize: int) -> Sequence[int]: ...
    def nvmlDeviceGetMemoryAffinity(self, handle: Any, nodeSetSize: int, scope: int) -> Sequence[int]: ...
    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int: ...
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int: ...
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int: ...
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int: ...
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int: ...
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> Any: ...
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int: ...
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int: ...
    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2pIndex: int) -> int: ...


_backend: NvmlBackend | None = None


def set_backend(backend: NvmlBackend | None) -> None:
    """Use ``backend`` for every NVML call from now on; ``None`` goes back to the real ``pynvml``."""
    global _backend
    _backend = backend


@contextmanager
def use_backend(backend: NvmlBackend) -> Iterator[NvmlBackend]:
    """Use ``backend`` inside the ``with`` block (tests pass a fake NVML), then restore the previous one."""
    previous = _backend
    set_backend(backend)
    try:
        yield backend
    finally:
        set_backend(previous)


def _pynvml() -> Any:
    # Imported here, not at module level: commands that never read the live machine don't pay for it.
    import pynvml

    return pynvml


def _lib() -> Any:
    return _backend if _backend is not None else _pynvml()


class NvmlUnavailable(UnavailableError):
    """NVML cannot start on this machine (exit 3); ``not_installed`` when there is no driver/library."""

    def __init__(self, message: str, hint: str | None = None, not_installed: bool = False) -> None:
        super().__init__(message, hint)
        self.not_installed = not_installed


class DeviceFailed(Exception):
    """A GPU stopped answering NVML. ``where`` is ``GPU2`` (or ``GPU0-GPU2`` for a pair query), ``reason``
    is NVML's text, e.g. ``GPU is lost``."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


def _soft_error_codes(lib: Any) -> frozenset[int]:
    """NVML return codes that mean "this value is not available here", not "this GPU is broken"."""
    names = (
        "NVML_ERROR_NOT_SUPPORTED",
        "NVML_ERROR_FUNCTION_NOT_FOUND",  # an older driver than the pynvml bindings
        "NVML_ERROR_NO_PERMISSION",
        "NVML_ERROR_NOT_FOUND",
        "NVML_ERROR_INVALID_ARGUMENT",  # e.g. an NVLink index past the GPU's last link
    )
    return frozenset(getattr(lib, n) for n in names if hasattr(lib, n))


def _not_installed_codes(lib: Any) -> frozenset[int]:
    return frozenset(
        getattr(lib, n)
        for n in ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED")
        if hasattr(lib, n)
    )


def _int_constant(value: Any) -> int:
    # pynvml 13 defines NVML_P2P_CAPS_INDEX_READ as ``0,`` (a tuple); ctypes would reject it as an argument.
    if isinstance(value, tuple):
        value = value[0]
    return int(value)


def normalize_bus_id(raw: bytes | str | None) -> str | None:
    """NVML's PCI bus id as nvidia-smi prints it: ``00000000:1B:00.0`` (8-digit domain, upper case).

    Accepts the legacy 4-digit-domain form (``0000:1b:00.0``) too; ``None`` for an empty value.
    """
    if raw is None:
        return None
    text = raw.decode("ascii", errors="replace") if isinstance(raw, bytes) else raw
    text = text.strip("\x00 \t\n").upper()
    if not text:
        return None
    parts = text.split(":")
    if len(parts) == 3:
        domain, bus, devfn = parts
        return f"{domain.rjust(8, '0')[-8:]}:{bus}:{devfn}"
    if len(parts) == 2:  # no domain at all: domain 0
        return "00000000:" + text
    return text


def bitmask_ids(words: Sequence[int], bits_per_word: int = 64) -> tuple[int, ...]:
    """The set bits of an NVML affinity mask (word ``i`` bit ``j`` is id ``i * 64 + j``), ascending."""
    ids: list[int] = []
    for w, word in enumerate(words):
        value = int(word)
        for bit in range(bits_per_word):
            if value >> bit & 1:
                ids.append(w * bits_per_word + bit)
    return tuple(ids)


def cuda_version_text(version: int | None) -> str | None:
    """NVML's CUDA driver version integer as people write it: 12040 -> ``12.4``."""
    if version is None or version <= 0:
        return None
    return f"{version // 1000}.{version % 1000 // 10}"


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


class Session:
    """An initialised NVML. Get one from ``session()``; it is valid only inside that ``with`` block."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._errors = _pynvml()
        self._soft = _soft_error_codes(self._errors)

    def _call(self, where: str, fn_name: str, *args: Any) -> Any:
        """Call ``lib.<fn_name>(*args)``; ``None`` when unsupported, ``DeviceFailed`` when the GPU fails."""
        errors = self._errors
        fn = getattr(self._lib, fn_name, None)
        if fn is None:  # bindings older than the function: same as the driver lacking it
            return None
        try:
            return fn(*args)
        except errors.NVMLLibraryMismatchError:
            return None
        except errors.NVMLError as exc:
            if exc.value in self._soft:
                return None
            raise DeviceFailed(where, str(exc)) from None

    def driver_version(self) -> str | None:
        """The NVIDIA driver version, e.g. ``550.54.15``."""
        try:
            value = self._call("driver", "nvmlSystemGetDriverVersion")
        except DeviceFailed:
            return None
        return value.decode() if isinstance(value, bytes) else value

    def cuda_driver_version(self) -> str | None:
        """The newest CUDA version the driver supports, e.g. ``12.4``."""
        try:
            return cuda_version_text(self._call("driver", "nvmlSystemGetCudaDriverVersion"))
        except DeviceFailed:
            return None

    def device_count(self) -> int:
        """How many GPUs NVML sees; ``NvmlUnavailable`` when it cannot even count them."""
        errors = self._errors
        try:
            return int(self._lib.nvmlDeviceGetCount())
        except errors.NVMLError as exc:
            raise NvmlUnavailable(
                f"NVML started but cannot count the GPUs: {exc}",
                "check `nvidia-smi`; the driver may need a reload or the machine a reboot",
            ) from None

    def device(self, index: int) -> Device:
        """The GPU with NVML index ``index`` (= nvidia-smi's); ``DeviceFailed`` when it does not answer."""
        errors = self._errors
        try:
            handle = self._lib.nvmlDeviceGetHandleByIndex(index)
        except errors.NVMLError as exc:
            raise DeviceFailed(f"GPU{index}", str(exc)) from None
        return Device(self, index, handle)

    def path_code(self, a: Device, b: Device) -> str | None:
        """The PCIe path between two GPUs as a ``topo -m`` code (``PIX`` ... ``SYS``); ``None`` if unknown."""
        level = self._call(
            f"GPU{a.index}-GPU{b.index}", "nvmlDeviceGetTopologyCommonAncestor", a.handle, b.handle
        )
        if level is None:
            return None
        return _topology_codes(self._errors).get(int(level))

    def p2p_status(self, a: Device, b: Device, capability: str) -> str | None:
        """P2P status from ``a`` to ``b`` for a capability in ``P2P_CAPABILITIES``: ``OK``, ``CNS``, ...

        ``None`` when NVML cannot answer or answers with a status this version of gputopo does not know.
        """
        e = self._errors
        index = {
            "read": e.NVML_P2P_CAPS_INDEX_READ,
            "write": e.NVML_P2P_CAPS_INDEX_WRITE,
            "nvlink": e.NVML_P2P_CAPS_INDEX_NVLINK,
            "atomics": e.NVML_P2P_CAPS_INDEX_ATOMICS,
        }[capability]
        status = self._call(
            f"GPU{a.index}-GPU{b.index}", "nvmlDeviceGetP2PStatus", a.handle, b.handle, _int_constant(index)
        )
        if status is None:
            return None
        return _p2p_codes(e).get(int(status))


def _topology_codes(e: Any) -> dict[int, str]:
    # NVML_TOPOLOGY_INTERNAL is two GPUs on one board (K80, M60): nvidia-smi prints PIX for it.
    return {
        e.NVML_TOPOLOGY_INTERNAL: "PIX",
        e.NVML_TOPOLOGY_SINGLE: "PIX",
        e.NVML_TOPOLOGY_MULTIPLE: "PXB",
        e.NVML_TOPOLOGY_HOSTBRIDGE: "PHB",
        e.NVML_TOPOLOGY_NODE: "NODE",
        e.NVML_TOPOLOGY_SYSTEM: "SYS",
    }


def _p2p_codes(e: Any) -> dict[int, str]:
    return {
        e.NVML_P2P_STATUS_OK: "OK",
        e.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED: "CNS",
        e.NVML_P2P_STATUS_GPU_NOT_SUPPORTED: "GNS",
        e.NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED: "TNS",
        e.NVML_P2P_STATUS_DISABLED_BY_REGKEY: "DR",
        e.NVML_P2P_STATUS_NOT_SUPPORTED: "NS",
        e.NVML_P2P_STATUS_UNKNOWN: "U",
    }


class Device:
    """One GPU inside a ``Session``. Each query returns ``None`` when NVML does not support it and raises
    ``DeviceFailed`` when the GPU stops answering."""

    def __init__(self, session: Session, index: int, handle: Any) -> None:
        self.session = session
        self.index = index
        self.handle = handle

    def _q(self, fn_name: str, *args: Any) -> Any:
        return self.session._call(f"GPU{self.index}", fn_name, self.handle, *args)

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
        """(total, used) GPU memory in MiB."""
        info = self._q("nvmlDeviceGetMemoryInfo")
        if info is None:
            return None, None
        return int(info.total) // _MIB, int(info.used) // _MIB

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
            try:
                remote = _bus_id_of(self._q("nvmlDeviceGetNvLinkRemotePciInfo", link))
                kind = self._q("nvmlDeviceGetNvLinkRemoteDeviceType", link)
            except DeviceFailed:
                if up:
                    raise
                # A link that is down may have no far end to describe; that says nothing about the GPU.
                remote, kind = None, None
            ends.append(NvlinkEnd(link, up, remote, kinds.get(int(kind)) if kind is not None else None))
        return ends


def _text(value: Any) -> str | None:
    if value is None:
        return None
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return text.strip("\x00").strip() or None


def _int_or_none(value: Any) -> int | None:
    return int(value) if value is not None else None


def _bus_id_of(info: Any) -> str | None:
    if info is None:
        return None
    bus_id = normalize_bus_id(getattr(info, "busId", None))
    if bus_id is None:  # drivers before NVML 9 only fill the legacy field
        bus_id = normalize_bus_id(getattr(info, "busIdLegacy", None))
    return bus_id


_INSTALL_HINT = "install the NVIDIA driver (it ships libnvidia-ml.so), or run where `nvidia-smi` works"


@contextmanager
def session() -> Iterator[Session]:
    """Initialise NVML for the ``with`` block and shut it down after, whatever happens inside.

    Raises ``NvmlUnavailable`` (exit 3) when NVML cannot start; ``not_installed`` is set when the library
    or the driver is missing (as opposed to, say, a driver/library version mismatch).
    """
    lib = _lib()
    errors = _pynvml()
    try:
        lib.nvmlInit()
    except errors.NVMLError as exc:
        missing = exc.value in _not_installed_codes(errors)
        raise NvmlUnavailable(f"NVML could not start: {exc}", _INSTALL_HINT, not_installed=missing) from None
    except OSError as exc:  # a broken libnvidia-ml.so that the loader finds but cannot load
        raise NvmlUnavailable(f"NVML could not start: {exc}", _INSTALL_HINT) from None
    try:
        yield Session(lib)
    finally:
        # Nothing useful to do when shutdown fails; the process carries on without NVML.
        with suppress(errors.NVMLError):
            lib.nvmlShutdown()


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
    errors = session._errors
    base = _LIST_FUNCTIONS[kind]
    for name in (base, base + "_v2"):
        fn = getattr(session._lib, name, None)
        if fn is None:
            continue
        try:
            raw = fn(dev.handle)
        except errors.NVMLLibraryMismatchError:
            continue
        except errors.NVMLError as exc:
            code = exc.value
            if code == getattr(errors, "NVML_ERROR_FUNCTION_NOT_FOUND", None):
                continue
            if kind != "compute" and code == getattr(errors, "NVML_ERROR_NOT_SUPPORTED", None):
                return ProcessList(kind, ())
            if code in session._soft:
                return ProcessList(kind, None, str(exc))
            raise DeviceFailed(f"GPU{dev.index}", str(exc)) from None
        out = []
        for p in raw or ():
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
    errors = s._errors
    fn = getattr(s._lib, "nvmlSystemGetProcessName", None)
    if fn is None:
        return None
    try:
        return _text(fn(pid))
    except errors.NVMLError:
        return None
