"""The one tail every command shares: the report files, written once, then the document or
the text, then the command's exit code.

A service hands back a ``Report``: ``document()`` is the command's whole JSON (built there, nowhere
else), ``exit_code`` its exit status, and ``with_files(paths)`` the same report naming the files
written for it. The views (``ui/``) turn a document into text, Markdown and HTML; a command without
report files passes no Markdown view. HTML that needs matplotlib, where it is not installed, is left
out with one warning and the rest is still written.

``hang`` and ``slow`` write no report files: their tail (``finish_page``) writes the one HTML page
``--html`` names, then shows the document or the text.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import typer

from gputopo.ui.output import Output

NO_MATPLOTLIB = "no HTML report: matplotlib is not installed (pip install 'gputopo[probe]')"

Document = dict[str, Any]


class Shown(Protocol):
    """What every service's ``run`` returns: the command's whole document and its exit code."""

    @property
    def exit_code(self) -> int: ...

    def document(self) -> Document: ...


class Report(Shown, Protocol):
    """A report that names the files written for it."""

    def with_files(self, paths: Mapping[str, str]) -> Report: ...


@dataclass(frozen=True)
class Views:
    """How one command's document is shown: ``text`` for the terminal (``None``: the ``Output`` renders
    nothing but the JSON), ``markdown`` and ``html`` for its report files (``html`` may raise
    ``ModuleNotFoundError`` for matplotlib)."""

    text: Callable[[Document], str] | None = None
    markdown: Callable[[Document], str] | None = None
    html: Callable[[Document], str] | None = None


def html_or_none(out: Output, views: Views, doc: Document) -> str | None:
    """The HTML page, or ``None`` with the one warning when matplotlib is missing."""
    if views.html is None:
        return None
    try:
        return views.html(doc)
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        out.warn(NO_MATPLOTLIB)
        return None


def write_files(out: Output, kind: str, doc: Document, views: Views, report_dir: Path) -> dict[str, str]:
    """Write ``doc`` as JSON, Markdown and (when it can be drawn) HTML under ``report_dir``; the paths."""
    from gputopo.report import write_report

    if views.markdown is None:
        raise ValueError(f"{kind}: no Markdown view to write report files with")
    html = html_or_none(out, views, doc)
    return write_report(kind, doc, views.markdown(doc), report_dir, html=html)


def attach_files(out: Output, kind: str, report: Report, views: Views, report_dir: Path | None) -> Report:
    """``report`` naming its files, once they are written (``report_dir`` ``None``: none are)."""
    if report_dir is None:
        return report
    return report.with_files(write_files(out, kind, report.document(), views, report_dir))


def show(out: Output, doc: Document, views: Views, json_out: bool) -> None:
    """The document on stdout (``--json``), or its text."""
    if json_out or views.text is None:
        out.document(doc)
        return
    sys.stdout.write(views.text(doc))
    sys.stdout.flush()


def finish(
    out: Output,
    report: Report,
    views: Views,
    *,
    kind: str,
    json_out: bool,
    report_dir: Path | None = None,
) -> NoReturn:
    """Write the report files (when ``report_dir`` is given), show the document, exit with its code."""
    report = attach_files(out, kind, report, views, report_dir)
    show(out, report.document(), views, json_out)
    raise typer.Exit(report.exit_code)


def finish_page(out: Output, report: Shown, render: Callable[[bool], str], html: Path | None) -> None:
    """``hang``'s and ``slow``'s tail: the HTML page to ``html`` (``render(True)``), the JSON document, or
    the text (``render(False)``); exits with the report's ``exit_code`` (returns when it is 0)."""
    if html is not None:
        from gputopo.outputs import write_output

        write_output(html, render(True), "--html")
        out.hint(f"HTML report: {html}")
    out.document(report.document())
    if not out.json_mode:
        out.line(render(False).rstrip("\n"))
    if report.exit_code:
        raise typer.Exit(report.exit_code)
