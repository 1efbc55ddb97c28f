"""NCCL's own view of a machine (``NCCL_TOPO_DUMP_FILE`` / ``NCCL_TOPO_FILE`` XML) -> ``Topology`` (pure).

The format (NCCL src/graph/xml.cc and topo.cc; docs/topo.md "NCCL's own topology as input" says what
we rely on)::

    <system version="1">
      <cpu numaid affinity arch vendor familyid modelid>      one per NUMA node
        <pci busid class link_speed link_width ...>          class 0x0604xx: a PCIe switch (its upstream port)
          <pci busid class="0x0302xx" ...>                   a GPU's own PCI function
            <gpu dev sm rank gdr> <nvlink target count tclass/> </gpu>
          <pci busid class="0x02xxxx" ...> <nic> <net name dev speed port guid .../> </nic> </pci>
        <nic> <net .../> </nic>                               a socket NIC (eth0): left out of the matrix

Hand-written topology files (Azure's) carry only ``<cpu>`` and ``<pci>``: a leaf ``<pci>`` of class
0x03 is a GPU, of class 0x02 a NIC, named by nobody; GPUs are then numbered in PCI bus order, as
nvidia-smi numbers them.

The link matrix is named as nvidia-smi would name it: NV# for NVLink (direct links: their count; through
NVSwitch: the GPU's total, as nvidia-smi prints), PIX when the path crosses one switch, PXB for more, PHB
when it meets the CPU, SYS across ``<cpu>`` elements. NODE cannot be told from PHB: the dump has no
host-bridge ids, so a path through the CPU is PHB (NCCL's own name for it), and a warning says so.

Hostile input: the file is parsed with expat directly; a DOCTYPE (the only way to declare entities, so
the only door to entity expansion and external entities) is refused, as are files above
``MAX_BYTES``, nesting deeper than ``MAX_DEPTH`` and more than ``MAX_ELEMENTS`` elements. Python's own
documentation ("XML security") says expat before 2.6/2.7.2 can be made to expand entities without bound,
and this interpreter may ship one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import NamedTuple
from xml.parsers import expat

from gputopo.errors import InputError
from gputopo.inputs import MAX_INPUT_BYTES
from gputopo.model import Gpu, Matrix, Nic, NvlinkPeer, PcieLink, Topology

MAX_BYTES = MAX_INPUT_BYTES  # the one cap of every reader (gputopo.inputs); real dumps are 1-100 KB
MAX_DEPTH = 64  # a dump nests cpu > pci (a few switch levels) > gpu > nvlink
MAX_ELEMENTS = 200_000
MAX_GPUS = 1024  # NVML indices in one dump
MAX_NVLINKS = 64  # links from one GPU (18 on Hopper and Blackwell); keeps NV# within what topo -m prints

HINT = 'give the file NCCL writes with NCCL_TOPO_DUMP_FILE=path (a <system version="1"> document)'

# NCCL's kvDictPciGen (topo.cc): link_speed strings, matched by prefix, to PCIe generations.
_GEN_BY_SPEED = (
    ("2.5 GT/s", 1),
    ("5 GT/s", 2),
    ("8 GT/s", 3),
    ("16 GT/s", 4),
    ("32 GT/s", 5),
    ("64 GT/s", 6),
)
# NCCL's per-lane units for width * speed / 80 = GB/s (topo.h), by generation.
_LANE_UNITS = {1: 15, 2: 30, 3: 60, 4: 120, 5: 240, 6: 480}
# A QEMU/IBM-cloud emulated switch (TI XIO3130 ids) reports 2.5 GT/s x1 whatever the real link is.
_EMULATED_SWITCHES = {("0x104c", "0x8232")}


@dataclass
class _Node:
    tag: str
    attrs: dict[str, str]
    line: int
    children: list[_Node] = field(default_factory=list)


def _parse_tree(text: str, source: str) -> _Node:
    """Expat into a small element tree, refusing DTDs (no entity can ever be expanded)."""
    if len(text) > MAX_BYTES:
        raise InputError(f"{source}: {len(text)} characters is too large for an NCCL topology file", HINT)
    parser = expat.ParserCreate()
    root = _Node("#document", {}, 0)
    stack = [root]
    count = 0

    def refuse(*_: object) -> None:
        raise InputError(
            f"{source}: line {parser.CurrentLineNumber}: a DOCTYPE or entity declaration is not allowed here",
            "NCCL never writes one; " + HINT,
        )

    def start(tag: str, attrs: dict[str, str]) -> None:
        nonlocal count
        count += 1
        if count > MAX_ELEMENTS or len(stack) > MAX_DEPTH:
            raise InputError(
                f"{source}: line {parser.CurrentLineNumber}: too many or too deeply nested elements", HINT
            )
        node = _Node(tag, attrs, parser.CurrentLineNumber)
        stack[-1].children.append(node)
        stack.append(node)

    def end(_tag: str) -> None:
        stack.pop()

    parser.StartDoctypeDeclHandler = refuse
    parser.EntityDeclHandler = refuse
    parser.ExternalEntityRefHandler = refuse
    parser.StartElementHandler = start
    parser.EndElementHandler = end
    try:
        parser.Parse(text, True)
    except expat.ExpatError as exc:
        raise InputError(
            f"{source}: not well-formed XML (line {exc.lineno}: {expat.errors.messages[exc.code]})", HINT
        ) from None
    if len(root.children) != 1:
        raise InputError(f"{source}: no XML element found", HINT)
    return root.children[0]


@dataclass(frozen=True)
class PciHop:
    """One ``<pci>`` element on a device's way to the CPU: bus id, class, and its link as NCCL recorded it."""

    busid: str
    pci_class: str
    speed: str | None
    gen: int | None
    width: int | None
    vendor: str | None = None
    device: str | None = None

    @property
    def gbps(self) -> float | None:
        """GB/s per direction as NCCL computes it (width * lane units / 80); ``None`` when unknown."""
        if self.gen is None or self.width is None:
            return None
        return self.width * _LANE_UNITS[self.gen] / 80

    @property
    def is_switch(self) -> bool:
        """A PCIe bridge (class 0x0604xx): NCCL writes one per switch, named by its upstream port."""
        return self.pci_class.startswith("0x0604")

    def describe(self) -> str:
        """``Gen4 x16 (24 GB/s)``, or what NCCL would assume."""
        if self.gen is None:
            return f"unrecorded speed {self.speed!r} x{self.width}"
        return f"Gen{self.gen} x{self.width} ({_num(self.gbps)} GB/s)"


