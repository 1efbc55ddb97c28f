"""Which GPU holders are stale, which are protected, and which ``--yes`` would stop (pure).

Stale, with the reason shown, is only what a crashed or interrupted launch leaves behind:

- **launcher gone**: a worker (a torchrun or torch.distributed.launch rank, a multiprocessing spawn or
  forkserver child, a fork worker) whose launcher or parent is gone (``procs.jobs`` says how that is told,
  and why PID 1 is not an orphan-maker when PID 1 is the launcher itself);
- **stuck in the driver**: the holder's main thread has exited (so it shows as a zombie) and its other
  threads, which still hold the device files, sleep uninterruptibly in the kernel (state ``D``). No signal
  reaches them; only a GPU reset or a reboot frees the GPU. Reported, never targeted.

A zombie is never a reason to stop its parent. A process that has really exited holds no files: the
kernel closes them before it becomes a zombie (torvalds/linux kernel/exit.c, ``do_exit`` calls
``exit_files`` before ``exit_notify``), so stopping the parent frees nothing and may stop a torchrun agent
or a notebook server. A "zombie" that holds ``/dev/nvidia*`` is a thread-group leader whose main thread
exited while other threads live on (the kernel keeps the leader a zombie until the group is empty:
``release_task``); a signal to its pid reaches those threads, so it is judged and targeted like any
process, unless a thread is in ``D`` state. A zombie with no live thread (it exited between the scan and
the read) is spared: its files are already closed.

Never stale by itself: a plain detached process (parent PID 1, no worker marks: a nohup'd training, a
service, a notebook), a worker whose launcher runs, and a process NVML does not list. Many healthy
processes hold ``/dev/nvidia*`` without a context NVML lists (NVML clients such as exporters, forked
DataLoader workers that inherited the descriptors, MPS clients, anything on a MIG GPU whose list the caller
may not read), so "invisible to NVML" is a note, never a reason.

``--all`` targets every holder that is not protected; ``--pid`` exactly the ones named. Protected, never
targeted: this process and its ancestors, PID 1, other users' processes (unless root with
``--all-users``), and the daemons and display stack in ``PROTECTED_NAMES``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from gputopo.procs.holders import Holder, HolderScan, NvmlView, ProcessInfo, ProcessRef
from gputopo.procs.jobs import JobRole, describe, role

# The one list of processes that hold GPUs on purpose and must never be stopped by this tool.
# Names are matched against the process name and argv[0]; a kernel name is cut to 15 characters.
PROTECTED_NAMES: Mapping[str, str] = {
    "nvidia-persistenced": "NVIDIA persistence daemon",
    "nv-hostengine": "DCGM host engine",
    "nvidia-fabricmanager": "NVIDIA Fabric Manager",
    "nv-fabricmanager": "NVIDIA Fabric Manager",
    "dcgm-exporter": "DCGM exporter",
    "nvidia-powerd": "NVIDIA power daemon",
    "nvidia-cuda-mps-control": "CUDA MPS control daemon",
    "nvidia-cuda-mps-server": "CUDA MPS server (its clients would die with it)",
    "nvidia-device-plugin": "Kubernetes NVIDIA device plugin",
    "nvidia-smi": "GPU monitor",
    "nvtop": "GPU monitor",
    "nvitop": "GPU monitor",
    "gpustat": "GPU monitor",
    "Xorg": "display server",
    "X": "display server",
    "Xwayland": "display server",
    "gnome-shell": "desktop compositor",
    "mutter": "desktop compositor",
    "kwin_wayland": "desktop compositor",
    "kwin_x11": "desktop compositor",
    "plasmashell": "desktop shell",
    "weston": "desktop compositor",
    "sway": "desktop compositor",
    "Hyprland": "desktop compositor",
    "gdm": "display manager",
    "gdm3": "display manager",
    "gdm-x-session": "display manager",
    "gdm-wayland-session": "display manager",
    "sddm": "display manager",
    "sddm-greeter": "display manager greeter",
    "sddm-greeter-qt6": "display manager greeter",
    "lightdm": "display manager",
    "gnome-remote-desktop-daemon": "remote desktop server",
}

_KERNEL_NAME_LEN = 15

_NUMBER_RE = re.compile(r"\d+(?:\.\d+)?")
_PART_RE = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_DURATION_RE = re.compile(r"(?:\d+(?:\.\d+)?[smhd])+")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True, kw_only=True)
class Policy:
    """What the user asked for: ``--all``, ``--all-users``, ``--older-than`` (seconds), ``--pid``."""

    all: bool = False
    all_users: bool = False
    older_than_s: float | None = None
    pids: frozenset[int] | None = None


@dataclass(frozen=True)
class Assessment:
    """The verdict on one holder.

    ``reasons`` say why it is stale; ``protected_reasons`` why it must not be touched; ``spared_reasons``
    why ``--yes`` would leave it (protected, not stale, too young). ``target`` is the process ``--yes``
    signals (the holder itself, or a zombie's parent), ``None`` when it is spared. ``job`` is its kind,
    launcher or parent, and why it is or is not stale; ``notes`` are facts that decide nothing (NVML does
    not list it, where its GPUs come from).
    """

    holder: Holder
    reasons: tuple[str, ...]
    protected_reasons: tuple[str, ...]
    spared_reasons: tuple[str, ...]
    target: ProcessRef | None
    job: JobRole | None = None
    notes: tuple[str, ...] = ()

    @property
    def stale(self) -> bool:
        """True when at least one stale reason holds."""
        return bool(self.reasons)

    @property
    def protected(self) -> bool:
        """True when the holder must never be signalled."""
        return bool(self.protected_reasons)

    @property
    def targeted(self) -> bool:
        """True when ``--yes`` would signal ``target``."""
        return self.target is not None


@dataclass(frozen=True)
class StaleReport:
    """All holders with their verdicts, the distinct targets, and notes on what could not be judged."""

    assessments: tuple[Assessment, ...]
    notes: tuple[str, ...]

    @property
    def targets(self) -> tuple[ProcessRef, ...]:
        """The processes ``--yes`` would signal, each once, in holder order."""
        return tuple(dict.fromkeys(a.target for a in self.assessments if a.target is not None))


def parse_duration_s(text: str) -> float:
    """Seconds in a duration: a plain number of seconds (``90``) or unit parts (``90s``, ``10m``, ``2h``,
    ``1d``, ``1h30m``).

    Raises ``ValueError`` for anything else: empty, negative, or a unit part without its unit.
    """
    compact = text.strip().lower().replace(" ", "")
    if _NUMBER_RE.fullmatch(compact):
        return float(compact)
    if not _DURATION_RE.fullmatch(compact):
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * _UNIT_S[unit] for n, unit in _PART_RE.findall(compact))


def format_duration(seconds: float | None) -> str:
    """A short human duration: ``45s``, ``12m``, ``3h05m``, ``2d04h``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s < 600 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def protected_name(info: ProcessInfo) -> str | None:
    """Why a process is protected by its name (a daemon or the display stack), or ``None``."""
    for identity in info.identities:
        for name, why in PROTECTED_NAMES.items():
            if identity == name or (
                len(identity) == _KERNEL_NAME_LEN and name[:_KERNEL_NAME_LEN] == identity
            ):
                return f"{why} ({name})"
    return None


def assess(
    holders: Sequence[Holder],
    scan: HolderScan,
    nvml: NvmlView,
    policy: Policy,
) -> StaleReport:
    """Judge every holder: stale reasons, protections, and what ``--yes`` would signal."""
    notes: list[str] = []
    if not nvml.available:
        notes.append("NVML unavailable: GPU numbers and memory are unknown; HOLDS shows the device files")
    elif not nvml.process_pids_usable:
        notes.append(
            "NVML's pids cannot be matched to this PID namespace"
            + (f" ({nvml.pid_note})" if nvml.pid_note else "")
            + ": GPUs shown are from the device files held, per-process GPU memory is unknown"
        )
    for gpu, why in sorted(nvml.refused.items()):
        notes.append(f"GPU{gpu}: NVML refused a process list ({why}); who uses it is unknown, not nobody")
    if policy.pids is not None:
        held = {h.pid for h in holders}
        for pid in sorted(policy.pids - held):
            notes.append(
                f"--pid {pid}: not among the holders shown (it holds none of the device files, or "
                "--gpus leaves it out); nothing is done to it"
            )
    pid1 = scan.processes.get(1)
    assessments = tuple(_assess_one(h, scan, nvml, policy, pid1) for h in holders)
    return StaleReport(assessments=assessments, notes=tuple(notes))


def _assess_one(
    holder: Holder, scan: HolderScan, nvml: NvmlView, policy: Policy, pid1: ProcessInfo | None
) -> Assessment:
    info = holder.info
    processes = scan.processes
    parent = processes.get(info.ppid) if info.ppid is not None else None

    reasons: list[str] = []
    job = role(info, parent, pid1)
    zombie = info.status == "zombie"
    live = info.live_threads
    stuck = [tid for tid, state in live if state == "D"]
    zombie_spared: str | None = None
    if zombie and stuck:
        reasons.append(
            f"stuck in the driver: its main thread exited; thread {', '.join(map(str, stuck))} waits "
            "uninterruptibly in the kernel (state D) and still holds the GPU: reset the GPU or reboot"
        )
        zombie_spared = "stuck in the driver: no signal frees it (reset the GPU or reboot)"
    elif zombie and not live:
        zombie_spared = (
            f"a zombie holds no files (the kernel closed them when it exited); its parent "
            f"{describe(parent, info.ppid)} has not reaped it, and stopping the parent would free nothing"
        )
    elif job.gone:
        reasons.append(job.gone)

    notes = _notes(holder, nvml)
    if zombie and live and not stuck:
        notes.append(
            f"its main thread exited; {len(live)} thread(s) live on and hold the files: a signal to its pid "
            "reaches them"
        )
    protected = _protections(info, scan, policy)

    spared = list(protected)
    if zombie_spared is not None:
        spared.append(zombie_spared)
    elif not protected:
        if policy.pids is not None:
            if info.pid not in policy.pids:
                spared.append("not named by --pid")
        elif not reasons and not policy.all:
            spared.append(f"not stale: {job.why or 'no stale rule holds'} (--all or --pid would stop it)")
        if policy.older_than_s is not None and (holder.age_s is None or holder.age_s < policy.older_than_s):
            spared.append(
                f"running for {format_duration(holder.age_s)}, younger than --older-than "
                f"{format_duration(policy.older_than_s)}"
            )
    target = None
    if not spared:
        target = info.ref
        if target is None:
            spared.append("its start time cannot be read, so its identity cannot be checked before a signal")
    return Assessment(
        holder=holder,
        reasons=tuple(reasons),
        protected_reasons=tuple(protected),
        spared_reasons=tuple(spared),
        target=target,
        job=job,
        notes=tuple(notes),
    )


def _notes(holder: Holder, nvml: NvmlView) -> list[str]:
    """Facts shown with a holder that decide nothing."""
    notes: list[str] = []
    if holder.nvml_listed is False and holder.gpu_devices:
        notes.append(
            "NVML lists no context of it (an NVML client, a forked worker, an MPS client...): a note, "
            "not a reason to stop it"
        )
    if holder.gpu_basis == "device files" and holder.gpu_devices and holder.gpus:
        notes.append(
            "GPUs from the device files it holds: a process that opened every GPU (an NVML client, CUDA "
            "without CUDA_VISIBLE_DEVICES) shows them all"
        )
    elif holder.gpu_basis == "nvml and device files":
        notes.append("some GPUs from its device files, where NVML refused the process list")
    elif holder.gpus is None and holder.gpu_devices and nvml.available:
        notes.append("its GPUs are unknown: a device file's minor number is not one NVML knows")
    return notes


def _protections(info: ProcessInfo, scan: HolderScan, policy: Policy) -> list[str]:
    """Why ``info`` must never be signalled (empty when nothing protects it)."""
    why: list[str] = []
    if scan.lineage and info.pid == scan.lineage[0]:
        why.append("this gputopo process")
    elif info.pid in scan.lineage:
        why.append(f"an ancestor of this gputopo ({info.name or '?'}): your shell or launcher")
    elif info.pid == 1:
        why.append("PID 1 (init)")
    if info.error:
        why.append(f"cannot be read ({info.error})")
    if info.uid is not None and info.uid != scan.my_uid:
        owner = info.user or f"uid {info.uid}"
        if scan.my_uid != 0:
            why.append(f"owned by {owner}, not you (only root with --all-users may stop it)")
        elif not policy.all_users:
            why.append(f"owned by {owner}, not you (add --all-users to include it)")
    daemon = protected_name(info)
    if daemon:
        why.append(daemon)
    return why


def memory_freed_mib(before: NvmlView, after: NvmlView | None, pid: int) -> int | None:
    """GPU memory released by a stopped process: what NVML listed before, if NVML no longer lists it.

    ``None`` when NVML cannot tell: unavailable, another PID namespace, no figure before, or the pid
    still listed (the driver has not released it yet).
    """
    if after is None or not after.process_pids_usable:
        return None
    used = before.memory_by_pid().get(pid)
    if not used or any(v is None for v in used.values()):
        return None
    if pid in after.memory_by_pid():
        return None
    return sum(v for v in used.values() if v is not None)


class StopResult(Enum):
    """How stopping one process ended."""

    TERMINATED = "terminated"  # gone after SIGTERM
    KILLED = "killed"  # gone only after SIGKILL
    ALREADY_GONE = "already gone"  # exited, or its pid was reused, before the first signal
    ACCESS_DENIED = "access denied"  # the kernel refused the signal
    FAILED = "failed"  # still there after SIGKILL (stuck in the kernel)

    @property
    def gone(self) -> bool:
        """True when the process no longer runs."""
        return self in (StopResult.TERMINATED, StopResult.KILLED, StopResult.ALREADY_GONE)


@dataclass(frozen=True)
class StopOutcome:
    """The result for one process and a sentence on what happened."""

    ref: ProcessRef
    result: StopResult
    detail: str


@dataclass(frozen=True)
class HolderOutcome:
    """What happened to one holder: the ``action`` of the JSON contract, the stop ``result`` when it was
    signalled (``already gone`` and ``access denied`` show only here), a ``detail`` sentence, and the GPU
    memory it freed when NVML can tell."""

    assessment: Assessment
    action: str
    result: StopResult | None
    detail: str | None
    memory_freed_mib: int | None

    @property
    def gone(self) -> bool | None:
        """True when the targeted process no longer runs; ``None`` when it was not signalled."""
        return self.result.gone if self.result is not None else None


_ACTION = {
    StopResult.TERMINATED: "terminated",
    StopResult.KILLED: "killed",
    StopResult.ALREADY_GONE: "terminated",
    StopResult.ACCESS_DENIED: "failed",
    StopResult.FAILED: "failed",
}


def settle(
    report: StaleReport,
    outcomes: Sequence[StopOutcome] | None,
    before: NvmlView,
    after: NvmlView | None = None,
) -> tuple[HolderOutcome, ...]:
    """Each holder's action. ``outcomes`` is ``None`` for a dry run (targets are ``listed``); otherwise
    the result of stopping ``report.targets``. ``after`` is NVML read again after stopping."""
    by_ref = {o.ref: o for o in outcomes} if outcomes is not None else {}
    settled: list[HolderOutcome] = []
    for a in report.assessments:
        if a.target is None:
            settled.append(HolderOutcome(a, "spared", None, None, None))
            continue
        outcome = by_ref.get(a.target)
        if outcome is None:
            settled.append(HolderOutcome(a, "listed", None, None, None))
            continue
        detail = outcome.detail
        freed = memory_freed_mib(before, after, a.holder.pid) if outcome.result.gone else None
        settled.append(HolderOutcome(a, _ACTION[outcome.result], outcome.result, detail, freed))
    return tuple(settled)


@dataclass(frozen=True)
class StaleRun:
    """One ``kill-stale`` run, ready to render: where holders were found, what was asked, what happened.

    ``source`` is ``"lsof"``, ``"/proc"``, or ``"none"`` when ``device_glob`` matched no file.
    """

    source: str
    device_glob: str
    device_files: tuple[str, ...]
    policy: Policy
    grace_s: float
    dry_run: bool
    nvml: NvmlView
    holders: tuple[HolderOutcome, ...]
    notes: tuple[str, ...] = ()

    @property
    def targeted(self) -> tuple[HolderOutcome, ...]:
        """Holders that ``--yes`` stops (or would stop, in a dry run)."""
        return tuple(h for h in self.holders if h.assessment.targeted)

    @property
    def not_stopped(self) -> tuple[HolderOutcome, ...]:
        """Targeted holders still running after the stop (always empty in a dry run)."""
        return tuple(h for h in self.targeted if h.gone is False)

    @property
    def memory_freed_mib(self) -> int | None:
        """Total GPU memory freed, over the holders for which NVML could tell; ``None`` if for none."""
        known = [h.memory_freed_mib for h in self.holders if h.memory_freed_mib is not None]
        return sum(known) if known else None
