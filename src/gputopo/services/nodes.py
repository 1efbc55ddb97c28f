"""``gputopo nodes``'s service: many nodes' facts (read from files or gathered over Slurm) -> NVLink
domains, fit trays, whole segments, a ``--nodelist``, Slurm's block topology, and an audit of Slurm's
own view of the racks (a topology file, ``scontrol show topology``, ``scontrol show job``).

The planning and the audit are pure (``topology.domains``, ``launch.slurm_blocks``); the machine is
reached through ``system/`` (``slurm_gather``, ``scontrol``). The CLI builds ``Options`` (validated
once, here), calls ``run`` and shows the ``NodesReport``; ``document()`` is the whole
``gputopo/nodes/v1`` JSON (docs/nodes.md).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputopo.errors import CheckFailed, InputError, UsageError
from gputopo.findings import PROBLEM, Finding
from gputopo.inputs import loads_bounded, read_capped
from gputopo.launch import slurm_blocks
from gputopo.topology import domains as dom
from gputopo.topology.domains import FACTS_HINT, NodeFacts, compress_hostlist, facts_from_doc

SCHEMA = "gputopo/nodes/v1"

# The most facts files one folder may hold (a 288-rack NVL72 site has 5,184 trays).
MAX_FACTS_FILES = 100_000
# How long gathering over Slurm may take by default, and the share of it scontrol may use.
DEFAULT_BUDGET_S = 60.0
SCONTROL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Gathered:
    """The nodes' facts, the nodes asked that did not answer (``unanswered``: node -> why) and warnings."""

    facts: list[NodeFacts]
    unanswered: dict[str, str]
    warnings: list[str]


def read_facts(paths: list[Path]) -> list[NodeFacts]:
    """Facts from files, or from every ``*.json`` in a folder named (not its sub-folders)."""
    files: list[tuple[Path, str]] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix == ".json" and p.is_file())
            if not found:
                raise InputError(f"{path}: a folder with no .json facts files in it", FACTS_HINT)
            files.extend((p, str(p)) for p in found)
        else:
            files.append((path, str(path)))
        if len(files) > MAX_FACTS_FILES:
            raise InputError(f"more than {MAX_FACTS_FILES} facts files", "give fewer files or folders")
    if not files:
        raise UsageError(
            "no facts to read", "give facts files or a folder of them, or --slurm to gather them"
        )
    return [_read_one(path, label) for path, label in files]


def _read_one(path: Path, label: str) -> NodeFacts:
    raw = read_capped(path, label, hint=FACTS_HINT)
    try:
        doc = loads_bounded(raw.decode("utf-8-sig"), label)
    except UnicodeDecodeError:
        raise InputError(f"{label}: binary data, not facts", FACTS_HINT) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{label}: not JSON (line {exc.lineno}: {exc.msg})", FACTS_HINT) from None
    return facts_from_doc(doc, label)


def slurm_nodes(nodelist: str | None) -> list[str]:
    """The nodes to gather from: ``--nodelist``, else the allocation's (``SLURM_JOB_NODELIST``)."""
    from gputopo.launch.slurm import expand_hostlist
    from gputopo.system.scontrol import hostnames

    text = nodelist or os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not text:
        raise UsageError(
            "--slurm: no allocation (SLURM_JOB_NODELIST is not set) and no --nodelist",
            "run inside salloc/sbatch, or name the nodes: --nodelist gpu-[01-18]",
        )
    return hostnames(text, SCONTROL_TIMEOUT_S) or expand_hostlist(text)


def gather_slurm(nodes: list[str], budget_s: float) -> Gathered:
    """``gputopo topo --json`` once on each node with ``srun``, within ``budget_s``; nodes that did not
    answer (or answered with something that is not facts) are named with why."""
    from gputopo.system.slurm_gather import run_on_nodes

    argv = [sys.executable, "-m", "gputopo", "topo", "--json"]
    outputs, error = run_on_nodes(compress_hostlist(nodes), len(nodes), argv, budget_s)
    facts: list[NodeFacts] = []
    warnings: list[str] = []
    for task, text in sorted(outputs.items()):
        try:
            facts.append(facts_from_doc(loads_bounded(text, f"srun task {task}"), f"srun task {task}"))
        except (InputError, json.JSONDecodeError) as exc:
            what = exc.message if isinstance(exc, InputError) else f"not JSON ({exc.msg})"
            warnings.append(f"srun task {task}: {what}")
    answered = {f.node for f in facts}
    why = error or "no facts came back"
    unanswered = {n: why for n in nodes if n not in answered}
    strangers = sorted(answered - set(nodes))
    if strangers:
        warnings.append(f"facts from nodes not asked for: {', '.join(strangers)} (SLURMD_NODENAME differs?)")
    return Gathered(facts, unanswered, warnings)


