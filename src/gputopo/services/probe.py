"""``gputopo probe``'s service: check GPU sets for real (P2P copies, DataParallel and DDP against one GPU,
an all-reduce sweep, each GPU on its own), on one machine or across nodes.

The steps, in order: the NCCL settings that would skew the measurements (warnings); torch (unless
``--dry-run``); the devices (``probe.pool.devices``: NVML's GPUs, narrowed to those that can be probed);
on live GPUs one health sample, whose drain-P2P GPUs ``p2p_left_out`` keeps out of the set the probe
picks itself; the options frozen against what exists (``probe.plan.config.build_config``; with
``--input``, every GPU must exist on that machine too); then the plan (``--dry-run`` stops here), the
run (``probe.pool.runner``, or ``probe.pool.multinode`` across nodes) and its judgement.

The CLI builds ``Options`` (``--gpus`` parsed once, here: ``gpu_sets``), calls ``run`` and shows the
report; no console or typer object comes down: ``Hooks`` carries the callbacks. torch is imported only
by the ranks, inside the run, so importing this module stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from gputopo.errors import EXIT_PROBLEM, Interrupted, UsageError
from gputopo.probe.plan import options as plan
from gputopo.probe.plan.options import Fault, Mode, Precision  # the CLI imports its choices from here

if TYPE_CHECKING:
    from gputopo.health.judge import Judgement
    from gputopo.probe.plan.config import DeviceInventory, ProbeConfig
    from gputopo.probe.plan.nodes import NodeOptions
    from gputopo.probe.plan.schedule import Job, Plan
    from gputopo.probe.shared import ProbeRun

Document = dict[str, Any]
# GPU sets by nvidia-smi index (CPU stand-ins with --device cpu), each in rank order: ``--gpus 5,6``.
GpuSets = tuple[tuple[int, ...], ...]
# A GPU pair behind an ACS-redirecting bridge: (gpu, gpu, the bridges).
RedirectedPair = tuple[int, int, tuple[str, ...]]


class Device(str, Enum):
    """Where the ranks run."""

    CUDA = "cuda"
    CPU = "cpu"


class ModelName(str, Enum):
    """torchvision ResNets; ``tiny`` is the smallest, for CPU runs; ``micro`` a small residual CNN in torch
    alone (no torchvision), the quick simulated doctor's."""

    RESNET18 = "resnet18"
    RESNET50 = "resnet50"
    TINY = "tiny"
    MICRO = "micro"


DEFAULT_MODEL_NAME = ModelName(plan.DEFAULT_MODEL)


# --- the inputs, read before anything else (each bad one: exit 2, one line) ---------------------------------


def gpu_sets(texts: list[str] | None) -> GpuSets | None:
    """``--gpus 5,6 --gpus 6,7`` -> ``((5, 6), (6, 7))``, by the one GPU-list rule (``gputopo.gpulist``);
    ``None`` when none is given (the probe picks: every GPU it may use)."""
    from gputopo.gpulist import parse_gpu_list

    return None if texts is None else tuple(parse_gpu_list(text, "--gpus") for text in texts)


def byte_size(option: str, text: str | None) -> int | None:
    """``--min-bytes``/``--max-bytes`` as nccl-tests reads them (``8``, ``1K``, ``256M``) in bytes."""
    from gputopo.probe.plan.config import parse_size

    return None if text is None else parse_size(option, text)


# --- what the CLI hands down --------------------------------------------------------------------------------


class ProgressDisplay(Protocol):
    """What shows a run's progress while it runs (the CLI's bars on stderr): opened around the run, told
    every progress row of a launch."""

    def __enter__(self) -> ProgressDisplay: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def update(self, job: Job, row: dict[str, Any]) -> None: ...


def _nothing(*_: object) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """What the service tells its caller while it runs.

    ``warn``: a line for stderr. ``progress``: the display of a run on one machine, made from its plan
    (``None``: nothing shown, as with ``--json``). Across nodes: ``before_nodes`` is called with this
    node's place once every option is checked, just before it goes to the rendezvous (the CLI refuses a
    host that does not resolve there), and ``on_row`` with every progress row of the inter-node tests.
    """

    warn: Callable[[str], None]
    progress: Callable[[Plan], ProgressDisplay] | None = None
    before_nodes: Callable[[NodeOptions], None] = _nothing
    on_row: Callable[[dict[str, Any]], None] | None = None


