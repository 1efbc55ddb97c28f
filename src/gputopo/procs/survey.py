"""One look at the machine for kill-stale (and doctor): who holds the GPU device files, and the verdict.

This is the service behind ``gputopo kill-stale``: it reads the machine through ``system/`` (lsof or
/proc, and NVML for GPU numbers and memory) and judges the holders with the pure ``procs.stale`` rules.
It signals nothing; ``procs.terminate`` does that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gputopo.errors import UnavailableError, UsageError
from gputopo.procs.holders import GpuMemoryUse, HolderScan, NvmlView, build_holders
from gputopo.procs.stale import Policy, StaleReport, StaleRun, StopOutcome, assess, settle

if TYPE_CHECKING:
    from gputopo.system.inventory import GpuProcess

DEFAULT_GRACE_S = 10.0


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
        nvml = nvml_view()
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


def nvml_view() -> NvmlView:
    """What NVML says, through the system seam; all ``None`` when NVML is unavailable.

    NVML's process list is read once and serves both the memory figures and the PID-namespace verdict.
    """
    from gputopo.system import inventory

    minors = inventory.minor_numbers()
    processes = inventory.gpu_processes()
    return NvmlView(
        processes=_memory_use(processes),
        minors=dict(minors) if minors is not None else None,
        sees_pid_namespace=inventory.pid_namespace_verdict(processes),
    )


def nvml_after(before: NvmlView) -> NvmlView:
    """NVML's process list again after stopping; the namespace verdict is the one from before (with the
    stopped processes gone, NVML may list nothing to judge it by)."""
    from gputopo.system import inventory

    return NvmlView(_memory_use(inventory.gpu_processes()), before.minors, before.sees_pid_namespace)


def _memory_use(processes: Sequence[GpuProcess] | None) -> tuple[GpuMemoryUse, ...] | None:
    if processes is None:
        return None
    return tuple(GpuMemoryUse(p.pid, p.gpu_index, p.used_memory_mib) for p in processes)