def read_slurm_view(audit: str, budget_end: float) -> tuple[str, str]:
    """Slurm's block topology as text and where it came from: ``--audit FILE``, or ``--audit scontrol``
    (``scontrol show topology`` now)."""
    if audit == "scontrol":
        from gputopo.system.scontrol import show

        text = show(["show", "topology"], _left(budget_end))
        if text is None:
            raise InputError(
                "--audit scontrol: `scontrol show topology` failed or is not here",
                "give the topology.conf file instead: --audit /etc/slurm/topology.conf",
            )
        return text, "scontrol show topology"
    label = f"--audit {audit}"
    raw = read_capped(
        Path(audit), label, hint="give a topology.conf or saved `scontrol show topology` output"
    )
    return raw.decode("utf-8", errors="replace"), audit


def read_job(job_id: str, budget_end: float) -> str:
    """``scontrol show job ID``'s text."""
    from gputopo.system.scontrol import show

    if not job_id.strip().replace("_", "").isdigit():
        raise UsageError(
            f"--job {job_id!r} is not a Slurm job id", "give the number squeue shows, e.g. --job 4242"
        )
    text = show(["show", "job", job_id.strip()], _left(budget_end))
    if text is None:
        raise InputError(
            f"--job {job_id}: `scontrol show job {job_id}` failed or is not here",
            "check the job id with squeue; the audit needs scontrol on PATH",
        )
    return text


def _left(budget_end: float) -> float:
    return max(0.5, min(SCONTROL_TIMEOUT_S, budget_end - time.monotonic()))


# --- the command: options in, a report out -------------------------------------------------------------

MISSING_HINT = "fewer or smaller segments, or bring unfit trays back (their why is listed)"
# Slurm stops on a block topology without blocks ("No blocks configured", block_record.c).
NO_BLOCK_WARNING = "no node is in an NVLink domain: the block topology has no block, Slurm would refuse it"


def _ignore(_: str) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """What the service tells its caller while it runs: ``warn``, a line for stderr."""

    warn: Callable[[str], None] = _ignore


@dataclass(frozen=True, kw_only=True)
class Options:
    """What ``gputopo nodes`` was asked, keyword only, validated when built (``UsageError``, exit 2)."""

    facts: tuple[Path, ...] = ()  # facts files or folders of them (none: ``slurm``)
    slurm: bool = False  # gather the facts with srun
    nodelist: str | None = None  # with ``slurm``: these nodes instead of the allocation's
    budget_s: float = DEFAULT_BUDGET_S
    segment: int | None = None
    nodes: int | None = None
    slurm_topology: bool = False
    audit: str | None = None  # a file, or "scontrol"
    job: str | None = None

    def __post_init__(self) -> None:
        if self.slurm and self.facts:
            raise UsageError(
                "give facts files or --slurm, not both", "gputopo nodes facts/  or  gputopo nodes --slurm"
            )
        if not self.slurm and not self.facts:
            raise UsageError(
                "no facts given", "gputopo nodes FACTS... (files or folders), or --slurm to gather them"
            )
        if self.nodelist is not None and not self.slurm:
            raise UsageError("--nodelist gathers over Slurm", "add --slurm, or give facts files")
        if not self.budget_s > 0 or math.isnan(self.budget_s):
            raise UsageError(
                f"--budget {self.budget_s} is not a positive number of seconds", "e.g. --budget 60"
            )
        for name, v in (("--segment", self.segment), ("--nodes", self.nodes)):
            if v is not None and v < 1:
                raise UsageError(f"{name} {v} is not a positive number of nodes", f"e.g. {name} 8")
        nodes, segment = self.nodes, self.segment
        if nodes is not None and segment is not None and nodes % segment:
            raise UsageError(
                f"--nodes {nodes} is not whole segments of --segment {segment}",
                f"--nodes {nodes - nodes % segment or segment} or {nodes + segment - nodes % segment}",
            )

    @property
    def size(self) -> int | None:
        """The segment size: ``--segment``, else ``--nodes`` (one segment), else none."""
        return self.segment or self.nodes