@dataclass(frozen=True)
class XmlGpu:
    """A GPU in the file: its NVML index (``dev``), where it sits, and its NVLinks."""

    index: int
    busid: str
    cpu: int
    numaid: str | None
    affinity: str | None
    path: tuple[PciHop, ...]  # from the CPU down to the GPU's own function
    sm: int | None
    nvlinks: tuple[tuple[str, int, str], ...]  # (target bus id, count, target class)


@dataclass(frozen=True)
class XmlNic:
    """A network device (one ``<net>``): name, where it sits, and the physical card it belongs to."""

    name: str | None
    cpus: tuple[int, ...]  # a socket NIC is listed under every <cpu>
    path: tuple[PciHop, ...]  # empty for a NIC without PCI device
    card: str  # PCI bus id of the card, or the name for a socket NIC
    speed_mbps: int | None = None
    gdr: bool | None = None


@dataclass(frozen=True)
class NcclSystem:
    """What the file says, before it becomes a ``Topology``."""

    gpus: tuple[XmlGpu, ...]
    nics: tuple[XmlNic, ...]
    cpus: tuple[dict[str, str], ...]
    warnings: tuple[str, ...]

    @property
    def physical_nics(self) -> int:
        """Cards, not ports: two ``<net>`` of one card (mlx5_0, mlx5_1 on a dual-port card) count once."""
        return len({n.card for n in self.nics})


