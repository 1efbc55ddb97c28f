"""What Slurm believes about the racks (pure): its block topology, read from ``topology.conf`` or from
``scontrol show topology``, audited against the NVLink domains the nodes' own facts show
(``gputopo nodes --audit``).

The two texts, as Slurm writes and reads them (SchedMD/slurm):
- ``topology.conf`` for ``topology/block`` (topology.conf(5); src/plugins/topology/block/block_record.c,
  ``_read_topo_file``): ``BlockName=NAME Nodes=HOSTLIST`` per base block and one ``BlockSizes=N,...``;
  parameter names are case insensitive, ``#`` starts a comment to the end of the line.
- ``scontrol show topology`` with that plugin (topology_block.c, ``_print_topo_record``): one line per
  block, ``BlockName=NAME BlockIndex=I Nodes=HOSTLIST BlockSize=N``, then the aggregated blocks Slurm
  builds from them as ``AggregatedBlock=NAMES BlockIndex=I Nodes=HOSTLIST BlockSize=N``. An aggregated
  block spans base blocks by design, so only the base blocks are audited.

The job audit: a job submitted with ``--segment=S`` should hold whole segments inside blocks. SchedMD/slurm
#225 shows Slurm silently ignoring the segment after a node's topology was reapplied with ``scontrol
update``: a 36-node job with ``--segment=12`` on three 17-node blocks got 17+17+2, while ``scontrol show
topology`` still showed the right blocks. Counting the job's nodes per block (and per domain) catches it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gputopo.errors import InputError, UsageError
from gputopo.findings import NOTE, PROBLEM, Finding
from gputopo.launch.slurm import expand_hostlist
from gputopo.topology.domains import Plan, compress_hostlist

_PAIR = re.compile(r"(\S+?)=(\S*)")
AUDIT_HINT = "give a topology.conf for topology/block, or what `scontrol show topology` prints"
BLOCKS_REMEDY = (
    "one block per NVLink domain, with all its members: `gputopo nodes --slurm-topology` prints it"
)


@dataclass(frozen=True)
class Block:
    """One base block: its ``name`` and its ``nodes`` (expanded)."""

    name: str
    nodes: tuple[str, ...]


def parse_blocks(text: str, source: str) -> tuple[list[Block], list[int]]:
    """The base blocks and ``BlockSizes`` in a ``topology.conf`` or ``scontrol show topology`` text;
    ``InputError`` (exit 2) for a line that is neither, a tree topology, or a text without blocks."""
    blocks: list[Block] = []
    sizes: list[int] = []
    names: set[str] = set()
    for line_no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        pairs = [(k.lower(), v) for k, v in _PAIR.findall(line)]
        if not pairs:
            raise InputError(
                f"{source}, line {line_no}: not Key=Value pairs: {raw.strip()[:80]!r}", AUDIT_HINT
            )
        key, value = pairs[0]
        fields = dict(pairs)
        if key == "aggregatedblock":
            continue
        if key == "switchname":
            raise InputError(
                f"{source}, line {line_no}: a topology/tree switch; the audit reads block topology",
                AUDIT_HINT,
            )
        if key == "blocksizes":
            try:
                sizes = [int(s) for s in value.split(",") if s]
            except ValueError:
                raise InputError(
                    f"{source}, line {line_no}: BlockSizes={value} is not numbers", AUDIT_HINT
                ) from None
            continue
        if key != "blockname":
            raise InputError(f"{source}, line {line_no}: unknown line {raw.strip()[:80]!r}", AUDIT_HINT)
        if not value or not fields.get("nodes"):
            raise InputError(f"{source}, line {line_no}: block {value or '?'} has no Nodes=", AUDIT_HINT)
        if value in names:
            raise InputError(f"{source}, line {line_no}: block {value} is defined twice", AUDIT_HINT)
        names.add(value)
        try:
            nodes = tuple(expand_hostlist(fields["nodes"]))
        except UsageError as exc:
            raise InputError(f"{source}, line {line_no}: {exc.message}", AUDIT_HINT) from None
        blocks.append(Block(value, nodes))
    if not blocks:
        raise InputError(f"{source}: no BlockName= lines", AUDIT_HINT)
    return blocks, sizes


def audit_blocks(p: Plan, blocks: Sequence[Block]) -> list[Finding]:
    """A block that mixes domains, a domain split across blocks, members Slurm puts in no block."""
    domain_of = p.domain_of()
    findings = []
    block_of: dict[str, list[str]] = {}
    for b in blocks:
        for n in b.nodes:
            block_of.setdefault(n, []).append(b.name)
        per = Counter(domain_of[n] for n in b.nodes if n in domain_of)
        if len(per) > 1:
            parts = "; ".join(
                f"{c} of {_label(p, d)} ({compress_hostlist([n for n in b.nodes if domain_of.get(n) == d])})"
                for d, c in sorted(per.items())
            )
            what = (
                f"block {b.name} mixes {len(per)} NVLink domains: {parts}; a segment placed in it "
                "can cross the network between racks"
            )
            findings.append(_blocks_finding(f"Slurm block {b.name}", what, PROBLEM))
    for d in p.domains:
        where = f"NVLink domain {_label(p, d.id)}"
        held = Counter(b for n in d.nodes for b in block_of.get(n, ()))
        if len(held) > 1:
            split = " + ".join(f"{c} in {b}" for b, c in sorted(held.items()))
            what = (
                f"the domain's {len(d.nodes)} nodes are split across {len(held)} Slurm blocks "
                f"({split}): Slurm cannot keep a segment inside the domain"
            )
            findings.append(_blocks_finding(where, what, PROBLEM))
        outside = [n for n in d.nodes if n not in block_of]
        if outside:
            what = f"{len(outside)} of the domain's nodes are in no Slurm block: {compress_hostlist(outside)}"
            findings.append(_blocks_finding(where, what, NOTE))
    return findings


def _blocks_finding(where: str, what: str, severity: str) -> Finding:
    """A finding of the block audit: Slurm's blocks against the NVLink domains (its one remedy)."""
    return Finding(
        where=where,
        what=what,
        remedy=BLOCKS_REMEDY,
        severity=severity,
        category="topology",
        action="config",
    )


