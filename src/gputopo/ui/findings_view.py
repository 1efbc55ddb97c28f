"""The one finding shape (``findings.Finding``, docs/design.md "The finding") shown the same way everywhere:
the same columns in the same order in the terminal, Markdown and HTML. Input is the JSON form
(``Finding.to_json``), so saved reports render as fresh ones; older reports without the newer keys show
``-`` there."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from rich.table import Table
from rich.text import Text

from gputopo.findings import PROBLEM

COLUMNS = ("where", "GPU", "category", "what", "remedy", "severity", "action")
HEALTH_MARKS = {"ok": "green", "PROBLEM": "bold red", "?": "dim"}


def cells(f: dict[str, Any]) -> list[str]:
    """One finding as the row every view shows, in ``COLUMNS`` order."""
    gpu = f.get("gpu")
    return [
        str(f.get("where") or "-"),
        f"GPU{gpu}" if isinstance(gpu, int) else "-",
        str(f.get("category") or "-"),
        str(f.get("what") or ""),
        str(f.get("remedy") or ""),
        str(f.get("severity") or PROBLEM),
        str(f.get("action") or "-"),
    ]


def ordered(findings: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Problems first, then notes; each by GPU (node-wide ones first), as found otherwise."""
    return sorted(findings, key=lambda f: (f.get("severity") != PROBLEM, f.get("gpu") is not None))


def findings_table(findings: Sequence[dict[str, Any]], title: str) -> Table:
    """A rich table of findings (problems in red, notes dim)."""
    t = Table(title=title, title_justify="left", show_lines=True, header_style="bold")
    for name in COLUMNS:
        t.add_column(name, no_wrap=name in ("where", "GPU", "severity"))
    for f in ordered(findings):
        row = cells(f)
        style = "bold red" if f.get("severity", PROBLEM) == PROBLEM else "dim"
        t.add_row(*row[:5], Text(row[5], style=style), row[6])
    return t


def findings_markdown(findings: Sequence[dict[str, Any]]) -> list[str]:
    """A Markdown table of findings (lines, without a heading)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for f in ordered(findings):
        lines.append("| " + " | ".join(_md(c) for c in cells(f)) + " |")
    return lines


def findings_html(findings: Sequence[dict[str, Any]]) -> str:
    """An HTML table of findings; the severity cell of a problem has class ``fail``, of a note
    ``skipped`` (the report's stylesheet colours both)."""
    head = "".join(f"<th>{escape(c)}</th>" for c in COLUMNS)
    body = []
    for f in ordered(findings):
        row = [escape(c) for c in cells(f)]
        cls = "fail" if f.get("severity", PROBLEM) == PROBLEM else "skipped"
        row[5] = f'<td class="{cls}">{row[5]}</td>'
        tds = "".join(c if i == 5 else f"<td>{c}</td>" for i, c in enumerate(row))
        body.append(f"<tr>{tds}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def not_checked_lines(not_checked: Sequence[dict[str, Any]]) -> list[str]:
    """``what: why`` per check that could not run."""
    return [f"{n.get('what')}: {n.get('why')}" for n in not_checked]


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
