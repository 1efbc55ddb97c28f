"""The PCIe path between two devices and what ACS does on it (pure): config-space parsing, the bridges a
pair's peer traffic crosses, and the findings for bridges that redirect it.

Why it matters: with ACS (Access Control Services, PCIe base spec, "ACS Extended Capability", ID 0x000D)
*Request Redirect* or *Completion Redirect* enabled on a bridge, a peer request between two devices below
it is sent up to the root complex instead of across the switch; with the IOMMU translating, the peer
address is then translated as if it were host memory. NCCL's troubleshooting guide ("PCI Access Control
Services (ACS)", https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html) says this
makes GPU Direct slow or hang, and the data-corruption reports that started this project (DataParallel on
two GPUs going to NaN, https://github.com/pytorch/pytorch/issues/84803) trace to it. The Linux kernel
judges a bridge much the same way: ``pci_bridge_has_acs_redir`` in drivers/pci/p2pdma.c refuses P2P
across a bridge whose ACS control has ``PCI_ACS_RR | PCI_ACS_CR | PCI_ACS_EC`` set (EgressCtrl is judged
here only through the bits lspci shows, not as a redirect).

Layout facts used here (PCIe base spec; Linux include/uapi/linux/pci_regs.h):

- Config space: 256 bytes of PCI-compatible space, then extended space up to 4096 bytes. The extended
  capability list starts at 0x100; each header dword is ``ID (bits 15:0) | version (19:16) | next (31:20)``.
- ACS capability: capability register at +4 (16 bits), control register at +6 (16 bits); bits
  SrcValid 0x01, TransBlk 0x02, ReqRedir 0x04, CmpltRedir 0x08, UpstreamFwd 0x10, EgressCtrl 0x20,
  DirectTrans 0x40, named and ordered as ``lspci -vvv`` prints them (``ACSCtl:``).
- sysfs gives a non-root reader only the first 64 bytes of ``config`` (drivers/pci/pci-sysfs.c), and some
  kernels or virtual machines only 256: without the extended space the ACS control cannot be read, which
  is "not checked", never "no redirect".
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gputopo.findings import NOT_DCGM, NOTE, PROBLEM, Finding, Rule

EXT_CAP_START = 0x100
EXT_CONFIG_BYTES = 4096
ACS_CAP_ID = 0x000D
# The ACS control bits in lspci's order and spelling (lspci ls-ecaps.c, cap_acs).
ACS_BITS: tuple[tuple[str, int], ...] = (
    ("SrcValid", 0x01),
    ("TransBlk", 0x02),
    ("ReqRedir", 0x04),
    ("CmpltRedir", 0x08),
    ("UpstreamFwd", 0x10),
    ("EgressCtrl", 0x20),
    ("DirectTrans", 0x40),
)
REDIRECT_BITS = 0x04 | 0x08  # ReqRedir, CmpltRedir
NCCL_ACS_GUIDE = (
    "NCCL troubleshooting guide, 'PCI Access Control Services (ACS)': "
    "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html"
)

NCCL_ACS = "NCCL troubleshooting guide, PCI Access Control Services (ACS)"

# The two rules judged here: rows of the one rule table (health.rules lists them in their place; topology
# sits below health, so the rows live beside their judgement and the table takes them from here).
# fmt: off
RULE_ACS_REDIRECT = Rule(
    "acs_redirect", "pcie", PROBLEM, "config", None, "",
    "ACS ReqRedir+ or CmpltRedir+ on a bridge below a GPU pair's (or GPU-NIC pair's) meeting point: peer "
    "traffic is redirected to the root complex",
    NCCL_ACS, "disable ACS redirection (`setpci -s BDF ECAP_ACS+0x6.w=0000`, or in the BIOS)",
    why=NOT_DCGM,
)
RULE_IOMMU_TRANSLATED = Rule(
    "iommu_translated", "config", NOTE, "config", None, "",
    "intel_iommu=on / amd_iommu=on without iommu=pt: the IOMMU translates device DMA",
    NCCL_ACS, "add iommu=pt to the kernel command line", why=NOT_DCGM,
)
# fmt: on

# What a bridge's ACS reading is.
ACS_REDIRECT = "redirect"
ACS_CLEAN = "clean"  # ACS present, no redirect bit set
ACS_ABSENT = "no ACS"  # the bridge has no ACS capability: nothing to redirect
ACS_NOT_CHECKED = "not checked"


@dataclass(frozen=True)
class AcsReading:
    """One bridge's ACS as read from its ``config``: ``state`` one of the ``ACS_*`` words, ``control``
    the control register (``None`` unless read), ``why`` what kept it from being read."""

    state: str
    control: int | None = None
    offset: int | None = None
    why: str | None = None

    @property
    def lspci(self) -> str | None:
        """The control bits as ``lspci -vvv`` prints them after ``ACSCtl:``."""
        return None if self.control is None else acs_bits_text(self.control)


def acs_bits_text(value: int) -> str:
    """``SrcValid+ TransBlk- ReqRedir+ ...``: every ACS bit with ``+`` or ``-``, lspci's order."""
    return " ".join(f"{name}{'+' if value & bit else '-'}" for name, bit in ACS_BITS)


