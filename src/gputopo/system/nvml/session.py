"""The session: NVML started for a ``with`` block (``session()``), the one door every call goes through
(``Session.query``), the error rule of the package docstring applied per call, and ``Device``: one GPU with
every kind of read (inventory, health counters, fabric and platform)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from gputopo.model import GPU_FAILING, GPU_NOT_ACCESSIBLE
from gputopo.system.nvml.answer import (
    NOT_IN_BINDINGS,
    Answer,
    DeviceFailed,
    NvmlUnavailable,
    _field_name,
    _gone_error_codes,
    _int_constant,
    _not_installed_codes,
    _refused_error_codes,
    _soft_error_codes,
    cuda_version_text,
)
from gputopo.system.nvml.backend import _lib, _pynvml
from gputopo.system.nvml.fabric import FabricReads
from gputopo.system.nvml.health import HealthReads
from gputopo.system.nvml.inventory import InventoryReads


class Device(InventoryReads, HealthReads, FabricReads):
    """One GPU inside a ``Session``: every kind of read. Each inventory read returns ``None`` when NVML
    does not support it, each health or fabric read an ``Answer``; all raise ``DeviceFailed`` when the GPU
    stops answering."""


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
