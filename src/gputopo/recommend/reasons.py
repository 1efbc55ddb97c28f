"""What recommend says about a set: its estimate and bottleneck, the reasons in words (including how it
compares with the best), and the warnings about the input; the result types (``Candidate``,
``Recommendation``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from gputopo.errors import UsageError
from gputopo.model import LinkKind
from gputopo.recommend.constraints import DEFAULT_TOP, Constraints, Exclusion
from gputopo.recommend.evidence import FailedGroup
from gputopo.recommend.search import UNITS_PER_GBPS, UNLIMITED, Problem, Shape
from gputopo.topology.bandwidth import Note, Ring


@dataclass(frozen=True)
class Bottleneck:
    """The slowest edge of a set's best ring."""

    a: int
    b: int
    code: str | None
    gbps: float
    why: str
    measured: bool

    @property
    def label(self) -> str:
        """``NODE between GPU1 and GPU2``."""
        return f"{self.code or 'link'} between GPU{self.a} and GPU{self.b}"


@dataclass(frozen=True)
class Candidate:
    """One recommended GPU set with its estimate and the reasons for its place in the ranking.

    ``est_busbw_gbps`` is ``None`` for a single GPU (nothing to communicate) and for a set with no ring
    over known links. ``lower_bound`` is true when some links in the set are not in the input: the
    estimate counts the known ones only, so the real figure can only be higher.
    """

    rank: int
    gpus: tuple[int, ...]
    est_busbw_gbps: float | None
    ring: tuple[int, ...] | None
    bottleneck: Bottleneck | None
    pair_sum_gbps: float
    numa_nodes: tuple[str, ...]
    reasons: tuple[str, ...]
    lower_bound: bool = False
    uuids: tuple[str | None, ...] = ()
    # How many concrete sets this row stands for: the others swap in interchangeable GPUs (same links to
    # every other GPU, same NUMA node), so they get the same estimate and the PCI-lowest one is shown.
    equivalent_sets: int = 1

    def env(self, id_format: str = "index") -> dict[str, str]:
        """The environment that selects this set: always PCI bus order, by index or by UUID."""
        if id_format == "uuid":
            if not self.uuids or any(u is None for u in self.uuids):
                raise UsageError(
                    "--format uuid: GPU UUIDs are not known for this input",
                    "UUIDs come from the machine itself (no --input) or a `gputopo topo --json` snapshot; "
                    "or use --format index",
                )
            devices = ",".join(u for u in self.uuids if u is not None)
        else:
            devices = ",".join(str(g) for g in self.gpus)
        # CUDA numbers devices fastest-first unless told to follow the PCI bus order nvidia-smi uses.
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": devices}

    def export_line(self, id_format: str = "index") -> str:
        """``export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=6,7``."""
        return "export " + " ".join(f"{k}={v}" for k, v in self.env(id_format).items())


@dataclass(frozen=True)
class Recommendation:
    """The answer to ``recommend --n K``: the best set, ranked candidates, packed sets, and context."""

    source: str
    n: int
    best: Candidate
    candidates: tuple[Candidate, ...]
    excluded: tuple[Exclusion, ...]
    kept_apart: tuple[FailedGroup, ...]
    notes: tuple[Note, ...]
    warnings: tuple[str, ...]
    sets: tuple[Candidate, ...] | None = None
    available: tuple[int, ...] = ()
    top: int = DEFAULT_TOP

    @property
    def merged_note(self) -> str | None:
        """Says that rows stand for equivalent sets, when they do (so ``--top 5`` giving 3 rows is clear)."""
        merged = [c for c in self.candidates if c.equivalent_sets > 1]
        if not merged:
            return None
        shown = ", ".join(f"#{c.rank} stands for {c.equivalent_sets} sets" for c in merged)
        fewer = (
            f"--top {self.top} shows {len(self.candidates)}: that is every distinct set; "
            if len(self.candidates) < self.top
            else ""
        )
        return (
            f"{fewer}rows merge equivalent sets (GPUs with the same links to every other GPU and the same "
            f"NUMA node are interchangeable; the lowest indices are shown): {shown}"
        )


