"""A finished probe as data: the gputopo/probe/v1 JSON document, nccl-tests-style text tables, Markdown.

Pure: ``ProbeRun`` in, dicts and strings out. The terminal view (``gputopo.ui.probe_view``) and the
report writer (``gputopo.report``) both use these, so the report says what the screen said.
"""

from __future__ import annotations

from typing import Any

from gputopo import __version__
from gputopo.probe.runner import ProbeRun
from gputopo.probe.verdict import FAIL, CheckResult, SetResult

SCHEMA = "gputopo/probe/v1"


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
    }


def to_document(run: ProbeRun, report: dict[str, str] | None = None) -> dict[str, Any]:
    """The gputopo/probe/v1 document (``report`` holds the written files' paths, when there are any)."""
    return {
        "schema": SCHEMA,
        "gputopo_version": __version__,
        "device": run.config.device,
        "verdict": run.verdict,
        "sets": [s.to_dict() for s in run.sets],
        "report": report,
        "started_utc": run.started_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wall_s": round(run.wall_s, 3),
        "config": config_dict(run),
        "environment": run.environment,
        "launches": list(run.launches),
        "notes": list(run.notes),
        "warnings": list(run.warnings),
    }


# --- nccl-tests-style text tables -----------------------------------------------------------------------


def _device_lines(run: ProbeRun, gpus: tuple[int, ...]) -> list[str]:
    devices = {d.get("index"): d for d in run.environment.get("devices", [])}
    lines = []
    for rank, index in enumerate(gpus):
        d = devices.get(index, {})
        name = d.get("name") or ("CPU stand-in" if run.config.device == "cpu" else "GPU")
        bus = d.get("pci_bus_id")
        lines.append(f"#  rank {rank:2d}: {run.config.device} {index} {name}" + (f" [{bus}]" if bus else ""))
    return lines


def allreduce_table(run: ProbeRun, gpus: tuple[int, ...], check: CheckResult) -> list[str]:
    """The all-reduce sweep as nccl-tests prints it: ``#`` header lines, a units row, a row per size."""
    m = check.metrics
    env = run.environment
    versions = f"torch {env.get('torch')}" + (f", NCCL {env['nccl']}" if env.get("nccl") else "")
    lines = [
        f"# all-reduce, set {set_label(gpus)}: {m.get('ranks')} ranks, {run.config.backend}, "
        f"{m.get('dtype')} sum, "
        f"{m.get('warmup_iters')} warm-up + {m.get('timed_iters')} timed iterations ({versions})",
        *_device_lines(run, gpus),
        "#",
        f"# {'size':>12} {'count':>12} {'type':>6} {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}",
        f"# {'(B)':>12} {'(elements)':>12} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}",
    ]
    for r in m.get("rows", []):
        lines.append(
            f"  {r['bytes']:>12} {r['count']:>12} {'float':>6} {r['time_us']:>10.1f} "
            f"{r['algbw_gbps']:>8.2f} {r['busbw_gbps']:>8.2f} {r['wrong']:>7}"
        )
    peak, expected = m.get("peak_busbw_gbps"), m.get("expected_busbw_gbps")
    model = f"{expected:.2f} GB/s" if expected is not None else "n/a"
    lines.append(
        f"# Peak bus bandwidth: {peak:.2f} GB/s; model estimate: {model}"
        if peak is not None
        else "# no sizes"
    )
    lines.append(f"# {check.verdict.upper()}: {check.detail}")
    return lines


def p2p_table(gpus: tuple[int, ...], check: CheckResult) -> list[str]:
    """Each ordered pair: what CUDA and NVML claim beside what the copies did."""
    m = check.metrics
    lines = [
        f"# p2p, set {set_label(gpus)}: random pattern of {m.get('bytes', 0) >> 20} MiB copied i->j->i, "
        "compared "
        "exactly through host memory",
        f"# {'src':>4} {'dst':>4} {'can_access':>10} {'nvml_read':>9} {'wrong_there':>11} {'wrong_back':>10} "
        f"{'copy':>8}",
        f"# {'':>4} {'':>4} {'':>10} {'':>9} {'(B)':>11} {'(B)':>10} {'(GB/s)':>8}",
    ]
    for p in m.get("pairs", []):
        nvml = p.get("nvml_p2p_read") or "n/a"
        lines.append(
            f"  {p['src']:>4} {p['dst']:>4} {str(p['can_access_peer']):>10} {nvml:>9} "
            f"{p['wrong_bytes_there']:>11} "
            f"{p['wrong_bytes_roundtrip']:>10} {p['gbps']:>8.2f}"
        )
    lines.append(f"# {check.verdict.upper()}: {check.detail}")
    return lines


