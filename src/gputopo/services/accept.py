"""``gputopo accept``'s service: may this node take jobs? Its steps, in order, within a budget, to one
verdict (``accept.steps``), kept in the check state file (``accept.record``), and with ``--gate`` the
Slurm node drained while it runs and resumed only when accepted.

The steps: **inventory** (one NVML sample: the GPUs expected are there, readable, one VBIOS per model,
the fabric), **health** (the whole ``gputopo check``), **DCGM's diagnostics** (when asked), **each GPU
alone** (the probe's per-GPU check against the floors) and **the wiring** (no GPU drained of P2P, the P2P
data check on every pair, an all-reduce over every GPU). The first failure stops the run unless
``keep_going``; a step with no time left in the budget is "not checked".

The CLI builds ``Options`` (validated once, here), calls ``run`` and renders the ``AcceptReport``; no
console or typer object comes down: ``Hooks`` carries the callbacks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gputopo import __version__
from gputopo.accept import DEFAULT_BUDGET_S, DEFAULT_REPORT_DIR, record, steps
from gputopo.accept.floors import FloorTable, packaged
from gputopo.accept.steps import FAILED, SCHEMA, StepResult
from gputopo.errors import EXIT_UNAVAILABLE, GputopoError, UsageError
from gputopo.health.check import DEFAULT_NVML_TIMEOUT_S, DEFAULT_SAMPLE_S, DEFAULT_SINCE_S
from gputopo.health.check import DEFAULT_SINCE as DEFAULT_SINCE  # the CLI's --since default
from gputopo.health.dcgm_diag import DcgmDiagResult
from gputopo.health.rules import DEFAULT_THRESHOLDS, Thresholds
from gputopo.probe.plan.options import PER_GPU_FAULTS, Fault
from gputopo.system.kernel_log import KernelLog

# Each step's share of the budget at most (what is left is the cap when less is left).
STEP_BUDGET_S = {"inventory": 60.0, "health": 60.0, "dcgm": 900.0, "per_gpu": 600.0, "wiring": 600.0}
# A step is not started with less time than this left in the budget: it is "not checked".
MIN_STEP_S = 2.0
# The shortest no-progress limit a probe step gets (``_probe_timeout``).
PROBE_SILENCE_S = 60.0
GATE_REASON = "gputopo: accepting"
# The verdict is kept, and the gate's last Slurm action taken, under the state's lock, waited for with
# what is left of --budget but at least this long: a check holds the lock for a read, an scontrol call and
# a save, and the verdict of a run that used its whole budget is still worth keeping.
MIN_LOCK_WAIT_S = 5.0
DCGM_LEVELS = (1, 2, 3, 4)
# CPU stand-in ranks exist for indices 0-7 only (probe.plan.config.CPU_STAND_INS).
MAX_STAND_INS = 8


def _ignore(*_: Any) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """What the service tells its caller while it runs: ``warn`` (a line for stderr) and ``progress``
    (a step's name and a line about it: started, its result)."""

    warn: Callable[[str], None] = _ignore
    progress: Callable[[str, str], None] = _ignore


@dataclass(frozen=True, kw_only=True)
class Options:
    """What ``gputopo accept`` was asked, keyword only, validated when built (``UsageError``, exit 2:
    bad input never reaches the machine, and never drains)."""

    expect_gpus: int | None = None
    expect_model: str | None = None
    expect_imex: bool = False
    device: str | None = None  # cuda | cpu (CPU ranks stand in for the GPUs) | None: cuda
    budget_s: float = DEFAULT_BUDGET_S
    keep_going: bool = False
    floors: FloorTable = field(default_factory=packaged, compare=False)
    dcgm_level: int | None = None
    dcgm_diag: Path | None = None
    # the saved result ``--dcgm-diag`` names, read before anything else (``read_dcgm_file``)
    dcgm_saved: DcgmDiagResult | None = field(default=None, compare=False)
    thresholds: Thresholds = DEFAULT_THRESHOLDS
    sample_s: float = DEFAULT_SAMPLE_S
    since_s: float | None = DEFAULT_SINCE_S
    kernel_log: KernelLog | None = field(default=None, compare=False)  # a saved log (None: this machine's)
    nvml_timeout_s: float = DEFAULT_NVML_TIMEOUT_S
    report_dir: Path = Path(DEFAULT_REPORT_DIR)
    state_path: Path | None = None
    gate: bool = False
    dry_run: bool = False
    inject: Fault | None = None  # a drill: plant sdc or slow in the per-GPU check on ``inject_gpus``
    inject_gpus: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.budget_s < math.inf:
            raise UsageError(f"--budget {self.budget_s:g}: must be more than 0 seconds", "e.g. --budget 1800")
        if self.expect_gpus is not None and self.expect_gpus < 1:
            raise UsageError(f"--expect-gpus {self.expect_gpus}: must be 1 or more", "e.g. --expect-gpus 8")
        if self.expect_model is not None and not self.expect_model.strip():
            raise UsageError("--expect-model: empty", "e.g. --expect-model H100")
        if self.device not in (None, "cuda", "cpu"):
            raise UsageError(f"--device {self.device}: not a device", "cuda or cpu")
        if self.dcgm_level is not None and self.dcgm_level not in DCGM_LEVELS:
            raise UsageError(
                f"--dcgm-level {self.dcgm_level}: DCGM's levels are 1 to 4",
                "1 quick (seconds), 2 medium (~2 min), 3 long (~30 min), 4 extended (1-2 h)",
            )
        if self.dcgm_level is not None and self.dcgm_diag is not None:
            raise UsageError(
                "--dcgm-level runs DCGM; --dcgm-diag reads a saved run: give one", "drop one of them"
            )
        if self.dry_run and not self.gate:
            raise UsageError("--dry-run: only with --gate", "gputopo accept --gate --dry-run")
        if self.inject_gpus is not None and self.inject is None:
            raise UsageError("--inject-gpus needs --inject", "e.g. --inject sdc --inject-gpus 1")
        if self.inject is not None and self.inject not in PER_GPU_FAULTS:
            raise UsageError(
                f"--inject {self.inject.value}: accept plants only the per-GPU check's drills",
                "--inject sdc or --inject slow, with --inject-gpus N",
            )
        if self.inject is not None and self.inject_gpus is None:
            raise UsageError(f"--inject {self.inject.value} needs --inject-gpus", "e.g. --inject-gpus 1")
        if self.inject_gpus is not None:
            from gputopo.gpulist import parse_gpu_list

            parse_gpu_list(self.inject_gpus, "--inject-gpus")  # UsageError for text that is no GPU list

    @property
    def asked(self) -> tuple[str, ...]:
        """The steps this run is asked for, in order (DCGM's only with ``--dcgm-level``/``--dcgm-diag``)."""
        dcgm = self.dcgm_level is not None or self.dcgm_diag is not None
        return tuple(s for s in steps.STEPS if s != "dcgm" or dcgm)


@dataclass(frozen=True)
class AcceptReport:
    """What ``run`` found: the steps, the node (name, driver, GPUs), the Slurm gate's actions, the stored
    record's fate, warnings, and the time; ``document()`` is the whole ``gputopo/accept/v1`` JSON."""

    steps: tuple[StepResult, ...]
    node: str
    device: str
    driver: str | None
    gpus: tuple[dict[str, Any], ...]
    started_utc: str
    elapsed_s: float
    budget_s: float
    gate: tuple[dict[str, Any], ...] = ()
    gate_note: str | None = None
    saved: str | None = None  # where the verdict was kept, or why not
    warnings: tuple[str, ...] = ()
    report: dict[str, str] | None = None
    # Why ``--gate`` could not do its part (the state's lock not got in time, a state it may not write):
    # the run exits 3 whatever the verdict, and the node is as the gate's note says.
    blocked: str | None = None

    @property
    def verdict(self) -> str:
        return steps.verdict(self.steps)

    @property
    def exit_code(self) -> int:
        if self.blocked is not None:
            return EXIT_UNAVAILABLE
        return steps.EXIT_CODES.get(self.verdict, EXIT_UNAVAILABLE)

    def with_files(self, paths: dict[str, str]) -> AcceptReport:
        return replace(self, report=dict(paths))

    def document(self) -> dict[str, Any]:
        """The ``gputopo/accept/v1`` document (docs/accept.md), built here and nowhere else."""
        return {
            "schema": SCHEMA,
            "gputopo_version": __version__,
            "node": self.node,
            "device": self.device,
            "verdict": self.verdict,
            "reason": steps.reason(self.steps),
            "started_utc": self.started_utc,
            "elapsed_s": round(self.elapsed_s, 3),
            "budget_s": self.budget_s,
            "driver": self.driver,
            "gpus": [dict(g) for g in self.gpus],
            "steps": [s.to_json() for s in self.steps],
            "actions": [
                {"step": s.name, "action": s.action, "why": s.summary}
                for s in self.steps
                if s.status == FAILED
            ],
            "not_checked": [
                {"step": s.name, "why": s.why_not} for s in self.steps if s.status == steps.NOT_CHECKED
            ],
            "gate": {"actions": [dict(a) for a in self.gate], "note": self.gate_note}
            if self.gate or self.gate_note
            else None,
            "state": self.saved,
            "warnings": list(self.warnings),
            "report": self.report,
        }


@dataclass
class _Run:
    """What the steps hand each other: the inventory's sample, the health check's result, the probe's
    device inventory."""

    options: Options
    hooks: Hooks
    deadline: float
    sample: Any = None
    check: Any = None
    probe_inventory: Any = None
    device: str = "cuda"
    warnings: list[str] = field(default_factory=list)

    def warn(self, line: str) -> None:
        """A warning: said now (``hooks.warn``) and kept in the document."""
        if line not in self.warnings:
            self.warnings.append(line)
            self.hooks.warn(line)


def run(options: Options, hooks: Hooks | None = None) -> AcceptReport:
    """Run the steps asked for, in order; the report (the verdict kept in the state file when one is
    named, the Slurm node gated when asked)."""
    hooks = hooks or Hooks()
    started = time.monotonic()
    started_utc = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    ctx = _Run(options, hooks, started + options.budget_s, device=options.device or "cuda")
    gate = _Gate(options, hooks, _node_name()) if options.gate else None
    if gate is not None:
        gate.start(started + min(options.budget_s / 4, 30.0))
    done: list[StepResult] = []
    failed: str | None = None
    for name in options.asked:
        if failed is not None and not options.keep_going:
            done.append(steps.not_run(name, failed))
            continue
        left = ctx.deadline - time.monotonic()
        if left < MIN_STEP_S:
            done.append(steps.not_checked(name, "the time budget (--budget) ran out before it"))
            continue
        hooks.progress(name, "started")
        t0 = time.monotonic()
        step_deadline = t0 + min(left, _step_budget(options, name))
        try:
            result = _STEPS[name](ctx, step_deadline)
        except GputopoError as exc:
            # What only the machine could refuse (a GPU of --inject-gpus that is not here, no torch, no
            # CUDA): this step could not run; the others, and the gate's ending, still do.
            why = exc.message + (f" ({exc.hint})" if getattr(exc, "hint", None) else "")
            result = steps.not_checked(name, why)
        elapsed = time.monotonic() - t0
        if elapsed > _step_budget(options, name) + 5 and result.status == steps.PASSED:
            result = steps.not_checked(name, f"it ran {elapsed:.0f} s, past its budget")
        result = replace(result, elapsed_s=elapsed)
        hooks.progress(name, f"{result.status}: {result.summary}")
        done.append(result)
        if result.status == FAILED and failed is None:
            failed = name
    driver, gpus = _identity(ctx)
    report = AcceptReport(
        steps=tuple(done),
        node=_node_name(),
        device=ctx.device,
        driver=driver,
        gpus=tuple(gpus),
        started_utc=started_utc,
        elapsed_s=time.monotonic() - started,
        budget_s=options.budget_s,
        warnings=tuple(ctx.warnings),
    )
    return _keep(options, report, hooks, gate, ctx.deadline)


def _step_budget(options: Options, name: str) -> float:
    """A step's time at most: DCGM's by its level (``system.dcgmi.DEFAULT_BUDGET_S``), the rest fixed."""
    if name == "dcgm" and options.dcgm_level is not None:
        from gputopo.system.dcgmi import DEFAULT_BUDGET_S as DCGM_BUDGET_S

        return DCGM_BUDGET_S[options.dcgm_level]
    return STEP_BUDGET_S[name]


def _node_name() -> str:
    from gputopo.system.slurm_node import node_name

    return node_name()


def _identity(ctx: _Run) -> tuple[str | None, list[dict[str, Any]]]:
    sample = ctx.sample
    if sample is None:
        return None, []
    gpus = [
        {
            "index": g.index,
            "uuid": g.uuid,
            "serial": g.serial,
            "vbios": g.vbios_version,
            "name": g.name,
            "pci_bus_id": g.pci_bus_id,
        }
        for g in sample.gpus
    ]
    return sample.driver_version, gpus


# --- the steps ---------------------------------------------------------------------------------------------


def _inventory(ctx: _Run, deadline: float) -> StepResult:
    from gputopo.system import nvml
    from gputopo.system.health_reads import sample_health

    o = ctx.options
    try:
        _, ctx.sample = sample_health(None, timeout_s=o.nvml_timeout_s, deadline=deadline)
    except nvml.NvmlUnavailable as exc:
        return steps.judge_inventory(
            None, expect_gpus=o.expect_gpus, expect_model=o.expect_model, unavailable=exc.message
        )
    return steps.judge_inventory(ctx.sample, expect_gpus=o.expect_gpus, expect_model=o.expect_model)


def _health(ctx: _Run, deadline: float) -> StepResult:
    from gputopo.health.check import HEALTHY, PROBLEMS
    from gputopo.services.check import CheckOptions, run_check

    o = ctx.options
    budget = max(1.0, deadline - time.monotonic())
    options = CheckOptions(
        sample_s=min(o.sample_s, budget / 2),
        budget_s=budget,
        nvml_timeout_s=o.nvml_timeout_s,
        expect_gpus=o.expect_gpus,
        expect_imex=o.expect_imex,
        thresholds=o.thresholds,
        since_s=o.since_s,
        kernel_log=o.kernel_log,
    )
    result = run_check(options)
    ctx.check = result
    if ctx.sample is None and result.sample is not None:
        ctx.sample = result.sample
    facts = {
        "verdict": result.verdict,
        "reason": result.reason,
        "not_checked": [n.to_json() for n in result.not_checked],
    }
    if result.verdict == PROBLEMS:
        return steps.from_findings("health", result.findings, result.reason, facts)
    if result.verdict == HEALTHY:
        return steps.StepResult("health", steps.PASSED, result.reason, result.findings, facts=facts)
    return steps.not_checked("health", result.reason, facts)


def _dcgm(ctx: _Run, deadline: float) -> StepResult:
    """DCGM's own diagnostic: ``dcgmi diag -r LEVEL -j`` run within the step's time (a missing or hung
    ``dcgmi`` is "not checked", never a stall), or the saved result ``--dcgm-diag`` named."""
    from gputopo.health.dcgm_diag import FAILED as DCGM_FAILED
    from gputopo.health.dcgm_diag import PASSED as DCGM_PASSED
    from gputopo.health.dcgm_diag import match_serials

    o = ctx.options
    if o.dcgm_saved is not None:
        result = o.dcgm_saved
    else:
        from gputopo.system.dcgmi import run_dcgm_diag

        assert o.dcgm_level is not None
        result = run_dcgm_diag(o.dcgm_level, max(0.0, deadline - time.monotonic()))
    # DCGM names GPUs by its own ids and their serials: held against NVML's serials, a GPU DCGM did not
    # diagnose (swapped in since a saved run, another node's file) leaves the step not checked.
    serials = {g.index: g.serial for g in (ctx.sample.gpus if ctx.sample is not None else ()) if g.serial}
    result = match_serials(result, serials)
    facts = result.to_json()
    facts.pop("findings", None)
    if result.status == DCGM_FAILED:
        return steps.from_findings(
            "dcgm", result.findings, result.reason or "DCGM's diagnostic failed", facts
        )
    if result.status == DCGM_PASSED:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts.items()) if n)
        ok = f"{result.source}: passed" + (f" ({counts})" if counts else "")
        return steps.StepResult("dcgm", steps.PASSED, ok, result.findings, facts=facts)
    return replace(steps.not_checked("dcgm", result.reason or "DCGM's diagnostic did not answer", facts),
                   findings=result.findings)  # fmt: skip


