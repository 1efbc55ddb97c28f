"""The node's network ports, judged (pure): two readings of every InfiniBand/RoCE port and Ethernet
interface -> findings in category ``network``, naming the device, the port and the GPUs behind it.

The rules and their limits follow NVSentinel's NIC health monitor (NVIDIA/NVSentinel, design documents
``docs/nic-health-monitor/link-counter-detection.md`` and ``link-state-detection.md``):

- a rise of ``link_downed``, ``excessive_buffer_overrun_errors`` or ``local_link_integrity_errors`` between
  two readings is fatal there (the link retrained, or the lossless contract was broken: NCCL's connections
  over the port fail): a problem here;
- ``symbol_error`` faster than 10 per second is its non-fatal degradation threshold (PAM4 links at HDR/NDR
  always see some raw bit errors, so "any rise" would alarm forever): a problem here. NVSentinel computes a
  rate only over at least its window; a reading shorter than 1 s is counted as 1 s here, so one stray
  error in a 0-second check is never "1000/s";
- a port that is not ACTIVE/LinkUp (DOWN, Polling, Disabled) while other ports of its kind (same link layer
  and NIC model) are ACTIVE: its "card homogeneity" rule, fatal there, a problem here; a port with no GPU on
  its NUMA node or PCIe switch (a management or storage port) only gets a note;
- ``carrier_changes`` (Ethernet) rising more than 2 in the interval: its link-flap threshold;
- a port slower than the others of its kind (200 among 400 Gb/s): its link speed degradation rule.

The readings come from ``system/ports.py`` (sysfs, Documentation/ABI/stable/sysfs-class-infiniband and
Documentation/ABI/testing/sysfs-class-net).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gputopo.findings import NOTE, PROBLEM, Finding
from gputopo.health.rules import (
    DEFAULT_THRESHOLDS,
    NVSENTINEL,
    NVSENTINEL_STATE,
    Rule,
    Thresholds,
)
from gputopo.health.rules import RULES as ALL_RULES
from gputopo.topology.pcie_path import PciPath, normal_bdf

# Counters whose any rise is fatal in NVSentinel's table.
FATAL_COUNTERS = ("link_downed", "excessive_buffer_overrun_errors", "local_link_integrity_errors")
# What the reader reads (only these: each counters/ read is a firmware query on InfiniBand adapters).
COUNTERS = (*FATAL_COUNTERS, "symbol_error", "link_error_recovery", "port_rcv_errors")
# hw_counters/ (mlx5): rnr_nak_retry_err is fatal in NVSentinel's table (the connection is severed).
HW_COUNTERS = ("rnr_nak_retry_err", "local_ack_timeout_err", "roce_slow_restart")
MIN_RATE_WINDOW_S = 1.0

IB, ETH = "ib", "eth"


# The network and PCIe-path rules: rows of the one rule table (``health.rules.RULES``), which
# ``check --list-rules`` prints and docs/health-rules.md's reference is generated from; ``--thresholds``
# overrides them as it does the GPU rules (judge_ports, since_last_run and apply_overrides take the table).
NET_RULE_NAMES = (
    "port_link_downed",
    "port_buffer_overrun",
    "port_link_integrity",
    "port_rnr_nak_retry",
    "port_symbol_errors",
    "port_symbol_errors_since_last",
    "port_carrier_flaps",
    "port_down",
    "port_slow",
    "gpudirect_off",
    "acs_redirect",
    "iommu_translated",
)
RULES: tuple[Rule, ...] = tuple(ALL_RULES[name] for name in NET_RULE_NAMES)


def apply_overrides(findings: Sequence[Finding], thresholds: Thresholds) -> list[Finding]:
    """The network and path findings with ``--thresholds`` applied: a disabled rule's findings dropped,
    and a rule whose severity or action the file sets gets it (a rule left alone keeps each finding's own,
    e.g. a management port's note)."""
    out: list[Finding] = []
    for f in findings:
        if f.rule not in NET_RULE_NAMES:
            out.append(f)
            continue
        rule, default = thresholds[f.rule], ALL_RULES[f.rule]
        if not rule.enabled:
            continue
        if rule.severity != default.severity:
            f = replace(f, severity=rule.severity)
        if rule.action != default.action:
            f = replace(f, action=rule.action)
        out.append(f)
    return out


@dataclass(frozen=True)
class PortReading:
    """One port as sysfs shows it. ``kind`` ``ib`` (an RDMA port: InfiniBand or RoCE) or ``eth`` (a network
    interface that is not an RDMA device's); ``name`` ``mlx5_0:1`` or ``eth0``; ``state`` and
    ``phys_state`` as sysfs spells them (``4: ACTIVE``, ``5: LinkUp``; Ethernet: ``operstate`` in
    ``state``); ``rate_gbps`` the link rate (``None`` unknown or down); ``counters`` every readable
    counter (``counters/*``, ``hw_counters/*`` prefixed ``hw_``, Ethernet ``carrier_changes``);
    ``pci_bus_id`` the PCI function behind it, ``model`` its ``vendor:device``, ``numa_node`` its NUMA
    node (-1: the platform gives none); ``gpus`` the nvidia-smi indices on its PCIe switch (its rail)."""

    kind: str
    name: str
    device: str
    port: str | None
    state: str | None
    phys_state: str | None = None
    rate_gbps: float | None = None
    link_layer: str | None = None
    counters: Mapping[str, int] = field(default_factory=dict)
    pci_bus_id: str | None = None
    model: str | None = None
    numa_node: int | None = None
    netdev: str | None = None

    @property
    def active(self) -> bool:
        """Up and passing traffic: ACTIVE and LinkUp (IB), ``up`` (Ethernet)."""
        if self.kind == ETH:
            return (self.state or "").lower() == "up"
        return _word(self.state) == "ACTIVE" and _word(self.phys_state) in ("LINKUP", None)

    @property
    def group(self) -> tuple[str, str | None, str | None]:
        """Ports judged against each other: same kind, link layer and NIC model."""
        return (self.kind, self.link_layer, self.model)

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "name": self.name,
            "state": self.state,
            "phys_state": self.phys_state,
            "rate_gbps": self.rate_gbps,
            "link_layer": self.link_layer,
            "pci_bus_id": self.pci_bus_id,
            "numa_node": self.numa_node,
            "netdev": self.netdev,
        }


