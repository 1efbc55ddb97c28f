"""CLI: ``gputopo check``: node health for schedulers (no torch, no GPU load, within a time budget)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, debug_enabled, examples, guarded
from gputopo.health.check import (
    DEFAULT_BUDGET_S,
    DEFAULT_MAX_AGE_S,
    DEFAULT_NVML_TIMEOUT_S,
    DEFAULT_SAMPLE_S,
    DEFAULT_SINCE,
)
from gputopo.health.node_action import DEFAULT_MAX_DRAINED
from gputopo.ui.check_view import NPD_DEFAULT_MAX_OUTPUT, CheckFormat
from gputopo.ui.output import Output

if TYPE_CHECKING:
    from gputopo.health.check import CheckResult
    from gputopo.health.state import CheckState

FORMAT_NAMES = "|".join(f.value for f in CheckFormat)
PROM_FILE = "gputopo.prom"


@app.command(
    "check",
    epilog=examples(
        "gputopo check                              # exit 0 healthy, 1 problems, 3 could not check",
        "gputopo check --expect-gpus 8 --json       # gputopo/check/v1 document",
        "gputopo check --expect-imex                # an NVL72 tray: its IMEX daemon and domain must be up",
        "gputopo check --format nagios              # GPUTOPO OK|WARNING|CRITICAL|UNKNOWN - reason",
        "gputopo check --format npd --max-output-length 200   # node-problem-detector custom plugin",
        "gputopo check --format npd --subsystem memory --state FILE   # one condition, from the last check",
        "gputopo check --textfile /var/lib/node_exporter     # writes gputopo.prom for node_exporter",
        "gputopo check --drain --resume-if-healthy  # as Slurm's HealthCheckProgram (see docs/check.md)",
        "gputopo check --save-baseline golden.json --fleet  # on a known-good node; then --baseline",
        "gputopo check --list-rules                 # every rule: limit, severity, DCGM's, remedy, source",
        "dmesg -T | gputopo check --kernel-log - --since 30m",
    ),
)
@guarded
def check_command(
    sample_s: float = typer.Option(
        DEFAULT_SAMPLE_S,
        "--sample-s",
        metavar="SECONDS",
        help="Time between the two reads of the error counters.",
    ),
    budget: float = typer.Option(
        DEFAULT_BUDGET_S,
        "--budget",
        metavar="SECONDS",
        help="End within this time (scontrol included); what was not read is reported unknown.",
    ),
    expect_gpus: int | None = typer.Option(
        None, "--expect-gpus", metavar="N", help="Fewer GPUs than N (or a broken driver) is a problem."
    ),
    expect_imex: bool = typer.Option(
        False,
        "--expect-imex",
        help="An IMEX daemon must run here (NVLink racks), even without /etc/nvidia-imex/nodes_config.cfg.",
    ),
    thresholds: Path | None = typer.Option(
        None, "--thresholds", metavar="FILE", help="Override health rules (TOML/JSON; see --list-rules)."
    ),
    xid_policy: Path | None = typer.Option(
        None,
        "--xid-policy",
        metavar="FILE",
        help="Which Xid codes are the application's (a note) and which the node's (a problem): TOML/JSON.",
    ),
    kernel_log: str | None = typer.Option(
        None,
        "--kernel-log",
        metavar="FILE|-",
        help="Read Xid lines from a saved kernel log instead of dmesg.",
    ),
    since: str = typer.Option(
        DEFAULT_SINCE, "--since", metavar="DURATION", help="Xid window: 90s, 30m, 2h, 1d."
    ),
    save_baseline: Path | None = typer.Option(
        None, "--save-baseline", metavar="FILE", help="Write this node's golden picture to FILE."
    ),
    fleet: bool = typer.Option(
        False,
        "--fleet",
        help="With --save-baseline: leave out per-GPU identities (UUID, VBIOS) for siblings.",
    ),
    baseline_file: Path | None = typer.Option(
        None, "--baseline", metavar="FILE", help="Compare this node with a saved baseline."
    ),
    drain: bool = typer.Option(
        False,
        "--drain",
        help="On problems that need it, drain this Slurm node (never a node drained by a person).",
    ),
    resume_if_healthy: bool = typer.Option(
        False, "--resume-if-healthy", help="When healthy, resume the node if gputopo drained it (never else)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="With --drain/--resume-if-healthy: print the command only."
    ),
    max_drained: str = typer.Option(
        DEFAULT_MAX_DRAINED,
        "--max-drained",
        metavar="N|N%",
        help="Drain nothing more while this many of the cluster's nodes carry a gputopo drain.",
    ),
    state_file: Path | None = typer.Option(
        None,
        "--state",
        metavar="FILE",
        help="Remember drains, acknowledgements and counters between runs (root's default with --drain: "
        "/var/lib/gputopo/check-state.json; writers take FILE.lock, a .old backup is kept).",
    ),
    fmt: str = typer.Option("text", "--format", metavar=FORMAT_NAMES, help="Output format."),
    json_out: bool = JSON_OPTION,
    max_output_length: int = typer.Option(
        NPD_DEFAULT_MAX_OUTPUT,
        "--max-output-length",
        metavar="BYTES",
        help="With --format npd: NPD's max_output_length (the line is cut to fit).",
    ),
    textfile: Path | None = typer.Option(
        None,
        "--textfile",
        metavar="DIR",
        help="Also write DIR/gputopo.prom (node_exporter's textfile collector).",
    ),
    subsystem: str | None = typer.Option(
        None,
        "--subsystem",
        metavar="NAME",
        help="With --format npd and --state: answer for one subsystem (memory, nvlink, xid, pcie, imex, "
        "driver, accept) from the last check's fresh result in the state, without reading the GPUs.",
    ),
    max_age: float = typer.Option(
        DEFAULT_MAX_AGE_S,
        "--max-age",
        metavar="SECONDS",
        help="With --subsystem: an older recorded result is unknown (exit 3).",
    ),
    nvml_timeout: float = typer.Option(
        DEFAULT_NVML_TIMEOUT_S,
        "--nvml-timeout",
        metavar="SECONDS",
        help="Seconds each GPU's NVML read may take.",
    ),
    list_rules: bool = typer.Option(
        False, "--list-rules", help="Print the rule table (with --thresholds applied; --json too) and exit."
    ),
) -> None:
    """Check this node's GPU health (ECC, row remaps, NVLink/PCIe errors, clocks, Xid, recovery action)."""
    started = time.monotonic()
    from gputopo.errors import GputopoError, UsageError
    from gputopo.health.rules import DEFAULT_THRESHOLDS, load_thresholds, load_xid_policy
    from gputopo.health.xid import parse_since

    rules = load_thresholds(thresholds) if thresholds is not None else DEFAULT_THRESHOLDS
    if xid_policy is not None:  # --xid-policy wins over an xid_policy table in the thresholds file
        from dataclasses import replace

        rules = replace(rules, xid_policy=load_xid_policy(xid_policy))
    if list_rules:
        _print_rules(rules, json_out or fmt == "json")
        raise typer.Exit(0)
    try:
        form = CheckFormat("json" if json_out else fmt)
    except ValueError:
        raise UsageError(
            f"--format {fmt}: not a format", f"one of {', '.join(f.value for f in CheckFormat)}"
        ) from None
    if subsystem is not None:
        _answer_subsystem(subsystem, form, state_file, max_age, max_output_length)
    # Every input is checked before the machine is touched: bad usage never reads, and never drains.
    from gputopo.health.node_action import parse_max_drained
    from gputopo.services.check import CheckOptions, load_baseline, run_check

    options = CheckOptions(
        sample_s=sample_s,
        budget_s=budget,
        nvml_timeout_s=nvml_timeout,
        expect_gpus=expect_gpus,
        expect_imex=expect_imex,
        thresholds=rules,
        since_s=parse_since(since),
    )
    limit = parse_max_drained(max_drained)
    if max_output_length < 1:
        raise UsageError(f"--max-output-length {max_output_length}: must be 1 or more", "NPD's default is 80")
    if textfile is not None and not textfile.is_dir():
        raise UsageError(
            f"--textfile {textfile}: not a folder", "name node_exporter's --collector.textfile.directory"
        )
    if fleet and save_baseline is None:
        raise UsageError(
            "--fleet: only with --save-baseline FILE", "gputopo check --save-baseline FILE --fleet"
        )
    saved = load_baseline(baseline_file) if baseline_file is not None else None
    if save_baseline is not None:
        from gputopo.outputs import check_output

        check_output(save_baseline, "--save-baseline", "golden.json")  # refused before anything is read
    log = None
    if kernel_log is not None:
        from gputopo.system.kernel_log import read_log_file

        log = read_log_file(kernel_log)
    from dataclasses import replace

    options = replace(options, kernel_log=log, baseline=saved, save_baseline=save_baseline, fleet=fleet)
    out = Output(json_mode=False)
    warnings: list[str] = []
    acting = drain or resume_if_healthy
    from gputopo.health.state import CheckState
    from gputopo.system.slurm_node import node_name

    node = node_name()
    state_path = _state_path(state_file, acting)
    before = _load_state(state_path, node, acting, warnings)
    state = before
    deadline = started + budget
    view = None
    now = time.time()
    if acting:
        from gputopo.health.state import took_over
        from gputopo.services.check import read_node_view

        # Read the node first (state and reason): a person's resume or drain since gputopo drained it
        # acknowledges the Xid lines up to now, before they are judged.
        # A quarter of the budget at most: a hung scontrol must leave the GPUs their time.
        view = read_node_view(started + budget / 4)
        if state is not None and view.node is not None:
            state = took_over(state, view.node.out_of_service, view.node.ours, now)
    options = replace(options, state=state)
    try:
        result = run_check(options, started)
    except GputopoError:
        raise
    except Exception as exc:
        # A bug must not read as "problems" (exit 1: node-problem-detector would mark the node, and a
        # scheduler could drain it): the check could not run, which is unknown (exit 3).
        if debug_enabled():
            raise
        from gputopo.health import check as service

        result = service.summarize(
            None, None, (), (), time.monotonic() - started, f"internal error: {type(exc).__name__}: {exc}"
        )
    from gputopo.services.check import keep_state

    # Slurm is changed, and the state saved, only under the state's lock (system.state_file).
    kept = keep_state(
        state_path,
        node,
        before or CheckState(node),
        state or CheckState(node),
        result,
        view,
        drain=drain,
        resume=resume_if_healthy,
        dry_run=dry_run,
        max_drained=limit,
        deadline=deadline,
        now=now,
        shown=tuple(warnings),
        rule_set=os.path.abspath(thresholds) if thresholds is not None else "default",
    )
    slurm = kept.slurm
    warnings += kept.warnings
    if kept.blocked is not None:
        result = _blocked(result, kept.blocked)
    from gputopo.services.check import accept_status
    from gputopo.ui.check_view import RenderContext, render, render_prometheus, slurm_lines

    ctx = RenderContext(
        slurm=slurm,
        max_output_length=max_output_length,
        now=now,
        accept=accept_status(state_path, node, result),
        acceptance=kept.acceptance,
        xid_counts=kept.xid_counts,
    )
    if textfile is not None:
        warnings += _write_textfile(textfile, render_prometheus(result, ctx).text)
    rendered = render(form, result, ctx)
    import sys

    sys.stdout.write(rendered.text)
    if (
        form == CheckFormat.TEXT
        and slurm is not None
        and slurm.command
        and not slurm.done
        and slurm.error is None
    ):
        sys.stdout.write(slurm.command + "\n")  # --dry-run: the command only
    sys.stdout.flush()
    out.warnings([*warnings, *slurm_lines(slurm)])
    raise typer.Exit(rendered.exit_code)


