"""``gputopo doctor``: the whole check of one machine, as one report document.

It reads the topology, judges the links and the environment's NCCL settings (``findings``), lists stale
GPU holders (dry run), probes every pair shortly and the recommended sets for the common sizes,
recommends sets again in the light of what the probes found, and sums it all up. On a machine without an
NVIDIA GPU it runs the same steps on a sample machine with CPU ranks standing in for the GPUs, and says
"simulated" everywhere.

The result is a plain ``gputopo/doctor/v1`` dict, so the report can be saved, re-rendered and turned
into HTML anywhere (``gputopo report``; its Markdown is ``ui.doctor_markdown``). This module only
orchestrates: ``run_doctor`` is the pipeline, one step a line, and each step is a function below it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gputopo import __version__
from gputopo.errors import GputopoError, Interrupted, UnavailableError, UsageError
from gputopo.findings import NOTE, PROBLEM, Finding, link_findings, nccl_env_findings
from gputopo.health.check import DEFAULT_NVML_TIMEOUT_S, DEFAULT_SAMPLE_S
from gputopo.model import Topology

SCHEMA = "gputopo/doctor/v1"
DEFAULT_SAMPLE = "quad-nv4-pairs-2socket"
COMMON_SIZES = (2, 4)
# CPU stand-in ranks exist for indices 0-7 only (gputopo.probe.plan.config.CPU_STAND_INS).
MAX_SIMULATED_GPUS = 8


@dataclass(frozen=True, kw_only=True)
class DoctorOptions:
    """What the user chose, by keyword, built and validated once per command (``check_options``); each
    default is written here once. ``None`` means the default for the device (tiny ResNet on CPU, the
    quick show's micro CNN in a simulation)."""

    input: str | None = None
    steps: int | None = None  # None: DEFAULT_STEPS, or the quick show's QUICK_STEPS
    timeout_s: float = 120.0
    skip_probe: bool = False
    model: str | None = None
    report_dir: Path = Path("reports")
    env: Mapping[str, str] | None = None  # the environment whose NCCL settings are checked (os.environ)
    simulate: bool = False  # asked for: run on the sample machine even where there are GPUs
    inject: Any = None  # a ``probe.plan.options.Fault`` for a drill, planted where ``inject_gpus`` says
    inject_gpus: str | None = None
    nvml_timeout_s: float | None = None  # per live NVML read; None: the default
    health_sample_s: float = (
        DEFAULT_SAMPLE_S  # the health check's window between its two samples (check's --sample-s)
    )
    skip_speed: bool = False
    # Across nodes (``gputopo.probe.plan.nodes.NodeOptions``): after this machine's checks, the inter-node
    # tests; ``inject`` then goes into them (on ``node.inject_node``), not into this machine's probes.
    node: Any = None
    on_row: Any = None  # prints the inter-node progress
    on_start: Any = None  # called with the ``Machine`` once it is read, before anything slow (a first line)
    nccl_log: Path | None = None  # a job's output whose ``NCCL DIAG`` lines join the findings (--nccl-log)
    dcgm_diag: Path | None = None  # a saved ``dcgmi diag -j`` output whose results join the findings
    health_validation: Path | None = None  # a saved NVIDIA Health Validation NodeVerdict, likewise
    full: bool = False  # a simulation runs the full probe, not the quick show


# The first look a newcomer gets without a GPU (``doctor`` or ``doctor --simulate`` on the default sample)
# is a quick show: the same checks of every pair and set on CPU stand-ins, with a micro CNN for two steps
# and no speed table (stand-ins' timings are never judged); ``--full`` runs the full probe.
DEFAULT_STEPS = 5
QUICK_STEPS = 2
QUICK_MODEL = "micro"


def quick_show(machine: Machine, options: DoctorOptions) -> bool:
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


def quick_words(options: DoctorOptions) -> str:
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


# Given a probe plan, a context manager whose value has ``update(job, row)`` (progress bars).
ProbeHook = Callable[[Any], AbstractContextManager[Any]]


def choose_machine(spec: str | None, simulate: bool = False, nvml_timeout_s: float | None = None) -> Machine:
    """This machine when it has NVIDIA GPUs; otherwise a sample (or ``--input``), simulated on CPU."""
    from gputopo.machine import load_topology

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
) -> list[dict[str, Any]]:
    """The best set for each size (GPUs with a health problem left out, and those whose driver asks to
    drain P2P, ``no_p2p``, left out of every set of two or more), with its export line; a size that can't
    be met says why."""
    from gputopo.recommend import Constraints, candidate_dict, evidence_from_report, recommend

    evidence = evidence_from_report(evidence_doc, "doctor probes") if evidence_doc else None
    sick = tuple(sorted((unhealthy or {}).items()))
    drained = tuple(sorted((no_p2p or {}).items()))
    redirected = redirected_pairs(topo)  # pairs behind an ACS-redirecting bridge rank after clean ones
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


