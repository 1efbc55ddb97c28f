"""Rich rendering of a Topology: the link matrix coloured by speed, the legend, per-GPU details."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from gputopo.model import GPU_NOT_RESPONDING, P2P_CAPABILITIES, UNKNOWN_CELL, Gpu, Link, LinkKind, Topology
from gputopo.topology.nvlink_domain import fabric_lines

NA = "n/a"

# Colour by distance: fastest green, slowest red, so a glance finds the slow paths.
_STYLE = {
    LinkKind.SELF: "dim",
    LinkKind.NVLINK: "bold green",
    LinkKind.PIX: "cyan",
    LinkKind.PXB: "blue",
    LinkKind.PHB: "yellow",
    LinkKind.NODE: "dark_orange",
    LinkKind.SYS: "red",
}


def link_style(code: str | None) -> str:
    """The style for a printed link code (unknown cells are dim)."""
    link = Link.from_code(code) if code else None
    return _STYLE[link.kind] if link else "dim"


def render_topology(topo: Topology, health: Mapping[str, Any] | None = None) -> RenderableType:
    """Everything ``gputopo topo`` shows for ``topo``, top to bottom; with ``health`` (the JSON health
    section of a live read) a health mark per GPU and the health findings under the tables."""
    parts: list[RenderableType] = [
        Text(f"Topology of {_title(topo)}", style="bold"),
        *topology_blocks(topo, health),
    ]
    if health is not None:
        parts.extend(health_blocks(health))
    if topo.live:
        parts.append(live_table(topo))
    if topo.nvlinks:
        parts.append(nvlink_table(topo))
    if topo.p2p:
        parts.append(p2p_table(topo))
    return Group(*parts)


def topology_blocks(topo: Topology, health: Mapping[str, Any] | None = None) -> list[RenderableType]:
    """What a report carries of a topology: the coloured link matrix, its legend, the NIC legend and the
    GPU table (name, PCI bus id, CPU and NUMA affinity, and a health mark when ``health`` is given); above
    the matrix, the NVLink domain, rack, tray and fabric state where the GPUs have a fabric."""
    parts: list[RenderableType] = [
        Text(line) for line in fabric_lines([(g.index, g.fabric) for g in topo.gpus])
    ]
    parts += [matrix_table(topo), Text("Legend:", style="bold"), legend(topo)]
    nics = nic_legend(topo)
    if nics is not None:
        parts.append(nics)
    parts.append(gpu_table(topo, health_marks(health, topo.gpu_indices) if health is not None else None))
    return parts


def health_marks(health: Mapping[str, Any], indices: Sequence[int]) -> dict[int, str]:
    """Per GPU: ``PROBLEM`` (a health problem), ``ok`` (none found), ``?`` (health not read)."""
    if not health.get("checked"):
        return {i: "?" for i in indices}
    from gputopo.health.readings import NOT_READ  # only with health: topo's start-up stays light

    sick = {u["gpu"] for u in health.get("unhealthy") or ()}
    unread: set[int] = set()
    for n in health.get("not_checked") or ():
        wheres, _, what = str(n.get("what", "")).rpartition(": ")
        if what == NOT_READ:  # "GPU4, GPU6: every health value" (refused, or out of time)
            unread |= {int(w[3:]) for w in wheres.split(", ") if w.startswith("GPU") and w[3:].isdigit()}
    return {i: "PROBLEM" if i in sick else "?" if i in unread else "ok" for i in indices}


def health_blocks(health: Mapping[str, Any]) -> list[RenderableType]:
    """The health findings (one table, the shape every view shows) and what could not be checked."""
    from gputopo.ui.findings_view import findings_table, not_checked_lines

    source = health.get("source") or ""
    parts: list[RenderableType] = []
    findings = health.get("findings") or []
    if not health.get("checked"):
        why = "; ".join(not_checked_lines(health.get("not_checked") or ())) or source
        return [Text(f"health: not checked ({why})", style="yellow")]
    if findings:
        parts.append(findings_table(findings, f"Health ({source})"))
    else:
        parts.append(Text(f"Health: no problems found ({source})", style="green"))
    # The signals only, once each: which GPUs and why is `gputopo check`'s long form.
    signals = list(
        dict.fromkeys(str(n.get("what", "")).split(": ", 1)[-1] for n in health.get("not_checked") or ())
    )
    if signals:
        shown = ", ".join(signals[:8]) + (f" and {len(signals) - 8} more" if len(signals) > 8 else "")
        parts.append(Text(f"health not checked: {shown} (`gputopo check` says why)", style="dim"))
    return parts


def topology_export(topo: Topology, html: bool = False) -> str:
    """``topology_blocks`` as plain text (for Markdown: it reads back with ``--input``) or as an HTML
    ``<pre>`` with the terminal's colours inlined."""
    import io

    from rich.console import Console

    console = Console(
        file=io.StringIO(), record=True, width=100_000, color_system="truecolor", highlight=False
    )
    for block in topology_blocks(topo):
        console.print(block)
    if not html:
        return "\n".join(line.rstrip() for line in console.export_text().splitlines()).strip("\n") + "\n"
    return console.export_html(inline_styles=True, code_format='<pre class="topo">{code}</pre>')