def parse_acs(config: bytes | None) -> AcsReading:
    """The ACS reading of one device's config space as sysfs gave it (``None``: could not be read)."""
    if config is None:
        return AcsReading(ACS_NOT_CHECKED, why="its config space could not be read")
    if len(config) < EXT_CONFIG_BYTES:
        return AcsReading(
            ACS_NOT_CHECKED,
            why=f"only {len(config)} bytes of its config space are readable (the extended space, where ACS "
            "sits, needs root: run as root)",
        )
    offset = EXT_CAP_START
    seen: set[int] = set()
    while offset and EXT_CAP_START <= offset <= EXT_CONFIG_BYTES - 8 and offset not in seen:
        seen.add(offset)
        (header,) = struct.unpack_from("<I", config, offset)
        if header in (0, 0xFFFFFFFF):
            break
        if header & 0xFFFF == ACS_CAP_ID:
            (control,) = struct.unpack_from("<H", config, offset + 6)
            state = ACS_REDIRECT if control & REDIRECT_BITS else ACS_CLEAN
            return AcsReading(state, control=control, offset=offset)
        offset = (header >> 20) & 0xFFC
    return AcsReading(ACS_ABSENT)


@dataclass(frozen=True)
class Bridge:
    """One bridge on a device's path: its bus id and ACS reading."""

    bdf: str
    acs: AcsReading


@dataclass(frozen=True)
class PciPath:
    """A device's way up to its host bridge: ``host`` (``pci0000:15``), ``bridges`` from the root port
    down to the device's own parent; ``numa_node`` as sysfs says (``None`` unknown, ``-1`` none)."""

    bdf: str
    host: str
    bridges: tuple[Bridge, ...]
    numa_node: int | None = None


@dataclass(frozen=True)
class Endpoint:
    """A device whose pairs are judged: ``label`` (``GPU5``, ``mlx5_0``), nvidia-smi ``index`` for a GPU,
    ``bdf`` in sysfs form (``0000:1b:00.0``)."""

    label: str
    bdf: str
    index: int | None = None
    kind: str = "gpu"


@dataclass(frozen=True)
class PairPath:
    """The PCIe path between two endpoints: ``common`` the lowest shared bridge (or host bridge; ``None``
    when the two sit under different host bridges), ``below`` the bridges under it that peer traffic
    crosses, ``redirect`` those of them that redirect it; ``not_checked`` why it could not be judged."""

    a: Endpoint
    b: Endpoint
    common: str | None = None
    below: tuple[Bridge, ...] = ()
    redirect: tuple[Bridge, ...] = ()
    not_checked: str | None = None

    @property
    def status(self) -> str:
        if self.redirect:
            return ACS_REDIRECT
        return ACS_NOT_CHECKED if self.not_checked else ACS_CLEAN

    @property
    def label(self) -> str:
        return f"{self.a.label}-{self.b.label}"

    def to_json(self) -> dict[str, object]:
        return {
            "a": self.a.label,
            "b": self.b.label,
            "kind": self.b.kind,
            "status": self.status,
            "common": self.common,
            "bridges": [b.bdf for b in self.below],
            "redirect": [{"bridge": b.bdf, "acs_ctl": b.acs.lspci} for b in self.redirect],
            "not_checked": self.not_checked,
        }