def fewer_hint(excluded: tuple[Exclusion, ...]) -> str:
    """The flags that would admit a left-out GPU, judged by each reason's own prefix (a health finding's
    words may say "while busy": that GPU needs --allow-unhealthy, not --allow-busy); a flag the user gave
    leaves no reason of its kind, so it is never named."""
    parts = [p for e in excluded for p in e.why.split("; ")]
    flags = []
    if any(p.startswith("busy: ") for p in parts):
        flags.append("count busy GPUs in with --allow-busy")
    if any(p.startswith("health: ") for p in parts):
        flags.append("count GPUs with a health problem in with --allow-unhealthy")
    return "ask for fewer GPUs" + (", or " + " or ".join(flags) if flags else "")


def input_warnings(p: Problem, constraints: Constraints) -> tuple[str, ...]:
    out = []
    if constraints.evidence:
        out.extend(constraints.evidence.warnings)
        named = {g for f in constraints.evidence.failed for g in f.gpus}
        named |= {g for m in constraints.evidence.measured for g in m.gpus}
        strangers = sorted(named - set(p.topo.gpu_indices))
        if strangers:
            out.append(
                f"{constraints.evidence.source} names {', '.join(f'GPU{g}' for g in strangers)}, not on "
                f"{p.topo.source}: was it written on another machine? Findings about them are ignored"
            )
    if constraints.allow_unhealthy and constraints.unhealthy:
        sick = ", ".join(f"GPU{g} ({why})" for g, why in constraints.unhealthy)
        out.append(f"--allow-unhealthy: sets may hold GPUs with a health problem: {sick}")
    missing = sorted({(a, b) for a, b in p.unknown if a < b})
    if missing:
        shown = ", ".join(f"GPU{a}-GPU{b}" for a, b in missing[:4]) + (", ..." if len(missing) > 4 else "")
        out.append(
            f"{len(missing)} GPU pair link(s) are not in the input ({shown}); sets that include them are "
            "estimated from their known links only"
        )
    return tuple(out)


def make_candidate(p: Problem, rank: int, gpus: tuple[int, ...], best: tuple[int, Shape] | None) -> Candidate:
    """A set with its estimate, bottleneck and reasons; ``best`` is #1 when this is a runner-up."""
    ring = p.ring(gpus) if len(gpus) > 1 else None
    bottleneck = None
    estimate = None
    if ring is not None:
        a, b = ring.bottleneck
        edge = p.model.edge(a, b)
        key = (min(a, b), max(a, b))
        measured = key in p.measured
        gbps = p.gbps(a, b)
        why = edge.why
        if measured:
            model = f" (model: {edge.gbps:.1f})" if edge.gbps is not None else ""
            why = f"measured {gbps:.1f} GB/s in the probe report{model}"
        bottleneck = Bottleneck(key[0], key[1], edge.code, gbps, why, measured)
        estimate = gbps
    pairs = list(itertools.combinations(gpus, 2))
    pair_sum = sum(p.gbps(a, b) for a, b in pairs if (a, b) not in p.unknown)
    lower_bound = any((a, b) in p.unknown for a, b in pairs)
    labels = tuple(dict.fromkeys(label for g in gpus if (label := p.labels[g]) is not None))
    reasons = _reasons(p, gpus, ring, bottleneck, labels, lower_bound, best)
    uuids = tuple(p.topo.gpu(g).uuid for g in gpus)
    return Candidate(
        rank,
        gpus,
        estimate,
        ring.order if ring else None,
        bottleneck,
        round(pair_sum, 3),
        labels,
        reasons,
        lower_bound,
        uuids,
    )


