"""``gputopo check``'s service: read this node through ``system/`` (NVML twice, the kernel log, the
topology for baselines) and judge it with the pure ``health`` package, within a time budget; keep the
check state's whole life cycle (read, a person's take-over, drained or resumed, saved under its lock)
and act on the Slurm node (``health.node_action`` decides).

The CLI builds ``Options`` (validated once, when built: bad input never reaches the machine, so it never
drains), calls ``run`` and renders the ``CheckReport`` (``document()`` is the whole ``gputopo/check/v1``
JSON). ``CheckOptions`` and ``run_check`` are the judgement alone, which ``accept`` and ``doctor`` run
too. ``--subsystem`` answers from the state without reading the GPUs (``answer``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputopo.errors import GputopoError, InputError, UsageError
from gputopo.findings import Finding
from gputopo.health.check import (  # noqa: F401 - re-exported: the CLI's typer defaults
    DEFAULT_BUDGET_S,
    DEFAULT_MAX_AGE_S,
    DEFAULT_NVML_TIMEOUT_S,
    DEFAULT_SAMPLE_S,
    DEFAULT_SINCE,
    DEFAULT_SINCE_S,
    NPD_DEFAULT_MAX_OUTPUT,
    UNKNOWN,
    CheckResult,
    one_line,
    summarize,
    validate_numbers,
)
from gputopo.health.judge import Judgement, NotChecked, judge
from gputopo.health.node_action import DEFAULT_MAX_DRAINED, parse_max_drained
from gputopo.health.readings import HealthSample
from gputopo.health.rules import DEFAULT_THRESHOLDS, Rule, Thresholds
from gputopo.health.xid import parse_since, scan, xid_findings
from gputopo.model import GPU_NOT_ACCESSIBLE, GPU_NOT_RESPONDING

if TYPE_CHECKING:  # the modules the check reads through, loaded when it runs (not for --help)
    from gputopo.health.node_action import Decision, NodeInfo
    from gputopo.health.rules import XidPolicy
    from gputopo.health.state import CheckState
    from gputopo.health.subsystems import AcceptStatus, SubsystemResult, XidCount
    from gputopo.system.kernel_log import KernelLog
    from gputopo.system.slurm_node import SlurmAction
    from gputopo.system.state_file import StateRead

# --max-drained: N nodes, or a fraction of the cluster's (health.node_action.parse_max_drained).
MaxDrained = tuple[int | None, float | None]
# A baseline document (``health.baseline``: what --save-baseline wrote), as JSON reads it.
BaselineDoc = dict[str, object]
# The file --textfile writes in its folder (node_exporter's textfile collector reads *.prom).
PROM_FILE = "gputopo.prom"

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
    baseline: BaselineDoc | None = None
    save_baseline: Path | None = None
    fleet: bool = False
    state: CheckState | None = field(default=None, compare=False)
    expect_imex: bool = False

    def __post_init__(self) -> None:
        validate_numbers(self.sample_s, self.budget_s, self.nvml_timeout_s, self.expect_gpus)


def run_check(options: CheckOptions, started: float | None = None) -> CheckResult:
    """Check this node; ``started`` is the ``time.monotonic()`` reading the budget counts from."""
    from gputopo.health.network import port_counters
    from gputopo.services import fabric
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
    xid_events: tuple[tuple[str, str, int], ...] = ()
    if log.text is None:
        not_checked.append(NotChecked("Xid", log.refused or "the kernel log could not be read"))
    else:
        found = scan(log.text, options.since_s, uptime_s=log.uptime_s)
        gpus = [(g.index, g.pci_bus_id) for g in sample.gpus] if sample is not None else []
        ack = options.state.acknowledged if options.state is not None else None
        driver = sample.driver_version if sample is not None else None
        extra += xid_findings(found, gpus, options.thresholds, acknowledged=ack, driver=driver)
        xid_keys = tuple(e.key for e in found.events if ack is None or not ack.covers(e))
        xid_events = tuple((e.key, e.address, e.xid) for e in found.events)
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
    return replace(
        result,
        ports=port_counters(net.ports),
        xid_events=xid_events,
        redirected=fabric.redirected_in(net.pairs),
    )


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
                rules["driver_unavailable"].finding(
                    "node",
                    f"the NVIDIA driver{module} is broken: {seen}, while GPUs are present ({evidence})",
                )
            )
    gpus = sample.gpus if sample is not None else ()
    refused = [g for g in gpus if g.state == GPU_NOT_ACCESSIBLE]
    if gpus and len(refused) == len(gpus) and os.geteuid() == 0 and rules["gpus_refused"].enabled:
        driver = sample.driver_version if sample is not None and sample.driver_version else "unknown"
        out.append(
            rules["gpus_refused"].finding(
                "node",
                f"every GPU ({len(gpus)}) refused NVML access to root ({refused[0].error}; driver {driver}): "
                "nothing about them could be judged",
            )
        )
    return out


def _since_last_run(options: CheckOptions, sample: HealthSample, window: Judgement) -> list[Finding]:
    """The counter rules judged again over the time since the last check (the state file), where that is
    longer than the sample window: a climb too slow for 2 s is seen over minutes."""
    from gputopo.health.state import previous_sample, since_last_run

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
    from gputopo.health import baseline
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


def load_baseline(path: Path) -> BaselineDoc:
    """The baseline document at ``path``; ``InputError`` (exit 2) when it cannot be read or is not one."""
    from gputopo.health import baseline
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
    from gputopo.system.state_file import writer_path

    return writer_path(node_actions)


def read_state(path: Path, node: str) -> StateRead:
    """The state at ``path`` for ``node`` as ``system.state_file.read_state`` reads it (never raises: a
    state that cannot be used is a fresh one, named in its warnings; an untrusted path comes back
    ``refused``)."""
    from gputopo.system.state_file import read_state as read

    return read(path, node)


def answer(options: Options) -> SubsystemAnswer:
    """``check --subsystem NAME``: the subsystem's result from the state's fresh ``subsystems`` record,
    and the read's warnings. No ``--state``: where readers read (``GPUTOPO_CHECK_STATE``, else root's
    default). A read without the lock (a reader: a save is a rename, so it sees the old file or the new
    one), and nothing is written, so the rules that only answer never wait on a writer. No state to read
    is ``UsageError``; a path not to be trusted is refused (``InputError``, exit 2); a state that cannot
    be used (corrupt, another node's, newer) has no record: unknown."""
    from gputopo.health.subsystems import SUBSYSTEMS_SECTION
    from gputopo.health.subsystems import answer as answer_from
    from gputopo.system.slurm_node import node_name
    from gputopo.system.state_file import reader_path

    if options.subsystem is None:
        raise ValueError("answer: no --subsystem asked")
    path = options.state or reader_path()
    if path is None:
        raise UsageError(
            "--subsystem: needs the check state (--state FILE, or GPUTOPO_CHECK_STATE not empty)",
            "the rule that runs `gputopo check --state FILE` records every subsystem there",
        )
    read = read_state(path, node_name())
    if read.refused is not None:
        raise InputError(read.refused, read.hint)
    doc = read.doc
    section = doc.section(SUBSYSTEMS_SECTION) if doc is not None and not doc.newer else None
    result = answer_from(section, options.subsystem, time.time(), options.max_age_s)
    return SubsystemAnswer(result, tuple(read.warnings))


@dataclass(frozen=True)
class Kept:
    """What keeping the state (and acting on Slurm under its lock) came to: the ``SlurmAction`` (or
    ``None``), warnings to show, what the metrics read of the state, and ``blocked``: why the check
    could not keep its state or act as asked (the lock not got in time, a newer schema under --drain):
    the run then exits 3."""

    slurm: SlurmAction | None = None
    warnings: tuple[str, ...] = ()
    blocked: str | None = None
    # For the metrics, from the sections re-read under the lock (``None``: no state kept this run): the
    # acceptance (``health.subsystems.AcceptStatus``) and the running Xid counts (``XidCount``s).
    acceptance: AcceptStatus | None = None
    xid_counts: tuple[XidCount, ...] | None = None


def keep_state(
    path: Path | None,
    node: str,
    before: CheckState,
    judged: CheckState,
    result: CheckResult,
    view: NodeView | None,
    *,
    drain: bool,
    resume: bool,
    dry_run: bool,
    max_drained: MaxDrained,
    deadline: float,
    now: float,
    shown: tuple[str, ...] = (),
    rule_set: str = "default",
) -> Kept:
    """Act on Slurm (when ``view``: --drain/--resume-if-healthy) and save the state, both under the state's
    lock (``system.state_file.locked``, waited for until ``deadline``, a ``time.monotonic()`` reading).
    Under it the file is read again: another check's sections and everyone else's are kept; this check's
    judgement replaces the last one. ``before`` is check's state as read when this check began and
    ``judged`` what it judged with (a person's take-over applied): when another check changed the node
    record (drain, acknowledgements) in between, this check's view of the node is stale and it does
    nothing to Slurm (the next check decides), so 20 checks at once drain once. Without a state file
    (``path`` ``None``) there is nothing to lock: it acts as asked. ``shown``: warnings already said;
    ``rule_set`` names the rule set whose latest judgement this is (``--thresholds``' file, or
    ``default``)."""
    from gputopo.health import state as st
    from gputopo.system import state_file

    acting = view is not None

    def act(view: NodeView) -> SlurmAction | None:
        return act_on_node(
            result,
            view,
            drain=drain,
            resume=resume,
            dry_run=dry_run,
            max_drained=max_drained,
            deadline=deadline,
        )

    if path is None:
        if view is None:
            return Kept()
        return Kept(act(view))
    warnings: list[str] = []
    blocked = None
    slurm = None
    acceptance, xid_counts = None, None
    try:
        with state_file.locked(path, deadline - time.monotonic()):
            fresh_read = state_file.read_state(path, node)
            said = {_without_age(w) for w in shown}
            warnings += [w for w in fresh_read.warnings if _without_age(w) not in said]
            if fresh_read.refused is not None:
                return Kept(
                    _held(view, f"nothing done: {fresh_read.refused}"), tuple(warnings), fresh_read.refused
                )
            fresh = st.check_state(fresh_read.doc, node)
            same_record = st.node_record(fresh) == st.node_record(before)
            read_only = fresh_read.doc is not None and fresh_read.doc.newer
            if acting and read_only:
                blocked = f"{path} was written by a newer gputopo (schema v{fresh_read.doc.version})"
                slurm = _held(view, f"nothing done: {blocked}")
            elif (
                acting
                and not same_record
                and not dry_run
                and _would_act(result, view, drain, resume, max_drained)
            ):
                verb = (
                    "not drained"
                    if _would_act(result, view, drain, resume, max_drained) == "drain"
                    else "not resumed"
                )
                slurm = _held(
                    view,
                    f"{verb}: another gputopo check changed this node's record in the state file during this "
                    "one (drained, resumed or acknowledged); the next check decides",
                )
            elif view is not None:
                slurm = act(view)
            mine = judged
            if slurm is not None and slurm.done and slurm.action == "drain":
                mine = st.drained(mine, slurm.reason or "", result.xid_keys, now)
            elif slurm is not None and slurm.done and slurm.action == "resume":
                mine = st.resumed(mine)
            if result.verdict != "unknown":
                mine = st.remember_judgement(
                    mine, now, result.verdict, result.findings, result.sample, result.ports, rule_set
                )
            new = st.merged(fresh, mine, with_record=acting and same_record and not read_only)
            if fresh_read.read_only is None:
                doc, acceptance, xid_counts = _with_subsystems(
                    st.with_check_state(fresh_read.doc, new), result, now
                )
                failed = state_file.save(fresh_read, doc)
                if failed is not None:
                    warnings.append(f"--state {failed}")
    except state_file.LockNotGot as exc:
        if acting or exc.busy:
            blocked = exc.message
        if acting:
            slurm = _held(view, f"nothing done: {exc.message}")
        else:
            warnings.append(f"--state {path}: not saved ({exc.message})")
    return Kept(slurm, tuple(warnings), blocked, acceptance, xid_counts)


def _with_subsystems(doc: Any, result: CheckResult, now: float) -> tuple[Any, Any, tuple[Any, ...]]:
    """``doc`` (the state re-read under the lock, this check's sections in it) with the per-subsystem
    record node-problem-detector's one-subsystem rules answer from and the running Xid counters
    (``health.subsystems.sections_after``: counted from the sections as they are under the lock, so two
    checks never count a line twice); also the acceptance and the Xid counts, for the metrics."""
    from gputopo.accept import record
    from gputopo.health.subsystems import sections_after

    # accept's section through accept's own reader: only a record in the shape it writes is judged.
    sections = {**doc.sections, record.KEY: record.from_section(doc.section(record.KEY))}
    new, acceptance, xid_counts = sections_after(sections, result, now)
    for name, value in new.items():
        doc = doc.with_section(name, value)
    return doc, acceptance, xid_counts


def _without_age(warning: str) -> str:
    """A warning without the backup's age in it (``(saved 5 s ago)``), which changes between two reads."""
    import re

    return re.sub(r" \(saved \d+ (?:min|s) ago\)", "", warning)


def _would_act(
    result: CheckResult, view: NodeView, drain: bool, resume: bool, max_drained: MaxDrained
) -> str | None:
    """drain or resume when ``health.node_action.decide`` calls for it on what ``view`` showed."""
    action = _decide(result, view, drain, resume, max_drained).action
    return action if action in ("drain", "resume") else None


def _decide(
    result: CheckResult, view: NodeView, drain: bool, resume: bool, max_drained: MaxDrained
) -> Decision:
    """``health.node_action.decide`` on this check's result and the node and cluster ``view`` showed
    (``--max-drained`` counted against the cluster's nodes, when they could be read)."""
    from gputopo.health.node_action import decide, max_drained_nodes

    limit = max_drained_nodes(*max_drained, view.cluster_nodes) if view.cluster_nodes else None
    return decide(
        result.verdict,
        result.findings,
        view.node,
        drain=drain,
        resume=resume,
        drained_elsewhere=view.drained_elsewhere,
        max_drained=limit,
    )


def _held(view: NodeView | None, why: str) -> SlurmAction | None:
    from gputopo.system import slurm_node

    if view is None:
        return None
    return slurm_node.SlurmAction("none", None, False, None, why, view.node)


@dataclass(frozen=True)
class NodeView:
    """This Slurm node and the cluster as ``scontrol show node`` showed them before the check: the node
    (``None`` with ``error`` when it could not be read) and how many other nodes carry a gputopo drain."""

    name: str
    node: NodeInfo | None = None
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
    max_drained: MaxDrained,
    deadline: float,
) -> SlurmAction | None:
    """Drain or resume this node as ``health.node_action.decide`` allows; the ``SlurmAction`` (with what
    was held back and why), or ``None`` when nothing was asked or called for."""
    from gputopo.system import slurm_node

    decision = _decide(result, view, drain, resume, max_drained)
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