def grid(header: list[str], rows: list[list[str | Text]], center: bool = False) -> Text:
    """A plain fixed-column table as one styled Text (header in bold, two spaces between columns).

    The topo view uses this instead of rich's Table: a 16-GPU, 10-NIC matrix has ~700 cells, and
    Table's layout costs tens of milliseconds on every start, which is most of topo's time budget.
    """
    cols = len(header)
    texts = [[c if isinstance(c, Text) else Text(c) for c in row] for row in rows]
    widths = [max([len(header[i])] + [len(r[i]) for r in texts if i < len(r)]) for i in range(cols)]
    out = Text()
    for i, h in enumerate(header):
        out.append((h.center(widths[i]) if center and i else h.ljust(widths[i])) + "  ", style="bold")
    out.rstrip()
    out.append("\n")
    for row in texts:
        line = Text()
        for i, cell in enumerate(row):
            pad = widths[i] - len(cell)
            left = pad // 2 if center and i else 0
            line.append(" " * left)
            line.append_text(cell)
            line.append(" " * (pad - left) + "  ")
        line.rstrip()
        out.append_text(line)
        out.append("\n")
    return out


def _title(topo: Topology) -> str:
    if not topo.live:
        return topo.source
    versions = f"driver {_na(topo.driver_version)}, CUDA {_na(topo.cuda_driver_version)}"
    return f"this machine ({topo.source.upper() if topo.source == 'nvml' else topo.source}, {versions})"


def matrix_table(topo: Topology) -> Text:
    """The link matrix, GPUs and NICs, with the codes as nvidia-smi prints them."""
    rows: list[list[str | Text]] = []
    for label, row in zip(topo.matrix.labels, topo.matrix.cells, strict=True):
        cells = [Text(c if c is not None else UNKNOWN_CELL, style=link_style(c)) for c in row]
        rows.append([Text(label, style="bold"), *cells])
    return grid(["", *topo.matrix.labels], rows, center=True)


def legend(topo: Topology) -> RenderableType:
    """A short legend of the codes that appear, fastest first, plus the NIC names."""
    seen: dict[LinkKind, set[str]] = {}
    for row in topo.matrix.cells:
        for code in row:
            link = Link.from_code(code) if code else None
            if link and link.kind is not LinkKind.SELF:
                seen.setdefault(link.kind, set()).add(code)
    lines = Text()
    for kind in sorted(seen, key=lambda k: k.rank):
        codes = sorted(seen[kind], key=lambda c: (len(c), c))
        name = "NV#" if kind is LinkKind.NVLINK else "/".join(codes)
        text = kind.description
        if "SOC" in codes:
            text += " (SOC is the old name of SYS)"
        lines.append(f"  {name:<8}", style=_STYLE[kind])
        lines.append(f"{text}\n")
    if any(c is None for row in topo.matrix.cells for c in row):
        lines.append("  ?       ", style="dim")
        lines.append("not shown in the source (cropped or truncated)\n")
    return lines


def nic_legend(topo: Topology) -> Text | None:
    """``NIC Legend:`` and one ``  NIC0: mlx5_0`` line per named NIC, as nvidia-smi prints it (so a saved
    ``gputopo topo`` reads back with its NIC names); ``None`` when no NIC has a name of its own."""
    named = [n for n in topo.nics if n.name and n.name != n.label]
    if not named:
        return None
    return Text("NIC Legend:\n\n" + "".join(f"  {n.label}: {n.name}\n" for n in named))


def _na(value: object) -> str:
    return NA if value is None else str(value)


def pcie_text(g: Gpu) -> Text:
    """``Gen4 x16 (max Gen4 x16)``; flags a link below its max while the GPU is busy."""
    p = g.pcie
    if p is None:
        return Text(NA, style="dim")
    cur = f"Gen{_na(p.gen_current)} x{_na(p.width_current)}"
    mx = f"Gen{_na(p.gen_max)} x{_na(p.width_max)}"
    if p.gen_current is None and p.width_current is None:
        return Text(f"max {mx}")
    if not p.degraded:
        return Text(f"{cur} (max {mx})")
    if g.pcie_below_max_while_busy:
        return Text(f"{cur} (max {mx}) BELOW MAX WHILE BUSY", style="bold red")
    return Text(f"{cur} (max {mx}, idle)", style="dim")


