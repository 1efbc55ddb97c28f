"""Which GPUs to use: a Topology and constraints in, ranked K-GPU sets with estimated busbw and reasons out.

The objective, in order (docs/design.md "Choosing a set"):

1. the estimated ring all-reduce busbw: the best ring's slowest edge (``bandwidth.best_ring``);
2. fewer GPU pairs whose PCIe path crosses a bridge where ACS redirects peer traffic (read live by
   ``fabric``: such a pair's P2P goes up to the root complex, slow or corrupt; docs/topo.md);
3. the sum of all pair bandwidths in the set (all-to-all traffic);
4. fewer NUMA nodes / CPU sockets spanned;
5. lower PCI order (the sorted nvidia-smi indices, compared lexicographically).

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
from collections.abc import Iterator
from dataclasses import dataclass, field

from gputopo.model import Gpu, Topology
from gputopo.recommend.evidence import ProbeEvidence
from gputopo.topology.bandwidth import BandwidthModel, Ring, best_ring

UNITS_PER_GBPS = 1000  # compare bandwidth in MB/s
UNLIMITED = 10**15  # a single GPU has no ring to limit it


def units(gbps: float) -> int:
    """A bandwidth in the integer units the search compares (MB/s)."""
    return round(gbps * UNITS_PER_GBPS)


# --- probe evidence ----------------------------------------------------------------------------------------


# --- request and result ------------------------------------------------------------------------------------


# --- the problem the search sees ---------------------------------------------------------------------------


def _locality(gpu: Gpu) -> tuple[str | None, str | None]:
    """(grouping key, label) of the NUMA node a GPU hangs off; CPU affinity when NUMA is not shown."""
    for value, label in ((gpu.numa_affinity, "NUMA {}"), (gpu.cpu_affinity, "CPUs {}")):
        text = (value or "").strip()
        if text and text.upper() not in ("N/A", "NA", "-"):
            return text, label.format(text)
    return None, None


@dataclass
class Problem:
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
    # GPU pairs (both orders) whose PCIe path crosses a bridge where ACS redirects peer traffic -> those
    # bridges (``fabric``, live machines only): ranked after an equally fast set without such a pair.
    redirected: dict[tuple[int, int], tuple[str, ...]] = field(default_factory=dict)
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


def make_problem(
    topo: Topology,
    model: BandwidthModel,
    gpus: list[int],
    evidence: ProbeEvidence | None,
    redirected: tuple[tuple[int, int, tuple[str, ...]], ...] = (),
) -> Problem:
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
    problem = Problem(
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
    for a, b, bridges in redirected:
        if a in members and b in members:
            problem.redirected[(a, b)] = problem.redirected[(b, a)] = bridges
    problem.classes = _classes(problem)
    return problem


def _classes(p: Problem) -> list[list[int]]:
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
            and ((u, x) in p.redirected) == ((r, x) in p.redirected)
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
class Shape:
    """A set as counts per class; ``gpus`` are its lowest-indexed members (the PCI-order representative)."""

    counts: tuple[int, ...]
    gpus: tuple[int, ...]
    pair_sum: int
    spans: int
    bound: int  # an upper bound on the ring value (exact for n <= 2)
    redirects: int = 0  # pairs in the set whose PCIe path an ACS-redirecting bridge crosses


def set_shapes(p: Problem, n: int) -> list[Shape]:
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
    shapes: list[Shape] = []
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
            bound = UNLIMITED
        elif n == 2:
            bound = inner[present[0]] if len(present) == 1 else cross[present[0]][present[1]]
        else:
            bound = min(_second_fastest(i, present, counts, inner, cross) for i in present)
        redirects = sum(1 for a, b in itertools.combinations(gpus, 2) if (a, b) in p.redirected)
        shapes.append(Shape(tuple(counts), gpus, pair_sum, spans, bound, redirects))

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


def _value(p: Problem, shape: Shape) -> int:
    """The exact ring value of a shape (0 when no ring uses only known links)."""
    if len(shape.gpus) <= 2:
        return shape.bound
    ring = p.ring(shape.gpus)
    return ring.busbw_gbps if ring else 0  # type: ignore[return-value]


def _key(value: int, shape: Shape) -> tuple[int, int, int, int, tuple[int, ...]]:
    """Sort key, smaller is better: ring value, pairs behind an ACS-redirecting bridge, pair sum, NUMA
    nodes spanned, PCI order."""
    return (-value, shape.redirects, -shape.pair_sum, shape.spans, shape.gpus)


def rank_shapes(p: Problem, shapes: list[Shape], top: int) -> list[tuple[int, Shape]]:
    """The ``top`` best shapes with their exact ring values, best first.

    Visits shapes by their optimistic key; stops once the bound can no longer beat the last kept one.
    """
    kept: list[tuple[tuple[int, int, int, int, tuple[int, ...]], int, Shape]] = []
    for shape in sorted(shapes, key=lambda s: _key(s.bound, s)):
        if len(kept) >= top and _key(shape.bound, shape) >= kept[-1][0]:
            break
        value = _value(p, shape)
        kept.append((_key(value, shape), value, shape))
        kept.sort(key=lambda item: item[0])
        del kept[top:]
    return [(value, shape) for _, value, shape in kept]


# --- packing disjoint sets ---------------------------------------------------------------------------------


def pack_sets(p: Problem, shapes: list[Shape], count: int) -> list[tuple[int, ...]] | None:
    """``count`` disjoint sets maximising the slowest set's ring value, then the total, exactly.

    After the total ring value come the total pair sum, fewer NUMA spans, and the PCI order of the sets
    (the sorted list of sorted sets, compared lexicographically). Returns ``None`` when the sets do not fit.
    Levels are tried from the fastest down; the first level at which ``count`` sets of at least that ring
    value fit is the best slowest set, and among those packings a table over the room left in each class
    finds the best totals.
    """
    sizes = tuple(len(c) for c in p.classes)
    values: dict[tuple[int, ...], int] = {}

    def value(s: Shape) -> int:
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

    def __init__(self, shapes: list[Shape], gains: list[_Gain]) -> None:
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

    def optimal(self, room: tuple[int, ...], left: int, want: _Gain, start: int = 0) -> Iterator[list[Shape]]:
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


def _assign(p: Problem, multiset: list[Shape]) -> list[tuple[int, ...]]:
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


def count_equivalent_sets(p: Problem, shape: Shape) -> int:
    """How many sets ``shape`` stands for: per class, the ways to choose its count of members."""
    from math import comb

    total = 1
    for cls, count in zip(p.classes, shape.counts, strict=True):
        total *= comb(len(cls), count)
    return total


# --- JSON --------------------------------------------------------------------------------------------------
