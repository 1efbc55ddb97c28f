"""Terminal rendering of a doctor report document (a fresh run or a saved JSON file)."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from gputopo.topology import snapshot
from gputopo.ui.doctor_markdown import estimate_words, fmt_gbps, other_findings
from gputopo.ui.findings_view import findings_table, not_checked_lines
from gputopo.ui.topo_view import topology_blocks


def render_doctor(doc: dict[str, Any]) -> RenderableType:
    """Verdict, problems with remedies, pair health, checks, holders, and the export lines last."""
    parts: list[RenderableType] = []
    if doc.get("simulated"):
        parts.append(Text(f"SIMULATED: {doc.get('why_simulated')}", style="bold yellow"))
    parts += health_section(doc)
    topo = doc["topology"]
    parts.append(Text(f"Topology of {topo.get('source', 'the report')}", style="bold"))
    parts.extend(topology_blocks(snapshot.from_dict(topo, source=topo.get("source", "report"))))
    for w in doc.get("warnings") or []:
        parts.append(Text(f"warning about the input: {w}", style="yellow"))
    others = other_findings(doc)
    if others:
        parts.append(findings_table(others, "Problems and remedies"))
    if doc.get("pairs"):
        t = Table(title="Pairs", title_justify="left", header_style="bold")
        for col in ("GPUs", "link", "verdict", "measured busbw GB/s", "model GB/s"):
            t.add_column(col, justify="right" if "GB/s" in col else "left")
        for p in doc["pairs"]:
            style = "green" if p["verdict"] == "pass" else "bold red"
            t.add_row(
                f"{p['gpus'][0]},{p['gpus'][1]}",
                p.get("link") or "?",
                Text(p["verdict"].upper(), style=style),
                fmt_gbps(p.get("measured_busbw_gbps")),
                fmt_gbps(p.get("est_busbw_gbps")),
            )
        parts.append(t)
    probe = doc.get("probe")
    if probe:
        names = [
            n
            for n in ("gpu", "p2p", "dp", "ddp", "allreduce")
            if any(c["name"] == n for s in probe["sets"] for c in s["checks"])
        ]
        failed = any(c["verdict"] == "fail" for s in probe["sets"] for c in s["checks"])
        title = "Checks (failures are explained above)" if failed and others else "Checks"
        t = Table(title=title, title_justify="left", header_style="bold")
        t.add_column("GPUs")
        for n in names:
            t.add_column(n)
        for s in probe["sets"]:
            by_name = {c["name"]: c for c in s["checks"]}
            cells = []
            for n in names:
                c = by_name.get(n)
                if c is None:
                    cells.append(Text("-", style="dim"))
                    continue
                style = {"pass": "green", "fail": "bold red"}.get(c["verdict"], "dim")
                kind = f" ({c['kind']})" if c.get("kind") else ""
                cells.append(Text(c["verdict"] + kind, style=style))
            t.add_row(",".join(map(str, s["gpus"])), *cells)
        parts.append(t)
        parts += per_gpu_tables(probe.get("per_gpu"))
    elif doc.get("probe_note"):
        parts.append(Text(f"probes {doc['probe_note']}", style="yellow"))
    stale = doc.get("stale") or {}
    holders = stale.get("holders") or []
    if holders:
        stale_n = sum(1 for h in holders if h.get("stale"))
        parts.append(
            Text(
                f"{len(holders)} process(es) hold GPU device files, {stale_n} stale "
                "(details: gputopo kill-stale)"
            )
        )
    else:
        parts.append(Text(f"GPU holders: {stale.get('note') or 'none'}", style="dim"))
    lines = Text()
    for r in doc["recommendations"]:
        if r["best"]:
            lines.append(f"# {r['n']} GPUs: {estimate_words(r['best'].get('est_busbw_gbps'))}\n", style="dim")
            lines.append(f"{r['export']}\n")
        else:
            lines.append(f"# {r['n']} GPUs: none ({r['why']})\n", style="dim")
    for e in doc.get("left_out") or []:
        lines.append(f"# GPU{e['gpu']} left out: {e['why']}\n", style="dim")
    lines.rstrip()
    parts.append(Panel(lines, title="Which GPUs to use", title_align="left"))
    from gputopo.ui.probe_view import nodes_tables

    parts += nodes_tables(doc)
    verdict_style = "bold green" if doc["verdict"] == "healthy" else "bold red"
    parts.append(Text(doc["headline"], style=verdict_style))
    if doc.get("report"):
        parts.append(Text("report: " + "  ".join(v for v in doc["report"].values() if v), style="dim"))
    return Group(*parts)


def health_section(doc: dict[str, Any]) -> list[RenderableType]:
    """The report's first section: the node health check's reason, its findings, what it could not
    check (older reports have no health section: nothing)."""
    health = doc.get("health")
    if not health:
        return []
    findings = health.get("findings") or []
    problems = any(f.get("severity") == "problem" for f in findings)
    style = "bold red" if problems else "green" if health.get("checked") else "yellow"
    parts: list[RenderableType] = [Text(health.get("reason") or "health: not checked", style=style)]
    if findings:
        parts.append(findings_table(findings, "Health"))
    skipped = not_checked_lines(health.get("not_checked") or ())
    if skipped:
        parts.append(Text("health not checked: " + "; ".join(skipped), style="dim"))
    return parts


def per_gpu_tables(per_gpu: dict[str, Any] | None) -> list[RenderableType]:
    """The per-GPU check: each GPU's four numbers beside its peers' median, and its verdict."""
    rows = (per_gpu or {}).get("gpus") or []
    if not rows:
        return []
    what = "CPU stand-in" if (per_gpu or {}).get("simulated") else "GPU"
    t = Table(title=f"Every {what} on its own (peers' median in brackets)", title_justify="left")
    for name in ("GPU", "matmul TFLOP/s", "memory GB/s", "H2D GB/s", "D2H GB/s", "verdict"):
        t.add_column(name)
    for r in rows:
        med = r.get("peers_median") or {}
        cells = []
        for key in ("matmul_tflops", "memory_gbps", "h2d_gbps", "d2h_gbps"):
            value, ref = r.get(key), med.get(key)
            text = f"{value:.4g}" if isinstance(value, (int, float)) else "-"
            cells.append(text + (f" ({ref:.4g})" if isinstance(ref, (int, float)) else ""))
        style = "green" if r.get("verdict") == "pass" else "bold red"
        style = "yellow" if r.get("undecided_about") == "speed" else style
        t.add_row(f"GPU{r.get('gpu')}", *cells, Text(str(r.get("verdict")), style=style))
    return [t]
