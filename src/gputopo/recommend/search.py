"""Which GPUs to use: a Topology and constraints in, ranked K-GPU sets with estimated busbw and reasons out.

The objective, in order (DESIGN.md, issue 3):

1. the estimated ring all-reduce busbw: the best ring's slowest edge (``bandwidth.best_ring``);
2. the sum of all pair bandwidths in the set (all-to-all traffic);
3. fewer NUMA nodes / CPU sockets spanned;
4. lower PCI order (the sorted nvidia-smi indices, compared lexicographically).

The search is exact. GPUs that look the same to everyone else (same bandwidth to every other GPU, same
NUMA node, same probe findings) are interchangeable, so a set is described by how many GPUs it takes from
each such class, and the lowest-indexed members stand for the rest (they win the PCI-order tie-break).
Class-count vectors are ranked by an upper bound first (every ring vertex needs two ring links, so no ring
beats the slowest "second-fastest link" in the set); the exact ring value is computed only for vectors
whose bound can still enter the top list. Candidates are therefore distinct shapes: on an NVSwitch box
the list shows "4 GPUs on one socket" and "4 across two", not twenty equal copies of the first.

Bandwidths are compared at 1 MB/s resolution (integers internally), so sums of floats never split ties.
No NVML call happens here: live state (busy, failing) arrives in the Topology.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gputopo.errors import InputError, UsageError
from gputopo.model import Gpu, LinkKind, Topology
from gputopo.topology.bandwidth import Assumptions, BandwidthModel, Note, Ring, best_ring, build_model

SCHEMA = "gputopo/recommendation/v1"
PROBE_SCHEMA = "gputopo/probe/v1"
DEFAULT_MAX_USED_MIB = 1024
DEFAULT_TOP = 5
UNITS_PER_GBPS = 1000  # compare bandwidth in MB/s
_UNLIMITED = 10**15  # a single GPU has no ring to limit it

# A probe finding of "slow" is about bandwidth, which the measured figure already carries; every other
# failure kind (nan, diverged, desync, corrupt, hung, crashed) means the GPUs must not work together.
_PERFORMANCE_ONLY_KINDS = frozenset({"slow"})


def units(gbps: float) -> int:
    """A bandwidth in the integer units the search compares (MB/s)."""
    return round(gbps * UNITS_PER_GBPS)


# --- probe evidence ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FailedGroup:
    """GPUs a probe check failed on: never all of them in one set (a pair: never together)."""

    gpus: tuple[int, ...]
    why: str


@dataclass(frozen=True)
class Measurement:
    """A measured all-reduce peak busbw for a GPU set (a pair's replaces the model's estimate)."""

    gpus: tuple[int, ...]
    busbw_gbps: float


@dataclass(frozen=True)
class ProbeEvidence:
    """What a probe report says about this machine's GPU sets."""

    source: str
    failed: tuple[FailedGroup, ...] = ()
    measured: tuple[Measurement, ...] = ()
    warnings: tuple[str, ...] = ()


