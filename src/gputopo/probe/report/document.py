"""A finished probe as data: the gputopo/probe/v1 JSON document, nccl-tests-style text tables, Markdown.

Pure. ``to_document`` turns a ``ProbeRun`` into the document; everything else reads only the document,
so the terminal view (``gputopo.ui.probe_view``), the Markdown and HTML reports, and ``gputopo report``
on a saved JSON file all say the same thing.
"""

from __future__ import annotations

from typing import Any

from gputopo import __version__
from gputopo.probe.judge.environment import describe_transports
from gputopo.probe.judge.p2p import p2p_matrices
from gputopo.probe.judge.pergpu import per_gpu_section
from gputopo.probe.judge.verdict import FAIL, SKIPPED, SetResult
from gputopo.probe.shared import ProbeRun

SCHEMA = "gputopo/probe/v1"
SRC_DST = "src\\dst"


def set_label(gpus: tuple[int, ...] | list[int]) -> str:
    """``(5, 6)`` -> ``"5,6"``."""
    return ",".join(str(g) for g in gpus)


def config_dict(run: ProbeRun) -> dict[str, Any]:
    """The options the run used, as JSON."""
    c = run.config
    return {
        "device": c.device,
        "backend": c.backend,
        "sets": [list(s) for s in c.sets],
        "each_pair": c.each_pair,
        "checks": list(c.checks),
        "model": c.model,
        "batch_size_per_gpu": c.batch_size,
        "steps": c.steps,
        "lr": c.lr,
        "seed": c.seed,
        "timeout_s": c.timeout_s,
        "inject": c.inject.value if c.inject else None,
        "inject_rank": c.inject_rank,
        "sweep_bytes": list(c.sweep_bytes),
        "topology_input": c.topology_input,
        "precisions": list(c.precisions),
        "tolerance": c.per_gpu_tolerance,
        "inject_gpus": list(c.inject_gpus),
    }


def machine_of(run: ProbeRun) -> dict[str, Any]:
    """The machine the run probed (``topology.identity``): GPUs by NVML UUID on ``cuda``; on CPU
    stand-ins the sample or file the run stood in for (``--input``), if any."""
    import platform

    from gputopo.topology.identity import LIVE_SOURCE, machine_record

    c = run.config
    host = run.environment.get("hostname") or platform.node()
    if c.device == "cuda":
        uuids = {g.index: g.uuid for g in c.inventory.identities}
        return machine_record(host, c.device, LIVE_SOURCE, uuids)
    return machine_record(host, c.device, c.topology_input)


def to_document(run: ProbeRun, report: dict[str, str] | None = None) -> dict[str, Any]:
    """The gputopo/probe/v1 document (``report`` holds the written files' paths, when there are any).

    ``caveats`` name what the ranks' environment took out of the test (``P2P path not tested:
    NCCL_P2P_DISABLE=1``); they belong to the verdict and are shown beside it everywhere."""
    return {
        "schema": SCHEMA,
        "gputopo_version": __version__,
        "device": run.config.device,
        "machine": machine_of(run),
        "verdict": run.verdict,
        "caveats": list(run.environment.get("caveats") or []),
        "sets": [s.to_dict() for s in run.sets],
        "per_gpu": per_gpu_section(_per_gpu_check(run)),
        "report": report,
        "started_utc": run.started_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wall_s": round(run.wall_s, 3),
        "config": config_dict(run),
        "environment": run.environment,
        "launches": list(run.launches),
        "notes": list(run.notes),
        "warnings": list(run.warnings),
    }


def _per_gpu_check(run: ProbeRun) -> dict[str, Any] | None:
    """The per-GPU check of the run (``None`` when it did not run)."""
    for s in run.sets:
        for c in s.checks:
            if c.name == "gpu":
                return c.to_dict()
    return None