@dataclass(frozen=True)
class JobView:
    """A job as ``scontrol show job ID`` shows it: ``state``, its ``nodes`` and its ``segment`` size
    where that output names one (else the user's ``--segment``)."""

    job_id: str
    state: str | None
    nodes: tuple[str, ...]
    segment: int | None


def parse_show_job(text: str, job_id: str) -> JobView:
    """``JobState=`` and ``NodeList=`` (and ``Segment=`` where the installed Slurm prints it) of the
    job in ``scontrol show job ID``'s output; ``InputError`` when the job has no nodes."""
    fields = {k: v for k, v in _PAIR.findall(text)}
    nodelist = fields.get("NodeList")
    if not nodelist or nodelist in ("(null)", "None"):
        raise InputError(
            f"job {job_id}: Slurm shows no nodes for it (JobState={fields.get('JobState', '?')})",
            "give the id of a running job (`squeue -t R`)",
        )
    try:
        nodes = tuple(expand_hostlist(nodelist))
    except UsageError as exc:
        raise InputError(f"job {job_id}: {exc.message}", "check `scontrol show job ID`") from None
    seg = fields.get("Segment")
    return JobView(job_id, fields.get("JobState"), nodes, int(seg) if seg and seg.isdigit() else None)


def audit_job(p: Plan, blocks: Sequence[Block] | None, job: JobView, segment: int | None) -> list[Finding]:
    """A running job whose segments span blocks or domains: its nodes counted per block and per domain
    (17+17+2 with ``--segment=12``, SchedMD/slurm #225). Without a segment size, a job across domains is a
    note."""
    size = segment or job.segment
    findings = []
    views: list[tuple[str, Mapping[str, str]]] = [("NVLink domains", {**p.domain_of()})]
    if blocks is not None:
        views.append(("Slurm blocks", {n: b.name for b in blocks for n in b.nodes}))
    for kind, group_of in views:
        per = Counter(group_of.get(n, "(none)") for n in job.nodes)
        if len(per) < 2:
            continue
        counts = [per[g] for g in sorted(per, key=lambda g: (-per[g], g))]
        split = "+".join(str(c) for c in counts)
        named = ", ".join(f"{_label(p, g) if kind == 'NVLink domains' else g}: {per[g]}" for g in sorted(per))
        if size and all(c % size == 0 for c in counts) and "(none)" not in per:
            continue
        if size:
            what = (
                f"job {job.job_id} ({len(job.nodes)} nodes, segment {size}) is split {split} across {kind} "
                f"({named}): a segment spans {kind.split()[-1]}"
            )
            sev = PROBLEM
            remedy = (
                "Slurm ignored --segment, as when a node's block was reapplied with `scontrol update` "
                "(SchedMD/slurm #225): `scontrol reconfigure`, check `gputopo nodes --audit`, requeue the job"
            )
        else:
            what = f"job {job.job_id} ({len(job.nodes)} nodes) is split {split} across {kind} ({named})"
            sev = NOTE
            remedy = "submit with --segment=S (S nodes per NVLink domain) so each group stays inside one rack"
        findings.append(
            Finding(
                where=f"Slurm job {job.job_id}",
                what=what,
                remedy=remedy,
                severity=sev,
                category="topology",
                action="config",
            )
        )
    return findings


def _label(p: Plan, dom_id: str) -> str:
    for d in p.domains:
        if d.id == dom_id:
            return f"{d.id} (rack {d.chassis_serial})" if d.chassis_serial else d.id
    return dom_id