@dataclass(frozen=True, kw_only=True)
class Options:
    """The probe's options, as typed values. ``gpus``: the sets asked for (``None``: the probe picks);
    ``tolerance_pct`` in percent; ``node``: this node's place in a run across nodes (``None``: one
    machine). Checked here, once, for what they say together; what needs the machine (which GPUs
    exist) is checked by ``probe.plan.config.build_config`` when the run starts."""

    gpus: GpuSets | None = None
    each_pair: bool = False
    mode: Mode = Mode.ALL
    device: Device | None = None
    model: ModelName = DEFAULT_MODEL_NAME
    batch_size: int = plan.DEFAULT_BATCH_SIZE
    steps: int = plan.DEFAULT_STEPS
    lr: float = plan.DEFAULT_LR
    seed: int = plan.DEFAULT_SEED
    timeout_s: float = plan.DEFAULT_TIMEOUT_S
    precisions: tuple[Precision, ...] = ()
    tolerance_pct: float | None = None
    inject: Fault | None = None
    inject_rank: int | None = None
    inject_gpus: str | None = None
    report_dir: Path = Path(plan.DEFAULT_REPORT_DIR)
    topology_input: str | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None
    step_factor: int = plan.DEFAULT_STEP_FACTOR
    iters: int | None = None
    dry_run: bool = False
    node: NodeOptions | None = None
    nvml_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.node is None:
            return
        if self.each_pair or len(self.gpus or ()) > 1:
            raise UsageError(
                "across nodes each node probes one set of its GPUs",
                "give one --gpus list (the same on every node), or none for all; drop --each-pair",
            )
        if self.dry_run:
            raise UsageError(
                "--dry-run shows one machine's plan", "drop --nnodes to see this node's own plan"
            )
        if self.inject_gpus is not None or self.inject_rank is not None:
            raise UsageError(
                "across nodes --inject goes into every rank of --inject-node",
                "drop --inject-gpus and --inject-rank, and name the node with --inject-node",
            )


# Every option's default, for the CLI's signature.
DEFAULTS = Options()


# --- what comes back ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanReport:
    """``--dry-run``: the plan (``gputopo/probe-plan/v1``); nothing started, no report files."""

    plan: Document
    report_dir: Path | None = None
    exit_code: int = 0

    def document(self) -> Document:
        return dict(self.plan)

    def with_files(self, paths: Mapping[str, str]) -> PlanReport:
        return self


@dataclass(frozen=True)
class ProbeReport:
    """A run on one machine: the judged run, the bridges likely behind wrong data (``None``: not asked,
    off live GPUs or without wrong data), why nothing was tested (``None``: something was), and the
    report files once written (under ``report_dir``)."""

    run: ProbeRun
    report_dir: Path | None
    path_causes: tuple[str, ...] | None = None
    untested: str | None = None
    files: Mapping[str, str] | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_PROBLEM if self.run.verdict == "fail" else 0

    def document(self) -> Document:
        """The ``gputopo/probe/v1`` document; a run that tested nothing reads ``skipped``."""
        from gputopo.probe.report.document import to_document

        doc = to_document(self.run, dict(self.files) if self.files is not None else None)
        if self.path_causes is not None:
            doc = {**doc, "path_causes": list(self.path_causes)}
        if self.untested is not None:
            doc = {**doc, "verdict": "skipped"}
        return doc

    def with_files(self, paths: Mapping[str, str]) -> ProbeReport:
        return replace(self, files=dict(paths))


@dataclass(frozen=True)
class NodesReport:
    """This node's part of a run across nodes (``probe.pool.multinode``'s document); node rank 0 writes
    the report (``report_dir``; ``None`` on the other nodes)."""

    doc: Document
    report_dir: Path | None
    files: Mapping[str, str] | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_PROBLEM if self.doc.get("verdict") == "fail" else 0

    def document(self) -> Document:
        return {**self.doc, "report": dict(self.files)} if self.files is not None else dict(self.doc)

    def with_files(self, paths: Mapping[str, str]) -> NodesReport:
        return replace(self, files=dict(paths))


Report = PlanReport | ProbeReport | NodesReport


def refuse_untested(report: Report) -> None:
    """A run that tested nothing must not read as a PASS, to a person or to ``gputopo probe && ...``: exit
    2 with the reason (after its report is written, which the hint names)."""
    if not isinstance(report, ProbeReport) or report.untested is None:
        return
    where = (report.files or {}).get("json")
    raise UsageError(
        f"nothing was tested: {report.untested}",
        "choose checks that run here (e.g. --mode ddp on CPU stand-ins), or GPUs with a peer-to-peer "
        f"path; what was measured is in {where}",
    )


