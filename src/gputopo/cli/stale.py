"""CLI: ``gputopo kill-stale``: the processes holding GPUs, which are stale and why; stops them on --yes."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, guarded
from gputopo.errors import CheckFailed, UnavailableError, UsageError
from gputopo.procs.holders import GpuMemoryUse, HolderScan, NvmlView, build_holders
from gputopo.procs.stale import (
    Policy,
    StaleReport,
    StaleRun,
    StopOutcome,
    assess,
    parse_duration_s,
    settle,
)
from gputopo.ui.output import Output

DEFAULT_GRACE_S = 10.0


@app.command("kill-stale")
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
    json_out: bool = JSON_OPTION,
) -> None:
    """Find processes holding GPU device files, show which are stale and why, and stop them with --yes."""
    from gputopo.ui.stale_view import render_run, stale_document

    out = Output(json_mode=json_out)
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
    wanted_gpus = _parse_gpus(gpus) if gpus is not None else None
    policy = Policy(all=all_holders, all_users=all_users, older_than_s=older_than_s)

    found = Survey.take(device_files, policy, wanted_gpus, grace_s=grace)
    for note in found.notes:
        out.warn(note)
    targets = found.report.targets
    act = yes
    prompted = not yes and bool(targets) and _stdin_is_tty()
    if prompted:
        out.show(render_run(found.run()))
        act = typer.confirm(
            f"Stop {len(targets)} process(es) now (SIGTERM, {grace:g} s grace, then SIGKILL)?",
            default=False,
            err=True,
        )
    if not act or not targets:
        run = found.run()
        out.document(stale_document(run))
        out.show("Nothing was signalled." if prompted else render_run(run))
        return

    from gputopo.procs.terminate import stop_processes

    outcomes = stop_processes(targets, grace_s=grace)
    nvml = found.nvml
    run = found.run(outcomes, _nvml_after(nvml) if nvml.process_pids_usable else None)
    out.document(stale_document(run))
    out.show(render_run(run))
    if run.not_stopped:
        pids = ", ".join(str(h.assessment.target.pid) for h in run.not_stopped if h.assessment.target)
        raise CheckFailed(
            f"{len(run.not_stopped)} process(es) could not be stopped: {pids}",
            "see the ACTION column; a process stuck in the driver needs a GPU reset or a reboot",
        )


@dataclass(frozen=True)
class Survey:
    """One look at the machine: who holds the device files and the verdict on each; signals nothing.

    ``gputopo doctor`` uses it as ``Survey.take().run()`` for a dry-run ``StaleRun``.
    """

    device_glob: str
    scan: HolderScan
    nvml: NvmlView
    report: StaleReport
    policy: Policy
    grace_s: float
    notes: tuple[str, ...]

    @classmethod
    def take(
        cls,
        device_files: str | None = None,
        policy: Policy | None = None,
        gpus: frozenset[int] | None = None,
        grace_s: float = DEFAULT_GRACE_S,
    ) -> Survey:
        """Scan ``device_files`` (default ``/dev/nvidia*``) and judge the holders under ``policy``.

        Raises ``UsageError`` for a ``--device-files`` glob that matches nothing or an unknown GPU,
        ``UnavailableError`` when ``gpus`` is given without NVML or neither lsof nor /proc can be read.
        """
        from gputopo.system.lsof import DEFAULT_DEVICE_GLOB, scan_holders

        policy = policy or Policy()
        nvml = _nvml_view()
        if gpus is not None:
            _check_gpus(gpus, nvml)
        pattern = device_files or DEFAULT_DEVICE_GLOB
        scan = scan_holders(pattern)
        if not scan.device_files and device_files is not None:
            raise UsageError(
                f"--device-files {pattern}: no file matches", "give a glob such as '/dev/nvidia[56]'"
            )
        holders, scan_notes = build_holders(scan, nvml, gpus)
        report = assess(holders, scan, nvml, policy)
        notes = [*scan.warnings, *report.notes, *scan_notes]
        if not scan.device_files:
            notes.insert(
                0, f"no {pattern} device files: the NVIDIA driver is not loaded, so no process holds a GPU"
            )
        if scan.my_uid != 0:
            notes.append("not root: processes of other users cannot be seen or stopped")
        return cls(pattern, scan, nvml, report, policy, grace_s, tuple(notes))

    def run(self, outcomes: Sequence[StopOutcome] | None = None, after: NvmlView | None = None) -> StaleRun:
        """The renderable run: a dry run without ``outcomes``, else what stopping the targets did."""
        return StaleRun(
            source=self.scan.source,
            device_glob=self.device_glob,
            device_files=self.scan.device_files,
            policy=self.policy,
            grace_s=self.grace_s,
            dry_run=outcomes is None,
            nvml=self.nvml,
            holders=settle(self.report, outcomes, self.nvml, after),
            notes=self.notes,
        )


def _stdin_is_tty() -> bool:
    return sys.stdin.isatty()


def _euid() -> int:
    return os.geteuid()


def _parse_gpus(text: str) -> frozenset[int]:
    try:
        found = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--gpus {text}: not a list of GPU indices", "e.g. --gpus 5,6") from None
    if not found or any(g < 0 for g in found):
        raise UsageError(f"--gpus {text}: not a list of GPU indices", "e.g. --gpus 5,6")
    return found


def _check_gpus(wanted: frozenset[int], nvml: NvmlView) -> None:
    """``--gpus`` needs NVML's minor numbers: /dev/nvidiaN is the GPU whose minor number is N, which is
    often but not always its index, so the mapping is never guessed."""
    if nvml.minors is None:
        raise UnavailableError(
            "--gpus needs NVML to map GPU indices to /dev/nvidiaN, and NVML is unavailable",
            "select device files by minor number instead, e.g. --device-files '/dev/nvidia[56]'",
        )
    unknown = sorted(wanted - set(nvml.minors))
    if unknown:
        have = ",".join(str(i) for i in sorted(nvml.minors)) or "none"
        raise UsageError(
            f"--gpus: no GPU {','.join(map(str, unknown))} on this machine", f"GPU indices here: {have}"
        )


def _nvml_view() -> NvmlView:
    """What NVML says, through the system seam; all ``None`` when NVML is unavailable."""
    from gputopo.system import inventory

    minors = inventory.minor_numbers()
    return NvmlView(
        processes=_gpu_processes(),
        minors=dict(minors) if minors is not None else None,
        sees_pid_namespace=inventory.nvml_sees_pid_namespace(),
    )


def _nvml_after(before: NvmlView) -> NvmlView:
    """NVML's process list again after stopping; the namespace verdict is the one from before (with the
    stopped processes gone, NVML may list nothing to judge it by)."""
    return NvmlView(_gpu_processes(), before.minors, before.sees_pid_namespace)


def _gpu_processes() -> tuple[GpuMemoryUse, ...] | None:
    from gputopo.system import inventory

    processes = inventory.gpu_processes()
    if processes is None:
        return None
    return tuple(GpuMemoryUse(p.pid, p.gpu_index, p.used_memory_mib) for p in processes)
