"""``gputopo check``'s service: read this node through ``system/`` (NVML twice, the kernel log, the
topology for baselines) and judge it with the pure ``health`` package, within a time budget.

The CLI parses and validates the options (bad input never reaches here, so it never drains), calls
``run_check``, and renders the ``health.check.CheckResult``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gputopo import fabric
from gputopo.errors import InputError
from gputopo.findings import Finding
from gputopo.health import baseline
from gputopo.health.check import (
    DEFAULT_BUDGET_S,
    DEFAULT_NVML_TIMEOUT_S,
    DEFAULT_SAMPLE_S,
    DEFAULT_SINCE_S,
    CheckResult,
    summarize,
    validate_numbers,
)
from gputopo.health.judge import Judgement, NotChecked, judge
from gputopo.health.network import port_counters
from gputopo.health.readings import HealthSample
from gputopo.health.rules import DEFAULT_THRESHOLDS, Thresholds
from gputopo.health.state import CheckState, previous_sample, since_last_run
from gputopo.health.xid import scan, xid_findings
from gputopo.model import GPU_NOT_ACCESSIBLE, GPU_NOT_RESPONDING
from gputopo.system.kernel_log import KernelLog

# Time kept back from the budget for what follows the NVML reads (kernel log, output).
RESERVE_S = 1.0
# Counters are judged again over the time since the last check only when that is longer than this.
MIN_SINCE_LAST_S = 10.0


@dataclass(frozen=True, kw_only=True)
class CheckOptions:
    """What ``gputopo check`` was asked, keyword only, validated when built (``UsageError``, exit 2: bad
    input never reaches the machine, so it never drains). Every default is written once, in
    ``health.check``. ``kernel_log`` is a log the user gave (``None``: read this machine's); ``baseline``
    a loaded baseline document to compare with; ``fleet`` saves a baseline without per-GPU identities;
    ``state`` what the last check left (``health.state``); ``expect_imex`` judges IMEX even where this
    node has no IMEX configuration (``health.imex``)."""

    sample_s: float = DEFAULT_SAMPLE_S
    budget_s: float = DEFAULT_BUDGET_S
    nvml_timeout_s: float = DEFAULT_NVML_TIMEOUT_S
    expect_gpus: int | None = None
    thresholds: Thresholds = DEFAULT_THRESHOLDS
    since_s: float | None = DEFAULT_SINCE_S
    kernel_log: KernelLog | None = None
    baseline: dict[str, Any] | None = None
    save_baseline: Path | None = None
    fleet: bool = False
    state: CheckState | None = field(default=None, compare=False)
    expect_imex: bool = False

    def __post_init__(self) -> None:
        validate_numbers(self.sample_s, self.budget_s, self.nvml_timeout_s, self.expect_gpus)


def run_check(options: CheckOptions, started: float | None = None) -> CheckResult:
    """Check this node; ``started`` is the ``time.monotonic()`` reading the budget counts from."""
    from gputopo.system import nvml
    from gputopo.system.health_reads import sample_health
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
        first, sample = sample_health(options.sample_s, timeout_s=per_gpu_s, deadline=deadline - RESERVE_S)
        judgement = judge(first, sample, thresholds=options.thresholds, expect_gpus=options.expect_gpus)
    except nvml.NvmlUnavailable as exc:
        unavailable = exc.message
    extra += _unknown_is_not_healthy(options, sample, unavailable)
    if sample is not None and judgement is not None and options.state is not None:
        extra += _since_last_run(options, sample, judgement)
    log = options.kernel_log
    if log is None:
        log = read_kernel_log(options.since_s, timeout_s=max(0.5, min(5.0, deadline - time.monotonic())))
    xid_keys: tuple[str, ...] = ()
    if log.text is None:
        not_checked.append(NotChecked("Xid", log.refused or "the kernel log could not be read"))
    else:
        found = scan(log.text, options.since_s, uptime_s=log.uptime_s)
        gpus = [(g.index, g.pci_bus_id) for g in sample.gpus] if sample is not None else []
        ack = options.state.acknowledged if options.state is not None else None
        driver = sample.driver_version if sample is not None else None
        extra += xid_findings(found, gpus, options.thresholds, acknowledged=ack, driver=driver)
        xid_keys = tuple(e.key for e in found.events if ack is None or not ack.covers(e))
    net = fabric.finish(
        ports,
        fabric.gpu_bus_ids([(g.index, g.pci_bus_id) for g in sample.gpus] if sample else []),
        options.thresholds,
    )
    extra += net.findings
    not_checked += [NotChecked(what, why) for what, why in net.not_checked]
    if options.state is not None:  # the ports' counters over the time since the last check, too
        extra += fabric.since_last_run(net, options.state.ports, options.state.ports_at, options.thresholds)
    imex_found, imex_skipped = _imex(options, deadline)
    extra += imex_found
    not_checked += imex_skipped
    if options.baseline is not None or options.save_baseline is not None:
        why_not = _no_time_for_baseline(options, sample, deadline)
        if why_not is None:
            extra += _baseline(options, sample, net.facts)
        else:
            not_checked.append(NotChecked("baseline comparison", why_not))
    result = summarize(
        sample, judgement, extra, not_checked, time.monotonic() - started, unavailable, xid_keys=xid_keys
    )
    return replace(result, ports=port_counters(net.ports))


def _imex(options: CheckOptions, deadline: float) -> tuple[list[Finding], list[NotChecked]]:
    """IMEX, only where a daemon is expected (its configuration, or ``--expect-imex``); nvidia-imex-ctl
    runs within the time left."""
    from gputopo.health.imex import judge_imex
    from gputopo.system.imex import read_imex

    return judge_imex(read_imex(options.expect_imex, deadline), options.expect_imex, options.thresholds)


def _unknown_is_not_healthy(
    options: CheckOptions, sample: HealthSample | None, unavailable: str | None
) -> list[Finding]:
    """Unknown is not healthy: NVML failing (or seeing no GPU) while the device files, the driver's procfs
    or ``--expect-gpus`` say GPUs are there is a broken driver; every GPU refusing root is too."""
    from gputopo.system.nvidia_devices import read_nvidia_devices

    rules = options.thresholds
    out: list[Finding] = []
    no_gpus = unavailable is not None or (sample is not None and not sample.gpus)
    if no_gpus and rules["driver_unavailable"].enabled:
        devices = read_nvidia_devices()
        expected = options.expect_gpus or 0
        if devices.count or expected:
            evidence = devices.words() if devices.count else "no NVIDIA device files"
            if expected:
                evidence += f"; --expect-gpus {expected}"
            seen = unavailable or "NVML lists no GPU"
            module = f" (kernel module {devices.module})" if devices.module else ""
            out.append(
                Finding(
                    "node",
                    f"the NVIDIA driver{module} is broken: {seen}, while GPUs are present ({evidence})",
                    "a driver/library version mismatch needs a reboot (or reloading the nvidia modules); "
                    "otherwise reinstall the driver; `nvidia-smi` shows the same error",
                    rules["driver_unavailable"].severity,
                    gpu=None,
                    category="driver",
                    action=rules["driver_unavailable"].action,
                    rule="driver_unavailable",
                )
            )
    gpus = sample.gpus if sample is not None else ()
    refused = [g for g in gpus if g.state == GPU_NOT_ACCESSIBLE]
    if gpus and len(refused) == len(gpus) and os.geteuid() == 0 and rules["gpus_refused"].enabled:
        out.append(
            Finding(
                "node",
                f"every GPU ({len(gpus)}) refused NVML access to root ({refused[0].error}; driver "
                f"{sample.driver_version if sample is not None and sample.driver_version else 'unknown'}): "
                "nothing about them could be judged",
                "check the driver (`nvidia-smi`) and the device files' permissions (`ls -l /dev/nvidia*`)",
                rules["gpus_refused"].severity,
                gpu=None,
                category="driver",
                action=rules["gpus_refused"].action,
                rule="gpus_refused",
            )
        )
    return out


def _since_last_run(options: CheckOptions, sample: HealthSample, window: Judgement) -> list[Finding]:
    """The counter rules judged again over the time since the last check (the state file), where that is
    longer than the sample window: a climb too slow for 2 s is seen over minutes."""
    state = options.state
    if state is None or state.counters_at is None:
        return []
    elapsed = time.time() - state.counters_at
    if elapsed < max(MIN_SINCE_LAST_S, options.sample_s):
        return []
    prev = previous_sample(state, sample)
    if prev is None:
        return []
    over = judge(prev, sample, window_s=elapsed, thresholds=options.thresholds)
    return since_last_run(over.findings, window.findings, elapsed / 60)


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
        from gputopo.outputs import write_output

        saved = baseline.fleet_baseline(doc) if options.fleet else doc
        write_output(options.save_baseline, baseline.dumps(saved), "--save-baseline")
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


# --- the state file and the Slurm node ----------------------------------------------------------------------


def default_state_path(node_actions: bool) -> Path | None:
    """``--state``'s default: ``GPUTOPO_CHECK_STATE`` when set (empty: none); for root acting on its Slurm
    node (``--drain``/``--resume-if-healthy``), ``/var/lib/gputopo/check-state.json``; else none."""
    from gputopo.health.state import DEFAULT_ROOT_PATH, STATE_ENV

    if STATE_ENV in os.environ:
        value = os.environ[STATE_ENV]
        return Path(value) if value else None
    if node_actions and os.geteuid() == 0:
        return Path(DEFAULT_ROOT_PATH)
    return None


def load_state(path: Path, node: str) -> tuple[CheckState, str | None]:
    """The state at ``path`` for ``node`` and a warning when it had to be replaced (never raises: a state
    that cannot be read is a fresh one, named in the warning)."""
    from gputopo.health.state import loads

    try:
        with open(path, "rb") as fh:
            data = fh.read(4 * 1024 * 1024 + 1)
    except FileNotFoundError:
        return loads(None, str(path), node)
    except OSError as exc:
        state, _ = loads(None, str(path), node)
        return state, f"--state {path}: cannot read it ({exc.strerror or exc}); starting afresh"
    if len(data) > 4 * 1024 * 1024:
        state, _ = loads(None, str(path), node)
        return state, f"--state {path}: too large to be a gputopo check state; it is replaced"
    return loads(data.decode("utf-8", errors="replace"), str(path), node)


@dataclass(frozen=True)
class NodeView:
    """This Slurm node and the cluster as ``scontrol show node`` showed them before the check: the node
    (``None`` with ``error`` when it could not be read) and how many other nodes carry a gputopo drain."""

    name: str
    node: Any = None
    cluster_nodes: int = 0
    drained_elsewhere: int = 0
    error: str | None = None


def read_node_view(deadline: float) -> NodeView:
    """Read every node once (inside the budget: ``deadline`` is a ``time.monotonic()`` reading)."""
    from gputopo.system import slurm_node

    name = slurm_node.node_name()
    nodes, err = slurm_node.read_nodes(deadline - time.monotonic())
    if nodes is None:
        return NodeView(name, error=err)
    mine = next((n for n in nodes if n.name == name), None)
    others = sum(1 for n in nodes if n.name != name and n.drained_by_gputopo)
    if mine is None:
        return NodeView(name, None, len(nodes), others, f"Slurm has no node named {name!r} (SLURMD_NODENAME)")
    return NodeView(name, mine, len(nodes), others)


def act_on_node(
    result: CheckResult,
    view: NodeView,
    *,
    drain: bool,
    resume: bool,
    dry_run: bool,
    max_drained: tuple[int | None, float | None],
    deadline: float,
) -> Any:
    """Drain or resume this node as ``health.node_action.decide`` allows; the ``SlurmAction`` (with what
    was held back and why), or ``None`` when nothing was asked or called for."""
    from gputopo.health.node_action import decide, max_drained_nodes
    from gputopo.system import slurm_node

    limit = max_drained_nodes(*max_drained, view.cluster_nodes) if view.cluster_nodes else None
    decision = decide(
        result.verdict,
        result.findings,
        view.node,
        drain=drain,
        resume=resume,
        drained_elsewhere=view.drained_elsewhere,
        max_drained=limit,
    )
    if decision.action == "drain" and decision.reason is not None:
        done = slurm_node.drain(view.name, decision.reason, dry_run, deadline - time.monotonic())
        return replace(done, node=view.node, reason=decision.reason)
    if decision.action == "resume":
        done = slurm_node.resume(view.name, dry_run, deadline - time.monotonic())
        return replace(done, node=view.node)
    held = decision.held_back
    if held is not None and view.error is not None and view.node is None:
        held = f"{held} ({view.error})"
    if held is None and view.error is not None and (drain or resume) and result.verdict != "unknown":
        held = f"nothing done: the node's state could not be read ({view.error})"
    if held is None:
        return None
    # A dry run previews the command the check calls for even where it is held back (the node's state
    # unreadable, someone else's drain, --max-drained), beside what holds it back.
    command = None
    if dry_run and decision.withheld is not None:
        command = slurm_node.command_line(decision.withheld, view.name, decision.reason)
    return slurm_node.SlurmAction(
        "none", command, False, None, held, view.node, decision.reason, dry_run, decision.withheld
    )


def accept_status(path: Path | None, result: CheckResult) -> dict[str, Any] | None:
    """``gputopo accept``'s verdict kept in the state file at ``path`` and whether it still holds for the
    GPUs and driver this check read (``accept.record.status``); ``None`` without a state or a verdict."""
    from gputopo.accept import record

    if path is None:
        return None
    sample = result.sample
    gpus = None
    if sample is not None and sample.gpus:
        gpus = [
            {"index": g.index, "uuid": g.uuid, "serial": g.serial, "vbios": g.vbios_version}
            for g in sample.gpus
        ]
    return record.status(
        record.from_state_text(state_text(path)), sample.driver_version if sample else None, gpus
    )


def state_text(path: Path) -> str | None:
    """The state file's text, or ``None`` when there is none or it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(4 * 1024 * 1024)
    except OSError:
        return None
