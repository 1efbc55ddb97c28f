"""Pictures for the HTML report, drawn with matplotlib (Agg, no screen) and returned as PNG bytes.

Each function takes plain data (a Topology, lists of numbers) and returns the PNG, so the report can be
re-rendered later from its saved JSON on a machine without GPUs. matplotlib is imported lazily: only
``doctor`` and ``report --html`` pay for it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

from gputopo.model import Link, LinkKind, Topology

# Edge styles by link kind: colour, line style. Same colour scale as the terminal matrix.
_EDGE = {
    LinkKind.NVLINK: ("#2e7d32", "-"),
    LinkKind.PIX: ("#00838f", "--"),
    LinkKind.PXB: ("#1565c0", "--"),
    LinkKind.PHB: ("#f9a825", ":"),
    LinkKind.NODE: ("#ef6c00", ":"),
    LinkKind.SYS: ("#c62828", ":"),
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return buf.getvalue()


def socket_of(numa: str | None) -> str:
    """The socket/NUMA group a GPU hangs off, from its NUMA affinity (one group when unknown)."""
    if numa is None or numa in ("", "N/A"):
        return "CPU"
    return f"NUMA {numa}"


def topology_graph(topo: Topology) -> bytes:
    """GPUs under their CPU socket/NUMA node, NICs above, edges styled by link kind.

    Close links (NVLink, PIX, PXB) are drawn between devices; links through the CPU (PHB, NODE) are
    implied by hanging off the same socket, and SYS is the edge between sockets. A uniform all-to-all
    NVLink set of four or more GPUs is drawn through one NVSwitch node instead of every pair.
    """
    plt = _pyplot()
    groups: dict[str, list[int]] = {}
    for g in topo.gpus:
        groups.setdefault(socket_of(g.numa_affinity), []).append(g.index)
    names = list(groups)
    width = max(6.0, 1.3 * len(topo.gpus) + 2)
    fig, ax = plt.subplots(figsize=(width, 4.6))
    pos: dict[str, tuple[float, float]] = {}
    x = 0.0
    socket_x: dict[str, float] = {}
    for name in names:
        members = groups[name]
        for i, idx in enumerate(members):
            pos[f"GPU{idx}"] = (x + i * 1.3, 0.0)
        socket_x[name] = x + (len(members) - 1) * 1.3 / 2
        pos[name] = (socket_x[name], -2.0)
        x += len(members) * 1.3 + 1.0
    gpu_labels = [g.label for g in topo.gpus]
    # NICs above the GPU they are closest to (fewest rank); spread those that share a GPU.
    above: dict[str, int] = {}
    for nic in topo.nics:
        best = min(
            gpu_labels,
            key=lambda lab: (_rank(topo, nic.label, lab), gpu_labels.index(lab)),
            default=None,
        )
        if best is None:
            continue
        k = above.get(best, 0)
        above[best] = k + 1
        gx, _ = pos[best]
        pos[nic.label] = (gx + 0.35 * k, 2.0 + 0.45 * k)

    def line(a: str, b: str, kind: LinkKind, label: str | None = None, rad: float = 0.0) -> None:
        from matplotlib.patches import FancyArrowPatch

        color, style = _EDGE[kind]
        patch = FancyArrowPatch(
            pos[a],
            pos[b],
            arrowstyle="-",
            connectionstyle=f"arc3,rad={rad}",
            color=color,
            linestyle=style,
            linewidth=2.4 if kind is LinkKind.NVLINK else 1.4,
            zorder=1,
        )
        ax.add_patch(patch)
        if label:
            (x1, y1), (x2, y2) = pos[a], pos[b]
            mx, my = (x1 + x2) / 2, (y1 + y2) / 2 - rad * (x2 - x1) * 0.5
            ax.text(
                mx,
                my,
                label,
                fontsize=7,
                color=color,
                ha="center",
                va="center",
                bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none"},
                zorder=2,
            )

    nv = _nvlink_pairs(topo)
    switch = _uniform_all_to_all(topo, nv)
    if switch is not None:
        pos["NVSwitch"] = ((x - 1.0 - 1.3) / 2, 1.1)
        for g in gpu_labels:
            line(g, "NVSwitch", LinkKind.NVLINK)
        ax.text(
            *pos["NVSwitch"],
            f"NVSwitch\n{switch} per GPU pair",
            ha="center",
            va="center",
            fontsize=8,
            bbox={"boxstyle": "round", "fc": "#e8f5e9", "ec": "#2e7d32"},
            zorder=3,
        )
    else:
        for (a, b), code in nv.items():
            line(a, b, LinkKind.NVLINK, code, rad=-0.35)
    for i, a in enumerate(gpu_labels):
        for b in gpu_labels[i + 1 :]:
            link = topo.matrix.link(a, b)
            if link is not None and link.kind in (LinkKind.PIX, LinkKind.PXB):
                line(a, b, link.kind, link.code, rad=0.3)
    for g in topo.gpus:
        line(g.label, socket_of(g.numa_affinity), LinkKind.PHB)
    for nic in topo.nics:
        if nic.label not in pos:
            continue
        near = [lab for lab in gpu_labels if _rank(topo, nic.label, lab) <= LinkKind.PXB.rank]
        for lab in near[:2]:
            link = topo.matrix.link(nic.label, lab)
            assert link is not None
            line(nic.label, lab, link.kind)
    for a, b in zip(names, names[1:], strict=False):
        line(a, b, LinkKind.SYS, "SYS (QPI/UPI)", rad=-0.15)
    for node, (px, py) in pos.items():
        if node == "NVSwitch":
            continue
        if node.startswith("GPU"):
            style = {"fc": "#76b900", "ec": "#33691e"}
        elif node in groups:
            style = {"fc": "#cfd8dc", "ec": "#455a64"}
        else:
            style = {"fc": "#bbdefb", "ec": "#0d47a1"}
        nic_name = next((n.name for n in topo.nics if n.label == node and n.name and n.name != n.label), None)
        text = f"{node}\n{nic_name}" if nic_name else node
        ax.text(
            px,
            py,
            text,
            ha="center",
            va="center",
            fontsize=8,
            zorder=3,
            bbox={"boxstyle": "round,pad=0.35", **style},
        )
    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - 1.0, max(xs) + 1.0)
    ax.set_ylim(min(ys) - 0.8, max(ys) + 0.8)
    ax.axis("off")
    ax.set_title(f"Topology: {topo.source}", fontsize=10)
    handles = [
        plt.Line2D([], [], color=c, linestyle=s, label=k.name if k is not LinkKind.NVLINK else "NVLink")
        for k, (c, s) in _EDGE.items()
    ]
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=6, fontsize=7, frameon=False
    )
    return _png(fig)


def _rank(topo: Topology, a: str, b: str) -> int:
    link = topo.matrix.link(a, b)
    return link.kind.rank if link is not None else 99


def _nvlink_pairs(topo: Topology) -> dict[tuple[str, str], str]:
    labels = [g.label for g in topo.gpus]
    pairs = {}
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            link = topo.matrix.link(a, b)
            if link is not None and link.kind is LinkKind.NVLINK:
                pairs[(a, b)] = link.code
    return pairs


def _uniform_all_to_all(topo: Topology, nv: dict[tuple[str, str], str]) -> str | None:
    n = len(topo.gpus)
    codes = set(nv.values())
    if n >= 4 and len(nv) == n * (n - 1) // 2 and len(codes) == 1:
        return codes.pop()
    return None


def pair_heatmaps(
    gpus: Sequence[int],
    measured_gbps: dict[tuple[int, int], float | None],
    estimated_gbps: dict[tuple[int, int], float | None],
    failed: set[tuple[int, int]],
    measured_title: str = "measured busbw (GB/s)",
    same_scale: bool = True,
) -> bytes:
    """Two heatmaps side by side: measured pair bandwidth and the model's estimate; failed pairs marked."""
    plt = _pyplot()
    n = len(gpus)
    size = max(3.2, 0.55 * n + 1.6)
    # Constrained layout gives each colour bar its own room: with fixed spacing the left bar's tick
    # labels ran into the right heatmap's GPU labels.
    fig, axes = plt.subplots(1, 2, figsize=(2 * size + 1.6, size), layout="constrained")
    shared_top = max([v for v in (*measured_gbps.values(), *estimated_gbps.values()) if v] + [1.0])
    for ax, data, title in (
        (axes[0], measured_gbps, measured_title),
        (axes[1], estimated_gbps, "model estimate (GB/s)"),
    ):
        # One colour scale for both panels so they compare, unless the measurement is of another kind
        # (CPU stand-ins): then each panel gets its own.
        top = shared_top if same_scale else max([v for v in data.values() if v] + [1.0])
        grid = [[math.nan] * n for _ in range(n)]
        for i, a in enumerate(gpus):
            for j, b in enumerate(gpus):
                v = data.get((min(a, b), max(a, b)))
                if i != j and v is not None:
                    grid[i][j] = v
        image = ax.imshow(grid, cmap="viridis", vmin=0, vmax=top)
        ax.set_xticks(range(n), [f"GPU{g}" for g in gpus], rotation=45, fontsize=7)
        ax.set_yticks(range(n), [f"GPU{g}" for g in gpus], fontsize=7)
        ax.set_title(title, fontsize=9)
        for i, a in enumerate(gpus):
            for j, b in enumerate(gpus):
                if i == j:
                    continue
                key = (min(a, b), max(a, b))
                if data is measured_gbps and key in failed:
                    ax.text(j, i, "FAIL", ha="center", va="center", fontsize=6, color="red", weight="bold")
                elif not math.isnan(grid[i][j]):
                    color = "black" if grid[i][j] > 0.6 * top else "white"  # readable on viridis
                    ax.text(j, i, f"{grid[i][j]:.3g}", ha="center", va="center", fontsize=6, color=color)
        bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02)
        bar.ax.tick_params(labelsize=7)
    return _png(fig)


