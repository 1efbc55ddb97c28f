"""``gputopo accept``'s text and Markdown, from its ``gputopo/accept/v1`` document (``services.accept``)."""

from __future__ import annotations

from typing import Any

_MARK = {"passed": "PASS", "failed": "FAIL", "not checked": "N/C ", "not run": "--  "}


def render_text(doc: dict[str, Any]) -> str:
    """The verdict first, then one line a step (with its action when it failed), then the gate and where
    the verdict was kept."""
    verdict = str(doc.get("verdict")).upper()
    lines = [f"{verdict}: {doc.get('reason')}", ""]
    gpus = doc.get("gpus") or []
    lines.append(
        f"node {doc.get('node')}, {len(gpus)} GPU(s), driver {doc.get('driver') or 'unknown'}, "
        f"device {doc.get('device')}, {doc.get('elapsed_s')} s of {doc.get('budget_s'):g} s"
    )
    for s in doc.get("steps") or []:
        lines.append(f"  {_MARK.get(s['status'], s['status'])}  {s['title']}: {s['summary']}")
        if s.get("action"):
            lines.append(f"        action: {s['action']}")
        for f in s.get("findings") or []:
            if f.get("severity") == "problem":
                lines.append(f"        {f['where']}: {f['what']}")
                lines.append(f"          remedy: {f['remedy']}")
    gate = doc.get("gate")
    if gate:
        for a in gate.get("actions") or []:
            verb = "would run" if a.get("dry_run") else "ran" if a.get("done") else "failed"
            lines.append(
                f"slurm: {verb}: {a.get('command')}" + (f" ({a['error']})" if a.get("error") else "")
            )
        if gate.get("note"):
            lines.append(f"slurm: {gate['note']}")
    if doc.get("state"):
        lines.append(f"verdict kept in: {doc['state']}")
    report = doc.get("report") or {}
    if report.get("json"):
        lines.append(f"report: {report['json']}")
    return "\n".join(lines) + "\n"


def render_markdown(doc: dict[str, Any]) -> str:
    """The report's Markdown: the verdict, a table of the steps, each failed step's findings."""
    out = [
        f"# gputopo accept: {doc.get('verdict')}",
        "",
        f"{doc.get('reason')}",
        "",
        f"Node {doc.get('node')}, driver {doc.get('driver') or 'unknown'}, device {doc.get('device')}, "
        f"started {doc.get('started_utc')}, {doc.get('elapsed_s')} s.",
        "",
        "| step | status | summary | action |",
        "|---|---|---|---|",
    ]
    for s in doc.get("steps") or []:
        summary = str(s.get("summary") or "").replace("|", "\\|")
        out.append(f"| {s['title']} | {s['status']} | {summary} | {s.get('action') or ''} |")
    for s in doc.get("steps") or []:
        problems = [f for f in s.get("findings") or [] if f.get("severity") == "problem"]
        if problems:
            out += ["", f"## {s['title']}", ""]
            out += [f"- **{f['where']}**: {f['what']}. Remedy: {f['remedy']}" for f in problems]
    return "\n".join(out) + "\n"


def render_html(doc: dict[str, Any]) -> str:
    """A plain HTML page of the same (no pictures: nothing here needs matplotlib)."""
    import html

    rows = "".join(
        f"<tr><td>{html.escape(s['title'])}</td><td>{html.escape(s['status'])}</td>"
        f"<td>{html.escape(str(s['summary']))}</td><td>{html.escape(s.get('action') or '')}</td></tr>"
        for s in doc.get("steps") or []
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>gputopo accept</title></head><body>"
        f"<h1>gputopo accept: {html.escape(str(doc.get('verdict')))}</h1>"
        f"<p>{html.escape(str(doc.get('reason')))}</p>"
        "<table border='1'><tr><th>step</th><th>status</th><th>summary</th><th>action</th></tr>"
        f"{rows}</table></body></html>\n"
    )