def _probe_inventory(ctx: _Run) -> Any:
    """The GPUs the probe may run on: CUDA's (NVML numbering), or CPU stand-ins for the GPUs the
    inventory listed (at most 8)."""
    if ctx.probe_inventory is not None:
        return ctx.probe_inventory
    from gputopo.probe.plan.config import DeviceInventory
    from gputopo.probe.pool.devices import detect_devices

    o = ctx.options
    if o.device == "cpu":
        listed = [g.index for g in (ctx.sample.gpus if ctx.sample is not None else ()) if g.error is None]
        if not listed:
            listed = [0, 1]
            ctx.warn("no GPU was listed: two CPU stand-ins run the probes")
        stand_ins = tuple(g for g in listed if g < MAX_STAND_INS)
        if len(stand_ins) < len(listed):
            ctx.warn(f"CPU stand-ins exist for GPU0-GPU{MAX_STAND_INS - 1} only; the rest are left out")
        detect_devices("cpu")  # torch is there (UnavailableError otherwise)
        ctx.probe_inventory = DeviceInventory("cpu", stand_ins, note="CPU ranks stand in for GPUs")
    else:
        ctx.probe_inventory = detect_devices(None, nvml_timeout_s=o.nvml_timeout_s)
    ctx.device = ctx.probe_inventory.device
    return ctx.probe_inventory


