"""The bandwidth model: a link code between two GPUs -> GB/s, and a GPU set -> ring all-reduce busbw.

The figures are NCCL's own priors (``src/graph/topo.h``), in GB/s per direction:

- NVLink per link by compute capability (``ncclTopoNVLinkBw``): 18 (SM60, P100), 20 (SM70/SM80: V100,
  A100), 12 (SM86: RTX 30xx, A6000, A40), 20.6 (SM90: H100/H200/H800/H20/GH200), 40.1 (SM100+: B200),
  and 20 (``SM80_NVLINK_BW``) when the compute capability is unknown.
- PCIe: ``width * speed / 80`` with NCCL's per-lane speed units, i.e. x16 is 12 / 24 / 48 GB/s for
  Gen3 / 4 / 5 (``PCI_BW 12.0 // PCI Gen3 x16``).
- The link between CPU sockets: ``BDW_QPI_BW`` 6, ``SKL_QPI_BW`` 10, ``SRP_QPI_BW`` 22, ``ERP_QPI_BW`` 40,
  AMD 16-32. ``topo -m`` does not name the CPU, so we assume Skylake-class 10 GB/s and say so.
- ``INTEL_P2P_OVERHEAD(bw) = bw * 6 / 5``: NCCL charges traffic that crosses an Intel root complex 6/5 of
  its size (the CPU splits P2P writes into 64-byte TLPs). We apply the same 5/6 to every path that goes
  through the CPU (PHB, NODE, SYS), whatever the vendor: NCCL only uses P2P up to PXB by default
  (``NCCL_P2P_LEVEL``), so those paths are staged through host memory (the SHM transport) or cross the
  root complex, and neither reaches the PCIe link rate.

Two choices are ours, not NCCL's, and are stated where they are used: PXB (several PCIe switches) is
counted at 0.9 of the link rate, because its traffic shares switch uplinks with every GPU behind them
and NCCL gives PIX and PXB the same figure, which would make "behind one switch" indistinguishable; and a
ring's estimate is its slowest edge (docs/design.md "Bandwidth model": measured ring busbw reaches
0.94-0.99 of this).

A path is as fast as its slowest part. Ring all-reduce runs at the bottleneck edge of the best ring, so
the estimated busbw of a set is the maximum over ring orders of the minimum edge bandwidth
(``best_ring``). Nothing here touches the machine: a ``Topology`` in, numbers out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gputopo.errors import UsageError
from gputopo.model import Gpu, LinkKind, Topology

# NCCL src/graph/topo.h: SM60/70/80/86/90/100 NVLink figures, GB/s per link per direction.
SM60_NVLINK_GBPS = 18.0
SM70_NVLINK_GBPS = 20.0
SM80_NVLINK_GBPS = 20.0
SM86_NVLINK_GBPS = 12.0
SM90_NVLINK_GBPS = 20.6
SM100_NVLINK_GBPS = 40.1
DEFAULT_NVLINK_GBPS = SM80_NVLINK_GBPS  # what ncclTopoNVLinkBw returns for an unknown compute capability

# NCCL's PCIe speed units per lane, by generation ("2.5 GT/s" -> 15 ... "64 GT/s" -> 480); x16 Gen3 = 12.
_PCIE_SPEED_UNITS = {1: 15, 2: 30, 3: 60, 4: 120, 5: 240, 6: 480}
DEFAULT_PCIE_GEN = 3  # NCCL's PCI_BW is Gen3 x16
DEFAULT_PCIE_WIDTH = 16
DEFAULT_SOCKET_GBPS = 10.0  # SKL_QPI_BW: Skylake-and-later UPI; older QPI is 6, AMD 16-32, SPR/EMR 22/40

CPU_PATH_FACTOR = 5 / 6  # 1 / INTEL_P2P_OVERHEAD: paths through the CPU root complex or host memory
PXB_FACTOR = 0.9  # ours: traffic through several switches shares their uplinks (see module docstring)


def pcie_gbps(gen: int, width: int = DEFAULT_PCIE_WIDTH) -> float:
    """GB/s per direction of a PCIe link, as NCCL counts it: ``width * speed / 80`` (Gen3 x16 = 12)."""
    if gen not in _PCIE_SPEED_UNITS:
        raise ValueError(f"PCIe generation {gen} is not one of {sorted(_PCIE_SPEED_UNITS)}")
    return width * _PCIE_SPEED_UNITS[gen] / 80


def nvlink_gbps_for_compute_capability(cc: int) -> float:
    """NCCL's per-link NVLink figure for a compute capability written as 10*major+minor (90 = 9.0)."""
    if cc >= 100:
        return SM100_NVLINK_GBPS
    if cc >= 90:
        return SM90_NVLINK_GBPS
    if cc == 86:
        return SM86_NVLINK_GBPS
    if cc >= 80:
        return SM80_NVLINK_GBPS
    if cc >= 70:
        return SM70_NVLINK_GBPS
    if cc >= 60:
        return SM60_NVLINK_GBPS
    return SM80_NVLINK_GBPS


