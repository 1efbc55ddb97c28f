"""``gputopo kill-stale``'s service: who holds the GPU device files, which of them are stale and why
(``procs.survey``: one look through ``system/``, judged by the pure ``procs.stale`` rules), and, when asked
(``--yes``, or a person's yes at the prompt), the stale ones stopped (``procs.terminate``: SIGTERM, a
grace period, SIGKILL).

The CLI builds ``Options`` (validated once, when built: bad input never reads the machine), calls ``run``
with ``Hooks`` (``warn``; ``confirm``, the prompt, only where a person can answer it) and shows the
``KillStaleReport`` (``document()`` is the whole ``gputopo/stale/v1`` JSON).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gputopo.errors import UsageError
from gputopo.procs.stale import Policy, StaleRun
from gputopo.procs.survey import DEFAULT_GRACE_S  # noqa: F401 - re-exported: the CLI's typer default


@dataclass(frozen=True, kw_only=True)
class Options:
    """What ``kill-stale`` was asked, keyword only, each value checked by its one rule when built
    (``UsageError``, exit 2). No defaults here: they are the CLI's, written once."""

    act: bool  # --yes: stop the targets (else a dry run, or a prompt where a person can answer)
    all_holders: bool  # --all: every holder that is not protected, stale or not
    all_users: bool  # --all-users: other users' processes too (root only)
    older_than: str | None  # --older-than AGE: only processes running at least that long
    grace_s: float  # --grace: the wait between SIGTERM and SIGKILL
    gpus: str | None  # --gpus LIST; None: every GPU
    device_files: str | None  # --device-files GLOB; None: /dev/nvidia*
    pids: tuple[int, ...]  # --pid, repeatable; (): no process named

    def __post_init__(self) -> None:
        if self.grace_s < 0:
            raise UsageError(f"--grace {self.grace_s:g}: must be 0 or more seconds", "e.g. --grace 10")
        self.older_than_s  # noqa: B018 - UsageError for text that is no duration
        if self.all_users and os.geteuid() != 0:
            raise UsageError("--all-users needs root", "run as root (sudo) to stop other users' processes")
        self.gpu_set  # noqa: B018 - UsageError for text that is no GPU list
        if self.device_files is not None:
            _check_device_glob(self.device_files)
        if any(p <= 0 for p in self.pids):
            raise UsageError("--pid: a process id is a positive number", "e.g. --pid 4242 --pid 4243")

    @property
    def older_than_s(self) -> float | None:
        from gputopo.procs.stale import parse_duration_s

        if self.older_than is None:
            return None
        try:
            return parse_duration_s(self.older_than)
        except ValueError:
            raise UsageError(
                f"--older-than {self.older_than}: not a duration",
                "use a number with s, m, h or d: 90s, 10m, 2h, 1d",
            ) from None

    @property
    def gpu_set(self) -> frozenset[int] | None:
        from gputopo.gpulist import parse_gpu_list

        return frozenset(parse_gpu_list(self.gpus, "--gpus")) if self.gpus is not None else None

    @property
    def policy(self) -> Policy:
        """Which holders are targets: ``procs.stale``'s rules with --all, --all-users, --older-than, --pid."""
        return Policy(
            all=self.all_holders,
            all_users=self.all_users,
            older_than_s=self.older_than_s,
            pids=frozenset(self.pids) if self.pids else None,
        )


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


def _ignore(_: str) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """What the service asks or tells its caller: ``warn``, a line for stderr (what the survey could not
    read); ``confirm``, asked before anything is signalled when neither --yes was given nor the run is
    a plain dry run: it gets the dry run and the number of targets and says whether to stop them
    (``None``: nobody to ask, so a dry run)."""

    warn: Callable[[str], None] = _ignore
    confirm: Callable[[StaleRun, int], bool] | None = None


@dataclass(frozen=True)
class KillStaleReport:
    """What ``run`` came to: the ``StaleRun`` (the holders, each judged, and what stopping them did), and
    ``declined``: a person was asked and said no, so nothing was signalled."""

    run: StaleRun
    declined: bool = False

    def document(self) -> dict[str, Any]:
        from gputopo.procs.document import stale_document

        return stale_document(self.run)

    @property
    def failure(self) -> tuple[str, str] | None:
        """The error (message, hint) when some targets could not be stopped; ``None`` when all were."""
        stuck = self.run.not_stopped
        if not stuck:
            return None
        pids = ", ".join(str(h.assessment.target.pid) for h in stuck if h.assessment.target)
        return (
            f"{len(stuck)} process(es) could not be stopped: {pids}",
            "see the ACTION column; a process stuck in the driver needs a GPU reset or a reboot",
        )

    @property
    def exit_code(self) -> int:
        return 1 if self.failure is not None else 0

    def with_files(self, paths: Any) -> KillStaleReport:
        return self  # kill-stale writes no report files


def run(options: Options, hooks: Hooks) -> KillStaleReport:
    """One survey; the targets stopped when --yes (or the person ``hooks.confirm`` asks) says so."""
    from gputopo.procs.survey import Survey, nvml_after

    found = Survey.take(options.device_files, options.policy, options.gpu_set, grace_s=options.grace_s)
    for note in found.notes:
        hooks.warn(note)
    targets = found.report.targets
    act = options.act
    asked = not act and bool(targets) and hooks.confirm is not None
    if asked and hooks.confirm is not None:
        act = hooks.confirm(found.run(), len(targets))
    if not act or not targets:
        return KillStaleReport(found.run(), declined=asked)
    from gputopo.procs.terminate import stop_processes

    outcomes = stop_processes(targets, grace_s=options.grace_s)
    nvml = found.nvml
    return KillStaleReport(found.run(outcomes, nvml_after(nvml) if nvml.process_pids_usable else None))