def probe_section(
    machine: Machine,
    usable: list[int],
    sizes_sets: list[list[int]],
    options: DoctorOptions,
    hook: ProbeHook | None,
    sick: Mapping[int, str] | None = None,
    no_p2p: Mapping[int, str] | None = None,
) -> dict[str, Any] | None:
    """Every pair (short) and the recommended larger sets in one probe run (one pool of ranks, a fresh
    one only after a hang or crash); its ``gputopo/probe/v1`` document. What doctor already read is
    handed down: the machine's topology (for the GPU list and the bandwidth model) and, on a live
    machine, the health its window found (``sick``), so the probe reads neither again. A GPU whose
    driver asks to drain P2P (``no_p2p``) is in no pair: it gets the one-GPU checks alone."""
    from gputopo.probe.plan.config import build_config
    from gputopo.probe.plan.options import Mode
    from gputopo.probe.plan.schedule import Job, make_plan
    from gputopo.probe.pool.devices import detect_devices, require_torch
    from gputopo.probe.pool.runner import run_probe
    from gputopo.probe.report.document import to_document
    from gputopo.probe.shared import TopologyView

    require_torch()
    live_topology = None if machine.simulated else machine.topology
    inventory = detect_devices(
        "cpu" if machine.simulated else None, nvml_timeout_s=options.nvml_timeout_s, topology=live_topology
    )
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
    if hook is None:
        run = run_probe(config, **handed)
    else:
        with hook(plan) as bars:
            run = run_probe(config, bars.update, **handed)
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


def probe_findings(
    probe: dict[str, Any] | None, redirected: tuple[tuple[int, int, tuple[str, ...]], ...] = ()
) -> list[Finding]:
    """A problem for every failed check, with the probe's remedy. Wrong data on a set with a pair whose
    PCIe path crosses an ACS-redirecting bridge (``redirected``) names that bridge as the likely cause."""
    out = []
    behind = {frozenset((a, b)): bridges for a, b, bridges in redirected}
    for s in (probe or {}).get("sets", []):
        where = "GPUs " + ",".join(str(g) for g in s["gpus"])
        pairs = [
            (a, b) for i, a in enumerate(s["gpus"]) for b in s["gpus"][i + 1 :] if frozenset((a, b)) in behind
        ]
        for c in s["checks"]:
            if c["name"] == "gpu" and c.get("kind") not in ("hung", "crashed"):
                out += per_gpu_findings(c)  # one per GPU found slow, corrupt or undecided (pass or fail)
            elif c["verdict"] == "fail":
                what = f"{c['name']} check failed ({c.get('kind')}): {c.get('detail')}"
                if pairs and c.get("kind") in ("corrupt", "nan", "diverged"):
                    bridges = sorted({br for a, b in pairs for br in behind[frozenset((a, b))]})
                    what += (
                        f"; the likely cause: ACS redirects P2P between "
                        f"{', '.join(f'GPU{a}-GPU{b}' for a, b in pairs)} at bridge {', '.join(bridges)} "
                        "(see that bridge's finding)"
                    )
                out.append(Finding(where, what, c.get("remedy") or "see the probe report"))
    return out