def evidence_from_report(doc: Any, source: str) -> ProbeEvidence:
    """Read a probe report (schema ``gputopo/probe/v1``, already parsed from JSON).

    A failed check (other than ``slow``) on a set of two GPUs keeps that pair apart; on a larger set it
    keeps the pairs in ``metrics.failed_pairs`` (``[[a, b], ...]``) apart when the check names them, and
    otherwise forbids the whole set together; on one GPU it excludes that GPU. An ``allreduce`` check's
    ``metrics.peak_busbw_gbps`` is a measurement, used only from reports that ran on GPUs
    (``device: cuda``). Raises ``InputError`` when the document is not such a report.
    """

    def bad(what: str) -> InputError:
        return InputError(
            f"--from-report {source}: {what}",
            "give the JSON report that `gputopo probe` wrote under reports/",
        )

    if not isinstance(doc, Mapping) or doc.get("schema") != PROBE_SCHEMA:
        schema = doc.get("schema") if isinstance(doc, Mapping) else None
        found = f"its schema is {schema!r}" if schema else "it has no schema field"
        raise bad(f"not a gputopo probe report ({found}; a probe report's is {PROBE_SCHEMA!r})")
    sets = doc.get("sets")
    if not isinstance(sets, list):
        raise bad("no 'sets' list")
    on_gpus = doc.get("device") == "cuda"
    failed: list[FailedGroup] = []
    measured: list[Measurement] = []
    skipped_measurements = 0
    for entry in sets:
        gpus = entry.get("gpus") if isinstance(entry, Mapping) else None
        if not isinstance(gpus, list) or not gpus or not all(_is_index(g) for g in gpus):
            raise bad(f"a set without a valid 'gpus' list: {entry!r:.80}")
        group = tuple(sorted(set(gpus)))
        checks = entry.get("checks", [])
        if not isinstance(checks, list):
            raise bad(f"set {list(group)}: 'checks' is not a list")
        for check in checks:
            if not isinstance(check, Mapping):
                raise bad(f"set {list(group)}: a check that is not an object")
            name = str(check.get("name", "?"))
            metrics = check.get("metrics") if isinstance(check.get("metrics"), Mapping) else {}
            if check.get("verdict") == "fail" and check.get("kind") not in _PERFORMANCE_ONLY_KINDS:
                kind = check.get("kind")
                why = f"{name} check failed{f' ({kind})' if kind else ''} in {source}"
                failed.extend(_failed_groups(group, metrics.get("failed_pairs"), why))
            peak = metrics.get("peak_busbw_gbps")
            if name == "allreduce" and isinstance(peak, (int, float)) and peak > 0 and len(group) >= 2:
                if on_gpus:
                    measured.append(Measurement(group, float(peak)))
                else:
                    skipped_measurements += 1
    warnings = ()
    if skipped_measurements:
        warnings = (
            f"{source} ran on {doc.get('device')!s} ranks: its bandwidth says nothing about GPU links, "
            "so the model's estimates stand",
        )
    return ProbeEvidence(source, tuple(dict.fromkeys(failed)), tuple(measured), warnings)


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _failed_groups(group: tuple[int, ...], pairs: Any, why: str) -> list[FailedGroup]:
    if len(group) > 2 and isinstance(pairs, list) and pairs:
        named = [
            tuple(sorted(p)) for p in pairs if isinstance(p, list) and len(p) == 2 and all(map(_is_index, p))
        ]
        if named:
            return [FailedGroup(p, why) for p in named if p[0] != p[1]]
    return [FailedGroup(group, why)]


# --- request and result ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Constraints:
    """What the user asked for: set size ``n``, optional ``sets`` to pack, and what to leave out."""

    n: int
    sets: int | None = None
    exclude: tuple[int, ...] = ()
    allow_busy: bool = False
    max_used_mib: int = DEFAULT_MAX_USED_MIB
    top: int = DEFAULT_TOP
    assumptions: Assumptions = field(default_factory=Assumptions)
    evidence: ProbeEvidence | None = None


@dataclass(frozen=True)
class Exclusion:
    """A GPU left out of every set, and why (``--exclude``, failing, busy, probe)."""

    gpu: int
    why: str


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


# --- the problem the search sees ---------------------------------------------------------------------------


def _locality(gpu: Gpu) -> tuple[str | None, str | None]:
    """(grouping key, label) of the NUMA node a GPU hangs off; CPU affinity when NUMA is not shown."""
    for value, label in ((gpu.numa_affinity, "NUMA {}"), (gpu.cpu_affinity, "CPUs {}")):
        text = (value or "").strip()
        if text and text.upper() not in ("N/A", "NA", "-"):
            return text, label.format(text)
    return None, None


