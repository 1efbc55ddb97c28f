"""Xid events: the probe listens while its ranks run."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from typing import Any

from gputopo.system.nvml.answer import DeviceFailed, NvmlCallFailed
from gputopo.system.nvml.session import Session

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