def redirected_pairs(topo: Topology) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """This machine's GPU pairs behind an ACS-redirecting bridge (``fabric``); none for a simulated one."""
    if not topo.live:
        return ()
    from gputopo import fabric

    return fabric.redirected(fabric.gpu_bus_ids([(g.index, g.pci_bus_id) for g in topo.gpus]))


_UNDECIDED_SPEED_REMEDY = (
    "Nothing to do for it now: run `gputopo probe --mode gpu` again when the machine is quieter to decide."
)


def per_gpu_findings(check: dict[str, Any]) -> list[Finding]:
    """The per-GPU check's slow or corrupt GPUs, one finding each (``drain`` for a corrupt GPU); a GPU
    whose speed is undecided (a difference this machine's noise swallows) is a note, not a problem."""
    out = []
    for row in (check.get("metrics") or {}).get("rows") or []:
        verdict = row.get("verdict")
        if verdict in ("slow", "corrupt", "undecided"):
            action = "drain" if verdict == "corrupt" else "monitor"
            what = f"per-GPU check: {verdict}: {row.get('why')}"
            remedy = check.get("remedy") or "see the probe report"
            if row.get("undecided_about") == "speed":
                what, remedy = f"per-GPU check: {row.get('why')}", _UNDECIDED_SPEED_REMEDY
            severity = NOTE if row.get("undecided_about") == "speed" else PROBLEM
            out.append(
                Finding(
                    f"GPU{row['gpu']}", what, remedy, severity, row["gpu"], category="compute", action=action
                )
            )
    return out


def run_doctor(options: DoctorOptions, probe_hook: ProbeHook | None = None) -> dict[str, Any]:
    """Check the machine end to end and return the ``gputopo/doctor/v1`` document (not yet written).

    A pipeline, read top to bottom: each step takes what the one before it handed over and calls no
    step back.
    """
    check_options(options)
    diag = nccl_log_findings(options.nccl_log)  # NCCL DIAG lines of a job's log, read before the slow part
    diag += imported_findings(options)  # saved dcgmi diag / Health Validation results, likewise
    machine = read_machine(options)  # the topology: this machine, or a sample simulated on CPU
    if options.on_start is not None:
        options.on_start(machine)
    health = check_health(machine, options)  # node health first: its sick GPUs are left out below
    findings = machine_findings(machine.topology, options.env, health) + diag  # links, NCCL settings
    sets = choose_sets(machine.topology, health.unhealthy, health.no_p2p)  # usable GPUs, sizes, best sets
    try:
        probe = run_probes(machine, sets, options, probe_hook)  # probe plan -> one probe run
    except Interrupted as exc:  # a stop signal: what was complete goes up with it, marked interrupted
        exc.partial = interrupted_document(machine, sets, findings, exc, health)
        raise
    judged = judge(machine.topology, sets, findings, probe)  # probe findings; sets chosen again
    doc = to_document(machine, sets, judged, probe, health)  # the report document
    if options.node is not None:
        doc = across_nodes(doc, machine, sets.usable, options)  # this node's part of the run across nodes
    return doc


def interrupted_document(
    machine: Machine, sets: Sets, findings: list[Finding], exc: Interrupted, health: HealthStep
) -> dict[str, Any]:
    """The document of a doctor run a signal stopped during the probes: topology, findings and sets as
    judged before it, the probe checks done so far (the rest say "not reached"), marked ``interrupted``."""
    from gputopo.probe.report.document import to_document as probe_document

    note = f"interrupted by {exc.name}"
    probe = ProbeStep(probe_document(exc.partial) if exc.partial is not None else None, note)
    try:
        judged = judge(machine.topology, sets, findings, probe)
    except Exception:  # a partial probe must never cost the rest of the report
        probe = ProbeStep(None, note)
        judged = judge(machine.topology, sets, findings, probe)
    doc = to_document(machine, sets, judged, probe, health)
    return {
        **doc,
        "verdict": "interrupted",
        "interrupted": exc.name,
        "headline": f"{note}; {doc['headline']}",
    }