def gpu_table(topo: Topology, marks: Mapping[int, str] | None = None) -> Text:
    """Per GPU: name, bus id, CPU/NUMA affinity (and GPU NUMA ID where the machine has one); with
    ``marks``, a health column (``ok``, ``PROBLEM``, ``?``)."""
    has_gpu_numa = any(g.gpu_numa_id not in (None, "N/A") for g in topo.gpus)
    header = ["GPU", "name", "PCI bus id", "CPU affinity", "NUMA"] + (["GPU NUMA ID"] if has_gpu_numa else [])
    rows: list[list[str | Text]] = []
    if marks is not None:
        header.insert(1, "health")
    for g in topo.gpus:
        if marks is not None:
            mark = marks.get(g.index, "?")
            style = {"ok": "green", "PROBLEM": "bold red"}.get(mark, "dim")
            cell = Text(mark, style=style)
        if g.error:
            if g.failing:
                text, style = f"FAILING: {g.error}", "bold red"
            elif g.state == GPU_NOT_RESPONDING:
                text, style = f"NOT RESPONDING: {g.error}", "bold red"
            else:
                text, style = f"not accessible from here: {g.error}", "dim"
            head = [Text(g.label, style=style)] + ([cell] if marks is not None else [])
            rows.append([*head, Text(text, style=style), *([""] * (len(header) - len(head) - 1))])
            continue
        row: list[str | Text] = [
            g.label,
            *([cell] if marks is not None else []),
            _na(g.name),
            _na(g.pci_bus_id),
            _na(g.cpu_affinity),
            _na(g.numa_affinity),
        ]
        if has_gpu_numa:
            row.append(_na(g.gpu_numa_id))
        rows.append(row)
    return grid(header, rows)


def live_table(topo: Topology) -> Text:
    """Live NVML fields per GPU: PCIe link current vs max, minor number, memory, UUID."""
    rows: list[list[str | Text]] = []
    for g in topo.gpus:
        if g.error:
            continue
        mem = (
            f"{g.memory_used_mib} / {g.memory_total_mib} MiB"
            if g.memory_used_mib is not None and g.memory_total_mib is not None
            else NA
        )
        util = NA if g.utilization_pct is None else f"{g.utilization_pct}%"
        rows.append([g.label, pcie_text(g), util, _na(g.minor_number), mem, _na(g.uuid)])
    table = grid(["GPU", "PCIe link", "util", "minor", "memory used", "UUID"], rows)
    return table + gpu_notes(topo)


def gpu_notes(topo: Topology) -> Text:
    """One line per GPU with MIG on (and its MIG devices) or NVLinks without a bridge; empty otherwise."""
    notes = Text()
    for g in topo.gpus:
        if g.error:
            continue
        if g.mig_enabled:
            migs = ", ".join(g.mig_devices) or "none created"
            notes.append(
                f"{g.label}: MIG enabled, left out of probes and sets; MIG devices: {migs}\n", "yellow"
            )
        if g.nvlink_bridge is False:
            notes.append(f"{g.label}: has NVLinks but no bridge (no link active or connected)\n", "dim")
    return notes


def nvlink_table(topo: Topology) -> Text:
    """NVLinks per GPU pair: links up, and links down in red."""
    rows: list[list[str | Text]] = []
    for p in topo.nvlinks or ():
        down = Text(str(p.links_down), style="bold red" if p.links_down else "")
        rows.append([f"GPU{p.gpu}", f"GPU{p.peer}", str(p.links_up), down])
    return Text("NVLink per peer\n", style="bold") + grid(["GPU", "peer", "links up", "links down"], rows)


def p2p_table(topo: Topology) -> Text:
    """P2P status matrices, one per capability; capabilities with identical matrices share one."""
    assert topo.p2p is not None
    groups: list[tuple[list[str], tuple[tuple[str | None, ...], ...]]] = []
    for cap in P2P_CAPABILITIES:
        if cap not in topo.p2p:
            continue
        for caps, m in groups:
            if m == topo.p2p[cap]:
                caps.append(cap)
                break
        else:
            groups.append(([cap], topo.p2p[cap]))
    out = Text(
        "P2P status: OK; CNS chipset, GNS GPU, TNS topology not supported; NS not supported; "
        "DR disabled by regkey; U unknown\n",
        style="bold",
    )
    for caps, m in groups:
        rows: list[list[str | Text]] = []
        for i, g in enumerate(topo.gpus):
            cells: list[str | Text] = [Text(g.label, style="bold")]
            for j, code in enumerate(m[i]):
                if i == j:
                    cells.append(Text("X", style="dim"))
                else:
                    cells.append(Text(code or "?", style="green" if code == "OK" else "yellow"))
            rows.append(cells)
        out.append("P2P " + ", ".join(caps) + "\n")
        out.append_text(grid(["", *(g.label for g in topo.gpus)], rows, center=True))
    return out
