"""What every command shares: the error boundary and the common options."""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from gputopo.errors import GputopoError
from gputopo.ui.output import Output

F = TypeVar("F", bound=Callable[..., Any])

JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document on stdout and nothing else.")
INPUT_HELP = (
    "Read a machine instead of this one: a saved `nvidia-smi topo -m` text file, a JSON snapshot from "
    "`gputopo topo --json`, or sample:NAME (see `gputopo topo --list-samples`)."
)


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
