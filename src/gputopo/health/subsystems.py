"""One check, judged per subsystem (pure): what node-problem-detector shows as one node condition each,
what Prometheus reads per GPU, and what the check state keeps between runs for both.

- **Subsystems.** GPU memory, NVLink and fabric, Xid, PCIe, IMEX, the driver and GPU readability, and
  acceptance (a fresh ``gputopo accept`` verdict for these GPUs and this driver). Each is OK (0), a
  problem (1: its first problem's rule, words and action) or unknown (3: why it could not be judged):
  never OK with nothing read. IMEX where no daemon is expected is OK (not applicable), never a problem
  (DCGM #308, NVSentinel #1471: IMEX alarms on nodes that run none).
- **One read per interval.** The check that reads NVML records every subsystem's result in the state
  (section ``subsystems``, with when); a node-problem-detector rule for one subsystem answers from that
  record while it is fresh, and says unknown when it is stale or missing (``answer``).
- **Xid counters that only go up.** Every Xid line of the ``--since`` window is counted once per GPU and
  code (section ``xid_counter``: the running counts and the keys of the lines already counted), so a line
  that leaves the window never lowers the count (``count_xids``).
- **Acceptance.** ``accept_status`` reads the ``accept`` section ``gputopo accept`` writes and says whether
  it still holds for the GPUs and driver read now.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gputopo.errors import EXIT_OK, EXIT_PROBLEM, EXIT_UNAVAILABLE
from gputopo.findings import PROBLEM, Finding
from gputopo.health.check import DEFAULT_MAX_AGE_S, HEALTHY, CheckResult
from gputopo.health.readings import NOT_READ, GpuHealth, HealthSample
from gputopo.health.xid import bus_key
from gputopo.model import GPU_NOT_ACCESSIBLE
from gputopo.topology.nvlink_domain import clique_label

SUBSYSTEMS_SECTION = "subsystems"
XID_SECTION = "xid_counter"
ACCEPT_SECTION = "accept"
# The most Xid line keys remembered as counted (the newest kept; older lines have left any window).
MAX_COUNTED_KEYS = 2000
# NVML_GPU_FABRIC_STATE_COMPLETED (nvml.h).
_FABRIC_COMPLETED = 3


@dataclass(frozen=True)
class Subsystem:
    """One subsystem: its name (``check --subsystem``), the node condition node-problem-detector sets
    True while it has a problem (gputopo's own prefix, NPD's PascalCase), and what it covers."""

    name: str
    condition: str
    covers: str


ROLLUP_CONDITION = "GputopoGPUProblem"
SUBSYSTEMS: tuple[Subsystem, ...] = (
    Subsystem("memory", "GputopoGPUMemoryProblem", "ECC errors, row remapping, retired pages"),
    Subsystem("nvlink", "GputopoNVLinkProblem", "NVLink links and counters, fabric registration and health"),
    Subsystem("xid", "GputopoXidProblem", "Xid errors in the kernel log (--since window)"),
    Subsystem("pcie", "GputopoPCIeProblem", "PCIe replays, link width and generation, ACS"),
    Subsystem("imex", "GputopoIMEXProblem", "the IMEX daemon and domain, where one is expected"),
    Subsystem("driver", "GputopoDriverProblem", "the driver loaded and every GPU readable (and counted)"),
    Subsystem("accept", "GputopoNotAccepted", "a fresh `gputopo accept` verdict for these GPUs and driver"),
)
BY_NAME = {s.name: s for s in SUBSYSTEMS}

# gputopo's actions in the words a remedy system keys on (NVSentinel's RecommendedAction style).
RECOMMENDED = {
    "none": "NONE",
    "monitor": "MONITOR",
    "config": "FIX_CONFIG",
    "reset": "RESET_GPU",
    "reboot": "REBOOT_NODE",
    "drain": "DRAIN_NODE",
    "replace": "REPLACE_HARDWARE",
    "accept": "RUN_GPUTOPO_ACCEPT",
}


@dataclass(frozen=True)
class SubsystemResult:
    """One subsystem's answer: ``status`` NPD's exit code (0 OK, 1 problem, 3 unknown), ``rule`` the rule
    behind it (a health rule, or ``ok``, ``not_checked``, ``stale`` ...), ``what`` in words, ``action``
    gputopo's action (``RECOMMENDED`` maps it)."""

    status: int
    rule: str
    what: str
    action: str = "none"

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "rule": self.rule, "what": self.what, "action": self.action}


