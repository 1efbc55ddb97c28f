"""The one module that talks to NVML (the only ``pynvml`` import in gputopo).

NVML is loaded and initialised lazily, inside ``session()``, and shut down when the session ends; importing
this module does neither. Every pynvml error is turned into something of ours here, so nothing outside this
module ever sees one. The rule, per call:

- a value the GPU or driver does not have (``NotSupported``, ``FunctionNotFound`` from a driver older than
  the bindings, ``InvalidArgument`` for an NVLink index past the last, ``NotFound``) returns ``None``,
  which the rest of gputopo shows as n/a;
- only a GPU that is gone (``GpuIsLost``, ``ResetRequired``, ``GpuNotFound``) raises ``DeviceFailed`` for
  that GPU, so the caller marks it "failing" and keeps reading the others;
- the handle refused for permission (``NoPermission``, or ``OperatingSystem``: "blocked by the operating
  system/cgroups") raises ``DeviceFailed`` with state "not accessible": GPUs hidden from a Slurm job;
- any other error (``Unknown``, ``NotReady``, ``InvalidState``, ``CorruptedInforom``, ``Timeout``,
  ``NoPermission`` on a single value, ...) blanks that one value and leaves a warning in
  ``Session.warnings``; the GPU's other values are still read;
- NVML that cannot start at all (no ``libnvidia-ml.so``, driver not loaded, driver/library mismatch)
  raises ``NvmlUnavailable``, a project error with exit code 3.

Every nvidia-ml-py from the lowest version pyproject allows is handled: names that newer bindings added
(``NVMLLibraryMismatchError``, ``NVML_ERROR_GPU_NOT_FOUND``, functions like ``nvmlDeviceGetNumaNodeId``)
are looked up with ``getattr``, never assumed.

Tests swap the backend (the object the ``nvml*`` functions are called on) with ``use_backend(fake)``; the
real backend is the ``pynvml`` module itself. A fake implements the functions named in ``NvmlBackend``, with
pynvml's names, arguments and return shapes, and raises pynvml's own ``NVMLError`` subclasses. The tests of
the real path load the real pynvml against a fake ``libnvidia-ml.so.1`` (tests/fakedriver).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gputopo.errors import UnavailableError
from gputopo.model import GPU_FAILING, GPU_NOT_ACCESSIBLE, PcieLink

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
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int: ...
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> Any: ...
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int: ...
    def nvmlDeviceGetTopologyCommonAncestor(self, device1: Any, device2: Any) -> int: ...
    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2pIndex: int) -> int: ...
    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]: ...
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int: ...
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any: ...
    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: Any) -> list[Any]: ...
    def nvmlSystemGetProcessName(self, pid: int) -> str: ...
    # Health (system/health_reads.py reads these through Device's health queries below).
    def nvmlDeviceGetVbiosVersion(self, handle: Any) -> str: ...
    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]: ...
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int: ...
    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]: ...
    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]: ...
    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int: ...
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int: ...
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int: ...
    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int: ...
    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int: ...
    def nvmlDeviceGetUnrepairableMemoryFlag_v1(self, handle: Any) -> int: ...
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Sequence[Any]: ...
    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int: ...
    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, gpuFabricInfo: Any) -> None: ...
    def nvmlDeviceGetGpuFabricInfo(self, device: Any, gpuFabricInfo: Any) -> None: ...
    # Xid events (XidEventSet).
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlEventSetFree(self, eventSet: Any) -> None: ...
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None: ...
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any: ...
    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any: ...


START_CALL = "nvmlInit"
"""The call that starts NVML: what the NVML worker waits on first (named in its "did not answer" line)."""

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


def backend_overridden() -> bool:
    """True while a test backend is in place (it lives in this process, so reads must too)."""
    return _backend is not None


def library_present() -> bool:
    """Whether ``libnvidia-ml.so.1`` loads, as pynvml loads it on Linux. Loading the library does not
    talk to the driver (only ``nvmlInit`` and the queries do), so this cannot hang; without the library
    there is nothing to put behind a deadline."""
    if sys.platform != "linux":
        return True  # let pynvml look for it the way it does there
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def _pynvml() -> Any:
    # Imported here, not at module level: commands that never read the live machine don't pay for it.
    import pynvml

    return pynvml


def _lib() -> Any:
    return _backend if _backend is not None else _pynvml()


class NvmlUnavailable(UnavailableError):
    """NVML cannot start on this machine (exit 3); ``not_installed`` when there is no driver/library,
    ``hung`` when it did not answer within the deadline."""

    def __init__(
        self, message: str, hint: str | None = None, not_installed: bool = False, hung: bool = False
    ) -> None:
        super().__init__(message, hint)
        self.not_installed = not_installed
        self.hung = hung


class DeviceFailed(Exception):
    """A GPU could not be read. ``where`` is ``GPU2`` (or ``GPU0-GPU2`` for a pair query), ``reason``
    is NVML's text, e.g. ``GPU is lost``; ``state`` is ``model.GPU_FAILING`` or ``GPU_NOT_ACCESSIBLE``."""

    def __init__(self, where: str, reason: str, state: str = GPU_FAILING) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason
        self.state = state


