"""The views of a hang report, one per format (the format table: ``HangFormat`` and ``RENDERERS``):
text (the verdict first, then each stuck group and its suspects, the ranks' stacks, what is missing,
the findings and what was assumed; plain lines, so the output reads the same piped), JSON
(``gputopo/hang/v1``) and HTML (``ui.hang_html``). Adding a format is one function and one row."""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum

from gputopo.gpulist import format_id_ranges as span
from gputopo.hang.triage import HangReport, user_frame
from gputopo.ui.hang_html import render_html

STACK_LINES = 6


class HangFormat(str, Enum):
    """The forms ``gputopo hang`` writes its report in."""

    TEXT = "text"
    JSON = "json"
    HTML = "html"


def render_json(report: HangReport) -> str:
    """The ``gputopo/hang/v1`` document."""
    return json.dumps(report.document(), indent=2, default=str) + "\n"


def render(report: HangReport, fmt: HangFormat) -> str:
    """The report in ``fmt``."""
    return RENDERERS[fmt](report)


def render_text(report: HangReport) -> list[str]:
    """The lines ``gputopo hang`` prints."""
    doc = report.document()
    lines = [f"{report.verdict}: {report.reason}"]
    dumps = doc["dumps"]
    if dumps["count"]:
        lines.append(
            f"dumps: {dumps['count']} ({', '.join(dumps['formats'])}; recorder {dumps['recorder_version']}"
            + (f", {dumps['comm_lib_version']}" if dumps["comm_lib_version"] else "")
            + f") of world {len(dumps['world'])}"
        )
    for g in doc["groups"]:
        c = g["collective"]
        lines.append("")
        if g["p2p"]:
            way = "to" if c["op"] == "send" else "from"
            at = f"{c['op']} {way} rank {c.get('peer')} (p2p seq {c['seq']})"
        else:
            at = f"{c['op']} seq {c['seq']}"
        lines.append(
            f"group {g['pg']} ({g['desc']}), ranks {span(g['ranks'])}: {g['kind']} at "
            f"{at}, "
            f"sizes {c['sizes']}, dtype {'/'.join(c['dtype']) or '?'}"
            + (f" ({c['backend']})" if c["backend"] else "")
        )
        lines.append(
            f"  completed: {span(g['completed']) or 'none'}   inside: {span(g['inside']) or 'none'}   "
            f"never entered: {span(g['never_entered']) or 'none'}"
        )
        if not g["state_tracked"]:
            lines.append("  (gloo records no start or completion: states stay 'scheduled')")
        if g["calls"]["note"]:
            lines.append(f"  calls: {g['calls']['note']}")
        if g["pg_status"]:
            lines.append(
                "  pg_status (enqueued/started/completed): "
                + "; ".join(
                    f"rank {r}: {st.get('enqueued', '?')}/{st.get('started', '?')}/{st.get('completed', '?')}"
                    for r, st in g["pg_status"].items()
                )
            )
        for m in g["mismatches"]:
            lines.append(f"  mismatch: rank {m['rank']} {m['what']}")
        for s in g["suspects"]:
            lines.append(f"  suspect rank {s['rank']}: {s['why']}: {s['what']}")
            place = []
            if s["host"]:
                place.append(f"host {s['host']}")
            if s["local_rank"] is not None:
                place.append(f"local rank {s['local_rank']}")
            if s["gpu"]:
                gpu = s["gpu"]
                place.append(f"GPU {gpu['index']}" + (f" ({gpu['uuid']})" if gpu.get("uuid") else ""))
            if s["pid"]:
                place.append(f"pid {s['pid']}")
            lines.append(
                "    " + ("  ".join(place) if place else "host, GPU and pid unknown (no run record)")
            )
            last = s["last_collective"]
            if last:
                lines.append(
                    f"    last collective: {last['op']} seq {last['seq']} of group {last['pg']}, "
                    f"sizes {last['sizes']}, "
                    f"{'/'.join(last['dtype']) or '?'}, {last['state']}"
                )
            if s["stack"]:
                frame = user_frame(s["stack"])
                lines.append(f"    called from: {frame}" if frame else "    stack:")
                for f in s["stack"][:STACK_LINES]:
                    lines.append(f"      {f}")
                if len(s["stack"]) > STACK_LINES:
                    lines.append(f"      ... {len(s['stack']) - STACK_LINES} more frames")
            elif last:
                lines.append("    stack: not in this dump (JSON dumps carry none; the pickle dump has them)")
            for h in s["health"]:
                lines.append(f"    health: {h.get('severity')}: {h.get('what')}")
    if doc["stacks"]:
        lines.append("")
        lines.append(f"stacks: {doc['stacks_verdict']}")
        for st in doc["stacks"]:
            where = f"{st['host'] or '?'} pid {st['pid'] or '?'}"
            if st["error"]:
                lines.append(f"  rank {st['rank']} ({where}): no stack: {st['error']}")
            elif st["in"] == "collective":
                lines.append(
                    f"  rank {st['rank']} ({where}): in {st['what']}"
                    + (f", called from {st['frame']}" if st["frame"] else "")
                )
            else:
                lines.append(f"  rank {st['rank']} ({where}): in {st['frame']}, not in a collective")
    if doc["missing_dumps"]:
        lines.append("")
        lines.append("missing dumps: " + "; ".join(f"rank {r}: no dump" for r in doc["missing_dumps"]))
    for sk in doc["skipped_dumps"]:
        lines.append(f"skipped: {sk['path']} (rank {sk['rank']}): {sk['why']}")
    ras = doc["ras"]
    if ras is not None:
        lines.append("")
        lines.append(
            f"NCCL RAS ({ras['source']}, NCCL {ras['nccl_version'] or '?'}): "
            f"{ras['communicators']} communicator(s), "
            f"{len(ras['troubled'])} troubled rank(s)"
        )
        for r in ras["troubled"]:
            gpu = f" GPU {r['gpu']['index']}" if r["gpu"] else ""
            lines.append(
                f"  rank {r['rank']} ({r['comm']}): {r['trouble']}: "
                f"host {r['host'] or '?'}{gpu} pid {r['pid'] or '?'}"
            )
    ta = doc["torch_analyzer"]
    if ta is not None:
        lines.append("")
        if ta.get("error"):
            lines.append(f"torch's analyzer: failed ({ta['error']}); the answer above is gputopo's own")
        else:
            agree = ta.get("agrees")
            lines.append(
                "torch's analyzer: "
                + ("agrees" if agree else "disagrees: " + "; ".join(ta.get("differences", [])))
            )
    if doc["findings"]:
        lines.append("")
        lines.append("findings:")
        for f in doc["findings"]:
            lines.append(f"  {f['severity']}: {f['where']}: {f['what']}")
            lines.append(f"    remedy: {f['remedy']}")
    if doc["placement"]["assumed"] or doc["notes"]:
        lines.append("")
        for a in doc["placement"]["assumed"]:
            lines.append(f"assumed: {a}")
        for n in doc["notes"]:
            lines.append(f"note: {n}")
    return lines


RENDERERS: dict[HangFormat, Callable[[HangReport], str]] = {
    HangFormat.TEXT: lambda report: "\n".join(render_text(report)) + "\n",
    HangFormat.JSON: render_json,
    HangFormat.HTML: render_html,
}
