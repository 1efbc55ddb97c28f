"""NVML reads with a deadline: a worker process asks NVML, the caller waits only as long as it chooses.

An NVML call cannot be interrupted: a GPU that fell into a bad state (Xid 79, a wedged driver) can block
``nvmlInit`` or any query about it for ever, in uninterruptible sleep inside the driver, and a thread
blocked there keeps the whole process from exiting cleanly. So the calls run in a child process
(``python -m gputopo.system.nvml_serve``) and the parent waits for each answer with a deadline. When one
does not come, the parent kills the child (it may stay stuck in the driver; it is not waited for), and
the next request starts a fresh child, which never touches the GPU that hung: NVML opens a GPU only when
its handle is asked for (NVML docs of nvmlDeviceGetHandleByIndex_v2: "this API causes NVML to initialize
the target GPU"), so a new ``nvmlInit`` does not go near it.

Requests and answers are pickled frames (4-byte length, then the pickle) on the child's stdin and
stdout, in this module's frames at both ends (the child's loop is ``nvml_serve``), run by the same
Python. The child holds one NVML session for its whole life, answers requests in order, and shuts NVML
down when its stdin closes.
"""

from __future__ import annotations

import functools
import os
import pickle
import select
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any, BinaryIO, TypeVar

from gputopo.model import DEFAULT_NVML_TIMEOUT_S

DEFAULT_TIMEOUT_S = DEFAULT_NVML_TIMEOUT_S
# A whole listing over every GPU (the processes on them, their minor numbers) in one call.
LIST_TIMEOUT_S = 15.0
_IN_WORKER = False
# Starting Python and importing pynvml touches no driver, so it gets its own, generous allowance: on a
# loaded machine it can take longer than an NVML deadline, and must not read as a hung GPU.
STARTUP_S = 60.0

T = TypeVar("T")
HEADER = struct.Struct(">I")
_REAP_S = 0.5


class NoAnswer(Exception):
    """The worker did not answer within the deadline, or could not be started; ``what`` says which."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def read_exact(stream: BinaryIO, n: int) -> bytes | None:
    chunks = b""
    while len(chunks) < n:
        chunk = stream.read(n - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return chunks


class Worker:
    """The parent's end: ``call(request)`` returns the child's answer or raises ``NoAnswer``.

    After a ``NoAnswer`` the child is gone; the next ``call`` starts a new one (and answers ``NoAnswer``
    at once if that fails too, so a dead driver costs one deadline, not one per request).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._broken: str | None = None
        self.header: Any = None
        """The child's first answer (what ``_serve`` reports on start), from the latest start."""

    def _start(self) -> None:
        # Same interpreter, environment and working directory: the child imports this same gputopo.
        debug = os.environ.get("GPUTOPO_DEBUG", "") not in ("", "0")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gputopo.system.nvml_serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None if debug else subprocess.DEVNULL,
            )
        except OSError as exc:
            self._broken = f"cannot start the NVML worker ({exc.strerror or exc})"
            raise NoAnswer(self._broken) from None
        self._buffer = b""
        try:
            self._receive("the NVML worker's start", STARTUP_S)
            from gputopo.system import nvml

            self.header = self._receive(nvml.START_CALL)
        except NoAnswer as exc:
            self._broken = exc.what
            raise

    def call(self, request: Any, what: str) -> Any:
        """Send ``request``; its answer, or ``NoAnswer`` when none comes within ``timeout_s``."""
        if self._broken is not None:
            raise NoAnswer(self._broken)
        if self._proc is None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None
        try:
            write_frame(self._proc.stdin, request)  # type: ignore[arg-type]
        except (BrokenPipeError, OSError):
            self._kill()
            raise NoAnswer(f"the NVML worker exited before {what}") from None
        return self._receive(what)

    def _receive(self, what: str, timeout_s: float | None = None) -> Any:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if len(self._buffer) >= HEADER.size:
                (size,) = HEADER.unpack_from(self._buffer)
                if len(self._buffer) >= HEADER.size + size:
                    frame = self._buffer[HEADER.size : HEADER.size + size]
                    self._buffer = self._buffer[HEADER.size + size :]
                    return pickle.loads(frame)
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise NoAnswer(f"NVML did not answer {what} within {timeout_s:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._kill()
                raise NoAnswer(f"the NVML worker exited during {what}")
            self._buffer += chunk

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with suppress(OSError):
            proc.kill()
        # A process stuck inside the driver may not die until the driver lets go: don't wait for it.
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_REAP_S)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with suppress(OSError):
                    pipe.close()

    def close(self) -> None:
        """End the child: close its stdin (it shuts NVML down and exits), then make sure it is gone."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self._proc = proc
            self._kill()
        if proc.stdout is not None:
            with suppress(OSError):
                proc.stdout.close()


def with_deadline(
    on_no_answer: Any, timeout_s: float = LIST_TIMEOUT_S
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Run the decorated function (one that reads NVML) in a worker process; ``on_no_answer`` when it
    does not return within ``timeout_s``. Arguments and result must pickle. With a test backend in place
    (``nvml.use_backend``), and inside the worker itself, the function runs here, as it is."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> T:
            from gputopo.system import nvml

            if _IN_WORKER or nvml.backend_overridden() or not nvml.library_present():
                return fn(*args, **kwargs)
            worker = Worker(LIST_TIMEOUT_S)
            try:
                answer = worker.call(("call", fn.__module__, fn.__qualname__, args, kwargs), fn.__name__)
            except NoAnswer:
                if worker.header is not None and worker.header[0] == "unavailable":
                    return fn(*args, **kwargs)  # NVML cannot start: the function says what that means
                return on_no_answer  # type: ignore[no-any-return]
            finally:
                worker.close()
            if answer[0] == "raise":
                raise answer[1]
            return answer[1]  # type: ignore[no-any-return]

        return inner

    return wrap