class NvmlCallFailed(Exception):
    """An NVML call that has no "unknown" to fall back on (an event set that cannot be made or waited on)
    failed; the message says how, in NVML's words."""


def _codes(lib: Any, *names: str) -> frozenset[int]:
    # getattr: older bindings lack some codes (NVML_ERROR_GPU_NOT_FOUND is not in nvidia-ml-py 12.535).
    return frozenset(getattr(lib, n) for n in names if hasattr(lib, n))


def _soft_error_codes(lib: Any) -> frozenset[int]:
    """NVML return codes that mean "this value is not available here", not "something is wrong"."""
    return _codes(
        lib,
        "NVML_ERROR_NOT_SUPPORTED",
        "NVML_ERROR_FUNCTION_NOT_FOUND",  # an older driver than the pynvml bindings
        "NVML_ERROR_NOT_FOUND",  # e.g. no far end to describe on an NVLink, an empty MIG slot
        "NVML_ERROR_INVALID_ARGUMENT",  # e.g. an NVLink index past the GPU's last link
    )


def _gone_error_codes(lib: Any) -> frozenset[int]:
    """NVML return codes that mean the GPU itself is gone or wedged: the only ones that fail a GPU."""
    return _codes(lib, "NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED", "NVML_ERROR_GPU_NOT_FOUND")


def _refused_error_codes(lib: Any) -> frozenset[int]:
    """Handle errors that mean "not yours to see": NVML's docs for nvmlDeviceGetCount_v2 say it counts
    GPUs whose nvmlDeviceGetHandleByIndex_v2 then answers NO_PERMISSION; OPERATING_SYSTEM is "blocked by
    the operating system/cgroups" (NVML nvmlReturn_t)."""
    return _codes(lib, "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_OPERATING_SYSTEM")


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


NOT_IN_BINDINGS = -1
"""``Answer.code`` when the nvidia-ml-py in use has no such function: read as the driver lacking it."""


@dataclass(frozen=True)
class Answer:
    """What one NVML query gave: ``value``, or ``None`` with ``why`` (NVML's words) and ``code`` (its
    ``nvmlReturn_t``, or ``NOT_IN_BINDINGS``) saying why the signal is unknown."""

    value: Any = None
    why: str | None = None
    code: int | None = None

    @property
    def ok(self) -> bool:
        return self.why is None

    def then(self, convert: Any) -> Answer:
        """The same answer with ``convert`` applied to a value that came back."""
        return Answer(convert(self.value)) if self.why is None and self.value is not None else self