@dataclass(frozen=True)
class NodesReport:
    """What ``run`` found: the plan over the nodes' facts, who did not answer, the pick (``--nodes``) or
    what it misses, the audit's findings (``None``: no audit asked) and the block topology (``None``:
    not asked)."""

    plan: dom.Plan
    facts: tuple[NodeFacts, ...]
    segment: int | None  # the segment size the domains are cut in
    unanswered: dict[str, str] = field(default_factory=dict)
    asked_nodes: bool = False
    picked: dom.Pick | None = None
    missing: str | None = None
    findings: tuple[Finding, ...] | None = None
    block_topology: str | None = None

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings or () if f.severity == PROBLEM]

    @property
    def failure(self) -> CheckFailed | None:
        """Why the command fails (exit 1): ``--nodes`` not met, or Slurm's view disagrees; else ``None``."""
        if self.missing is not None:
            return CheckFailed(self.missing, MISSING_HINT)
        problems = self.problems
        if problems:
            return CheckFailed(
                f"Slurm's view disagrees with the NVLink domains: {len(problems)} problem(s)",
                problems[0].remedy,
            )
        return None

    @property
    def exit_code(self) -> int:
        return 0 if self.failure is None else 1

    def document(self) -> dict[str, Any]:
        """The ``gputopo/nodes/v1`` document (docs/nodes.md), built here and nowhere else."""
        pick: dict[str, Any] = {}
        if self.picked is not None:
            pick = {
                "nodelist": f"--nodelist={self.picked.nodelist}",
                "picked": [{"domain": d, "nodes": list(s)} for d, s in self.picked.segments],
            }
        elif self.asked_nodes:
            pick = {"nodelist": None, "missing": self.missing}
        audit = {} if self.findings is None else {"findings": [f.to_json() for f in self.findings]}
        blocks = {} if self.block_topology is None else {"block_topology": self.block_topology}
        return {
            "schema": SCHEMA,
            **dom.to_json(self.plan, self.segment),
            "unanswered": [{"node": n, "why": w} for n, w in self.unanswered.items()],
            # each node's stored `gputopo accept` verdict, and whether it still holds (null: none kept)
            "accept": {f.node: f.accept for f in self.facts},
            **pick,
            **audit,
            **blocks,
        }


def run(options: Options, hooks: Hooks | None = None) -> NodesReport:
    """Read (or gather) the facts, plan the domains, pick, audit and write the block topology as asked."""
    hooks = hooks or Hooks()
    end = time.monotonic() + options.budget_s
    facts, unanswered = _facts(options, hooks)
    plan = dom.plan(facts)
    picked = missing = None
    if options.nodes is not None:
        try:
            picked = dom.pick(plan, options.nodes, options.size or options.nodes)
        except dom.NotMet as exc:
            missing = str(exc)
    findings = None
    if options.audit is not None or options.job is not None:
        findings = tuple(_audit(plan, options, end))
    blocks = None
    if options.slurm_topology:
        blocks = dom.block_topology(plan)
        if not plan.domains:
            hooks.warn(NO_BLOCK_WARNING)
    return NodesReport(
        plan=plan,
        facts=tuple(facts),
        segment=options.size,
        unanswered=unanswered,
        asked_nodes=options.nodes is not None,
        picked=picked,
        missing=missing,
        findings=findings,
        block_topology=blocks,
    )


def _facts(options: Options, hooks: Hooks) -> tuple[list[NodeFacts], dict[str, str]]:
    """The nodes' facts, and the nodes asked over Slurm that did not answer (node -> why)."""
    if not options.slurm:
        return read_facts(list(options.facts)), {}
    gathered = gather_slurm(slurm_nodes(options.nodelist), options.budget_s)
    for warning in dict.fromkeys(gathered.warnings):
        hooks.warn(warning)
    if not gathered.facts:
        first = next(iter(gathered.unanswered.values()), "no facts came back")
        raise CheckFailed(
            f"--slurm: no node answered ({len(gathered.unanswered)} asked: {first})",
            "try `srun -N1 python -m gputopo topo --json` by hand; a larger --budget for slow starts",
        )
    return gathered.facts, gathered.unanswered


def _audit(plan: dom.Plan, options: Options, end: float) -> list[Finding]:
    """``--audit``: Slurm's block topology against the domains; ``--job``: a running job's placement."""
    findings: list[Finding] = []
    blocks = None
    if options.audit is not None:
        text, where = read_slurm_view(options.audit, end)
        blocks, _sizes = slurm_blocks.parse_blocks(text, where)
        findings += slurm_blocks.audit_blocks(plan, blocks)
    if options.job is not None:
        view = slurm_blocks.parse_show_job(read_job(options.job, end), options.job)
        findings += slurm_blocks.audit_job(plan, blocks, view, options.segment)
    return findings