def verdict_line(doc: dict[str, Any]) -> str:
    """``PASS``, or ``PASS (P2P path not tested: NCCL_P2P_DISABLE=1)``: the verdict with its caveats."""
    text = str(doc.get("verdict", "")).upper()
    caveats = doc.get("caveats") or []
    return f"{text} ({'; '.join(caveats)})" if caveats else text


# --- nccl-tests-style text tables -----------------------------------------------------------------------


def _device_lines(doc: dict[str, Any], gpus: list[int]) -> list[str]:
    env = doc.get("environment") or {}
    devices = {d.get("index"): d for d in env.get("devices", [])}
    kind = doc.get("device", "")
    lines = []
    for rank, index in enumerate(gpus):
        d = devices.get(index, {})
        name = d.get("name") or ("CPU stand-in" if kind == "cpu" else "GPU")
        bus = d.get("pci_bus_id")
        lines.append(f"#  rank {rank:2d}: {kind} {index} {name}" + (f" [{bus}]" if bus else ""))
    return lines


def _backend(doc: dict[str, Any]) -> str:
    return str((doc.get("config") or {}).get("backend") or (doc.get("environment") or {}).get("backend"))


def _transport_line(m: dict[str, Any]) -> list[str]:
    rows = m.get("transports")
    return [f"# NCCL transports: {describe_transports(rows)}"] if rows is not None else []


def allreduce_table(doc: dict[str, Any], gpus: list[int], check: dict[str, Any]) -> list[str]:
    """The all-reduce sweep as nccl-tests prints it: ``#`` header lines, a units row, a row per size, and
    its closing ``# Out of bounds values`` and ``# Avg bus bandwidth`` lines."""
    m = check.get("metrics") or {}
    env = doc.get("environment") or {}
    versions = f"torch {env.get('torch')}" + (f", NCCL {env['nccl']}" if env.get("nccl") else "")
    lines = [
        f"# all-reduce, set {set_label(gpus)}: {m.get('ranks')} ranks, {_backend(doc)}, "
        f"{m.get('dtype')} sum, "
        f"{m.get('warmup_iters')} warm-up + {m.get('timed_iters')} timed iterations ({versions})",
        *_device_lines(doc, gpus),
        *_transport_line(m),
        "#",
        f"# {'size':>12} {'count':>12} {'type':>6} {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}",
        f"# {'(B)':>12} {'(elements)':>12} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}",
    ]
    rows = m.get("rows", [])
    for r in rows:
        lines.append(
            f"  {r['bytes']:>12} {r['count']:>12} {'float':>6} {r['time_us']:>10.1f} "
            f"{r['algbw_gbps']:>8.2f} {r['busbw_gbps']:>8.2f} {r['wrong']:>7}"
        )
    wrong = sum(int(r.get("wrong") or 0) for r in rows)
    lines.append(f"# Out of bounds values : {wrong} {'FAILED' if wrong else 'OK'}")
    avg = m.get("avg_busbw_gbps")
    if avg is None and rows:
        avg = sum(r["busbw_gbps"] for r in rows) / len(rows)
    if avg is not None:
        lines.append(f"# Avg bus bandwidth    : {avg:g}")  # nccl-tests' own format: %g, in GB/s
    peak, expected = m.get("peak_busbw_gbps"), m.get("expected_busbw_gbps")
    model = f"{expected:.2f} GB/s" if expected is not None else "n/a"
    lines.append(
        f"# Peak bus bandwidth   : {peak:.2f} GB/s; model estimate: {model}"
        if peak is not None
        else "# no sizes"
    )
    lines.append(f"# {str(check.get('verdict')).upper()}: {check.get('detail')}")
    return lines


def _matrix_lines(
    title: str, gpus: list[int], grid: list[list[Any]], fmt: str, mark: list[list[str]]
) -> list[str]:
    lines = [f"# {title}", "# " + f"{SRC_DST:>8}" + "".join(f"{g:>10}" for g in gpus)]
    for i, g in enumerate(gpus):
        cells = []
        for j in range(len(gpus)):
            v = grid[i][j]
            cells.append(f"{'-':>10}" if i == j or v is None else f"{format(v, fmt) + mark[i][j]:>10}")
        lines.append(f"  {g:>8}" + "".join(cells))
    return lines