def accept_status(path: Path | None, node: str, result: CheckResult) -> dict[str, Any] | None:
    """``gputopo accept``'s verdict kept in the state file at ``path`` (its ``accept`` section, read through
    ``system.state_file.read_state`` like the rest of the state) and whether it still holds for the GPUs
    and driver this check read (``accept.record.status``); ``None`` without a state or a verdict. A state
    that cannot be used was already named in check's own warnings, so none is added here."""
    from gputopo.accept import record
    from gputopo.system.state_file import read_state as read

    if path is None:
        return None
    doc = read(path, node).doc
    sample = result.sample
    gpus = None
    if sample is not None and sample.gpus:
        gpus = [
            {"index": g.index, "uuid": g.uuid, "serial": g.serial, "vbios": g.vbios_version}
            for g in sample.gpus
        ]
    return record.status(record.from_doc(doc), sample.driver_version if sample else None, gpus)


# --- the command: Options -> run -> CheckReport -------------------------------------------------------------


@dataclass(frozen=True)
class RuleSet:
    """The rules a check judges with (``--thresholds`` and ``--xid-policy`` applied) and the name its
    judgement is kept under in the state (the thresholds file's absolute path, or ``default``)."""

    thresholds: Thresholds = DEFAULT_THRESHOLDS
    name: str = "default"