@dataclass(frozen=True)
class PortSample:
    """Every port at one moment (``taken_s``: ``time.monotonic()``)."""

    ports: tuple[PortReading, ...]
    taken_s: float


def _word(state: str | None) -> str | None:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``; ``"5: LinkUp"`` -> ``"LINKUP"``."""
    if state is None:
        return None
    return state.split(":", 1)[-1].strip().upper().replace(" ", "")


def parse_rate_gbps(text: str | None) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0; ``None`` when absent or not a rate."""
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", text or "")
    return float(m.group(1)) if m else None


def parse_speed_gbps(text: str | None) -> float | None:
    """Ethernet ``speed`` (Mb/s; ``-1`` or unreadable when down) in Gb/s."""
    try:
        mbps = int((text or "").strip())
    except ValueError:
        return None
    return mbps / 1000 if mbps > 0 else None


@dataclass(frozen=True)
class Rail:
    """Which GPUs sit behind a port: ``switch`` those sharing a PCIe bridge with it, ``numa`` those on its
    NUMA node."""

    switch: tuple[int, ...] = ()
    numa: tuple[int, ...] = ()

    @property
    def gpus(self) -> tuple[int, ...]:
        return self.switch or self.numa

    def words(self) -> str:
        if self.switch:
            return f"GPUs behind it (same PCIe switch): {_gpus(self.switch)}"
        if self.numa:
            return f"GPUs on its NUMA node: {_gpus(self.numa)}"
        return "no GPU on its PCIe switch or NUMA node"