def subsystem_of(f: Finding) -> str | None:
    """The subsystem a finding belongs to (``None``: only the roll-up shows it: power, thermal, network,
    configuration, baseline changes)."""
    rule = f.rule or ""
    if rule.startswith("imex_"):
        return "imex"
    if rule == "expect_gpus":
        return "driver"
    return {"memory": "memory", "nvlink": "nvlink", "xid": "xid", "pcie": "pcie", "driver": "driver"}.get(
        f.category
    )


def _read(g: GpuHealth) -> bool:
    if g.error is not None or g.state == GPU_NOT_ACCESSIBLE:
        return False
    return not any(u.what == NOT_READ for u in g.unknown)


def gpus_read(sample: HealthSample | None) -> list[GpuHealth]:
    """The GPUs whose health values were read (not lost, refused, hung or cut off by the budget)."""
    return [g for g in (sample.gpus if sample is not None else ()) if _read(g)]


def sample_clique(sample: HealthSample | None) -> str | None:
    """``nvidia.com/gpu.clique``'s value for the GPUs of a health sample (``topology.nvlink_domain``)."""
    return clique_label(
        (g.fabric_state == _FABRIC_COMPLETED, g.fabric_status, g.fabric_cluster_uuid, g.fabric_clique_id)
        for g in (sample.gpus if sample is not None else ())
    )


def judge(result: CheckResult, accepted: AcceptStatus | None = None) -> dict[str, SubsystemResult]:
    """Every subsystem's result from one check (``accepted``: the acceptance as ``accept_status`` says;
    ``None`` leaves acceptance unknown)."""
    up = bool(gpus_read(result.sample))
    why_down = result.reason if result.verdict != HEALTHY else "no GPU could be read"
    out: dict[str, SubsystemResult] = {}
    for s in SUBSYSTEMS:
        if s.name == "accept":
            out[s.name] = _accept_result(accepted, up, why_down)
            continue
        problems = [f for f in result.findings if f.severity == PROBLEM and subsystem_of(f) == s.name]
        if problems:
            first = problems[0]
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            out[s.name] = SubsystemResult(EXIT_PROBLEM, first.rule or s.name, first.what + more, first.action)
            continue
        unknown = _why_unknown(s.name, result, up, why_down)
        if unknown is not None:
            out[s.name] = SubsystemResult(EXIT_UNAVAILABLE, "not_checked", unknown)
            continue
        out[s.name] = SubsystemResult(EXIT_OK, "ok", _ok_words(s.name, result))
    return out


def _why_unknown(name: str, result: CheckResult, up: bool, why_down: str) -> str | None:
    skipped = {n.what: n.why for n in result.not_checked}
    if name == "xid":
        return skipped.get("Xid")
    if name == "imex":
        why = skipped.get("IMEX") or skipped.get("IMEX domain")
        if why is not None and why.startswith("no IMEX daemon expected here"):
            return None  # not applicable here: OK, never an alarm (DCGM #308)
        return why
    if not up:
        return why_down
    return None


def _ok_words(name: str, result: CheckResult) -> str:
    n = len(gpus_read(result.sample))
    gpus = f"{n} GPU{'s' if n != 1 else ''}"
    if name == "imex":
        why = next((x.why for x in result.not_checked if x.what == "IMEX"), None)
        return "not applicable: " + why if why else "the IMEX daemon is ready and the domain up"
    if name == "xid":
        return "no Xid error in the window"
    if name == "nvlink":
        clique = sample_clique(result.sample)
        return f"no NVLink or fabric problem on {gpus}" + (f"; gpu.clique {clique}" if clique else "")
    if name == "driver":
        return f"the driver answers and every GPU is readable ({gpus})"
    return f"no {'PCIe' if name == 'pcie' else 'GPU memory'} problem on {gpus}"


# --- acceptance ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AcceptStatus:
    """Whether the node holds a fresh acceptance: ``state`` ``accepted``, ``rejected``, ``stale`` (given for
    other GPUs or another driver or VBIOS), ``none`` (never accepted) or ``unknown`` (nothing read now to
    compare with); ``why`` in words; ``at`` when the verdict was given (epoch seconds)."""

    state: str
    why: str
    at: float | None = None

    @property
    def accepted(self) -> bool:
        return self.state == "accepted"


ACCEPT_STATES = ("accepted", "rejected", "stale", "none", "unknown")