@dataclass
class _Problem:
    """The available GPUs as a weighted graph with constraints, in the search's integer units."""

    topo: Topology
    model: BandwidthModel
    gpus: list[int]
    weight: dict[tuple[int, int], int]
    unknown: set[tuple[int, int]]
    forbidden: set[tuple[int, int]]
    groups: list[frozenset[int]]
    measured: dict[tuple[int, int], float]
    locality: dict[int, str | None]
    labels: dict[int, str | None]
    set_measured: dict[tuple[int, ...], float] = field(default_factory=dict)
    classes: list[list[int]] = field(default_factory=list)
    rings: dict[tuple[int, ...], Ring | None] = field(default_factory=dict)

    def w(self, a: int, b: int) -> int:
        return self.weight[(a, b)]

    def gbps(self, a: int, b: int) -> float:
        """The float figure behind an edge: measured if the probe measured it, else the model's."""
        key = (min(a, b), max(a, b))
        if key in self.measured:
            return self.measured[key]
        return self.model.gbps(a, b) or 0.0

    def ring(self, gpus: tuple[int, ...]) -> Ring | None:
        if gpus not in self.rings:
            self.rings[gpus] = best_ring(gpus, self.w)
        return self.rings[gpus]


def _problem(
    topo: Topology, model: BandwidthModel, gpus: list[int], evidence: ProbeEvidence | None
) -> _Problem:
    measured: dict[tuple[int, int], float] = {}
    set_measured: dict[tuple[int, ...], float] = {}
    forbidden: set[tuple[int, int]] = set()
    groups: list[frozenset[int]] = []
    members = set(gpus)
    for m in evidence.measured if evidence else ():
        if set(m.gpus) <= members:
            # Several runs of one set: keep the best; a slow run says less about the link than a fast one.
            into = measured if len(m.gpus) == 2 else set_measured
            into[m.gpus] = max(into.get(m.gpus, 0.0), m.busbw_gbps)
    for f in evidence.failed if evidence else ():
        if len(f.gpus) == 2 and set(f.gpus) <= members:
            forbidden.update({f.gpus, f.gpus[::-1]})
        elif len(f.gpus) > 2 and set(f.gpus) <= members:
            groups.append(frozenset(f.gpus))
    weight: dict[tuple[int, int], int] = {}
    unknown: set[tuple[int, int]] = set()
    for a, b in itertools.combinations(gpus, 2):
        if (a, b) in measured:
            w = units(measured[(a, b)])
        elif (gbps := model.gbps(a, b)) is not None:
            w = units(gbps)
        else:
            w = 0
            unknown.update({(a, b), (b, a)})
        weight[(a, b)] = weight[(b, a)] = w
    local = {g.index: _locality(g) for g in topo.gpus}
    problem = _Problem(
        topo,
        model,
        gpus,
        weight,
        unknown,
        forbidden,
        groups,
        measured,
        {g: local[g][0] for g in gpus},
        {g: local[g][1] for g in gpus},
        set_measured,
    )
    problem.classes = _classes(problem)
    return problem


def _classes(p: _Problem) -> list[list[int]]:
    """Interchangeable GPUs: same locality and the same (bandwidth, forbidden, unknown) to every other GPU.

    Members of a failed group of more than two GPUs stay alone, because the group rule names them.
    """
    in_group = set().union(*p.groups) if p.groups else set()

    def same(u: int, r: int) -> bool:
        if p.locality[u] != p.locality[r] or u in in_group or r in in_group:
            return False
        return all(
            p.weight[(u, x)] == p.weight[(r, x)]
            and ((u, x) in p.forbidden) == ((r, x) in p.forbidden)
            and ((u, x) in p.unknown) == ((r, x) in p.unknown)
            for x in p.gpus
            if x != u and x != r
        )

    classes: list[list[int]] = []
    for g in p.gpus:
        for cls in classes:
            if same(g, cls[0]):
                cls.append(g)
                break
        else:
            classes.append([g])
    return classes


@dataclass(frozen=True)
class _Shape:
    """A set as counts per class; ``gpus`` are its lowest-indexed members (the PCI-order representative)."""

    counts: tuple[int, ...]
    gpus: tuple[int, ...]
    pair_sum: int
    spans: int
    bound: int  # an upper bound on the ring value (exact for n <= 2)