def rails(
    ports: Sequence[PortReading], paths: Mapping[str, PciPath | str], gpus: Mapping[int, str]
) -> dict[str, Rail]:
    """The GPUs behind each port: those whose PCIe path shares a bridge with the port's (its switch or
    root port: nvidia-smi's PIX/PXB), and those on its NUMA node. ``paths`` is keyed by sysfs bdf,
    ``gpus`` maps an nvidia-smi index to its bus id."""
    out: dict[str, Rail] = {}
    gpu_paths = {i: paths.get(normal_bdf(bus)) for i, bus in gpus.items()}
    for p in ports:
        pp = paths.get(p.pci_bus_id or "")
        switch: list[int] = []
        numa: list[int] = []
        for i, gp in sorted(gpu_paths.items()):
            if not isinstance(gp, PciPath):
                continue
            shares = isinstance(pp, PciPath) and pp.host == gp.host and pp.bridges and gp.bridges
            if shares and pp.bridges[0].bdf == gp.bridges[0].bdf:  # type: ignore[union-attr]
                switch.append(i)
            if p.numa_node is not None and gp.numa_node == p.numa_node:
                numa.append(i)
        out[p.name] = Rail(tuple(switch), tuple(numa))
    return out


def _gpus(indices: Sequence[int]) -> str:
    return ", ".join(f"GPU{i}" for i in indices)


