"""CLI: ``gputopo kill-stale``: the processes holding GPUs, which are stale and why; stops them on --yes."""

from __future__ import annotations

import sys
from collections.abc import Callable

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, examples, guarded
from gputopo.errors import CheckFailed
from gputopo.services import stale as service
from gputopo.services.stale import DEFAULT_GRACE_S, StaleRun
from gputopo.ui.output import Output


@app.command(
    "kill-stale",
    epilog=examples(
        "gputopo kill-stale                      # dry run: who holds the GPUs, which are stale and why",
        "gputopo kill-stale --yes                # stop the stale ones (SIGTERM, grace, SIGKILL)",
        "gputopo kill-stale --gpus 5,6 --older-than 10m --yes",
    ),
)
@guarded
def kill_stale_command(
    yes: bool = typer.Option(False, "--yes", "-y", help="Stop the targeted processes (default: dry run)."),
    all_holders: bool = typer.Option(
        False, "--all", help="Target every holder that is not protected, stale or not."
    ),
    all_users: bool = typer.Option(False, "--all-users", help="Include other users' processes (root only)."),
    older_than: str | None = typer.Option(
        None,
        "--older-than",
        metavar="AGE",
        help="Only target processes running at least AGE (90s, 10m, 2h, 1d).",
    ),
    grace: float = typer.Option(
        DEFAULT_GRACE_S, "--grace", metavar="SECONDS", help="Wait this long after SIGTERM before SIGKILL."
    ),
    gpus: str | None = typer.Option(
        None, "--gpus", metavar="LIST", help="Only holders of these GPUs (nvidia-smi indices, e.g. 5,6)."
    ),
    device_files: str | None = typer.Option(
        None, "--device-files", metavar="GLOB", help="Device files to look at (default: /dev/nvidia*)."
    ),
    pids: list[int] | None = typer.Option(
        None,
        "--pid",
        metavar="PID",
        help="Target exactly this process (repeatable); protections still apply.",
    ),
    json_out: bool = JSON_OPTION,
) -> None:
    """Find processes holding GPU device files, show what each is and why it is stale or not, and stop
    the leftovers of a crashed launch (ranks and workers whose launcher is gone) with --yes."""
    from gputopo.ui.stale_view import render_run

    out = Output(json_mode=json_out)
    options = service.Options(
        act=yes,
        all_holders=all_holders,
        all_users=all_users,
        older_than=older_than,
        grace_s=grace,
        gpus=gpus,
        device_files=device_files,
        pids=tuple(pids or ()),
    )
    confirm = _confirm(out, options.grace_s) if not options.act and _stdin_is_tty() else None
    report = service.run(options, service.Hooks(warn=out.warn, confirm=confirm))
    out.document(report.document())
    out.show("Nothing was signalled." if report.declined else render_run(report.run))
    if report.failure is not None:
        raise CheckFailed(*report.failure)


def _confirm(out: Output, grace_s: float) -> Callable[[StaleRun, int], bool]:
    """The prompt on a terminal: the dry run shown, then a yes or no on stderr (no is the default)."""
    from gputopo.ui.stale_view import render_run

    def confirm(run: StaleRun, targets: int) -> bool:
        out.show(render_run(run))
        question = f"Stop {targets} process(es) now (SIGTERM, {grace_s:g} s grace, then SIGKILL)?"
        return typer.confirm(question, default=False, err=True)

    return confirm


def _stdin_is_tty() -> bool:
    return sys.stdin.isatty()