def _probe(ctx: _Run, deadline: float, gpus: list[int], mode: Any, **kw: Any) -> dict[str, Any]:
    """One probe run (``probe.pool.runner``) of ``mode`` on ``gpus``; its ``gputopo/probe/v1`` document."""
    from gputopo.probe.plan.config import build_config
    from gputopo.probe.pool.runner import run_probe
    from gputopo.probe.report.document import to_document

    inventory = _probe_inventory(ctx)
    config = build_config(
        inventory,
        [",".join(map(str, gpus))],
        mode=mode,
        timeout_s=_probe_timeout(deadline - time.monotonic()),
        report_dir=ctx.options.report_dir,
        **kw,
    )
    doc = to_document(run_probe(config, on_warning=ctx.warn))
    # The probe's own report beside accept's (JSON and Markdown: every figure, for whoever looks closer).
    from gputopo.probe.report.document import to_markdown
    from gputopo.report import write_report

    doc["report"] = write_report("probe", doc, to_markdown(doc), ctx.options.report_dir)
    return doc


def _with_reports(step: StepResult, *docs: dict[str, Any] | None) -> StepResult:
    """``step`` with the probe reports its figures came from (``facts.probe_reports``)."""
    paths = [d["report"]["json"] for d in docs if d and d.get("report")]
    return replace(step, facts={**step.facts, "probe_reports": paths}) if paths else step