def normal_bdf(bus_id: str) -> str:
    """NVML's ``00000000:1B:00.0`` as sysfs names it: ``0000:1b:00.0`` (4-digit domain, lower case)."""
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        domain = parts[0][-4:].rjust(4, "0")
        return f"{domain}:{parts[1]}:{parts[2]}"
    if len(parts) == 2:
        return f"0000:{text}"
    return text


def pair_path(a: Endpoint, b: Endpoint, paths: Mapping[str, PciPath | str]) -> PairPath:
    """Judge the path between ``a`` and ``b``; ``paths`` maps a bdf to its path, or to why it has none."""
    pa, pb = paths.get(a.bdf), paths.get(b.bdf)
    for end, p in ((a, pa), (b, pb)):
        if not isinstance(p, PciPath):
            return PairPath(a, b, not_checked=f"{end.label} ({end.bdf}): {p or 'not found in sysfs'}")
    assert isinstance(pa, PciPath) and isinstance(pb, PciPath)
    shared = 0
    if pa.host == pb.host:
        for x, y in zip(pa.bridges, pb.bridges, strict=False):
            if x.bdf != y.bdf:
                break
            shared += 1
        common: str | None = pa.bridges[shared - 1].bdf if shared else pa.host
    else:
        common = None
    below = pa.bridges[shared:] + pb.bridges[shared:]
    redirect = tuple(br for br in below if br.acs.state == ACS_REDIRECT)
    unread = [br for br in below if br.acs.state == ACS_NOT_CHECKED]
    why = f"bridge {unread[0].bdf}: {unread[0].acs.why}" if unread and not redirect else None
    return PairPath(a, b, common, below, redirect, why)


