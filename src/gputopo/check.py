"""``gputopo check``'s service: read this node through ``system/`` (NVML twice, the kernel log, the
topology for baselines) and judge it with the pure ``health`` package, within a time budget.

The CLI parses and validates the options (bad input never reaches here, so it never drains), calls
``run_check``, and renders the ``health.check.CheckResult``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputopo import fabric
from gputopo.errors import InputError
from gputopo.findings import Finding
from gputopo.health import baseline
from gputopo.health.check import CheckResult, summarize
from gputopo.health.judge import Judgement, NotChecked, judge
from gputopo.health.readings import HealthSample
from gputopo.health.rules import DEFAULT_THRESHOLDS, Thresholds
from gputopo.health.xid import scan, xid_findings
from gputopo.model import GPU_NOT_RESPONDING
from gputopo.system.kernel_log import KernelLog

# Time kept back from the budget for what follows the NVML reads (kernel log, output).
RESERVE_S = 1.0


@dataclass(frozen=True)
class CheckOptions:
    """What ``gputopo check`` was asked, already validated. ``kernel_log`` is a log the user gave (``None``:
    read this machine's); ``baseline`` a loaded baseline document to compare with."""

    sample_s: float = 2.0
    budget_s: float = 20.0
    nvml_timeout_s: float = 5.0
    expect_gpus: int | None = None
    thresholds: Thresholds = DEFAULT_THRESHOLDS
    since_s: float | None = 7200.0
    kernel_log: KernelLog | None = None
    baseline: dict[str, Any] | None = None
    save_baseline: Path | None = None


def run_check(options: CheckOptions, started: float | None = None) -> CheckResult:
    """Check this node; ``started`` is the ``time.monotonic()`` reading the budget counts from."""
    from gputopo.system import nvml
    from gputopo.system.health_reads import read_two_samples
    from gputopo.system.kernel_log import read_kernel_log

    started = time.monotonic() if started is None else started
    deadline = started + options.budget_s
    sample: HealthSample | None = None
    judgement: Judgement | None = None
    unavailable = None
    extra: list[Finding] = []
    not_checked: list[NotChecked] = []
    # A hung GPU costs one NVML deadline: keep that well inside the budget.
    per_gpu_s = min(options.nvml_timeout_s, max(0.5, (deadline - time.monotonic()) / 4))
    ports = fabric.start()  # the network ports' first reading: their counters' rise spans the NVML window
    try:
        first, sample = read_two_samples(options.sample_s, timeout_s=per_gpu_s, deadline=deadline - RESERVE_S)
        judgement = judge(first, sample, thresholds=options.thresholds, expect_gpus=options.expect_gpus)
    except nvml.NvmlUnavailable as exc:
        unavailable = exc.message
    log = options.kernel_log
    if log is None:
        log = read_kernel_log(options.since_s, timeout_s=max(0.5, min(5.0, deadline - time.monotonic())))
    if log.text is None:
        not_checked.append(NotChecked("Xid", log.refused or "the kernel log could not be read"))
    else:
        found = scan(log.text, options.since_s, uptime_s=log.uptime_s)
        gpus = [(g.index, g.pci_bus_id) for g in sample.gpus] if sample is not None else []
        extra += xid_findings(found, gpus, options.thresholds)
    net = fabric.finish(
        ports, fabric.gpu_bus_ids([(g.index, g.pci_bus_id) for g in sample.gpus] if sample else [])
    )
    extra += net.findings
    not_checked += [NotChecked(what, why) for what, why in net.not_checked]
    if options.baseline is not None or options.save_baseline is not None:
        why_not = _no_time_for_baseline(options, sample, deadline)
        if why_not is None:
            extra += _baseline(options, sample, net.facts)
        else:
            not_checked.append(NotChecked("baseline comparison", why_not))
    return summarize(sample, judgement, extra, not_checked, time.monotonic() - started, unavailable)


def _no_time_for_baseline(options: CheckOptions, sample: HealthSample | None, deadline: float) -> str | None:
    """Why the baseline comparison cannot run within the budget (``None``: it can). It reads the topology
    again: a GPU that did not answer NVML would cost another deadline, and a read cut short by the
    budget would show GPUs and links as missing that are not. ``--save-baseline`` is never skipped: the
    user asked for the file (a hung GPU still costs its deadline there)."""
    if options.save_baseline is not None:
        return None
    hung = [g.label for g in (sample.gpus if sample else ()) if g.state == GPU_NOT_RESPONDING]
    if hung:
        return f"{', '.join(hung)} did not answer NVML; reading the topology again would wait on it"
    if deadline - time.monotonic() < options.nvml_timeout_s + RESERVE_S:
        return "the time budget ran out before it"
    return None


def _baseline(options: CheckOptions, sample: HealthSample | None, network: Any = None) -> list[Finding]:
    """Save this node's baseline and/or compare it with the given one. ``network`` is ``fabric``'s facts
    (GPUDirect mode, RDMA ports and their rates, IOMMU mode), kept under ``network``."""
    from gputopo.health.network import network_changes
    from gputopo.system.inventory import read_live

    doc = baseline.baseline_from(read_live(nvml_timeout_s=options.nvml_timeout_s), sample)
    if network is not None:
        doc["network"] = dict(network)
    if options.save_baseline is not None:
        try:
            options.save_baseline.write_text(baseline.dumps(doc))
        except OSError as exc:
            raise InputError(
                f"--save-baseline {options.save_baseline}: cannot write it ({exc.strerror or exc})",
                "choose a folder you can write to",
            ) from None
    if options.baseline is None:
        return []
    return baseline.compare(options.baseline, doc) + network_changes(options.baseline.get("network"), network)


def load_baseline(path: Path) -> dict[str, Any]:
    """The baseline document at ``path``; ``InputError`` (exit 2) when it cannot be read or is not one."""
    from gputopo.inputs import read_capped

    label = f"--baseline {path}"
    try:
        data = read_capped(path, label, hint="give a file from --save-baseline")
    except InputError as exc:
        why = exc.message[len(label) + 2 :]
        raise InputError(f"{label}: cannot read it ({why})", "give a file from --save-baseline") from None
    return baseline.loads(data, str(path))