def p2p_table(doc: dict[str, Any], gpus: list[int], check: dict[str, Any]) -> list[str]:
    """The pair matrix as p2pBandwidthLatencyTest prints it: one way, both ways, latency, wrong bytes;
    ``*`` marks a pair without peer access (copies staged through host memory)."""
    m = check.get("metrics") or {}
    if "unidir_gbps" not in (m.get("pairs") or [{}])[0]:
        return [f"# {str(check.get('verdict')).upper()}: {check.get('detail')}"]  # a report from before 0.2
    mat = m.get("matrix") or p2p_matrices(m)
    order = mat["gpus"]
    mark = [["*" if p == "staged" else "" for p in row] for row in mat["path"]]
    size = m.get("bytes", 0)
    lines = [
        f"# p2p, set {set_label(gpus)}: {size >> 20} MiB per copy, {m.get('warmup_copies')} warm-up + "
        f"{m.get('timed_copies')} timed copies per direction, timed with {m.get('timing')}; "
        f"{m.get('check')}",
        *_matrix_lines("unidirectional bandwidth (GB/s)", order, mat["unidir_gbps"], ".2f", mark),
        *_matrix_lines(
            "bidirectional bandwidth (GB/s, both directions together)", order, mat["bidir_gbps"], ".2f", mark
        ),
        *_matrix_lines(
            f"latency of a {m.get('latency_bytes')} B torch copy_ (us, with torch's stream barrier)",
            order,
            mat["latency_us"],
            ".2f",
            mark,
        ),
        *_matrix_lines("wrong bytes (there + round trip + both ways)", order, mat["wrong_bytes"], "d", mark),
    ]
    if any(any(row) for row in mat.get("expected_gbps") or []):
        lines += _matrix_lines("model estimate, one way (GB/s)", order, mat["expected_gbps"], ".2f", mark)
    staged = [p for p in m.get("pairs", []) if p.get("path") == "staged"]
    if staged:
        lines.append(
            "# * no peer-to-peer path: copies staged through host memory: "
            + ", ".join(
                f"{p['src']}->{p['dst']} (NVML P2P read {p.get('nvml_p2p_read') or 'n/a'})" for p in staged
            )
        )
    nvml = {p.get("nvml_p2p_read") for p in m.get("pairs", [])} - {None}
    if nvml and not staged:
        lines.append(f"# NVML P2P read status of these pairs: {', '.join(sorted(nvml))}")
    lines.append(f"# {str(check.get('verdict')).upper()}: {check.get('detail')}")
    return lines


def loss_table(gpus: list[int], check: dict[str, Any]) -> list[str]:
    """Step by step: both reference runs, the probe's loss and its gap to reference run 1."""
    m = check.get("metrics") or {}
    name = check.get("name")
    what = "DataParallel" if str(name).partition("@")[0] == "dp" else "DDP"
    precision = f" at {m['precision']}" if m.get("precision", "fp32") != "fp32" else ""
    lines = [
        f"# {name}, set {set_label(gpus)}: {what}{precision} loss vs the single-device reference "
        + (
            f"(noise floor {m.get('noise_floor', 0):.3g})"
            if m.get("ref2_run", True)
            else "(every step within the fixed tolerance: the second reference run was not needed)"
        ),
        *_transport_line(m),
        f"# {'step':>5} {'reference':>12} {'reference2':>12} {name:>12} {'gap':>10}",
    ]
    refs2 = m.get("ref2_losses") or []
    for step, (ref, loss) in enumerate(zip(m.get("ref_losses", []), m.get("losses", []), strict=False)):
        ref2 = f"{refs2[step]:>12.6g}" if step < len(refs2) else f"{'-':>12}"
        lines.append(f"  {step:>5} {ref:>12.6g} {ref2} {loss:>12.6g} {abs(loss - ref):>10.3g}")
    lines.append(f"# {str(check.get('verdict')).upper()}: {check.get('detail')}")
    return lines


