"""The other half of the node: its network ports, GPUDirect RDMA, and the PCIe path between its GPUs
(ACS, IOMMU). Reads through ``system/`` (sysfs and procfs, re-rootable with ``GPUTOPO_SYSFS_ROOT`` and
``GPUTOPO_PROCFS_ROOT``) and judges with the pure ``health.network`` and ``topology.pcie_path``.

``check`` takes the first port reading before its NVML samples (``start``) and the second after them
(``finish``), so the counters' rise spans the check's own sampling window; ``topo``, ``recommend`` and
``doctor`` ask for the path table alone (``read_pairs``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gputopo.findings import Finding
from gputopo.health.network import (
    IB,
    PortSample,
    Rail,
    apply_overrides,
    gdr_findings,
    judge_ports,
    network_facts,
    rails,
)
from gputopo.health.rules import DEFAULT_THRESHOLDS, Thresholds
from gputopo.system.pci_path import read_paths
from gputopo.system.ports import read_cmdline, read_gdr_mode, read_ports
from gputopo.system.sysfs import FsView, view
from gputopo.topology.pcie_path import (
    Endpoint,
    PairPath,
    PciPath,
    all_pairs,
    iommu_findings,
    iommu_mode,
    judge_paths,
    normal_bdf,
    redirected_pairs,
)


@dataclass(frozen=True)
class Started:
    """The first port reading, and the view it was read through."""

    fs: FsView
    ports: PortSample


@dataclass(frozen=True)
class FabricResult:
    """Findings (network and PCIe path), what could not be checked (``(what, why)``), the pair table, the
    second port reading, and the GPUDirect and IOMMU modes."""

    findings: tuple[Finding, ...] = ()
    not_checked: tuple[tuple[str, str], ...] = ()
    pairs: tuple[PairPath, ...] = ()
    ports: PortSample | None = None
    gdr: str | None = None
    iommu: str | None = None
    facts: Mapping[str, Any] = field(default_factory=dict)
    rails: Mapping[str, Rail] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.facts,
            "ports": [
                {**p.to_json(), "gpus": list(self.rails[p.name].gpus if p.name in self.rails else ())}
                for p in (self.ports.ports if self.ports else ())
            ],
            "pairs": [p.to_json() for p in self.pairs],
        }


def start(fs: FsView | None = None) -> Started:
    """Read every port once (the first of check's two readings)."""
    fs = fs or view()
    return Started(fs, read_ports(fs))


def finish(
    started: Started, gpus: Mapping[int, str], thresholds: Thresholds = DEFAULT_THRESHOLDS
) -> FabricResult:
    """Read the ports again and the PCIe paths of ``gpus`` (nvidia-smi index -> bus id), and judge it all
    with the rule table in force (``--thresholds``)."""
    fs = started.fs
    second = read_ports(fs)
    nics = _nic_endpoints(second)
    paths = read_paths([*gpus.values(), *(n.bdf for n in nics)], fs)
    behind = rails(second.ports, paths, gpus)
    located = any(isinstance(paths.get(normal_bdf(bus)), PciPath) for bus in gpus.values())
    findings = judge_ports(started.ports, second, behind, located, thresholds)
    judged = judge_paths(all_pairs(_gpu_endpoints(gpus), nics, paths))
    rdma = [p for p in second.ports if p.kind == IB]
    mode = read_gdr_mode(bool(rdma), fs)
    iommu = iommu_mode(read_cmdline(fs))
    findings += apply_overrides(
        [*judged.findings, *gdr_findings(mode, len(rdma)), *iommu_findings(iommu)], thresholds
    )
    not_checked = list(judged.not_checked)
    if len(gpus) > 1 and not judged.pairs:
        not_checked.append(("PCIe ACS on the GPU pairs' paths", "no GPU pair to check"))
    facts = {**network_facts(second.ports, mode), "iommu": iommu}
    return FabricResult(
        tuple(findings),
        tuple(not_checked),
        judged.pairs,
        second,
        mode,
        iommu,
        facts,
        behind,
    )


def read_pairs(gpus: Mapping[int, str], fs: FsView | None = None) -> tuple[PairPath, ...]:
    """The PCIe path table of every GPU pair (no ports judged, no counters read twice)."""
    fs = fs or view()
    paths = read_paths(list(gpus.values()), fs)
    return tuple(all_pairs(_gpu_endpoints(gpus), (), paths))


def _gpu_endpoints(gpus: Mapping[int, str]) -> list[Endpoint]:
    return [Endpoint(f"GPU{i}", normal_bdf(bus), i, "gpu") for i, bus in sorted(gpus.items())]


def _nic_endpoints(sample: PortSample) -> list[Endpoint]:
    seen: dict[str, Endpoint] = {}
    for p in sample.ports:
        if p.kind == IB and p.pci_bus_id and p.pci_bus_id not in seen:
            seen[p.pci_bus_id] = Endpoint(p.device, p.pci_bus_id, None, "nic")
    return list(seen.values())


def gpu_bus_ids(items: Sequence[tuple[int, str | None]]) -> dict[int, str]:
    """``{index: bus id}`` of the GPUs whose bus id is known."""
    return {i: bus for i, bus in items if bus}


def snapshot(gpus: Mapping[int, str], fs: FsView | None = None) -> FabricResult:
    """One reading for ``topo``: the ports (their state and rate judged against their peers; no counter
    rise, which needs two readings), GPUDirect and IOMMU, and every GPU pair's and GPU-NIC pair's path."""
    fs = fs or view()
    return finish(Started(fs, read_ports(fs)), gpus)


def redirected(
    gpus: Mapping[int, str], fs: FsView | None = None
) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """GPU pairs whose PCIe path crosses an ACS-redirecting bridge, with those bridges, for recommend."""
    return redirected_in(read_pairs(gpus, fs))


def redirected_in(pairs: Sequence[PairPath]) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """The GPU pairs of a path table already read (``read_pairs``, or check's ``finish``) whose path
    crosses an ACS-redirecting bridge, with those bridges: ``(lower index, higher index, bridges)``."""
    found = redirected_pairs(pairs)
    return tuple(
        (min(k), max(k), bridges) for k, bridges in sorted(found.items(), key=lambda kv: sorted(kv[0]))
    )


def since_last_run(
    result: FabricResult,
    saved: Mapping[str, Any],
    saved_at: float | None,
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> list[Finding]:
    """The ports' counter rules over the time since the last check (its state file's counters)."""
    import time

    from gputopo.health.network import since_last_run as judge_since

    if result.ports is None:
        return []
    return judge_since(saved, saved_at, result.ports, time.time(), result.rails, result.findings, thresholds)
