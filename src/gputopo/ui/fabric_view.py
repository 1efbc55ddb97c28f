"""Rich rendering of the node's other half (``fabric.FabricResult``): the network ports with the GPUs
behind them, and the PCIe path of each GPU pair (ACS)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import RenderableType
from rich.text import Text

from gputopo.ui.topo_view import grid

_STATUS_STYLE = {"clean": "green", "redirect": "bold red", "not checked": "yellow"}


def fabric_blocks(doc: Mapping[str, Any], findings: Sequence[Mapping[str, Any]] = ()) -> list[RenderableType]:
    """The ports table (when the node has ports), the GPU pairs' PCIe path table, one line with the
    GPUDirect RDMA and IOMMU modes, and the findings. ``doc`` is ``FabricResult.to_json()``."""
    parts: list[RenderableType] = []
    ports = doc.get("ports") or []
    if ports:
        rows: list[list[str | Text]] = []
        for p in ports:
            up = (p.get("state") or "").upper().endswith(("ACTIVE", "UP"))
            state = " / ".join(x for x in (p.get("state"), p.get("phys_state")) if x) or "n/a"
            rate = f"{p['rate_gbps']:g} Gb/s" if p.get("rate_gbps") else "n/a"
            numa = p.get("numa_node")
            rows.append(
                [
                    p["name"],
                    "RoCE"
                    if p.get("kind") == "ib" and p.get("link_layer") == "Ethernet"
                    else p.get("kind", ""),
                    Text(state, style="green" if up else "red"),
                    rate,
                    "n/a" if numa is None else str(numa),
                    p.get("pci_bus_id") or "n/a",
                    ", ".join(f"GPU{i}" for i in p.get("gpus") or ()) or "-",
                ]
            )
        parts.append(Text("Network ports:", style="bold"))
        parts.append(grid(["port", "kind", "state", "rate", "NUMA", "PCI", "GPUs behind it"], rows))
    pairs = [p for p in doc.get("pairs") or [] if p.get("kind") != "nic"]
    if pairs:
        parts.extend(pair_matrix(pairs))
    gdr, iommu = doc.get("gdr"), doc.get("iommu")
    words = []
    if gdr is not None:
        words.append(f"GPUDirect RDMA: {gdr} ({doc.get('rdma_ports', 0)} RDMA ports)")
    if iommu is not None:
        words.append(f"IOMMU: {iommu}")
    if words:
        parts.append(Text("; ".join(words), style="dim"))
    if findings:
        from gputopo.ui.findings_view import findings_table

        parts.append(findings_table(list(findings), "Network and PCIe path"))
    return parts


_CELL = {"clean": ("ok", "green"), "redirect": ("ACS", "bold red"), "not checked": ("?", "yellow")}


def pair_matrix(pairs: Sequence[Mapping[str, Any]]) -> list[RenderableType]:
    """ACS on each GPU pair's PCIe path as a matrix like the link matrix (``ok`` no bridge under the pair's
    meeting point redirects, ``ACS`` one does, ``?`` not checked), then the redirecting bridges with their
    pairs and why a pair was not checked."""
    labels = list(dict.fromkeys(x for p in pairs for x in (p["a"], p["b"])))
    cell = {frozenset((p["a"], p["b"])): p for p in pairs}
    rows: list[list[str | Text]] = []
    for a in labels:
        row: list[str | Text] = [a]
        for b in labels:
            if a == b:
                row.append(Text("X", style="dim"))
                continue
            word, style = _CELL.get(cell[frozenset((a, b))]["status"], ("?", "yellow"))
            row.append(Text(word, style=style))
        rows.append(row)
    out: list[RenderableType] = [
        Text(
            "ACS on each GPU pair's PCIe path (ok: no redirect, ACS: a bridge redirects P2P, ?: not read):",
            style="bold",
        ),
        grid(["", *labels], rows, center=True),
    ]
    bridges: dict[str, list[str]] = {}
    for p in sorted(pairs, key=lambda p: p.get("common") is None):  # pairs under one host bridge first
        for r in p.get("redirect") or ():
            bridges.setdefault(r["bridge"], []).append(f"{p['a']}-{p['b']}")
    for bdf, names in sorted(bridges.items()):
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        out.append(Text(f"  bridge {bdf} redirects P2P of {shown}", style="red"))
    unread = [p for p in pairs if p["status"] == "not checked"]
    if unread:
        out.append(Text(f"  not checked: {unread[0].get('not_checked')}", style="yellow"))
    return out
