"""``gputopo check --state FILE``: what one check leaves for the next, and the sections other commands keep
beside it (pure: the document and its rules; ``system.state_file`` reads, locks and writes the file).

- **Drains remembered, resumes acknowledged.** When gputopo drains the node it records when, why and the
  Xid lines that caused it. When a later check finds the node back in service (or drained under someone
  else's reason), a person has taken over: every Xid line up to that moment is acknowledged and never
  drains again; a new line does.
- **Rates across runs.** The error counters of the last check (per GPU UUID, with the wall-clock time) let
  the next check judge them over the time since, so a HealthCheckInterval of minutes sees slow climbs.
- **One answer everywhere.** The last check's judgement (its time, verdict and sick GPUs) is what
  ``recommend``, ``run`` and ``doctor`` use while it is fresh.

**The document** is one JSON object: ``schema`` (``gputopo/check-state/v1``), ``node``, and one top-level
key per *section*, each owned by one writer. ``check`` owns ``drain`` and ``acknowledged`` (the node
record: only a check that acts on Slurm changes them), ``counters``, ``last`` and ``results`` (its
latest judgement), and ``subsystems`` and ``xid_counter`` (``health.subsystems``: what
node-problem-detector's one-subsystem rules answer from, the running Xid counts; written in the same
save, under the lock). Every other top-level key belongs to someone else (``accept`` keeps its verdict
under ``accept``) and is carried through every write untouched, also when this gputopo does not know
it. A file whose schema is newer (``.../v2``) is read only: its sections are not interpreted and nothing
is saved over it (a fleet rolling gputopo back keeps every node's drain and acknowledgements).

**The API for another writer** (``accept``, a per-subsystem result):

- ``StateDoc``: the parsed document (``node``, ``sections``, ``version``); ``doc.section(name)`` reads
  one section (``None`` when absent), ``doc.with_section(name, value)`` returns the document with it
  replaced (``None`` removes it); a name in ``RESERVED`` is refused (``ValueError``).
- ``system.state_file.update_section(path, node, name, change, wait_s)``: the read-modify-write of one
  section under the file's lock: waits at most ``wait_s`` for ``<state>.lock``, re-reads the file under
  it, calls ``change(old_value) -> new_value`` (``old_value`` ``None`` when absent), saves (the previous
  file kept as ``<state>.old``) and returns a ``system.state_file.Saved``: ``saved`` or, with the
  reason, not (lock not got in time, a newer schema, an unsafe path). Nothing else in the file changes.
- ``system.state_file.read_state(path, node)``: a read without the lock (what readers do: a write is a
  rename, so a reader sees the old file or the new one, never half).

A file that is not such a document (corrupt, another program's, another node's) is named in a warning;
the check still runs, from the backup ``<state>.old`` when that is good, else afresh; the next save moves
the bad file aside to ``<state>.bad`` (never silently replaced).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gputopo.findings import PROBLEM, Finding
from gputopo.health.readings import GpuHealth, HealthSample, NvlinkHealth
from gputopo.health.xid import Acknowledged

SCHEMA_PREFIX = "gputopo/check-state/v"
VERSION = 1
SCHEMA = f"{SCHEMA_PREFIX}{VERSION}"
# The top-level keys that are not sections.
RESERVED = frozenset({"schema", "node"})
# check's sections: the node record (only a check acting on Slurm writes it) and its latest judgement.
NODE_RECORD_SECTIONS = ("drain", "acknowledged")
JUDGEMENT_SECTIONS = ("counters", "last", "results")
# The rule set of a check without --thresholds; at most MAX_RESULTS rule sets are kept (the oldest go).
DEFAULT_RULE_SET = "default"
MAX_RESULTS = 32
CHECK_SECTIONS = (*NODE_RECORD_SECTIONS, *JUDGEMENT_SECTIONS)
# Where root keeps it by default (--drain/--resume-if-healthy); GPUTOPO_CHECK_STATE names another.
DEFAULT_ROOT_PATH = "/var/lib/gputopo/check-state.json"
STATE_ENV = "GPUTOPO_CHECK_STATE"
# The most acknowledged lines remembered (the oldest are forgotten first; they age out of --since anyway).
MAX_KEYS = 2000
# What the other commands' "not checked" line calls a state file that could not be used.
LAST_CHECK_WHAT = "the last gputopo check"
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
    # The latest judgement of each rule set (``--thresholds`` file, or ``default``): one check per
    # subsystem (node-problem-detector's rules) each keeps its own, so a healthy run of one never erases
    # another's fresh problems. Rule set -> {at, verdict, unhealthy, uuids, problems}.
    results: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def acknowledged(self) -> Acknowledged | None:
        if self.ack_until is None and not self.ack_keys:
            return None
        return Acknowledged(self.ack_until, frozenset(self.ack_keys), self.ack_by or "a person's resume")

    def to_json(self) -> dict[str, Any]:
        return {
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
            "results": {k: dict(v) for k, v in sorted(self.results.items())},
        }


def dumps(state: CheckState) -> str:
    return json.dumps(state.to_json(), indent=1, sort_keys=True) + "\n"


@dataclass(frozen=True)
class StateDoc:
    """The whole state document: the node it is about, every section by its top-level key (check's and
    everyone else's, known or not), and the schema version it was written in (above ``VERSION``: written
    by a newer gputopo, read only)."""

    node: str
    sections: Mapping[str, Any] = field(default_factory=dict)
    version: int = VERSION

    @property
    def newer(self) -> bool:
        return self.version > VERSION

    def section(self, name: str) -> Any:
        """The section ``name`` as stored (``None`` when absent)."""
        return self.sections.get(name)

    def with_section(self, name: str, value: Any) -> StateDoc:
        """This document with section ``name`` replaced by ``value`` (``None`` removes it); the other
        sections as they are. ``ValueError`` for a reserved key (``schema``, ``node``)."""
        if name in RESERVED or not name:
            raise ValueError(f"{name!r} is not a section name")
        sections = {k: v for k, v in self.sections.items() if k != name}
        if value is not None:
            sections[name] = value
        return replace(self, sections=sections)

    def to_json(self) -> dict[str, Any]:
        return {**self.sections, "schema": f"{SCHEMA_PREFIX}{self.version}", "node": self.node}


def dumps_doc(doc: StateDoc) -> str:
    return json.dumps(doc.to_json(), indent=1, sort_keys=True) + "\n"


def version_of(schema: Any) -> int | None:
    """The version in ``gputopo/check-state/vN`` (``None``: not a gputopo check state's schema)."""
    if not isinstance(schema, str) or not schema.startswith(SCHEMA_PREFIX):
        return None
    digits = schema[len(SCHEMA_PREFIX) :]
    return int(digits) if digits.isdigit() and len(digits) < 6 else None


def parse_doc(doc: Any, label: str, node: str) -> tuple[StateDoc | None, str | None]:
    """The state document in the parsed JSON ``doc`` for ``node``: (the document, ``None``); (``None``, why
    not) when it is not one (not a gputopo check state, another node's); a newer schema comes back
    with its sections kept as they are and a warning (read only). ``label`` starts the messages."""
    version = version_of(doc.get("schema")) if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or version is None or version < 1:
        what = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        return None, f"{label}: not a gputopo check state ({str(what)[:80]!r})"
    if doc.get("node") != node:
        return None, (
            f"{label}: the state of node {str(doc.get('node'))[:80]!r}, not {node!r} (give each node its "
            "own file)"
        )
    sections = {str(k): v for k, v in doc.items() if k not in RESERVED}
    parsed = StateDoc(node, sections, version)
    if parsed.newer:
        return parsed, (
            f"{label}: written by a newer gputopo (schema v{version}; this one knows v{VERSION}): read "
            "only, nothing is saved and nothing in it is used (upgrade gputopo on this node)"
        )
    return parsed, None


def check_state(doc: StateDoc | None, node: str) -> CheckState:
    """check's own sections of ``doc`` (a fresh state when there is none, or it is newer than this
    gputopo knows: its layout is not guessed at)."""
    if doc is None or doc.newer:
        return CheckState(node)
    try:
        return _from_json(dict(doc.sections), node)
    except (ValueError, TypeError, AttributeError):
        return CheckState(node)


def with_check_state(doc: StateDoc | None, state: CheckState) -> StateDoc:
    """``doc`` with check's sections replaced by ``state``'s; everyone else's sections as they were."""
    out = doc if doc is not None else StateDoc(state.node)
    mine = state.to_json()
    return replace(out, sections={**out.sections, **{name: mine[name] for name in CHECK_SECTIONS}})


def node_record(state: CheckState) -> dict[str, Any]:
    """The node record (gputopo's drain and the acknowledgement) as stored: what a check that acts on
    Slurm compares before acting, to see whether another check changed it meanwhile."""
    doc = state.to_json()
    return {name: doc[name] for name in NODE_RECORD_SECTIONS}


# What a check saves of its own over the state re-read under the lock: its judgement and counters, and
# (only when it acted on a record nobody changed meanwhile) the node record: the drain and the
# acknowledgements.
JUDGEMENT_FIELDS = (
    "counters",
    "counters_at",
    "judged_at",
    "verdict",
    "unhealthy",
    "uuids",
    "ports",
    "ports_at",
    "problems",
)
RECORD_FIELDS = ("drained_at", "drained_reason", "drained_events", "ack_until", "ack_keys", "ack_by")


def merged(fresh: CheckState, mine: CheckState, with_record: bool) -> CheckState:
    """What a check saves over ``fresh`` (the state re-read under the lock): its own judgement and
    counters (``mine``); the node record its own too only when ``with_record`` (it acted on a record
    nobody changed meanwhile), else the fresh one, so a plain check never undoes a drain."""
    taken = JUDGEMENT_FIELDS + (RECORD_FIELDS if with_record else ())
    results = _newest({**fresh.results, **mine_only(fresh, mine)})
    return replace(fresh, results=results, **{name: getattr(mine, name) for name in taken})


def mine_only(fresh: CheckState, mine: CheckState) -> dict[str, Mapping[str, Any]]:
    """The rule sets' results ``mine`` judged anew (newer than ``fresh``'s, or not there)."""
    out = {}
    for k, v in mine.results.items():
        old = fresh.results.get(k)
        if old is None or (_num(v.get("at")) or 0) > (_num(old.get("at")) or 0):
            out[k] = v
    return out


def _newest(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    ordered = sorted(results.items(), key=lambda kv: _num(kv[1].get("at")) or 0.0, reverse=True)
    return dict(ordered[:MAX_RESULTS])


def loads(text: str | None, path: str, node: str) -> tuple[CheckState, str | None]:
    """check's state in ``text`` (``None``: no file yet) for ``node``, and a warning when it could not be
    used (not JSON, not a gputopo check state, another node's, a newer schema): then a fresh state. Text
    already within the size and depth caps (``system.state_file`` reads through ``inputs``)."""
    fresh = CheckState(node)
    if text is None:
        return fresh, None
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        return fresh, f"--state {path}: corrupt ({first})"
    doc, warning = parse_doc(raw, f"--state {path}", node)
    return check_state(doc, node), warning


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
        results={
            str(k): v
            for k, v in (doc.get("results") or {}).items()
            if isinstance(v, dict) and _num(v.get("at"))
        },
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
    rule_set: str = DEFAULT_RULE_SET,
) -> CheckState:
    """The judgement other commands read back: the sick GPUs (index -> first problem) and their UUIDs,
    as the latest (``last``) and as ``rule_set``'s own (``results``)."""
    unhealthy: dict[int, str] = {}
    for f in findings:
        if f.severity == PROBLEM and f.gpu is not None:
            unhealthy.setdefault(f.gpu, f.what)
    uuids = {g.index: g.uuid for g in (sample.gpus if sample else ()) if g.uuid}
    counters = counters_of(sample) if sample is not None else dict(state.counters)
    # Every problem, the node's own too (fabric, network): ``gputopo nodes`` names why a node is unfit;
    # ``last_check_findings`` still hands on only those of single GPUs.
    problems = tuple(f.to_json() for f in findings if f.severity == PROBLEM)
    entry = {
        "at": now,
        "verdict": verdict,
        "unhealthy": {str(k): v for k, v in sorted(unhealthy.items())},
        "uuids": {str(k): v for k, v in sorted(uuids.items())},
        "problems": [dict(p) for p in problems],
    }
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
        results=_newest({**state.results, rule_set: entry}),
    )


