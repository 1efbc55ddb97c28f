"""``gputopo check --state FILE``: what one check leaves for the next (pure: the document and its rules).

- **Drains remembered, resumes acknowledged.** When gputopo drains the node it records when, why and the
  Xid lines that caused it. When a later check finds the node back in service (or drained under someone
  else's reason), a person has taken over: every Xid line up to that moment is acknowledged and never
  drains again; a new line does.
- **Rates across runs.** The error counters of the last check (per GPU UUID, with the wall-clock time) let
  the next check judge them over the time since, so a HealthCheckInterval of minutes sees slow climbs.
- **One answer everywhere.** The last check's judgement (its time, verdict and sick GPUs) is what
  ``recommend``, ``run`` and ``doctor`` use while it is fresh.

A file that is not such a document (corrupt, another program's, another node's) is named in a warning and
replaced, never a crash: the check still runs, with a fresh state.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gputopo.findings import PROBLEM, Finding
from gputopo.health.readings import GpuHealth, HealthSample, NvlinkHealth
from gputopo.health.xid import Acknowledged

SCHEMA = "gputopo/check-state/v1"
# Where root keeps it by default (--drain/--resume-if-healthy); GPUTOPO_CHECK_STATE names another.
DEFAULT_ROOT_PATH = "/var/lib/gputopo/check-state.json"
STATE_ENV = "GPUTOPO_CHECK_STATE"
# The most acknowledged lines remembered (the oldest are forgotten first; they age out of --since anyway).
MAX_KEYS = 2000
# How old the last check's judgement may be for recommend/run/doctor to use it.
FRESH_S = 900.0


@dataclass(frozen=True)
class CheckState:
    """The state one check leaves: the node it is about; gputopo's drain (``drained_at`` epoch seconds,
    ``drained_reason``, ``drained_events`` the Xid line keys that caused it); the acknowledgement
    (``ack_until``, ``ack_keys``, ``ack_by``); the counters of the last check (``counters`` per UUID,
    taken at ``counters_at``); and the last judgement (``judged_at``, ``verdict``, ``unhealthy`` GPU
    index -> its first problem, ``uuids`` index -> UUID)."""

    node: str
    drained_at: float | None = None
    drained_reason: str | None = None
    drained_events: tuple[str, ...] = ()
    ack_until: float | None = None
    ack_keys: tuple[str, ...] = ()
    ack_by: str | None = None
    counters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    counters_at: float | None = None
    judged_at: float | None = None
    verdict: str | None = None
    unhealthy: Mapping[int, str] = field(default_factory=dict)
    uuids: Mapping[int, str] = field(default_factory=dict)
    # The network ports' counters of the last check (port name -> counter -> value), taken at ``ports_at``
    # (``health.network.since_last_run`` judges their rise since).
    ports: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    ports_at: float | None = None
    problems: tuple[Mapping[str, Any], ...] = ()
    # Every other top-level key of the document, carried through untouched: the sections other writers
    # own (``accept``'s verdict) and those ``health.subsystems`` keeps (``subsystems``, ``xid_counter``).
    sections: Mapping[str, Any] = field(default_factory=dict)

    @property
    def acknowledged(self) -> Acknowledged | None:
        if self.ack_until is None and not self.ack_keys:
            return None
        return Acknowledged(self.ack_until, frozenset(self.ack_keys), self.ack_by or "a person's resume")

    def to_json(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in self.sections.items() if k not in _OWN_KEYS},
            "schema": SCHEMA,
            "node": self.node,
            "drain": None
            if self.drained_at is None
            else {"at": self.drained_at, "reason": self.drained_reason, "events": list(self.drained_events)},
            "acknowledged": {"until": self.ack_until, "keys": list(self.ack_keys), "by": self.ack_by},
            "counters": {
                "at": self.counters_at,
                "gpus": dict(self.counters),
                "ports": dict(self.ports),
                "ports_at": self.ports_at,
            },
            "last": {
                "at": self.judged_at,
                "verdict": self.verdict,
                "unhealthy": {str(k): v for k, v in sorted(self.unhealthy.items())},
                "uuids": {str(k): v for k, v in sorted(self.uuids.items())},
                "problems": [dict(p) for p in self.problems],
            },
        }


# The top-level keys CheckState's own fields make; any other key is a section (``CheckState.sections``).
_OWN_KEYS = frozenset({"schema", "node", "drain", "acknowledged", "counters", "last"})


def with_section(state: CheckState, name: str, value: Any) -> CheckState:
    """``state`` with its section ``name`` replaced (``None``: removed)."""
    sections = {k: v for k, v in state.sections.items() if k != name}
    if value is not None:
        sections[name] = value
    return replace(state, sections=sections)


def dumps(state: CheckState) -> str:
    return json.dumps(state.to_json(), indent=1, sort_keys=True) + "\n"


def loads(text: str | None, path: str, node: str) -> tuple[CheckState, str | None]:
    """The state in ``text`` (``None``: no file yet) for ``node``, and a warning when the file had to be
    replaced (not JSON, not a gputopo check state, another node's): then a fresh state."""
    fresh = CheckState(node)
    if text is None:
        return fresh, None
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            what = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
            return fresh, f"--state {path}: not a gputopo check state ({what!r}); it is replaced"
        if doc.get("node") != node:
            return fresh, (
                f"--state {path}: the state of node {doc.get('node')!r}, not {node!r}; it is replaced "
                "(give each node its own file)"
            )
        return _from_json(doc, node), None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        return fresh, f"--state {path}: corrupt ({first}); it is replaced"


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _strs(v: Any) -> tuple[str, ...]:
    return tuple(str(x) for x in v) if isinstance(v, list) else ()


def _from_json(doc: dict[str, Any], node: str) -> CheckState:
    drain = doc.get("drain") or {}
    ack = doc.get("acknowledged") or {}
    counters = doc.get("counters") or {}
    last = doc.get("last") or {}
    gpus = counters.get("gpus") if isinstance(counters.get("gpus"), dict) else {}
    return CheckState(
        node=node,
        drained_at=_num(drain.get("at")),
        drained_reason=drain.get("reason") if isinstance(drain.get("reason"), str) else None,
        drained_events=_strs(drain.get("events")),
        ack_until=_num(ack.get("until")),
        ack_keys=_strs(ack.get("keys")),
        ack_by=ack.get("by") if isinstance(ack.get("by"), str) else None,
        counters={str(k): v for k, v in gpus.items() if isinstance(v, dict)},
        counters_at=_num(counters.get("at")),
        judged_at=_num(last.get("at")),
        verdict=last.get("verdict") if isinstance(last.get("verdict"), str) else None,
        unhealthy={int(k): str(v) for k, v in (last.get("unhealthy") or {}).items()},
        uuids={int(k): str(v) for k, v in (last.get("uuids") or {}).items()},
        ports={str(k): v for k, v in (counters.get("ports") or {}).items() if isinstance(v, dict)},
        ports_at=_num(counters.get("ports_at")),
        problems=tuple(p for p in (last.get("problems") or []) if isinstance(p, dict)),
        sections={k: v for k, v in doc.items() if k not in _OWN_KEYS},
    )


def took_over(state: CheckState, node_out_of_service: bool, node_reason_ours: bool, now: float) -> CheckState:
    """A person took over gputopo's drain (resumed the node, or drained it under their own reason): every
    Xid line up to ``now`` and those that drained are acknowledged; gputopo's drain is forgotten. The state
    as it was when gputopo's drain still stands (or there was none)."""
    if state.drained_at is None or (node_out_of_service and node_reason_ours):
        return state
    by = "a person's resume" if not node_out_of_service else "a person's own drain"
    keys = (*state.ack_keys, *state.drained_events)[-MAX_KEYS:]
    return replace(
        state,
        drained_at=None,
        drained_reason=None,
        drained_events=(),
        ack_until=now,
        ack_keys=keys,
        ack_by=by,
    )


def drained(state: CheckState, reason: str, events: Iterable[str], now: float) -> CheckState:
    return replace(state, drained_at=now, drained_reason=reason, drained_events=tuple(events)[-MAX_KEYS:])


def resumed(state: CheckState) -> CheckState:
    return replace(state, drained_at=None, drained_reason=None, drained_events=())


# --- counters across runs ---------------------------------------------------------------------------------

_GPU_COUNTERS = ("ecc_volatile_uncorrected", "pcie_replays")
_LINK_COUNTERS = ("replay_errors", "recovery_errors", "crc_flit_errors", "crc_data_errors")
# The rules judged again over the time since the last run (rates and rises).
COUNTER_RULES = frozenset(
    {"nvlink_replay_rise", "nvlink_recovery_rise", "nvlink_crc_per_s", "nvlink_crc_rise", "pcie_replay_rate"}
)


def counters_of(sample: HealthSample) -> dict[str, dict[str, Any]]:
    """The error counters of every GPU read (by UUID) as the state keeps them."""
    out: dict[str, dict[str, Any]] = {}
    for g in sample.gpus:
        if g.uuid is None or g.error is not None:
            continue
        doc: dict[str, Any] = {k: getattr(g, k) for k in _GPU_COUNTERS}
        doc["links"] = {str(n.link): [getattr(n, k) for k in _LINK_COUNTERS] for n in g.nvlinks or ()}
        out[g.uuid] = doc
    return out


def previous_sample(state: CheckState, now_sample: HealthSample) -> HealthSample | None:
    """The last check's counters as a sample of the GPUs read now (matched by UUID; ``None`` when none
    match): the judge's first sample for the time since the last run."""
    gpus: list[GpuHealth] = []
    for g in now_sample.gpus:
        old = state.counters.get(g.uuid or "")
        if old is None:
            continue
        links = old.get("links") if isinstance(old.get("links"), dict) else {}
        nvlinks = []
        for k, values in links.items():
            if not isinstance(values, list) or len(values) != len(_LINK_COUNTERS) or not str(k).isdigit():
                continue
            vals = [v if isinstance(v, int) and not isinstance(v, bool) else None for v in values]
            nvlinks.append(NvlinkHealth(int(k), None, None, None, *vals))
        kw = {k: old.get(k) if isinstance(old.get(k), int) else None for k in _GPU_COUNTERS}
        gpus.append(GpuHealth(g.index, g.pci_bus_id, g.uuid, nvlinks=tuple(nvlinks) or None, **kw))
    if not gpus:
        return None
    return HealthSample(tuple(gpus), taken_s=0.0)


def since_last_run(findings: Sequence[Finding], window: Sequence[Finding], minutes: float) -> list[Finding]:
    """The counter findings judged over the time since the last run that the sample window did not find
    already (same rule on the same GPU), their words saying over what time."""
    seen = {(f.rule, f.gpu) for f in window}
    out = []
    for f in findings:
        if f.rule not in COUNTER_RULES or (f.rule, f.gpu) in seen:
            continue
        out.append(replace(f, what=f"{f.what} [since the last check, {minutes:.0f} min ago]"))
    return out


def remember_judgement(
    state: CheckState,
    now: float,
    verdict: str,
    findings: Sequence[Finding],
    sample: HealthSample | None,
    ports: Mapping[str, Mapping[str, int]] | None = None,
) -> CheckState:
    """The judgement other commands read back: the sick GPUs (index -> first problem) and their UUIDs."""
    unhealthy: dict[int, str] = {}
    for f in findings:
        if f.severity == PROBLEM and f.gpu is not None:
            unhealthy.setdefault(f.gpu, f.what)
    uuids = {g.index: g.uuid for g in (sample.gpus if sample else ()) if g.uuid}
    counters = counters_of(sample) if sample is not None else dict(state.counters)
    # Every problem, the node's own too (fabric, network): ``gputopo nodes`` names why a node is unfit;
    # ``last_check_findings`` still hands on only those of single GPUs.
    problems = tuple(f.to_json() for f in findings if f.severity == PROBLEM)
    return replace(
        state,
        judged_at=now,
        verdict=verdict,
        unhealthy=unhealthy,
        uuids=uuids,
        problems=problems,
        counters=counters,
        counters_at=now if sample is not None else state.counters_at,
        ports=dict(ports) if ports else state.ports,
        ports_at=now if ports else state.ports_at,
    )


def last_check_findings(
    state: CheckState, now: float, live_uuids: Mapping[int, str | None], max_age_s: float = FRESH_S
) -> tuple[list[Finding], float | None]:
    """The last check's problems on single GPUs, while it is fresh (``max_age_s``), for the commands that
    read one sample (recommend, run, topo, probe) or a window of their own (doctor): so they agree with
    ``check`` on which GPUs are sick. Each says how old it is. Only GPUs whose UUID is the one the check
    saw at that index (a renumbered or swapped GPU is not blamed). Also the age, or ``None`` when stale."""
    from gputopo.findings import finding_from_json

    if state.judged_at is None:
        return [], None
    age = now - state.judged_at
    if age < 0 or age > max_age_s:
        return [], None
    words = f"{age / 60:.0f} min" if age >= 60 else f"{age:.0f} s"
    out = []
    for doc in state.problems:
        f = finding_from_json(doc)
        if f.gpu is None or (live_uuids.get(f.gpu) or None) != (state.uuids.get(f.gpu) or None):
            continue
        out.append(replace(f, what=f"{f.what} (gputopo check, {words} ago)"))
    return out, age


def fresh_judgement(state: CheckState, now: float, max_age_s: float = FRESH_S) -> dict[str, Any] | None:
    """The last check's judgement while fresh, as a node's facts carry it (``gputopo topo --json``'s
    ``check``): ``verdict``, ``at`` (epoch seconds) and ``problems`` (findings); ``None`` when there was
    none or it is older than ``max_age_s`` (then ``gputopo nodes`` counts the node fit, unchecked)."""
    if state.judged_at is None or state.verdict is None:
        return None
    age = now - state.judged_at
    if age < 0 or age > max_age_s:
        return None
    return {"verdict": state.verdict, "at": state.judged_at, "problems": [dict(p) for p in state.problems]}
