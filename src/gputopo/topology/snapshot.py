"""JSON snapshots of a topology (schema ``gputopo/topology/v1``): what ``gputopo topo --json`` prints.

A snapshot read back with ``loads`` gives the same ``Topology`` (except ``source``, which says where
it was read from, and ``snapshot_of`` in the JSON, which keeps the original source). Unknown values
are ``null``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any

from gputopo.errors import InputError
from gputopo.inputs import loads_bounded
from gputopo.model import (
    P2P_CAPABILITIES,
    Gpu,
    GpuFabric,
    Matrix,
    Nic,
    NvlinkPeer,
    PcieLink,
    Topology,
    is_link_code,
)
from gputopo.topology import nvlink_domain

SCHEMA = "gputopo/topology/v1"

_GPU_FIELDS = tuple(f.name for f in fields(Gpu))
_FABRIC_FIELDS = tuple(f.name for f in fields(GpuFabric))


def to_dict(topo: Topology) -> dict[str, Any]:
    """The JSON document for ``topo`` (design doc shape; extra keys are live details)."""
    gpus = []
    for g in topo.gpus:
        d = asdict(g)
        d["label"] = g.label
        d["compute_pids"] = list(g.compute_pids) if g.compute_pids is not None else None
        d["mig_devices"] = list(g.mig_devices)
        gpus.append(d)
    return {
        "schema": SCHEMA,
        "source": topo.source,
        "live": topo.live,
        "driver_version": topo.driver_version,
        "cuda_driver_version": topo.cuda_driver_version,
        "gpus": gpus,
        "nics": [{"label": n.label, "name": n.name} for n in topo.nics],
        "matrix": {"labels": list(topo.matrix.labels), "cells": [list(r) for r in topo.matrix.cells]},
        "nvlinks": [asdict(p) for p in topo.nvlinks] if topo.nvlinks is not None else None,
        "p2p": {k: [list(r) for r in v] for k, v in topo.p2p.items()} if topo.p2p is not None else None,
        "warnings": list(topo.warnings),
        # The node's NVLink domain (GB200/GB300 racks), or null: a contract (`gputopo nodes` reads it).
        "nvlink_domain": _domain_json(topo),
        # Exactly the value GPU feature discovery puts in the node label nvidia.com/gpu.clique, or null
        # where it puts none (registration not completed, no cluster UUID, GPUs that disagree).
        "gpu_clique": nvlink_domain.fabric_clique_label([g.fabric for g in topo.gpus]),
        "node": topo.node,
        "check": topo.check,
        "accept": topo.accept,
    }


def _domain_json(topo: Topology) -> dict[str, Any] | None:
    domain = nvlink_domain.node_domain([g.fabric for g in topo.gpus])
    return domain.to_json() if domain is not None else None


# NVML numbers GPUs from 0; no machine has this many.
MAX_GPU_INDEX = 1024


def dumps(topo: Topology) -> str:
    """``to_dict`` as indented JSON text."""
    return json.dumps(to_dict(topo), indent=2)


def loads(text: str, source: str = "snapshot") -> Topology:
    """Read a snapshot written by ``dumps``; ``InputError`` (exit 2) naming what is wrong otherwise."""
    try:
        data = loads_bounded(text, source)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{source}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            "give a file written by `gputopo topo --json`, or a saved `nvidia-smi topo -m` text",
        ) from None
    return from_dict(data, source=source)


def from_dict(data: Any, source: str = "snapshot") -> Topology:
    """Build a ``Topology`` from a snapshot document, checking its shape."""
    hint = "give a file written by `gputopo topo --json` (schema gputopo/topology/v1)"
    if not isinstance(data, dict):
        raise InputError(f"{source}: a topology snapshot is a JSON object", hint)
    if data.get("schema") != SCHEMA:
        found = f"its schema is {data['schema']!r}" if data.get("schema") else "it has no schema field"
        raise InputError(f"{source}: {found}; a topology snapshot has schema {SCHEMA!r}", hint)
    try:
        gpus = tuple(_gpu(g) for g in data["gpus"])
        nics = tuple(Nic(label=str(n["label"]), name=n.get("name")) for n in data.get("nics") or [])
        labels = tuple(str(x) for x in data["matrix"]["labels"])
        cells = tuple(tuple(_cell(c) for c in row) for row in data["matrix"]["cells"])
        nvlinks = data.get("nvlinks")
        p2p = data.get("p2p")
        topo = Topology(
            source=source,
            gpus=gpus,
            nics=nics,
            matrix=Matrix(labels, cells),
            warnings=tuple(str(w) for w in data.get("warnings") or ()),
            nvlinks=tuple(NvlinkPeer(**p) for p in nvlinks) if nvlinks is not None else None,
            p2p={k: tuple(tuple(None if c is None else str(c) for c in r) for r in v) for k, v in p2p.items()}
            if p2p
            else None,
            driver_version=data.get("driver_version"),
            cuda_driver_version=data.get("cuda_driver_version"),
            live=bool(data.get("live", False)),
            node=_node_name(data.get("node")),
            check=_check_doc(data.get("check")),
            accept=data.get("accept") if isinstance(data.get("accept"), dict) else None,
        )
    except InputError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InputError(f"{source}: malformed topology snapshot ({_plain(exc)})", hint) from None
    _check(topo, source, hint)
    return topo


def _plain(exc: Exception) -> str:
    """What is wrong with a snapshot, in words rather than Python's."""
    if isinstance(exc, KeyError):
        return f"the field {exc.args[0]!r} is missing"
    if isinstance(exc, ValueError) and str(exc).startswith(("matrix cell", "GPU index", "node ", "check ")):
        return str(exc)
    return "a field holds the wrong kind of value, e.g. text where a number or a list belongs"


