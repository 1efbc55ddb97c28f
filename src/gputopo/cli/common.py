"""What every command shares: the error boundary and the common options."""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from gputopo.errors import GputopoError, InputError, Interrupted, defer_stop
from gputopo.inputs import read_json_file  # noqa: F401  (doctor's --compare reads a report with it)
from gputopo.model import DEFAULT_NVML_TIMEOUT_S
from gputopo.ui.output import Output

if TYPE_CHECKING:
    pass

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document on stdout and nothing else.")
INPUT_HELP = (
    "Read a machine instead of this one: a saved `nvidia-smi topo -m` text file, a JSON snapshot from "
    "`gputopo topo --json`, NCCL's topology dump (NCCL_TOPO_DUMP_FILE XML), - for any of them on stdin, "
    "or sample:NAME (see `gputopo topo --list-samples`)."
)
INPUT_METAVAR = "PATH|-|sample:NAME"
INPUT_OPTION = typer.Option(None, "--input", "-i", metavar=INPUT_METAVAR, help=INPUT_HELP)

# Shared by the commands that read the live machine (topo, recommend, probe, doctor): declared once.
# hang and slow: the run records that place ranks on hosts, PIDs and GPUs.
RUN_RECORD_OPTION = typer.Option(
    None,
    "--run-record",
    metavar="FILE",
    help="A run record (gputopo/run-record/v1) mapping ranks to hosts and GPUs; repeatable. "
    "Default: run-record*.json beside the dumps.",
)
NVML_TIMEOUT_OPTION = typer.Option(
    DEFAULT_NVML_TIMEOUT_S,
    "--nvml-timeout",
    metavar="SECONDS",
    help="Seconds each live NVML read (start-up, one GPU, one GPU pair) may take; a GPU that does not "
    "answer in time is shown as not responding.",
)


def examples(*lines: str) -> str:
    """An "Examples:" block for a command's help; ``\\b`` keeps the help formatter from refolding it."""
    return "\n\n\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


def report_usage_error(exc: Exception) -> int:
    """One line and a hint for an option error typer found; returns its exit code (2)."""
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    code = getattr(exc, "exit_code", 2)
    ctx = getattr(exc, "ctx", None)
    if "\n" in message:  # `gputopo` alone: the message is the help text itself
        sys.stderr.write(message.rstrip("\n") + "\n")
        return code
    where = ctx.command_path if ctx is not None else "gputopo"
    # typer names the value's Python type; a person wants the kind of value.
    message = re.sub(r"is not a valid (?:int|integer)\b", "is not a whole number", message)
    message = re.sub(r"is not a valid float\b", "is not a number", message)
    Output().error(f"{where}: {message.rstrip('.')}", f"`{where} --help` lists the options, with examples")
    return code


