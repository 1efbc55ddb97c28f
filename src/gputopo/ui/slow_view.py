"""The views of a slow report (``gputopo slow``): text (the answer first, then each straggler, the
ranks' lateness and what the reading assumed), JSON (``gputopo/slow/v1``) and HTML (a per-rank lateness
chart, one self-contained file with an inline SVG: no script, readable offline)."""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum
from html import escape

from gputopo.slow.report import SlowReport

CHART_WIDTH = 720
BAR_HEIGHT = 14
MAX_TEXT_RANKS = 16


class SlowFormat(str, Enum):
    TEXT = "text"
    JSON = "json"
    HTML = "html"


def render(report: SlowReport, fmt: SlowFormat) -> str:
    return RENDERERS[fmt](report)


def render_json(report: SlowReport) -> str:
    return json.dumps(report.document(), indent=2) + "\n"


def render_text(report: SlowReport) -> str:
    doc = report.document()
    verdict = {"straggler": "straggler", "none": "no straggler", "undecided": "undecided"}[doc["verdict"]]
    lines = [f"{verdict}: {report.sentence()}"]
    lines.append(f"read: {doc['source']} ({doc['operations']} operations, {doc['windows']} windows)")
    lines.append(f"clock: {doc['clock']}")
    for s in doc["stragglers"]:
        lines.append(
            f"  {report.unit} {s['rank']}: outlier in {s['windows_flagged']} of {s['windows']} windows; "
            f"communicators {', '.join(s['communicators'])}; operations {', '.join(s['operations']) or '?'}"
        )
    for w in doc["waited"]:
        lines.append(
            f"  {report.unit} {w['rank']} waited for {', '.join(str(r) for r in w['waited_for'])} in "
            f"{', '.join(w['communicators'])}: late downstream only, not a straggler"
        )
    ranks = sorted(doc["ranks"], key=lambda r: (-r["median_lateness_ms"], r["rank"]))
    if ranks:
        lines.append(f"median lateness per {report.unit} (ms), latest first:")
        for r in ranks[:MAX_TEXT_RANKS]:
            where = f" {r['host']}" if r["host"] else ""
            gpu = f" GPU {r['gpu']}" if r["gpu"] is not None else ""
            lines.append(f"  {report.unit} {r['rank']}{where}{gpu}: {r['median_lateness_ms']:.3f}")
        if len(ranks) > MAX_TEXT_RANKS:
            lines.append(f"  ... {len(ranks) - MAX_TEXT_RANKS} more (--json lists every one)")
    for note in doc["notes"]:
        lines.append(f"note: {note}")
    rule = doc["rule"]
    lines.append(
        f"rule: an outlier by median + {rule.get('k', 0):g} x MAD and by {rule.get('floor', 0):.0%} of the "
        f"operation's time, in at least {rule.get('recurrence', 0):.0%} of its windows"
    )
    return "\n".join(lines) + "\n"


def render_html(report: SlowReport) -> str:
    doc = report.document()
    ranks = doc["ranks"]
    late = {s["rank"] for s in doc["stragglers"]}
    top = max((r["median_lateness_ms"] for r in ranks), default=0.0) or 1.0
    label_w = 180
    height = BAR_HEIGHT * len(ranks) + 30
    bars = []
    for i, r in enumerate(ranks):
        y = 10 + i * BAR_HEIGHT
        w = max(0.0, r["median_lateness_ms"]) / top * (CHART_WIDTH - label_w - 80)
        where = f" {r['host']}" if r["host"] else ""
        gpu = f" GPU {r['gpu']}" if r["gpu"] is not None else ""
        colour = "#d9534f" if r["rank"] in late else "#7a9cc6"
        bars.append(
            f'<text x="{label_w - 6}" y="{y + BAR_HEIGHT - 4}" text-anchor="end" font-size="11">'
            f"{escape(report.unit)} {r['rank']}{escape(where + gpu)}</text>"
            f'<rect x="{label_w}" y="{y + 1}" width="{w:.1f}" height="{BAR_HEIGHT - 3}" fill="{colour}"/>'
            f'<text x="{label_w + w + 4:.1f}" y="{y + BAR_HEIGHT - 4}" font-size="11">'
            f"{r['median_lateness_ms']:.3f} ms</text>"
        )
    notes = "".join(f"<li>{escape(n)}</li>" for n in doc["notes"])
    klass = {"straggler": "bad", "none": "good", "undecided": "unsure"}[doc["verdict"]]
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>gputopo slow</title><style>"
        "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}.v{padding:.4em .6em;"
        "border-radius:4px;display:inline-block;font-weight:600}.bad{background:#fde2e1}"
        ".good{background:#e3f6e3}.unsure{background:#fff4d6}</style></head><body>"
        f"<h1>gputopo slow: {escape(doc['path'])}</h1>"
        f"<p class='v {klass}'>{escape(report.sentence())}</p>"
        f"<p>Source: {escape(doc['source'])}; {doc['operations']} operations in {doc['windows']} windows; "
        f"clock: {escape(doc['clock'])}.</p>"
        f"<h2>Median lateness per {escape(report.unit)}</h2>"
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_WIDTH}" height="{height}" role="img" '
        f'aria-label="median lateness per {escape(report.unit)}">{"".join(bars)}</svg>'
        f"<h2>Notes</h2><ul>{notes}</ul></body></html>\n"
    )


RENDERERS: dict[SlowFormat, Callable[[SlowReport], str]] = {
    SlowFormat.TEXT: render_text,
    SlowFormat.JSON: render_json,
    SlowFormat.HTML: render_html,
}
