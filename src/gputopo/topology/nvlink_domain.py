"""The NVLink domain a node's GPUs belong to (pure): GB200/GB300 NVL72 racks are 18 compute trays joined by
NVLink switch trays into one domain, and NCCL runs collectives across trays over it (multi-node NVLink).

A domain is named ``<clusterUuid>.<cliqueId>``, the form of NVIDIA's GPU feature discovery label
``nvidia.com/gpu.clique``, never by the clique alone: every GB300 rack reports the sentinel clique 32766, so
the clique alone merges unrelated racks. A zero cluster UUID or clique 0 with a completed registration is
not multi-node NVLink (an HGX B200 or H100 board behind its own NVSwitches), not a fault.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gputopo.model import GpuFabric

ZERO_UUID = "00000000-0000-0000-0000-000000000000"

# NVML_GPU_FABRIC_STATE_* and NVML_GPU_FABRIC_HEALTH_SUMMARY_* (nvml.h), in words.
FABRIC_STATE_WORDS = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
COMPLETED = "completed"
SUMMARY_WORDS = {1: "healthy", 2: "unhealthy", 3: "limited capacity"}  # 0: not supported


def domain_id(cluster_uuid: str | None, clique_id: int | None) -> str | None:
    """``<clusterUuid>.<cliqueId>``, or ``None`` when the pair names no multi-node domain (a zero or
    unknown UUID, clique 0 or unknown)."""
    if not cluster_uuid or cluster_uuid == ZERO_UUID or not clique_id:
        return None
    return f"{cluster_uuid}.{clique_id}"


def clique_label(gpus: Iterable[tuple[bool, int | None, str | None, int | None]]) -> str | None:
    """The value GPU feature discovery gives the node label ``nvidia.com/gpu.clique``, or ``None`` where it
    sets none, for ``(registration completed, its status, cluster UUID, clique id)`` per GPU. As
    NVIDIA/k8s-device-plugin forms it (internal/lm/imex.go ``newImexLabeler``/``getFabricIDs``, with
    go-nvlib's ``IsFabricAttached``): a GPU counts only when its fabric registration completed, its status
    is success and its cluster UUID is not all zeros; the label is ``<clusterUUID>.<cliqueID>`` (the UUID
    lower case 8-4-4-4-12, the clique in decimal, clique 0 included), and there is none when the counted
    GPUs disagree on either (GFD only warns "non-unique") or none counts."""
    uuids: set[str] = set()
    cliques: set[int] = set()
    for completed, status, cluster_uuid, clique_id in gpus:
        if not completed or status not in (0, None) or not cluster_uuid or cluster_uuid == ZERO_UUID:
            continue
        if clique_id is None:
            return None
        uuids.add(cluster_uuid.lower())
        cliques.add(clique_id)
    if len(uuids) != 1 or len(cliques) != 1:
        return None
    return f"{next(iter(uuids))}.{next(iter(cliques))}"


def fabric_clique_label(fabrics: Sequence[GpuFabric | None]) -> str | None:
    """``clique_label`` of the GPUs' fabric as the inventory reads it (``topo --json``'s ``gpu_clique``)."""
    return clique_label(
        (f.state == COMPLETED, f.status, f.cluster_uuid, f.clique_id) for f in fabrics if f is not None
    )


def gpu_domain(f: GpuFabric | None) -> str | None:
    """The domain of a GPU whose registration completed without error; ``None`` otherwise."""
    if f is None or f.state != COMPLETED or f.status not in (0, None):
        return None
    return domain_id(f.cluster_uuid, f.clique_id)


def in_rack(f: GpuFabric | None) -> bool:
    """Whether the platform places the GPU in a rack: a chassis serial and a tray index (an HGX board has
    neither, though it says "switch connected")."""
    return f is not None and bool(f.chassis_serial) and f.tray_index is not None


@dataclass(frozen=True)
class NvlinkDomain:
    """The node's NVLink domain as ``topo --json`` carries it (top-level ``nvlink_domain``)."""

    id: str
    cluster_uuid: str
    clique_id: int
    chassis_serial: str | None
    tray_index: int | None
    slot: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "cluster_uuid": self.cluster_uuid,
            "clique_id": self.clique_id,
            "chassis_serial": self.chassis_serial,
            "tray_index": self.tray_index,
            "slot": self.slot,
        }


def node_domain(fabrics: Sequence[GpuFabric | None]) -> NvlinkDomain | None:
    """The domain of most of the node's GPUs (the lowest GPU's among equals); ``None`` when none is in
    one. GPUs of one tray that disagree are ``check``'s problem (``fabric_domain_split``), not hidden here."""
    domains = [(gpu_domain(f), f) for f in fabrics]
    counts = Counter(d for d, _ in domains if d is not None)
    if not counts:
        return None
    top = max(counts.values())
    chosen, f = next((d, f) for d, f in domains if d is not None and counts[d] == top)
    assert f is not None and f.cluster_uuid is not None and f.clique_id is not None
    return NvlinkDomain(chosen, f.cluster_uuid, f.clique_id, f.chassis_serial, f.tray_index, f.slot)


def fabric_lines(gpus: Sequence[tuple[int, GpuFabric | None]]) -> list[str]:
    """What ``topo`` prints above the matrix for ``(GPU index, fabric)`` pairs: the domain, the rack, tray
    and slot, the fabric's state and health summary (GPUs that differ named). Empty where no GPU has a
    fabric."""
    known = [(i, f) for i, f in gpus if f is not None and f.state not in (None, "not supported")]
    if not known:
        return []
    lines = []
    domain = node_domain([f for _, f in gpus])
    if domain is not None:
        lines.append(f"NVLink domain: {domain.id} (clique {domain.clique_id})")
        place = [f"rack (chassis) {domain.chassis_serial}"] if domain.chassis_serial else []
        if domain.tray_index is not None:
            place.append(f"tray {domain.tray_index}")
        if domain.slot is not None:
            place.append(f"slot {domain.slot}")
        if place:
            lines.append("Place: " + ", ".join(place))
    else:
        lines.append("NVLink domain: none (not multi-node NVLink: the NVLinks stay inside this node)")
    lines.append("Fabric: " + _spread([(i, _state(f)) for i, f in known]))
    summaries = [(i, f.health_summary) for i, f in known if f.health_summary]
    if summaries:
        lines.append("Fabric health: " + _spread(summaries))
    return lines


def _state(f: GpuFabric) -> str:
    state = f.state or "unknown"
    if state == COMPLETED and f.status not in (0, None):
        return f"completed with NVML error {f.status}"
    return state


def _spread(values: Sequence[tuple[int, str]]) -> str:
    """``completed`` when every GPU says it, else ``completed (GPU0, GPU1), in progress (GPU2)``."""
    by: dict[str, list[int]] = {}
    for i, v in values:
        by.setdefault(v, []).append(i)
    if len(by) == 1:
        return next(iter(by))
    return ", ".join(f"{v} ({', '.join(f'GPU{i}' for i in idx)})" for v, idx in by.items())