def accept_status(section: Any, sample: HealthSample | None) -> AcceptStatus:
    """The ``accept`` section of the state (``gputopo accept``'s verdict: ``verdict``, ``at``, ``driver``,
    ``gpus`` [{``uuid``, ``vbios``, ``serial``}]) judged against the GPUs read now: stale when the driver,
    the set of GPUs (by UUID) or a GPU's VBIOS changed since. Serials are compared where both sides have
    them; the health sample reads none, so the UUID stands for the board."""
    if not isinstance(section, Mapping) or not isinstance(section.get("verdict"), str):
        return AcceptStatus("none", "no gputopo accept verdict on this node")
    at = section.get("at") if isinstance(section.get("at"), (int, float)) else None
    verdict = section["verdict"]
    if verdict != "accepted":
        reason = section.get("reason") if isinstance(section.get("reason"), str) else None
        said = f"gputopo accept said {verdict!r}" + (f": {reason}" if reason else "")
        return AcceptStatus("rejected", said, at)
    read = gpus_read(sample)
    if not read or sample is None:
        return AcceptStatus("unknown", "no GPU could be read to compare with the accepted ones", at)
    then_driver = section.get("driver")
    if isinstance(then_driver, str) and sample.driver_version and then_driver != sample.driver_version:
        return AcceptStatus(
            "stale", f"not accepted since the driver changed ({then_driver} -> {sample.driver_version})", at
        )
    then = {
        str(g.get("uuid")): g
        for g in section.get("gpus") or ()
        if isinstance(g, Mapping) and isinstance(g.get("uuid"), str)
    }
    now = {g.uuid: g for g in (sample.gpus if sample is not None else ()) if g.uuid}
    if then and set(then) != set(now):
        gone, new = sorted(set(then) - set(now)), sorted(set(now) - set(then))
        words = ", ".join([*(f"{u} gone" for u in gone), *(f"{u} new" for u in new)])
        return AcceptStatus("stale", f"not accepted since the GPUs changed ({words})", at)
    for uuid, old in then.items():
        vbios, live = old.get("vbios"), now[uuid].vbios_version
        if isinstance(vbios, str) and live and vbios != live:
            return AcceptStatus(
                "stale",
                f"not accepted since GPU{now[uuid].index}'s VBIOS changed ({vbios} -> {live})",
                at,
            )
    return AcceptStatus("accepted", "accepted for these GPUs and this driver", at)


def _accept_result(accepted: AcceptStatus | None, up: bool, why_down: str) -> SubsystemResult:
    if accepted is None or accepted.state == "unknown":
        return SubsystemResult(EXIT_UNAVAILABLE, "not_checked", accepted.why if accepted else why_down)
    if accepted.accepted:
        return SubsystemResult(EXIT_OK, "ok", accepted.why)
    rule = {"stale": "accept_stale", "rejected": "accept_rejected"}.get(accepted.state, "accept_missing")
    # Never accepted, or for other GPUs or another driver: run gputopo accept; rejected: keep it out.
    action = "drain" if accepted.state == "rejected" else "accept"
    return SubsystemResult(EXIT_PROBLEM, rule, accepted.why, action)


# --- the record that one-subsystem rules answer from --------------------------------------------------------


def record(results: Mapping[str, SubsystemResult], now: float, clique: str | None) -> dict[str, Any]:
    """The ``subsystems`` section one check leaves."""
    return {"at": now, "gpu_clique": clique, "results": {k: v.to_json() for k, v in results.items()}}


def answer(section: Any, name: str, now: float, max_age_s: float = DEFAULT_MAX_AGE_S) -> SubsystemResult:
    """Subsystem ``name``'s result from the recorded section, while it is at most ``max_age_s`` old:
    stale, missing or unreadable is unknown (exit 3), never OK."""
    if not isinstance(section, Mapping) or not isinstance(section.get("at"), (int, float)):
        return SubsystemResult(
            EXIT_UNAVAILABLE,
            "no_result",
            "no check has recorded a result yet (the rule that runs `gputopo check --state` goes first)",
        )
    age = now - float(section["at"])
    if age < 0 or age > max_age_s:
        return SubsystemResult(
            EXIT_UNAVAILABLE,
            "stale",
            f"the last check's result is {age:.0f} s old (more than --max-age {max_age_s:g} s)",
        )
    doc = (section.get("results") or {}).get(name) if isinstance(section.get("results"), Mapping) else None
    if not isinstance(doc, Mapping) or doc.get("status") not in (EXIT_OK, EXIT_PROBLEM, EXIT_UNAVAILABLE):
        return SubsystemResult(EXIT_UNAVAILABLE, "no_result", f"the last check recorded no {name} result")
    rule, what = str(doc.get("rule") or name), str(doc.get("what") or "")
    return SubsystemResult(int(doc["status"]), rule, what, str(doc.get("action") or "none"))