# --- the run ------------------------------------------------------------------------------------------------


def run(options: Options, hooks: Hooks) -> Report:
    """Plan the probe and (unless ``--dry-run``) run and judge it; ``Interrupted`` (a stop signal)
    propagates, with the checks judged before it written to a report first."""
    from gputopo.launch.command import warn_nccl_env
    from gputopo.probe.plan.schedule import make_plan
    from gputopo.report import ensure_report_dir

    warn_nccl_env(hooks.warn)  # the ranks inherit these settings, and so do the measurements
    config = configure(options, hooks.warn)
    if options.dry_run:
        from gputopo.probe.plan.dryrun import plan_document

        return PlanReport(plan_document(config, make_plan(config)))
    ensure_report_dir(config.report_dir)
    if options.node is not None:
        return _across_nodes(config, options.node, hooks)
    return _on_this_machine(config, hooks)


def configure(options: Options, warn: Callable[[str], None]) -> ProbeConfig:
    """The run's ``ProbeConfig``: the options checked against the devices that exist (exit 2 or 3 when
    they cannot be probed); on live GPUs the drain-P2P GPUs kept out of the set the probe picks."""
    from gputopo.probe.plan.config import build_config, check_sets_in_topology
    from gputopo.probe.pool.devices import detect_devices, require_torch

    if not options.dry_run:
        require_torch()
    # --dry-run reads the GPUs from NVML only: torch and CUDA are never started.
    inventory = detect_devices(
        options.device.value if options.device else None,
        need_cuda=not options.dry_run,
        nvml_timeout_s=options.nvml_timeout_s,
    )
    sets = options.gpus
    if inventory.device == "cuda" and options.topology_input is None:
        sets, inventory = _keep_p2p_off(inventory, sets, _live_health(inventory, options), warn)
    tolerance = options.tolerance_pct
    config = build_config(
        inventory,
        sets,
        each_pair=options.each_pair,
        mode=options.mode,
        model=options.model.value,
        batch_size=options.batch_size,
        steps=options.steps,
        lr=options.lr,
        seed=options.seed,
        timeout_s=options.timeout_s,
        inject=options.inject,
        inject_rank=options.inject_rank,
        report_dir=options.report_dir,
        topology_input=options.topology_input,
        min_bytes=options.min_bytes,
        max_bytes=options.max_bytes,
        step_factor=options.step_factor,
        iters=options.iters,
        inject_gpus=options.inject_gpus,
        precisions=[p.value for p in options.precisions],
        tolerance=None if tolerance is None else tolerance / 100,
        across_nodes=options.node is not None,
    )
    if options.topology_input is not None:
        from gputopo.system.machine import load_topology

        topo = load_topology(options.topology_input)
        check_sets_in_topology(config.sets, topo.gpu_indices, topo.source)
    return config


def _live_health(inventory: DeviceInventory, options: Options) -> Judgement:
    """One health sample of the GPUs that may be probed (the machine step the drain rule reads)."""
    from gputopo.system.machine import read_live_health

    return read_live_health(options.nvml_timeout_s, gpus=list(inventory.gpus))


def p2p_left_out(
    health: Judgement, gpus: tuple[int, ...], sets: GpuSets | None, warn: Callable[[str], None]
) -> dict[int, str]:
    """The drain rule, for the probe: GPU -> why it is left out of the set the probe picks itself (every
    GPU it may use, two or more), for the GPUs whose driver asks to drain P2P (NVML recovery action
    DRAIN_P2P, in ``health``), each said through ``warn``. Sets the user names (``sets``), or a machine
    with nothing else to probe, are kept: nothing is left out, and each drained GPU in a multi-GPU set is
    warned about."""
    from gputopo.services.machine import drained as drain_rule

    drained = drain_rule(health.findings)
    rest = [g for g in gpus if g not in drained]
    if sets is not None or not rest:  # the user's sets (or nothing else to probe): kept, warned about
        named = {g for s in (sets if sets is not None else (gpus,)) if len(s) > 1 for g in s}
        for g in sorted(set(drained) & named):
            warn(f"GPU{g}: the driver asks to keep P2P work off it ({drained[g]}); probed in a set as asked")
        return {}
    if len(gpus) < 2 or not drained:
        return {}
    why = {g: f"the driver asks to keep P2P work off it, so no multi-GPU set: {drained[g]}" for g in drained}
    for g in sorted(why):
        warn(f"GPU{g} left out: {why[g]}")
    return why