def _probe_timeout(left_s: float) -> float:
    """The probe's no-progress limit for a step with ``left_s`` seconds: the pool stops a step that keeps
    reporting progress at ``LOAD_CAP`` times it, so a tenth of the time left bounds the step by it; never
    below a minute (a silent minute on a GPU is a hang; less would call a loaded machine hung), never
    above what is left."""
    from gputopo.probe.pool.pool import LOAD_CAP

    return max(5.0, min(max(PROBE_SILENCE_S, left_s / LOAD_CAP), left_s))


def _per_gpu(ctx: _Run, deadline: float) -> StepResult:
    from gputopo.probe.plan.options import Mode

    inventory = _probe_inventory(ctx)
    gpus = list(inventory.gpus)
    if not gpus:
        return steps.not_checked("per_gpu", "no GPU here can be probed")
    o = ctx.options
    kw: dict[str, Any] = {}
    if inventory.device == "cuda":
        kw["precisions"] = ["bf16"]  # the floors' matmul figures are bf16 on tensor cores
    if o.inject is not None:
        kw.update(inject=o.inject, inject_gpus=o.inject_gpus)
    doc = _probe(ctx, deadline, gpus, Mode.GPU, **kw)
    return _with_reports(steps.judge_per_gpu(doc.get("per_gpu"), o.floors, inventory.device), doc)