def read_system(text: str, source: str = "nccl-topo.xml") -> NcclSystem:
    """Parse NCCL topology XML; ``InputError`` with the line for anything that is not one."""
    root = _parse_tree(text.lstrip("\ufeff"), source)
    if root.tag == "graphs":
        raise InputError(
            f"{source}: this is an NCCL graph file (NCCL_GRAPH_DUMP_FILE: rings and trees), not a topology",
            "give the NCCL_TOPO_DUMP_FILE output instead",
        )
    if root.tag != "system":
        raise InputError(f"{source}: the root element is <{root.tag}>, not <system>", HINT)
    warnings: list[str] = []
    version = root.attrs.get("version")
    if version != "1":
        warnings.append(f"<system version={version!r}>: NCCL reads only version 1; read as if it were")
    walker = _Walker(source, warnings)
    cpus = [c for c in root.children if c.tag == "cpu"]
    if not cpus:
        raise InputError(f"{source}: <system> has no <cpu> element", HINT)
    for i, cpu in enumerate(cpus):
        walker.cpu(i, cpu)
    return NcclSystem(
        gpus=walker.numbered_gpus(),
        nics=walker.merged_nics(),
        cpus=tuple(c.attrs for c in cpus),
        warnings=tuple(warnings),
    )


class _Where(NamedTuple):
    """The ``<cpu>`` a device hangs off: its position in the file, NUMA node and CPU list."""

    cpu: int
    numa: str | None
    affinity: str | None


def _xml_gpu(
    busid: str, where: _Where, path: tuple[PciHop, ...], sm: int | None, nv: tuple[tuple[str, int, str], ...]
) -> XmlGpu:
    return XmlGpu(-1, busid, where.cpu, where.numa, where.affinity, path, sm, nv)