def busbw_curves(curves: Sequence[tuple[str, Sequence[tuple[int, float]], float | None]]) -> bytes:
    """All-reduce busbw against message size, one line per GPU set; the model's estimate dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    dashed = False
    for i, (label, points, expected) in enumerate(curves):
        color = f"C{i % 10}"
        xs = [p[0] for p in points]
        ax.plot(xs, [p[1] for p in points], marker="o", markersize=3, color=color, label=label)
        if expected:
            dashed = True
            ax.axhline(expected, color=color, linestyle="--", linewidth=0.8, label=f"{label}: model")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    # Promise the dashed lines only when some are drawn (CPU stand-ins get no model estimate).
    title = "all-reduce bus bandwidth" + (" (dashed: model estimate)" if dashed else "")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if curves:
        # Outside the plot, so it never hides a curve however many sets there are.
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return _png(fig)


def speed_bars(tables: Sequence[tuple[str, Sequence[dict[str, Any]]]], stand_ins: bool) -> bytes:
    """The speed table as bars: samples/s of each configuration, one group per GPU set, speedup on top."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, max(1, len(tables)), figsize=(3.6 * max(1, len(tables)), 3.4), squeeze=False)
    for ax, (label, rows) in zip(axes[0], tables, strict=False):
        names = [r["config"] for r in rows]
        values = [r["samples_per_s"] for r in rows]
        bars = ax.bar(range(len(rows)), values, color=[f"C{i}" for i in range(len(rows))])
        for bar, r in zip(bars, rows, strict=True):
            if r.get("speedup") is not None:
                ax.annotate(
                    f"{r['speedup']:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.set_xticks(range(len(rows)), names, rotation=20, fontsize=7)
        if ax is axes[0][0]:
            ax.set_ylabel("samples/s")
        ax.margins(y=0.12)  # room for the speedup labels
        ax.set_title(label, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    title = "training speed at the same global batch (speedup over one GPU)"
    fig.suptitle(title + (": CPU stand-ins, not judged" if stand_ins else ""), fontsize=9)
    return _png(fig)


# The per-GPU check's numbers: (row key, axis label, datasheet peak key or None).
_GPU_PANELS = (
    ("matmul_tflops", "matmul (TFLOP/s)", "matmul_tflops"),
    ("memory_gbps", "device memory (GB/s)", "memory_gbps"),
    ("h2d_gbps", "host to device (GB/s)", None),
    ("d2h_gbps", "device to host (GB/s)", None),
)
_GPU_VERDICT_COLOR = {"pass": "C2", "slow": "C1", "corrupt": "C3", "undecided": "C3"}


def gpu_bars(rows: Sequence[dict[str, Any]], stand_ins: bool) -> bytes:
    """The per-GPU check as bars: one panel per number, a bar per GPU coloured by its verdict, the median
    of every GPU dashed and the datasheet peak dotted where the report knows it."""
    import statistics

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(_GPU_PANELS), figsize=(3.2 * len(_GPU_PANELS), 3.2), squeeze=False)
    labels = [f"GPU{r.get('gpu')}" for r in rows]
    # grey for a speed left undecided by this machine's noise (not a failure)
    colors = [
        "C7" if r.get("undecided_about") == "speed" else _GPU_VERDICT_COLOR.get(str(r.get("verdict")), "C7")
        for r in rows
    ]
    for ax, (key, title, peak_key) in zip(axes[0], _GPU_PANELS, strict=True):
        values = [float(r[key]) if isinstance(r.get(key), (int, float)) else 0.0 for r in rows]
        ax.bar(range(len(rows)), values, color=colors)
        measured = [v for v in values if v > 0]
        if measured:
            ax.axhline(statistics.median(measured), color="k", linestyle="--", linewidth=0.8)
        peaks = {(r.get("peak") or {}).get(peak_key) for r in rows if peak_key and r.get("peak")} - {None}
        for peak in peaks:
            ax.axhline(float(peak), color="C0", linestyle=":", linewidth=1.0)
        ax.set_xticks(range(len(rows)), labels, rotation=30, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    what = "CPU stand-ins (simulated), process CPU time" if stand_ins else "each GPU on its own"
    lines = "dashed: median" + ("" if stand_ins else ", dotted: datasheet peak")
    fig.suptitle(f"{what}; green pass, orange slow, red corrupt; {lines}", fontsize=9)
    fig.subplots_adjust(top=0.8, wspace=0.3)
    return _png(fig)


def link_code(topo: Topology, a: int, b: int) -> str | None:
    """The printed link code between two GPUs (for captions)."""
    link: Link | None = topo.gpu_link(a, b)
    return link.code if link else None


def matrix_heatmaps(
    gpus: Sequence[int],
    panels: Sequence[tuple[str, Sequence[Sequence[float | None]], Sequence[Sequence[str]] | None]],
    same_scale: bool = True,
) -> bytes:
    """Ordered-pair matrices side by side (row: source GPU, column: destination), one panel each.

    Each panel is (title, values, marks): a cell's mark (``FAIL``, ``*``) is written beside or instead of
    its value. The p2p check draws measured bandwidth beside the model's estimate with one colour scale,
    so a pair that falls short stands out.
    """
    plt = _pyplot()
    n = len(gpus)
    size = max(3.2, 0.55 * n + 1.6)
    fig, axes = plt.subplots(1, len(panels), figsize=(len(panels) * size + 1, size), squeeze=False)
    values = [v for _, grid, _ in panels for row in grid for v in row if v]
    shared_top = max(values + [1.0])
    for ax, (title, grid, marks) in zip(axes[0], panels, strict=True):
        top = shared_top if same_scale else max([v for row in grid for v in row if v] + [1.0])
        data = [
            [math.nan if (i == j or grid[i][j] is None) else grid[i][j] for j in range(n)] for i in range(n)
        ]
        image = ax.imshow(data, cmap="viridis", vmin=0, vmax=top)
        ax.set_xticks(range(n), [f"GPU{g}" for g in gpus], rotation=45, fontsize=7)
        ax.set_yticks(range(n), [f"GPU{g}" for g in gpus], fontsize=7)
        ax.set_xlabel("destination", fontsize=7)
        ax.set_ylabel("source", fontsize=7)
        ax.set_title(title, fontsize=9)
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                mark = marks[i][j] if marks else ""
                if mark == "FAIL":
                    ax.text(j, i, "FAIL", ha="center", va="center", fontsize=6, color="red", weight="bold")
                elif not math.isnan(data[i][j]):
                    color = "black" if data[i][j] > 0.6 * top else "white"  # readable on viridis
                    ax.text(
                        j, i, f"{data[i][j]:.3g}{mark}", ha="center", va="center", fontsize=6, color=color
                    )
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return _png(fig)
