"""What an NVML read gives back, and the errors of ours it can raise: ``Answer`` (the value, or why it is
unknown in NVML's words), ``DeviceFailed`` (a GPU that is gone), ``NvmlUnavailable`` (no NVML at all); the
return codes that mean each; ``DeviceReads``, the base of every kind of per-GPU read; the small converters
of NVML's values (bus ids, masks, versions, text)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gputopo.errors import UnavailableError
from gputopo.model import GPU_FAILING

_MIB = 1024 * 1024


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


class DeviceReads:
    """One GPU inside a ``Session``: what every kind of read (inventory, health counters, fabric and
    platform) shares. ``Device`` (system/nvml/session.py) is all of them in one class."""

    def __init__(self, session: Any, index: int, handle: Any) -> None:
        self.session = session
        self.index = index
        self.handle = handle

    def _q(self, fn_name: str, *args: Any, **kwargs: Any) -> Any:
        """The value, or ``None`` under the package's per-call rule (a warning for unexpected errors)."""
        return self.session._call(f"GPU{self.index}", fn_name, self.handle, *args, **kwargs)

    def _a(self, fn_name: str, *args: Any) -> Answer:
        """The whole ``Answer``: each health and fabric read keeps why a value is unknown."""
        return self.session.query(f"GPU{self.index}", fn_name, self.handle, *args)


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