class Session:
    """An initialised NVML. Get one from ``session()``; it is valid only inside that ``with`` block."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._errors = _pynvml()
        self._soft = _soft_error_codes(self._errors)
        self._gone = _gone_error_codes(self._errors)
        # nvidia-ml-py 12.535.x has no NVMLLibraryMismatchError (raised by newer bindings' unversioned
        # wrappers when the driver lacks the function): looking it up unconditionally crashed every read.
        self._mismatch: type[BaseException] | None = getattr(self._errors, "NVMLLibraryMismatchError", None)
        self._function_not_found = int(getattr(self._errors, "NVML_ERROR_FUNCTION_NOT_FOUND", 13))
        self.warnings: list[str] = []
        """Values blanked by an unexpected NVML error, one line each (``GPU3: ... : Unknown Error``)."""

    def query(self, where: str, fn_name: str, *args: Any, **kwargs: Any) -> Answer:
        """The one door every NVML read of gputopo goes through: call ``lib.<fn_name>(*args)`` and say what
        came back. An ``Answer`` with the value, or with ``why`` (NVML's words: ``Not Supported``,
        ``Insufficient Permissions``, ...) and ``code`` when NVML could not give it; a function the bindings
        or the driver lack answers ``missing``. Only a GPU that is gone raises (``DeviceFailed``, for
        ``where``), so one GPU's loss never hides the others'."""
        fn = getattr(self._lib, fn_name, None)
        if fn is None:  # bindings older than the function: the same as the driver lacking it
            return Answer(None, "Function Not Found (not in these nvidia-ml-py bindings)", NOT_IN_BINDINGS)
        try:
            return Answer(fn(*args, **kwargs))
        except self._errors.NVMLError as exc:
            if exc.value in self._gone:
                raise DeviceFailed(where, str(exc)) from None
            return Answer(None, str(exc), int(exc.value))
        except Exception as exc:
            # Newer bindings' versioned wrappers on a driver without the function.
            if self._mismatch is not None and isinstance(exc, self._mismatch):
                return Answer(None, "Function Not Found", self._function_not_found)
            raise

    def code(self, name: str) -> int | None:
        """The value of NVML's constant ``name`` in these bindings (``None`` when they lack it)."""
        value = getattr(self._errors, name, None)
        return int(value[0] if isinstance(value, tuple) else value) if value is not None else None

    def _call(self, where: str, fn_name: str, *args: Any, **kwargs: Any) -> Any:
        """``query`` under the rule in the module docstring: the value, or ``None`` when it is not there
        (with a warning when NVML said something unexpected); ``DeviceFailed`` when the GPU is gone."""
        answer = self.query(where, fn_name, *args, **kwargs)
        if answer.why is not None and not self.missing(answer) and answer.code not in self._soft:
            note = f"{where}: {_field_name(fn_name)} is n/a: NVML said {answer.why}"
            if note not in self.warnings:  # once per value, not per link
                self.warnings.append(note)
        return answer.value

    def missing(self, answer: Answer) -> bool:
        """Whether ``answer`` says the function is not there (bindings or driver older than it)."""
        return answer.code in (NOT_IN_BINDINGS, self._function_not_found)

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
        try:
            answer = self.query("driver", "nvmlDeviceGetCount")
        except DeviceFailed as exc:
            answer = Answer(None, exc.reason)
        if answer.why is not None:
            raise NvmlUnavailable(
                f"NVML started but cannot count the GPUs: {answer.why}",
                "check `nvidia-smi`; the driver may need a reload or the machine a reboot",
            )
        return int(answer.value)

    def device(self, index: int) -> Device:
        """The GPU with NVML index ``index`` (= nvidia-smi's); ``DeviceFailed`` when it does not answer."""
        answer = self.query(f"GPU{index}", "nvmlDeviceGetHandleByIndex", index)
        if answer.why is not None:
            # Without a handle nothing about the GPU can be read: permission means "not ours to see",
            # anything else (lost, insufficient power, IRQ issue, unknown) leaves a GPU that cannot work.
            refused = answer.code in _refused_error_codes(self._errors)
            raise DeviceFailed(f"GPU{index}", answer.why, GPU_NOT_ACCESSIBLE if refused else GPU_FAILING)
        return Device(self, index, answer.value)

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

    def _q(self, fn_name: str, *args: Any, **kwargs: Any) -> Any:
        return self.session._call(f"GPU{self.index}", fn_name, self.handle, *args, **kwargs)

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

    # --- Health reads: each answer keeps why a value is unknown (system/health_reads.py) ----------------

    def _a(self, fn_name: str, *args: Any) -> Answer:
        return self.session.query(f"GPU{self.index}", fn_name, self.handle, *args)

    def vbios(self) -> Answer:
        """The VBIOS version (``96.00.99.00.01``)."""
        return self._a("nvmlDeviceGetVbiosVersion").then(_text)

    def ecc_mode(self) -> Answer:
        """``(enabled now, enabled after the next reset)``."""
        on = int(self.session._errors.NVML_FEATURE_ENABLED)
        return self._a("nvmlDeviceGetEccMode").then(lambda m: (int(m[0]) == on, int(m[1]) == on))

    def ecc_errors(
        self, error: Literal["corrected", "uncorrected"], counter: Literal["volatile", "aggregate"]
    ) -> Answer:
        """The ECC error count of one kind: since the driver loaded (volatile) or over the GPU's life."""
        s = self.session
        kind = s.code(f"NVML_MEMORY_ERROR_TYPE_{error.upper()}")
        which = s.code("NVML_VOLATILE_ECC" if counter == "volatile" else "NVML_AGGREGATE_ECC")
        return self._a("nvmlDeviceGetTotalEccErrors", kind, which).then(int)

    def remapped_rows(self) -> Answer:
        """``(corrected, uncorrected, pending, failure)`` row remaps (Ampere and later)."""
        return self._a("nvmlDeviceGetRemappedRows").then(
            lambda r: (int(r[0]), int(r[1]), bool(int(r[2])), bool(int(r[3])))
        )

    def retired_pages(self, cause: Literal["sbe", "dbe"]) -> Answer:
        """How many pages were retired for ``cause`` (before Ampere): multiple single-bit or a double-bit
        ECC error."""
        name = {
            "sbe": "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",
            "dbe": "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR",
        }[cause]
        return self._a("nvmlDeviceGetRetiredPages", self.session.code(name)).then(len)

    def retired_pages_pending(self) -> Answer:
        """Whether a page retirement waits for the next reset."""
        on = int(self.session._errors.NVML_FEATURE_ENABLED)
        return self._a("nvmlDeviceGetRetiredPagesPendingStatus").then(lambda v: int(v) == on)

    def clocks_event_reasons(self) -> Answer:
        """NVML's clocks event reasons bitmask; drivers before r535 know the same bits under the older
        ``...ClocksThrottleReasons`` name."""
        answer = self._a("nvmlDeviceGetCurrentClocksEventReasons")
        if self.session.missing(answer):
            answer = self._a("nvmlDeviceGetCurrentClocksThrottleReasons")
        return answer.then(int)

    def temperature_c(self) -> Answer:
        return self._a("nvmlDeviceGetTemperature", self.session._errors.NVML_TEMPERATURE_GPU).then(int)

    def power_w(self) -> Answer:
        """Power draw in W (NVML answers mW)."""
        return self._a("nvmlDeviceGetPowerUsage").then(lambda mw: int(mw) / _MW_PER_W)

    def power_limit_w(self) -> Answer:
        """The enforced power limit in W."""
        return self._a("nvmlDeviceGetEnforcedPowerLimit").then(lambda mw: int(mw) / _MW_PER_W)

    def pcie_value(self, which: Literal["gen_current", "gen_max", "width_current", "width_max"]) -> Answer:
        """One of the PCIe link's generation and width, current or maximum."""
        name = {
            "gen_current": "nvmlDeviceGetCurrPcieLinkGeneration",
            "gen_max": "nvmlDeviceGetMaxPcieLinkGeneration",
            "width_current": "nvmlDeviceGetCurrPcieLinkWidth",
            "width_max": "nvmlDeviceGetMaxPcieLinkWidth",
        }[which]
        return self._a(name).then(int)

    def pcie_replays(self) -> Answer:
        return self._a("nvmlDeviceGetPcieReplayCounter").then(int)

    def utilization(self) -> Answer:
        """GPU utilisation over NVML's last sample period, percent."""
        return self._a("nvmlDeviceGetUtilizationRates").then(lambda rates: int(rates.gpu))

    def unrepairable_memory(self) -> Answer:
        """Whether the driver flags the GPU's memory as unrepairable (newer drivers'
        ``nvmlDeviceGetUnrepairableMemoryFlag_v1``; DCGM 4.6 reads it for DCGM_FI_DEV_MEMORY_UNREPAIRABLE)."""
        return self._a("nvmlDeviceGetUnrepairableMemoryFlag_v1").then(lambda v: bool(int(v)))

    def persistence_mode(self) -> Answer:
        on = int(self.session._errors.NVML_FEATURE_ENABLED)
        return self._a("nvmlDeviceGetPersistenceMode").then(lambda v: int(v) == on)

    def mig_enabled(self) -> Answer:
        """Whether MIG is enabled now."""
        on = int(getattr(self.session._errors, "NVML_DEVICE_MIG_ENABLE", 1))
        return self._a("nvmlDeviceGetMigMode").then(lambda m: int(m[0]) == on)

    def field_value(self, field_id: int) -> Answer:
        """One NVML field value; each field carries its own return code (``nvmlFieldValue_t.nvmlReturn``),
        so one field's NOT_SUPPORTED does not hide the others."""
        answer = self._a("nvmlDeviceGetFieldValues", [field_id])
        if answer.why is not None or answer.value is None:
            return answer
        v = answer.value[0]
        ret = int(v.nvmlReturn)
        if ret != 0:
            why = str(self.session._errors.NVMLError(ret))
            if ret in self.session._gone:
                raise DeviceFailed(f"GPU{self.index}", why)
            return Answer(None, why, ret)
        return Answer(int(getattr(v.value, _VALUE_MEMBERS.get(int(v.valueType), "ullVal"))))

    def link_field_values(self, links: Sequence[int], field_ids: Sequence[int]) -> Answer:
        """NVML field values scoped to NVLinks (``nvmlFieldValue_t.scopeId`` = the link), in one call: a
        dict ``(link, field id) -> value`` of those that answered (a field the GPU lacks, NOT_SUPPORTED in
        its own slot, is left out). The NVLink5 error counters (fields 206-215, 221) are read this way."""
        pairs = [(f, link) for link in links for f in field_ids]
        if not pairs:
            return Answer({})
        try:
            answer = self._a("nvmlDeviceGetFieldValues", pairs)
        except TypeError:  # bindings that take field ids only, no (field, scope) pairs
            return Answer(None, "these bindings cannot scope a field to a link", NOT_IN_BINDINGS)
        if answer.why is not None or answer.value is None:
            return answer
        out: dict[tuple[int, int], int] = {}
        for (field_id, link), v in zip(pairs, answer.value, strict=False):
            if int(v.nvmlReturn) == 0:
                out[(link, field_id)] = int(getattr(v.value, _VALUE_MEMBERS.get(int(v.valueType), "ullVal")))
        return Answer(out)

    def nvlink_errors(
        self, link: int, counter: Literal["replay", "recovery", "crc_flit", "crc_data"]
    ) -> Answer:
        """One NVLink error counter of ``link``."""
        name = {
            "replay": "NVML_NVLINK_ERROR_DL_REPLAY",
            "recovery": "NVML_NVLINK_ERROR_DL_RECOVERY",
            "crc_flit": "NVML_NVLINK_ERROR_DL_CRC_FLIT",
            "crc_data": "NVML_NVLINK_ERROR_DL_CRC_DATA",
        }[counter]
        return self._a("nvmlDeviceGetNvLinkErrorCounter", link, self.session.code(name)).then(int)

    def fabric_info(self) -> Answer:
        """The GPU's NVLink fabric registration (NVSwitch and NVL systems) as a ``FabricInfo``: asked
        through ``nvmlDeviceGetGpuFabricInfoV`` (v2, with the health mask), else the v1 call."""
        import ctypes

        v1_type, v2_type, v2_version = _fabric_structs()
        v2 = v2_type(version=v2_version)
        answer = self._a("nvmlDeviceGetGpuFabricInfoV", ctypes.byref(v2))
        if answer.ok:
            return Answer(_fabric_of(v2, v2.healthMask))
        if self.session.missing(answer):
            v1 = v1_type()
            answer = self._a("nvmlDeviceGetGpuFabricInfo", ctypes.byref(v1))
            if answer.ok:
                return Answer(_fabric_of(v1, None))
        return answer


