"""doctor's Markdown report, and the words its other views share (``doctor_view``, ``html_report``):
a ``gputopo/doctor/v1`` document in, text out. It lives with the views because the link matrix is
rendered by rich (``topo_view.topology_export``)."""

from __future__ import annotations

from typing import Any

from gputopo.ui.findings_view import findings_markdown, not_checked_lines


def to_markdown(doc: dict[str, Any]) -> str:
    """The report as Markdown: verdict, problems with remedies, export lines, pairs, checks, holders."""
    lines = [f"# gputopo doctor{' (SIMULATED)' if doc['simulated'] else ''}", ""]
    lines.append(f"- when: {doc['created_utc']}; gputopo {doc['gputopo_version']}; device: {doc['device']}")
    lines.append(f"- machine: {doc['topology']['source']}")
    if doc["simulated"]:
        lines.append(f"- simulated: {doc['why_simulated']}. Bandwidths and timings are not a real GPU's.")
    lines += ["", f"**{doc['headline']}**", ""]
    lines += health_markdown(doc)
    if doc.get("warnings"):
        lines += ["## Warnings about the input", ""] + [f"- {_md(w)}" for w in doc["warnings"]] + [""]
    others = other_findings(doc)
    if others:
        lines += ["## Problems and remedies", "", *findings_markdown(others), ""]
    lines += ["## Which GPUs to use", ""]
    for r in doc["recommendations"]:
        if r["best"]:
            lines.append(
                f"- {r['n']} GPUs: `{r['export']}` ({estimate_words(r['best'].get('est_busbw_gbps'))})"
            )
        else:
            lines.append(f"- {r['n']} GPUs: none ({r['why']})")
    for e in doc["left_out"]:
        lines.append(f"- GPU{e['gpu']} left out: {e['why']}")
    lines.append("")
    if doc["pairs"]:
        lines += [
            "## Pairs",
            "",
            "| GPUs | link | verdict | measured busbw GB/s | model GB/s |",
            "|---|---|---|---|---|",
        ]
        for p in doc["pairs"]:
            lines.append(
                f"| {p['gpus'][0]},{p['gpus'][1]} | {p['link']} | {p['verdict']} | "
                f"{fmt_gbps(p['measured_busbw_gbps'])} | {fmt_gbps(p['est_busbw_gbps'])} |"
            )
        lines.append("")
    if doc["probe"]:
        lines += ["## Checks", "", "| GPUs | check | verdict | detail |", "|---|---|---|---|"]
        for s in doc["probe"]["sets"]:
            for c in s["checks"]:
                kind = f" ({c['kind']})" if c.get("kind") else ""
                gpus = ",".join(map(str, s["gpus"]))
                lines.append(f"| {gpus} | {c['name']} | {c['verdict']}{kind} | {_md(c.get('detail'))} |")
        lines.append("")
        lines += per_gpu_markdown(doc["probe"])
        lines += speed_markdown(doc["probe"])
    elif doc["probe_note"]:
        lines += [f"Probes {doc['probe_note']}.", ""]
    lines += ["## Topology", "", "```text", topology_text(doc["topology"]).rstrip("\n"), "```", ""]
    lines += ["## Processes holding GPUs", ""]
    holders = doc["stale"].get("holders") or []
    for h in holders:
        state = holder_state(h) + (f" {h['kind']}" if h.get("kind") else "")
        lines.append(f"- pid {h['pid']} ({h.get('user')}): {state}; {holder_why(h)}")
    if not holders:
        lines.append(doc["stale"].get("note") or "No process holds a GPU device file.")
    if doc.get("nodes"):
        from gputopo.probe.report.nodes import nodes_markdown

        lines += nodes_markdown(doc)
    return "\n".join(lines) + "\n"


def other_findings(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's findings that are not the health check's (those have their own section first)."""
    health = doc.get("health") or {}
    own = health.get("findings") or []
    return [f for f in doc.get("findings") or [] if f not in own]


def health_markdown(doc: dict[str, Any]) -> list[str]:
    """The health section (first in the report): the check's reason, findings, what it did not check."""
    health = doc.get("health")
    if not health:
        return []
    lines = ["## Health", "", _md(health.get("reason") or "health: not checked"), ""]
    findings = health.get("findings") or []
    if findings:
        lines += [*findings_markdown(findings), ""]
    skipped = not_checked_lines(health.get("not_checked") or ())
    if skipped:
        lines += ["Not checked:", "", *(f"- {_md(s)}" for s in skipped), ""]
    return lines


def per_gpu_markdown(probe: dict[str, Any]) -> list[str]:
    """The per-GPU check's table (each GPU's numbers, the median, the datasheet peak), as the probe's."""
    from gputopo.probe.report.document import gpu_table

    out: list[str] = []
    for s in probe.get("sets") or []:
        for c in s["checks"]:
            if c["name"] == "gpu" and c.get("kind") not in ("hung", "crashed"):
                out += ["```", *gpu_table(s["gpus"], c), "```", ""]
    return ["## Every GPU on its own", "", *out] if out else []


def speed_markdown(probe: dict[str, Any]) -> list[str]:
    """The speed table of every set that has one (one GPU, DataParallel, DDP, DDP+AMP), as text bars."""
    from gputopo.probe.judge.speed import speed_table

    out: list[str] = []
    for s in probe.get("sets") or []:
        for c in s["checks"]:
            if c["name"] == "speed":
                out += [
                    "```",
                    *speed_table(tuple(s["gpus"]), c.get("metrics") or {}, probe.get("device")),
                    "```",
                    "",
                ]
    return ["## Speed: one GPU vs DataParallel vs DDP", "", *out] if out else []


def holder_why(holder: dict[str, Any]) -> str:
    """Why a kill-stale holder is stale (its reasons), or else why it is not (its launcher runs, it is
    detached, ...)."""
    return "; ".join(holder.get("reasons") or []) or (holder.get("why") or "")


def topology_text(topology: dict[str, Any]) -> str:
    """The report's topology as ``gputopo topo`` prints it: link matrix, legends, GPU table (affinity and
    PCI bus ids). Plain text, so ``gputopo topo --input`` reads it back from a copied report."""
    from gputopo.topology import snapshot
    from gputopo.ui.topo_view import topology_export

    return topology_export(snapshot.from_dict(topology, source=topology.get("source", "report")))


def holder_state(holder: dict[str, Any]) -> str:
    """One word for a kill-stale holder in a report: stale, protected, or in use."""
    if holder.get("stale"):
        return "stale"
    return "protected" if holder.get("protected") else "in use"


def _md(text: Any) -> str:
    return str(text if text is not None else "n/a").replace("|", "\\|").replace("\n", " ")


def estimate_words(gbps: float | None) -> str:
    """``est. 48 GB/s busbw``, or why there is none (a cut paste hides links the set needs)."""
    if gbps is None:
        return "no busbw estimate: the input does not show every link this set needs"
    return f"est. {fmt_gbps(gbps)} GB/s busbw"


def fmt_gbps(value: float | None) -> str:
    """A bandwidth for a report: three significant digits, ``n/a`` when unknown."""
    return "n/a" if value is None else f"{value:.3g}"