def _shapes(p: _Problem, n: int) -> list[_Shape]:
    """Every feasible class-count vector for sets of ``n`` GPUs."""
    classes = p.classes
    m = len(classes)
    cap = []
    for cls in classes:
        apart = len(cls) > 1 and (cls[0], cls[1]) in p.forbidden
        cap.append(1 if apart else len(cls))
    room = [sum(cap[i:]) for i in range(m)] + [0]
    inner = [p.w(c[0], c[1]) if len(c) > 1 else 0 for c in classes]
    cross = [[p.w(classes[i][0], classes[j][0]) if i != j else 0 for j in range(m)] for i in range(m)]
    apart_cross = [
        [i != j and (classes[i][0], classes[j][0]) in p.forbidden for j in range(m)] for i in range(m)
    ]
    shapes: list[_Shape] = []
    counts = [0] * m

    def emit() -> None:
        present = [i for i in range(m) if counts[i]]
        gpus = tuple(sorted(g for i in present for g in classes[i][: counts[i]]))
        if p.groups and any(group <= set(gpus) for group in p.groups):
            return
        pair_sum = sum(counts[i] * (counts[i] - 1) // 2 * inner[i] for i in present) + sum(
            counts[i] * counts[j] * cross[i][j] for i, j in itertools.combinations(present, 2)
        )
        spans = len({p.locality[classes[i][0]] for i in present} - {None})
        if n == 1:
            bound = _UNLIMITED
        elif n == 2:
            bound = inner[present[0]] if len(present) == 1 else cross[present[0]][present[1]]
        else:
            bound = min(_second_fastest(i, present, counts, inner, cross) for i in present)
        shapes.append(_Shape(tuple(counts), gpus, pair_sum, spans, bound))

    def place(i: int, left: int) -> None:
        if left == 0:
            emit()
            return
        if i == m or room[i] < left:
            return
        for c in range(min(cap[i], left), -1, -1):
            if c and any(counts[j] and apart_cross[i][j] for j in range(i)):
                continue
            counts[i] = c
            place(i + 1, left - c)
        counts[i] = 0

    place(0, n)
    return shapes


def _second_fastest(
    i: int, present: list[int], counts: list[int], inner: list[int], cross: list[list[int]]
) -> int:
    """The second-fastest link from a member of class ``i`` to the rest of the set."""
    links = sorted(
        ((inner[i], counts[i] - 1), *((cross[i][j], counts[j]) for j in present if j != i)), reverse=True
    )
    seen = 0
    for w, count in links:
        seen += count
        if seen >= 2:
            return w
    return 0


def _value(p: _Problem, shape: _Shape) -> int:
    """The exact ring value of a shape (0 when no ring uses only known links)."""
    if len(shape.gpus) <= 2:
        return shape.bound
    ring = p.ring(shape.gpus)
    return ring.busbw_gbps if ring else 0  # type: ignore[return-value]


def _key(value: int, shape: _Shape) -> tuple[int, int, int, tuple[int, ...]]:
    """Sort key, smaller is better: ring value, pair sum, NUMA nodes spanned, PCI order."""
    return (-value, -shape.pair_sum, shape.spans, shape.gpus)


def _rank(p: _Problem, shapes: list[_Shape], top: int) -> list[tuple[int, _Shape]]:
    """The ``top`` best shapes with their exact ring values, best first.

    Visits shapes by their optimistic key; stops once the bound can no longer beat the last kept one.
    """
    kept: list[tuple[tuple[int, int, int, tuple[int, ...]], int, _Shape]] = []
    for shape in sorted(shapes, key=lambda s: _key(s.bound, s)):
        if len(kept) >= top and _key(shape.bound, shape) >= kept[-1][0]:
            break
        value = _value(p, shape)
        kept.append((_key(value, shape), value, shape))
        kept.sort(key=lambda item: item[0])
        del kept[top:]
    return [(value, shape) for _, value, shape in kept]