def gpu_table(gpus: list[int], check: dict[str, Any]) -> list[str]:
    """Every GPU on its own: its four numbers and result hash beside the median and the datasheet peak."""
    from gputopo.probe.judge.pergpu import METRICS

    m = check.get("metrics") or {}
    rows = m.get("rows") or []
    z = m.get("sizes") or {}
    stand_in = m.get("device") == "cpu"
    tolerance = m.get("tolerance")
    lines = [
        f"# gpu, set {set_label(gpus)}: every {'CPU stand-in' if stand_in else 'GPU'} on its own; "
        f"{m.get('precision')} matmul {z.get('matmul_n')}^2 x{z.get('matmuls_per_rep')} per rep, "
        f"{(z.get('copy_bytes') or 0) >> 20} MiB device copies, {(z.get('host_bytes') or 0) >> 20} MiB "
        f"{'host' if stand_in else 'pinned host'} copies; {z.get('warmup_reps')} warm-up + "
        f"{z.get('timed_reps')} timed reps, {'fastest' if stand_in else 'median'}; {m.get('concurrent')}",
        f"# slow: more than {tolerance:.0%} below the median of its peers of the same model, by a gap "
        f"at least {m.get('noise_margin') or 2:g} times this machine's noise, every run below every peer's"
        + ("" if stand_in else "; or below its model's floor (the floor row, where the model is known)")
        if isinstance(tolerance, (int, float))
        else "# slow: below the median of its peers",
        f"# {'gpu':>5} {'matmul':>10} {'memory':>10} {'h2d':>9} {'d2h':>9}  {'result hash':<17} verdict",
        f"# {'':>5} {'(TFLOP/s)':>10} {'(GB/s)':>10} {'(GB/s)':>9} {'(GB/s)':>9}",
    ]

    def cells(values: list[Any]) -> str:
        widths = (10, 10, 9, 9)
        return " ".join(
            f"{v:>{w}.4g}" if isinstance(v, (int, float)) else f"{'-':>{w}}"
            for v, w in zip(values, widths, strict=True)
        )

    for r in rows:
        digest = str(r.get("result_hash") or "-")
        why = f": {r['why']}" if r.get("why") and r.get("verdict") != "pass" else ""
        lines.append(
            f"  {r.get('gpu'):>5} {cells([r.get(k) for k in METRICS])}  {digest:<17} {r.get('verdict')}{why}"
        )
    measured = [r for r in rows if isinstance(r.get("matmul_tflops"), (int, float))]
    for name in dict.fromkeys(str(r.get("name")) for r in measured):
        same = [r for r in measured if str(r.get("name")) == name]
        medians = [_median_of([r.get(k) for r in same]) for k in METRICS]
        lines.append(f"  {'median':>5} {cells(medians)}  ({name}, {len(same)})")
        peak = same[0].get("peak")
        if peak:
            lines.append(
                f"  {'peak':>5} {cells([peak.get('matmul_tflops'), peak.get('memory_gbps'), None, None])}  "
                f"({peak.get('model')} datasheet: {peak.get('source')})"
            )
            floors = peak.get("floor") or {}
            values = [(floors.get(k) or {}).get("value") for k in ("matmul_tflops", "memory_gbps")]
            if any(v is not None for v in values):
                bases = sorted({str((floors.get(k) or {}).get("from")) for k in floors if floors.get(k)})
                lines.append(
                    f"  {'floor':>5} {cells([*values, None, None])}  "
                    f"(below it a GPU is slow; from the {' and '.join(bases)} figure(s))"
                )
    noise = next((r.get("noise") for r in rows if isinstance(r.get("noise"), dict)), None)
    if noise:
        spreads = ", ".join(f"{k.split('_')[0]} {v:.0%}" for k, v in noise.items() if isinstance(v, float))
        lines.append(f"# this machine's noise (the largest spread of one GPU's own runs): {spreads}")
    if stand_in:
        lines.append("# simulated: CPU stand-ins, timed in process CPU time; a CPU's numbers, not a GPU's")
    lines.append(f"# {str(check.get('verdict')).upper()}: {check.get('detail')}")
    return lines


