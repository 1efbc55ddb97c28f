"""CLI: ``gputopo check``: node health for schedulers (no torch, no GPU load, within a time budget)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, examples, guarded
from gputopo.ui.output import Output

FORMATS = ("text", "json", "nagios")


@app.command(
    "check",
    epilog=examples(
        "gputopo check                              # exit 0 healthy, 1 problems, 3 could not check",
        "gputopo check --expect-gpus 8 --json       # gputopo/check/v1 document",
        "gputopo check --format nagios              # GPUTOPO OK|WARNING|CRITICAL|UNKNOWN - reason",
        "gputopo check --save-baseline golden.json  # on a known-good node; then --baseline golden.json",
        "dmesg -T | gputopo check --kernel-log - --since 30m",
    ),
)
@guarded
def check_command(
    sample_s: float = typer.Option(
        2.0, "--sample-s", metavar="SECONDS", help="Time between the two reads of the error counters."
    ),
    budget: float = typer.Option(
        20.0,
        "--budget",
        metavar="SECONDS",
        help="End within this time; what was not read is reported unknown.",
    ),
    expect_gpus: Optional[int] = typer.Option(  # noqa: UP045 (typer)
        None, "--expect-gpus", metavar="N", help="Fewer GPUs than N is a problem."
    ),
    thresholds: Optional[Path] = typer.Option(  # noqa: UP045 (typer)
        None, "--thresholds", metavar="FILE", help="Override health rules (TOML or JSON; see the README)."
    ),
    kernel_log: Optional[str] = typer.Option(  # noqa: UP045 (typer)
        None,
        "--kernel-log",
        metavar="FILE|-",
        help="Read Xid lines from a saved kernel log instead of dmesg.",
    ),
    since: str = typer.Option("2h", "--since", metavar="DURATION", help="Xid window: 90s, 30m, 2h, 1d."),
    save_baseline: Optional[Path] = typer.Option(  # noqa: UP045 (typer)
        None, "--save-baseline", metavar="FILE", help="Write this node's golden picture to FILE."
    ),
    baseline_file: Optional[Path] = typer.Option(  # noqa: UP045 (typer)
        None, "--baseline", metavar="FILE", help="Compare this node with a saved baseline."
    ),
    drain: bool = typer.Option(
        False, "--drain", help="On problems, drain this Slurm node (reason 'gputopo: ...')."
    ),
    resume_if_healthy: bool = typer.Option(
        False, "--resume-if-healthy", help="When healthy, resume the node if gputopo drained it (never else)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="With --drain/--resume-if-healthy: print the command only."
    ),
    fmt: str = typer.Option("text", "--format", metavar="text|json|nagios", help="Output format."),
    json_out: bool = JSON_OPTION,
    nvml_timeout: float = typer.Option(
        5.0, "--nvml-timeout", metavar="SECONDS", help="Seconds each GPU's NVML read may take."
    ),
) -> None:
    """Check this node's GPU health (ECC, row remaps, NVLink/PCIe errors, clocks, Xid, recovery action)."""
    started = time.monotonic()
    from gputopo.errors import UsageError
    from gputopo.health import check as service
    from gputopo.health.rules import DEFAULT_THRESHOLDS, load_thresholds
    from gputopo.health.xid import parse_since

    fmt = "json" if json_out else fmt
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt}: not a format", "one of text, json, nagios")
    # Every input is checked before the machine is touched: bad usage never reads, and never drains.
    service.validate_options(sample_s, budget, expect_gpus)
    if nvml_timeout <= 0:
        raise UsageError(f"--nvml-timeout {nvml_timeout:g}: must be positive", "e.g. --nvml-timeout 5")
    since_s = parse_since(since)
    rules = load_thresholds(thresholds) if thresholds is not None else DEFAULT_THRESHOLDS
    saved = _load_baseline(baseline_file) if baseline_file is not None else None
    log = None
    if kernel_log is not None:
        from gputopo.system.kernel_log import read_log_file

        log = read_log_file(kernel_log)
    deadline = started + budget
    result = _run(
        started, deadline, sample_s, nvml_timeout, expect_gpus, rules, log, since_s, saved, save_baseline
    )
    slurm = _slurm(result, drain, resume_if_healthy, dry_run)
    out = Output(json_mode=fmt == "json")
    if fmt == "json":
        doc = result.to_json()
        if slurm is not None:
            doc["slurm"] = slurm.to_json()
        out.document(doc)
        raise typer.Exit(result.exit_code)
    if fmt == "nagios":
        code, line = result.nagios()
        out.line(line)
        _say_slurm(out, slurm)
        raise typer.Exit(code)
    for line in _text_lines(result):
        out.line(line)
    if slurm is not None and slurm.command and not slurm.done and slurm.error is None:
        out.line(slurm.command)  # --dry-run: the command only
    _say_slurm(out, slurm)
    raise typer.Exit(result.exit_code)