def _fresh_results(state: CheckState, now: float, max_age_s: float) -> list[tuple[float, Mapping[str, Any]]]:
    """Every rule set's judgement that is fresh, as (at, entry); a state without ``results`` (written by
    an older gputopo) stands as one from its ``last``."""
    entries: list[Mapping[str, Any]] = list(state.results.values())
    if not entries and state.judged_at is not None and state.verdict is not None:
        entries = [
            {
                "at": state.judged_at,
                "verdict": state.verdict,
                "uuids": {str(k): v for k, v in state.uuids.items()},
                "problems": [dict(p) for p in state.problems],
            }
        ]
    out = []
    for e in entries:
        at = _num(e.get("at"))
        if at is None or not isinstance(e.get("verdict"), str):
            continue
        if 0 <= now - at <= max_age_s:
            out.append((at, e))
    return sorted(out, key=lambda x: x[0], reverse=True)


_WORST = {"problems": 2, "unknown": 1, "healthy": 0}


def last_check_findings(
    state: CheckState, now: float, live_uuids: Mapping[int, str | None], max_age_s: float = FRESH_S
) -> tuple[list[Finding], float | None]:
    """The fresh checks' problems on single GPUs (every rule set's, while fresh: ``max_age_s``), for the
    commands that read one sample (recommend, run, topo, probe) or a window of their own (doctor): so they
    agree with ``check`` on which GPUs are sick. Each says how old it is. Only GPUs whose UUID is the one
    the check saw at that index (a renumbered or swapped GPU is not blamed). Also the age of the newest,
    or ``None`` when none is fresh."""
    from gputopo.findings import finding_from_json

    fresh = _fresh_results(state, now, max_age_s)
    if not fresh:
        return [], None
    out = []
    seen: set[tuple[Any, ...]] = set()
    for at, entry in fresh:
        age = now - at
        words = f"{age / 60:.0f} min" if age >= 60 else f"{age:.0f} s"
        uuids = entry.get("uuids") if isinstance(entry.get("uuids"), dict) else {}
        for doc in entry.get("problems") or []:
            if not isinstance(doc, dict):
                continue
            f = finding_from_json(doc)
            key = (f.gpu, f.rule, f.what)
            if f.gpu is None or key in seen:
                continue
            if (live_uuids.get(f.gpu) or None) != (uuids.get(str(f.gpu)) or None):
                continue
            seen.add(key)
            out.append(replace(f, what=f"{f.what} (gputopo check, {words} ago)"))
    return out, now - fresh[0][0]


def fresh_judgement(state: CheckState, now: float, max_age_s: float = FRESH_S) -> dict[str, Any] | None:
    """The fresh checks' judgement, as a node's facts carry it (``gputopo topo --json``'s ``check``):
    ``verdict`` (the worst of every rule set's fresh one), ``at`` (the newest, epoch seconds) and
    ``problems`` (every fresh rule set's, once each); ``None`` when there was none or all are older than
    ``max_age_s`` (then ``gputopo nodes`` counts the node fit, unchecked)."""
    fresh = _fresh_results(state, now, max_age_s)
    if not fresh:
        return None
    verdict = max((e["verdict"] for _, e in fresh), key=lambda v: _WORST.get(v, 1))
    problems: list[dict[str, Any]] = []
    for _, e in fresh:
        for p in e.get("problems") or []:
            if isinstance(p, dict) and p not in problems:
                problems.append(dict(p))
    return {"verdict": verdict, "at": fresh[0][0], "problems": problems}