class _Walker:
    """Walks the element tree once, collecting GPUs and NICs with the path of ``<pci>`` above each."""

    def __init__(self, source: str, warnings: list[str]) -> None:
        self.source = source
        self.warnings = warnings
        self.gpus: list[tuple[int | None, XmlGpu, _Node]] = []  # (dev as written, GPU, its element)
        self.nics: list[XmlNic] = []

    def fail(self, node: _Node, what: str) -> InputError:
        return InputError(f"{self.source}: line {node.line}: {what}", HINT)

    def cpu(self, index: int, node: _Node) -> None:
        numaid = node.attrs.get("numaid")
        numa = None if numaid in (None, "", "-1") else numaid
        affinity = _cpu_list(node.attrs.get("affinity"))
        where = _Where(index, numa, affinity)
        for child in node.children:
            if child.tag == "pci":
                self.pci(child, where, ())
            elif child.tag == "nic":
                self.nic(child, where, ())

    def pci(self, node: _Node, where: _Where, path: tuple[PciHop, ...]) -> None:
        busid = _busid(node.attrs.get("busid"))
        if busid is None:
            raise self.fail(node, "<pci> without a valid busid")
        hop = _hop(busid, node.attrs)
        path = (*path, hop)
        kids = [c for c in node.children if c.tag in ("pci", "gpu", "nic")]
        for child in kids:
            if child.tag == "pci":
                self.pci(child, where, path)
            elif child.tag == "gpu":
                self.gpu(child, where, path)
            else:
                self.nic(child, where, path)
        if not kids:  # a bare leaf of a hand-written file: its class says what it is
            if hop.pci_class.startswith("0x03"):
                self.gpus.append((None, _xml_gpu(busid, where, path, None, ()), node))
            elif hop.pci_class.startswith("0x02"):
                self.nics.append(XmlNic(None, (where.cpu,), path, busid))

    def gpu(self, node: _Node, where: _Where, path: tuple[PciHop, ...]) -> None:
        dev = _int(node, "dev", self, 0, MAX_GPUS - 1)
        nv = []
        for link in node.children:
            if link.tag != "nvlink":
                continue
            target = (link.attrs.get("target") or "").strip().lower()
            count = _int(link, "count", self, 0, MAX_NVLINKS)
            if count is None:
                raise self.fail(link, "<nvlink> without a count")
            nv.append((target, count, (link.attrs.get("tclass") or "").lower()))
        if sum(c for _, c, _ in nv) > MAX_NVLINKS:
            raise self.fail(node, f"more than {MAX_NVLINKS} NVLinks on one GPU")
        self.gpus.append(
            (dev, _xml_gpu(path[-1].busid, where, path, _int(node, "sm", self), tuple(nv)), node)
        )

    def nic(self, node: _Node, where: _Where, path: tuple[PciHop, ...]) -> None:
        for net in node.children:
            if net.tag != "net":
                continue
            name = net.attrs.get("name")
            card = path[-1].busid if path else f"socket:{name}:{net.attrs.get('guid')}"
            gdr = net.attrs.get("gdr")
            self.nics.append(
                XmlNic(
                    name,
                    (where.cpu,),
                    path,
                    card,
                    _int(net, "speed", self),
                    None if gdr is None else gdr == "1",
                )
            )

    def numbered_gpus(self) -> tuple[XmlGpu, ...]:
        """GPUs by NVML index; those without ``dev`` (hand-written files) numbered after, in bus order."""
        seen: dict[int, str] = {}
        numbered: list[XmlGpu] = []
        for dev, gpu, node in self.gpus:
            if dev is None:
                continue
            if dev in seen:
                raise self.fail(node, f"two GPUs claim dev={dev} ({seen[dev]} and {gpu.busid})")
            seen[dev] = gpu.busid
            numbered.append(replace(gpu, index=dev))
        unnumbered = sorted((gpu for dev, gpu, _ in self.gpus if dev is None), key=lambda g: g.busid)
        if unnumbered:
            self.warnings.append(
                f"{len(unnumbered)} GPU(s) have no <gpu dev=...> (a hand-written file): numbered in PCI bus "
                "order, as nvidia-smi does"
            )
        first = max(seen, default=-1) + 1
        numbered += [replace(gpu, index=first + i) for i, gpu in enumerate(unnumbered)]
        return tuple(sorted(numbered, key=lambda g: g.index))

    def merged_nics(self) -> tuple[XmlNic, ...]:
        """One entry per device: a socket NIC repeated under every <cpu> is merged into one."""
        merged: dict[tuple[str, str | None], XmlNic] = {}
        for n in self.nics:
            key = (n.card, n.name)
            if key in merged:
                old = merged[key]
                merged[key] = XmlNic(n.name, (*old.cpus, *n.cpus), old.path, n.card, old.speed_mbps, old.gdr)
            else:
                merged[key] = n
        return tuple(merged.values())


def parse_nccl_xml(text: str, source: str = "nccl-topo.xml") -> Topology:
    """NCCL topology XML -> ``Topology`` (GPUs, NICs, link matrix, NVLinks, and link warnings)."""
    system = read_system(text, source)
    return to_topology(system, source)


