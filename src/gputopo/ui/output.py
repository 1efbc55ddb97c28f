"""The one object that owns the terminal: data to stdout, hints and warnings to stderr.

With ``--json`` the command's result goes to stdout as one JSON document and nothing else is written
there; warnings still go to stderr. Colour follows rich's rules (``NO_COLOR``, ``FORCE_COLOR``,
``TERM=dumb``); width follows ``COLUMNS`` when set.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console, RenderableType

PIPE_WIDTH = 160


class Output:
    """Human (rich) or machine (JSON) output for one command run."""

    def __init__(self, json_mode: bool = False) -> None:
        self.json_mode = json_mode
        # Piped output is read by people too (in logs, pasted in issues): don't fold it at rich's
        # default of 80 columns; COLUMNS still wins when set.
        width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else PIPE_WIDTH
        self.out = Console(file=sys.stdout, highlight=False, soft_wrap=False, width=width)
        self.err = Console(file=sys.stderr, highlight=False, soft_wrap=True)

    def show(self, *renderables: RenderableType) -> None:
        """Print human output to stdout (ignored in JSON mode, where only the document goes out)."""
        if not self.json_mode:
            self.out.print(*renderables)

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
        self.err.print(f"[yellow]warning:[/] {message}", markup=True, highlight=False)

    def hint(self, message: str) -> None:
        """A hint line on stderr."""
        self.err.print(f"[dim]hint:[/] {message}", markup=True, highlight=False)

    def error(self, message: str, hint: str | None = None) -> None:
        """The one-line error (and its hint) on stderr."""
        self.err.print(f"[bold red]error:[/] {_escape(message)}", markup=True, highlight=False)
        if hint:
            self.hint(_escape(hint))


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