@dataclass(frozen=True)
class GpuFamily:
    """What a GPU's marketing name tells the model: architecture and compute capability (10*major+minor)."""

    architecture: str
    compute_capability: int

    @property
    def nvlink_gbps_per_link(self) -> float:
        """NCCL's per-link NVLink figure for this family."""
        return nvlink_gbps_for_compute_capability(self.compute_capability)


# Matched against the upper-cased NVML / nvidia-smi name ("NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-32GB",
# "NVIDIA GeForce RTX 3090", "NVIDIA RTX A6000"). Order matters: the first match wins, so specific names
# ("RTX 6000 Ada", "RTX PRO 6000 Blackwell") come before the generic ones they contain.
_FAMILIES: tuple[tuple[re.Pattern[str], GpuFamily], ...] = tuple(
    (re.compile(pattern), GpuFamily(arch, cc))
    for pattern, arch, cc in (
        (r"\bGB10\b", "Blackwell", 121),
        (r"\bRTX (PRO )?\d{4}\b.*\bBLACKWELL\b|\bRTX 50\d0\b", "Blackwell", 120),
        (r"\bG?B(100|200|300)\b", "Blackwell", 100),
        (r"\bGH200\b|\bH(100|200|800|20)\b", "Hopper", 90),
        (r"\bADA\b|\bL(40S?|40G|20|4)\b|\bRTX 40\d0\b", "Ada Lovelace", 89),
        (r"\bA(100|800|30)\b", "Ampere", 80),
        (r"\bRTX A\d{4}\b|\bA(40|16|10G?|2)\b|\bRTX 30\d0\b", "Ampere", 86),
        (r"\bG?V100\b|\bTITAN V\b", "Volta", 70),
        (r"\bT4\b|\bRTX 20\d0\b|\bQUADRO RTX\b|\bTITAN RTX\b", "Turing", 75),
        (r"\bG?P100\b", "Pascal", 60),
        (r"\bP(40|6|4)\b|\bGTX 10\d0\b|\bTITAN XP?\b", "Pascal", 61),
    )
)


def gpu_family(name: str | None) -> GpuFamily | None:
    """The family a GPU name belongs to, or ``None`` when the name is unknown or not in our table."""
    if not name:
        return None
    text = " ".join(re.split(r"[^A-Z0-9]+", name.upper()))
    for pattern, family in _FAMILIES:
        if pattern.search(text):
            return family
    return None


