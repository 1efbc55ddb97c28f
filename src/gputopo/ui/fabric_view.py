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
        rows = []
        for p in pairs:
            status = p.get("status", "")
            detail = ", ".join(r["bridge"] for r in p.get("redirect") or ())
            if status == "not checked":
                detail = p.get("not_checked") or ""
            rows.append(
                [
                    f"{p['a']}-{p['b']}",
                    Text(status, style=_STATUS_STYLE.get(status, "")),
                    p.get("common") or "-",
                    detail,
                ]
            )
        parts.append(
            Text("PCIe path of each GPU pair (ACS on the bridges peer traffic crosses):", style="bold")
        )
        parts.append(grid(["pair", "ACS", "meets at", "redirecting bridges / why not checked"], rows))
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