@dataclass(frozen=True)
class FabricInfo:
    """A GPU's fabric registration: ``state`` (``NVML_GPU_FABRIC_STATE_*``), ``status`` (an
    ``nvmlReturn_t``), its clique and (v2 only) the health mask."""

    state: int
    status: int
    clique_id: int
    health_mask: int | None


def _fabric_of(info: Any, mask: Any) -> FabricInfo:
    return FabricInfo(
        int(info.state), int(info.status), int(info.cliqueId), int(mask) if mask is not None else None
    )


# nvmlValueType_t -> the member of nvmlValue_t that holds the value (nvml.h).
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
_MW_PER_W = 1000.0


@functools.cache
def _fabric_structs() -> tuple[Any, Any, int]:
    """The fabric info structs as nvml.h lays them out, ours rather than the bindings': nvidia-ml-py 12.535
    declares the v1 struct with an 80-byte clusterUuid (the device UUID buffer size), where nvml.h has 16
    (NVML_GPU_FABRIC_UUID_LEN), so every field after it would be read from the wrong place. Built on first
    use, so that importing this module does not import ctypes. Returns (v1, v2, the v2 version word)."""
    import ctypes

    class FabricInfoV1(ctypes.Structure):
        _fields_ = [
            ("clusterUuid", ctypes.c_uint8 * 16),
            ("status", ctypes.c_int),
            ("cliqueId", ctypes.c_uint32),  # "partitionId" in r525-r535's nvml.h: the same field
            ("state", ctypes.c_uint32),
        ]

    class FabricInfoV2(ctypes.Structure):
        _fields_ = [
            ("version", ctypes.c_uint32),
            ("clusterUuid", ctypes.c_uint8 * 16),
            ("status", ctypes.c_int),
            ("cliqueId", ctypes.c_uint32),
            ("state", ctypes.c_uint32),
            ("healthMask", ctypes.c_uint32),
        ]

    # nvmlGpuFabricInfo_v2 = NVML_STRUCT_VERSION(GpuFabricInfo, 2): the struct's size | 2 << 24 (nvml.h).
    return FabricInfoV1, FabricInfoV2, ctypes.sizeof(FabricInfoV2) | 2 << 24


