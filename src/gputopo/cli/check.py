"""CLI: ``gputopo check``: node health for schedulers (no torch, no GPU load, within a time budget)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, debug_enabled, examples, guarded
from gputopo.ui.output import Output

if TYPE_CHECKING:
    from gputopo.health.check import CheckResult
    from gputopo.system.slurm_node import SlurmAction

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
        None, "--thresholds", metavar="FILE", help="Override health rules (TOML/JSON; docs/health-rules.md)."
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
    from gputopo.errors import GputopoError, UsageError
    from gputopo.health import check as service
    from gputopo.health.rules import DEFAULT_THRESHOLDS, load_thresholds
    from gputopo.health.xid import parse_since

    fmt = "json" if json_out else fmt
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt}: not a format", "one of text, json, nagios")
    # Every input is checked before the machine is touched: bad usage never reads, and never drains.
    service.validate_options(sample_s, budget, expect_gpus)
    if not 0 < nvml_timeout < math.inf:
        raise UsageError(f"--nvml-timeout {nvml_timeout:g}: must be positive", "e.g. --nvml-timeout 5")
    since_s = parse_since(since)
    rules = load_thresholds(thresholds) if thresholds is not None else DEFAULT_THRESHOLDS
    from gputopo.check import CheckOptions, load_baseline, run_check

    saved = load_baseline(baseline_file) if baseline_file is not None else None
    if save_baseline is not None:
        from gputopo.outputs import check_output

        check_output(save_baseline, "--save-baseline", "golden.json")  # refused before anything is read
    log = None
    if kernel_log is not None:
        from gputopo.system.kernel_log import read_log_file

        log = read_log_file(kernel_log)
    options = CheckOptions(
        sample_s, budget, nvml_timeout, expect_gpus, rules, since_s, log, saved, save_baseline
    )
    try:
        result = run_check(options, started)
    except GputopoError:
        raise
    except Exception as exc:
        # A bug must not read as "problems" (exit 1: node-problem-detector would mark the node, and a
        # scheduler could drain it): the check could not run, which is unknown (exit 3).
        if debug_enabled():
            raise
        result = service.summarize(
            None, None, (), (), time.monotonic() - started, f"internal error: {type(exc).__name__}: {exc}"
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


def _slurm(result: CheckResult, drain: bool, resume: bool, dry_run: bool) -> SlurmAction | None:
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


def _say_slurm(out: Output, slurm: SlurmAction | None) -> None:
    if slurm is None:
        return
    if slurm.error is not None:
        out.warn(f"slurm: could not {slurm.action} this node: {slurm.error}")
    elif slurm.done:
        out.warn(f"slurm: {slurm.command}")


def _text_lines(result: CheckResult) -> list[str]:
    """The reason first (what a scheduler shows), then each finding with its remedy, then what was not
    checked."""
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