def to_topology(system: NcclSystem, source: str) -> Topology:
    """The ``Topology`` of a parsed file: the matrix named as nvidia-smi names it (see module docstring)."""
    warnings = list(system.warnings)
    if not system.gpus:
        raise InputError(
            f"{source}: the file lists no GPU", "NCCL dumps the GPUs of the communicator; " + HINT
        )
    nv_pairs, nvlinks = _nvlink_codes(system, warnings)
    gpus = tuple(
        Gpu(
            index=g.index,
            pci_bus_id=_nvml_busid(g.busid),
            cpu_affinity=g.affinity,
            numa_affinity=g.numaid,
            # The link NCCL recorded: sysfs max_link_* (the lower of device and port) up to NCCL 2.29,
            # NVML's current gen/width from 2.30 (xml.cc), which an idle GPU can show lower.
            pcie=PcieLink(gen_max=g.path[-1].gen, width_max=g.path[-1].width) if g.path else None,
        )
        for g in system.gpus
    )
    # Like nvidia-smi, the matrix shows PCI network devices only: a socket NIC (eth0 under <cpu>) is not
    # an RDMA device, and naming it in NCCL_IB_HCA would be wrong.
    pci_nics = [n for n in system.nics if n.path]
    nics = tuple(Nic(f"NIC{i}", n.name) for i, n in enumerate(pci_nics))
    # (cpus, path) of every matrix entry, GPUs first, as the labels are
    ends: list[tuple[tuple[int, ...], tuple[PciHop, ...]]] = [((g.cpu,), g.path) for g in system.gpus] + [
        (n.cpus, n.path) for n in pci_nics
    ]
    labels = tuple([f"GPU{g.index}" for g in system.gpus] + [n.label for n in nics])
    size = len(labels)
    cells: list[list[str | None]] = [[None] * size for _ in range(size)]
    for i in range(size):
        for j in range(size):
            if i == j:
                cells[i][j] = "X"
            elif i < len(system.gpus) and j < len(system.gpus):
                key = (system.gpus[i].index, system.gpus[j].index)
                cells[i][j] = nv_pairs.get(key) or _pci_code(ends[i], ends[j])
            else:
                cells[i][j] = _pci_code(ends[i], ends[j])
    if _crosses_cpu(ends):
        warnings.append(
            "paths through the CPU are shown as PHB: NCCL's XML has no PCIe host-bridge ids, so PHB and NODE "
            "(nvidia-smi's name when two host bridges are crossed) cannot be told apart"
        )
    if any(g.numaid is None for g in system.gpus):
        warnings.append(
            "some <cpu> elements have numaid -1 (usual in VMs): NUMA affinity unknown, SYS may be hidden"
        )
    for n in system.nics:
        if not n.path:
            warnings.append(
                f"{n.name} is a socket NIC without PCI device (NCCL talks TCP through it); like nvidia-smi, "
                "the matrix leaves it out"
            )
    if any(n.name is None for n in system.nics):
        warnings.append(
            "NICs of a hand-written file have no names (NIC Legend unknown); NCCL fills them in at run time"
        )
    warnings.extend(_link_warnings(system))
    n_gpus = len(system.gpus)
    if any(code == "SYS" for row in cells[:n_gpus] for code in row[:n_gpus]):  # GPU pairs across sockets
        note = _socket_note(system.cpus)
        if note:
            warnings.append(note)
    return Topology(
        source=source,
        gpus=gpus,
        nics=nics,
        matrix=Matrix(labels, tuple(tuple(r) for r in cells)),
        warnings=tuple(warnings),
        nvlinks=tuple(nvlinks) if nvlinks else None,
    )


def _crosses_cpu(ends: list) -> bool:
    return any(_pci_code(a, b) == "PHB" for i, a in enumerate(ends) for b in ends[i + 1 :])


def _pci_code(a: tuple, b: tuple) -> str:
    """PIX / PXB / PHB / SYS between two devices from their <cpu> and their chain of <pci> elements."""
    cpus_a, path_a = a
    cpus_b, path_b = b
    if not set(cpus_a) & set(cpus_b):
        return "SYS"
    if not path_a or not path_b:
        return "PHB"
    if path_a[-1].busid == path_b[-1].busid:
        return "PIX"  # two ports (functions) of one card
    sw_a = [h.busid for h in path_a[:-1] if h.is_switch]
    sw_b = [h.busid for h in path_b[:-1] if h.is_switch]
    common = 0
    for x, y in zip(sw_a, sw_b, strict=False):
        if x != y:
            break
        common += 1
    if common == 0:
        return "PHB"
    switches = (len(sw_a) - common) + (len(sw_b) - common) + 1
    return "PIX" if switches == 1 else "PXB"