def load_rules(thresholds: Path | None, xid_policy: Path | None) -> RuleSet:
    """``--thresholds FILE`` and ``--xid-policy FILE`` read (``InputError``, exit 2, for a bad one);
    ``--xid-policy`` wins over an ``xid_policy`` table in the thresholds file."""
    from gputopo.health.rules import load_thresholds, load_xid_policy

    rules = load_thresholds(thresholds) if thresholds is not None else DEFAULT_THRESHOLDS
    if xid_policy is not None:
        rules = replace(rules, xid_policy=load_xid_policy(xid_policy))
    return RuleSet(rules, os.path.abspath(thresholds) if thresholds is not None else "default")


def rule_table(rules: RuleSet) -> tuple[list[Rule], list[dict[str, object]], XidPolicy | None]:
    """``--list-rules``: every rule row, every Xid row (the policy applied), and the Xid policy."""
    from gputopo.health.xid import xid_rows

    policy = rules.thresholds.xid_policy
    return list(rules.thresholds.rules.values()), xid_rows(policy), policy


@dataclass(frozen=True, kw_only=True)
class Options:
    """What ``gputopo check`` was asked, keyword only, validated when built (``UsageError``, exit 2: bad
    input never reaches the machine, so it never drains). Files it names (``baseline``, ``kernel_log``)
    are read by ``run`` before anything else; ``output`` is the format's name (``ui.check_view``'s
    table), ``max_drained`` ``N`` or ``N%``, ``debug`` lets an internal error's traceback through."""

    sample_s: float = DEFAULT_SAMPLE_S
    budget_s: float = DEFAULT_BUDGET_S
    nvml_timeout_s: float = DEFAULT_NVML_TIMEOUT_S
    expect_gpus: int | None = None
    expect_imex: bool = False
    rules: RuleSet = field(default_factory=RuleSet)
    since: str = DEFAULT_SINCE
    kernel_log: str | None = None  # FILE, or - for stdin; None: this machine's
    save_baseline: Path | None = None
    fleet: bool = False
    baseline: Path | None = None
    drain: bool = False
    resume_if_healthy: bool = False
    dry_run: bool = False
    max_drained: str = DEFAULT_MAX_DRAINED
    state: Path | None = None
    output: str = "text"
    max_output_length: int = NPD_DEFAULT_MAX_OUTPUT
    textfile: Path | None = None
    subsystem: str | None = None
    max_age_s: float = DEFAULT_MAX_AGE_S
    debug: bool = False

    def __post_init__(self) -> None:
        if self.subsystem is not None:  # an answer from the state: nothing else of a check is used
            self._check_subsystem()
            return
        self.since_s  # noqa: B018 - UsageError for text that is no duration
        validate_numbers(self.sample_s, self.budget_s, self.nvml_timeout_s, self.expect_gpus)
        self.max_drained_limit  # noqa: B018 - UsageError for text that is neither N nor N%
        self._check_output_length()
        if self.textfile is not None and not self.textfile.is_dir():
            raise UsageError(
                f"--textfile {self.textfile}: not a folder",
                "name node_exporter's --collector.textfile.directory",
            )
        if self.fleet and self.save_baseline is None:
            raise UsageError(
                "--fleet: only with --save-baseline FILE", "gputopo check --save-baseline FILE --fleet"
            )

    def _check_subsystem(self) -> None:
        from gputopo.health.subsystems import BY_NAME

        if self.output != "npd":
            raise UsageError(
                "--subsystem: only with --format npd", "gputopo check --format npd --subsystem NAME"
            )
        self._check_output_length()
        if self.subsystem not in BY_NAME:
            raise UsageError(f"--subsystem {self.subsystem}: not a subsystem", f"one of {', '.join(BY_NAME)}")
        if not self.max_age_s > 0:
            raise UsageError(
                f"--max-age {self.max_age_s:g}: must be more than 0 seconds", "e.g. --max-age 120"
            )

    def _check_output_length(self) -> None:
        if self.max_output_length < 1:
            raise UsageError(
                f"--max-output-length {self.max_output_length}: must be 1 or more", "NPD's default is 80"
            )

    @property
    def since_s(self) -> float:
        return parse_since(self.since)

    @property
    def max_drained_limit(self) -> MaxDrained:
        return parse_max_drained(self.max_drained)

    @property
    def acting(self) -> bool:
        """--drain or --resume-if-healthy: the check acts on its Slurm node."""
        return self.drain or self.resume_if_healthy