def _reasons(
    p: Problem,
    gpus: tuple[int, ...],
    ring: Ring | None,
    bottleneck: Bottleneck | None,
    labels: tuple[str, ...],
    lower_bound: bool,
    best: tuple[int, Shape] | None,
) -> tuple[str, ...]:
    out: list[str] = []
    pairs = list(itertools.combinations(gpus, 2))
    if len(gpus) == 1:
        out.append("a single GPU: no inter-GPU traffic, nothing to estimate")
    elif bottleneck is None:
        out.append("no ring over known links: the links it would need are not in the input")
    else:
        kinds = {p.model.edge(a, b).kind for a, b in pairs}
        if len(gpus) > 2 and kinds == {LinkKind.NVLINK}:
            out.append("every pair on NVLink")
        slowest = "link" if len(gpus) == 2 else "slowest ring link"
        code = bottleneck.code or "link"
        out.append(f"{slowest} {code} (GPU{bottleneck.a}-GPU{bottleneck.b}): {bottleneck.why}")
    unplaced = [f"GPU{g}" for g in gpus if p.labels[g] is None]
    if len(labels) == 1 and not unplaced:
        out.append(f"all on {labels[0]}")
    elif len(labels) > 1:
        out.append(f"spans {' and '.join(labels)}")
    if unplaced and labels:
        out.append(f"NUMA node not shown for {', '.join(unplaced[:4])}{', ...' if len(unplaced) > 4 else ''}")
    if lower_bound:
        missing = [f"GPU{a}-GPU{b}" for a, b in pairs if (a, b) in p.unknown]
        out.append(f"at least this: {len(missing)} link(s) not in the input ({', '.join(missing[:3])})")
    behind = [(a, b) for a, b in pairs if (a, b) in p.redirected]
    if behind:
        bridges = sorted({br for pair in behind for br in p.redirected[pair]})
        named = ", ".join(f"GPU{a}-GPU{b}" for a, b in behind[:4]) + (", ..." if len(behind) > 4 else "")
        out.append(
            f"P2P between {named} crosses a bridge where ACS redirects it ({', '.join(bridges)}): "
            "up to the root complex, slower, and corrupt where the IOMMU translates (`gputopo check`)"
        )
    if gpus in p.set_measured:
        out.append(f"measured {p.set_measured[gpus]:.1f} GB/s busbw for this set in the probe report")
    if best is not None:
        out.append(_versus_best(p, gpus, ring, best))
    return tuple(out)


def _versus_best(p: Problem, gpus: tuple[int, ...], ring: Ring | None, best: tuple[int, Shape]) -> str:
    """Why this runner-up ranks below #1, in the objective's order."""
    best_value, best_shape = best
    value = ring.busbw_gbps if ring else (UNLIMITED if len(gpus) == 1 else 0)
    if value < best_value:
        top = p.ring(best_shape.gpus)
        if top is not None and ring is not None:
            ta, tb = top.bottleneck
            a, b = ring.bottleneck
            return (
                f"slower than #1: {p.model.edge(a, b).code} at {p.gbps(a, b):.1f} GB/s "
                f"vs {p.model.edge(ta, tb).code} at {p.gbps(ta, tb):.1f} GB/s"
            )
        return "slower than #1"
    redirects = sum(1 for pair in itertools.combinations(gpus, 2) if pair in p.redirected)
    if redirects > best_shape.redirects:
        return (
            f"as fast as #1 on paper, but {redirects} of its pairs cross an ACS-redirecting bridge "
            f"(#1: {best_shape.redirects})"
        )
    pair_sum = sum(p.w(a, b) for a, b in itertools.combinations(gpus, 2))
    if pair_sum < best_shape.pair_sum:
        return (
            f"same ring bandwidth as #1, less between all pairs "
            f"({pair_sum / UNITS_PER_GBPS:.1f} vs {best_shape.pair_sum / UNITS_PER_GBPS:.1f} GB/s summed)"
        )
    spans = len({p.locality[g] for g in gpus} - {None})
    if spans > best_shape.spans:
        return f"as fast as #1 but spans {spans} NUMA nodes instead of {best_shape.spans}"
    return "as good as #1; listed after it by PCI order"