def _nvlink_codes(
    system: NcclSystem, warnings: list[str]
) -> tuple[dict[tuple[int, int], str], list[NvlinkPeer]]:
    """NV# per GPU pair: direct links by count; through NVSwitch, each GPU's total links (as nvidia-smi)."""
    by_bus = {g.busid: g for g in system.gpus}
    direct: dict[tuple[int, int], int] = {}
    switch_total: dict[int, int] = {}
    for g in system.gpus:
        for target, count, tclass in g.nvlinks:
            if target.startswith("fffffff") or tclass.startswith("0x0680"):
                switch_total[g.index] = switch_total.get(g.index, 0) + count
            elif target == g.busid:
                warnings.append(f"GPU{g.index}: an <nvlink> names the GPU itself as its target; ignored")
            elif target in by_bus:
                peer = by_bus[target].index
                key = (min(g.index, peer), max(g.index, peer))
                direct[key] = max(direct.get(key, 0), count)
            elif count:
                warnings.append(
                    f"GPU{g.index}: {count} NVLink(s) to {target}, which is not a GPU in the file"
                )
    codes: dict[tuple[int, int], str] = {}
    peers: list[NvlinkPeer] = []
    for (a, b), count in direct.items():
        if count:
            codes[(a, b)] = codes[(b, a)] = f"NV{count}"
            peers += [NvlinkPeer(a, b, count), NvlinkPeer(b, a, count)]
    switched = sorted(g for g, total in switch_total.items() if total)
    for i, a in enumerate(switched):
        for b in switched[i + 1 :]:
            if (a, b) not in codes:
                codes[(a, b)] = codes[(b, a)] = f"NV{min(switch_total[a], switch_total[b])}"
    if len({switch_total[g] for g in switched}) > 1:
        shown = ", ".join(f"GPU{g} {switch_total[g]}" for g in switched)
        warnings.append(f"GPUs have different NVSwitch link totals ({shown}): some NVLinks may be down")
    return codes, peers


def _link_warnings(system: NcclSystem) -> list[str]:
    """A PCIe link on a device's way to the CPU that is slower than the device's own link."""
    out: list[str] = []
    seen: dict[str, list[str]] = {}
    hops: dict[str, PciHop] = {}
    own: dict[str, str] = {}
    for label, path in [(f"GPU{g.index}", g.path) for g in system.gpus] + [
        (n.name or n.card, n.path) for n in system.nics
    ]:
        if not path or path[-1].gbps is None:
            continue
        dev = path[-1]
        for hop in path[:-1]:
            if hop.gbps is not None and hop.gbps < dev.gbps:
                seen.setdefault(hop.busid, []).append(f"{label} ({dev.describe()})")
                hops[hop.busid] = hop
        own[label] = dev.describe()
    for busid, below in seen.items():
        hop = hops[busid]
        why = (
            " (an emulated switch in a VM reports this whatever the real link; NCCL still models it so)"
            if (hop.vendor, hop.device) in _EMULATED_SWITCHES
            else ""
        )
        out.append(
            f"PCIe link at {busid} runs {hop.describe()}, below the devices behind it: "
            f"{', '.join(below)}{why}"
        )
    unknown = [f"GPU{g.index}" for g in system.gpus if g.path and g.path[-1].gen is None]
    if unknown:
        out.append(
            f"{', '.join(unknown)}: link speed not recorded (empty link_speed, usual in VMs); NCCL then "
            "assumes Gen3 x16 (12 GB/s)"
        )
    return out


