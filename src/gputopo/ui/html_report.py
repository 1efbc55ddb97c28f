"""The doctor and probe reports as self-contained HTML files: verdict, pictures (embedded PNGs), tables.

Built only from the report's JSON document, so ``gputopo report PATH --html`` can redraw a saved
report on another machine.
"""

from __future__ import annotations

import base64
import html
from typing import Any

from gputopo.topology import snapshot
from gputopo.ui import figures
from gputopo.ui.doctor_markdown import holder_state, holder_why, other_findings
from gputopo.ui.findings_view import findings_html, not_checked_lines
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
    health = doc.get("health")
    if health:
        parts.append("<h2>Health</h2>")
        parts.append(f"<p>{_e(health.get('reason') or 'health: not checked')}</p>")
        if health.get("findings"):
            parts.append(findings_html(health["findings"]))
        skipped = not_checked_lines(health.get("not_checked") or ())
        if skipped:
            parts.append("<p>Not checked:</p><ul>" + "".join(f"<li>{_e(x)}</li>" for x in skipped) + "</ul>")
    if doc.get("warnings"):
        parts.append("<h2>Warnings about the input</h2>")
        parts.append("<ul>" + "".join(f"<li>{_e(w)}</li>" for w in doc["warnings"]) + "</ul>")

    findings = other_findings(doc)
    if findings:
        parts.append("<h2>Problems and remedies</h2>")  # the name the headline gives it
        parts.append(findings_html(findings))

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

    parts += per_gpu_html((doc.get("probe") or {}).get("per_gpu"))
    parts += speed_section((doc.get("probe") or {}).get("sets") or [], simulated)

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

    parts += nodes_section(doc)
    return _page(title, parts)


def _page(title: str, parts: list[str]) -> str:
    """One self-contained page around ``parts``: the frame of the doctor's and the probe's reports."""
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


_PROBE_BANNER = {"pass": "healthy", "fail": "problems"}


def speed_section(sets: list[dict[str, Any]], stand_ins: bool) -> list[str]:
    """The speed checks' rows as a bar chart (one panel per set), with their flags; nothing without one."""
    speed = [
        (
            "GPUs " + ",".join(str(g) for g in s["gpus"]),
            check["metrics"]["rows"],
            check["metrics"].get("flags"),
        )
        for s in sets
        for check in s.get("checks") or []
        if check.get("name") == "speed" and (check.get("metrics") or {}).get("rows")
    ]
    if not speed:
        return []
    flags = [flag for _, _, set_flags in speed for flag in set_flags or []]
    return [
        "<h2>Is DataParallel or DDP worth it?</h2>",
        "<figure>"
        + _img(
            figures.speed_bars([(label, rows) for label, rows, _ in speed], stand_ins),
            "speed: one GPU, DataParallel, DDP, DDP+AMP",
        )
        + "<figcaption>Samples per second of one GPU, DataParallel, DDP and DDP with AMP at the same "
        "global batch, with the speedup over one GPU."
        + "".join(f" <b>{_e(f)}</b>" for f in flags)
        + "</figcaption></figure>",
    ]


def per_gpu_html(per_gpu: dict[str, Any] | None) -> list[str]:
    """The per-GPU check (``per_gpu`` of a probe document): a bar per GPU for each number, and the table
    of numbers beside the median of its peers and the model's datasheet peak; nothing without one."""
    rows = [r for r in (per_gpu or {}).get("gpus") or [] if isinstance(r.get("matmul_tflops"), (int, float))]
    if not rows:
        return []
    stand_ins = bool((per_gpu or {}).get("simulated"))
    tolerance = (per_gpu or {}).get("tolerance")
    table_rows, classes = [], []
    for r in (per_gpu or {}).get("gpus") or []:
        med = r.get("peers_median") or {}
        peak = r.get("peak") or {}

        def cell(key: str, r: dict[str, Any] = r, med: dict[str, Any] = med) -> str:
            value, ref = r.get(key), med.get(key)
            if not isinstance(value, (int, float)):
                return "-"
            return f"{value:.4g}" + (f" (peers {ref:.4g})" if isinstance(ref, (int, float)) else "")

        table_rows.append(
            [
                _e(f"GPU{r.get('gpu')}"),
                _e(r.get("name")),
                _e(cell("matmul_tflops")) + (f" / peak {_e(peak['matmul_tflops'])}" if peak else ""),
                _e(cell("memory_gbps")) + (f" / peak {_e(peak['memory_gbps'])}" if peak else ""),
                _e(cell("h2d_gbps")),
                _e(cell("d2h_gbps")),
                f"<code>{_e(r.get('result_hash'))}</code>",
                _e(r.get("verdict")) + (f": {_e(r.get('why'))}" if r.get("why") else ""),
            ]
        )
        verdict = str(r.get("verdict"))
        classes.append(["", "", "", "", "", "", "", "pass" if verdict == "pass" else "fail"])
    slow = f"more than {tolerance:.0%} below" if isinstance(tolerance, (int, float)) else "below"
    return [
        "<h2>Every GPU on its own</h2>",
        "<figure>"
        + _img(figures.gpu_bars(rows, stand_ins), "per-GPU matmul, memory and host copy bars")
        + f"<figcaption>A GPU is slow {slow} the median of its peers of the same model (dashed: the "
        "median of all of them), or below half its datasheet peak (dotted, where known); corrupt when its "
        "result's bits differ from the majority or from its own second run."
        + (" CPU stand-ins: a CPU's numbers, not a GPU's." if stand_ins else "")
        + "</figcaption></figure>",
        _table(
            [
                "GPU",
                "model",
                "matmul TFLOP/s",
                "memory GB/s",
                "host to device GB/s",
                "device to host GB/s",
                "result hash",
                "verdict",
            ],
            table_rows,
            classes,
        ),
    ]


