"""Listening for Xid events while something runs (the probe's ranks): NVML's event set in a child process.

``XidWatch`` (the parent's end) starts ``python -m gputopo.system.xid_events GPU...``, which registers the
GPUs for Xid critical error events (``system.nvml.XidEventSet``) and prints one JSON line per event; a
thread here collects them. The child, not a thread of the caller, waits on NVML: a call stuck in the
driver must never keep the caller from finishing (see ``nvml_worker``). Closing the child's stdin is its
stop flag; a child that does not stop in time is killed and not waited for.

Everything here is best effort: no driver, no event support or a child that dies means no events, with
``why_not`` saying so, never a failure of what is being watched.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from types import TracebackType

from gputopo.system import nvml

WAIT_MS = 250  # one NVML wait; the child looks at its stop flag between waits
STOP_S = 2.0


@dataclass(frozen=True)
class XidEvent:
    """One Xid NVML reported while watching: the GPU (NVML index; ``None`` when the event named a GPU not
    registered), the Xid, and when it arrived (seconds since the epoch)."""

    gpu: int | None
    xid: int
    time_s: float


class XidWatch:
    """Collects Xid events on ``gpus`` from ``__enter__`` to ``__exit__``; ``events()`` is what came so
    far. ``why_not`` says why nothing can come (no driver, no Xid events on these GPUs, ...)."""

    def __init__(self, gpus: tuple[int, ...] | list[int]) -> None:
        self.gpus = tuple(gpus)
        self.why_not: str | None = None
        self.registered: tuple[int, ...] = ()
        self._events: list[XidEvent] = []
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> XidWatch:
        debug = os.environ.get("GPUTOPO_DEBUG", "") not in ("", "0")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gputopo.system.xid_events", *map(str, self.gpus)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None if debug else subprocess.DEVNULL,
            )
        except OSError as exc:
            self.why_not = f"cannot start the Xid listener ({exc.strerror or exc})"
            return self
        self._reader = threading.Thread(target=self._read, name="gputopo-xid", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in self._proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            with self._lock:
                if "xid" in msg:
                    self._events.append(XidEvent(msg.get("gpu"), int(msg["xid"]), float(msg["time_s"])))
                elif "registered" in msg:
                    self.registered = tuple(msg["registered"])
                    if not self.registered:
                        self.why_not = "no GPU here reports Xid events"
                elif "why_not" in msg:
                    self.why_not = str(msg["why_not"])

    def events(self) -> tuple[XidEvent, ...]:
        with self._lock:
            return tuple(self._events)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # the child's stop flag
            proc.wait(timeout=STOP_S)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()  # stuck in the driver, perhaps: not waited for beyond a moment
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
        if self._reader is not None:
            self._reader.join(timeout=0.5)


def _emit(msg: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _stopped() -> bool:
    """True once the parent closed our stdin (or went away)."""
    ready, _, _ = select.select([sys.stdin], [], [], 0)
    return bool(ready) and not os.read(sys.stdin.fileno(), 1 << 12)


def _listen(gpus: list[int]) -> None:
    """The child: register ``gpus`` (every GPU when none is named) and report Xid events until stopped."""
    try:
        with nvml.session() as s:
            events = nvml.XidEventSet(s, gpus or range(s.device_count()))
            try:
                _emit(
                    {
                        "registered": events.registered,
                        "skipped": {str(k): v for k, v in events.skipped.items()},
                    }
                )
                while events.registered and not _stopped():
                    got = events.wait(WAIT_MS)
                    if got is not None:
                        _emit({"gpu": got[0], "xid": got[1], "time_s": time.time()})
            finally:
                events.close()
    except nvml.NvmlUnavailable as exc:
        _emit({"why_not": exc.message})
    except Exception as exc:  # best effort: say why listening stopped, never a traceback
        _emit({"why_not": f"the Xid listener stopped: {type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    _listen([int(a) for a in sys.argv[1:]])
    sys.stdout.flush()
    os._exit(0)  # NVML is shut down: skip the interpreter's teardown