def all_pairs(
    gpus: Sequence[Endpoint], nics: Sequence[Endpoint], paths: Mapping[str, PciPath | str]
) -> list[PairPath]:
    """Every GPU pair, then every GPU-NIC pair."""
    out = [pair_path(a, b, paths) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
    out += [pair_path(g, n, paths) for g in gpus for n in nics]
    return out


@dataclass(frozen=True)
class PathJudgement:
    """Findings (one per redirecting bridge) and what could not be checked (``(what, why)`` pairs)."""

    findings: tuple[Finding, ...]
    not_checked: tuple[tuple[str, str], ...]
    pairs: tuple[PairPath, ...] = field(default=())


def judge_paths(pairs: Iterable[PairPath]) -> PathJudgement:
    """One problem per bridge that redirects peer traffic, naming the pairs it affects, its bits as lspci
    prints them and the remedy; pairs that could not be read are "not checked" (one line for all)."""
    pairs = tuple(pairs)
    by_bridge: dict[str, tuple[Bridge, list[PairPath]]] = {}
    for p in pairs:
        for br in p.redirect:
            by_bridge.setdefault(br.bdf, (br, []))[1].append(p)
    findings: list[Finding] = []
    for bdf, (br, affected) in sorted(by_bridge.items()):
        # Pairs under one host bridge first: between host bridges the traffic goes up anyway.
        affected.sort(key=lambda p: p.common is None)
        gpu_pairs = [p.label for p in affected if p.b.kind == "gpu"]
        nic_pairs = [p.label for p in affected if p.b.kind != "gpu"]
        named = ", ".join(gpu_pairs[:8]) + (
            f" and {len(gpu_pairs) - 8} more GPU pairs" if len(gpu_pairs) > 8 else ""
        )
        if nic_pairs:
            nic_words = ", ".join(nic_pairs[:4]) + (
                f" and {len(nic_pairs) - 4} more" if len(nic_pairs) > 4 else ""
            )
            named = f"{named}; GPU-NIC {nic_words}" if named else f"GPU-NIC {nic_words}"
        findings.append(
            RULE_ACS_REDIRECT.finding(
                f"PCIe bridge {bdf}",
                f"ACS redirects peer traffic at bridge {bdf} (ACSCtl: {br.acs.lspci}): P2P between {named} "
                "is sent up to the root complex (and through the IOMMU where it translates): slow P2P, "
                "hangs, or silently corrupt data",
                "turn ACS redirect off in the BIOS (the PCIe ACS setting), or until the next boot: "
                f"`sudo setpci -s {bdf} ECAP_ACS+0x6.w=0000` (bare metal only: VMs passing devices through "
                f"need ACS) ({NCCL_ACS_GUIDE})",
            )
        )
    unread = [p for p in pairs if p.not_checked]
    not_checked: list[tuple[str, str]] = []
    if unread:
        not_checked.append(
            (
                f"PCIe ACS on the path of {len(unread)} pair{'s' if len(unread) != 1 else ''}"
                f" ({', '.join(p.label for p in unread[:4])}{', ...' if len(unread) > 4 else ''})",
                unread[0].not_checked or "",
            )
        )
    return PathJudgement(tuple(findings), tuple(not_checked), pairs)


def iommu_mode(cmdline: str | None) -> str | None:
    """What the kernel command line asks of the IOMMU: ``"translated"`` (``intel_iommu=on`` or
    ``amd_iommu=on`` without passthrough), ``"passthrough"`` (``iommu=pt`` or ``iommu.passthrough=1``),
    ``"off"`` (``intel_iommu=off``, ``amd_iommu=off``, ``iommu=off``), ``"default"`` (none of these: the
    kernel's build default), ``None`` when the command line could not be read
    (Documentation/admin-guide/kernel-parameters.txt)."""
    if cmdline is None:
        return None
    words = cmdline.split()
    if "--" in words:
        words = words[: words.index("--")]  # after "--" the words are init's, not the kernel's
    args = {w.split("=", 1)[0]: (w.split("=", 1)[1] if "=" in w else "") for w in words}
    passthrough = args.get("iommu") == "pt" or args.get("iommu.passthrough") in ("1", "y", "on")
    on = any(args.get(k, "").split(",")[0] == "on" for k in ("intel_iommu", "amd_iommu"))
    off = args.get("iommu") == "off" or any(
        args.get(k, "").split(",")[0] == "off" for k in ("intel_iommu", "amd_iommu")
    )
    if passthrough:
        return "passthrough"
    if off:
        return "off"
    if on:
        return "translated"
    return "default"


def iommu_findings(mode: str | None) -> list[Finding]:
    """A note when the kernel command line puts the IOMMU in translation mode."""
    if mode != "translated":
        return []
    return [
        RULE_IOMMU_TRANSLATED.finding(
            "kernel command line",
            "the IOMMU translates device DMA (intel_iommu=on or amd_iommu=on without iommu=pt): GPU peer "
            "traffic the ACS sends up to the root complex is translated as if it were host memory, and "
            "GPUDirect RDMA pays a translation on every access",
            "add `iommu=pt` to the kernel command line (GRUB_CMDLINE_LINUX, then update-grub and reboot) "
            f"unless the node passes devices through to VMs ({NCCL_ACS_GUIDE})",
        )
    ]


def redirected_pairs(pairs: Iterable[PairPath]) -> dict[frozenset[int], tuple[str, ...]]:
    """GPU pairs (by nvidia-smi index) whose path crosses a redirecting bridge -> those bridges."""
    out: dict[frozenset[int], tuple[str, ...]] = {}
    for p in pairs:
        if p.redirect and p.a.index is not None and p.b.index is not None and p.b.kind == "gpu":
            out[frozenset((p.a.index, p.b.index))] = tuple(br.bdf for br in p.redirect)
    return out