def render_probe_html(doc: dict[str, Any]) -> str:
    """The whole report page for a ``gputopo/probe/v1`` document: verdict and caveats, the checks, the
    p2p matrix beside the model's estimate, the all-reduce curves, NCCL transports, environment."""
    from gputopo.probe.judge.environment import describe_transports
    from gputopo.probe.judge.p2p import p2p_matrices
    from gputopo.probe.report.document import (
        env_value,
        numerics_text,
        set_label,
        set_tables,
        set_transports,
        variable_value,
        verdict_line,
    )

    cpu = doc.get("device") == "cpu"
    env = doc.get("environment") or {}
    title = "gputopo probe"
    parts = [f"<h1>{_e(title)}</h1>"]
    parts.append(
        f'<p class="sub">{_e(doc.get("started_utc"))} &middot; device: {_e(doc.get("device"))} &middot; '
        f"host: {_e(env.get('hostname'))} &middot; gputopo {_e(doc.get('gputopo_version'))}</p>"
    )
    if cpu:
        parts.append(
            '<div class="banner simulated">CPU ranks stood in for the GPUs (gloo): the checks ran, but '
            "bandwidths and timings are not a GPU's.</div>"
        )
    verdict = str(doc.get("verdict", ""))
    parts.append(
        f'<div class="banner {_PROBE_BANNER.get(verdict, "problems")}">{_e(verdict_line(doc))}</div>'
    )
    warnings = doc.get("warnings") or []
    if warnings:
        parts.append(
            "<h2>Warnings about the topology</h2><ul>"
            + "".join(f"<li>{_e(w)}</li>" for w in warnings)
            + "</ul>"
        )
    caveats = doc.get("caveats") or []
    if caveats:
        parts.append(
            "<h2>Not tested in this run</h2><ul>" + "".join(f"<li>{_e(c)}</li>" for c in caveats) + "</ul>"
        )

    rows, classes = [], []
    for s in doc.get("sets") or []:
        for c in s.get("checks") or []:
            rows.append(
                [
                    _e(set_label(s["gpus"])),
                    _e(c.get("name")),
                    _e(c.get("verdict")) + (f" ({_e(c.get('kind'))})" if c.get("kind") else ""),
                    _e(c.get("detail")),
                    _e(c.get("remedy") or ""),
                ]
            )
            classes.append(["", "", str(c.get("verdict") or ""), "", ""])
    parts.append("<h2>Checks</h2>")
    parts.append(_table(["GPUs", "check", "verdict", "detail", "remedy"], rows, classes))

    for s in doc.get("sets") or []:
        for c in s.get("checks") or []:
            m = c.get("metrics") or {}
            if c.get("name") != "p2p" or not m.get("pairs") or "unidir_gbps" not in m["pairs"][0]:
                continue
            mat = m.get("matrix") or p2p_matrices(m)
            fails = [
                [
                    "FAIL" if (w or 0) > 0 else ("*" if p == "staged" else "")
                    for w, p in zip(wr, pr, strict=True)
                ]
                for wr, pr in zip(mat["wrong_bytes"], mat["path"], strict=True)
            ]
            panels = [("measured one way (GB/s)", mat["unidir_gbps"], fails)]
            if any(v for row in mat.get("expected_gbps") or [] for v in row):
                panels.append(("model estimate (GB/s)", mat["expected_gbps"], None))
            panels.append(("measured both ways (GB/s)", mat["bidir_gbps"], fails))
            parts.append(f"<h2>Peer-to-peer copies, set {_e(set_label(s['gpus']))}</h2>")
            parts.append(
                "<figure>"
                + _img(
                    figures.matrix_heatmaps(mat["gpus"], panels, same_scale=not cpu), "p2p bandwidth matrix"
                )
                + "<figcaption>Rows: source GPU; columns: destination. FAIL: a copy came back wrong; "
                "*: no peer-to-peer path, copies staged through host memory (its number is not a P2P one). "
                f"{_e(m.get('timed_copies'))} timed copies of {_e((m.get('bytes') or 0) >> 20)} MiB per "
                f"direction, timed with {_e(m.get('timing'))}.</figcaption></figure>"
            )

    curves = []
    for s in doc.get("sets") or []:
        for c in s.get("checks") or []:
            m = c.get("metrics") or {}
            if c.get("name") == "allreduce" and m.get("rows"):
                points = [(row["bytes"], row["busbw_gbps"]) for row in m["rows"]]
                curves.append(
                    ("GPUs " + set_label(s["gpus"]), points, None if cpu else m.get("expected_busbw_gbps"))
                )
    if curves:
        parts.append("<h2>All-reduce bandwidth</h2>")
        parts.append("<figure>" + _img(figures.busbw_curves(curves), "all-reduce busbw curves") + "</figure>")

    parts += per_gpu_html(doc.get("per_gpu"))
    parts += speed_section(doc.get("sets") or [], cpu)

    transports = [(s, set_transports(s)) for s in doc.get("sets") or []]
    if any(rows is not None for _, rows in transports):
        parts.append("<h2>NCCL transports</h2>")
        parts.append(
            _table(
                ["GPUs", "connections (from NCCL's INIT log)"],
                [
                    [_e(set_label(s["gpus"])), _e(describe_transports(rows))]
                    for s, rows in transports
                    if rows is not None
                ],
            )
        )

    parts += nodes_section(doc)

    parts.append("<h2>Measurements</h2>")
    for _, lines in set_tables(doc):
        parts.append(f"<pre>{_e(chr(10).join(lines))}</pre>")

    parts.append("<h2>Environment</h2>")
    parts.append(f"<p>Numerics: {_e(numerics_text(env.get('numerics')))}</p>")
    skip = ("devices", "gpus", "rank_variables", "numerics", "caveats")
    parts.append(
        _table(["key", "value"], [[_e(k), _e(env_value(k, v))] for k, v in env.items() if k not in skip])
    )
    rank_vars = env.get("rank_variables")
    if rank_vars:
        ranks = sorted(rank_vars, key=int)
        names = sorted({k for v in rank_vars.values() for k in v})
        parts.append("<h3>NCCL_* and CUDA_* variables the ranks got</h3>")
        parts.append(
            _table(
                ["variable", *[f"rank {r}" for r in ranks]],
                [[_e(n), *[_e(variable_value(rank_vars[r].get(n))) for r in ranks]] for n in names],
            )
            if names
            else "<p>None.</p>"
        )
    return _page(title + ": " + verdict_line(doc), parts)


def nodes_section(doc: dict[str, Any]) -> list[str]:
    """A multi-node run: a row per node with its verdict and what points at it, then every inter-node
    test (bus bandwidth per node pair, per rail, over all)."""
    from gputopo.probe.report.nodes import NODE_HEADER, TEST_HEADER, node_rows, test_rows

    if not doc.get("nodes"):
        return []
    section = doc.get("internode") or {}
    parts = [
        "<h2>Nodes</h2>",
        f'<p class="sub">{_e(section.get("nnodes"))} nodes, rendezvous {_e(section.get("endpoint"))} '
        f"(id {_e(section.get('rdzv_id'))}); inter-node tests: {_e(section.get('status'))}</p>",
    ]
    if section.get("message"):
        parts.append(f"<p>{_e(section['message'])}</p>")
    rows = node_rows(doc)
    parts.append(
        _table(
            NODE_HEADER, [[_e(c) for c in row] for row in rows], [["", "", "", row[3], ""] for row in rows]
        )
    )
    notes = section.get("notes") or []
    if notes:
        parts.append("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    tests = test_rows(section)
    if tests:
        parts.append("<h2>Between nodes</h2>")
        parts.append(_table(TEST_HEADER, [[_e(c) for c in row] for row in tests]))
    return parts