def _median_of(values: list[Any]) -> float | None:
    import statistics

    numbers = [float(v) for v in values if isinstance(v, (int, float))]
    return statistics.median(numbers) if numbers else None


def check_table(doc: dict[str, Any], gpus: list[int], check: dict[str, Any]) -> list[str]:
    """The detailed table of a check that ran, or nothing."""
    if check.get("kind") in ("hung", "crashed"):
        return []
    name = check.get("name")
    if name == "gpu":
        return gpu_table(gpus, check)
    if check.get("verdict") == SKIPPED and not (name == "p2p" and (check.get("metrics") or {}).get("pairs")):
        return []
    if name == "allreduce":
        return allreduce_table(doc, gpus, check)
    if name == "p2p":
        return p2p_table(doc, gpus, check)
    if name == "speed":
        from gputopo.probe.judge.speed import speed_table

        return [
            *speed_table(tuple(gpus), check.get("metrics") or {}, doc.get("device", "cpu")),
            f"# {str(check.get('verdict')).upper()}: {check.get('detail')}",
        ]
    return loss_table(gpus, check)


def set_tables(doc: dict[str, Any]) -> list[tuple[list[int], list[str]]]:
    """Every table of the document, with its set, in report order."""
    out = []
    for s in doc.get("sets") or []:
        for chk in s.get("checks") or []:
            lines = check_table(doc, s["gpus"], chk)
            if lines:
                out.append((s["gpus"], lines))
    return out