def _answer_subsystem(
    name: str, form: CheckFormat, state_file: Path | None, max_age: float, max_output_length: int
) -> None:
    """``--subsystem NAME``: NPD's answer for one subsystem from the state's fresh record (no GPU read:
    node-problem-detector runs one rule per condition, and only the first of an interval reads NVML)."""
    import sys

    from gputopo.errors import UsageError
    from gputopo.services.check import answer_subsystem
    from gputopo.ui.check_view import render_npd_subsystem

    if form != CheckFormat.NPD:
        raise UsageError("--subsystem: only with --format npd", "gputopo check --format npd --subsystem NAME")
    if max_output_length < 1:
        raise UsageError(f"--max-output-length {max_output_length}: must be 1 or more", "NPD's default is 80")
    res, warnings = answer_subsystem(state_file, name, time.time(), max_age)
    rendered = render_npd_subsystem(res, max_output_length)
    sys.stdout.write(rendered.text)
    sys.stdout.flush()
    Output(json_mode=False).warnings(list(warnings))
    raise typer.Exit(rendered.exit_code)


def _print_rules(rules: Any, as_json: bool) -> None:
    import sys

    from gputopo.health.xid import xid_rows
    from gputopo.ui.check_view import rules_json, rules_text, xids_text

    table = list(rules.rules.values())
    xids = xid_rows(rules.xid_policy)
    policy = rules.xid_policy
    sys.stdout.write(
        rules_json(table, xids, policy) if as_json else rules_text(table) + xids_text(xids, policy)
    )