def _slurm(result, drain: bool, resume: bool, dry_run: bool):  # type: ignore[no-untyped-def]
    """Drain on problems, resume when healthy; nothing on unknown (a check that could not run proves
    nothing) and nothing on bad input (that never gets here)."""
    if not drain and not resume:
        return None
    from gputopo.health.check import HEALTHY, PROBLEMS, one_line
    from gputopo.system import slurm_node

    if drain and result.verdict == PROBLEMS:
        return slurm_node.drain(one_line(result.reason, 120), dry_run)
    if resume and result.verdict == HEALTHY:
        return slurm_node.resume_if_ours(dry_run)
    return None


def _say_slurm(out: Output, slurm) -> None:  # type: ignore[no-untyped-def]
    if slurm is None:
        return
    if slurm.error is not None:
        out.warn(f"slurm: could not {slurm.action} this node: {slurm.error}")
    elif slurm.done:
        out.warn(f"slurm: {slurm.command}")


def _load_baseline(path: Path) -> dict:
    from gputopo.errors import InputError
    from gputopo.health import baseline

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(
            f"--baseline {path}: cannot read it ({exc.strerror or exc})", "give a file from --save-baseline"
        ) from None
    return baseline.loads(data, str(path))


def _run(started, deadline, sample_s, nvml_timeout, expect_gpus, rules, log, since_s, saved, save_to):  # type: ignore[no-untyped-def]
    from gputopo.health import check as service
    from gputopo.health.judge import NotChecked, judge
    from gputopo.health.xid import scan, xid_findings
    from gputopo.system import nvml
    from gputopo.system.health_reads import read_two_samples
    from gputopo.system.kernel_log import read_kernel_log

    sample = judgement = None
    unavailable = None
    extra, not_checked = [], []
    # A hung GPU costs one NVML deadline; keep that well inside the budget.
    per_gpu_s = min(nvml_timeout, max(0.5, (deadline - time.monotonic()) / 4))
    try:
        first, sample = read_two_samples(sample_s, timeout_s=per_gpu_s, deadline=deadline - 1.0)
        judgement = judge(first, sample, thresholds=rules, expect_gpus=expect_gpus)
    except nvml.NvmlUnavailable as exc:
        unavailable = exc.message
    if log is None:
        log = read_kernel_log(since_s, timeout_s=max(0.5, min(5.0, deadline - time.monotonic())))
    if log.text is None:
        not_checked.append(NotChecked("Xid", log.refused or "the kernel log could not be read"))
    else:
        found = scan(log.text, since_s, uptime_s=log.uptime_s)
        gpus = [(g.index, g.pci_bus_id) for g in sample.gpus] if sample is not None else []
        extra += xid_findings(found, gpus, rules)
    if saved is not None or save_to is not None:
        extra += _baseline(saved, save_to, sample, nvml_timeout)
    return service.summarize(sample, judgement, extra, not_checked, time.monotonic() - started, unavailable)


def _baseline(saved, save_to, sample, nvml_timeout):  # type: ignore[no-untyped-def]
    from gputopo.errors import InputError
    from gputopo.health import baseline
    from gputopo.system.inventory import read_live

    doc = baseline.baseline_from(read_live(nvml_timeout_s=nvml_timeout), sample)
    if save_to is not None:
        try:
            save_to.write_text(baseline.dumps(doc))
        except OSError as exc:
            raise InputError(f"--save-baseline {save_to}: cannot write it ({exc.strerror or exc})") from None
    return baseline.compare(saved, doc) if saved is not None else []


def _text_lines(result) -> list[str]:  # type: ignore[no-untyped-def]
    lines = [
        f"{result.verdict}: {result.reason}"
        if not result.reason.startswith(result.verdict)
        else result.reason
    ]
    for f in result.findings:
        lines.append(f"{f.severity.upper():8} {f.where:<10} {f.category}/{f.action}: {f.what}")
        lines.append(f"{'':8} {'':<10} -> {f.remedy}")
    for n in result.not_checked:
        lines.append(f"not checked: {n.what} ({n.why})")
    return lines