def _wiring(ctx: _Run, deadline: float) -> StepResult:
    from gputopo.health.judge import judge_one
    from gputopo.probe.plan.options import Mode
    from gputopo.services.machine import drained as drain_rule

    if ctx.check is not None:
        drained = drain_rule(ctx.check.findings)
    elif ctx.sample is not None:
        drained = drain_rule(judge_one(ctx.sample).findings)
    else:
        drained = {}
    names = {g.index: g.name for g in (ctx.sample.gpus if ctx.sample is not None else ())}
    o = ctx.options
    if drained:  # no P2P work on a GPU whose driver asks to keep it off: the step fails as it stands
        return steps.judge_wiring(
            drained=drained, p2p=None, allreduce=None, table=o.floors, device=ctx.device, names=names
        )
    inventory = _probe_inventory(ctx)
    gpus = list(inventory.gpus)
    names = {g: names.get(g) for g in gpus}
    if len(gpus) < 2:
        return steps.StepResult(
            "wiring", steps.PASSED, f"{len(gpus)} GPU: no pair and no all-reduce to check"
        )
    p2p = None
    if inventory.device == "cuda":
        half = time.monotonic() + (deadline - time.monotonic()) / 2
        p2p = _probe(ctx, half, gpus, Mode.P2P, each_pair=True)
    allreduce = _probe(ctx, deadline, gpus, Mode.ALLREDUCE)
    judged = steps.judge_wiring(
        drained={}, p2p=p2p, allreduce=allreduce, table=o.floors, device=inventory.device, names=names
    )
    return _with_reports(judged, p2p, allreduce)


