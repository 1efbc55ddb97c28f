"""The one object that owns the terminal: data to stdout, hints and warnings to stderr.

With ``--json`` the command's result goes to stdout as one JSON document and nothing else is written
there; warnings still go to stderr. Colour follows rich's rules (``NO_COLOR``, ``FORCE_COLOR``,
``TERM=dumb``); width follows ``COLUMNS`` when set to a usable width (at least ``MIN_COLUMNS``).

Output that does not go to a terminal is never wrapped (nvidia-smi never wraps either): each block is
laid out at its own natural width, so a saved ``gputopo topo`` matrix reads back with ``--input`` and a
``# ...`` comment line keeps its ``#``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console, Group, RenderableType

# A bound on the natural width of piped output; only a pathological line would reach it.
PIPE_MAX_WIDTH = 100_000
# COLUMNS below this is a mistake (COLUMNS=0 printed nothing at all): it is treated as unset.
MIN_COLUMNS = 40


def usable_columns() -> int | None:
    """``COLUMNS`` when it holds a usable width (a number of at least ``MIN_COLUMNS``), else ``None``."""
    value = os.environ.get("COLUMNS", "").strip()
    return int(value) if value.isdigit() and int(value) >= MIN_COLUMNS else None


def _terminal_width(stream: Any) -> int | None:
    """The width of the terminal ``stream`` is, when it is one (``None`` lets rich decide)."""
    try:
        return max(MIN_COLUMNS, os.get_terminal_size(stream.fileno()).columns)
    except (OSError, ValueError, AttributeError):
        return None


def stdout_is_terminal() -> bool:
    """Whether stdout is a terminal; ``isatty`` is missing on some replaced streams."""
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


class Output:
    """Human (rich) or machine (JSON) output for one command run."""

    def __init__(self, json_mode: bool = False) -> None:
        self.json_mode = json_mode
        # Not a terminal and no usable COLUMNS: lay out at the natural width (see ``show``), never fold.
        columns = usable_columns()
        self.unwrapped = not stdout_is_terminal() and columns is None
        # rich reads COLUMNS itself; an unusable one must not reach it, so the width is always given.
        width = PIPE_MAX_WIDTH if self.unwrapped else columns or _terminal_width(sys.stdout)
        err_width = columns or _terminal_width(sys.stderr) or 80
        self.out = Console(file=sys.stdout, highlight=False, emoji=False, soft_wrap=False, width=width)
        self.err = Console(file=sys.stderr, highlight=False, emoji=False, soft_wrap=True, width=err_width)
        # rich exits 1 on a closed pipe; the CLI's error boundary decides instead (a reader that stopped
        # reading, `| head -1`, is no failure: exit 0, quietly).
        self.out.on_broken_pipe = _raise_broken_pipe  # type: ignore[method-assign]

    def show(self, *renderables: RenderableType) -> None:
        """Print human output to stdout (ignored in JSON mode, where only the document goes out)."""
        if self.json_mode:
            return
        if not self.unwrapped:
            self.out.print(*renderables)
            return
        for block in _blocks(renderables):
            self.out.print(block, width=self.natural_width(block))

    def natural_width(self, renderable: RenderableType) -> int:
        """The width ``renderable`` takes when nothing folds it: its longest line, table or panel."""
        from rich.measure import Measurement

        measured = Measurement.get(self.out, self.out.options, renderable)
        return max(1, min(measured.maximum, PIPE_MAX_WIDTH))

    def line(self, text: str) -> None:
        """One line of plain text on stdout, never wrapped or cropped (a line meant to be pasted)."""
        if not self.json_mode:
            self.out.print(text, soft_wrap=True, markup=False, highlight=False)

    def document(self, data: dict[str, Any]) -> None:
        """Print the JSON document (JSON mode only)."""
        if self.json_mode:
            import json  # only JSON mode needs it; kept out of the human path's start-up

            sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
            sys.stdout.flush()

    def warn(self, message: str) -> None:
        """A warning line on stderr."""
        self.err.print(f"[yellow]warning:[/] {_escape(message)}", markup=True, highlight=False)

    def warnings(self, messages: Any) -> None:
        """Each warning about the input on stderr, once, in order."""
        for message in dict.fromkeys(messages):
            self.warn(message)

    def hint(self, message: str) -> None:
        """A hint line on stderr."""
        self.err.print(f"[dim]hint:[/] {message}", markup=True, highlight=False)

    def error(self, message: str, hint: str | None = None) -> None:
        """The one-line error (and its hint) on stderr."""
        self.err.print(f"[bold red]error:[/] {_escape(message)}", markup=True, highlight=False)
        if hint:
            self.hint(_escape(hint))


def _raise_broken_pipe() -> None:
    raise BrokenPipeError(32, "the reader of stdout has gone")


def _blocks(renderables: Any) -> list[RenderableType]:
    """Top-level renderables with groups opened, so each block gets its own natural width."""
    out: list[RenderableType] = []
    for r in renderables:
        if isinstance(r, Group):
            out.extend(_blocks(r.renderables))
        else:
            out.append(r)
    return out


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