def _ignore(_: str) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """What the service tells its caller while it runs: ``warn``, a line for stderr (a state that could
    not be used, a lock not got, a save that failed)."""

    warn: Callable[[str], None] = _ignore


@dataclass(frozen=True)
class SubsystemAnswer:
    """``--subsystem``'s answer (``health.subsystems.SubsystemResult``) and the state read's warnings."""

    result: SubsystemResult
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckReport:
    """What a check came to: the judgement (``result``), what was done to the Slurm node (or held back),
    ``accept``'s stored verdict and whether it still holds, what the metrics read of the state
    (``acceptance``, ``xid_counts``; ``None`` without a state) and the check's wall-clock time.
    ``document()`` is the whole ``gputopo/check/v1`` JSON."""

    result: CheckResult
    slurm: SlurmAction | None = None
    accept: dict[str, Any] | None = None
    acceptance: AcceptStatus | None = None
    xid_counts: tuple[XidCount, ...] | None = None
    now: float = 0.0

    @property
    def exit_code(self) -> int:
        return self.result.exit_code

    def document(self) -> dict[str, Any]:
        slurm = {"slurm": self.slurm.to_json()} if self.slurm is not None else {}
        return {**self.result.to_json(), **slurm, "accept": self.accept}

    def with_files(self, paths: Any) -> CheckReport:
        return self  # check writes no report files (--textfile is the caller's, after rendering)

    @property
    def dry_run_line(self) -> str | None:
        """--dry-run: the scontrol command a check would have run (``None``: none, or it ran)."""
        s = self.slurm
        return s.command if s is not None and s.command and not s.done and s.error is None else None