# --- Xid counters -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class XidCount:
    """How many Xid ``xid`` lines were counted on one GPU (``uuid``, ``index`` as last seen; an Xid on a
    PCI address no GPU has: ``uuid`` and ``index`` ``None``, ``pci_bus_id`` that address)."""

    uuid: str | None
    index: int | None
    pci_bus_id: str
    xid: int
    count: int

    def to_json(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "index": self.index,
            "pci_bus_id": self.pci_bus_id,
            "xid": self.xid,
            "count": self.count,
        }


def _counts_of(section: Any) -> list[XidCount]:
    out = []
    for c in (section.get("counts") or []) if isinstance(section, Mapping) else []:
        if not isinstance(c, Mapping) or not all(isinstance(c.get(k), int) for k in ("xid", "count")):
            continue
        out.append(
            XidCount(
                c.get("uuid") if isinstance(c.get("uuid"), str) else None,
                c.get("index") if isinstance(c.get("index"), int) else None,
                str(c.get("pci_bus_id") or ""),
                c["xid"],
                c["count"],
            )
        )
    return out


def count_xids(
    section: Any, events: Sequence[tuple[str, str, int]], sample: HealthSample | None
) -> tuple[dict[str, Any], list[XidCount]]:
    """Add the window's Xid lines (``CheckResult.xid_events``) not counted before to the running counts
    in ``section`` (``None``: the first run); the new section and the counts. A line is counted once, by
    its key; a GPU is named by its UUID (its index and bus id as read now), so a renumbered GPU keeps
    its count."""
    counted = [str(k) for k in (section.get("counted") or [])] if isinstance(section, Mapping) else []
    seen = set(counted)
    by_bus: dict[tuple[int, int, int], GpuHealth] = {}
    for g in sample.gpus if sample is not None else ():
        key = bus_key(g.pci_bus_id) if g.pci_bus_id else None
        if key is not None:
            by_bus[key] = g
    counts = {(c.uuid or f"bus:{c.pci_bus_id}", c.xid): c for c in _counts_of(section)}
    for line_key, address, xid in events:
        if line_key in seen:
            continue
        seen.add(line_key)
        counted.append(line_key)
        bk = bus_key(address)
        g = by_bus.get(bk) if bk is not None else None
        who = g.uuid if g is not None and g.uuid else f"bus:{address.lower()}"
        n = counts[(who, xid)].count + 1 if (who, xid) in counts else 1
        if g is not None and g.uuid:
            counts[(who, xid)] = XidCount(g.uuid, g.index, g.pci_bus_id or "", xid, n)
        else:
            counts[(who, xid)] = XidCount(None, None, address.lower(), xid, n)
    # The index and bus id as read now for every GPU counted before (a renumbered GPU keeps its count).
    by_uuid = {g.uuid: g for g in (sample.gpus if sample is not None else ()) if g.uuid}
    rows = []
    for c in counts.values():
        g = by_uuid.get(c.uuid) if c.uuid else None
        rows.append(XidCount(c.uuid, g.index, g.pci_bus_id or c.pci_bus_id, c.xid, c.count) if g else c)
    rows.sort(key=lambda c: (c.index is None, c.index or 0, c.pci_bus_id, c.xid))
    doc = {"counted": counted[-MAX_COUNTED_KEYS:], "counts": [c.to_json() for c in rows]}
    return doc, rows


def sections_after(
    sections: Mapping[str, Any], result: CheckResult, now: float
) -> tuple[dict[str, Any], AcceptStatus, tuple[XidCount, ...]]:
    """What one check writes for the rules and metrics that follow, from the state's sections as they are
    (read under the state's lock where there is one, so two checks never count a line twice): the new
    ``subsystems`` and ``xid_counter`` sections; also the acceptance as judged now (from ``accept``'s
    section, never written here) and the Xid counts, for the metrics."""
    accepted = accept_status(sections.get(ACCEPT_SECTION), result.sample)
    xid_doc, counts = count_xids(sections.get(XID_SECTION), result.xid_events, result.sample)
    results = judge(result, accepted)
    new = {
        SUBSYSTEMS_SECTION: record(results, now, sample_clique(result.sample)),
        XID_SECTION: xid_doc,
    }
    return new, accepted, tuple(counts)
