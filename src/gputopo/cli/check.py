"""CLI: ``gputopo check``: node health for schedulers (no torch, no GPU load, within a time budget)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, debug_enabled, examples, guarded
from gputopo.cli.finish import Views, show
from gputopo.services import check as service
from gputopo.services.check import (
    DEFAULT_BUDGET_S,
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_DRAINED,
    DEFAULT_NVML_TIMEOUT_S,
    DEFAULT_SAMPLE_S,
    DEFAULT_SINCE,
    NPD_DEFAULT_MAX_OUTPUT,
    Hooks,
    Options,
    RuleSet,
)
from gputopo.ui.check_view import CheckFormat
from gputopo.ui.output import Output

FORMAT_NAMES = "|".join(f.value for f in CheckFormat)


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
    rules = service.load_rules(thresholds, xid_policy)
    if list_rules:
        _print_rules(rules, json_out or fmt == "json")
    options = Options(
        output=CheckFormat.parse(fmt, json_out).value,
        sample_s=sample_s,
        budget_s=budget,
        nvml_timeout_s=nvml_timeout,
        expect_gpus=expect_gpus,
        expect_imex=expect_imex,
        rules=rules,
        since=since,
        kernel_log=kernel_log,
        save_baseline=save_baseline,
        fleet=fleet,
        baseline=baseline_file,
        drain=drain,
        resume_if_healthy=resume_if_healthy,
        dry_run=dry_run,
        max_drained=max_drained,
        state=state_file,
        max_output_length=max_output_length,
        textfile=textfile,
        subsystem=subsystem,
        max_age_s=max_age,
        debug=debug_enabled(),
    )
    _run(options)


def _run(options: Options) -> None:
    """Answer one subsystem from the state, or check this node; show it in the chosen format and exit
    with its code."""
    from gputopo.ui.check_view import (
        RenderContext,
        render,
        render_npd_subsystem,
        render_prometheus,
        slurm_lines,
    )

    out = Output(json_mode=options.output == "json")
    if options.subsystem is not None:
        answer = service.answer(options)
        rendered = render_npd_subsystem(answer.result, options.max_output_length)
        _exit(out, rendered.text, rendered.exit_code, answer.warnings)
    warnings: list[str] = []
    report = service.run(options, Hooks(warn=warnings.append))
    ctx = RenderContext.of(report, options.max_output_length)
    if options.textfile is not None:
        warnings += service.write_textfile(options.textfile, render_prometheus(report.result, ctx).text)
    warnings += slurm_lines(report.slurm)
    if options.output == "json":  # the document, as every command shows its own
        show(out, report.document(), Views(), json_out=True)
        _exit(out, "", report.exit_code, warnings)
    rendered = render(CheckFormat(options.output), report.result, ctx)
    preview = report.dry_run_line if options.output == "text" else None
    _exit(out, rendered.text + (preview + "\n" if preview else ""), rendered.exit_code, warnings)


def _exit(out: Output, text: str, code: int, warnings: list[str] | tuple[str, ...]) -> NoReturn:
    """``text`` on stdout, the warnings on stderr (each once), then exit with ``code``."""
    sys.stdout.write(text)
    sys.stdout.flush()
    out.warnings(list(warnings))
    raise typer.Exit(code)


def _print_rules(rules: RuleSet, as_json: bool) -> None:
    """``--list-rules``: the rule table (and the Xid table), then exit 0."""
    from gputopo.ui.check_view import rules_json, rules_text, xids_text

    table, xids, policy = service.rule_table(rules)
    sys.stdout.write(
        rules_json(table, xids, policy) if as_json else rules_text(table) + xids_text(xids, policy)
    )
    raise typer.Exit(0)
