"""Across nodes in one NVLink domain: did NCCL use the domain (MNNVL), or fall back to the network? (pure:
log lines and each node's facts in, findings out).

On GB200/GB300 racks the GPUs of every tray share one NVLink fabric; NCCL uses it between nodes ("MNNVL")
only when every rank's fabric registration is complete, the ranks share a cluster UUID and clique, and a
FABRIC memory handle can be exported and imported through IMEX. When any of that fails NCCL either stops
(the two warnings below) or, with ``NCCL_MNNVL_ENABLE=0``, silently sends the traffic between the trays
over the NICs at a fraction of the speed. What NCCL writes with ``NCCL_DEBUG=INFO`` (NVIDIA/nccl at
5067397c2676d5aed50042fc39e5c8ee96eb0027):

- ``src/init.cc`` (``fillInfo``), per rank, whenever NVML reports fabric info (whatever MNNVL_ENABLE says):
  ``MNNVL busId 0x%lx fabric UUID %lx.%lx cliqueId 0x%x state %d healthMask 0x%x``; ``state`` is NVML's
  ``nvmlGpuFabricState_t`` (3 = ``NVML_GPU_FABRIC_STATE_COMPLETED``, the only one MNNVL accepts).
- ``src/mnnvl.cc`` (``ncclMnnvlCheck``), run when there is more than one node and ``NCCL_MNNVL_ENABLE`` is
  not 0: on success ``MNNVL %d cliqueId %x cliqueSize %d cliqueRank %d nvlDomainSize %d`` (older NCCL ends
  at ``cliqueRank``); when the FABRIC allocation fails, ``WARN("MNNVL (cliqueSize %d) is available but not
  working on this system. Check the IMEX channel configuration (/dev/nvidia-caps-imex-channels). ...")``;
  when the export/import through IMEX fails, the same sentence with ``Check the IMEX configuration
  (nvidia-imex-ctl -N)``. Both return ``ncclSystemError``: the communicator is not created.
- ``src/init.cc``: ``comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d``. With MNNVL
  NCCL counts a whole clique as one node (``nNodes`` comes from the rings' first ranks, and
  ``nvlDomainInfo.nNvlDomains = comm->nNodes``), so two trays of one rack show ``nNodes 1 ... MNNVL 1``.
- ``src/transport/nvls.cc``: ``NVLS comm %p headRank %d nHeads %d nvlsRanks %d buffSize ...`` when NVLink
  SHARP (the switches' multicast) is set up.

The judgement: a warning is a problem on its own; nodes that share a domain (each node's facts:
``nvlink_domain``) whose communicator crossed them without MNNVL (``MNNVL 0``, or channels ``via NET/``)
is a problem; nodes in different domains going over the network is how it should be (a note). Where the
domain was used, bus bandwidth is judged against the NVLink class of the GPU (``NVLINK_CLASS_GBPS``)
instead of the NICs' line rate.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gputopo.probe.judge.network import LOW_FRACTION, MIN_JUDGED_BYTES, parse_nccl_net

# nvmlGpuFabricState_t (nvml.h): NVML_GPU_FABRIC_STATE_NOT_SUPPORTED 0, NOT_STARTED 1, IN_PROGRESS 2,
# COMPLETED 3.
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
FABRIC_COMPLETED = 3

# The NVLink bandwidth a GPU has into the domain, GB/s per direction (half of the bidirectional figure of
# NVIDIA's datasheets): GB200 NVL72 and GB300 NVL72, "fifth-generation NVLink ... 1.8 TB/s" GPU-to-GPU
# (18 links x 50 GB/s each way; 130 TB/s over the rack's 72 GPUs); GH200 NVL32, fourth-generation
# NVLink, 900 GB/s (18 x 25). The first match on the GPU's name wins; ``GPUTOPO_NVLINK_DOMAIN_GBPS``
# overrides it.
NVLINK_CLASS_GBPS: tuple[tuple[str, float], ...] = (("GB300", 900.0), ("GB200", 900.0), ("GH200", 450.0))
OVERRIDE_VARIABLE = "GPUTOPO_NVLINK_DOMAIN_GBPS"

REMEDY = (
    "check IMEX: `nvidia-imex-ctl -N` (every node of the domain connected), the channels in "
    "/dev/nvidia-caps-imex-channels (channel0 present in the job's container), `NCCL_MNNVL_ENABLE` "
    "(unset or 1)"
)

_HEX = "[0-9a-fA-F]"
_BUS = re.compile(
    rf"NCCL INFO MNNVL busId 0x(?P<bus>{_HEX}+) fabric UUID (?P<u0>{_HEX}+)\.(?P<u1>{_HEX}+) "
    rf"cliqueId 0x(?P<clique>{_HEX}+) state (?P<state>\d+) healthMask 0x(?P<mask>{_HEX}+)"
)
_USED = re.compile(
    rf"NCCL INFO MNNVL (?P<on>\d+) cliqueId (?P<clique>{_HEX}+) cliqueSize (?P<size>\d+) "
    r"cliqueRank (?P<rank>\d+)(?: nvlDomainSize (?P<domain>\d+))?"
)
_COMM = re.compile(
    r"NCCL INFO comm 0x\w+ rank (?P<rank>\d+) nRanks (?P<nranks>\d+) nNodes (?P<nnodes>\d+) "
    r"localRanks (?P<local>\d+) localRank \d+ MNNVL (?P<mnnvl>\d+)"
)
_NVLS = re.compile(r"NCCL INFO NVLS comm 0x\w+ headRank -?\d+ nHeads (?P<heads>\d+) nvlsRanks (?P<ranks>\d+)")
_WARN = re.compile(
    r"NCCL WARN MNNVL \(cliqueSize (?P<size>\d+)\) is available but not working on this system\. "
    r"Check the IMEX (?P<what>channel configuration|configuration)"
)
# What ``parse_mnnvl`` needs from a rank's log: the multi-node probe keeps only lines holding one of these.
MARKS = ("MNNVL", "NVLS comm")


def parse_mnnvl(lines: Iterable[str]) -> dict[str, Any]:
    """What NCCL's INIT log says about the NVLink domain.

    ``gpus``: per ``MNNVL busId`` line (``bus_id``, ``uuid``, ``clique``, ``state``, ``health_mask``), one
    per bus id; ``used``: the ``MNNVL 1 cliqueId`` lines (``clique``, ``size``, ``domain_size``);
    ``comms``: the communicator lines (``nranks``, ``nnodes``, ``mnnvl``); ``nvls``: the NVLS ranks of
    the largest ``NVLS comm`` line, or ``None``; ``warnings``: ``{"what": "channels"|"domain", "size"}``.
    """
    out: dict[str, Any] = {"gpus": [], "used": [], "comms": [], "nvls": None, "warnings": []}
    seen: set[str] = set()
    for line in lines:
        if m := _WARN.search(line):
            what = "channels" if m["what"].startswith("channel") else "domain"
            warning = {"what": what, "size": int(m["size"])}
            if warning not in out["warnings"]:
                out["warnings"].append(warning)
        elif m := _BUS.search(line):
            if m["bus"] not in seen:
                seen.add(m["bus"])
                out["gpus"].append(
                    {
                        "bus_id": m["bus"],
                        "uuid": f"{m['u0']}.{m['u1']}",
                        "clique": int(m["clique"], 16),
                        "state": int(m["state"]),
                        "health_mask": int(m["mask"], 16),
                    }
                )
        elif m := _USED.search(line):
            if m["on"] == "1":
                out["used"].append(
                    {
                        "clique": int(m["clique"], 16),
                        "size": int(m["size"]),
                        "domain_size": int(m["domain"]) if m["domain"] else None,
                    }
                )
        elif m := _COMM.search(line):
            out["comms"].append(
                {"nranks": int(m["nranks"]), "nnodes": int(m["nnodes"]), "mnnvl": m["mnnvl"] == "1"}
            )
        elif m := _NVLS.search(line):
            out["nvls"] = max(out["nvls"] or 0, int(m["ranks"]))
    return out


def nvlink_class_gbps(models: Sequence[str] | None, override: str | None = None) -> tuple[float | None, str]:
    """The NVLink bandwidth of the domain's GPUs (GB/s per direction) and where it came from."""
    if override:
        try:
            value = float(override)
        except ValueError:
            value = 0.0
        if value > 0:
            return value, f"{OVERRIDE_VARIABLE}={override}"
    for name in models or ():
        upper = str(name).upper()
        for sku, gbps in NVLINK_CLASS_GBPS:
            if sku in upper:
                return gbps, f"{sku} NVLink"
    return None, "GPU model without a known NVLink class"