def _keep_p2p_off(
    inventory: DeviceInventory, sets: GpuSets | None, health: Judgement, warn: Callable[[str], None]
) -> tuple[GpuSets | None, DeviceInventory]:
    """The sets to probe and the inventory, with ``p2p_left_out``'s GPUs out of the probe's own set and
    in the inventory's ``why_not`` (the dry run's ``left_out``)."""
    left_out = p2p_left_out(health, inventory.gpus, sets, warn)
    if not left_out:
        return sets, inventory
    rest = tuple(g for g in inventory.gpus if g not in left_out)
    return (rest,), replace(inventory, why_not={**inventory.why_not, **left_out})


def _on_this_machine(config: ProbeConfig, hooks: Hooks) -> ProbeReport:
    """Run the plan on this machine and judge it; a stop signal leaves what was judged in a report."""
    from gputopo.probe.judge.verdict import nothing_tested
    from gputopo.probe.plan.schedule import make_plan
    from gputopo.probe.pool.runner import run_probe

    plan = make_plan(config)
    try:
        if hooks.progress is None:
            done = run_probe(config, plan=plan, on_warning=hooks.warn)
        else:
            with hooks.progress(plan) as shown:
                done = run_probe(config, shown.update, plan=plan, on_warning=hooks.warn)
    except Interrupted as exc:
        _keep_partial(exc, config.report_dir)
        raise
    for message in dict.fromkeys(done.warnings):
        hooks.warn(message)
    causes = _path_causes(done)
    for line in causes or ():
        hooks.warn(line)
    return ProbeReport(done, config.report_dir, causes, nothing_tested(done.sets))


def _keep_partial(exc: Interrupted, report_dir: Path) -> None:
    """What was judged before the stop signal, marked interrupted, in a report the CLI's line names."""
    from gputopo.probe.report.document import to_document, to_markdown
    from gputopo.report import write_report

    if exc.partial is None:
        return
    doc = {**to_document(exc.partial), "verdict": "interrupted", "interrupted": exc.name}
    paths = write_report("probe", doc, to_markdown(doc), report_dir)
    exc.note = f"the checks done so far are in {paths['json']}"


def _path_causes(done: ProbeRun) -> tuple[str, ...] | None:
    """On live GPUs, when a check found wrong data: the ACS-redirecting bridges on the pairs' paths."""
    from gputopo.probe.report.document import to_document

    doc = to_document(done)
    if doc.get("device") != "cuda" or not wrong_data(doc):
        return None
    return tuple(path_causes(doc, live_redirected()))


_WRONG_DATA = ("corrupt", "nan", "diverged")


def wrong_data(doc: Document) -> bool:
    """Whether a check of the probe found wrong data (corrupt, NaN, diverged) on a set."""
    return any(
        c.get("verdict") == "fail" and c.get("kind") in _WRONG_DATA
        for s in doc.get("sets") or []
        for c in s.get("checks") or []
    )


def live_redirected() -> tuple[RedirectedPair, ...]:
    """This machine's GPU pairs behind an ACS-redirecting bridge (sysfs; docs/topo.md)."""
    from gputopo.services.machine import redirected_pairs
    from gputopo.system.machine import load_topology

    return redirected_pairs(load_topology(None))


def path_causes(doc: Document, redirected: tuple[RedirectedPair, ...]) -> list[str]:
    """One line per failed wrong-data check on a set with a pair behind an ACS-redirecting bridge: the
    bridge is the likely cause."""
    from gputopo.probe.judge.findings import probe_findings

    return [
        f"{f.where}: {f.what}" for f in probe_findings(doc, redirected) if "the likely cause: ACS" in f.what
    ]


def _across_nodes(config: ProbeConfig, node: NodeOptions, hooks: Hooks) -> NodesReport:
    """This node's part of a multi-node probe; node rank 0 writes the report."""
    from gputopo.probe.pool.multinode import run_nodes

    hooks.before_nodes(node)
    doc = run_nodes(config, node, on_row=hooks.on_row)
    return NodesReport(doc, config.report_dir if node.node_rank == 0 else None)