def run(options: Options, hooks: Hooks, started: float | None = None) -> CheckReport:
    """Check this node as ``options`` ask: read the inputs it names, the state (a person's drain or resume
    since gputopo's taken over), the Slurm node (when acting), judge, then act and save under the
    state's lock. ``started``: the ``time.monotonic()`` reading the budget counts from."""
    from gputopo.health.state import CheckState

    started = time.monotonic() if started is None else started
    judging = _judging(options)  # every file named is read before the machine is touched
    node, path = _node_name(), options.state or default_state_path(options.acting)
    before, said = _load_state(path, node, options.acting)
    for warning in said:
        hooks.warn(warning)
    state, view, now = before, None, time.time()
    if options.acting:
        state, view = _take_over(state, started + options.budget_s / 4, now)
    result = _judge(replace(judging, state=state), options.debug, started)
    kept = keep_state(
        path,
        node,
        before or CheckState(node),
        state or CheckState(node),
        result,
        view,
        drain=options.drain,
        resume=options.resume_if_healthy,
        dry_run=options.dry_run,
        max_drained=options.max_drained_limit,
        deadline=started + options.budget_s,
        now=now,
        shown=said,
        rule_set=options.rules.name,
    )
    for warning in kept.warnings:
        hooks.warn(warning)
    if kept.blocked is not None:
        result = _blocked(result, kept.blocked)
    acceptance = accept_status(path, node, result)
    return CheckReport(result, kept.slurm, acceptance, kept.acceptance, kept.xid_counts, now)


