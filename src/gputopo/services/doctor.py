"""``gputopo doctor``'s service: the whole check of one machine, as one report.

It reads the topology, judges the links and the environment's NCCL settings (``findings``), lists stale
GPU holders (dry run), probes every pair shortly and the recommended sets for the common sizes,
recommends sets again in the light of what the probes found, and sums it all up. On a machine without an
NVIDIA GPU it runs the same steps on a sample machine with CPU ranks standing in for the GPUs, and says
"simulated" everywhere.

The CLI builds ``Options`` (validated once, here), calls ``run`` with ``Hooks`` (typed callbacks: no
console or typer object comes down) and renders the ``DoctorReport``, whose ``document()`` is the whole
``gputopo/doctor/v1`` JSON, so the report can be saved, re-rendered and turned into HTML anywhere
(``gputopo report``; its Markdown is ``ui.doctor_markdown``). ``run`` is the pipeline, one step a line,
and each step is a function below it. What a step reads is read once and handed down: the topology, the
health window, the PCIe path table (the health check's reading; ``machine.redirected_pairs`` where no
check ran) and the device inventory (``read_inventory``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gputopo import __version__
from gputopo.errors import (
    EXIT_PROBLEM,
    EXIT_UNAVAILABLE,
    GputopoError,
    InputError,
    Interrupted,
    UnavailableError,
    UsageError,
)
from gputopo.findings import NOTE, PROBLEM, Finding, link_findings, nccl_env_findings
from gputopo.health.check import DEFAULT_NVML_TIMEOUT_S, DEFAULT_SAMPLE_S
from gputopo.model import Topology
from gputopo.probe.judge.findings import probe_findings
from gputopo.probe.plan.options import Fault
from gputopo.services.machine import redirected_pairs

if TYPE_CHECKING:
    from gputopo.probe.plan.config import DeviceInventory
    from gputopo.probe.plan.nodes import NodeOptions
    from gputopo.probe.plan.schedule import Job, Plan

SCHEMA = "gputopo/doctor/v1"
DEFAULT_SAMPLE = "quad-nv4-pairs-2socket"
COMMON_SIZES = (2, 4)
# CPU stand-in ranks exist for indices 0-7 only (gputopo.probe.plan.config.CPU_STAND_INS).
MAX_SIMULATED_GPUS = 8
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_REPORT_DIR = Path("reports")
MAX_SAMPLE_S = 60.0
# The CLI's typer defaults come from here: the constants above, ``DEFAULT_SAMPLE_S`` (``health.check``'s)
# and the drill's ``Fault``, so cli/ imports nothing below the service.


@dataclass(frozen=True, kw_only=True)
class Options:
    """What the user chose, by keyword, built and validated once per command (``UsageError``, exit 2,
    before anything is read); each default is written here once. ``None`` means the default for the
    device (tiny ResNet on CPU, the quick show's micro CNN in a simulation)."""

    input: str | None = None
    steps: int | None = None  # None: DEFAULT_STEPS, or the quick show's QUICK_STEPS
    timeout_s: float = DEFAULT_TIMEOUT_S
    skip_probe: bool = False
    model: str | None = None
    report_dir: Path = DEFAULT_REPORT_DIR
    env: Mapping[str, str] | None = None  # the environment whose NCCL settings are checked (os.environ)
    simulate: bool = False  # asked for: run on the sample machine even where there are GPUs
    inject: Fault | None = None  # a drill's fault, planted where ``inject_gpus`` says
    inject_gpus: str | None = None
    nvml_timeout_s: float | None = None  # per live NVML read; None: the default
    health_sample_s: float = (
        DEFAULT_SAMPLE_S  # the health check's window between its two samples (check's --sample-s)
    )
    skip_speed: bool = False
    # Across nodes: after this machine's checks, the inter-node tests; ``inject`` then goes into them (on
    # ``node.inject_node``), not into this machine's probes.
    node: NodeOptions | None = None
    nccl_log: Path | None = None  # a job's output whose ``NCCL DIAG`` lines join the findings (--nccl-log)
    dcgm_diag: Path | None = None  # a saved ``dcgmi diag -j`` output whose results join the findings
    health_validation: Path | None = None  # a saved NVIDIA Health Validation NodeVerdict, likewise
    full: bool = False  # a simulation runs the full probe, not the quick show

    def __post_init__(self) -> None:
        from gputopo.probe.plan.config import MODELS

        if self.model is not None and self.model not in MODELS:
            raise UsageError(f"--model {self.model}: unknown model", f"choose one of {', '.join(MODELS)}")
        if not 0 <= self.health_sample_s <= MAX_SAMPLE_S:
            raise UsageError(
                f"--sample-s {self.health_sample_s:g}: must be 0 to 60 seconds",
                "e.g. --sample-s 2 (the default)",
            )
        if self.steps is not None and self.steps < 1:
            raise UsageError(f"--steps {self.steps}: must be at least 1", "e.g. --steps 5")
        if not self.timeout_s > 0:
            raise UsageError(f"--timeout {self.timeout_s:g}: must be positive", "e.g. --timeout 120")
        across = self.node is not None and self.inject is not None
        if across and self.inject_gpus is not None:
            raise UsageError(
                "across nodes --inject goes into the inter-node tests of --inject-node", "drop --inject-gpus"
            )
        if not across and (self.inject is None) != (self.inject_gpus is None):
            raise UsageError(
                "--inject and --inject-gpus go together in doctor", "e.g. --inject corrupt --inject-gpus 5,6"
            )
        if self.inject is not None and self.skip_probe and self.node is None:
            raise UsageError("--inject plants a fault in the probes, and --skip-probe skips them", "drop one")

    @property
    def no_driver_is_unavailable(self) -> bool:
        """Whether a machine without a driver, shown simulated, exits 3: nobody asked for a simulation."""
        return self.input is None and not self.simulate


DoctorOptions = Options  # the name scripts and tests have used


class ProbeBars(Protocol):
    """What shows the probes' progress: told of every row a job of the plan reports."""

    def update(self, job: Job, row: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Hooks:
    """What the service tells its caller while it runs: ``on_start`` the ``Machine`` once it is read,
    before anything slow (a first line); ``probe_bars`` given the probe plan, a context manager whose
    value shows the progress of its jobs; ``on_row`` every progress row of the inter-node tests."""

    on_start: Callable[[Machine], None] | None = None
    probe_bars: Callable[[Plan], AbstractContextManager[ProbeBars]] | None = None
    on_row: Callable[[dict[str, Any]], None] | None = None


# The first look a newcomer gets without a GPU (``doctor`` or ``doctor --simulate`` on the default sample)
# is a quick show: the same checks of every pair and set on CPU stand-ins, with a micro CNN for two steps
# and no speed table (stand-ins' timings are never judged); ``--full`` runs the full probe.
DEFAULT_STEPS = 5
QUICK_STEPS = 2
QUICK_MODEL = "micro"


def quick_show(machine: Machine, options: Options) -> bool:
    """Whether this run is the quick simulated show: the default sample simulated on CPU ranks, no drill,
    no nodes, not ``--full``. A machine given with ``--input`` gets the full probe."""
    return (
        machine.simulated
        and options.input is None
        and options.inject is None
        and options.node is None
        and not options.full
        and not options.skip_probe
    )


def quick_words(options: Options) -> str:
    """How the quick show differs from the full probe, for its label."""
    model = options.model or QUICK_MODEL
    steps = options.steps or QUICK_STEPS
    return f"a quick show ({model} model, {steps} steps, no speed table; --full runs the full probe)"


@dataclass(frozen=True)
class Machine:
    """The machine the doctor looks at: live, or simulated from a sample or saved input."""

    topology: Topology
    simulated: bool
    why_simulated: str | None
    quick: bool = False  # the quick simulated show (``quick_show``), labelled in ``why_simulated``


def choose_machine(spec: str | None, simulate: bool = False, nvml_timeout_s: float | None = None) -> Machine:
    """This machine when it has NVIDIA GPUs; otherwise a sample (or ``--input``), simulated on CPU."""
    from gputopo.system.machine import load_topology

    if spec is not None:
        topo = load_topology(spec)
        return Machine(topo, simulated=True, why_simulated=f"--input {spec}: not this machine's GPUs")
    if simulate:
        topo = load_topology(f"sample:{DEFAULT_SAMPLE}")
        why = f"--simulate: running on sample machine {DEFAULT_SAMPLE} with CPU ranks"
        return Machine(topo, simulated=True, why_simulated=why)
    try:
        return Machine(load_topology(None, nvml_timeout_s), simulated=False, why_simulated=None)
    except UnavailableError as exc:
        topo = load_topology(f"sample:{DEFAULT_SAMPLE}")
        why = f"{exc.message}; running on sample machine {DEFAULT_SAMPLE} with CPU ranks (simulated)"
        return Machine(topo, simulated=True, why_simulated=why)


def usable_gpus(
    topo: Topology, unhealthy: Mapping[int, str] | None = None
) -> tuple[list[int], list[dict[str, Any]]]:
    """GPUs fit to probe (not failing, not busy, no health problem) and those left out with the reason."""
    from gputopo.recommend import Constraints, exclusions

    sick = tuple(sorted((unhealthy or {}).items()))
    left_out = {e.gpu: e.why for e in exclusions(topo, Constraints(n=1, unhealthy=sick))}
    usable = [g.index for g in topo.gpus if g.index not in left_out]
    return usable, [{"gpu": g, "why": why} for g, why in sorted(left_out.items())]


def common_sizes(n_usable: int) -> list[int]:
    """Set sizes people ask for: 2, 4 and all of them (those that fit)."""
    return sorted({k for k in (*COMMON_SIZES, n_usable) if 2 <= k <= n_usable})


def recommendations(
    topo: Topology,
    sizes: list[int],
    evidence_doc: dict[str, Any] | None,
    unhealthy: Mapping[int, str] | None = None,
    no_p2p: Mapping[int, str] | None = None,
    redirected: Redirected = (),
) -> list[dict[str, Any]]:
    """The best set for each size (GPUs with a health problem left out, and those whose driver asks to
    drain P2P, ``no_p2p``, left out of every set of two or more), with its export line; a size that can't
    be met says why. A pair behind an ACS-redirecting bridge (``redirected``, read once by ``run``) ranks
    after clean ones."""
    from gputopo.recommend import Constraints, candidate_dict, evidence_from_report, recommend

    evidence = evidence_from_report(evidence_doc, "doctor probes") if evidence_doc else None
    sick = tuple(sorted((unhealthy or {}).items()))
    drained = tuple(sorted((no_p2p or {}).items()))
    out = []
    for k in sizes:
        try:
            rec = recommend(
                topo,
                Constraints(
                    n=k, top=3, evidence=evidence, unhealthy=sick, no_p2p=drained, redirected=redirected
                ),
            )
        except GputopoError as exc:
            out.append({"n": k, "best": None, "export": None, "why": exc.message})
            continue
        out.append(
            {
                "n": k,
                "best": candidate_dict(rec.best),
                "export": rec.best.export_line(),
                "why": "; ".join(rec.best.reasons),
            }
        )
    return out


def stale_section() -> dict[str, Any]:
    """The kill-stale dry run on this machine (what holds /dev/nvidia* now); never signals."""
    from gputopo.procs.document import stale_document
    from gputopo.procs.survey import Survey

    try:
        run = Survey.take().run()
    except GputopoError as exc:
        return {"holders": [], "note": f"not checked: {exc.message}"}
    doc = stale_document(run)
    doc["note"] = "; ".join(run.notes) if run.notes else None
    return doc


def read_inventory(machine: Machine, options: Options) -> DeviceInventory | UnavailableError | None:
    """What the probes can drive (torch, and CUDA on a live machine), read once and handed to both the
    probes and the inter-node tests; ``None`` where neither runs. A machine that cannot probe (no torch,
    no CUDA) hands down the ``UnavailableError``: the probes turn it into a note, across nodes it ends the
    run. On a live machine the topology doctor read is handed down, so NVML is not read again."""
    if options.skip_probe and options.node is None:
        return None
    from gputopo.probe.pool.devices import detect_devices, require_torch

    try:
        require_torch()
        live_topology = None if machine.simulated else machine.topology
        return detect_devices(
            "cpu" if machine.simulated else None,
            nvml_timeout_s=options.nvml_timeout_s,
            topology=live_topology,
        )
    except UnavailableError as exc:
        return exc


def _inventory(found: DeviceInventory | UnavailableError | None) -> DeviceInventory:
    """The inventory ``read_inventory`` handed down, or its error raised where it is needed."""
    if isinstance(found, UnavailableError):
        raise found
    if found is None:  # read_inventory reads it wherever a probe or an inter-node test runs
        raise ValueError("no device inventory was read for this step")
    return found


def probe_section(
    machine: Machine,
    usable: list[int],
    sizes_sets: list[list[int]],
    options: Options,
    inventory: DeviceInventory,
    bars: Callable[[Plan], AbstractContextManager[ProbeBars]] | None = None,
    sick: Mapping[int, str] | None = None,
    no_p2p: Mapping[int, str] | None = None,
) -> dict[str, Any] | None:
    """Every pair (short) and the recommended larger sets in one probe run (one pool of ranks, a fresh
    one only after a hang or crash); its ``gputopo/probe/v1`` document. What doctor already read is
    handed down: the device inventory, the machine's topology (for the GPU list and the bandwidth model)
    and, on a live machine, the health its window found (``sick``), so the probe reads none of them again.
    A GPU whose driver asks to drain P2P (``no_p2p``) is in no pair: it gets the one-GPU checks alone."""
    from gputopo.probe.plan.config import build_config
    from gputopo.probe.plan.options import Mode
    from gputopo.probe.plan.schedule import Job, make_plan
    from gputopo.probe.pool.runner import run_probe
    from gputopo.probe.report.document import to_document
    from gputopo.probe.shared import TopologyView

    if inventory.device == "cuda":
        # A preset CUDA_VISIBLE_DEVICES (a Slurm job) limits the GPUs this process may probe.
        allowed = set(inventory.gpus)
        usable = [g for g in usable if g in allowed]
        sizes_sets = [s for s in sizes_sets if set(s) <= allowed]
    quick = machine.quick
    model = options.model or (QUICK_MODEL if quick else "tiny" if inventory.device == "cpu" else "resnet18")
    topology_input = machine.topology.source if machine.simulated else None
    common = {
        "mode": Mode.ALL,
        "model": model,
        "steps": options.steps or (QUICK_STEPS if quick else DEFAULT_STEPS),
        "timeout_s": options.timeout_s,
        "report_dir": options.report_dir,
        "topology_input": topology_input,
    }
    if not usable:
        return None
    drill = {"inject": options.inject, "inject_gpus": options.inject_gpus}
    # A GPU whose driver asks to drain P2P is probed on its own (one-GPU checks), never in a pair.
    drained = tuple((g,) for g in usable if g in (no_p2p or {}))
    paired = [g for g in usable if g not in (no_p2p or {})]
    bigger = tuple(tuple(s) for s in sizes_sets if len(s) > 2)
    if len(paired) >= 2:
        config = build_config(inventory, [",".join(map(str, paired))], each_pair=True, **common, **drill)
        plan = make_plan(config, more_sets=drained + bigger)
    else:
        config = build_config(inventory, [str(g) for g in usable], **common, **drill)
        plan = make_plan(config, more_sets=bigger)
    if not options.skip_speed and not quick and sizes_sets:
        # The speed table (one GPU, DataParallel, DDP, DDP+AMP) on each recommended set, as steps of
        # their own after the checks, in the same pool. CPU stand-ins' timings are shown but never
        # judged, so a simulation shows the table on its smallest set only: the cheapest to time (on 8
        # stand-ins the 8-GPU set's one-GPU and DataParallel phases run the whole batch in one process).
        timed = sizes_sets if inventory.device == "cuda" else [min(sizes_sets, key=len)]
        speed = tuple((Job(tuple(s), ("speed",)),) for s in timed if tuple(s) in plan.sets)
        plan = replace(plan, rounds=plan.rounds + speed)
    # The topology read once: live, the machine doctor read; simulated, the sample it loaded (what the
    # probe's --input would load again).
    view = TopologyView(machine.topology) if inventory.device == "cuda" or topology_input else None
    handed = {"plan": plan, "view": view, "sick": None if machine.simulated else dict(sick or {})}
    if bars is None:
        run = run_probe(config, **handed)
    else:
        with bars(plan) as shown:
            run = run_probe(config, shown.update, **handed)
    return to_document(run)


def pair_rows(topo: Topology, probe: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per probed pair: its verdict, measured busbw, and the model's estimate."""
    from gputopo.topology.bandwidth import ring_busbw_gbps

    rows = []
    for s in (probe or {}).get("sets", []):
        if len(s["gpus"]) != 2:
            continue
        measured = None
        for c in s["checks"]:
            if c["name"] == "allreduce":
                measured = (c.get("metrics") or {}).get("peak_busbw_gbps")
        try:
            est = ring_busbw_gbps(topo, s["gpus"])
        except GputopoError:
            est = None
        rows.append(
            {
                "gpus": s["gpus"],
                "link": _code(topo, *s["gpus"]),
                "verdict": s["verdict"],
                "measured_busbw_gbps": measured,
                "est_busbw_gbps": est,
            }
        )
    return rows


def _code(topo: Topology, a: int, b: int) -> str | None:
    link = topo.gpu_link(a, b)
    return link.code if link else None


# A GPU pair behind an ACS-redirecting bridge: (GPU, GPU, the bridges that redirect P2P between them).
Redirected = tuple[tuple[int, int, tuple[str, ...]], ...]


def run(options: Options, hooks: Hooks | None = None) -> DoctorReport:
    """Check the machine end to end: the report (its files not yet written).

    A pipeline, read top to bottom: each step takes what the one before it handed over and calls no
    step back. A stop signal during the probes raises ``Interrupted`` whose ``partial`` is the report so
    far, marked interrupted.
    """
    hooks = hooks or Hooks()
    diag = nccl_log_findings(options.nccl_log)  # NCCL DIAG lines of a job's log, read before the slow part
    diag += imported_findings(options)  # saved dcgmi diag / Health Validation results, likewise
    machine = read_machine(options)  # the topology: this machine, or a sample simulated on CPU
    if hooks.on_start is not None:
        hooks.on_start(machine)
    health = check_health(machine, options)  # node health first: its sick GPUs are left out below
    # The PCIe path table, read once for the steps below: the health check's reading, else its own.
    redirected = health.redirected if health.checked else redirected_pairs(machine.topology)
    findings = machine_findings(machine.topology, options.env, health) + diag  # links, NCCL settings
    topo = machine.topology
    sets = choose_sets(topo, health.unhealthy, health.no_p2p, redirected)  # usable GPUs, sizes, best sets
    inventory = read_inventory(machine, options)  # what can be probed: once, for the probes and the nodes
    try:
        probe = run_probes(machine, sets, options, inventory, hooks.probe_bars)  # probe plan -> one run
    except Interrupted as exc:  # a stop signal: what was complete goes up with it, marked interrupted
        exc.partial = interrupted_report(machine, sets, findings, exc, health, redirected, options)
        raise
    judged = judge(topo, sets, findings, probe, redirected)  # probe findings; sets chosen again
    report = make_report(machine, sets, judged, probe, health, options)  # the stale holders read here
    if options.node is not None:  # this node's part of the run across nodes
        report = across_nodes(report, _inventory(inventory), options, hooks.on_row)
    return report


def run_doctor(options: Options, hooks: Hooks | None = None) -> dict[str, Any]:
    """``run``'s document alone (scripts and tests that want the ``gputopo/doctor/v1`` dict)."""
    return run(options, hooks).document()


def interrupted_report(
    machine: Machine,
    sets: Sets,
    findings: list[Finding],
    exc: Interrupted,
    health: HealthStep,
    redirected: Redirected,
    options: Options,
) -> DoctorReport:
    """The report of a doctor run a signal stopped during the probes: topology, findings and sets as
    judged before it, the probe checks done so far (the rest say "not reached"), marked ``interrupted``."""
    from gputopo.probe.report.document import to_document as probe_document

    note = f"interrupted by {exc.name}"
    probe = ProbeStep(probe_document(exc.partial) if exc.partial is not None else None, note)
    try:
        judged = judge(machine.topology, sets, findings, probe, redirected)
    except Exception:  # a partial probe must never cost the rest of the report
        probe = ProbeStep(None, note)
        judged = judge(machine.topology, sets, findings, probe, redirected)
    return replace(make_report(machine, sets, judged, probe, health, options), interrupted=exc.name)


def nccl_log_findings(path: Path | None) -> list[Finding]:
    """``--nccl-log FILE``: a problem for every failed ``NCCL DIAG`` check of the log, and notes (how many
    lines and checks, NCCL's other ``[INFO]`` lines, or that the log holds none). An unreadable file is an
    ``InputError`` (exit 2) before anything else runs."""
    if path is None:
        return []
    from gputopo.findings import finding_from_json
    from gputopo.hang.nccl_diag import diag_findings, read_diag

    lines = read_diag(path)
    found, notes = diag_findings(lines, str(path))
    remedy = (
        "nothing to do"
        if lines
        else "run the job with NCCL_RUN_DIAGNOSTICS=1 (`gputopo run --nccl-diagnostics`, NCCL >= 2.31) and "
        "give its output"
    )
    return [finding_from_json(f) for f in found] + [
        Finding(str(path), note, remedy, severity=NOTE, category="config") for note in notes
    ]


def imported_findings(options: Options) -> list[Finding]:
    """``--dcgm-diag FILE`` and ``--health-validation FILE``: each file's findings (DCGM's failures as
    problems on the GPU it names, warnings and skipped tests as notes; Health Validation's CRITICAL and
    UNKNOWN as problems), after a note that says what the file said as a whole. An unreadable file is an
    ``InputError`` (exit 2) before anything else runs."""
    from gputopo.health import dcgm_diag, health_validation

    found: list[Finding] = []
    if options.dcgm_diag is not None:
        result = dcgm_diag.read_dcgm_diag(options.dcgm_diag)
        found += [dcgm_diag.summary_finding(result), *result.findings]
    if options.health_validation is not None:
        verdict = health_validation.read_health_validation(options.health_validation)
        found += [health_validation.summary_finding(verdict), *verdict.findings]
    return found


def read_machine(options: Options) -> Machine:
    """The machine to check (``choose_machine``), refused when CPU ranks cannot stand in for its GPUs."""
    machine = choose_machine(options.input, options.simulate, options.nvml_timeout_s)
    topo = machine.topology
    if machine.simulated and len(topo.gpus) > MAX_SIMULATED_GPUS and not options.skip_probe:
        raise UsageError(
            f"{topo.source} has {len(topo.gpus)} GPUs; CPU ranks stand in for at most {MAX_SIMULATED_GPUS}",
            "pick a smaller sample (gputopo topo --list-samples), or add --skip-probe",
        )
    if quick_show(machine, options):
        machine = replace(
            machine, why_simulated=f"{machine.why_simulated}; {quick_words(options)}", quick=True
        )
    return machine


@dataclass(frozen=True)
class HealthStep:
    """The node health check (``gputopo check``'s service) as the doctor ran it: its verdict and
    one-line reason, findings, what it could not check, the GPUs with a problem (index -> why) and those
    whose driver asks to drain P2P (``no_p2p``: a note, but no multi-GPU set may hold them). ``checked``
    is false where there is no live machine (simulated, ``--input``)."""

    checked: bool
    verdict: str | None
    reason: str
    findings: tuple[Finding, ...] = ()
    not_checked: tuple[dict[str, str], ...] = ()
    unhealthy: Mapping[int, str] = field(default_factory=dict)
    window_s: float | None = None
    no_p2p: Mapping[int, str] = field(default_factory=dict)
    # The GPU pairs behind an ACS-redirecting bridge, from the PCIe path table the check read.
    redirected: Redirected = ()

    def to_json(self) -> dict[str, Any]:
        """The report's ``health`` section."""
        return {
            "checked": self.checked,
            "verdict": self.verdict,
            "reason": self.reason,
            "window_s": self.window_s,
            "findings": [f.to_json() for f in self.findings],
            "not_checked": list(self.not_checked),
            "unhealthy": [{"gpu": g, "why": why} for g, why in sorted(self.unhealthy.items())],
        }


def check_health(machine: Machine, options: Options) -> HealthStep:
    """Run the node health check (two NVML samples ``health_sample_s`` apart, the kernel log's Xid lines)
    on the live machine; a simulated machine has no health to read, and says so."""
    if machine.simulated:
        why = "simulated" if options.input is None else f"--input {options.input}: not this machine"
        return HealthStep(False, None, f"health: not checked ({why})")
    from gputopo.services.check import CheckOptions, run_check

    sample_s = max(0.0, options.health_sample_s)
    nvml_timeout_s = options.nvml_timeout_s if options.nvml_timeout_s is not None else DEFAULT_NVML_TIMEOUT_S
    result = run_check(
        CheckOptions(
            sample_s=sample_s,
            budget_s=max(20.0, sample_s + 4 * nvml_timeout_s),
            nvml_timeout_s=nvml_timeout_s,
        )
    )
    topo_errors = {g.index for g in machine.topology.gpus if g.error is not None}
    # A GPU the topology could not read already has its finding (link_findings: failing, not responding,
    # or another job's GPU, which is a note): the health check's "could not be read" would repeat it.
    kept = tuple(
        f
        for f in result.findings
        if not (f.gpu in topo_errors and f.category == "driver" and "could not be read" in f.what)
    )
    # The last `gputopo check` on this node, while fresh: its judgement over minutes (the state file) joins
    # doctor's own window, so both name the same sick GPUs.
    from gputopo.health.state import LAST_CHECK_WHAT
    from gputopo.system.machine import last_check

    sick = {f.gpu for f in kept if f.severity == PROBLEM and f.gpu is not None}
    uuids = {g.index: g.uuid for g in (result.sample.gpus if result.sample else ())}
    last, state_warning = last_check(uuids)
    kept += tuple(f for f in last if f.gpu not in sick)
    not_checked = tuple(n.to_json() for n in result.not_checked)
    if state_warning is not None:  # a state file that could not be used is said, never a silent nothing
        not_checked += ({"what": LAST_CHECK_WHAT, "why": state_warning},)
    unhealthy: dict[int, str] = {}
    for f in kept:
        if f.severity == PROBLEM and f.gpu is not None:
            unhealthy.setdefault(f.gpu, f.what)
    window = sample_s if result.sample is not None and sample_s > 0 else None
    return HealthStep(
        result.sample is not None,
        result.verdict,
        f"health: {result.reason}",
        kept,
        not_checked,
        unhealthy,
        window,
        drained_p2p(kept, unhealthy),
        result.redirected,
    )


def drained_p2p(findings: tuple[Finding, ...], unhealthy: Mapping[int, str]) -> dict[int, str]:
    """The drain rule, applied in this one place: the GPUs whose driver asks to drain P2P (index -> why),
    kept out of every multi-GPU set and probed alone; a GPU already left out as unhealthy is not named
    again. The rule itself is the shared machine step's (``services.machine.drained``)."""
    from gputopo.services.machine import drained

    return {g: what for g, what in drained(findings).items() if g not in unhealthy}


def machine_findings(
    topo: Topology, env: Mapping[str, str] | None, health: HealthStep | None = None
) -> list[Finding]:
    """What the topology and the environment's NCCL settings say before any probe, after the health
    findings. Where health ran, its PCIe rules (width below max, generation below max while busy) stand
    for the topology's busy-link finding, which is left out so a link is named once."""
    findings = link_findings(topo)
    if health is not None and health.checked:
        findings = [f for f in findings if not (f.category == "pcie" and f.gpu is not None)]
    env = os.environ if env is None else env
    head = list(health.findings) if health is not None else []
    return head + findings + nccl_env_findings(env, [nic.name or nic.label for nic in topo.nics])


@dataclass(frozen=True)
class Sets:
    """The GPUs the doctor works with: usable ones, those left out (with why), the set sizes it checks
    and the best set of each size before any probe."""

    usable: list[int]
    left_out: list[dict[str, Any]]
    sizes: list[int]
    first: list[dict[str, Any]]
    unhealthy: Mapping[int, str] = field(default_factory=dict)
    no_p2p: Mapping[int, str] = field(default_factory=dict)


def choose_sets(
    topo: Topology,
    unhealthy: Mapping[int, str] | None = None,
    no_p2p: Mapping[int, str] | None = None,
    redirected: Redirected = (),
) -> Sets:
    """Usable GPUs (none with a health problem), the common sizes that fit, and the recommended set of
    each size; a GPU whose driver asks to drain P2P (``no_p2p``) is in no set, so the sizes count
    without it; a pair behind an ACS-redirecting bridge (``redirected``) ranks after clean ones."""
    from gputopo.recommend import Constraints, exclusions

    usable, left_out = usable_gpus(topo, unhealthy)
    drained = {g: why for g, why in (no_p2p or {}).items() if g in usable}
    if drained:  # still probed on its own; out of the sets, with recommend's reason
        multi = exclusions(topo, Constraints(n=2, no_p2p=tuple(sorted(drained.items()))))
        left_out = sorted(
            left_out + [{"gpu": e.gpu, "why": e.why} for e in multi if e.gpu in drained],
            key=lambda e: e["gpu"],
        )
    sizes = common_sizes(len(usable) - len(drained))
    sick = dict(unhealthy or {})
    first = recommendations(topo, sizes, None, sick, drained, redirected)
    return Sets(usable, left_out, sizes, first, sick, drained)


@dataclass(frozen=True)
class ProbeStep:
    """The probe's ``gputopo/probe/v1`` document, or ``None`` with the note saying why not."""

    doc: dict[str, Any] | None
    note: str | None


def run_probes(
    machine: Machine,
    sets: Sets,
    options: Options,
    inventory: DeviceInventory | UnavailableError | None,
    bars: Callable[[Plan], AbstractContextManager[ProbeBars]] | None = None,
) -> ProbeStep:
    """Every usable pair and the recommended sets, probed in one run, unless ``--skip-probe``; a machine
    that cannot probe (no torch, no CUDA: ``inventory`` is the error) gets a note instead."""
    if options.skip_probe:
        return ProbeStep(None, "skipped (--skip-probe)")
    try:
        best = [r["best"]["gpus"] for r in sets.first if r["best"]]
        local = replace(options, inject=None, inject_gpus=None) if options.node is not None else options
        found = _inventory(inventory)
        return ProbeStep(
            probe_section(machine, sets.usable, best, local, found, bars, sets.unhealthy, sets.no_p2p), None
        )
    except UnavailableError as exc:
        return ProbeStep(None, f"not run: {exc.message}" + (f" ({exc.hint})" if exc.hint else ""))


@dataclass(frozen=True)
class Judged:
    """Every finding (the probe's added), and the sets chosen again in the light of the probes."""

    findings: list[Finding]
    recommendations: list[dict[str, Any]]


def judge(
    topo: Topology, sets: Sets, findings: list[Finding], probe: ProbeStep, redirected: Redirected = ()
) -> Judged:
    """The probe's failed checks become findings (wrong data behind an ACS-redirecting bridge names the
    bridge); the probe's evidence re-ranks the sets."""
    findings = findings + probe_findings(probe.doc, redirected)
    recs = (
        recommendations(topo, sets.sizes, probe.doc, sets.unhealthy, sets.no_p2p, redirected)
        if probe.doc
        else sets.first
    )
    return Judged(findings, recs)


@dataclass(frozen=True)
class AcrossNodes:
    """This node's part of the inter-node tests: every node's row and the tests' section, as in a probe
    across nodes; ``failing`` when any node failed (the verdict is then problems)."""

    nnodes: int
    rows: list[dict[str, Any]]
    section: dict[str, Any]
    failing: bool

    def words(self) -> str:
        """What the headline adds."""
        if not self.failing:
            return f"; across {self.nnodes} nodes: every node passed"
        bad = [str(r["node_rank"]) for r in self.rows if r["verdict"] == "fail"]
        return f"; across {self.nnodes} nodes: " + (
            f"node rank {', '.join(bad)} failed" if bad else f"inter-node tests {self.section['status']}"
        )


@dataclass(frozen=True)
class DoctorReport:
    """What ``run`` found, step by step; ``document()`` is the whole ``gputopo/doctor/v1`` JSON, built
    there and nowhere else. ``stale`` (the kill-stale dry run) and ``created_utc`` were read when the
    report was made; ``no_driver``: a machine without a driver shown simulated though nobody asked for a
    simulation (exit 3, ``unavailable``); ``report`` the files written for it (``with_files``)."""

    machine: Machine
    sets: Sets
    judged: Judged
    probe: ProbeStep
    health: HealthStep
    stale: Mapping[str, Any]
    created_utc: str
    no_driver: bool = False
    across: AcrossNodes | None = None
    interrupted: str | None = None  # the signal that stopped the probes
    report: Mapping[str, str] | None = None

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.judged.findings if f.severity == PROBLEM]

    @property
    def verdict(self) -> str:
        if self.interrupted is not None:
            return "interrupted"
        failing = self.across is not None and self.across.failing
        return "problems" if self.problems or failing else "healthy"

    @property
    def exit_code(self) -> int:
        if self.no_driver:
            return EXIT_UNAVAILABLE
        return 0 if self.verdict == "healthy" else EXIT_PROBLEM

    def unavailable(self) -> UnavailableError | None:
        """Why this run exits 3 (``no_driver``): the simulation shown is the best first look, but this
        machine's GPUs were not checked, and ``gputopo doctor || alert`` must not read that as healthy."""
        if not self.no_driver:
            return None
        return UnavailableError(
            f"{(self.machine.why_simulated or '').split(';')[0]}: this machine's GPUs were not checked "
            "(the run above is a simulation)",
            "load the NVIDIA driver (see `nvidia-smi`), or pass --simulate to ask for the simulation",
        )

    def with_files(self, paths: Mapping[str, str]) -> DoctorReport:
        return replace(self, report=dict(paths))

    def document(self) -> dict[str, Any]:
        """The ``gputopo/doctor/v1`` document (docs/doctor.md). ``findings`` holds every finding, the
        health check's first; ``health`` the health section; across nodes ``nodes`` and ``internode``; a
        run a signal stopped says ``interrupted`` (and names no files: it is written as it stops)."""
        from gputopo.topology import snapshot

        machine, probe, topo = self.machine, self.probe, self.machine.topology
        device = (probe.doc or {}).get("device") or ("cpu" if machine.simulated else "cuda")
        words = headline(
            topo, machine.simulated, self.problems, self.sets.usable, probe.doc, probe.note,
            health_findings(self.health),
        )  # fmt: skip
        words += _sick_words(self.health) + (
            f"; {len(topo.warnings)} warning(s) about the input" if topo.warnings else ""
        )
        words += self.across.words() if self.across is not None else ""
        across = {"nodes": self.across.rows, "internode": self.across.section} if self.across else {}
        return {
            "schema": SCHEMA,
            "gputopo_version": __version__,
            "created_utc": self.created_utc,
            "simulated": machine.simulated,
            "why_simulated": machine.why_simulated,
            "device": device,
            "machine": _machine_record(machine, device),
            "verdict": self.verdict,
            "headline": f"{probe.note}; {words}" if self.interrupted is not None else words,
            "warnings": list(topo.warnings),
            "health": self.health.to_json(),
            "topology": snapshot.to_dict(topo),
            "findings": [asdict(f) for f in self.judged.findings],
            "left_out": self.sets.left_out,
            "recommendations": self.judged.recommendations,
            "stale": dict(self.stale),
            "probe": probe.doc,
            "probe_note": probe.note,
            "pairs": pair_rows(topo, probe.doc),
            **across,
            **(
                {"interrupted": self.interrupted} if self.interrupted is not None else {"report": self.report}
            ),
        }


def make_report(
    machine: Machine, sets: Sets, judged: Judged, probe: ProbeStep, health: HealthStep, options: Options
) -> DoctorReport:
    """The report of the steps so far; the stale holders are listed (dry run) and the time taken now."""
    return DoctorReport(
        machine,
        sets,
        judged,
        probe,
        health,
        stale_section(),
        datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        no_driver=machine.simulated and options.no_driver_is_unavailable,
    )


def _machine_record(machine: Machine, device: str) -> dict[str, Any]:
    """Which machine this report is about (``--from-report`` refuses it on another one)."""
    import platform

    from gputopo.topology.identity import topology_record

    return topology_record(machine.topology, platform.node(), device, live=not machine.simulated)


def _sick_words(health: HealthStep | None) -> str:
    """The GPUs the health check found sick, for the headline ("" when none)."""
    if health is None or not health.unhealthy:
        return ""
    gpus = ", ".join(f"GPU{g}" for g in sorted(health.unhealthy))
    return f"; health problems on {gpus} (left out of the probes and sets)"


def across_nodes(
    report: DoctorReport,
    inventory: DeviceInventory,
    options: Options,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> DoctorReport:
    """This node's part of the inter-node tests (every usable GPU a rank), added to its report as in a
    probe across nodes; any node failing makes the verdict problems. ``inventory``: what ``run`` read
    once for the probes too."""
    from gputopo.probe.plan.config import build_config
    from gputopo.probe.plan.options import Mode
    from gputopo.probe.pool.multinode import gpu_nics, judge_outcome, run_cross
    from gputopo.probe.report.nodes import any_failed

    node, machine = options.node, report.machine
    if node is None:
        raise ValueError("across_nodes needs options.node")
    usable = report.sets.usable
    if inventory.device == "cuda":
        usable = [g for g in usable if g in set(inventory.gpus)]
    if not usable:
        raise UnavailableError(
            f"node {node.node_rank}: no usable GPU to take part in the inter-node tests",
            "start gputopo only on nodes with a working GPU, and --nnodes to match",
        )
    config = build_config(
        inventory,
        [",".join(map(str, usable))],
        mode=Mode.ALLREDUCE,
        timeout_s=options.timeout_s,
        report_dir=options.report_dir,
        topology_input=machine.topology.source if machine.simulated else None,
        inject=options.inject,
    )
    problems = report.problems
    local = {
        "verdict": "fail" if problems else "pass",
        "sets": [],
        "findings": [
            {
                "kind": "doctor",
                "nodes": [node.node_rank],
                "detail": f"node {node.node_rank}: {f.where}: {f.what}",
                "remedy": f.remedy,
            }
            for f in problems
        ],
    }
    outcome = run_cross(config, node, local, gpu_nics(machine.topology, tuple(usable)), on_row)
    rows, section = judge_outcome(node, config, outcome)
    return replace(report, across=AcrossNodes(node.nnodes, rows, section, any_failed(rows, section)))


# The title of the table of problems in every view (terminal, Markdown, HTML). The headline is printed
# last in the terminal and first in the files, so it names the table, not a direction.
REMEDIES_TITLE = "Problems and remedies"
HEALTH_TITLE = "Health"  # the health check's findings, in their own section first


def health_findings(health: HealthStep | None) -> tuple[Finding, ...]:
    """The findings the health section shows (``()`` without a health step)."""
    return tuple(health.findings) if health is not None else ()


def _remedy_titles(problems: list[Finding], from_health: tuple[Finding, ...]) -> list[str]:
    titles = [HEALTH_TITLE] if any(p in from_health for p in problems) else []
    return titles + ([REMEDIES_TITLE] if any(p not in from_health for p in problems) else [])


def headline(
    topo: Topology,
    simulated: bool,
    problems: list[Finding],
    usable: list[int],
    probe: dict[str, Any] | None,
    probe_note: str | None,
    from_health: tuple[Finding, ...] = (),
) -> str:
    """One sentence: healthy or not, how much was checked, and under which title the remedies are
    (``from_health``: the problems the health section shows, under its own title)."""
    prefix = "SIMULATED: " if simulated else ""
    checked = (
        f"{len(probe['sets'])} GPU set(s) probed"
        if probe
        else f"probes {probe_note}"
        if probe_note
        else "no probes"
    )
    if problems:
        return (
            f"{prefix}{len(problems)} problem(s) found on {topo.source} ({checked}); "
            f"their remedies are under {' and '.join(repr(t) for t in _remedy_titles(problems, from_health))}"
        )
    return f"{prefix}healthy: {len(usable)} of {len(topo.gpus)} GPUs usable, no problems found ({checked})"


REPORT_HINT = "give a reports/doctor-*.json or probe-*.json file that gputopo wrote"
# Every report ``gputopo report`` shows, by its schema, and the command that wrote it.
REPORT_SCHEMAS = {SCHEMA: "doctor", "gputopo/probe/v1": "probe"}


def saved_report(doc: object, label: str) -> tuple[dict[str, Any], str]:
    """A saved report's document (read from the file ``label`` names) and the command that wrote it
    (any schema in ``REPORT_SCHEMAS``); ``InputError`` in plain words otherwise."""
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or schema not in REPORT_SCHEMAS:
        found = f"its schema is {schema!r}" if schema else "it has no schema field"
        raise InputError(f"{label}: not a gputopo doctor or probe report ({found})", REPORT_HINT)
    kind = REPORT_SCHEMAS[schema]
    probe = doc if kind == "probe" else doc.get("probe")
    for entry in (probe.get("sets") if isinstance(probe, dict) else None) or ():
        gpus = entry.get("gpus") if isinstance(entry, dict) else None
        if not isinstance(gpus, list) or not all(_is_index(g) for g in gpus):
            shown = gpus if isinstance(gpus, list) else entry
            raise InputError(f"{label}: a probed set's GPUs are not GPU indices: {shown!r:.60}", REPORT_HINT)
    return doc, kind


def _is_index(value: object) -> bool:
    """A GPU index as NVML numbers them: a whole number from 0 (JSON's true/false are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1024