@dataclass(frozen=True)
class Assumptions:
    """Figures the user gives to replace what the model reads or assumes (``--nvlink-gbps`` etc.).

    ``None`` means: read it from the topology (GPU name, NVML PCIe gen), else use the stated default
    (``DEFAULT_NVLINK_GBPS``, ``DEFAULT_PCIE_GEN``, ``DEFAULT_SOCKET_GBPS``). A given value wins over a
    read one: it is how a user corrects the model for a machine it misjudges.
    """

    nvlink_gbps_per_link: float | None = None
    pcie_gen: int | None = None
    socket_gbps: float | None = None

    def __post_init__(self) -> None:
        if self.nvlink_gbps_per_link is not None and not self.nvlink_gbps_per_link > 0:
            raise UsageError(
                f"--nvlink-gbps {self.nvlink_gbps_per_link}: must be above 0",
                "give GB/s per link per direction, e.g. 20 for A100, 20.6 for H100",
            )
        if self.pcie_gen is not None and self.pcie_gen not in _PCIE_SPEED_UNITS:
            raise UsageError(
                f"--pcie-gen {self.pcie_gen}: not a PCIe generation", "give 1 to 6, e.g. 4 for PCIe Gen4"
            )
        if self.socket_gbps is not None and not self.socket_gbps > 0:
            raise UsageError(
                f"--socket-gbps {self.socket_gbps}: must be above 0",
                "give the CPU socket link in GB/s, e.g. 10 (UPI), 6 (older QPI), 16-32 (AMD)",
            )


@dataclass(frozen=True)
class Note:
    """One figure the model did not read from the machine: ``kind`` is ``assumed`` or ``given``."""

    kind: str
    text: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.text}"


@dataclass(frozen=True)
class GpuFigures:
    """The per-GPU inputs of the model and where each came from (``known``, ``assumed``, ``given``)."""

    index: int
    nvlink_gbps_per_link: float
    nvlink_source: str
    family: GpuFamily | None
    pcie_gen: int
    pcie_width: int
    pcie_source: str
    pcie_width_max: int | None = None  # the width the link can train at, when below it now

    @property
    def pcie_gbps(self) -> float:
        """This GPU's own PCIe link, GB/s per direction (its maximum generation, its current width)."""
        return pcie_gbps(self.pcie_gen, self.pcie_width)

    @property
    def pcie_narrowed(self) -> bool:
        """True when the link trained narrower than it can (x8 of x16)."""
        return self.pcie_width_max is not None and self.pcie_width < self.pcie_width_max


@dataclass(frozen=True)
class Edge:
    """The model's answer for one GPU pair: GB/s (``None`` if the link is unknown) and why."""

    a: int
    b: int
    gbps: float | None
    code: str | None
    kind: LinkKind | None
    why: str

    @property
    def known(self) -> bool:
        """True when the model has a figure for this pair."""
        return self.gbps is not None