def _field_name(fn_name: str) -> str:
    """``nvmlDeviceGetMemoryInfo`` -> ``MemoryInfo``: the value a warning is about."""
    for prefix in ("nvmlDeviceGet", "nvmlSystemGet", "nvml"):
        if fn_name.startswith(prefix):
            return fn_name[len(prefix) :]
    return fn_name


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


# --- Xid events (the probe listens while its ranks run) -----------------------------------------------
#
# NVML docs, "Event Handling Methods" (nvmlDeviceRegisterEvents, nvmlEventSetWait_v2): events that
# happened before registration are not recorded; a wait returns at once when an event is ready, else
# sleeps up to its timeout (or less, on an interrupt) and answers NVML_ERROR_TIMEOUT; on Linux every Xid
# event carries its own Xid in ``eventData``; NOT_SUPPORTED from a registration leaves the set usable.


class XidEventSet:
    """An NVML event set with every GPU of ``indices`` that has Xid critical error events registered.

    ``registered`` lists those GPUs, ``skipped`` says why each other one is not (lost, no Xid events).
    ``wait(timeout_ms)`` gives ``(gpu index or None, xid)`` for the next Xid event, or ``None`` when none
    came in time. ``close()`` frees the set.
    """

    def __init__(self, s: Session, indices: Sequence[int]) -> None:
        self._s = s
        self._xid = int(getattr(s._errors, "nvmlEventTypeXidCriticalError", 0x8))
        self._by_handle: dict[int | None, int] = {}
        self.registered: list[int] = []
        self.skipped: dict[int, str] = {}
        created = s.query("events", "nvmlEventSetCreate")
        if created.why is not None:
            raise NvmlCallFailed(f"NVML cannot create an event set: {created.why}")
        self._set = created.value
        for index in indices:
            try:
                dev = s.device(index)
                supported = dev._a("nvmlDeviceGetSupportedEventTypes")
                if supported.why is not None:
                    self.skipped[index] = supported.why
                    continue
                if not int(supported.value) & self._xid:
                    self.skipped[index] = "the driver reports no Xid events for it"
                    continue
                registered = dev._a("nvmlDeviceRegisterEvents", self._xid, self._set)
            except DeviceFailed as exc:
                self.skipped[index] = exc.reason
                continue
            if registered.why is not None:
                self.skipped[index] = registered.why
                continue
            self._by_handle[_handle_address(dev.handle)] = index
            self.registered.append(index)

    def wait(self, timeout_ms: int) -> tuple[int | None, int] | None:
        """The next Xid event as ``(gpu index, xid)`` (index ``None``: a handle not registered here), or
        ``None`` after ``timeout_ms`` without one (or an event of another type)."""
        s = self._s
        answer = s.query("events", "nvmlEventSetWait_v2", self._set, int(timeout_ms))
        if s.missing(answer):
            answer = s.query("events", "nvmlEventSetWait", self._set, int(timeout_ms))
        if answer.code == (s.code("NVML_ERROR_TIMEOUT") or 10):
            return None
        if answer.why is not None:
            raise NvmlCallFailed(f"NVML stopped waiting for events: {answer.why}")
        data = answer.value
        if not int(data.eventType) & self._xid:
            return None
        return self._by_handle.get(_handle_address(data.device)), int(data.eventData)

    def close(self) -> None:
        with suppress(DeviceFailed):
            self._s.query("events", "nvmlEventSetFree", self._set)


def _handle_address(handle: Any) -> int | None:
    """A device handle's address: the key that matches an event's ``device`` to the GPU registered."""
    import ctypes

    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
