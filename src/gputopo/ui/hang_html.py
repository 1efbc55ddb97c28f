"""The HTML form of a hang report (pure): the verdict, then for each stuck group its ranks drawn as
boxes per host, coloured by what each rank did at the stuck collective, then the suspects and findings.
One self-contained file (inline CSS, no script), readable offline."""

from __future__ import annotations

from html import escape
from typing import Any

from gputopo.hang.triage import HangReport

# rank status at the stuck collective -> (CSS class, legend text)
STATUS = {
    "completed": ("done", "completed"),
    "inside": ("inside", "entered, waiting inside"),
    "never_entered": ("never", "never entered"),
    "mismatch": ("mism", "called it differently"),
    "no_dump": ("nodump", "no dump"),
    "other": ("other", "went past it / not recorded"),
}

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.6em}
.verdict{font-weight:600;padding:.4em .6em;border-radius:4px;display:inline-block}
.v-hang,.v-mismatch{background:#fde2e1}.v-no_hang{background:#e3f6e3}.v-incomplete{background:#fff4d6}
.host{border:1px solid #ccc;border-radius:4px;padding:.4em;margin:.3em;display:inline-block;
vertical-align:top}
.host b{display:block;font-size:.85em;margin-bottom:.3em}
.rank{display:inline-block;min-width:2.6em;padding:.3em;margin:.15em;text-align:center;border-radius:3px;
font-size:.85em;border:1px solid #888}
.done{background:#bfe8bf}.inside{background:#cfe0f5}.never{background:#f5a3a3;font-weight:700}
.mism{background:#f7c98b;font-weight:700}.nodump{background:#fff;border:2px dashed #c00;font-weight:700}
.other{background:#eee}
table{border-collapse:collapse;font-size:.9em;margin:.5em 0}td,th{border:1px solid #ccc;padding:.3em .5em;
text-align:left;vertical-align:top}pre{font-size:.8em;background:#f6f6f6;padding:.5em;overflow-x:auto}
"""


def render_html(report: HangReport) -> str:
    """The whole page."""
    doc = report.document()
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>gputopo hang</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>gputopo hang</h1>",
        f"<p><span class='verdict v-{escape(doc['verdict'])}'>{escape(doc['verdict'])}</span> "
        f"{escape(doc['reason'])}</p>",
    ]
    if doc["groups"]:
        parts.append(_legend())
    for g in doc["groups"]:
        parts.append(_group(g, report))
    if doc["stacks"]:
        parts.append(f"<h2>Stacks</h2><p>{escape(str(doc['stacks_verdict'] or ''))}</p>")
        parts.append("<table><tr><th>rank</th><th>host</th><th>pid</th><th>where</th></tr>")
        for st in doc["stacks"]:
            if st["error"]:
                where = f"no stack: {st['error']}"
            elif st["in"] == "collective":
                where = f"in {st['what']}" + (f", called from {st['frame']}" if st["frame"] else "")
            else:
                where = f"in {st['frame']}, not in a collective"
            cells = (st["rank"], st["host"] or "?", st["pid"] or "?", where)
            parts.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
    if doc["missing_dumps"]:
        parts.append("<h2>Missing dumps</h2><p>")
        parts.append(", ".join(f"rank {r}: no dump" for r in doc["missing_dumps"]) + "</p>")
    if doc["findings"]:
        parts.append(
            "<h2>Findings</h2><table><tr><th>severity</th><th>where</th><th>what</th><th>remedy</th>"
        )
        parts.append("<th>action</th></tr>")
        for f in doc["findings"]:
            parts.append(
                "<tr>"
                + "".join(
                    f"<td>{escape(str(f[k]))}</td>" for k in ("severity", "where", "what", "remedy", "action")
                )
                + "</tr>"
            )
        parts.append("</table>")
    notes = [f"assumed: {a}" for a in doc["placement"]["assumed"]] + [f"note: {n}" for n in doc["notes"]]
    if notes:
        parts.append("<h2>Assumptions and notes</h2><ul>")
        parts.extend(f"<li>{escape(n)}</li>" for n in notes)
        parts.append("</ul>")
    parts.append("</body></html>\n")
    return "".join(parts)


def rank_status(g: dict[str, Any]) -> dict[int, str]:
    """What each rank of a group did at its stuck collective (a ``STATUS`` key)."""
    status = {r: "other" for r in g["ranks"]}
    for r in g["completed"]:
        status[r] = "completed"
    for r in g["inside"]:
        status[r] = "inside"
    for r in g["never_entered"]:
        status[r] = "never_entered"
    for m in g["mismatches"]:
        status[m["rank"]] = "mismatch"
    for s in g["suspects"]:
        if s["why"] == "no_dump":
            status[s["rank"]] = "no_dump"
    return status


def _legend() -> str:
    return (
        "<p>"
        + " ".join(f"<span class='rank {cls}'>{escape(text)}</span>" for cls, text in STATUS.values())
        + "</p>"
    )


def _group(g: dict[str, Any], report: HangReport) -> str:
    c = g["collective"]
    status = rank_status(g)
    by_host: dict[str, list[int]] = {}
    for r in g["ranks"]:
        p = report.placement.get(r)
        by_host.setdefault(p.host if p and p.host else "host unknown", []).append(r)
    out = [
        f"<h2>Group {escape(g['pg'])} ({escape(g['desc'])}): {escape(g['kind'])} at {escape(c['op'])} "
        f"seq {c['seq']}, sizes {escape(str(c['sizes']))}, dtype {escape('/'.join(c['dtype']))}</h2><div>"
    ]
    for host, ranks in by_host.items():
        out.append(f"<div class='host'><b>{escape(host)}</b>")
        for r in ranks:
            p = report.placement.get(r)
            gpu = f" GPU {p.gpu_index}" if p and p.gpu_index is not None else ""
            cls, text = STATUS[status[r]]
            out.append(f"<span class='rank {cls}' title='rank {r}{escape(gpu)}: {escape(text)}'>{r}</span>")
        out.append("</div>")
    out.append("</div>")
    if g["suspects"]:
        out.append(
            "<table><tr><th>rank</th><th>why</th><th>host</th><th>GPU</th><th>pid</th><th>what</th></tr>"
        )
        for s in g["suspects"]:
            gpu = s["gpu"]
            gpu_text = f"{gpu['index']} ({gpu['uuid']})" if gpu else ""
            out.append(
                "<tr>"
                + "".join(
                    f"<td>{escape(str(v))}</td>"
                    for v in (s["rank"], s["why"], s["host"] or "", gpu_text, s["pid"] or "", s["what"])
                )
                + "</tr>"
            )
        out.append("</table>")
        for s in g["suspects"]:
            if s["stack"]:
                out.append(f"<p>rank {s['rank']}, last collective's stack:</p><pre>")
                out.append(escape("\n".join(s["stack"])) + "</pre>")
    return "".join(out)