def _state_path(path: Path | None, acting: bool) -> Path | None:
    from gputopo.services.check import default_state_path

    return path or default_state_path(acting)


def _load_state(path: Path | None, node: str, acting: bool, warnings: list[str]) -> CheckState | None:
    """check's sections of the state at ``path`` (``None``: no state); a fresh state when it is new or
    cannot be used (named in a warning). A path not to be trusted (a symbolic link; as root, another
    user's or a writable file or folder) stops the check before anything is read: exit 2, or 3 when
    acting on Slurm (a health check that cannot run)."""
    if path is None:
        return None
    from gputopo.errors import InputError, UnavailableError
    from gputopo.health.state import check_state
    from gputopo.services.check import read_state

    read = read_state(path, node)
    if read.refused is not None:
        raise (UnavailableError if acting else InputError)(read.refused, read.hint)
    warnings += read.warnings
    return check_state(read.doc, node)


def _blocked(result: CheckResult, why: str) -> CheckResult:
    """The result of a check that could not keep its state or act as asked: unknown (exit 3), saying why
    and what the check found."""
    from dataclasses import replace

    from gputopo.health.check import UNKNOWN, one_line

    return replace(
        result,
        verdict=UNKNOWN,
        reason=one_line(f"nothing done to Slurm, nothing saved: {why} (the check: {result.reason})"),
    )


def _write_textfile(folder: Path, text: str) -> list[str]:
    """``DIR/gputopo.prom`` written atomically (a temporary file in DIR and a rename): node_exporter never
    reads half a file."""
    from gputopo.errors import GputopoError
    from gputopo.report import atomic_write

    try:
        atomic_write(folder / PROM_FILE, text)
    except (OSError, GputopoError) as exc:
        why = getattr(exc, "message", None) or getattr(exc, "strerror", None) or str(exc)
        return [f"--textfile {folder}: {PROM_FILE} not written ({why})"]
    return []
