"""What ``hang`` and ``slow`` share: the tail every report takes (the HTML page, the JSON document or the
text, the exit code). ``--live`` (taking a running job's evidence) is the services' (``services.hang``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import typer

from gputopo.ui.output import Output


class JobReport(Protocol):
    """What ``hang`` and ``slow`` hand back (``HangReport``, ``SlowReport``); they write no report files."""

    @property
    def exit_code(self) -> int: ...

    def document(self) -> dict[str, Any]: ...


def finish(out: Output, report: JobReport, render: Callable[[bool], str], html: Path | None) -> None:
    """A report's tail: the HTML page to ``html`` (``render(True)``), the JSON document, or the text
    (``render(False)``); exits with the report's ``exit_code``."""
    if html is not None:
        from gputopo.outputs import write_output

        write_output(html, render(True), "--html")
        out.hint(f"HTML report: {html}")
    out.document(report.document())
    if not out.json_mode:
        out.line(render(False).rstrip("\n"))
    if report.exit_code:
        raise typer.Exit(report.exit_code)