def loss_table(gpus: tuple[int, ...], check: CheckResult) -> list[str]:
    """Step by step: both reference runs, the probe's loss and its gap to reference run 1."""
    m = check.metrics
    what = "DataParallel" if check.name.partition("@")[0] == "dp" else "DDP"
    precision = f" at {m['precision']}" if m.get("precision", "fp32") != "fp32" else ""
    lines = [
        f"# {check.name}, set {set_label(gpus)}: {what}{precision} loss vs the single-device reference "
        f"(noise floor {m.get('noise_floor', 0):.3g})",
        f"# {'step':>5} {'reference':>12} {'reference2':>12} {check.name:>12} {'gap':>10}",
    ]
    for step, (ref, ref2, loss) in enumerate(
        zip(m.get("ref_losses", []), m.get("ref2_losses", []), m.get("losses", []), strict=False)
    ):
        lines.append(f"  {step:>5} {ref:>12.6g} {ref2:>12.6g} {loss:>12.6g} {abs(loss - ref):>10.3g}")
    lines.append(f"# {check.verdict.upper()}: {check.detail}")
    return lines


def check_table(run: ProbeRun, gpus: tuple[int, ...], check: CheckResult) -> list[str]:
    """The detailed table of a check that ran, or nothing."""
    if check.verdict == "skipped" or check.kind in ("hung", "crashed"):
        return []
    if check.name == "allreduce":
        return allreduce_table(run, gpus, check)
    if check.name == "p2p":
        return p2p_table(gpus, check)
    if check.name == "speed":
        from gputopo.probe.speed import speed_table

        return [
            *speed_table(gpus, check.metrics, run.config.device),
            f"# {check.verdict.upper()}: {check.detail}",
        ]
    return loss_table(gpus, check)


# --- Markdown ---------------------------------------------------------------------------------------


def _md_cell(text: Any) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ")


def to_markdown(run: ProbeRun) -> str:
    """The human report: verdicts and remedies first, then environment, options and every measurement."""
    c = run.config
    out = [
        f"# gputopo probe: {run.verdict.upper()}",
        "",
        f"- started (UTC): {run.started_utc.strftime('%Y-%m-%d %H:%M:%S')}, wall time {run.wall_s:.1f} s",
        f"- device: {c.device} ({c.backend}), model {c.model}, {c.steps} steps, "
        f"batch {c.batch_size} per GPU, "
        f"lr {c.lr:g}, seed {c.seed}, timeout {c.timeout_s:g} s",
    ]
    out += [f"- note: {n}" for n in run.notes]
    out += [f"- warning about the topology: {w}" for w in run.warnings]
    out += ["", "## Verdicts", "", "| set | check | verdict | kind | detail |", "|---|---|---|---|---|"]
    for s in run.sets:
        for chk in s.checks:
            out.append(
                f"| {set_label(s.gpus)} | {chk.name} | {chk.verdict} | {_md_cell(chk.kind)} "
                f"| {_md_cell(chk.detail)} |"
            )
    failures = [(s, chk) for s in run.sets for chk in s.checks if chk.verdict == FAIL]
    if failures:
        out += ["", "## What to do", ""]
        for s, chk in failures:
            out.append(f"- **set {set_label(s.gpus)}, {chk.name} ({chk.kind})**: {chk.remedy}")
            tail = chk.metrics.get("stderr_tail")
            if tail:
                out += ["", "  ```", *[f"  {line}" for line in tail.splitlines()], "  ```"]
    out += ["", "## Environment", "", "| key | value |", "|---|---|"]
    for key, value in run.environment.items():
        if key not in ("devices", "gpus"):
            out.append(f"| {key} | {_md_cell(value)} |")
    devices = run.environment.get("devices") or []
    if devices:
        out += ["", "| index | name | PCI bus id |", "|---|---|---|"]
        out += [
            f"| {d.get('index')} | {_md_cell(d.get('name'))} | {_md_cell(d.get('pci_bus_id'))} |"
            for d in devices
        ]
    out += ["", "## Measurements", ""]
    for s in run.sets:
        out += [f"### Set {set_label(s.gpus)}: {s.verdict}", ""]
        for chk in s.checks:
            table = check_table(run, s.gpus, chk)
            if table:
                out += ["```", *table, "```", ""]
    return "\n".join(out).rstrip() + "\n"


def failed_sets(sets: tuple[SetResult, ...]) -> list[SetResult]:
    """The sets with at least one failed check."""
    return [s for s in sets if s.verdict == FAIL]