def _judging(options: Options) -> CheckOptions:
    """The judgement's options, with the baseline and the saved kernel log read (``InputError``, exit 2,
    for one that cannot be); ``--save-baseline`` refused first when it cannot take a file."""
    saved = load_baseline(options.baseline) if options.baseline is not None else None
    if options.save_baseline is not None:
        from gputopo.outputs import check_output

        check_output(options.save_baseline, "--save-baseline", "golden.json")
    log = None
    if options.kernel_log is not None:
        from gputopo.system.kernel_log import read_log_file

        log = read_log_file(options.kernel_log)
    return CheckOptions(
        sample_s=options.sample_s,
        budget_s=options.budget_s,
        nvml_timeout_s=options.nvml_timeout_s,
        expect_gpus=options.expect_gpus,
        expect_imex=options.expect_imex,
        thresholds=options.rules.thresholds,
        since_s=options.since_s,
        kernel_log=log,
        baseline=saved,
        save_baseline=options.save_baseline,
        fleet=options.fleet,
    )


def _node_name() -> str:
    from gputopo.system.slurm_node import node_name

    return node_name()


def _load_state(path: Path | None, node: str, acting: bool) -> tuple[CheckState | None, tuple[str, ...]]:
    """check's sections of the state at ``path`` (``None``: no state), and the read's warnings; a fresh
    state when it is new or cannot be used (named in a warning). A path not to be trusted (a symbolic
    link; as root, another user's or a writable file or folder) stops the check before anything is
    read: exit 2, or 3 when acting on Slurm (a health check that cannot run)."""
    if path is None:
        return None, ()
    from gputopo.errors import UnavailableError
    from gputopo.health.state import check_state

    read = read_state(path, node)
    if read.refused is not None:
        raise (UnavailableError if acting else InputError)(read.refused, read.hint)
    return check_state(read.doc, node), tuple(read.warnings)