@dataclass(frozen=True)
class BandwidthModel:
    """Per-pair GB/s for one topology under one set of assumptions (``build_model`` makes it)."""

    topology: Topology
    assumptions: Assumptions
    figures: dict[int, GpuFigures] = field(hash=False)
    socket_gbps: float
    socket_source: str
    _edges: dict[tuple[int, int], Edge] = field(hash=False, repr=False)

    def edge(self, a: int, b: int) -> Edge:
        """The modelled link between GPUs ``a`` and ``b`` (nvidia-smi indices)."""
        return self._edges[(a, b) if a < b else (b, a)]

    def gbps(self, a: int, b: int) -> float | None:
        """GB/s per direction between two GPUs, ``None`` when the link is unknown."""
        return self.edge(a, b).gbps

    def notes(self, gpus: Sequence[int] | None = None) -> tuple[Note, ...]:
        """What was assumed or given for the links among ``gpus`` (all GPUs by default), one line each.

        A figure is mentioned only when a link among these GPUs uses it: an NVLink assumption on a PCIe
        box would be noise.
        """
        members = sorted(self.figures) if gpus is None else sorted(gpus)
        kinds = {
            e.kind
            for i, a in enumerate(members)
            for b in members[i + 1 :]
            if (e := self.edge(a, b)).known and e.kind is not None
        }
        notes: list[Note] = []
        if LinkKind.NVLINK in kinds:
            notes.extend(self._nvlink_notes(members))
        if kinds & {LinkKind.PIX, LinkKind.PXB, LinkKind.PHB, LinkKind.NODE, LinkKind.SYS}:
            notes.extend(self._pcie_notes(members))
        if LinkKind.SYS in kinds and self.socket_source != "known":
            reason = (
                "from --socket-gbps"
                if self.socket_source == "given"
                else "CPU unknown: NCCL's Skylake UPI figure; set --socket-gbps"
            )
            notes.append(
                Note(self.socket_source, f"CPU socket link {_num(self.socket_gbps)} GB/s ({reason})")
            )
        return tuple(notes)

    def _nvlink_notes(self, members: list[int]) -> list[Note]:
        notes = []
        for source in ("given", "assumed"):
            gpus = [g for g in members if self.figures[g].nvlink_source == source]
            if not gpus:
                continue
            per_link = self.figures[gpus[0]].nvlink_gbps_per_link
            reason = "from --nvlink-gbps" if source == "given" else "GPU model unknown: NCCL's default"
            notes.append(
                Note(source, f"NVLink {_num(per_link)} GB/s per link ({reason}{_for(gpus, members)})")
            )
        return notes

    def _pcie_notes(self, members: list[int]) -> list[Note]:
        notes = []
        for source in ("given", "assumed"):
            gpus = [g for g in members if self.figures[g].pcie_source == source]
            if not gpus:
                continue
            f = self.figures[gpus[0]]
            reason = "from --pcie-gen" if source == "given" else "PCIe generation unknown: NCCL's PCI_BW"
            link = f"PCIe Gen{f.pcie_gen} x{f.pcie_width} = {_num(f.pcie_gbps)} GB/s"
            notes.append(Note(source, f"{link} ({reason}{_for(gpus, members)})"))
        return notes


def _num(x: float) -> str:
    """A GB/s figure as people write it: 20, 20.6, 8.3."""
    return f"{x:.1f}".removesuffix(".0")


def _for(gpus: list[int], members: list[int]) -> str:
    return "" if len(gpus) == len(members) else "; for " + ", ".join(f"GPU{g}" for g in gpus)


def _figures(gpu: Gpu, assumptions: Assumptions) -> GpuFigures:
    family = gpu_family(gpu.name)
    if assumptions.nvlink_gbps_per_link is not None:
        per_link, nv_source = assumptions.nvlink_gbps_per_link, "given"
    elif family is not None:
        per_link, nv_source = family.nvlink_gbps_per_link, "known"
    else:
        per_link, nv_source = DEFAULT_NVLINK_GBPS, "assumed"
    pcie = gpu.pcie
    # Generation at its maximum (an idle GPU lowers its generation to save power and raises it under
    # load), width as trained now (a link trained at x8 stays at x8 until the slot is fixed: docs/design.md
    # "Node health"), so a GPU trained at x8 loses to its x16 siblings.
    read_gen = pcie.gen_max if pcie is not None else None
    read_width = None
    if pcie is not None:
        read_width = pcie.width_current if pcie.width_current else pcie.width_max
    if assumptions.pcie_gen is not None:
        gen, pcie_source = assumptions.pcie_gen, "given"
    elif read_gen in _PCIE_SPEED_UNITS:
        gen, pcie_source = read_gen, "known" if read_width else "assumed"
    else:
        gen, pcie_source = DEFAULT_PCIE_GEN, "assumed"
    width = read_width if read_width else DEFAULT_PCIE_WIDTH
    width_max = pcie.width_max if pcie is not None and pcie.width_max else width
    return GpuFigures(gpu.index, per_link, nv_source, family, gen, width, pcie_source, max(width, width_max))


