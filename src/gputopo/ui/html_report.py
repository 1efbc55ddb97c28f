"""The doctor report as one self-contained HTML file: verdict, pictures (embedded PNGs), tables.

Built only from the report's JSON document, so ``gputopo report PATH --html`` can redraw a saved
report on another machine.
"""

from __future__ import annotations

import base64
import html
from typing import Any

from gputopo.doctor import holder_state, holder_why
from gputopo.topology import snapshot
from gputopo.ui import figures
from gputopo.ui.topo_view import topology_export

_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2rem auto; max-width: 1100px;
       color: #212121; padding: 0 1rem; }
h1 { margin-bottom: 0.2rem; } .sub { color: #616161; margin-top: 0; }
.banner { padding: 0.8rem 1rem; border-radius: 6px; font-weight: 600; margin: 1rem 0; }
.healthy { background: #e8f5e9; border: 1px solid #2e7d32; }
.problems { background: #ffebee; border: 1px solid #c62828; }
.simulated { background: #fff8e1; border: 1px solid #f9a825; }
table { border-collapse: collapse; margin: 0.5rem 0 1.2rem; font-size: 0.9rem; }
th, td { border: 1px solid #e0e0e0; padding: 0.3rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } td.pass { color: #2e7d32; font-weight: 600; }
td.fail { color: #c62828; font-weight: 600; } td.skipped { color: #757575; }
code, pre { background: #f5f5f5; padding: 0.1rem 0.3rem; border-radius: 3px; }
pre { padding: 0.6rem; overflow-x: auto; } img { max-width: 100%; border: 1px solid #eeeeee; }
figure { margin: 0.5rem 0 1.5rem; } figcaption { color: #616161; font-size: 0.85rem; }
"""


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _e(value: Any) -> str:
    return html.escape("n/a" if value is None else str(value))


def _table(header: list[str], rows: list[list[str]], classes: list[list[str]] | None = None) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = []
    for r, row in enumerate(rows):
        cells = []
        for c, cell in enumerate(row):
            cls = classes[r][c] if classes and classes[r][c] else ""
            cells.append(f'<td class="{cls}">{cell}</td>' if cls else f"<td>{cell}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def render_html(doc: dict[str, Any]) -> str:
    """The whole report page for a ``gputopo/doctor/v1`` document."""
    topo = snapshot.from_dict(doc["topology"], source=doc["topology"].get("source", "report"))
    simulated = bool(doc.get("simulated"))
    parts: list[str] = []
    title = "gputopo doctor" + (" (simulated)" if simulated else "")
    parts.append(f"<h1>{_e(title)}</h1>")
    parts.append(
        f'<p class="sub">{_e(doc.get("created_utc"))} &middot; machine: {_e(topo.source)} &middot; '
        f"device: {_e(doc.get('device'))} &middot; gputopo {_e(doc.get('gputopo_version'))}</p>"
    )
    if simulated:
        parts.append(
            f'<div class="banner simulated">SIMULATED: {_e(doc.get("why_simulated") or "not this machine")}. '
            "CPU ranks stand in for the GPUs: bandwidths and timings are not a real GPU's.</div>"
        )
    verdict = doc.get("verdict", "problems")
    parts.append(f'<div class="banner {_e(verdict)}">{_e(doc.get("headline"))}</div>')
    if doc.get("warnings"):
        parts.append("<h2>Warnings about the input</h2>")
        parts.append("<ul>" + "".join(f"<li>{_e(w)}</li>" for w in doc["warnings"]) + "</ul>")

    findings = doc.get("findings") or []
    if findings:
        parts.append("<h2>What is wrong, and what to do</h2>")
        rows = [[_e(f.get("where")), _e(f.get("what")), _e(f.get("remedy"))] for f in findings]
        parts.append(_table(["where", "problem", "remedy"], rows))

    parts.append("<h2>Which GPUs to use</h2>")
    rec_rows = []
    for r in doc.get("recommendations") or []:
        best = r.get("best") or {}
        rec_rows.append(
            [
                _e(r.get("n")),
                _e(",".join(str(g) for g in best.get("gpus", [])) or None),
                _e(best.get("est_busbw_gbps")),
                _e(best.get("bottleneck")),
                f"<code>{_e(r.get('export'))}</code>" if r.get("export") else _e(r.get("why")),
            ]
        )
    parts.append(_table(["GPUs wanted", "best set", "est. busbw GB/s", "bottleneck", "use"], rec_rows))

    parts.append("<h2>Topology</h2>")
    parts.append(
        "<figure>"
        + _img(figures.topology_graph(topo), "topology graph")
        + "<figcaption>GPUs under their CPU socket / NUMA node, NICs above. Green: NVLink; dashed: "
        "PCIe switches (PIX/PXB); dotted: through the CPU (PHB/NODE) and across sockets (SYS)."
        "</figcaption></figure>"
    )
    # The matrix, legends and GPU table in the terminal's colours: what an operator compares first.
    parts.append(topology_export(topo, html=True))

    pairs = doc.get("pairs") or []
    if pairs:
        gpus = sorted({g for p in pairs for g in p["gpus"]})
        measured = {tuple(sorted(p["gpus"])): p.get("measured_busbw_gbps") for p in pairs}
        estimated = {tuple(sorted(p["gpus"])): p.get("est_busbw_gbps") for p in pairs}
        failed = {tuple(sorted(p["gpus"])) for p in pairs if p.get("verdict") == "fail"}
        parts.append("<h2>Pair health and bandwidth</h2>")
        parts.append(
            "<figure>"
            + _img(
                figures.pair_heatmaps(
                    gpus,
                    measured,
                    estimated,
                    failed,
                    "measured busbw, CPU stand-ins (GB/s)" if simulated else "measured busbw (GB/s)",
                    same_scale=not simulated,
                ),
                "pair bandwidth heatmaps",
            )
            + "<figcaption>Left: all-reduce busbw measured on each pair (FAIL: a check failed on that pair). "
            "Right: the bandwidth model's estimate from the link type.</figcaption></figure>"
        )

    curves = []
    for s in (doc.get("probe") or {}).get("sets") or []:
        for check in s.get("checks") or []:
            if check.get("name") == "allreduce" and (check.get("metrics") or {}).get("rows"):
                m = check["metrics"]
                points = [(row["bytes"], row["busbw_gbps"]) for row in m["rows"]]
                label = "GPUs " + ",".join(str(g) for g in s["gpus"])
                # CPU stand-ins' gloo numbers are not comparable with the GPU model: no estimate line.
                curves.append((label, points, None if simulated else m.get("expected_busbw_gbps")))
    if curves:
        parts.append("<h2>All-reduce bandwidth</h2>")
        parts.append("<figure>" + _img(figures.busbw_curves(curves), "all-reduce busbw curves") + "</figure>")

    speed = [
        ("GPUs " + ",".join(str(g) for g in s["gpus"]), (check.get("metrics") or {})["rows"])
        for s in (doc.get("probe") or {}).get("sets") or []
        for check in s.get("checks") or []
        if check.get("name") == "speed" and (check.get("metrics") or {}).get("rows")
    ]
    if speed:
        flags = [
            flag
            for s in doc["probe"]["sets"]
            for check in s.get("checks") or []
            if check.get("name") == "speed"
            for flag in (check.get("metrics") or {}).get("flags") or []
        ]
        parts.append("<h2>Is DataParallel or DDP worth it?</h2>")
        parts.append(
            "<figure>"
            + _img(figures.speed_bars(speed, simulated), "speed: one GPU, DataParallel, DDP, DDP+AMP")
            + "<figcaption>Samples per second of one GPU, DataParallel, DDP and DDP with AMP at the same "
            "global batch, with the speedup over one GPU."
            + "".join(f" <b>{_e(f)}</b>" for f in flags)
            + "</figcaption></figure>"
        )

    probe = doc.get("probe") or {}
    if probe.get("sets"):
        parts.append("<h2>Checks</h2>")
        rows, classes = [], []
        for s in probe["sets"]:
            for c in s.get("checks") or []:
                rows.append(
                    [
                        _e(",".join(str(g) for g in s["gpus"])),
                        _e(c.get("name")),
                        _e(c.get("verdict")) + (f" ({_e(c.get('kind'))})" if c.get("kind") else ""),
                        _e(c.get("detail")),
                        _e(c.get("remedy") or ""),
                    ]
                )
                classes.append(["", "", str(c.get("verdict") or ""), "", ""])
        parts.append(_table(["GPUs", "check", "verdict", "detail", "remedy"], rows, classes))

    stale = doc.get("stale") or {}
    parts.append("<h2>Processes holding GPUs</h2>")
    if stale.get("holders"):
        rows = [
            [
                _e(h.get("pid")),
                _e(h.get("user")),
                _e(
                    " ".join(h.get("command") or [])
                    if isinstance(h.get("command"), list)
                    else h.get("command")
                ),
                holder_state(h),
                _e(holder_why(h)),
            ]
            for h in stale["holders"]
        ]
        parts.append(_table(["pid", "user", "command", "state", "reasons"], rows))
    else:
        parts.append(f"<p>{_e(stale.get('note') or 'No process holds a GPU device file.')}</p>")

    body = "\n".join(parts)
    # The onload marker lets a headless browser test confirm every picture decoded to a real image.
    script = (
        "<script>window.addEventListener('load', function () {"
        "var ok = Array.prototype.filter.call(document.images, function (i) {"
        "return i.complete && i.naturalWidth > 0; }).length;"
        "document.body.setAttribute('data-images-loaded', String(ok)); });</script>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{_CSS}</style>{script}</head>\n"
        f'<body data-images-total="{body.count("<img ")}">\n{body}\n</body></html>\n'
    )
