"""The error tree: every failure a user can cause or meet carries a message, a hint and an exit code.

The CLI maps these to one line on stderr (plus the hint) and the exit code, in one place
(``gputopo.cli``). Anything that is not a ``GputopoError`` is a bug and shows a traceback only
with ``GPUTOPO_DEBUG=1``.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3


class GputopoError(Exception):
    """Base class: ``message`` says what went wrong, ``hint`` what to do about it."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(GputopoError):
    """Bad options or arguments (exit 2)."""

    exit_code = EXIT_USAGE


class InputError(GputopoError):
    """An ``--input`` that cannot be read or understood (exit 2)."""

    exit_code = EXIT_USAGE


class ParseError(InputError):
    """Saved ``nvidia-smi topo -m`` text that cannot be parsed; names the line where possible."""

    def __init__(self, message: str, line_no: int | None = None, hint: str | None = None) -> None:
        where = f"line {line_no}: " if line_no is not None else ""
        super().__init__(
            where + message,
            hint or "check that the file is the output of `nvidia-smi topo -m`, pasted whole",
        )
        self.line_no = line_no


class UnavailableError(GputopoError):
    """The machine lacks what the command needs: no NVIDIA driver/NVML, no lsof, no torch (exit 3)."""

    exit_code = EXIT_UNAVAILABLE


class CheckFailed(GputopoError):
    """A check ran and found a problem (exit 1)."""

    exit_code = EXIT_PROBLEM


class Interrupted(KeyboardInterrupt):
    """A signal asked gputopo to stop (SIGINT, SIGTERM, SIGHUP, SIGQUIT): raised where the program was, so
    every ``finally`` on the way out stops what it started and removes its temp files; the CLI then says
    one line and exits ``128 + signum``. A ``KeyboardInterrupt`` so that code written for Ctrl-C handles
    every signal the same way. ``partial`` may carry what was complete (a run's judged part) for the
    report."""

    def __init__(self, signum: int, name: str) -> None:
        super().__init__(name)
        self.signum = signum
        self.name = name
        self.partial: object | None = None
        self.note: str | None = None  # what the CLI adds to its one line (the interrupted report)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# A stop signal that arrives while a child is being started is held back until the start is complete
# and recorded, then raised: raised in the middle (inside ``subprocess.Popen``, after the child exists
# but before the caller holds it), nothing would stop the child. The CLI's signal handler asks
# ``defer_stop`` first; a block that starts children runs inside ``stop_held``.
_holding: list[int] = []  # one entry per open stop_held block (they may nest)
_held: list[Interrupted] = []


class _StopHeld:
    # Python runs signal handlers in the main thread only: a block in another thread holds nothing (a
    # stop held there would be raised in that thread, where nobody stops the program).
    def __enter__(self) -> None:
        import threading

        self.holds = threading.current_thread() is threading.main_thread()
        if self.holds:
            _holding.append(1)

    def __exit__(self, kind: object, value: object, tb: object) -> None:
        if not self.holds:
            return
        _holding.pop()
        if not _holding and _held:
            held = _held.pop()
            _held.clear()
            if value is None:  # an exception already on its way out goes on; the held stop is dropped
                raise held


def stop_held() -> _StopHeld:
    """``with stop_held(): child = Popen(...); self.child = child``: a stop signal in between is raised
    when the block ends, when the caller's ``try``/``finally`` can stop the child."""
    return _StopHeld()


def defer_stop(exc: Interrupted) -> bool:
    """The signal handler's question: hold ``exc`` (True: inside ``stop_held``) or raise it now (False)."""
    if not _holding:
        return False
    if not _held:
        _held.append(exc)
    return True
