"""Golden baselines (pure): save a node's picture once, compare a node against it later.

A baseline (schema ``gputopo/baseline/v1``) holds what should not change on a healthy node: the GPU count,
each GPU's model, PCI bus id, maximum PCIe generation and width, NVLinks per GPU and per GPU pair, the
link matrix, the NICs, NUMA/CPU affinity, the driver and CUDA versions and each GPU's VBIOS. GPUs are
matched by PCI bus id, never by UUID or index, so a baseline saved on one node checks its siblings of the
same build.

Compared: a GPU missing, an NVLink fewer, a lower maximum PCIe width or generation, a changed matrix cell
or NIC are problems; driver, CUDA, VBIOS, UUID, model and affinity changes are notes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gputopo.errors import InputError
from gputopo.findings import NOTE, PROBLEM, Finding
from gputopo.health.readings import HealthSample
from gputopo.inputs import loads_bounded
from gputopo.model import Topology

SCHEMA = "gputopo/baseline/v1"
MAX_BASELINE_BYTES = 16 * 1024 * 1024
_HINT = "write one with `gputopo check --save-baseline FILE` on a known-good node"
_REQUIRED = ("schema", "gpu_count", "gpus", "nvlink_pairs", "matrix", "nics")


def baseline_from(topo: Topology, health: HealthSample | None = None) -> dict[str, Any]:
    """This node's baseline document from its topology (``system.inventory.read_live``) and, when given,
    a health sample (NVLinks per GPU, VBIOS)."""
    hg = {g.index: g for g in health.gpus} if health is not None else {}
    pairs: dict[tuple[str, str], int] = {}
    bus = {g.index: g.pci_bus_id for g in topo.gpus}
    for p in topo.nvlinks or ():
        a, b = bus.get(p.gpu), bus.get(p.peer)
        if a and b and p.gpu < p.peer:
            pairs[(a, b)] = p.links_up + p.links_down
    gpus = []
    for g in topo.gpus:
        h = hg.get(g.index)
        links = None
        if h is not None and h.nvlinks is not None:
            links = sum(1 for n in h.nvlinks if n.up)
        gpus.append(
            {
                "pci_bus_id": g.pci_bus_id,
                "index": g.index,
                "name": g.name,
                "uuid": g.uuid,
                "vbios": h.vbios_version if h is not None else None,
                "pcie_gen_max": g.pcie.gen_max if g.pcie else None,
                "pcie_width_max": g.pcie.width_max if g.pcie else None,
                "nvlinks_up": links,
                "cpu_affinity": g.cpu_affinity,
                "numa_affinity": g.numa_affinity,
            }
        )
    return {
        "schema": SCHEMA,
        "source": topo.source,
        "driver_version": topo.driver_version,
        "cuda_driver_version": topo.cuda_driver_version,
        "gpu_count": len(topo.gpus),
        "gpus": gpus,
        "nvlink_pairs": [{"a": a, "b": b, "links": n} for (a, b), n in sorted(pairs.items())],
        "matrix": {"labels": list(topo.matrix.labels), "cells": [list(r) for r in topo.matrix.cells]},
        "nics": [{"label": n.label, "name": n.name} for n in topo.nics],
    }


def dumps(doc: Mapping[str, Any]) -> str:
    """The baseline as the text ``--save-baseline`` writes."""
    return json.dumps(doc, indent=2) + "\n"


def loads(data: bytes, source: str) -> dict[str, Any]:
    """A baseline read back; ``InputError`` (exit 2) for one that is too large, truncated, not JSON, of
    another schema, or missing a part."""
    where = f"--baseline {source}"
    if len(data) > MAX_BASELINE_BYTES:
        raise InputError(f"{where}: {len(data)} bytes is too large for a baseline", _HINT)
    try:
        doc = loads_bounded(data.decode("utf-8"), where)
    except UnicodeDecodeError:
        raise InputError(f"{where}: not UTF-8 text", _HINT) from None
    except json.JSONDecodeError as exc:
        why = "truncated" if exc.pos >= len(data.rstrip()) else f"not JSON ({exc.msg}, line {exc.lineno})"
        raise InputError(f"{where}: {why}", _HINT) from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        schema = doc.get("schema") if isinstance(doc, dict) else None
        raise InputError(f"{where}: schema {schema!r}, expected {SCHEMA!r}", _HINT)
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise InputError(f"{where}: no {', '.join(missing)} (truncated or edited?)", _HINT)
    _check_shape(doc, where)
    return doc


def _check_shape(doc: Mapping[str, Any], where: str) -> None:
    ok = (
        isinstance(doc["gpu_count"], int)
        and isinstance(doc["gpus"], list)
        and all(
            isinstance(g, dict) and isinstance(g.get("pci_bus_id"), (str, type(None))) for g in doc["gpus"]
        )
        and isinstance(doc["nvlink_pairs"], list)
        and all(isinstance(p, dict) and {"a", "b", "links"} <= p.keys() for p in doc["nvlink_pairs"])
        and isinstance(doc["matrix"], dict)
        and isinstance(doc["matrix"].get("labels"), list)
        and isinstance(doc["matrix"].get("cells"), list)
        and isinstance(doc["nics"], list)
        and all(isinstance(n, dict) for n in doc["nics"])
    )
    if not ok:
        raise InputError(f"{where}: a part has the wrong shape (edited by hand?)", _HINT)


def _norm(bus_id: str | None) -> str | None:
    """Bus ids compared as nvidia-smi prints them (8-digit domain, upper case)."""
    if not bus_id:
        return None
    text = bus_id.strip().upper()
    parts = text.split(":")
    if len(parts) == 3:
        return f"{parts[0].rjust(8, '0')[-8:]}:{parts[1]}:{parts[2]}"
    return text


def compare(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[Finding]:
    """What changed from ``saved`` to ``now`` (both ``baseline_from`` documents), problems first."""
    out: list[Finding] = []
    old_gpus = {_norm(g.get("pci_bus_id")): g for g in saved["gpus"] if g.get("pci_bus_id")}
    new_gpus = {_norm(g.get("pci_bus_id")): g for g in now["gpus"] if g.get("pci_bus_id")}
    remedy_missing = (
        "look for Xid 79 in `dmesg` and at `lspci -d 10de:`; a reboot or reseat usually brings it back, "
        "else hardware service"
    )
    if now["gpu_count"] < saved["gpu_count"]:
        out.append(
            Finding(
                "node",
                f"{now['gpu_count']} GPUs, the baseline has {saved['gpu_count']}",
                remedy_missing,
                PROBLEM,
                category="topology",
                action="drain",
            )
        )
    for bus, old in old_gpus.items():
        new = new_gpus.get(bus)
        if new is None:
            out.append(
                Finding(
                    f"GPU at {bus}",
                    f"the GPU at {bus} ({old.get('name') or 'GPU'}, GPU{old.get('index')} in the baseline) "
                    "is missing",
                    remedy_missing,
                    PROBLEM,
                    category="topology",
                    action="drain",
                )
            )
            continue
        out.extend(_gpu_changes(bus, old, new))
    for bus, new in new_gpus.items():
        if bus not in old_gpus:
            out.append(
                Finding(
                    f"GPU{new.get('index')}",
                    f"GPU{new.get('index')} at {bus} is not in the baseline",
                    "save a new baseline if the node was rebuilt on purpose",
                    NOTE,
                    gpu=new.get("index"),
                    category="topology",
                )
            )
    out.extend(_pair_changes(saved, now, new_gpus))
    out.extend(_matrix_changes(saved, now))
    out.extend(_nic_changes(saved["nics"], now["nics"]))
    for key, words in (("driver_version", "driver"), ("cuda_driver_version", "CUDA driver version")):
        if saved.get(key) and now.get(key) and saved[key] != now[key]:
            out.append(
                Finding(
                    "node",
                    f"{words} {now[key]}, the baseline has {saved[key]}",
                    "expected after an upgrade; save a new baseline once the node checks out",
                    NOTE,
                    category="driver",
                )
            )
    return sorted(out, key=lambda f: f.severity != PROBLEM)


def _gpu_changes(bus: str | None, old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Finding]:
    i = new.get("index")
    label = f"GPU{i}"
    out: list[Finding] = []
    for key, words in (
        ("pcie_width_max", "maximum PCIe width x"),
        ("pcie_gen_max", "maximum PCIe generation Gen"),
    ):
        a, b = old.get(key), new.get(key)
        if isinstance(a, int) and isinstance(b, int) and b < a:
            out.append(
                Finding(
                    label,
                    f"{label} ({bus}): {words}{b}, the baseline has {words.split()[-1]}{a}",
                    "the slot, riser or card lost lanes or speed: reseat the GPU, check the riser and the "
                    "BIOS PCIe settings",
                    PROBLEM,
                    gpu=i,
                    category="pcie",
                    action="replace",
                )
            )
    a, b = old.get("nvlinks_up"), new.get("nvlinks_up")
    if isinstance(a, int) and isinstance(b, int) and b < a:
        out.append(
            Finding(
                label,
                f"{label} ({bus}): {b} NVLinks up, the baseline has {a}",
                "`nvidia-smi nvlink -s` shows which; a GPU reset or reseat usually brings a link back",
                PROBLEM,
                gpu=i,
                category="nvlink",
                action="reset",
            )
        )
    for key, words, category in (
        ("vbios", "VBIOS", "driver"),
        ("uuid", "UUID", "topology"),
        ("name", "model", "topology"),
        ("cpu_affinity", "CPU affinity", "config"),
        ("numa_affinity", "NUMA affinity", "config"),
    ):
        a, b = old.get(key), new.get(key)
        if a and b and a != b:
            out.append(
                Finding(
                    label,
                    f"{label} ({bus}): {words} {b}, the baseline has {a}",
                    "expected on a sibling node or after a firmware update or GPU swap; otherwise check what "
                    "changed",
                    NOTE,
                    gpu=i,
                    category=category,
                )
            )
    return out


def _pair_changes(
    saved: Mapping[str, Any], now: Mapping[str, Any], new_gpus: Mapping[str | None, Mapping[str, Any]]
) -> list[Finding]:
    def links(doc: Mapping[str, Any]) -> dict[tuple[str | None, str | None], int]:
        out = {}
        for p in doc["nvlink_pairs"]:
            a, b = sorted((_norm(p["a"]) or "", _norm(p["b"]) or ""))
            out[(a, b)] = int(p["links"])
        return out

    old, new = links(saved), links(now)
    out: list[Finding] = []
    for (a, b), n in sorted(old.items()):
        if a not in new_gpus or b not in new_gpus:
            continue  # a missing GPU is its own finding
        m = new.get((a, b), 0)
        if m < n:
            ia, ib = new_gpus[a].get("index"), new_gpus[b].get("index")
            out.append(
                Finding(
                    f"GPU{ia}-GPU{ib}",
                    f"GPU{ia}-GPU{ib}: {m} NVLinks, the baseline has {n}",
                    "`nvidia-smi nvlink -s` shows the links; a GPU reset or reseat usually brings one back",
                    PROBLEM,
                    category="nvlink",
                    action="reset",
                )
            )
    return out


def _label_keys(doc: Mapping[str, Any]) -> list[str]:
    """Matrix labels as stable keys: GPUs by bus id, NICs by name (labels like GPU3 and NIC0 are
    positions, which differ between siblings when a GPU is missing)."""
    bus = {f"GPU{g.get('index')}": _norm(g.get("pci_bus_id")) for g in doc["gpus"]}
    nic = {n.get("label"): n.get("name") or n.get("label") for n in doc["nics"]}
    keys = []
    for label in doc["matrix"]["labels"]:
        if label in bus and bus[label]:
            keys.append(f"gpu:{bus[label]}")
        elif label in nic:
            keys.append(f"nic:{nic[label]}")
        else:
            keys.append(f"label:{label}")
    return keys


def _matrix_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[Finding]:
    def cells(doc: Mapping[str, Any]) -> dict[tuple[str, str], Any]:
        keys = _label_keys(doc)
        rows = doc["matrix"]["cells"]
        out = {}
        for r, a in enumerate(keys):
            row = rows[r] if r < len(rows) and isinstance(rows[r], list) else []
            for c, b in enumerate(keys):
                if c < len(row):
                    out[(a, b)] = row[c]
        return out

    old, new = cells(saved), cells(now)
    names = dict(zip(_label_keys(now), now["matrix"]["labels"], strict=False))
    out: list[Finding] = []
    for (a, b), code in sorted(old.items()):
        if a >= b or (a, b) not in new or code is None or new[(a, b)] is None:
            continue
        if new[(a, b)] != code:
            where = f"{names.get(a, a)}-{names.get(b, b)}"
            out.append(
                Finding(
                    where,
                    f"{where}: the link is {new[(a, b)]}, the baseline has {code}",
                    "compare `nvidia-smi topo -m` with the baseline node: a missing NVLink, a card in "
                    "another slot or a changed BIOS setting",
                    PROBLEM,
                    category="topology",
                    action="drain",
                )
            )
    return out


def _nic_changes(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[Finding]:
    was = [n.get("name") or n.get("label") for n in old]
    now = {n.get("name") or n.get("label") for n in new}
    return [
        Finding(
            f"NIC {name}",
            f"NIC {name} is in the baseline but not on this node",
            "check `ibstat`/`ip link` and the NIC's driver; a missing NIC slows every inter-node job",
            PROBLEM,
            category="topology",
            action="drain",
        )
        for name in was
        if name not in now
    ]


def fleet_baseline(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``--save-baseline --fleet``: the wiring and the model without what differs between sibling nodes of
    one build (each GPU's UUID and VBIOS, the host it came from), so every sibling compares cleanly against
    one file."""
    out = dict(doc)
    out["fleet"] = True
    out["source"] = None
    out["gpus"] = [{**g, "uuid": None, "vbios": None} for g in doc.get("gpus", ())]
    return out