_STEPS: dict[str, Callable[[_Run, float], StepResult]] = {
    "inventory": _inventory,
    "health": _health,
    "dcgm": _dcgm,
    "per_gpu": _per_gpu,
    "wiring": _wiring,
}


# --- the verdict kept ---------------------------------------------------------------------------------


def _keep(
    options: Options, report: AcceptReport, hooks: Hooks, gate: _Gate | None, deadline: float
) -> AcceptReport:
    """Keep the verdict in the state's ``accept`` section and end the gate (resume an accepted node,
    leave a rejected one drained with the reason), both under the state's lock, as ``check`` changes
    Slurm only under it (``check.keep_state``): ``system.state_file.update_section`` takes
    ``<state>.lock``, re-reads the file, calls ``change`` (the gate's Slurm action and the new record)
    and saves, every other section as it was. Without the lock in time, or over a state that may not be
    written (a newer gputopo's, an unsafe path), nothing is done to Slurm, the verdict is not kept, and
    with ``--gate`` the run exits 3. Without a state file there is nothing to lock: the gate acts."""
    path = options.state_path
    if path is None:
        if gate is not None:
            gate.finish(report, time.monotonic() + 20.0)
            report = replace(report, gate=tuple(gate.actions), gate_note=gate.note, blocked=gate.blocked)
        return report
    from gputopo.system.state_file import update_section

    rec = record.make(
        at=time.time(),
        verdict=report.verdict,
        reason=steps.reason(report.steps),
        driver=report.driver,
        gpus=report.gpus,
    )

    def change(_old: Any) -> dict[str, Any]:
        if gate is not None:  # Slurm changed under the lock, after the file was re-read under it
            gate.finish(report, time.monotonic() + 20.0)
        return rec

    wait_s = max(deadline - time.monotonic(), MIN_LOCK_WAIT_S)
    kept = update_section(path, report.node, record.KEY, change, wait_s)
    said = list(kept.warnings)
    saved = str(path)
    blocked = gate.blocked if gate is not None else None
    if not kept.saved:
        why = kept.why_not or "not saved"
        said.append(f"--state {path}: the verdict was not kept ({why})")
        saved = f"not kept: {why}"
        if gate is not None and not gate.finished and gate.ours:
            gate.note = f"nothing done after the run, so the node stays drained: {why}"
            blocked = blocked or why
    for line in said:
        if line not in report.warnings:
            hooks.warn(line)
    if gate is not None:
        report = replace(report, gate=tuple(gate.actions), gate_note=gate.note)
    warnings = (*report.warnings, *(w for w in said if w not in report.warnings))
    return replace(report, saved=saved, blocked=blocked, warnings=warnings)


