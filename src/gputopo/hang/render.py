"""The text form of a hang report: the verdict first, then each stuck group and its suspects, then what
is missing, the findings and what was assumed. Plain lines (pure), so the output reads the same piped."""

from __future__ import annotations

from gputopo.hang.triage import HangReport, user_frame

STACK_LINES = 6


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
        lines.append(
            f"group {g['pg']} ({g['desc']}), ranks {_span(g['ranks'])}: {g['kind']} at "
            f"{c['op']} seq {c['seq']}, "
            f"sizes {c['sizes']}, dtype {'/'.join(c['dtype']) or '?'}"
            + (f" ({c['backend']})" if c["backend"] else "")
        )
        lines.append(
            f"  completed: {_span(g['completed']) or 'none'}   inside: {_span(g['inside']) or 'none'}   "
            f"never entered: {_span(g['never_entered']) or 'none'}"
        )
        if not g["state_tracked"]:
            lines.append("  (gloo records no start or completion: states stay 'scheduled')")
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


def _span(ranks: list[int]) -> str:
    """0-3,5 style."""
    out: list[str] = []
    rs = sorted(ranks)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)