def build_model(topo: Topology, assumptions: Assumptions | None = None) -> BandwidthModel:
    """The bandwidth of every GPU pair in ``topo``.

    Per-GPU figures come from ``Gpu.name`` (NVLink per link) and ``Gpu.pcie.gen_max``/``width_max``;
    where those are unknown the defaults above are used and ``BandwidthModel.notes`` says so. Live
    details refine a pair when present: NVLinks that are down (``Topology.nvlinks``) and a PCIe pair whose
    P2P status is not OK (``Topology.p2p``), which NCCL then stages through host memory.
    """
    assumptions = assumptions or Assumptions()
    figures = {g.index: _figures(g, assumptions) for g in topo.gpus}
    if assumptions.socket_gbps is not None:
        socket_gbps, socket_source = assumptions.socket_gbps, "given"
    else:
        socket_gbps, socket_source = DEFAULT_SOCKET_GBPS, "assumed"
    links_up = _nvlinks_up(topo)
    p2p_status = _p2p_status(topo)
    edges: dict[tuple[int, int], Edge] = {}
    indices = sorted(figures)
    for i, a in enumerate(indices):
        for b in indices[i + 1 :]:
            edges[(a, b)] = _edge(
                topo, figures[a], figures[b], socket_gbps, links_up.get((a, b)), p2p_status.get((a, b))
            )
    return BandwidthModel(topo, assumptions, figures, socket_gbps, socket_source, edges)