def _take_over(state: CheckState | None, deadline: float, now: float) -> tuple[CheckState | None, NodeView]:
    """Read the Slurm node first (its state and reason): a person's resume or drain since gputopo
    drained it acknowledges the Xid lines up to now, before they are judged. ``deadline``: a quarter of
    the budget at most, so a hung scontrol leaves the GPUs their time."""
    from gputopo.health.state import took_over

    view = read_node_view(deadline)
    if state is not None and view.node is not None:
        state = took_over(state, view.node.out_of_service, view.node.ours, now)
    return state, view


def _judge(options: CheckOptions, debug: bool, started: float) -> CheckResult:
    """``run_check``; a bug must not read as "problems" (exit 1: node-problem-detector would mark the
    node, and a scheduler could drain it): the check could not run, which is unknown (exit 3)."""
    try:
        return run_check(options, started)
    except GputopoError:
        raise
    except Exception as exc:
        if debug:
            raise
        why = f"internal error: {type(exc).__name__}: {exc}"
        return summarize(None, None, (), (), time.monotonic() - started, why)


def _blocked(result: CheckResult, why: str) -> CheckResult:
    """The result of a check that could not keep its state or act as asked: unknown (exit 3), saying why
    and what the check found."""
    return replace(
        result,
        verdict=UNKNOWN,
        reason=one_line(f"nothing done to Slurm, nothing saved: {why} (the check: {result.reason})"),
    )


def write_textfile(folder: Path, text: str) -> list[str]:
    """``DIR/gputopo.prom`` written atomically (a temporary file in DIR and a rename): node_exporter never
    reads half a file. The warnings (one when it could not be written)."""
    from gputopo.outputs import atomic_write

    try:
        atomic_write(folder / PROM_FILE, text)
    except (OSError, GputopoError) as exc:
        why = getattr(exc, "message", None) or getattr(exc, "strerror", None) or str(exc)
        return [f"--textfile {folder}: {PROM_FILE} not written ({why})"]
    return []