def set_transports(s: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The NCCL connections logged for a set (from its last NCCL check), or ``None`` when none were."""
    found = None
    for chk in s.get("checks") or []:
        rows = (chk.get("metrics") or {}).get("transports")
        if rows is not None:
            found = rows
    return found


# --- Markdown ---------------------------------------------------------------------------------------


def _md_cell(text: Any) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ")


def env_value(key: str, value: Any) -> str:
    """An environment entry as the reports show it: ``NAME=value`` lists for variable maps."""
    if key == "set_by_probe" and isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "nothing"
    return str(value if value is not None else "")


def variable_value(value: str | None) -> str:
    """A variable's value in the per-rank table: unset and empty are told apart."""
    if value is None:
        return "(unset)"
    return value if value != "" else "(empty)"


def numerics_text(numerics: dict[str, Any] | None) -> str:
    """How the ranks' numerics were pinned, in one line."""
    if not numerics:
        return "not recorded"
    tf32 = numerics.get("tf32") or {}
    if tf32.get("api") == "fp32_precision":
        tf32_text = (
            f"TF32 off (fp32_precision matmul={tf32.get('matmul')}, cuDNN conv={tf32.get('cudnn_conv')})"
        )
    else:
        tf32_text = (
            f"TF32 off (allow_tf32 matmul={tf32.get('matmul_allow_tf32')}, "
            f"cuDNN={tf32.get('cudnn_allow_tf32')})"
        )
    return (
        f"deterministic algorithms {numerics.get('deterministic_algorithms')}"
        f"{' (warn only)' if numerics.get('deterministic_warn_only') else ''}, "
        f"cudnn.deterministic {numerics.get('cudnn_deterministic')}, "
        f"cudnn.benchmark {numerics.get('cudnn_benchmark')}, {tf32_text}"
    )


def to_markdown(doc: dict[str, Any]) -> str:
    """The human report: verdicts and remedies first, then environment, options and every measurement."""
    c = doc.get("config") or {}
    env = doc.get("environment") or {}
    out = [
        f"# gputopo probe: {verdict_line(doc)}",
        "",
        f"- started (UTC): {doc.get('started_utc')}, wall time {float(doc.get('wall_s') or 0):.1f} s",
        f"- device: {c.get('device')} ({c.get('backend')}), model {c.get('model')}, {c.get('steps')} steps, "
        f"batch {c.get('batch_size_per_gpu')} per GPU, "
        f"lr {c.get('lr')}, seed {c.get('seed')}, timeout {c.get('timeout_s')} s",
        f"- numerics: {numerics_text(env.get('numerics'))}",
    ]
    out += [f"- not tested: {n}" for n in doc.get("caveats") or []]
    out += [f"- note: {n}" for n in doc.get("notes") or []]
    out += [f"- warning about the topology: {w}" for w in doc.get("warnings") or []]
    out += ["", "## Verdicts", "", "| set | check | verdict | kind | detail |", "|---|---|---|---|---|"]
    for s in doc.get("sets") or []:
        for chk in s.get("checks") or []:
            out.append(
                f"| {set_label(s['gpus'])} | {chk.get('name')} | {chk.get('verdict')} "
                f"| {_md_cell(chk.get('kind'))} "
                f"| {_md_cell(chk.get('detail'))} |"
            )
    failures = [
        (s, chk) for s in doc.get("sets") or [] for chk in s.get("checks") or [] if chk.get("verdict") == FAIL
    ]
    if failures:
        out += ["", "## What to do", ""]
        for s, chk in failures:
            out.append(
                f"- **set {set_label(s['gpus'])}, {chk.get('name')} ({chk.get('kind')})**: "
                f"{chk.get('remedy')}"
            )
            tail = (chk.get("metrics") or {}).get("stderr_tail")
            if tail:
                out += ["", "  ```", *[f"  {line}" for line in tail.splitlines()], "  ```"]
    transports = [(s, set_transports(s)) for s in doc.get("sets") or []]
    if any(rows is not None for _, rows in transports):
        out += ["", "## NCCL transports (from NCCL's INIT log)", ""]
        out += [
            f"- set {set_label(s['gpus'])}: {describe_transports(rows)}"
            for s, rows in transports
            if rows is not None
        ]
    out += ["", "## Environment", "", "| key | value |", "|---|---|"]
    skip = ("devices", "gpus", "rank_variables", "numerics", "caveats")
    for key, value in env.items():
        if key not in skip:
            out.append(f"| {key} | {_md_cell(env_value(key, value))} |")
    devices = env.get("devices") or []
    if devices:
        out += ["", "| index | name | PCI bus id |", "|---|---|---|"]
        out += [
            f"| {d.get('index')} | {_md_cell(d.get('name'))} | {_md_cell(d.get('pci_bus_id'))} |"
            for d in devices
        ]
    rank_vars = env.get("rank_variables")
    if rank_vars is not None:
        out += ["", "### NCCL_* and CUDA_* variables the ranks got", ""]
        names = sorted({k for v in rank_vars.values() for k in v})
        if names:
            ranks = sorted(rank_vars, key=int)
            out += [
                "| variable | " + " | ".join(f"rank {r}" for r in ranks) + " |",
                "|---|" + "---|" * len(ranks),
            ]
            out += [
                f"| {n} | " + " | ".join(_md_cell(variable_value(rank_vars[r].get(n))) for r in ranks) + " |"
                for n in names
            ]
        else:
            out.append("None.")
    out += ["", "## Measurements", ""]
    for s in doc.get("sets") or []:
        out += [f"### Set {set_label(s['gpus'])}: {s.get('verdict')}", ""]
        for chk in s.get("checks") or []:
            table = check_table(doc, s["gpus"], chk)
            if table:
                out += ["```", *table, "```", ""]
    return "\n".join(out).rstrip() + "\n"


def failed_sets(sets: tuple[SetResult, ...]) -> list[SetResult]:
    """The sets with at least one failed check."""
    return [s for s in sets if s.verdict == FAIL]
