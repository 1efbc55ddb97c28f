"""``gputopo recommend``'s service: the best K-GPU sets for ``CUDA_VISIBLE_DEVICES``, with estimates and
reasons, and with ``--launch`` the torchrun line for the best one.

``Choice`` holds what ``recommend`` and ``run`` both choose a set by (their shared options, checked once);
``choose`` reads the machine through the one machine step (``services.machine``: topology, one health
sample, the drain rule, the preset ``CUDA_VISIBLE_DEVICES``, the PCIe paths) and runs the pure search
(``gputopo.recommend``). ``run`` is ``choose`` plus the launch line and the report; ``services.run``
calls ``choose`` too, so both commands pick a set the same way.

Nothing here imports typer, rich or the views: warnings go to ``Hooks.warn``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputopo.errors import UsageError
from gputopo.services.hooks import Warn

if TYPE_CHECKING:
    from gputopo.launch.line import LaunchPlan
    from gputopo.model import Topology
    from gputopo.recommend import Constraints, ProbeEvidence, Recommendation
    from gputopo.services.machine import Machine
    from gputopo.topology.bandwidth import Assumptions

# The defaults the CLI shows; equal to gputopo.recommend's (a test keeps them so), spelled here so that
# `--help` need not import the search.
DEFAULT_MAX_USED_MIB = 1024
DEFAULT_TOP = 5
ID_FORMATS = ("index", "uuid")
REPORT_HINT = "give the .json report `gputopo probe` or `doctor` wrote under reports/"


# What the service tells its caller while it runs: ``warn`` (a line for stderr).
Hooks = Warn


@dataclass(frozen=True, kw_only=True)
class Choice:
    """What ``recommend`` and ``run`` choose a set by, from their shared options, checked once when built
    (``UsageError``, exit 2, before the machine is read): ``input`` (``None``: this machine), ``exclude``
    (a GPU list, parsed once into ``excluded``), the busy rule, the health rule, ``from_report`` (a probe
    or doctor report whose failing pairs are kept apart) and ``force_report`` (use it even when it was
    written on another machine)."""

    input: str | None = None
    exclude: str | None = None
    allow_busy: bool = False
    allow_unhealthy: bool = False
    max_used_mib: int = DEFAULT_MAX_USED_MIB
    from_report: Path | None = None
    force_report: bool = False
    excluded: tuple[int, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if self.max_used_mib < 0:
            raise UsageError(
                f"--max-used-mib {self.max_used_mib}: must be 0 or more", "e.g. --max-used-mib 1024"
            )
        if self.exclude:
            from gputopo.gpulist import parse_gpu_list

            object.__setattr__(self, "excluded", tuple(parse_gpu_list(self.exclude, "--exclude")))


@dataclass(frozen=True, kw_only=True)
class Options:
    """What ``gputopo recommend`` was asked, keyword only, validated when built."""

    n: int
    choice: Choice = field(default_factory=Choice)
    sets: int | None = None
    top: int = DEFAULT_TOP
    nvlink_gbps: float | None = None
    pcie_gen: int | None = None
    socket_gbps: float | None = None
    id_format: str = "index"
    launch: str | None = None  # CMD: also the torchrun line that runs it on the best set
    nnodes: int | None = None
    nvml_timeout_s: float | None = None
    ignore_visible: bool = False

    def __post_init__(self) -> None:
        if self.id_format not in ID_FORMATS:
            raise UsageError(f"--format {self.id_format}: not a format", "index or uuid")
        if self.nnodes is not None and self.launch is None:
            raise UsageError(
                "--nnodes goes with --launch", 'add --launch "CMD ...", e.g. --launch "train.py"'
            )

    def assumptions(self) -> Assumptions:
        from gputopo.topology.bandwidth import Assumptions

        return Assumptions(
            nvlink_gbps_per_link=self.nvlink_gbps, pcie_gen=self.pcie_gen, socket_gbps=self.socket_gbps
        )


@dataclass(frozen=True)
class Chosen:
    """What ``choose`` found: the machine as read, and the ranked sets."""

    machine: Machine
    recommendation: Recommendation

    def health_section(self, allowed: bool) -> dict[str, Any]:
        """The JSON's ``health``: how it was read, what it found, and whether sick GPUs were let in
        (``allowed``, only where health was read)."""
        section = self.machine.health.section()
        return {**section, "allowed": allowed} if self.machine.health.judgement is not None else section


@dataclass(frozen=True)
class RecommendReport:
    """What ``run`` found; ``document()`` is the whole ``gputopo/recommendation/v1`` JSON."""

    recommendation: Recommendation
    health: dict[str, Any]
    id_format: str = "index"
    plan: LaunchPlan | None = None

    exit_code: int = 0

    def with_files(self, paths: dict[str, str]) -> RecommendReport:
        return self  # recommend writes no report files

    def document(self) -> dict[str, Any]:
        """The document (docs/recommend.md), built here and nowhere else: the sets, then ``health``, then
        ``launch`` with ``--launch``."""
        from gputopo.recommend import to_dict

        launch = {"launch": self.plan.to_dict()} if self.plan is not None else {}
        return {**to_dict(self.recommendation, self.id_format), "health": self.health, **launch}


def run(options: Options, hooks: Hooks | None = None) -> RecommendReport:
    """Choose the sets and, with ``--launch``, the line for the best one; warnings through ``hooks``."""
    hooks = hooks or Hooks()
    chosen = choose(
        options.choice,
        constraints_of(options),
        hooks,
        nvml_timeout_s=options.nvml_timeout_s,
        ignore_visible=options.ignore_visible,
    )
    report = RecommendReport(
        chosen.recommendation, chosen.health_section(options.choice.allow_unhealthy), options.id_format
    )
    report.document()  # every env is built first: a --format uuid error comes before any other output
    if options.launch is not None:
        from gputopo.launch.command import launch_plan_for

        best = chosen.recommendation.best.gpus
        uuid = options.id_format == "uuid"
        plan = launch_plan_for(
            chosen.machine.topology, best, options.launch, options.nnodes or 1, uuid, hooks.warn
        )
        report = replace(report, plan=plan)
    for line in dict.fromkeys(chosen.recommendation.warnings):  # the topology's warnings too, once each
        hooks.warn(line)
    return report


def constraints_of(options: Options) -> Constraints:
    """recommend's options as the search's ``Constraints`` (the machine's part is added by ``choose``)."""
    from gputopo.recommend import Constraints

    return Constraints(n=options.n, sets=options.sets, top=options.top, assumptions=options.assumptions())


def choose(
    choice: Choice,
    constraints: Constraints,
    hooks: Hooks,
    *,
    nvml_timeout_s: float | None = None,
    ignore_visible: bool = False,
    pcie_paths: bool = True,
) -> Chosen:
    """The ranked sets for ``constraints`` (its size and shape) under ``choice``: the report read, the
    machine read once (``services.machine``), the GPUs it rules out (``--exclude``, busy, sick, drained of
    P2P, outside a preset ``CUDA_VISIBLE_DEVICES``) left out, every ACS-redirected pair ranked after."""
    from gputopo.recommend import recommend
    from gputopo.services import machine as step

    evidence = read_evidence(choice.from_report)
    live = choice.input is None

    def check_report(topo: Topology) -> None:
        check_report_machine(evidence, topo, live, choice.force_report, hooks.warn)

    got = step.read(
        step.MachineOptions(
            input=choice.input,
            nvml_timeout_s=nvml_timeout_s,
            preset=not ignore_visible,
            pcie_paths=pcie_paths,
        ),
        step.Hooks(warn=hooks.warn, on_topology=check_report),
    )
    constraints = replace(
        constraints,
        exclude=choice.excluded,
        allow_busy=choice.allow_busy,
        max_used_mib=choice.max_used_mib,
        evidence=evidence,
        allow_unhealthy=choice.allow_unhealthy,
        **_machine_constraints(got),
    )
    return Chosen(got, recommend(got.topology, constraints))


def _machine_constraints(got: Machine) -> dict[str, Any]:
    """What the machine step adds to the constraints: sick and drained GPUs, the preset, the pairs."""
    preset: dict[str, Any] = {}
    if got.preset is not None:
        preset = {"allowed": got.preset.allowed, "outside_allowed": got.preset.outside}
    unhealthy, no_p2p = got.health.unhealthy, got.health.no_p2p
    return {"unhealthy": unhealthy, "no_p2p": no_p2p, "redirected": got.redirected, **preset}


def read_evidence(path: Path | None) -> ProbeEvidence | None:
    """``--from-report``: the probe or doctor report read into groups kept apart and measured bandwidths
    (``InputError``, exit 2, for a file that is not one)."""
    if path is None:
        return None
    from gputopo.inputs import read_json_file
    from gputopo.recommend import evidence_from_report

    return evidence_from_report(read_json_file(path, f"--from-report {path}", REPORT_HINT), str(path))


def check_report_machine(
    evidence: ProbeEvidence | None, topo: Topology, live: bool, force: bool, warn: Callable[[str], None]
) -> None:
    """Refuse ``--from-report`` written on another machine (or on CPU stand-ins, for a live one): its
    GPU numbers would point at other GPUs here. ``--force-report`` turns the refusal into a warning."""
    from gputopo.topology.identity import report_mismatch

    if evidence is None:
        return
    why = report_mismatch(evidence.machine, evidence.device, topo, live)
    if why is None:
        return
    if force:
        warn(f"--from-report {evidence.source}: {why}; used anyway (--force-report)")
        return
    raise UsageError(
        f"--from-report {evidence.source}: not this machine's report: {why}",
        "probe this machine (gputopo doctor, or gputopo probe), or add --force-report to use it anyway",
    )