def node_domains(local: Mapping[int, Mapping[str, Any] | None]) -> dict[int, str | None]:
    """Each node's NVLink domain id (``<clusterUuid>.<cliqueId>``) from its facts, else ``None``."""
    out: dict[int, str | None] = {}
    for node, summary in local.items():
        dom = ((summary or {}).get("config") or {}).get("nvlink_domain")
        out[node] = dom.get("id") if isinstance(dom, Mapping) else None
    return out


def _shared_groups(domains: Mapping[int, str | None], nodes: Sequence[int]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for n in nodes:
        d = domains.get(n)
        if d:
            groups.setdefault(d, []).append(n)
    return {d: sorted(ns) for d, ns in groups.items() if len(ns) >= 2}


def _env(local: Mapping[int, Mapping[str, Any] | None], name: str) -> dict[int, str]:
    out = {}
    for node, summary in local.items():
        value = (((summary or {}).get("config") or {}).get("env") or {}).get(name)
        if value is not None:
            out[node] = str(value)
    return out


def warning_findings(log: Mapping[str, Any], nodes: Sequence[int]) -> list[dict[str, Any]]:
    """A problem per "MNNVL ... is available but not working" warning in the log."""
    found = []
    for w in log["warnings"]:
        why = (
            "the IMEX channel (/dev/nvidia-caps-imex-channels) is missing or not usable, so no FABRIC memory "
            "handle could be allocated"
            if w["what"] == "channels"
            else "a FABRIC memory handle could not be exported and imported through the IMEX daemon "
            "(its domain is not connected)"
        )
        found.append(
            {
                "kind": "mnnvl",
                "nodes": list(nodes),
                "detail": f"NCCL found the NVLink domain (MNNVL, a clique of {w['size']} GPUs) available but "
                f"not working: {why}; NCCL stopped with a system error",
                "remedy": REMEDY,
            }
        )
    return found


def judge_mnnvl(
    device: str,
    tests: Sequence[Mapping[str, Any]],
    nccl_lines: Sequence[str] | None,
    local: Mapping[int, Mapping[str, Any] | None],
    nodes: Sequence[int],
    override: str | None = None,
) -> tuple[list[dict[str, Any]], list[str], dict[str, Any], set[int]]:
    """Findings, notes, the ``mnnvl`` summary, and the indices of ``tests`` judged here against the
    NVLink class (``judge.network`` leaves those out of its line-rate comparison).

    ``nccl_lines``: node rank 0's NCCL log lines; ``local``: each node's summary by node rank (its
    ``config`` facts carry ``nvlink_domain`` and ``env``).
    """
    log = parse_mnnvl(nccl_lines or [])
    domains = node_domains(local)
    shared = _shared_groups(domains, nodes)
    used = bool(log["used"]) or any(c["mnnvl"] for c in log["comms"])
    summary: dict[str, Any] = {
        "used": used,
        "domains": {str(n): domains.get(n) for n in nodes},
        "cliques": sorted({u["clique"] for u in log["used"]} | {g["clique"] for g in log["gpus"]}),
        "clique_size": max((u["size"] for u in log["used"]), default=None),
        "nvls_ranks": log["nvls"],
        "warnings": [w["what"] for w in log["warnings"]],
    }
    found = warning_findings(log, nodes)
    notes: list[str] = []
    if device != "cuda" and not (log["gpus"] or log["used"] or log["comms"]):
        return found, notes, summary, set()
    if not shared and not log["gpus"]:
        return found, notes, summary, set()
    net = parse_nccl_net(nccl_lines or [])
    crossed_by_net = bool(net["via"]) or any(c["nnodes"] > 1 and not c["mnnvl"] for c in log["comms"])
    if shared and not used and not log["warnings"] and crossed_by_net:
        why = []
        # What keeps NCCL from even trying (src/init.cc: the check runs only with NCCL_MNNVL_ENABLE not 0
        # and a P2P level above LOC, ncclGetUserP2pLevel from NCCL_P2P_DISABLE/NCCL_P2P_LEVEL; src/mnnvl.cc:
        # it needs cuMem, NCCL_CUMEM_ENABLE).
        for name, values in (
            ("NCCL_MNNVL_ENABLE", ("0",)),
            ("NCCL_P2P_DISABLE", ("1",)),
            ("NCCL_P2P_LEVEL", ("LOC", "0")),
            ("NCCL_CUMEM_ENABLE", ("0",)),
        ):
            set_to = sorted({v.strip() for v in _env(local, name).values() if v.strip().upper() in values})
            if set_to:
                why.append(f"{name}={set_to[0]} is set")
        stuck = [g for g in log["gpus"] if g["state"] != FABRIC_COMPLETED]
        if stuck:
            g = stuck[0]
            why.append(
                f"GPU {g['bus_id']}'s fabric registration is {FABRIC_STATES.get(g['state'], g['state'])}"
            )
        if any(g["uuid"] == "0.0" for g in log["gpus"]):
            why.append("a GPU reports no fabric cluster UUID")
        transport = "NET/" + max(net["via"].items(), key=lambda kv: kv[1])[0] if net["via"] else "the network"
        for dom, members in shared.items():
            found.append(
                {
                    "kind": "mnnvl",
                    "nodes": members,
                    "detail": f"node {', '.join(map(str, members))} share the NVLink domain {dom} but NCCL "
                    f"sent the traffic between them over {transport}, not the NVLink domain (MNNVL 0)"
                    + (f": {'; '.join(why)}" if why else ""),
                    "remedy": REMEDY,
                }
            )
    if shared and not (used or log["warnings"] or log["comms"] or net["via"]):
        names = ", ".join(shared)
        notes.append(
            f"nodes share the NVLink domain {names}, but NCCL logged no communicator or channel lines "
            "(NCCL_DEBUG below INFO, or NCCL_DEBUG_SUBSYS without INIT): whether it used the domain is "
            "unknown"
        )
    if len(set(filter(None, domains.values()))) > 1:
        named = "; ".join(
            f"{d}: node {', '.join(map(str, ns))}" for d, ns in _by_domain(domains, nodes).items()
        )
        notes.append(
            f"the nodes are in {len(set(filter(None, domains.values())))} NVLink domains ({named}): "
            "traffic between domains goes over the network, inside each over NVLink"
        )
    judged: set[int] = set()
    if used:
        judged, more_found, more_notes = _bandwidth(tests, domains, local, log, nodes, override)
        found += more_found
        notes += more_notes
    return found, notes, summary, judged


def _by_domain(domains: Mapping[int, str | None], nodes: Sequence[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for n in nodes:
        out.setdefault(domains.get(n) or "unknown", []).append(n)
    return out


def _bandwidth(
    tests: Sequence[Mapping[str, Any]],
    domains: Mapping[int, str | None],
    local: Mapping[int, Mapping[str, Any] | None],
    log: Mapping[str, Any],
    nodes: Sequence[int],
    override: str | None,
) -> tuple[set[int], list[dict[str, Any]], list[str]]:
    """Tests whose nodes all sit in one used domain, judged against the NVLink class."""
    # Without the nodes' facts: one clique holding every rank of the largest communicator (cliqueSize
    # counts GPUs) means every test stayed inside the domain.
    world = max((c["nranks"] for c in log["comms"]), default=None)
    whole = (
        bool(log["used"])
        and world is not None
        and max(u["size"] for u in log["used"]) >= world
        and not any(domains.values())
    )

    def inside(t: Mapping[str, Any]) -> bool:
        members = [int(n) for n in t.get("nodes") or []]
        if whole:
            return True
        ids = {domains.get(n) for n in members}
        return len(ids) == 1 and None not in ids

    models = ((local.get(0) or {}).get("config") or {}).get("gpu_model")
    gbps, source = nvlink_class_gbps(models, override)
    judged: set[int] = set()
    low = []
    for i, t in enumerate(tests):
        if t.get("rail") is not None or len(t.get("nodes") or []) < 2 or not inside(t):
            continue
        judged.add(i)
        if gbps is None or int(t.get("wrong") or 0) > 0:
            continue
        big = [r for r in t.get("rows") or [] if int(r.get("bytes") or 0) >= MIN_JUDGED_BYTES]
        if not big:
            continue
        peak = max(float(r["busbw_gbps"]) for r in big)
        if peak < LOW_FRACTION * gbps:
            low.append((t, peak))
    notes = []
    if judged and gbps is None:
        notes.append(
            f"NCCL used the NVLink domain but the {source}: bandwidth inside the domain not judged "
            f"(set {OVERRIDE_VARIABLE} to the GB/s per direction)"
        )
    found = []
    if low and gbps is not None:
        parts = [f"{_label(t)} {peak:.1f} GB/s ({100 * peak / gbps:.0f}%)" for t, peak in low]
        found.append(
            {
                "kind": "slow",
                "nodes": sorted({int(n) for t, _ in low for n in t["nodes"]}),
                "detail": f"bus bandwidth inside the NVLink domain far below its class {gbps:g} GB/s "
                f"({source}, per GPU per direction): {'; '.join(parts)}",
                "remedy": "check the trays' NVLinks and the switch trays (`nvidia-smi nvlink -s`, "
                "`gputopo check`), and that NVLink SHARP is on (NCCL_NVLS_ENABLE)",
                "metrics": {"nvlink_class_gbs": gbps, "low_fraction": LOW_FRACTION},
            }
        )
    return judged, found, notes


def _label(t: Mapping[str, Any]) -> str:
    if t.get("kind") == "all":
        return "all nodes"
    return f"{t.get('kind')} {'-'.join(map(str, t['nodes']))}"


def drill_log(host: str, pid: int, rank: int, clique_size: int) -> list[str]:
    """The log NCCL writes when MNNVL is available but no IMEX channel is there (``--inject mnnvl`` on
    CPU ranks, which have no NCCL): the rank's fabric line, then the warning, in NCCL's own format."""
    prefix = f"{host}:{pid}:{pid} [0]"
    bus = 0x1B000 + 0x100000 * rank
    return [
        f"{prefix} NCCL INFO MNNVL busId 0x{bus:x} fabric UUID 1f2e3d4c5b6a7988.8897a6b5c4d3e2f1 "
        "cliqueId 0x7fff state 3 healthMask 0x0",
        f"{prefix} mnnvl.cc:74 (ncclMnnvlCheck) NCCL WARN MNNVL (cliqueSize {clique_size}) is available but "
        "not working on this system. Check the IMEX channel configuration (/dev/nvidia-caps-imex-channels). "
        "Set NCCL_MNNVL_ENABLE=0 to ignore this issue.",
    ]
