"""CLI: ``gputopo run --n K [--torchrun] -- CMD ...``: choose the best free set and run CMD on it."""

from __future__ import annotations

from pathlib import Path

import typer

from gputopo.cli import app
from gputopo.cli.common import examples, guarded, options_from
from gputopo.cli.finish import Views, finish
from gputopo.cli.options import IGNORE_VISIBLE_OPTION, choice_options
from gputopo.services import run as service
from gputopo.services.recommend import Choice
from gputopo.ui.output import Output

# What the run is armed with (docs/run.md), declared apart so the command's signature reads as a list.
FLIGHT_RECORDER_OPTION = typer.Option(
    True,
    "--flight-recorder/--no-flight-recorder",
    help="Arm PyTorch's Flight Recorder (TORCH_FR_BUFFER_SIZE=2000, TORCH_NCCL_DUMP_ON_TIMEOUT=1, dumps "
    "in the run folder) so `gputopo hang RUN_FOLDER` can name a hung rank. Values you set are kept.",
)


NCCL_DIAGNOSTICS_OPTION = typer.Option(
    False,
    "--nccl-diagnostics",
    help="Set NCCL_RUN_DIAGNOSTICS=1 (NCCL >= 2.31): NCCL checks GPU peer paths at each communicator "
    "init and prints `NCCL DIAG` lines on rank 0's stdout (read them with gputopo hang --nccl-log).",
)


INSPECTOR_OPTION = typer.Option(
    False,
    "--inspector",
    help="Arm NCCL's Inspector profiler plugin (NCCL >= 2.28): one JSON line per collective per rank "
    "in RUN_FOLDER/inspector/, kernel-timed, for `gputopo slow RUN_FOLDER`. Without the plugin the "
    "job runs anyway and gputopo says how to get it.",
)


INSPECTOR_PLUGIN_OPTION = typer.Option(
    None,
    "--inspector-plugin",
    metavar="SO",
    help="The Inspector plugin to load (libnccl-profiler-inspector.so); implies --inspector. "
    "Default: found on LD_LIBRARY_PATH, the library folders or beside NCCL.",
)


CONTROL_PLANE_OPTION = typer.Option(
    True,
    "--control-plane/--no-control-plane",
    help="Run a Python script inside torch's control plane (worker_main(), one socket per rank), "
    "unchanged, so `gputopo slow --live` and `gputopo hang --live` read each rank's Flight Recorder "
    "while the job runs.",
)


RUN_DIR_OPTION = typer.Option(
    None,
    "--run-dir",
    metavar="DIR",
    help="The run folder for the dumps and the run record (default reports/run-<UTC time>); give "
    "every node of a job the same shared folder to analyse them together.",
)


@app.command(
    "run",
    context_settings={"allow_extra_args": False, "ignore_unknown_options": False},
    epilog=examples(
        "gputopo run --n 2 -- python train.py",
        "gputopo run --n 4 --torchrun -- train.py --epochs 10",
        "gputopo run --n 2 --exclude 0,1 --dry-run -- python train.py",
        "gputopo run --n 8 --torchrun --run-dir /shared/run-42 -- train.py   # dumps + run record there",
        "gputopo run --n 8 --torchrun --nccl-diagnostics -- train.py 2>&1 | tee job.log",
    ),
)
@guarded
@choice_options
def run_command(
    command: list[str] = typer.Argument(None, metavar="-- CMD ...", help="The command to run, after --."),
    n: int = typer.Option(..., "--n", "-n", help="GPUs to give the command."),
    torchrun: bool = typer.Option(
        False,
        "--torchrun",
        help="Run CMD under torchrun --nproc-per-node K (with --numa-binding node where possible).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the line instead of running it."),
    choice: Choice = None,  # type: ignore[assignment]  # the shared set-choice options (choice_options)
    ignore_visible: bool = IGNORE_VISIBLE_OPTION,
    json_out: bool = typer.Option(
        False, "--json", help="With --dry-run: print the launch as one JSON document."
    ),
    flight_recorder: bool = FLIGHT_RECORDER_OPTION,
    nccl_diagnostics: bool = NCCL_DIAGNOSTICS_OPTION,
    inspector: bool = INSPECTOR_OPTION,
    inspector_plugin: Path | None = INSPECTOR_PLUGIN_OPTION,
    control_plane: bool = CONTROL_PLANE_OPTION,
    run_dir: Path | None = RUN_DIR_OPTION,
) -> None:
    """Choose the best free GPU set (as recommend does) and run CMD on it, passing its exit code through."""
    options = options_from(service.Options, locals(), command=tuple(command or ()))
    out = Output(json_mode=json_out)
    hooks = service.Hooks(warn=out.warn, hint=out.hint, say=lambda line: _say(out, line))
    report = service.plan(options, hooks)
    if json_out:
        finish(out, report, Views(), kind="run", json_out=True)
    for note in report.plan.notes:
        out.hint(note)
    if dry_run:
        out.line(report.plan.command)
        return
    raise typer.Exit(service.launch(report, options, hooks))


def _say(out: Output, line: str) -> None:
    """One ``gputopo run: ...`` line on stderr, whole (never wrapped: it names paths to paste)."""
    out.err.print(f"gputopo run: {line}", markup=False, highlight=False, soft_wrap=True)