def _nvlinks_up(topo: Topology) -> dict[tuple[int, int], tuple[int, int]]:
    """(links up, links down) per GPU pair from live NVML data, keyed (low, high)."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for peer in topo.nvlinks or ():
        key = (min(peer.gpu, peer.peer), max(peer.gpu, peer.peer))
        up, down = out.get(key, (0, 0))
        # Each side reports the same links; keep the larger count rather than adding them twice.
        out[key] = (max(up, peer.links_up), max(down, peer.links_down))
    return out


def _p2p_status(topo: Topology) -> dict[tuple[int, int], str]:
    """The P2P read status per GPU pair (``OK``, ``CNS``, ...), keyed (low, high), where NVML gave one."""
    rows = (topo.p2p or {}).get("read")
    if not rows:
        return {}
    order = [g.index for g in topo.gpus]
    out = {}
    for i, a in enumerate(order):
        for j, b in enumerate(order):
            if a < b and i < len(rows) and j < len(rows[i]):
                out[(a, b)] = rows[i][j]
    return out


def _edge(
    topo: Topology,
    fa: GpuFigures,
    fb: GpuFigures,
    socket_gbps: float,
    nvlinks: tuple[int, int] | None,
    p2p: str | None,
) -> Edge:
    a, b = fa.index, fb.index
    link = topo.gpu_link(a, b) or topo.gpu_link(b, a)  # a cropped paste may keep only one triangle
    if link is None or link.kind is LinkKind.SELF:
        return Edge(a, b, None, None, None, "link not shown in the input")
    kind = link.kind
    pcie = min(fa.pcie_gbps, fb.pcie_gbps)
    pcie_words = f"Gen{min(fa.pcie_gen, fb.pcie_gen)} x{min(fa.pcie_width, fb.pcie_width)} {_num(pcie)} GB/s"
    narrow = [f for f in (fa, fb) if f.pcie_narrowed]
    if narrow:
        pcie_words += "; " + ", ".join(
            f"GPU{f.index} trained at x{f.pcie_width} of x{f.pcie_width_max}" for f in narrow
        )
    if kind is LinkKind.NVLINK:
        count = link.nvlinks or 0
        per_link = min(fa.nvlink_gbps_per_link, fb.nvlink_gbps_per_link)
        down = ""
        if nvlinks is not None and nvlinks[0] < count:
            down = f", {count - nvlinks[0]} of {count} down"
            count = nvlinks[0]
        if count == 0:
            return Edge(a, b, None, link.code, kind, f"all NVLinks down{down}; the PCIe path is not known")
        family = fa.family.architecture if fa.family and fa.nvlink_source == "known" else fa.nvlink_source
        gbps = count * per_link
        why = f"{count} NVLink{'s' if count > 1 else ''} x {_num(per_link)} GB/s ({family}{down})"
        return Edge(a, b, gbps, link.code, kind, why)
    p2p_off = p2p is not None and p2p not in ("OK", "X")
    if kind is LinkKind.PIX and not p2p_off:
        return Edge(a, b, pcie, link.code, kind, f"PCIe P2P via one switch: {pcie_words}")
    if kind is LinkKind.PXB and not p2p_off:
        gbps = pcie * PXB_FACTOR
        why = f"PCIe P2P via several switches: {pcie_words} less 10% for shared uplinks"
        return Edge(a, b, gbps, link.code, kind, why)
    if kind is LinkKind.SYS:
        gbps = min(pcie, socket_gbps) * CPU_PATH_FACTOR
        why = f"PCIe across CPU sockets: min({pcie_words}, socket link {_num(socket_gbps)} GB/s) x 5/6"
        return Edge(a, b, gbps, link.code, kind, why)
    gbps = pcie * CPU_PATH_FACTOR
    if p2p_off:
        via = f"PCIe without P2P ({p2p}), staged in host memory"
    elif kind is LinkKind.PHB:
        via = "PCIe via the CPU, staged in host memory"
    else:
        via = "PCIe between host bridges of a NUMA node, staged in host memory"
    return Edge(a, b, gbps, link.code, kind, f"{via}: {pcie_words} x 5/6")


# --- the best ring ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ring:
    """A ring order over a GPU set, its slowest edge and that edge's bandwidth (the ring's busbw)."""

    order: tuple[int, ...]
    busbw_gbps: float
    bottleneck: tuple[int, int]


def best_ring(gpus: Sequence[int], gbps: Callable[[int, int], float]) -> Ring | None:
    """The ring over ``gpus`` whose slowest edge is fastest (max over ring orders of the min edge).

    ``gbps(a, b)`` is the symmetric edge weight; 0 means "no usable link". Returns ``None`` for fewer
    than two GPUs or when no ring uses only usable links. Two GPUs form the ring a -> b -> a.

    Exact: the answer is the largest threshold t for which the graph of edges >= t has a Hamiltonian
    cycle; there are few distinct link speeds, Hamiltonicity is monotone in t, so we test the degree
    bound first and binary-search the rest. Each test runs on twin classes (GPUs with the same links to
    everyone else are interchangeable), which turns an NVSwitch box or a PCIe tree into a handful of
    classes instead of 2^n subsets.
    """
    members = list(gpus)
    n = len(members)
    if n < 2:
        return None
    if n == 2:
        w = gbps(members[0], members[1])
        return Ring((members[0], members[1]), w, (members[0], members[1])) if w > 0 else None
    weight = {(a, b): gbps(a, b) for i, a in enumerate(members) for b in members[i + 1 :]}
    for (a, b), w in list(weight.items()):
        weight[(b, a)] = w
    # A Hamiltonian cycle gives every vertex two ring neighbours: no ring beats the smallest
    # "second-fastest link" of any vertex.
    upper = min(sorted((weight[(v, u)] for u in members if u != v), reverse=True)[1] for v in members)
    levels = sorted({w for w in weight.values() if 0 < w <= upper})
    if not levels:
        return None
    order = _hamiltonian_cycle(members, weight, levels[-1])
    if order is None:
        lo, hi = 0, len(levels) - 1  # invariant: levels[hi] fails; find the largest level that works
        found: list[int] | None = None
        while lo < hi:
            mid = (lo + hi) // 2
            attempt = _hamiltonian_cycle(members, weight, levels[mid])
            if attempt is None:
                hi = mid
            else:
                found, lo = attempt, mid + 1
        if found is None:
            return None
        order = found
    edges = [(order[i], order[(i + 1) % n]) for i in range(n)]
    slowest = min(edges, key=lambda e: weight[e])
    return Ring(tuple(order), weight[slowest], slowest)


def _twin_classes(members: list[int], adjacent: Callable[[int, int], bool]) -> list[list[int]]:
    """Groups of interchangeable vertices: u ~ v when they have the same neighbours apart from each other.

    The relation is an equivalence (if u ~ v and v ~ y then all three share their mutual adjacency), so
    comparing with each class's first member is enough.
    """
    classes: list[list[int]] = []
    for v in members:
        for cls in classes:
            r = cls[0]
            if all(adjacent(v, x) == adjacent(r, x) for x in members if x != v and x != r):
                cls.append(v)
                break
        else:
            classes.append([v])
    return classes


def _hamiltonian_cycle(
    members: list[int], weight: dict[tuple[int, int], float], t: float
) -> list[int] | None:
    """A Hamiltonian cycle (as a vertex order) in the graph of edges with weight >= t, or ``None``.

    Searches over class counts rather than vertices: a walk that enters class i picks any unused member
    of it, since all members look alike from outside. States (counts left, current class) that cannot be
    completed are remembered, so the search is polynomial in the class sizes for a fixed class count.
    """
    n = len(members)

    def adjacent(a: int, b: int) -> bool:
        return weight[(a, b)] >= t

    if any(sum(adjacent(v, u) for u in members if u != v) < 2 for v in members):
        return None
    classes = _twin_classes(members, adjacent)
    m = len(classes)
    link = [[False] * m for _ in range(m)]
    for i in range(m):
        for j in range(m):
            if i != j:
                link[i][j] = adjacent(classes[i][0], classes[j][0])
            else:
                link[i][i] = len(classes[i]) > 1 and adjacent(classes[i][0], classes[i][1])
    counts = [len(c) for c in classes]
    counts[0] -= 1  # the ring starts at the first member of class 0
    walk = [0]
    dead: set[tuple[tuple[int, ...], int]] = set()

    def extend(cur: int, left: int) -> bool:
        if left == 0:
            return link[cur][0]
        state = (tuple(counts), cur)
        if state in dead:
            return False
        # Classes with fewer remaining members first: they are the ones that can be stranded.
        for j in sorted((j for j in range(m) if counts[j] and link[cur][j]), key=lambda j: counts[j]):
            counts[j] -= 1
            walk.append(j)
            if extend(j, left - 1):
                return True
            walk.pop()
            counts[j] += 1
        dead.add(state)
        return False

    if not extend(0, n - 1):
        return None
    unused = [list(c) for c in classes]
    return [unused[c].pop(0) for c in walk]


def ring_busbw_gbps(
    topo: Topology, gpus: Sequence[int], assumptions: Assumptions | None = None
) -> float | None:
    """The model's ring all-reduce busbw for ``gpus`` on ``topo`` (GB/s), as the probe compares it.

    ``None`` when some link among ``gpus`` is unknown (a cropped input) and for a single GPU, where there
    is no inter-GPU traffic to estimate. Raises ``UsageError`` for an index that is not in ``topo`` or
    given twice.
    """
    members = list(gpus)
    known = set(topo.gpu_indices)
    for g in members:
        if g not in known:
            raise UsageError(
                f"no GPU{g} in {topo.source}", f"GPUs there: {', '.join(map(str, sorted(known)))}"
            )
    if len(set(members)) != len(members):
        raise UsageError(f"GPU set {members} names a GPU twice", "list each GPU once")
    if len(members) < 2:
        return None
    model = build_model(topo, assumptions)
    if any(model.gbps(a, b) is None for i, a in enumerate(members) for b in members[i + 1 :]):
        return None
    ring = best_ring(members, lambda a, b: model.gbps(a, b) or 0.0)
    return ring.busbw_gbps if ring else None