def check_options(options: DoctorOptions) -> None:
    """Usage errors in the options, before anything is read (exit 2)."""
    if options.steps is not None and options.steps < 1:
        raise UsageError(f"--steps {options.steps}: must be at least 1", "e.g. --steps 5")
    if not options.timeout_s > 0:
        raise UsageError(f"--timeout {options.timeout_s:g}: must be positive", "e.g. --timeout 120")
    across = options.node is not None and options.inject is not None
    if across and options.inject_gpus is not None:
        raise UsageError(
            "across nodes --inject goes into the inter-node tests of --inject-node", "drop --inject-gpus"
        )
    if not across and (options.inject is None) != (options.inject_gpus is None):
        raise UsageError(
            "--inject and --inject-gpus go together in doctor", "e.g. --inject corrupt --inject-gpus 5,6"
        )
    if options.inject is not None and options.skip_probe and options.node is None:
        raise UsageError("--inject plants a fault in the probes, and --skip-probe skips them", "drop one")


def nccl_log_findings(path: Path | None) -> list[Finding]:
    """``--nccl-log FILE``: a problem for every failed ``NCCL DIAG`` check of the log, and notes (how many
    lines and checks, NCCL's other ``[INFO]`` lines, or that the log holds none). An unreadable file is an
    ``InputError`` (exit 2) before anything else runs."""
    if path is None:
        return []
    from gputopo.findings import NOTE, finding_from_json
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


def imported_findings(options: DoctorOptions) -> list[Finding]:
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


def read_machine(options: DoctorOptions) -> Machine:
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


def check_health(machine: Machine, options: DoctorOptions) -> HealthStep:
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
    from gputopo.machine import last_check

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
    from gputopo.health.judge import p2p_drained

    no_p2p = {g: what for g, what in p2p_drained(kept).items() if g not in unhealthy}
    return HealthStep(
        result.sample is not None,
        result.verdict,
        f"health: {result.reason}",
        kept,
        not_checked,
        unhealthy,
        window,
        no_p2p,
    )


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
    topo: Topology, unhealthy: Mapping[int, str] | None = None, no_p2p: Mapping[int, str] | None = None
) -> Sets:
    """Usable GPUs (none with a health problem), the common sizes that fit, and the recommended set of
    each size; a GPU whose driver asks to drain P2P (``no_p2p``) is in no set, so the sizes count
    without it."""
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
    return Sets(usable, left_out, sizes, recommendations(topo, sizes, None, sick, drained), sick, drained)


@dataclass(frozen=True)
class ProbeStep:
    """The probe's ``gputopo/probe/v1`` document, or ``None`` with the note saying why not."""

    doc: dict[str, Any] | None
    note: str | None


def run_probes(
    machine: Machine, sets: Sets, options: DoctorOptions, probe_hook: ProbeHook | None
) -> ProbeStep:
    """Every usable pair and the recommended sets, probed in one run, unless ``--skip-probe``; a machine
    that cannot probe (no torch, no CUDA) gets a note instead."""
    if options.skip_probe:
        return ProbeStep(None, "skipped (--skip-probe)")
    try:
        best = [r["best"]["gpus"] for r in sets.first if r["best"]]
        local = replace(options, inject=None, inject_gpus=None) if options.node is not None else options
        return ProbeStep(
            probe_section(machine, sets.usable, best, local, probe_hook, sets.unhealthy, sets.no_p2p), None
        )
    except UnavailableError as exc:
        return ProbeStep(None, f"not run: {exc.message}" + (f" ({exc.hint})" if exc.hint else ""))


@dataclass(frozen=True)
class Judged:
    """Every finding (the probe's added), and the sets chosen again in the light of the probes."""

    findings: list[Finding]
    recommendations: list[dict[str, Any]]