def options_from(cls: type[T], params: Mapping[str, Any], **turned: Any) -> T:
    """A service's ``Options`` from a command's parameters (``locals()`` in its body): each field from
    the parameter of its name, ``turned`` where the value is changed first (an enum's value); parameters
    that are no field (``json_out``...) stay the command's. Built, so checked, once."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in params.items() if k in names and k not in turned}, **turned)


def debug_enabled() -> bool:
    """``GPUTOPO_DEBUG=1`` shows tracebacks."""
    return os.environ.get("GPUTOPO_DEBUG", "") not in ("", "0")


# What schedulers and people send to stop a command: `timeout`, scancel, docker stop, Kubernetes and systemd
# send SIGTERM; a dropped ssh session SIGHUP; Ctrl-C SIGINT; Ctrl-\\ SIGQUIT.
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
_stopping: list[int] = []


def _on_stop_signal(signum: int, frame: object) -> None:
    """Raise ``Interrupted`` where the program is, so every ``finally`` on the way out stops what it
    started (rank pools, a supervised command) and removes its temp files. A second signal while that
    cleanup runs (a few seconds at most) is ignored, so it cannot cut the cleanup short."""
    if _stopping:
        return
    _stopping.append(signum)
    exc = Interrupted(signum, signal.Signals(signum).name)
    if defer_stop(exc):  # a child is being started: raised once the caller holds it (errors.stop_held)
        return
    raise exc


def install_stop_signals() -> dict[int, Any]:
    """Route every stop signal through ``_on_stop_signal``; return the handlers it replaced.

    A signal that is ignored stays ignored (``nohup`` ignores SIGHUP, a shell's background job SIGINT);
    only the main thread may set handlers (in-process tests from another thread keep the defaults).
    """
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    _stopping.clear()
    for name in STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is None or signal.getsignal(sig) == signal.SIG_IGN:
            continue
        previous[sig] = signal.signal(sig, _on_stop_signal)
    return previous


def restore_signals(previous: dict[int, Any]) -> None:
    """Put back the handlers ``install_stop_signals`` replaced (tests run many commands in one process)."""
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def stopped_line(exc: KeyboardInterrupt) -> tuple[str, int]:
    """The one line for a command a signal stopped, and its exit code (128 + the signal's number)."""
    if not isinstance(exc, Interrupted):
        exc = Interrupted(signal.SIGINT, "SIGINT")
    note = getattr(exc, "note", None) or "nothing it started is left running"
    return f"stopped by {exc.name}: interrupted; {note}", exc.exit_code


def guarded(func: F) -> F:
    """Turn ``GputopoError`` into one line on stderr, a hint, and the error's exit code.

    A stop signal (``STOP_SIGNALS``) becomes ``Interrupted`` where the program is; once everything it
    started is stopped, one line says which signal, and the exit code is 128 + its number.
    Unexpected exceptions are bugs: one line saying so, and the traceback only with ``GPUTOPO_DEBUG=1``.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        previous = install_stop_signals()
        try:
            return _run_guarded(func, args, kwargs)
        finally:
            restore_signals(previous)

    return wrapper  # type: ignore[return-value]


def check_finite(kwargs: dict[str, Any]) -> None:
    """Refuse a number option given as ``inf`` or ``nan`` (a timeout of ``inf`` never fires, ``nan``
    compares false with everything): ``UsageError`` naming the option as it was typed."""
    import math

    bad = [k for k, v in kwargs.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return
    name = "--" + bad[0].replace("_", "-")  # typer names each parameter after its option
    raise InputError(f"{name} {kwargs[bad[0]]}: must be a finite number", f"e.g. {name} 60")


def _stdout_closed() -> bool:
    """True when the reader of stdout has gone (``gputopo topo | head -1``): the pipe reports an error."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return True  # no way to ask: a broken pipe here is most likely stdout's


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so what is still buffered cannot fail again when Python exits."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _flush_stdout() -> None:
    """Write out stdout now, so a closed pipe or a full disk is met here and not at exit."""
    stdout = sys.stdout
    if stdout is not None:
        stdout.flush()


BUG_HINT = "rerun with GPUTOPO_DEBUG=1 for the traceback, and report it"
# Writing failed because the disk (or the quota) is full: the destination the user chose cannot take it,
# like an unwritable --report-dir, so it is bad usage (exit 2), not a missing tool (3).
_NO_SPACE = {28, 122}  # ENOSPC, EDQUOT


def _run_guarded(func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    try:
        return _run_and_flush(func, args, kwargs)
    except BrokenPipeError as exc:
        if not _stdout_closed():  # another pipe broke (a helper process died): a bug, said as one
            if debug_enabled():
                raise
            Output().error(
                f"internal error: {exc}", "rerun with GPUTOPO_DEBUG=1 for the traceback, and report it"
            )
            raise typer.Exit(1) from None
        # The reader chose to stop reading (`| head -1`): nothing is wrong, and nothing more to say.
        _silence_stdout()
        raise typer.Exit(0) from None
    except OSError as exc:
        if exc.errno not in _NO_SPACE:
            raise
        where = exc.filename or "the output"
        _silence_stdout()
        Output().error(
            f"no space left on device: cannot write {where}", "free some space, or write elsewhere"
        )
        raise typer.Exit(2) from None


def _run_and_flush(func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    try:
        result = _run_command(func, args, kwargs)
    except typer.Exit:
        _flush_stdout()
        raise
    _flush_stdout()
    return result


def _run_command(func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    try:
        try:
            check_finite(kwargs)
            return func(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except GputopoError as exc:
            if debug_enabled():
                traceback.print_exc()
            Output().error(exc.message, exc.hint)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt as exc:
            line, code = stopped_line(exc)
            Output().error(line)
            raise typer.Exit(code) from None
        except Exception as exc:  # a bug: say so in one line; the traceback is for GPUTOPO_DEBUG=1
            if isinstance(exc, BrokenPipeError) or getattr(exc, "errno", None) in _NO_SPACE:
                raise  # not a bug: _run_guarded says what it is
            if debug_enabled():
                raise
            Output().error(f"internal error: {type(exc).__name__}: {exc}", BUG_HINT)
            raise typer.Exit(1) from None
    except KeyboardInterrupt as exc:  # a signal while an error above was being reported
        line, code = stopped_line(exc)
        Output().error(line)
        raise typer.Exit(code) from None