# --- the Slurm gate ----------------------------------------------------------------------------------------


class _Gate:
    """``--gate``: drain this Slurm node with gputopo's own reason before the steps (unless someone else
    drained it: then it runs, reports and never resumes it), resume it only when accepted, and leave a
    rejected node drained with the reason. ``health.node_action``'s rules: never overrule a person.
    With a state file, each Slurm change is made under the state's lock, as ``check``'s are
    (``check.keep_state``): the drain here, the ending in ``_keep``. ``blocked`` says why the gate could
    not do its part (the run then exits 3)."""

    def __init__(self, options: Options, hooks: Hooks, node: str) -> None:
        self.options = options
        self.hooks = hooks
        self.node = node
        self.actions: list[dict[str, Any]] = []
        self.note: str | None = None
        self.ours = False  # the drain in place is gputopo's own (ours to lift)
        self.finished = False  # the ending was decided (acted, or left to a person)
        self.blocked: str | None = None

    def _act(self, done: Any) -> None:
        self.actions.append(done.to_json())
        if done.error:
            self.hooks.warn(f"--gate: {done.error}")

    def start(self, deadline: float) -> None:
        path = self.options.state_path
        if path is None:
            self._start(deadline)
            return
        from gputopo.system import state_file

        try:
            with state_file.locked(path, deadline - time.monotonic()):
                self._start(deadline)
        except state_file.LockNotGot as exc:
            self.note = f"the node was not drained: {exc.message}"
            self.blocked = exc.message
            self.hooks.warn(f"--gate: {self.note}")

    def _start(self, deadline: float) -> None:
        from gputopo.services.check import read_node_view
        from gputopo.system import slurm_node

        view = read_node_view(deadline)
        if view.node is None:
            self.note = f"the node was not drained: its state could not be read ({view.error})"
            self.hooks.warn(f"--gate: {self.note}")
            return
        node = view.node
        if node.out_of_service and not node.ours:
            self.note = (
                f"{node.name} is already {node.state} by someone else (Reason={node.reason or 'none'}): "
                "accept runs and reports, and never resumes it"
            )
            return
        done = slurm_node.drain(view.name, GATE_REASON, self.options.dry_run, deadline - time.monotonic())
        self._act(replace(done, node=node, reason=GATE_REASON))
        self.ours = done.done or self.options.dry_run or node.drained_by_gputopo

    def finish(self, report: AcceptReport, deadline: float) -> None:
        from gputopo.health.node_action import slurm_reason
        from gputopo.services.check import read_node_view
        from gputopo.system import slurm_node

        self.finished = True
        if not self.ours:
            return
        view = read_node_view(deadline)
        node = view.node
        if node is None:
            self.note = f"nothing done after the run: the node's state could not be read ({view.error})"
            return
        if not (node.held_by_accept or self.options.dry_run):
            if node.drained_by_gputopo:
                # A gputopo check drained it while accept ran (its view predates accept's drain): that
                # drain is the check's to lift, and its record says so; accept never resumes over it.
                self.note = (
                    f"{node.name} was drained by a gputopo check while accept ran "
                    f"(Reason={node.reason}): left as it is; the check lifts its own drain"
                )
                return
            # A person took over while it ran (resumed it, or drained it with their own reason).
            self.note = (
                f"{node.name} is {node.state} (Reason={node.reason or 'none'}) since accept drained it: a "
                "person took over, so it is left as it is"
            )
            return
        verdict = report.verdict
        if verdict == steps.ACCEPTED:
            self._act(
                replace(
                    slurm_node.resume(view.name, self.options.dry_run, deadline - time.monotonic()), node=node
                )
            )
            return
        failed = [
            f for s in report.steps if s.status == FAILED for f in s.findings if f.severity == "problem"
        ]
        if verdict == steps.REJECTED and failed:
            why = slurm_reason(failed)[len("gputopo: ") :]
            reason = f"gputopo: accept rejected: {why}"[:200]
        else:
            reason = f"gputopo: accept: {steps.reason(report.steps)}"[:200]
        done = slurm_node.drain(view.name, reason, self.options.dry_run, deadline - time.monotonic())
        self._act(replace(done, node=node, reason=reason))


