"""Configuration drift across nodes (pure; shared by ``probe`` and ``hang``, which sit side by side): the
same facts gathered on every node, compared.

A job whose nodes differ in NCCL, its network plugin or their GPU count is a known source of hangs and
slow rings that no single node's check shows (nccl#1634: one node's other plugin). Every node's facts
(``gputopo.system.run_facts.config_facts``) are compared key by key; a key whose values differ is shown
grouped as value -> nodes, as NCCL's RAS diagnostics print it, and judged: a different GPU count, NCCL
version or NCCL net plugin is a problem (the ranks cannot agree on a ring or a transport), any other
difference (driver, CUDA, torch, GPU model, VBIOS, GPUDirect RDMA mode, RDMA port count or rates, an
``NCCL_*`` or ``TORCH_NCCL_*`` variable, the NVLink domain or rack: a job may span racks) a note.
A different IMEX state (its daemon, its channels) is a problem: NVLink between the nodes depends on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gputopo.findings import NOTE, PROBLEM, Finding

# The facts each node reports, in the order they are shown; env variables follow as "env NAME".
FACT_KEYS = (
    "gpu_count",
    "gpu_model",
    "nccl",
    "net_plugin",
    "driver",
    "cuda",
    "torch",
    "vbios",
    "gdr",
    "rdma_ports",
    "nic_rates_gbps",
    "nvlink_domain",
    "rack",
    "imex",
)
# IMEX that differs between nodes: NCCL's MNNVL check runs on every rank of a clique and stops the job
# (or, with NCCL_MNNVL_ENABLE=0, leaves it on the network) where one node has no channel or daemon.
PROBLEM_KEYS = frozenset({"gpu_count", "nccl", "net_plugin", "imex"})
LABELS = {
    "gpu_count": "GPU count",
    "gpu_model": "GPU model",
    "nccl": "NCCL version",
    "net_plugin": "NCCL net plugin",
    "driver": "driver version",
    "cuda": "CUDA version",
    "torch": "torch version",
    "vbios": "VBIOS",
    "gdr": "GPUDirect RDMA",
    "rdma_ports": "RDMA ports",
    "nic_rates_gbps": "RDMA port rates (Gb/s)",
    "nvlink_domain": "NVLink domain",
    "rack": "rack (chassis serial)",
    "imex": "IMEX",
}
UNSET = "(unset)"
UNKNOWN = "(unknown)"
NO_PLUGIN = "(none: NCCL's internal IB/socket transport)"


@dataclass(frozen=True)
class Drift:
    """One fact that differs: its key, and each value with the nodes that have it (most nodes first)."""

    key: str
    groups: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def label(self) -> str:
        if self.key.startswith("env "):
            return self.key[4:]
        return LABELS.get(self.key, self.key)

    @property
    def severity(self) -> str:
        return PROBLEM if self.key in PROBLEM_KEYS else NOTE

    def values_text(self) -> str:
        """``2.27.5 on node0, node1; 2.21.5 on node2``."""
        return "; ".join(f"{v} on {', '.join(nodes)}" for v, nodes in self.groups)

    def text(self) -> str:
        """``NCCL version: 2.27.5 on node0, node1; 2.21.5 on node2``."""
        return f"{self.label}: {self.values_text()}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "label": self.label,
            "severity": self.severity,
            "values": [{"value": v, "nodes": list(n)} for v, n in self.groups],
        }


def _flatten(facts: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in FACT_KEYS:
        value = facts.get(key)
        if key == "net_plugin":
            out[key] = NO_PLUGIN if value is None else str(value)
        elif key == "nvlink_domain":
            out[key] = str(value.get("id")) if isinstance(value, Mapping) and value.get("id") else UNKNOWN
        elif isinstance(value, list | tuple):
            out[key] = ", ".join(str(v) for v in value) if value else UNKNOWN
        else:
            out[key] = UNKNOWN if value is None else str(value)
    env = facts.get("env")
    for name, value in env.items() if isinstance(env, Mapping) else ():
        out[f"env {name}"] = str(value)
    return out


def compare(facts_by_node: Mapping[str, Mapping[str, Any]]) -> list[Drift]:
    """Every fact whose value is not the same on all nodes. A fact no node knows is not compared; one
    only some nodes know is (the others show ``(unknown)``); an env variable set on some nodes only shows
    ``(unset)`` on the rest."""
    if len(facts_by_node) < 2:
        return []
    flat = {node: _flatten(f) for node, f in facts_by_node.items()}
    env_keys = sorted({k for f in flat.values() for k in f if k.startswith("env ")})
    out: list[Drift] = []
    for key in (*FACT_KEYS, *env_keys):
        values = {node: f.get(key, UNSET) for node, f in flat.items()}
        if all(v == UNKNOWN for v in values.values()):
            continue
        by_value: dict[str, list[str]] = {}
        for node, value in values.items():
            by_value.setdefault(value, []).append(node)
        if len(by_value) > 1:
            groups = sorted(by_value.items(), key=lambda kv: -len(kv[1]))  # ties: in node order
            out.append(Drift(key, tuple((v, tuple(n)) for v, n in groups)))
    return out


_REMEDY = {
    "gpu_count": "give every node the same number of GPUs (a GPU fell off the bus, or a node's allocation "
    "differs); NCCL builds its rings and trees over all ranks",
    "nccl": "install the same NCCL (and torch build) on every node; mixed NCCL versions can disagree on "
    "protocols and hang at the first collective",
    "net_plugin": "install the same NCCL net plugin (or none) on every node and set NCCL_NET_PLUGIN the "
    "same way; one node on another transport hangs or slows the job (nccl#1634)",
    "imex": "check IMEX: `nvidia-imex-ctl -N`, the channels in /dev/nvidia-caps-imex-channels, "
    "`NCCL_MNNVL_ENABLE`; every node of an NVLink domain needs the daemon and a channel",
}
_DOMAIN_REMEDY = (
    "nodes in different NVLink domains (racks) talk over the network: keep a job's tensor- and "
    "expert-parallel groups inside one domain (`gputopo nodes --segment`)"
)
_NOTE_REMEDY = "make the nodes' configuration the same unless the difference is meant"


def findings(drifts: list[Drift]) -> list[Finding]:
    """One finding per difference, problems first (category ``config``)."""
    found = [
        Finding(
            where=d.label,
            what=f"differs across nodes: {d.values_text()}",
            remedy=_REMEDY.get(d.key, _DOMAIN_REMEDY if d.key in ("nvlink_domain", "rack") else _NOTE_REMEDY),
            severity=d.severity,
            category="config",
            action="config",
        )
        for d in drifts
    ]
    return sorted(found, key=lambda f: f.severity != PROBLEM)
