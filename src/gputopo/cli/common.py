"""What every command shares: the error boundary and the common options."""

from __future__ import annotations

import functools
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from gputopo.errors import GputopoError, InputError
from gputopo.ui.output import Output

if TYPE_CHECKING:
    from pathlib import Path

    from gputopo.model import Topology

F = TypeVar("F", bound=Callable[..., Any])

JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document on stdout and nothing else.")
INPUT_HELP = (
    "Read a machine instead of this one: a saved `nvidia-smi topo -m` text file, a JSON snapshot from "
    "`gputopo topo --json`, NCCL's topology dump (NCCL_TOPO_DUMP_FILE XML), - for any of them on stdin, "
    "or sample:NAME (see `gputopo topo --list-samples`)."
)
INPUT_METAVAR = "PATH|-|sample:NAME"


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


def read_topology(out: Output, spec: str | None, nvml_timeout_s: float | None = None) -> Topology:
    """The topology ``--input`` names (or this machine's, each NVML read within ``nvml_timeout_s``), its
    warnings said on stderr."""
    from gputopo.machine import load_topology

    topo = load_topology(spec, nvml_timeout_s=nvml_timeout_s)
    out.warnings(topo.warnings)
    return topo


def debug_enabled() -> bool:
    """``GPUTOPO_DEBUG=1`` shows tracebacks."""
    return os.environ.get("GPUTOPO_DEBUG", "") not in ("", "0")


def guarded(func: F) -> F:
    """Turn ``GputopoError`` into one line on stderr, a hint, and the error's exit code.

    Unexpected exceptions are bugs: one line saying so, and the traceback only with ``GPUTOPO_DEBUG=1``.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except GputopoError as exc:
            if debug_enabled():
                traceback.print_exc()
            Output().error(exc.message, exc.hint)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            Output().error("interrupted")
            raise typer.Exit(130) from None
        except Exception as exc:  # a bug: say so in one line; the traceback is for GPUTOPO_DEBUG=1
            if debug_enabled():
                raise
            Output().error(
                f"internal error: {type(exc).__name__}: {exc}",
                "rerun with GPUTOPO_DEBUG=1 for the traceback, and report it",
            )
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def read_json_file(path: Path, label: str, hint: str) -> object:
    """The JSON document at ``path``; every way it can be unreadable is an ``InputError`` in plain words
    that starts with ``label`` (the option and path as the user wrote them)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{label}: no such file", hint) from None
    except IsADirectoryError:
        raise InputError(f"{label}: is a folder, not a report", hint) from None
    except OSError as exc:
        raise InputError(f"{label}: cannot read ({exc.strerror or exc})", "check the path") from None
    import json  # only reports need it; kept out of start-up

    try:
        return json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise InputError(f"{label}: binary data, not a JSON report", hint) from None
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{label}: not JSON (line {exc.lineno}: {exc.msg})",
            "give the .json report, not the Markdown or HTML one",
        ) from None