def _gpu(d: dict[str, Any]) -> Gpu:
    kwargs = {k: d.get(k) for k in _GPU_FIELDS}
    index = d["index"]
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_GPU_INDEX:
        raise ValueError(f"GPU index {index!r} is not a whole number from 0 to {MAX_GPU_INDEX - 1}")
    kwargs["index"] = index
    if d.get("pcie") is not None:
        kwargs["pcie"] = PcieLink(**d["pcie"])
    if d.get("compute_pids") is not None:
        kwargs["compute_pids"] = tuple(int(p) for p in d["compute_pids"])
    kwargs["mig_devices"] = tuple(str(u) for u in d.get("mig_devices") or ())
    if d.get("fabric") is not None:
        fabric = dict(d["fabric"])
        if fabric.get("cliques") is not None:
            fabric["cliques"] = tuple((int(t), int(i)) for t, i in fabric["cliques"])
        kwargs["fabric"] = GpuFabric(**{k: fabric.get(k) for k in _FABRIC_FIELDS})
    return Gpu(**kwargs)


def _node_name(v: Any) -> str | None:
    if v is not None and (not isinstance(v, str) or not v.strip()):
        raise ValueError("node is not a name or null")
    return v


def _check_doc(v: Any) -> dict[str, Any] | None:
    """The node's last fresh check (``verdict``, ``at``, ``problems``) or ``None``."""
    if v is None:
        return None
    shaped = isinstance(v, dict) and isinstance(v.get("verdict"), str) and isinstance(v.get("problems"), list)
    if not shaped:
        raise ValueError("check is not {verdict, at, problems} or null")
    return v


def _cell(c: Any) -> str | None:
    if c is None:
        return None
    if not isinstance(c, str):
        raise ValueError(f"matrix cell {c!r} is not a string or null")
    return c


def _check(topo: Topology, source: str, hint: str) -> None:
    """Reject snapshots whose parts disagree (hand edits): square matrix, labels match devices."""
    indices = [g.index for g in topo.gpus]
    if len(set(indices)) != len(indices):
        raise InputError(f"{source}: GPU indices {indices} repeat", hint)
    n = len(topo.matrix.labels)
    if len(topo.matrix.cells) != n or any(len(r) != n for r in topo.matrix.cells):
        raise InputError(f"{source}: matrix is not {n}x{n} like its labels", hint)
    expected = [g.label for g in topo.gpus] + [x.label for x in topo.nics]
    if list(topo.matrix.labels) != expected:
        raise InputError(
            f"{source}: matrix labels {list(topo.matrix.labels)} don't match gpus and nics", hint
        )
    for row in topo.matrix.cells:
        for c in row:
            if c is not None and not is_link_code(c):
                raise InputError(f"{source}: unknown link code {c!r} in the matrix", hint)
    if topo.p2p is not None:
        for cap, m in topo.p2p.items():
            if cap not in P2P_CAPABILITIES or len(m) != len(topo.gpus):
                raise InputError(f"{source}: p2p matrix {cap!r} doesn't match the GPUs", hint)