# --- packing disjoint sets ---------------------------------------------------------------------------------


def _pack(p: _Problem, shapes: list[_Shape], count: int) -> list[tuple[int, ...]] | None:
    """``count`` disjoint sets maximising the slowest set's ring value, then the total, exactly.

    After the total ring value come the total pair sum, fewer NUMA spans, and the PCI order of the sets
    (the sorted list of sorted sets, compared lexicographically). Returns ``None`` when the sets do not fit.
    Levels are tried from the fastest down; the first level at which ``count`` sets of at least that ring
    value fit is the best slowest set, and among those packings a table over the room left in each class
    finds the best totals.
    """
    sizes = tuple(len(c) for c in p.classes)
    values: dict[tuple[int, ...], int] = {}

    def value(s: _Shape) -> int:
        if s.counts not in values:
            values[s.counts] = _value(p, s)
        return values[s.counts]

    need = count * sum(shapes[0].counts)
    levels = sorted({s.bound for s in shapes} | set(p.weight.values()) | {0}, reverse=True)
    tried = -1
    for level in levels:
        eligible = [s for s in shapes if s.bound >= level and value(s) >= level]
        # Nothing new since the last level that failed, or too few GPUs in reach: cannot fit here either.
        reach = sum(size for i, size in enumerate(sizes) if any(s.counts[i] for s in eligible))
        if len(eligible) == tried or reach < need:
            continue
        tried = len(eligible)
        packer = _Packer(eligible, [(value(s), s.pair_sum, -s.spans) for s in eligible])
        best = packer.best(sizes, count)
        if best is None:
            continue
        return min(_assign(p, multiset) for multiset in packer.optimal(sizes, count, best))
    return None


_Gain = tuple[int, int, int]  # (ring value, pair sum, -NUMA spans): summed over sets, larger is better


def _add(x: _Gain, y: _Gain) -> _Gain:
    return (x[0] + y[0], x[1] + y[1], x[2] + y[2])