def judge_ports(
    first: PortSample,
    second: PortSample,
    rails: Mapping[str, Rail] | None = None,
    gpus_located: bool = True,
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> list[Finding]:
    """Findings for the ports: counters that rose between ``first`` and ``second``, ports down while their
    peers are up, ports slower than their peers. ``rails`` maps a port name to the GPUs behind it;
    ``gpus_located`` says whether any GPU was found in sysfs (if none was, no port can be called a
    management port for having no GPU near it); ``thresholds`` the rule table in force (``--thresholds``)."""
    rails = rails or {}
    window_s = max(second.taken_s - first.taken_s, 0.0)
    before = {p.name: p for p in first.ports}
    out: list[Finding] = []
    groups: dict[tuple[str, str | None, str | None], list[PortReading]] = {}
    for p in second.ports:
        groups.setdefault(p.group, []).append(p)
    for p in second.ports:
        rail = rails.get(p.name, Rail())
        management = gpus_located and p.numa_node is not None and not rail.gpus
        out += _state(p, groups[p.group], rail, management)
        out += _slower(p, groups[p.group], rail, management)
        old = before.get(p.name)
        if old is not None:
            out += _counters(old, p, window_s, rail, thresholds)
    out = apply_overrides(out, thresholds)
    out.sort(key=lambda f: f.severity != PROBLEM)
    return out


def _finding(
    rule: str,
    p: PortReading,
    what: str,
    remedy: str,
    rail: Rail,
    severity: str = PROBLEM,
    action: str | None = None,
) -> Finding:
    """The port rule's finding (its defaults: ``--thresholds`` is applied by ``apply_overrides``); a note
    (a port no GPU uses, or none of its kind up) is only watched."""
    return ALL_RULES[rule].finding(
        p.name,
        f"{_port_words(p)}: {what}; {rail.words()}",
        remedy,
        severity=severity,
        action=action if severity == PROBLEM else "monitor",
    )


def _port_words(p: PortReading) -> str:
    if p.kind == ETH:
        return f"network interface {p.name}"
    layer = "RoCE" if (p.link_layer or "").lower() == "ethernet" else "InfiniBand"
    return f"{layer} port {p.name}" + (f" ({p.netdev})" if p.netdev else "")


def _cable_remedy(p: PortReading) -> str:
    if p.kind == ETH:
        return f"check the cable and transceiver of {p.name} (`ethtool {p.name}`, `ip -s link show {p.name}`)"
    dev, port = p.device, p.port or "1"
    return (
        f"check the cable and transceiver (`mlxlink -d {dev} -p {port}`, `ibstat {dev} {port}`); reseat or "
        "replace them; drain the node while the jobs on it use this port"
    )


def _state(p: PortReading, peers: Sequence[PortReading], rail: Rail, management: bool) -> list[Finding]:
    if p.active:
        return []
    up = [q for q in peers if q is not p and q.active]
    shown = p.state if p.kind == ETH else f"{p.state or '?'}, {p.phys_state or '?'}"
    if not up:
        return [
            _finding(
                "port_down",
                p,
                f"not up ({shown}) and no other port of its kind is up: unused or not cabled",
                "nothing to do if the port is not meant to be used; otherwise check its cable",
                rail,
                severity=NOTE,
            )
        ]
    down = (
        p.kind == ETH or _word(p.state) == "DOWN" or _word(p.phys_state) in ("POLLING", "DISABLED", "SLEEP")
    )
    what = f"{'down' if down else 'not active'} ({shown}) while {len(up)} other port(s) of its kind are up"
    if management:
        return [
            _finding(
                "port_down",
                p,
                what + " (no GPU uses it: a management or storage port)",
                _cable_remedy(p),
                rail,
                NOTE,
            )
        ]
    if not down:  # INIT / ARMED: waiting for the subnet manager
        return [
            _finding(
                "port_down",
                p,
                what + ": waiting for the subnet manager",
                "check that a subnet manager runs on the fabric (`sminfo`) and sees this port",
                rail,
                action="config",
            )
        ]
    return [
        _finding(
            "port_down",
            p,
            what + ": NCCL's traffic for these GPUs crosses the node to another NIC, or the job fails",
            _cable_remedy(p) + f" ({NVSENTINEL_STATE})",
            rail,
        )
    ]


def _slower(p: PortReading, peers: Sequence[PortReading], rail: Rail, management: bool) -> list[Finding]:
    if not p.active or p.rate_gbps is None:
        return []
    rates = [q.rate_gbps for q in peers if q.active and q.rate_gbps is not None]
    if len(rates) < 2:
        return []
    top = max(rates)
    if p.rate_gbps >= top:
        return []
    common = Counter(rates).most_common(1)[0][0]
    what = (
        f"runs at {p.rate_gbps:g} Gb/s while other ports of its kind run at {top:g} Gb/s "
        f"(most at {common:g}): a link trained down, and every ring through it runs at its speed"
    )
    return [
        _finding(
            "port_slow",
            p,
            what,
            _cable_remedy(p) + f" ({NVSENTINEL_STATE})",
            rail,
            NOTE if management else PROBLEM,
        )
    ]


# The rule of each counter whose any rise is a problem.
_RISE_RULES = {
    "link_downed": "port_link_downed",
    "excessive_buffer_overrun_errors": "port_buffer_overrun",
    "local_link_integrity_errors": "port_link_integrity",
    "hw_rnr_nak_retry_err": "port_rnr_nak_retry",
}


def _counters(
    old: PortReading,
    new: PortReading,
    window_s: float,
    rail: Rail,
    thresholds: Thresholds,
    since_last: bool = False,
) -> list[Finding]:
    out: list[Finding] = []
    symbol_rule = "port_symbol_errors_since_last" if since_last else "port_symbol_errors"
    symbol_per_s = thresholds.limit(symbol_rule) / (3600 if since_last else 1)
    window = f"{window_s:.1f} s" if window_s < 120 else f"{window_s / 60:.0f} min"

    def rise(name: str) -> int | None:
        a, b = old.counters.get(name), new.counters.get(name)
        if a is None or b is None or b < a:  # not read, or reset between the readings
            return None
        return b - a

    for name, rule in _RISE_RULES.items():
        d = rise(name)
        if d and d > thresholds.limit(rule):
            limit = thresholds.limit(rule)
            any_rise = f"{NVSENTINEL}: any rise is fatal" if limit == 0 else f"--thresholds: above {limit:g}"
            out.append(
                _finding(
                    rule,
                    new,
                    f"{name} rose by {d} in {window} (now {new.counters[name]})",
                    _cable_remedy(new) + f" ({any_rise})",
                    rail,
                )
            )
    d = rise("symbol_error")
    if d:
        per_s = d / max(window_s, MIN_RATE_WINDOW_S)
        if per_s > symbol_per_s:
            limit = f"{symbol_per_s:g}/s" if symbol_per_s >= 1 else f"{symbol_per_s * 3600:g}/hour"
            rate = f"{per_s:.0f}/s" if symbol_per_s >= 1 else f"{per_s * 3600:.0f}/hour"
            out.append(
                _finding(
                    symbol_rule,
                    new,
                    f"symbol_error rose by {d} in {window} ({rate}, above {limit}): the link is degrading "
                    "before its error correction gives out",
                    _cable_remedy(new) + f" ({NVSENTINEL}: symbol_error above {limit})",
                    rail,
                )
            )
    d = rise("carrier_changes")
    flaps = thresholds.limit("port_carrier_flaps")
    if d and d > flaps and not since_last:
        out.append(
            _finding(
                "port_carrier_flaps",
                new,
                f"the link flapped: carrier_changes rose by {d} in {window}",
                _cable_remedy(new) + f" ({NVSENTINEL}: carrier_changes above {flaps:g} per interval)",
                rail,
            )
        )
    return out


# Since the last check (the unattended check's state file): the IBTA's limit NVSentinel calls fatal, 120
# symbol errors an hour (a bit error rate of 1e-12, rule port_symbol_errors_since_last), instead of the
# short window's 10/s; the link-flap threshold is per sampling interval, so it is not judged over the long
# window.
MIN_SINCE_LAST_S = 60.0


def port_counters(sample: PortSample | None) -> dict[str, dict[str, int]]:
    """Every port's counters as the check's state file keeps them."""
    return {p.name: dict(p.counters) for p in (sample.ports if sample else ()) if p.counters}


def since_last_run(
    saved: Mapping[str, Any],
    saved_at: float | None,
    now: PortSample,
    now_s: float,
    rails: Mapping[str, Rail] | None = None,
    window: Sequence[Finding] = (),
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> list[Finding]:
    """The counter rules judged again over the time since the last check (``saved`` counters by port,
    taken at ``saved_at``, epoch seconds; ``now_s`` now): a climb too slow for the check's own window is
    seen over minutes. What the window already found (same rule, same port) is not said twice."""
    if saved_at is None or not saved:
        return []
    elapsed = now_s - saved_at
    if elapsed < MIN_SINCE_LAST_S:
        return []
    seen = {(f.rule, f.where) for f in window}
    out: list[Finding] = []
    for p in now.ports:
        old = saved.get(p.name)
        if not isinstance(old, Mapping):
            continue
        counters = {k: v for k, v in old.items() if isinstance(v, int) and not isinstance(v, bool)}
        before = PortReading(p.kind, p.name, p.device, p.port, p.state, counters=counters)
        found = _counters(
            before,
            p,
            elapsed,
            (rails or {}).get(p.name, Rail()),
            thresholds,
            since_last=True,
        )
        for f in apply_overrides(found, thresholds):
            if (f.rule, f.where) in seen or (
                f.rule == "port_symbol_errors_since_last" and ("port_symbol_errors", f.where) in seen
            ):
                continue
            out.append(replace(f, what=f"{f.what} [since the last check, {elapsed / 60:.0f} min ago]"))
    return out


def gdr_mode(
    has_rdma: bool, peermem: bool, nv_mem: bool, open_module: bool | None, kernel: tuple[int, int] | None
) -> str | None:
    """How GPUDirect RDMA can register GPU memory here: ``"nvidia_peermem"`` (the driver's module loaded),
    ``"nv_peer_mem"`` (MLNX_OFED's older module: ``/sys/kernel/mm/memory_peers/nv_mem``), ``"dmabuf"`` (no
    module, but the open GPU kernel module on Linux 5.12 or later: NCCL registers through DMA-BUF),
    ``"none"``; ``None`` when there is no RDMA port (nothing to ask). The DMA-BUF requirements are the GPU
    Operator's ("GPUDirect RDMA and GPUDirect Storage": open kernel modules, Linux 5.12+)."""
    if not has_rdma:
        return None
    if peermem:
        return "nvidia_peermem"
    if nv_mem:
        return "nv_peer_mem"
    if open_module and kernel is not None and kernel >= (5, 12):
        return "dmabuf"
    return "none"


def gdr_findings(mode: str | None, rdma_ports: int) -> list[Finding]:
    """A note when the node has RDMA ports and no way for them to reach GPU memory directly."""
    if mode != "none":
        return []
    return [
        ALL_RULES["gpudirect_off"].finding(
            "GPUDirect RDMA",
            f"{rdma_ports} RDMA port(s) but GPUDirect RDMA is off: no nvidia_peermem in /proc/modules, no "
            "/sys/kernel/mm/memory_peers/nv_mem, and no DMA-BUF path (it needs the open GPU kernel module "
            "and Linux 5.12+): every inter-node transfer is staged through host memory, which costs "
            "bandwidth and latency (NCCL falls back without saying so unless NCCL_DEBUG=INFO)",
            "`sudo modprobe nvidia-peermem` (and load it at boot), or use the open GPU kernel module on "
            "Linux 5.12+ for DMA-BUF; then `NCCL_DEBUG=INFO` shows `GPU Direct RDMA Enabled`",
        )
    ]


def network_facts(ports: Sequence[PortReading], mode: str | None) -> dict[str, object]:
    """What a baseline and a run record keep about the network: GPUDirect mode, NIC count, rates."""
    rdma = [p for p in ports if p.kind == IB]
    return {
        "gdr": mode,
        "rdma_ports": len(rdma),
        "rates_gbps": sorted((p.rate_gbps for p in rdma if p.rate_gbps is not None), reverse=True),
        "ports": {p.name: p.rate_gbps for p in ports if p.kind == IB},
    }


def network_changes(saved: Any, now: Mapping[str, Any] | None) -> list[Finding]:
    """What changed in the network facts since the baseline (``network_facts`` of both): a port gone or
    slower is a problem; GPUDirect RDMA or the IOMMU mode changed is a note (a node that differs from its
    siblings in either runs NCCL differently). A baseline without network facts (older) compares nothing."""
    if not isinstance(saved, Mapping) or now is None:
        return []
    out: list[Finding] = []
    old_ports = saved.get("ports") if isinstance(saved.get("ports"), Mapping) else {}
    new_ports = now.get("ports") or {}
    for name, rate in sorted(old_ports.items()):
        if name not in new_ports:
            out.append(
                Finding(
                    name,
                    f"RDMA port {name} is in the baseline but not on this node",
                    "check `ibstat` and the NIC's driver (`dmesg | grep mlx5`); a missing rail slows every "
                    "inter-node job",
                    category="network",
                    action="drain",
                )
            )
        elif (
            isinstance(rate, (int, float))
            and isinstance(new_ports[name], (int, float))
            and new_ports[name] < rate
        ):
            out.append(
                Finding(
                    name,
                    f"RDMA port {name} runs at {new_ports[name]:g} Gb/s, the baseline has {rate:g} Gb/s",
                    "check the cable and transceiver (`mlxlink`); reseat or replace them",
                    category="network",
                    action="replace",
                )
            )
    for key, words in (("gdr", "GPUDirect RDMA"), ("iommu", "the IOMMU mode")):
        if key in saved and saved.get(key) != now.get(key):
            out.append(
                Finding(
                    "GPUDirect RDMA" if key == "gdr" else "kernel command line",
                    f"{words} is {now.get(key)} here, the baseline has {saved.get(key)}",
                    "make the node match its siblings (nvidia-peermem loaded at boot, the same kernel "
                    "command line), or save a new baseline if the change is meant",
                    severity=NOTE,
                    category="network" if key == "gdr" else "config",
                    action="config",
                )
            )
    return out
