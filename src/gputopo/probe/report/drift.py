"""Configuration drift in a probe across nodes (pure): every node's facts, sent to node rank 0 with its
own checks' summary (``local["config"]``, gathered by ``system.run_facts.config_facts``), compared by
``health.drift`` (shared with hang).

The document gets ``internode.drift``: ``{"differences": [{"key", "label", "severity", "values":
[{"value", "nodes"}]}], "findings": [finding...]}`` (the shared finding shape, category ``config``). Each
difference is also a line of ``internode.notes``, so every view shows it; a problem (GPU count, NCCL
version, net plugin) also joins ``internode.findings`` against the nodes that differ from the most, and
fails the run.
"""

from __future__ import annotations

from typing import Any

from gputopo.health.drift import Drift, compare, findings

FAIL = "fail"


def node_label(node_rank: int, host: str | None) -> str:
    return f"node {node_rank} ({host})" if host else f"node {node_rank}"


def add_drift(doc: dict[str, Any], record: dict[str, Any] | None) -> dict[str, Any]:
    """``doc`` (with ``nodes`` and ``internode``) with the drift between its nodes' facts added."""
    if not record or not isinstance(record.get("local"), dict):
        return doc
    hosts = {int(r["node_rank"]): r.get("host") for r in doc.get("nodes") or []}
    facts: dict[str, dict[str, Any]] = {}
    rank_of: dict[str, int] = {}
    for node, local in sorted(record["local"].items(), key=lambda kv: int(kv[0])):
        config = (local or {}).get("config")
        if isinstance(config, dict):
            label = node_label(int(node), hosts.get(int(node)))
            facts[label] = config
            rank_of[label] = int(node)
    drifts = compare(facts)
    section = dict(doc.get("internode") or {})
    section["drift"] = {
        "nodes": len(facts),
        "differences": [d.as_dict() for d in drifts],
        "findings": [f.to_json() for f in findings(drifts)],
    }
    if not drifts:
        return {**doc, "internode": section}
    notes = list(section.get("notes") or [])
    notes += [f"configuration drift ({d.severity}): {d.text()}" for d in drifts]
    section["notes"] = notes
    problems = [d for d in drifts if d.severity == "problem"]
    section["findings"] = list(section.get("findings") or []) + [_node_finding(d, rank_of) for d in problems]
    out = {**doc, "internode": section}
    if problems:
        out["verdict"] = FAIL
    return out


def _node_finding(d: Drift, rank_of: dict[str, int]) -> dict[str, Any]:
    """A problem drift in the ``internode.findings`` shape, pointing at the nodes outside the largest
    group (all of them on a tie: nobody can tell which is right)."""
    sizes = [len(nodes) for _, nodes in d.groups]
    if sizes.count(max(sizes)) > 1:
        odd = [n for _, nodes in d.groups for n in nodes]
    else:
        odd = [n for _, nodes in d.groups[1:] for n in nodes]
    (f,) = findings([d])
    return {
        "kind": "drift",
        "nodes": sorted(rank_of[n] for n in odd),
        "detail": f"{d.label} differs across nodes: {d.values_text()}",
        "remedy": f.remedy,
    }
