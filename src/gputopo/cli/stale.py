"""CLI: ``gputopo kill-stale``: the processes holding GPUs, which are stale and why; stops them on --yes."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, examples, guarded
from gputopo.errors import CheckFailed, UsageError
from gputopo.gpulist import parse_gpu_list
from gputopo.ui.output import Output

if TYPE_CHECKING:
    from gputopo.procs.stale import Policy

# Kept in step with procs.survey.DEFAULT_GRACE_S (a test checks); not imported, so that --help and the
# other commands don't load the process modules.
DEFAULT_GRACE_S = 10.0


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
    from gputopo.procs.document import stale_document
    from gputopo.procs.survey import Survey, nvml_after
    from gputopo.ui.stale_view import render_run

    out = Output(json_mode=json_out)
    options = kill_stale_options(
        yes=yes,
        all_holders=all_holders,
        all_users=all_users,
        older_than=older_than,
        grace=grace,
        gpus=gpus,
        device_files=device_files,
        pids=pids,
    )
    found = Survey.take(options.device_files, options.policy, options.gpus, grace_s=options.grace_s)
    for note in found.notes:
        out.warn(note)
    targets = found.report.targets
    act = options.act
    prompted = not options.act and bool(targets) and _stdin_is_tty()
    if prompted:
        out.show(render_run(found.run()))
        act = typer.confirm(
            f"Stop {len(targets)} process(es) now (SIGTERM, {options.grace_s:g} s grace, then SIGKILL)?",
            default=False,
            err=True,
        )
    if not act or not targets:
        run = found.run()
        out.document(stale_document(run))
        out.show("Nothing was signalled." if prompted else render_run(run))
        return

    from gputopo.procs.terminate import stop_processes

    outcomes = stop_processes(targets, grace_s=options.grace_s)
    nvml = found.nvml
    run = found.run(outcomes, nvml_after(nvml) if nvml.process_pids_usable else None)
    out.document(stale_document(run))
    out.show(render_run(run))
    if run.not_stopped:
        pids = ", ".join(str(h.assessment.target.pid) for h in run.not_stopped if h.assessment.target)
        raise CheckFailed(
            f"{len(run.not_stopped)} process(es) could not be stopped: {pids}",
            "see the ACTION column; a process stuck in the driver needs a GPU reset or a reboot",
        )


@dataclass(frozen=True, kw_only=True)
class KillStaleOptions:
    """What ``kill-stale`` was asked, checked once by ``kill_stale_options`` (as torchrun's
    ``config_from_args``) and handed whole to the survey and the stopping."""

    act: bool  # --yes: stop the targets (else a dry run, or a prompt on a terminal)
    policy: Policy  # --all, --all-users, --older-than, --pid
    gpus: frozenset[int] | None  # --gpus; None: every GPU
    device_files: str | None  # --device-files; None: /dev/nvidia*
    grace_s: float  # --grace


def kill_stale_options(
    *,
    yes: bool,
    all_holders: bool,
    all_users: bool,
    older_than: str | None,
    grace: float,
    gpus: str | None,
    device_files: str | None,
    pids: list[int] | None,
) -> KillStaleOptions:
    """The parsed ``kill-stale`` options, each checked by its one rule (``UsageError``, exit 2); nothing
    is read from the machine before all of them pass. No defaults here: they are the CLI's, written once."""
    from gputopo.procs.stale import Policy, parse_duration_s

    if grace < 0:
        raise UsageError(f"--grace {grace:g}: must be 0 or more seconds", "e.g. --grace 10")
    older_than_s = None
    if older_than is not None:
        try:
            older_than_s = parse_duration_s(older_than)
        except ValueError:
            raise UsageError(
                f"--older-than {older_than}: not a duration",
                "use a number with s, m, h or d: 90s, 10m, 2h, 1d",
            ) from None
    if all_users and _euid() != 0:
        raise UsageError("--all-users needs root", "run as root (sudo) to stop other users' processes")
    wanted_gpus = frozenset(parse_gpu_list(gpus, "--gpus")) if gpus is not None else None
    if device_files is not None:
        _check_device_glob(device_files)
    if pids and any(p <= 0 for p in pids):
        raise UsageError("--pid: a process id is a positive number", "e.g. --pid 4242 --pid 4243")
    policy = Policy(
        all=all_holders,
        all_users=all_users,
        older_than_s=older_than_s,
        pids=frozenset(pids) if pids else None,
    )
    return KillStaleOptions(
        act=yes, policy=policy, gpus=wanted_gpus, device_files=device_files, grace_s=grace
    )


def _stdin_is_tty() -> bool:
    return sys.stdin.isatty()


def _euid() -> int:
    return os.geteuid()


def _check_device_glob(pattern: str) -> None:
    """NVIDIA's device files are all named ``nvidia*`` (nvidia0, nvidiactl, nvidia-uvm, nvidia-caps/...);
    a glob whose file names can't be one (``/etc/passwd``) is a mistake, not a narrower search."""
    from fnmatch import fnmatchcase

    name = os.path.basename(pattern.rstrip("/"))
    if not name.startswith("nvidia") and not any(fnmatchcase(f, name) for f in ("nvidia0", "nvidiactl")):
        raise UsageError(
            f"--device-files {pattern}: {name or pattern} is not an NVIDIA device file name",
            "their names start with nvidia, e.g. --device-files '/dev/nvidia[0-3]' (default /dev/nvidia*)",
        )