class _Packer:
    """Best totals of k shapes that fit in the room left per class, and every packing that reaches them.

    The shapes that fit a room are found by enumerating the count vectors under the room and looking them
    up, not by scanning every shape: late in a packing the room is small and holds only a few.
    """

    def __init__(self, shapes: list[_Shape], gains: list[_Gain]) -> None:
        self.shapes = shapes
        self.gains = gains
        self.size = sum(shapes[0].counts)
        self.position = {s.counts: i for i, s in enumerate(shapes)}
        self.memo: dict[tuple[tuple[int, ...], int], _Gain | None] = {}
        self.fit_memo: dict[tuple[int, ...], list[int]] = {}

    def fitting(self, room: tuple[int, ...]) -> list[int]:
        """Positions (ascending) of the shapes whose counts fit within ``room``."""
        if room not in self.fit_memo:
            m = len(room)
            after = [sum(room[i:]) for i in range(m)] + [0]
            found: list[int] = []
            counts = [0] * m

            def walk(i: int, left: int) -> None:
                if left == 0:
                    at = self.position.get(tuple(counts))
                    if at is not None:
                        found.append(at)
                    return
                if i == m or after[i] < left:
                    return
                for c in range(min(room[i], left), -1, -1):
                    counts[i] = c
                    walk(i + 1, left - c)
                counts[i] = 0

            walk(0, self.size)
            self.fit_memo[room] = sorted(found)
        return self.fit_memo[room]

    @staticmethod
    def _minus(room: tuple[int, ...], counts: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(r - c for r, c in zip(room, counts, strict=True))

    def best(self, room: tuple[int, ...], left: int) -> _Gain | None:
        """The best summed gain of ``left`` shapes fitting ``room``; ``None`` if they do not fit."""
        if left == 0:
            return (0, 0, 0)
        key = (room, left)
        if key not in self.memo:
            top = None
            for i in self.fitting(room):
                rest = self.best(self._minus(room, self.shapes[i].counts), left - 1)
                if rest is not None and (top is None or _add(self.gains[i], rest) > top):
                    top = _add(self.gains[i], rest)
            self.memo[key] = top
        return self.memo[key]

    def optimal(
        self, room: tuple[int, ...], left: int, want: _Gain, start: int = 0
    ) -> Iterator[list[_Shape]]:
        """Every multiset (in list order) of ``left`` shapes that fits ``room`` with gain ``want``."""
        if left == 0:
            if want == (0, 0, 0):
                yield []
            return
        for i in self.fitting(room):
            if i < start:
                continue
            s = self.shapes[i]
            rest_room = self._minus(room, s.counts)
            # An optimal packing's remainder is optimal for the room it leaves.
            rest = self.best(rest_room, left - 1)
            if rest is None or _add(self.gains[i], rest) != want:
                continue
            for tail in self.optimal(rest_room, left - 1, rest, i):
                yield [s, *tail]


def _assign(p: _Problem, multiset: list[_Shape]) -> list[tuple[int, ...]]:
    """Members for a multiset of shapes, choosing the lowest PCI order (sorted list of sorted sets).

    The lowest-indexed members of each class are the ones used; the set holding the lowest of them is
    made as low as possible first, then the next, so the sorted list of sets is lexicographically least.
    """
    free = [list(cls) for cls in p.classes]
    owner = {g: i for i, cls in enumerate(p.classes) for g in cls}
    usage = [sum(s.counts[i] for s in multiset) for i in range(len(free))]
    free = [cls[:u] for cls, u in zip(free, usage, strict=True)]
    left = list(multiset)
    out: list[tuple[int, ...]] = []
    while left:
        lowest = min(cls[0] for cls in free if cls)
        home = owner[lowest]
        options = {s.counts: s for s in left if s.counts[home]}
        chosen = min(
            options.values(),
            key=lambda s: tuple(sorted(g for i, c in enumerate(s.counts) for g in free[i][:c])),
        )
        members = tuple(sorted(g for i, c in enumerate(chosen.counts) for g in free[i][:c]))
        for i, c in enumerate(chosen.counts):
            del free[i][:c]
        left.remove(chosen)
        out.append(members)
    return sorted(out)


# --- the service -------------------------------------------------------------------------------------------


def exclusions(topo: Topology, constraints: Constraints) -> tuple[Exclusion, ...]:
    """GPUs no set may use, each with its reasons: ``--exclude``, failing, not accessible, not responding,
    MIG enabled, busy, failed alone in a probe."""
    known = set(topo.gpu_indices)
    for g in constraints.exclude:
        if g not in known:
            raise UsageError(
                f"--exclude {g}: there is no GPU{g} on {topo.source}", f"GPUs there: {_list(sorted(known))}"
            )
    alone = {
        f.gpus[0]: f.why
        for f in (constraints.evidence.failed if constraints.evidence else ())
        if len(f.gpus) == 1
    }
    out = []
    for gpu in sorted(topo.gpus, key=lambda g: g.index):
        why = []
        if gpu.index in constraints.exclude:
            why.append("excluded by --exclude")
        # Failing, not accessible from here, not responding, or MIG enabled (CUDA sees MIG devices, not
        # the GPU, and NCCL does not run on them): no set can use it.
        unavailable = gpu.unavailable_reason
        if unavailable:
            why.append(unavailable)
        if gpu.index in alone:
            why.append(alone[gpu.index])
        if not constraints.allow_busy:
            if gpu.compute_pids:
                pids = ", ".join(str(pid) for pid in gpu.compute_pids[:4]) + (
                    ", ..." if len(gpu.compute_pids) > 4 else ""
                )
                plural = "es" if len(gpu.compute_pids) > 1 else ""
                why.append(f"busy: {len(gpu.compute_pids)} compute process{plural} (pid {pids})")
            if gpu.memory_used_mib is not None and gpu.memory_used_mib > constraints.max_used_mib:
                why.append(
                    f"busy: {gpu.memory_used_mib} MiB in use (over --max-used-mib {constraints.max_used_mib})"
                )
        if why:
            out.append(Exclusion(gpu.index, "; ".join(why)))
    return tuple(out)


def _list(gpus: Sequence[int]) -> str:
    return ", ".join(str(g) for g in gpus)


def recommend(topo: Topology, constraints: Constraints) -> Recommendation:
    """Rank the ``constraints.n``-GPU sets of ``topo`` and, with ``constraints.sets``, pack disjoint ones.

    Raises ``UsageError`` (exit 2) for a request that cannot be met: ``n`` below 1, more GPUs than are
    available (the message says which are excluded and why), sets that do not fit, an unknown GPU in
    ``exclude``, or probe findings that rule out every set.
    """
    n, count = constraints.n, constraints.sets
    if n < 1:
        raise UsageError(f"--n {n}: a set needs at least one GPU", "ask for --n 1 or more")
    if count is not None and count < 1:
        raise UsageError(
            f"--sets {count}: need at least one set", "ask for --sets 1 or more, or leave it out"
        )
    if constraints.top < 1:
        raise UsageError(f"--top {constraints.top}: need at least one candidate", "ask for --top 1 or more")
    excluded = exclusions(topo, constraints)
    out = {e.gpu for e in excluded}
    available = [g for g in sorted(topo.gpu_indices) if g not in out]
    need = n * (count or 1)
    if need > len(available):
        asked = f"--n {n}" + (f" --sets {count} needs {need} GPUs" if count else "")
        why = "; ".join(f"GPU{e.gpu} {e.why}" for e in excluded)
        raise UsageError(
            f"{asked}: only {len(available)} of {len(topo.gpus)} GPUs available"
            + (f" ({why})" if why else ""),
            _fewer_hint(excluded),
        )
    model = build_model(topo, constraints.assumptions)
    p = _problem(topo, model, available, constraints.evidence)
    shapes = _shapes(p, n)
    if not shapes:
        raise UsageError(
            f"--n {n}: every {n}-GPU set includes GPUs a probe report keeps apart",
            "ask for fewer GPUs, or re-probe the failing pairs after fixing them",
        )
    ranked = _rank(p, shapes, constraints.top)
    candidates = tuple(
        replace(
            _candidate(p, rank, shape.gpus, ranked[0] if rank > 1 else None),
            equivalent_sets=_equivalent_sets(p, shape),
        )
        for rank, (_, shape) in enumerate(ranked, start=1)
    )
    packed = None
    if count is not None:
        sets = _pack(p, shapes, count)
        if sets is None:
            raise UsageError(
                f"--sets {count} --n {n}: no {count} disjoint sets avoid the GPUs a probe report keeps apart",
                "ask for fewer or smaller sets",
            )
        packed = tuple(_candidate(p, i, gpus, None) for i, gpus in enumerate(sets, start=1))
    known = set(topo.gpu_indices)
    # One entry per group of GPUs, with every reason (a pair failing dp and ddp is one pair kept apart).
    reasons: dict[tuple[int, ...], list[str]] = {}
    for f in constraints.evidence.failed if constraints.evidence else ():
        if len(f.gpus) >= 2 and set(f.gpus) <= known and f.why not in reasons.get(f.gpus, []):
            reasons.setdefault(f.gpus, []).append(f.why)
    kept_apart = tuple(FailedGroup(gpus, "; ".join(whys)) for gpus, whys in reasons.items())
    return Recommendation(
        source=topo.source,
        n=n,
        best=candidates[0],
        candidates=candidates,
        excluded=excluded,
        kept_apart=kept_apart,
        notes=model.notes(available),
        warnings=topo.warnings + _warnings(p, constraints),
        sets=packed,
        available=tuple(available),
        top=constraints.top,
    )


def _equivalent_sets(p: _Problem, shape: _Shape) -> int:
    """How many sets ``shape`` stands for: per class, the ways to choose its count of members."""
    from math import comb

    total = 1
    for cls, count in zip(p.classes, shape.counts, strict=True):
        total *= comb(len(cls), count)
    return total


def _fewer_hint(excluded: tuple[Exclusion, ...]) -> str:
    if any("busy" in e.why for e in excluded):
        return "ask for fewer GPUs, or count busy GPUs in with --allow-busy"
    return "ask for fewer GPUs"


def _warnings(p: _Problem, constraints: Constraints) -> tuple[str, ...]:
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
    missing = sorted({(a, b) for a, b in p.unknown if a < b})
    if missing:
        shown = ", ".join(f"GPU{a}-GPU{b}" for a, b in missing[:4]) + (", ..." if len(missing) > 4 else "")
        out.append(
            f"{len(missing)} GPU pair link(s) are not in the input ({shown}); sets that include them are "
            "estimated from their known links only"
        )
    return tuple(out)


def _candidate(p: _Problem, rank: int, gpus: tuple[int, ...], best: tuple[int, _Shape] | None) -> Candidate:
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
    p: _Problem,
    gpus: tuple[int, ...],
    ring: Ring | None,
    bottleneck: Bottleneck | None,
    labels: tuple[str, ...],
    lower_bound: bool,
    best: tuple[int, _Shape] | None,
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
    if gpus in p.set_measured:
        out.append(f"measured {p.set_measured[gpus]:.1f} GB/s busbw for this set in the probe report")
    if best is not None:
        out.append(_versus_best(p, gpus, ring, best))
    return tuple(out)


def _versus_best(p: _Problem, gpus: tuple[int, ...], ring: Ring | None, best: tuple[int, _Shape]) -> str:
    """Why this runner-up ranks below #1, in the objective's order."""
    best_value, best_shape = best
    value = ring.busbw_gbps if ring else (_UNLIMITED if len(gpus) == 1 else 0)
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


# --- JSON --------------------------------------------------------------------------------------------------


def candidate_dict(c: Candidate, id_format: str = "index") -> dict[str, Any]:
    """One candidate: the DESIGN.md keys (gpus, est_busbw_gbps, bottleneck, reasons) and more."""
    b = c.bottleneck
    return {
        "gpus": list(c.gpus),
        "est_busbw_gbps": round(c.est_busbw_gbps, 3) if c.est_busbw_gbps is not None else None,
        "est_is_lower_bound": c.lower_bound,
        "bottleneck": b.code if b else None,
        "bottleneck_gpus": [b.a, b.b] if b else None,
        "bottleneck_gbps": round(b.gbps, 3) if b else None,
        "bottleneck_measured": b.measured if b else False,
        "ring": list(c.ring) if c.ring else None,
        "pair_sum_gbps": c.pair_sum_gbps,
        "numa_nodes": [label.removeprefix("NUMA ") for label in c.numa_nodes if label.startswith("NUMA ")],
        "locality": list(c.numa_nodes),
        "reasons": list(c.reasons),
        "env": c.env(id_format),
        "equivalent_sets": c.equivalent_sets,
    }


def to_dict(rec: Recommendation, id_format: str = "index") -> dict[str, Any]:
    """The ``gputopo/recommendation/v1`` document."""
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "source": rec.source,
        "n": rec.n,
        "best": candidate_dict(rec.best, id_format),
        "candidates": [candidate_dict(c, id_format) for c in rec.candidates],
        "excluded": [{"gpu": e.gpu, "why": e.why} for e in rec.excluded],
        "kept_apart": [{"gpus": list(f.gpus), "why": f.why} for f in rec.kept_apart],
        "env": rec.best.env(id_format),
        "assumptions": [str(note) for note in rec.notes],
        "warnings": list(rec.warnings),
        "merged_note": rec.merged_note,
    }
    if rec.sets is not None:
        doc["sets"] = [candidate_dict(c, id_format) for c in rec.sets]
    return doc
