"""Nodes across racks (pure): many nodes' facts (``gputopo topo --json``) -> NVLink domains, fit trays,
segments, a ``--nodelist`` and Slurm's block topology (``gputopo nodes``).

A node's facts say which NVLink domain it is in (``nvlink_domain.id``, ``<clusterUuid>.<cliqueId>``: never
the clique alone, GB300 racks all report 32766) and its last fresh ``gputopo check`` (``check``). A node is
*fit* when that check found no problem; a node without a fresh check counts as fit and is marked
unchecked. A *segment* of S nodes never spans two domains, and a node whose domain is unknown is never
put into one: NCCL's multi-node NVLink only joins trays of one domain, so an expert-parallel group that
spans two racks crosses the network (NVIDIA-NeMo/RL #2986).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gputopo.errors import InputError

FACTS_SCHEMA = "gputopo/topology/v1"
FACTS_HINT = "give files written by `gputopo topo --json` on each node (or a folder of them)"

_NUMBERED = re.compile(r"^(.*?)([0-9]+)$")


@dataclass(frozen=True)
class NodeFacts:
    """What one node's ``topo --json`` says that matters across nodes: its ``node`` name, its NVLink
    ``domain`` id (``None``: not in one, or the facts do not say), where it sits (``chassis_serial`` =
    the rack, ``tray_index``, ``slot``), how many ``gpus``, the last fresh ``check`` (``verdict``, ``at``,
    ``problems``) or ``None``, and the file it came from (``source``)."""

    node: str
    domain: str | None
    chassis_serial: str | None = None
    tray_index: int | None = None
    slot: int | None = None
    gpus: int = 0
    check: Mapping[str, Any] | None = None
    source: str = ""
    accept: Mapping[str, Any] | None = None  # ``gputopo accept``'s stored verdict (accept.record.status)

    @property
    def unchecked(self) -> bool:
        return self.check is None

    @property
    def why_unfit(self) -> str | None:
        """Why the node is not fit, in the last check's words; ``None`` when it is fit."""
        if self.check is None:
            return None
        verdict = self.check.get("verdict")
        problems = [p for p in self.check.get("problems") or () if isinstance(p, Mapping)]
        if verdict == "healthy" or (verdict != "unknown" and not problems and verdict != "problems"):
            return None
        if not problems:
            return f"gputopo check: {verdict}"
        first = problems[0]
        where = f"{first.get('where')}: " if first.get("where") else ""
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return f"{where}{first.get('what')}{more}"


@dataclass(frozen=True)
class Domain:
    """One NVLink domain as its members' facts show it: ``id``, the rack (``chassis_serial`` when its
    members agree on one), every member in tray order (``nodes``), the ``fit`` ones, the ``unfit`` ones
    with why, and the fit ones no fresh check vouches for (``unchecked``)."""

    id: str
    chassis_serial: str | None
    nodes: tuple[str, ...]
    fit: tuple[str, ...]
    unfit: tuple[tuple[str, str], ...]
    unchecked: tuple[str, ...]

    def segments(self, size: int) -> list[tuple[str, ...]]:
        """Whole segments of ``size`` fit nodes, in tray order (17 fit of 18 with size 8: two)."""
        whole = len(self.fit) // size
        return [self.fit[i * size : (i + 1) * size] for i in range(whole)]


@dataclass(frozen=True)
class Plan:
    """Every domain (ordered by id) and the nodes whose domain is unknown (``unknown_domain``, with
    ``unknown_unfit`` those of them a check found unfit, and why)."""

    domains: tuple[Domain, ...]
    unknown_domain: tuple[str, ...]
    unknown_unfit: tuple[tuple[str, str], ...] = ()

    def domain_of(self) -> dict[str, str]:
        """Node name -> domain id, for every node in a domain."""
        return {n: d.id for d in self.domains for n in d.nodes}


@dataclass(frozen=True)
class Pick:
    """``--nodes N --segment S``: the segments chosen (domain id, nodes), and the ``--nodelist`` line."""

    segments: tuple[tuple[str, tuple[str, ...]], ...]
    nodelist: str


class NotMet(Exception):
    """``--nodes`` cannot be met with fit segments; the message says what is missing (exit 1)."""


# --- facts in ------------------------------------------------------------------------------------------