def _socket_note(cpus: tuple[dict[str, str], ...]) -> str | None:
    """NCCL's figure for the link between CPU sockets, from the first <cpu>'s arch, vendor and model.

    NCCL topo.h / topo.cc (ncclTopoGetInterCpuBw): Intel by model class (modelid >= 0xCF Emerald/Granite
    Rapids 40, >= 0x8F Sapphire Rapids 22, >= 0x55 Skylake..Ice Lake 10, older 6), AMD 16, POWER9 32,
    arm64 6 GB/s. The topo -m model assumes 10, so say which figure to give it.
    """
    attrs = cpus[0] if cpus else {}
    arch, vendor = attrs.get("arch"), (attrs.get("vendor") or "").strip()
    try:
        family, model = int(attrs.get("familyid", ""), 0), int(attrs.get("modelid", ""), 0)
    except ValueError:
        family = model = -1
    if arch == "x86_64" and vendor == "GenuineIntel" and family == 6 and model >= 0:
        gbps, what = next(
            (g, w)
            for floor, g, w in (
                (0xCF, 40, "Emerald/Granite Rapids"),
                (0x8F, 22, "Sapphire Rapids"),
                (0x55, 10, "Skylake to Ice Lake"),
                (0, 6, "Broadwell or older"),
            )
            if model >= floor
        )
        cpu = f"Intel model {model} ({what})"
    elif arch == "x86_64" and vendor == "AuthenticAMD":
        gbps, cpu = 16, "AMD"
    elif arch == "ppc64":
        gbps, cpu = 32, "POWER"
    elif arch == "arm64":
        gbps, cpu = 6, "Arm"
    else:
        return None
    return (
        f"CPU: {cpu}; NCCL counts {gbps} GB/s between sockets, so give recommend --socket-gbps {gbps} to "
        "use the same figure"
    )


def _hop(busid: str, attrs: dict[str, str]) -> PciHop:
    speed = attrs.get("link_speed")
    gen = None
    if speed:
        for prefix, g in _GEN_BY_SPEED:
            if speed.strip().startswith(prefix) or speed.strip().startswith(prefix.replace(" GT", ".0 GT")):
                gen = g
                break
    width_text = attrs.get("link_width")
    width: int | None = None
    if width_text is not None and width_text.strip().isdigit():
        width = int(width_text) or 16  # NCCL reads x0 (a VM without sysfs link data) as x16
    return PciHop(
        busid, (attrs.get("class") or "").lower(), speed, gen, width, attrs.get("vendor"), attrs.get("device")
    )


_BUSID_RE = re.compile(r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")


def _busid(text: str | None) -> str | None:
    """NCCL's ``0000:13:00.0`` (lower case), or ``None`` when it is not a PCI address."""
    m = _BUSID_RE.fullmatch((text or "").strip())
    if not m:
        return None
    return f"{int(m.group(1), 16):04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{m.group(4)}"


def _nvml_busid(busid: str) -> str:
    """NVML's form of a bus id: 8-digit domain, upper case (``00000000:3B:00.0``)."""
    domain, bus, rest = busid.split(":")
    return f"{int(domain, 16):08X}:{bus.upper()}:{rest.upper()}"


def _int(node: _Node, name: str, walker: _Walker, lo: int = -(2**31), hi: int = 2**31) -> int | None:
    """An integer attribute (decimal or 0x hex) within [lo, hi]; ``None`` when absent or empty."""
    text = node.attrs.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text.strip(), 0)
    except ValueError:
        raise walker.fail(node, f"<{node.tag} {name}={text!r}> is not a number") from None
    if not lo <= value <= hi:
        raise walker.fail(node, f"<{node.tag} {name}={text!r}> is out of range ({lo} to {hi})")
    return value


def _cpu_list(mask: str | None) -> str | None:
    """The /sys cpumap form (``0000ffff,ff000000``: 32-bit hex words, most significant first) as
    nvidia-smi's CPU list (``24-47``); ``None`` when absent or malformed."""
    if not mask:
        return None
    words = mask.strip().split(",")
    if not all(re.fullmatch(r"[0-9a-fA-F]{1,8}", w) for w in words) or len(words) > 1024:
        return None
    value = int("".join(w.rjust(8, "0") for w in words), 16)
    ranges: list[str] = []
    cpu = 0
    while value >> cpu:
        if value >> cpu & 1:
            start = cpu
            while value >> (cpu + 1) & 1:
                cpu += 1
            ranges.append(str(start) if start == cpu else f"{start}-{cpu}")
        cpu += 1
    return ",".join(ranges) or None


def _num(x: float | None) -> str:
    if x is None:
        return "?"
    return f"{x:.2f}".rstrip("0").rstrip(".") if x < 1 else f"{x:g}"
