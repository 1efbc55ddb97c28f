"""One look at the machine for kill-stale (and doctor): who holds the GPU device files, and the verdict.

This is the service behind ``gputopo kill-stale``: it reads the machine through ``system/`` (lsof or
/proc, and NVML's process lists, names and minor numbers), matches NVML's pids to this PID namespace
(``procs.pidmap``) and judges the holders with the pure ``procs.stale`` rules.
It signals nothing; ``procs.terminate`` does that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gputopo.errors import UnavailableError, UsageError
from gputopo.procs.holders import GpuMemoryUse, HolderScan, NvmlView, build_holders
from gputopo.procs.pidmap import match_pids
from gputopo.procs.stale import Policy, StaleReport, StaleRun, StopOutcome, assess, settle

if TYPE_CHECKING:
    from gputopo.system.inventory import ProcessListing

DEFAULT_GRACE_S = 10.0
# NVML's pids are read here to be matched; a machine with more GPU processes than this is judged on these.
_MAX_NVML_PIDS_READ = 512


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
        from gputopo.system import inventory
        from gputopo.system.lsof import DEFAULT_DEVICE_GLOB, scan_holders

        policy = policy or Policy()
        listing = inventory.process_listing()
        minors = inventory.minor_numbers()
        if gpus is not None:
            _check_gpus(gpus, minors)
        pattern = device_files or DEFAULT_DEVICE_GLOB
        nvml_pids = sorted({e[0] for e in listing.entries}) if listing is not None else []
        scan = scan_holders(pattern, extra_pids=nvml_pids[:_MAX_NVML_PIDS_READ])
        if not scan.device_files and device_files is not None:
            raise UsageError(
                f"--device-files {pattern}: no file matches", "give a glob such as '/dev/nvidia[56]'"
            )
        nvml = view_of(listing, minors, scan)
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


def _check_gpus(wanted: frozenset[int], minors: dict[int, int] | None) -> None:
    """``--gpus`` needs NVML: its process lists say who uses a GPU, and its minor numbers which
    /dev/nvidiaN is which GPU (often but not always N = index), so the mapping is never guessed."""
    if minors is None:
        raise UnavailableError(
            "--gpus needs NVML to tell which processes use which GPU, and NVML is unavailable",
            "select device files by minor number instead, e.g. --device-files '/dev/nvidia[56]'",
        )
    unknown = sorted(wanted - set(minors))
    if unknown:
        have = ",".join(str(i) for i in sorted(minors)) or "none"
        raise UsageError(
            f"--gpus: no GPU {','.join(map(str, unknown))} on this machine", f"GPU indices here: {have}"
        )


def view_of(listing: ProcessListing | None, minors: dict[int, int] | None, scan: HolderScan) -> NvmlView:
    """What NVML says, with its pids matched to this namespace's (``procs.pidmap``)."""
    if listing is None:
        return NvmlView(minors=dict(minors) if minors is not None else None)
    from gputopo.system.lsof import holds_device

    gpu_holders = {o.pid for o in scan.open_devices}
    for pid in {e[0] for e in listing.entries}:
        if pid in scan.processes and pid not in gpu_holders and holds_device(pid):
            gpu_holders.add(pid)
    matched = match_pids(
        (e[0] for e in listing.entries), listing.names, scan.processes, frozenset(gpu_holders)
    )
    return NvmlView(
        processes=_memory_use(listing),
        minors=dict(minors) if minors is not None else None,
        sees_pid_namespace=matched.sees_pid_namespace,
        pid_map=matched.mapping,
        refused=dict(listing.refused),
        pid_note=matched.note,
    )


def nvml_after(before: NvmlView) -> NvmlView:
    """NVML's process lists again after stopping, read with the pid matching from before (with the
    stopped processes gone, NVML may list nothing to judge it by)."""
    from gputopo.system import inventory

    listing = inventory.process_listing()
    if listing is None:
        return NvmlView(None, before.minors, before.sees_pid_namespace, before.pid_map, before.refused)
    return NvmlView(
        _memory_use(listing), before.minors, before.sees_pid_namespace, before.pid_map, dict(listing.refused)
    )


def _memory_use(listing: ProcessListing) -> tuple[GpuMemoryUse, ...]:
    return tuple(GpuMemoryUse(pid, gpu, used, kind) for pid, gpu, used, kind in listing.entries)