def facts_from_doc(doc: Any, source: str) -> NodeFacts:
    """One node's facts from its ``topo --json`` document; ``InputError`` (exit 2) naming the file and
    what is wrong when it is not such a document."""
    if not isinstance(doc, dict) or doc.get("schema") != FACTS_SCHEMA:
        raise InputError(
            f"{source}: not a `gputopo topo --json` document (schema {FACTS_SCHEMA})", FACTS_HINT
        )
    node = doc.get("node")
    if not isinstance(node, str) or not node.strip():
        raise InputError(
            f"{source}: names no node (written from --input, a sample, or by a gputopo before 0.x)",
            "run `gputopo topo --json` on the node itself: it adds the node's name and last check",
        )
    gpus = doc.get("gpus")
    if not isinstance(gpus, list):
        raise InputError(f"{source}: the field 'gpus' is not a list", FACTS_HINT)
    check = doc.get("check")
    if check is not None and (not isinstance(check, dict) or not isinstance(check.get("problems", []), list)):
        raise InputError(f"{source}: 'check' is not {{verdict, at, problems}} or null", FACTS_HINT)
    dom = doc.get("nvlink_domain")
    if dom is None:
        return NodeFacts(
            node=node.strip(), domain=None, gpus=len(gpus), check=check, source=source, accept=_accept(doc)
        )
    if not isinstance(dom, dict) or not isinstance(dom.get("id"), str) or not dom["id"]:
        raise InputError(f"{source}: 'nvlink_domain' has no id (<clusterUuid>.<cliqueId>)", FACTS_HINT)
    return NodeFacts(
        node=node.strip(),
        domain=dom["id"],
        chassis_serial=_text(dom.get("chassis_serial")),
        tray_index=_int(dom.get("tray_index")),
        slot=_int(dom.get("slot")),
        gpus=len(gpus),
        check=check,
        source=source,
        accept=_accept(doc),
    )


def _accept(doc: Mapping[str, Any]) -> Mapping[str, Any] | None:
    v = doc.get("accept")
    return v if isinstance(v, dict) else None


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# --- the plan --------------------------------------------------------------------------------------------


def natural_key(name: str) -> tuple[str, int, str]:
    """Order host names as people number them: gpu-2 before gpu-10."""
    m = _NUMBERED.match(name)
    return (m.group(1), int(m.group(2)), name) if m else (name, -1, name)


def plan(facts: Iterable[NodeFacts]) -> Plan:
    """Group nodes by NVLink domain; ``InputError`` when one node name comes twice."""
    seen: dict[str, str] = {}
    by_domain: dict[str, list[NodeFacts]] = {}
    unknown: list[NodeFacts] = []
    for f in facts:
        if f.node in seen:
            raise InputError(
                f"node {f.node!r} comes twice ({seen[f.node]} and {f.source})",
                "give each node's facts once",
            )
        seen[f.node] = f.source
        if f.domain is None:
            unknown.append(f)
        else:
            by_domain.setdefault(f.domain, []).append(f)
    domains = []
    for dom_id in sorted(by_domain):
        members = sorted(by_domain[dom_id], key=_tray_order)
        serials = {m.chassis_serial for m in members if m.chassis_serial}
        unfit = tuple((m.node, why) for m in members if (why := m.why_unfit) is not None)
        bad = {n for n, _ in unfit}
        domains.append(
            Domain(
                id=dom_id,
                chassis_serial=serials.pop() if len(serials) == 1 else None,
                nodes=tuple(m.node for m in members),
                fit=tuple(m.node for m in members if m.node not in bad),
                unfit=unfit,
                unchecked=tuple(m.node for m in members if m.unchecked),
            )
        )
    unknown.sort(key=lambda f: natural_key(f.node))
    return Plan(
        domains=tuple(domains),
        unknown_domain=tuple(f.node for f in unknown),
        unknown_unfit=tuple((f.node, why) for f in unknown if (why := f.why_unfit) is not None),
    )


def _tray_order(f: NodeFacts) -> tuple[int, int, tuple[str, int, str]]:
    return (0, f.tray_index, natural_key(f.node)) if f.tray_index is not None else (1, 0, natural_key(f.node))


def pick(p: Plan, nodes: int, segment: int) -> Pick:
    """``nodes`` fit nodes as whole segments of ``segment`` inside domains, in as few domains as can hold
    them: the one domain that fits them most tightly, else the domains with most segments first. ``NotMet``
    saying what is missing when the fit segments do not add up."""
    if nodes % segment:
        raise ValueError(f"{nodes} nodes are not whole segments of {segment}")
    wanted = nodes // segment
    held = [(d, d.segments(segment)) for d in p.domains]
    held = [(d, s) for d, s in held if s]
    total = sum(len(s) for _, s in held)
    if total < wanted:
        where = ", ".join(f"{_short(d)} {len(s)}" for d, s in held) or "none"
        raise NotMet(
            f"--nodes {nodes} --segment {segment} needs {wanted} segments of {segment} fit nodes; "
            f"the domains hold {total} ({where}): {wanted - total} missing"
        )
    one = [(d, s) for d, s in held if len(s) >= wanted]
    if one:
        d, s = min(one, key=lambda ds: (len(ds[1]), ds[0].id))
        chosen = [(d.id, seg) for seg in s[:wanted]]
    else:
        chosen = []
        for d, s in sorted(held, key=lambda ds: (-len(ds[1]), ds[0].id)):
            for seg in s[: wanted - len(chosen)]:
                chosen.append((d.id, seg))
            if len(chosen) == wanted:
                break
    names = [n for _, seg in chosen for n in seg]
    return Pick(segments=tuple(chosen), nodelist=compress_hostlist(names))


