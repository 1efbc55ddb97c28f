"""``gputopo nodes``'s text view: one row per NVLink domain (members, fit, segments), the unfit trays with
why, the nodes whose domain is unknown, the nodes that did not answer, the audit's findings."""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.markup import escape
from rich.text import Text

from gputopo.topology.domains import compress_hostlist
from gputopo.ui.findings_view import findings_table
from gputopo.ui.output import Output


def show_nodes(out: Output, doc: dict[str, Any], segment: int | None, failed: bool) -> None:
    """``gputopo nodes``'s output: the document (``--json``); on a failure (``failed``) the table on
    stderr only; else the block topology alone (``--slurm-topology``), the ``--nodelist`` line alone
    (``--nodes`` met), or the table."""
    if out.json_mode:
        out.document(doc)
    elif failed:
        # A failure prints nothing on stdout: `sbatch $(gputopo nodes ... --nodes N) job.sh` and
        # `... --slurm-topology > topology.conf` must not take the table as their arguments or file. The
        # table and the reason go to stderr, for the person reading.
        out.err.print(*render_nodes(doc, segment))
    elif "block_topology" in doc and "nodelist" not in doc and not doc.get("findings"):
        out.line(doc["block_topology"].rstrip("\n"))
    elif doc.get("picked") is not None and not doc.get("findings"):
        for p in doc["picked"]:
            out.hint(escape(f"segment in {p['domain']}: {compress_hostlist(p['nodes'])}"))
        out.line(doc["nodelist"])
    else:
        out.show(*render_nodes(doc, segment))


def render_nodes(doc: dict[str, Any], segment: int | None) -> list[RenderableType]:
    """The renderables for ``doc`` (``gputopo nodes --json``'s document)."""
    domains = doc["domains"]
    fit = sum(len(d["fit"]) for d in domains)
    total = sum(len(d["nodes"]) for d in domains)
    # Plain aligned columns, not a rich table: a site of 288 racks is 288 rows, and rich's table layout
    # took longer than reading the 5,184 facts files (benchmarks/bench_nodes.py).
    header = ["NVLink domain", "rack", "members", "fit"] + ([f"segments of {segment}"] if segment else [])
    rows = [header]
    for d in domains:
        row = [
            d["id"],
            d.get("chassis_serial") or "-",
            f"{len(d['nodes'])}: {compress_hostlist(d['nodes'])}",
            f"{len(d['fit'])}" + (f" ({len(d['unchecked'])} unchecked)" if d.get("unchecked") else ""),
        ]
        if segment:
            segs = d.get("segments") or []
            row.append(f"{len(segs)}: " + "  ".join(compress_hostlist(s) for s in segs) if segs else "0")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    table = [f"{len(domains)} NVLink domains, {total} nodes, {fit} fit"]
    table += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    t = Text("\n".join(table))
    blocks: list[RenderableType] = [t]
    lines = []
    for d in domains:
        for u in d["unfit"]:
            lines.append(f"unfit  {u['node']} ({d.get('chassis_serial') or d['id']}): {u['why']}")
    if doc.get("unknown_domain"):
        unknown = compress_hostlist(doc["unknown_domain"])
        lines.append(f"NVLink domain unknown (never mixed into a domain's segments): {unknown}")
        lines.extend(f"unfit  {u['node']}: {u['why']}" for u in doc.get("unknown_domain_unfit") or ())
    lines.extend(f"did not answer  {u['node']}: {u['why']}" for u in doc.get("unanswered") or ())
    # gputopo accept's kept verdict, where it is not a standing acceptance (rejected, not checked, stale).
    for node, acc in sorted((doc.get("accept") or {}).items()):
        if acc and (acc.get("stale") or acc.get("verdict") != "accepted"):
            lines.append(f"accept  {node}: {acc.get('words')}")
    # A --nodes that cannot be met is the command's error line (stderr), not repeated here.
    if doc.get("nodelist"):
        lines.append(doc["nodelist"])
    if lines:
        blocks.append(Text("\n".join(lines)))
    if doc.get("findings"):
        blocks.append(findings_table(doc["findings"], "What Slurm believes, against the NVLink domains"))
    elif "findings" in doc:
        blocks.append(Text("Slurm's view agrees with the NVLink domains: no finding."))
    if doc.get("block_topology"):
        blocks.append(Text(doc["block_topology"].rstrip("\n")))
    return blocks