# --- the inputs, read before anything else (each bad one: exit 2, one line) ---------------------------------


def load_floors(path: Path | None) -> FloorTable:
    """``--floors FILE``, or gputopo's own table."""
    from gputopo.accept import floors

    return floors.load(path) if path is not None else floors.packaged()


def load_rules(path: Path | None) -> Thresholds:
    """``--thresholds FILE`` (check's rule overrides), or the rules as shipped."""
    from gputopo.health.rules import load_thresholds

    return load_thresholds(path) if path is not None else DEFAULT_THRESHOLDS


def since_seconds(text: str) -> float | None:
    """``--since DURATION`` (check's Xid window) in seconds."""
    from gputopo.health.xid import parse_since

    return parse_since(text)


def state_file(given: Path | None, gate: bool) -> Path | None:
    """``--state FILE``, else check's default (``GPUTOPO_CHECK_STATE``; root's file with ``--gate``),
    refused before anything runs when it is not to be trusted (``system.state_file.unsafe``: a symbolic
    link; as root, another user's or a writable file or folder): exit 2, or 3 with ``--gate``, as
    ``check`` refuses it (3 under ``--drain``)."""
    from gputopo.errors import InputError, UnavailableError
    from gputopo.services.check import default_state_path
    from gputopo.system.state_file import unsafe

    path = given or default_state_path(gate)
    if path is None:
        return None
    refused = unsafe(path, f"--state {path}")
    if refused is not None:
        raise (UnavailableError if gate else InputError)(refused[0], refused[1])
    return path


def floors_json(table: FloorTable) -> dict[str, Any]:
    """The table as ``--list-floors --json`` prints it (the shape ``--floors`` reads)."""
    from gputopo.accept.floors import table_json

    return table_json(table)


def read_dcgm_file(path: Path) -> DcgmDiagResult:
    """``--dcgm-diag FILE``: a saved ``dcgmi diag -j`` output, judged (exit 2, one line, when not one)."""
    from gputopo.health.dcgm_diag import read_dcgm_diag

    return read_dcgm_diag(path)


def read_kernel_log(spec: str) -> KernelLog:
    """``--kernel-log FILE|-``: the saved kernel log check reads Xid lines from (exit 2 when unreadable)."""
    from gputopo.system.kernel_log import read_log_file

    return read_log_file(spec)


def check_report_dir(path: Path) -> None:
    """The report folder is refused before anything is read (exit 2)."""
    from gputopo.report import ensure_report_dir

    ensure_report_dir(path)