def _short(d: Domain) -> str:
    return d.chassis_serial or d.id


# --- Slurm's hostlist and block topology ----------------------------------------------------------------


def compress_hostlist(names: Sequence[str]) -> str:
    """Names as one Slurm hostlist expression, e.g. ``gpu-[01-08,10],login1``, in natural order.

    As Slurm's ``hostlist_ranged_string`` writes them (SchedMD/slurm src/common/hostlist.c): a name is a
    prefix and a numeric suffix; consecutive numbers of one prefix form a range when their digit counts
    match, or neither is zero-padded (``hostrange_width_combine``); ranges of one prefix share one pair of
    brackets; a lone numbered name stays bare. ``launch.slurm.expand_hostlist`` reads the result back.
    """
    ordered = sorted(dict.fromkeys(names), key=natural_key)
    groups: list[tuple[str, list[list[str]]]] = []  # prefix -> runs of digit strings
    for name in ordered:
        m = _NUMBERED.match(name)
        if m is None:
            groups.append((name, []))
            continue
        prefix, digits = m.group(1), m.group(2)
        if groups and groups[-1][0] == prefix and groups[-1][1]:
            runs = groups[-1][1]
            last = runs[-1][-1]
            if int(digits) == int(last) + 1 and _combine(last, digits):
                runs[-1].append(digits)
            else:
                runs.append([digits])
        else:
            groups.append((prefix, [[digits]]))
    parts = []
    for prefix, runs in groups:
        if not runs:
            parts.append(prefix)
        elif len(runs) == 1 and len(runs[0]) == 1:
            parts.append(prefix + runs[0][0])
        else:
            body = ",".join(r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
            parts.append(f"{prefix}[{body}]")
    return ",".join(parts)


def _combine(a: str, b: str) -> bool:
    padded = (len(a) > 1 and a[0] == "0") or (len(b) > 1 and b[0] == "0")
    return len(a) == len(b) or not padded


def block_names(p: Plan) -> dict[str, str]:
    """Domain id -> the block name gputopo gives it (``nvl001``...): Slurm joins block names into
    aggregated block names and reads them back as a hostlist (block_record.c, ``hostlist_create``), so a
    name must be a plain hostlist word; the domain id goes in a comment above the block."""
    width = max(3, len(str(len(p.domains))))
    return {d.id: f"nvl{i:0{width}d}" for i, d in enumerate(p.domains, 1)}


def block_sizes(p: Plan) -> list[int]:
    """``BlockSizes``: the base block is the smallest domain (Slurm stops with "children count lower than
    bblock_node_cnt" when a block has fewer nodes than the first size, block_record.c), then every
    power-of-two multiple up to the number of blocks (each size must be base x 2^k, k <= 15)."""
    if not p.domains:
        return []
    base = min(len(d.nodes) for d in p.domains)
    sizes, k = [base], 1
    while k < len(p.domains) and k < 2**15:
        k *= 2
        sizes.append(base * k)
    return sizes


def block_topology(p: Plan) -> str:
    """The block topology for Slurm's ``topology/block`` plugin (topology.conf(5)): one ``BlockName=...
    Nodes=...`` line per domain with all its members, fit or not (Slurm's own drain keeps unfit ones
    idle), then ``BlockSizes=``; ``#`` comments name each domain and the nodes left out."""
    names = block_names(p)
    lines = ["# NVLink domains from `gputopo nodes --slurm-topology` (TopologyPlugin=topology/block)"]
    for d in p.domains:
        rack = f", rack {d.chassis_serial}" if d.chassis_serial else ""
        lines.append(f"# {d.id}{rack}: {len(d.nodes)} nodes, {len(d.fit)} fit")
        lines.append(f"BlockName={names[d.id]} Nodes={compress_hostlist(d.nodes)}")
    if p.unknown_domain:
        lines.append(f"# not in any block (NVLink domain unknown): {compress_hostlist(p.unknown_domain)}")
    sizes = block_sizes(p)
    if sizes:
        lines.append("BlockSizes=" + ",".join(str(s) for s in sizes))
    return "\n".join(lines) + "\n"


def to_json(p: Plan, segment: int | None) -> dict[str, Any]:
    """The ``domains`` and ``unknown_domain`` of ``gputopo nodes --json``."""
    domains = []
    for d in p.domains:
        domains.append(
            {
                "id": d.id,
                "chassis_serial": d.chassis_serial,
                "nodes": list(d.nodes),
                "fit": list(d.fit),
                "unfit": [{"node": n, "why": w} for n, w in d.unfit],
                "unchecked": list(d.unchecked),
                "segments": [list(s) for s in d.segments(segment)] if segment else None,
            }
        )
    return {
        "domains": domains,
        "unknown_domain": list(p.unknown_domain),
        "unknown_domain_unfit": [{"node": n, "why": w} for n, w in p.unknown_unfit],
    }
