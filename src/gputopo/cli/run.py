"""CLI: ``gputopo run --n K [--torchrun] -- CMD ...``: choose the best free set and run CMD on it."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import typer

from gputopo.cli import app
from gputopo.cli.common import INPUT_HELP, INPUT_METAVAR, examples, guarded
from gputopo.cli.options import (
    ALLOW_BUSY_OPTION,
    EXCLUDE_OPTION,
    FORCE_REPORT_OPTION,
    MAX_USED_OPTION,
    REPORT_OPTION,
    check_report_machine,
    set_constraints,
)
from gputopo.errors import UnavailableError, UsageError
from gputopo.launch.line import LaunchTools
from gputopo.ui.output import Output


@app.command(
    "run",
    context_settings={"allow_extra_args": False, "ignore_unknown_options": False},
    epilog=examples(
        "gputopo run --n 2 -- python train.py",
        "gputopo run --n 4 --torchrun -- train.py --epochs 10",
        "gputopo run --n 2 --exclude 0,1 --dry-run -- python train.py",
    ),
)
@guarded
def run_command(
    command: list[str] = typer.Argument(None, metavar="-- CMD ...", help="The command to run, after --."),
    n: int = typer.Option(..., "--n", "-n", help="GPUs to give the command."),
    torchrun: bool = typer.Option(
        False,
        "--torchrun",
        help="Run CMD under torchrun --nproc-per-node K (with --numa-binding node where possible).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the line instead of running it."),
    input: str | None = typer.Option(None, "--input", "-i", metavar=INPUT_METAVAR, help=INPUT_HELP),
    exclude: str | None = EXCLUDE_OPTION,
    allow_busy: bool = ALLOW_BUSY_OPTION,
    max_used_mib: int = MAX_USED_OPTION,
    from_report: Path | None = REPORT_OPTION,
    force_report: bool = FORCE_REPORT_OPTION,
    json_out: bool = typer.Option(
        False, "--json", help="With --dry-run: print the launch as one JSON document."
    ),
) -> None:
    """Choose the best free GPU set (as recommend does) and run CMD on it, passing its exit code through."""
    from gputopo.launch.line import SCHEMA, build_launch
    from gputopo.machine import load_topology
    from gputopo.recommend import recommend

    out = Output(json_mode=json_out)
    if json_out and not dry_run:
        raise UsageError("--json goes with --dry-run", "the command's own output goes to stdout when it runs")
    if not command:
        raise UsageError("no command given", "put it after --, e.g. gputopo run --n 2 -- python train.py")
    constraints = set_constraints(n, exclude, allow_busy, max_used_mib, from_report, top=1)
    topo = load_topology(input)
    check_report_machine(constraints, topo, input is None, force_report, out.warn)
    rec = recommend(topo, constraints)
    out.warnings(rec.warnings)  # the topology's warnings too
    tools = LaunchTools(torchrun=None)
    if torchrun:
        from gputopo.system.launcher import detect_tools

        tools = detect_tools()
        if tools.torchrun is None and not dry_run:
            raise UnavailableError(
                "--torchrun: torch is not installed here", "pip install torch, or drop --torchrun"
            )
    from gputopo.launch.command import warn_nccl_env

    findings = warn_nccl_env(out.warn, [nic.name or nic.label for nic in topo.nics])
    plan = build_launch(topo, rec.best.gpus, command, torchrun=torchrun, tools=tools, prefer_uuid=True)
    if dry_run:
        if json_out:
            doc = {"schema": SCHEMA, "source": topo.source, "launch": plan.to_dict()}
            doc["findings"] = [asdict(f) for f in findings]
            doc["warnings"] = list(rec.warnings)
            out.document(doc)
            return
        for note in plan.notes:
            out.hint(note)
        out.line(plan.command)
        return
    for note in plan.notes:
        out.hint(note)
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None and inherited != plan.env["CUDA_VISIBLE_DEVICES"]:
        out.warn(
            f"CUDA_VISIBLE_DEVICES={inherited} was set (a scheduler's allocation?); it is replaced by the "
            "chosen set, so use --exclude to stay inside an allocation"
        )
    if input is not None:
        out.warn(f"the set was chosen from {topo.source}, not read from this machine")
    gpus = ",".join(str(g) for g in plan.gpus)
    out.err.print(f"gputopo run: GPUs {gpus}: {plan.command}", markup=False, highlight=False, soft_wrap=True)
    from gputopo.launch.line import merged_env
    from gputopo.system.launcher import exec_command

    exec_command(plan.argv, merged_env(os.environ, plan))