def judge(topo: Topology, sets: Sets, findings: list[Finding], probe: ProbeStep) -> Judged:
    """The probe's failed checks become findings; the probe's evidence re-ranks the sets."""
    findings = findings + probe_findings(probe.doc, redirected_pairs(topo))
    recs = (
        recommendations(topo, sets.sizes, probe.doc, sets.unhealthy, sets.no_p2p) if probe.doc else sets.first
    )
    return Judged(findings, recs)


def to_document(
    machine: Machine, sets: Sets, judged: Judged, probe: ProbeStep, health: HealthStep | None = None
) -> dict[str, Any]:
    """The ``gputopo/doctor/v1`` document; the stale holders are listed (dry run) as it is built.
    ``findings`` holds every finding, the health check's first; ``health`` the health section."""
    from gputopo.topology import snapshot

    topo = machine.topology
    problems = [f for f in judged.findings if f.severity == PROBLEM]
    device = (probe.doc or {}).get("device") or ("cpu" if machine.simulated else "cuda")
    return {
        "schema": SCHEMA,
        "gputopo_version": __version__,
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "simulated": machine.simulated,
        "why_simulated": machine.why_simulated,
        "device": device,
        "machine": _machine_record(machine, device),
        "verdict": "problems" if problems else "healthy",
        "headline": headline(
            topo, machine.simulated, problems, sets.usable, probe.doc, probe.note, health_findings(health)
        )
        + _sick_words(health)
        + (f"; {len(topo.warnings)} warning(s) about the input" if topo.warnings else ""),
        "warnings": list(topo.warnings),
        "health": (health or HealthStep(False, None, "health: not checked")).to_json(),
        "topology": snapshot.to_dict(topo),
        "findings": [asdict(f) for f in judged.findings],
        "left_out": sets.left_out,
        "recommendations": judged.recommendations,
        "stale": stale_section(),
        "probe": probe.doc,
        "probe_note": probe.note,
        "pairs": pair_rows(topo, probe.doc),
    }


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
    doc: dict[str, Any], machine: Machine, usable: list[int], options: DoctorOptions
) -> dict[str, Any]:
    """This node's part of the inter-node tests (every usable GPU a rank), added to its doctor document:
    ``nodes`` and ``internode`` as in a probe across nodes; any node failing makes the verdict problems."""
    from gputopo.probe.plan.config import build_config
    from gputopo.probe.plan.options import Mode
    from gputopo.probe.pool.devices import detect_devices, require_torch
    from gputopo.probe.pool.multinode import gpu_nics, judge_outcome, run_cross
    from gputopo.probe.report.nodes import any_failed

    node = options.node
    require_torch()
    live_topology = None if machine.simulated else machine.topology
    inventory = detect_devices(
        "cpu" if machine.simulated else None, nvml_timeout_s=options.nvml_timeout_s, topology=live_topology
    )
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
    problems = [f for f in doc["findings"] if f["severity"] == PROBLEM]
    local = {
        "verdict": "fail" if problems else "pass",
        "sets": [],
        "findings": [
            {
                "kind": "doctor",
                "nodes": [node.node_rank],
                "detail": f"node {node.node_rank}: {f['where']}: {f['what']}",
                "remedy": f["remedy"],
            }
            for f in problems
        ],
    }
    outcome = run_cross(config, node, local, gpu_nics(machine.topology, tuple(usable)), options.on_row)
    rows, section = judge_outcome(node, config, outcome)
    failing = any_failed(rows, section)
    doc = {**doc, "nodes": rows, "internode": section}
    if failing:
        doc["verdict"] = "problems"
        bad = [str(r["node_rank"]) for r in rows if r["verdict"] == "fail"]
        doc["headline"] += f"; across {node.nnodes} nodes: " + (
            f"node rank {', '.join(bad)} failed" if bad else f"inter-node tests {section['status']}"
        )
    else:
        doc["headline"] += f"; across {node.nnodes} nodes: every node passed"
    return doc


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
