"""Verdicts, findings and the ``gputopo/hang/v1`` document (pure): the matching's stuck groups joined
with where each rank ran (run records, NCCL RAS) and what gputopo knows of that GPU's health.

Verdicts: ``mismatch`` (ranks called different collectives, sizes or dtypes), ``hang`` (a group waits
on ranks that never entered, died without a dump, or are stuck inside), ``no_hang`` (every rank
completed everything it recorded and every rank has a dump), ``incomplete`` (nothing stuck in the dumps
there are, but dumps are missing or RAS names troubled ranks: the dumps cannot rule a hang out).
Exit codes: 0 no_hang, 1 hang or mismatch, 3 incomplete or nothing to analyse (2 is bad input, raised
before a report exists).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gputopo.hang.load import Loaded
from gputopo.hang.match import (
    MISMATCH,
    NEVER_ENTERED,
    NO_DUMP,
    STUCK_INSIDE,
    GroupResult,
    MatchResult,
    Suspect,
)
from gputopo.hang.ras import RasRank, RasReport
from gputopo.hang.record import Placement
from gputopo.hang.stacks import NOT_IN_COLLECTIVE, OTHER_COLLECTIVE, RankStack, StackVerdict, judge

SCHEMA = "gputopo/hang/v1"
# Why NCCL RAS blames a rank (a ``suspects`` row's ``why``): dead, missing, aborted or in an asynchronous
# error; or behind the others of its communicator in a collective's count (RAS MISMATCH).
RAS_TROUBLED, RAS_LAGGING = "ras_troubled", "ras_lagging"
_STACK_WHYS = (NOT_IN_COLLECTIVE, OTHER_COLLECTIVE)
HANG, MISMATCHED, NO_HANG, INCOMPLETE = "hang", "mismatch", "no_hang", "incomplete"
EXIT_CODES = {NO_HANG: 0, HANG: 1, MISMATCHED: 1, INCOMPLETE: 3}

# Health findings, finding-shaped dicts, per (host, GPU index): filled by whoever can read that host's
# GPUs (this machine's, or a future gathered ``gputopo check`` per node).
Health = Mapping[tuple[str, int], Sequence[Mapping[str, Any]]]
# A stuck group's collective in the document: these keys of its call (``peer``: point-to-point only).
GROUP_CALL_KEYS = ("seq", "op", "sizes", "dtype", "backend", "peer")

_REMEDY = {
    NEVER_ENTERED: (
        "a rank that never entered the collective took another code path (a collective under a condition, "
        "an exception caught and swallowed, a rank that ran out of data first) or its process is stalled "
        "or dead: read that rank's log and live stack (`py-spy dump --pid PID` on its host), and make every "
        "rank call the same collectives in the same order"
    ),
    MISMATCH: (
        "every rank must call the same collective with the same sizes and dtypes in the same order; the "
        "code differs between ranks (a shape from the rank's own data, a cast on one path). "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL checks each collective's shapes while the job runs"
    ),
    STUCK_INSIDE: (
        "every rank entered and this one did not finish: with no code difference left, look at the GPU and "
        "its links (`gputopo check` on that host; NVLink errors or an Xid mean the hardware: drain the "
        "node), then at the network between the hosts (NCCL_DEBUG=INFO, `ncclras`)"
    ),
    NO_DUMP: (
        "the process died or could not write its dump: look for its exit code, the OOM killer (`dmesg`), an "
        "Xid on its GPU; with NCCL set TORCH_NCCL_DUMP_ON_TIMEOUT=1 and a writable TORCH_FR_DUMP_TEMP_FILE "
        "folder (`gputopo run` does both)"
    ),
}
_REMEDY_STACK = (
    "this rank is not where the others wait: its frame is where it is stuck (a data loader, I/O, a lock, "
    "a loop that does not end, a different code path); fix that code, or look at its host if the frame "
    "is in I/O"
)
_HARDWARE_CATEGORIES = {"memory", "nvlink", "pcie", "thermal", "power", "xid", "driver"}


@dataclass(frozen=True)
class Blame:
    """A rank a problem finding blames, made with that finding (``_Findings.blame``): the one source of
    the top-level ``suspects`` and of the headline's count, so neither can leave out a rank the findings
    name. ``rank`` is global unless ``ras`` numbers it within its communicator (no run record maps it)."""

    rank: int
    why: str
    what: str
    group: str | None = None
    frame: str | None = None
    ras: RasRank | None = None
    within_comm: bool = False

    @property
    def key(self) -> tuple[int, str | None]:
        """The rank as one thing: a global rank, or a rank of one communicator."""
        return (self.rank, self.ras.comm if self.within_comm and self.ras else None)

    @property
    def label(self) -> str:
        return f"rank {self.rank} of communicator {self.key[1]}" if self.key[1] else str(self.rank)


class _Findings:
    """The findings as they are written, and the ranks the problems among them blame."""

    def __init__(self) -> None:
        self.all: list[dict[str, Any]] = []
        self.blamed: list[Blame] = []

    def add(self, finding: dict[str, Any]) -> None:
        self.all.append(finding)

    def blame(self, finding: dict[str, Any], blame: Blame) -> None:
        """A finding that blames a rank: it and its suspect are written together."""
        self.all.append(finding)
        self.blamed.append(blame)


@dataclass(frozen=True)
class HangReport:
    """The analysis of one hung job, ready to print or to write as JSON."""

    verdict: str
    reason: str
    match: MatchResult | None
    placement: dict[int, Placement]
    placement_source: str
    assumed: tuple[str, ...]
    missing_dumps: tuple[int, ...]
    loaded: Loaded | None
    ras: RasReport | None
    findings: tuple[dict[str, Any], ...]
    health: dict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=dict)
    torch_analyzer: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    stacks: tuple[RankStack, ...] = ()
    stack_verdict: StackVerdict | None = None
    blamed: tuple[Blame, ...] = ()

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def document(self) -> dict[str, Any]:
        """The ``gputopo/hang/v1`` JSON document."""
        groups = [self._group_doc(g) for g in (self.match.groups if self.match else ())]
        dumps = self.loaded.dumps if self.loaded else ()
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "reason": self.reason,
            "groups": groups,
            "missing_dumps": list(self.missing_dumps),
            "skipped_dumps": [
                {"rank": s.rank, "path": str(s.path), "why": s.why}
                for s in (self.loaded.skipped if self.loaded else ())
            ],
            "dumps": {
                "count": len(dumps),
                "ranks": [d.rank for d in dumps],
                "formats": sorted({d.format for d in dumps}),
                "recorder_version": dumps[0].version if dumps else None,
                "comm_lib_version": next((d.comm_lib_version for d in dumps if d.comm_lib_version), None),
                "world": list(self.match.world) if self.match else [],
                "healthy_groups": list(self.match.healthy_groups) if self.match else [],
            },
            "placement": {"source": self.placement_source, "assumed": list(self.assumed)},
            "ras": self._ras_doc(),
            "torch_analyzer": self.torch_analyzer,
            "findings": list(self.findings),
            "notes": list(self.notes),
            "suspects": self._suspects_doc(),
            "stacks": [s.as_dict() for s in self.stacks],
            "stacks_verdict": self.stack_verdict.sentence if self.stack_verdict else None,
        }

    def _suspects_doc(self) -> list[dict[str, Any]]:
        """Every rank a problem finding blames (``blamed``), one row per rank and reason, each with where
        it ran and the frame it was last seen in (its stack, else its dump's call site). A rank the stacks
        blame that a group already names keeps the group's row (which carries the stack's frame)."""
        rows: list[dict[str, Any]] = []
        seen: set[tuple[tuple[int, str | None], str]] = set()
        in_groups = {b.key for b in self.blamed if b.group is not None}
        for b in self.blamed:
            if (b.key, b.why) in seen or (b.why in _STACK_WHYS and b.key in in_groups):
                continue
            seen.add((b.key, b.why))
            rows.append(self._placed(b))
        return sorted(rows, key=lambda r: (r["rank"], r["communicator"] or ""))

    def _placed(self, b: Blame) -> dict[str, Any]:
        rank = b.rank
        p = None if b.within_comm else self.placement.get(rank)
        st = None if b.within_comm else next((s for s in self.stacks if s.rank == rank), None)
        ras = b.ras if b.within_comm else None
        gpu = p.gpu_index if p and p.gpu_index is not None else (st.gpu if st else None)
        return {
            "rank": rank,
            "communicator": b.key[1],
            "why": b.why,
            "what": b.what,
            "group": b.group,
            "host": (p.host if p else None) or (st.host if st else None) or (ras.host if ras else None),
            "local_rank": p.local_rank if p and p.local_rank is not None else (st.local_rank if st else None),
            "gpu": gpu if gpu is not None else (ras.nvml_dev if ras else None),
            "pid": (p.pid if p else None) or (st.pid if st else None) or (ras.pid if ras else None),
            "frame": b.frame,
        }

    def _group_doc(self, g: GroupResult) -> dict[str, Any]:
        # The call's own JSON (Call.as_dict), in the group's order and without what the group says itself.
        call = g.collective.as_dict()
        collective = {k: call[k] for k in GROUP_CALL_KEYS if k in call}
        return {
            "pg": g.pg,
            "desc": g.desc,
            "ranks": list(g.ranks),
            "membership": g.membership,
            "kind": g.kind,
            "p2p": g.p2p,
            "collective": collective,
            "calls": {"per_rank": {str(r): v for r, v in g.calls.items()}, "note": g.calls_note},
            "pg_status": {str(r): v for r, v in g.pg_status.items()},
            "completed": list(g.completed),
            "inside": list(g.entered),
            "never_entered": list(g.never_entered),
            "states": {str(r): s for r, s in g.states.items()},
            "state_tracked": g.state_tracked,
            "mismatches": [{"rank": m.rank, "kind": m.kind, "what": m.what} for m in g.mismatches],
            "suspects": [self._suspect_doc(s) for s in g.suspects],
        }

    def _suspect_doc(self, s: Suspect) -> dict[str, Any]:
        p = self.placement.get(s.rank)
        gpu = None
        if p is not None and (p.gpu_index is not None or p.gpu_uuid is not None):
            gpu = {"index": p.gpu_index, "uuid": p.gpu_uuid}
        health = (
            self.health.get((p.host, p.gpu_index), []) if p and p.host and p.gpu_index is not None else []
        )
        return {
            "rank": s.rank,
            "why": s.why,
            "what": s.what,
            "host": p.host if p else None,
            "local_rank": p.local_rank if p else None,
            "gpu": gpu,
            "pid": p.pid if p else None,
            "placed_from": p.source if p else None,
            "last_collective": s.last_collective.as_dict() if s.last_collective else None,
            "stack": list(s.last_collective.stack) if s.last_collective and s.last_collective.stack else None,
            "health": list(health),
        }

    def _ras_doc(self) -> dict[str, Any] | None:
        if self.ras is None:
            return None
        return {
            "source": self.ras.source,
            "nccl_version": self.ras.nccl_version,
            "communicators": self.ras.communicators,
            "timeouts": self.ras.timeouts,
            "troubled": [r.as_dict() for r in self.ras.troubled],
            "lagging": [
                {**r.as_dict(), "op": op, "count": n, "others": common}
                for r, op, n, common in self.ras.lagging
            ],
        }


def triage(
    loaded: Loaded | None,
    match: MatchResult | None,
    placement: dict[int, Placement] | None = None,
    assumed: Sequence[str] = (),
    ras: RasReport | None = None,
    health: Health | None = None,
    torch_analyzer: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
    stacks: Sequence[RankStack] = (),
) -> HangReport:
    """Judge the matching (and RAS, and the ranks' stacks), place each suspect, and write the findings."""
    placement = dict(placement or {})
    assumed = list(assumed)
    source = "run-record" if placement else "none"
    if loaded is not None:
        for d in loaded.dumps:
            if d.rank not in placement and (d.host or d.pid):
                placement[d.rank] = Placement(d.rank, d.host, None, None, None, None, d.pid, "dump")
                source = "dump" if source == "none" else source
    if ras is not None:
        ras = _ras_global(ras, placement)
    if ras is not None and _place_from_ras(ras, match, placement):
        ras = _ras_global(ras, placement, "ras")
        assumed.append(
            "NCCL RAS placed ranks no record did: a communicator as large as the world numbers its ranks "
            "as the global ranks; its host is the IP address RAS reports"
        )
        if source == "none":
            source = "ras"
    if source == "none" and loaded is not None:
        assumed.append(
            "no run record beside the dumps (--run-record FILE): hosts, GPUs and PIDs unknown "
            f"(Flight Recorder {loaded.dumps[0].version if loaded.dumps else ''} dumps carry none of them); "
            "ranks are the numbers at the end of the dump file names"
        )
    health_map = {k: [dict(f) for f in v] for k, v in (health or {}).items()}
    world = match.world if match else ()
    have = {d.rank for d in loaded.dumps} if loaded else set()
    missing = tuple(r for r in world if r not in have)
    found = _Findings()
    groups = match.groups if match else ()
    stack_frames = {st.rank: st.where()[2] for st in stacks}
    for g in groups:
        for s in g.suspects:
            frame = stack_frames.get(s.rank)
            if frame is None and s.last_collective and s.last_collective.stack:
                frame = _user_frame(s.last_collective.stack)
            blame = Blame(s.rank, s.why, s.what, g.pg, str(frame) if frame else None)
            _suspect_findings(found, blame, g, s, placement.get(s.rank), health_map)
    for r in missing:
        if not any(r in g.no_dump for g in groups):
            found.add(
                _finding(_where(r, placement.get(r)), None, "process", "no dump", _REMEDY[NO_DUMP], "note")
            )
    if ras is not None:
        _ras_findings(found, ras, stack_frames)
    stack_verdict = judge(list(stacks)) if stacks else None
    for sv in stack_verdict.suspects if stack_verdict else ():
        p = placement.get(sv.rank)
        found.blame(
            _finding(
                _where(sv.rank, p),
                p.gpu_index if p else None,
                "process",
                sv.what + (f"; {stack_verdict.waiting}" if stack_verdict and stack_verdict.waiting else ""),
                _REMEDY_STACK,
                "problem",
                "none",
            ),
            Blame(sv.rank, sv.why, sv.what, None, sv.frame),
        )
    verdict, reason, named = _verdict(groups, missing, ras, loaded)
    if stack_verdict is not None:
        stack_named = {(sv.rank, None) for sv in stack_verdict.suspects}
        if stack_verdict.suspects and (verdict in (NO_HANG, INCOMPLETE) or loaded is None):
            verdict, reason, named = HANG, stack_verdict.sentence, stack_named
        elif loaded is None and ras is None:
            verdict, reason = INCOMPLETE, stack_verdict.sentence
        elif groups:
            reason += f" (stacks: {stack_verdict.sentence})"
            named |= stack_named
    reason += _the_rest(found.blamed, named)
    findings = found.all
    return HangReport(
        verdict=verdict,
        reason=reason,
        match=match,
        placement=placement,
        placement_source=source,
        assumed=tuple(dict.fromkeys(assumed)),
        missing_dumps=missing,
        loaded=loaded,
        ras=ras,
        findings=tuple(sorted(findings, key=lambda f: f["severity"] != "problem")),
        health=health_map,
        torch_analyzer=torch_analyzer,
        notes=tuple(notes) + (match.notes if match else ()),
        stacks=tuple(stacks),
        stack_verdict=stack_verdict,
        blamed=tuple(found.blamed),
    )


def _the_rest(blamed: Sequence[Blame], named: set[tuple[int, str | None]]) -> str:
    """What the headline adds so that it counts every suspect: the ranks the findings blame that its
    sentence did not name ("" when it named them all)."""
    ranks: dict[tuple[int, str | None], str] = {}
    for b in blamed:
        ranks.setdefault(b.key, b.label)
    rest = [
        label
        for key, label in sorted(ranks.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))
        if key not in named
    ]
    if not rest:
        return ""
    return f"; {len(ranks)} suspect rank(s) in all, also {', '.join(rest)}"


def _ras_findings(
    found: _Findings,
    ras: RasReport,
    stack_frames: Mapping[int, Any],
) -> None:
    """A problem for every rank RAS finds behind the others (RAS MISMATCH) or in trouble, each blaming it."""
    for rr, op, n, common in ras.lagging:
        what = (
            f"NCCL RAS: {_ras_name(rr)} made {n} {op} where the others of communicator "
            f"{rr.comm} made {common}: it is behind them (RAS MISMATCH), and they wait for it"
        )
        finding = _finding(_ras_where(rr), rr.nvml_dev, "process", what, _REMEDY[NEVER_ENTERED], "problem")
        found.blame(
            finding,
            _ras_blame(rr, RAS_LAGGING, f"made {n} {op}, the others {common}", stack_frames),
        )
    for rr in ras.troubled:
        finding = _finding(
            _ras_where(rr),
            rr.nvml_dev,
            "process",
            f"NCCL RAS: {_ras_name(rr)} is {rr.trouble}",
            "a dead or unresponsive rank stops every collective of its communicator: look at that "
            "process and host first (exit code, `dmesg`, Xid); `ncclras -v` shows the detail",
            "problem",
        )
        found.blame(finding, _ras_blame(rr, RAS_TROUBLED, str(rr.trouble), stack_frames))


def _ras_blame(rr: RasRank, why: str, what: str, stack_frames: Mapping[int, Any]) -> Blame:
    """A RAS rank as a suspect: by its global rank where a run record maps it or RAS placed it as one
    (a communicator as large as the world), else by its rank within the communicator."""
    rank = rr.global_rank
    if rank is None:
        return Blame(rr.rank, why, what, None, None, rr, within_comm=True)
    frame = stack_frames.get(rank)
    return Blame(rank, why, what, None, str(frame) if frame else None, rr)


def _ras_name(rr: RasRank) -> str:
    """A RAS rank as the user knows it: its global rank where a run record says it (and it differs), and
    always which communicator's rank it is (RAS numbers ranks per communicator)."""
    within = f"rank {rr.rank} of communicator {rr.comm}"
    other = rr.global_rank is not None and rr.global_rank != rr.rank
    return f"global rank {rr.global_rank} ({within})" if other else within


def _ras_where(rr: RasRank) -> str:
    gpu = f", GPU {rr.nvml_dev}" if rr.nvml_dev is not None else ""
    head = (
        f"rank {rr.global_rank}" if rr.global_rank is not None else f"communicator {rr.comm} rank {rr.rank}"
    )
    return f"{head} ({rr.host or 'unknown host'}{gpu}, pid {rr.pid if rr.pid else '?'})"


def _ras_global(ras: RasReport, placement: dict[int, Placement], source: str = "run-record") -> RasReport:
    """Each RAS rank's global rank, from the run records: the placed rank with the same PID (and the same
    host, where both hosts are known and more than one rank has that PID). RAS gives the host as an IP
    address and a run record as a host name, so the PID decides, and a PID that several hosts share
    with no host to tell them apart stays unmapped. With ``source`` "ras": the ranks RAS itself placed
    as global ranks (``_place_from_ras``, an assumption the report states) get that global rank."""
    by_pid: dict[int, list[Placement]] = {}
    for p in placement.values():
        if p.pid is not None and p.source == source:
            by_pid.setdefault(p.pid, []).append(p)
    mapped = []
    for r in ras.ranks:
        if r.global_rank is not None:
            mapped.append(r)
            continue
        found = by_pid.get(r.pid or -1, [])
        if source == "ras":
            found = [p for p in found if p.rank == r.rank and p.host == r.host]
        if len(found) > 1:
            found = [p for p in found if r.host is not None and p.host == r.host]
        mapped.append(replace(r, global_rank=found[0].rank) if len(found) == 1 else r)
    return replace(ras, ranks=tuple(mapped))


def _place_from_ras(ras: RasReport, match: MatchResult | None, placement: dict[int, Placement]) -> int:
    """A communicator as large as the world numbers its ranks as the global ranks: RAS then says each
    rank's host (IP), PID and NVML index, for ranks no run record placed."""
    world = len(match.world) if match else 0
    sizes: dict[str, int] = {}
    for r in ras.ranks:
        sizes[r.comm] = max(sizes.get(r.comm, 0), r.rank + 1)
    placed = 0
    for r in ras.ranks:
        if r.rank < 0 or r.rank in placement or (world and sizes[r.comm] != world):
            continue
        placement[r.rank] = Placement(r.rank, r.host, None, None, r.nvml_dev, None, r.pid, "ras")
        placed += 1
    return placed


Named = set[tuple[int, str | None]]  # the ranks a headline's sentence names (``Blame.key``)


def _verdict(
    groups: Sequence[GroupResult],
    missing: Sequence[int],
    ras: RasReport | None,
    loaded: Loaded | None,
) -> tuple[str, str, Named]:
    """The verdict, its sentence, and the ranks the sentence names."""
    if groups:
        g = next((x for x in groups if x.mismatches), groups[0])
        verdict, reason, named = _group_verdict(g)
        return verdict, reason + (f"; {g.calls_note}" if g.calls_note else ""), named
    return _no_group_verdict(missing, ras, loaded)


def _at(g: GroupResult) -> str:
    c = g.collective
    if g.p2p:
        way = "to" if c.op == "send" else "from"
        return f"{c.op} {way} rank {c.peer} (p2p seq {c.seq}) of group {g.pg} ({g.desc})"
    return f"{c.op} (seq {c.seq}) of group {g.pg} ({g.desc})"


def _group_verdict(g: GroupResult) -> tuple[str, str, Named]:
    at = _at(g)
    if g.mismatches:
        ranks = ",".join(str(m.rank) for m in g.mismatches)
        named = {(m.rank, None) for m in g.mismatches}
        return MISMATCHED, f"rank(s) {ranks} called {at} differently: {g.mismatches[0].what}", named
    lead = g.suspects[0] if g.suspects else None
    if g.p2p and lead is not None and lead.why in (NEVER_ENTERED, NO_DUMP):
        reason = f"rank {lead.rank} {lead.what} (group {g.pg} ({g.desc}), p2p seq {g.collective.seq})"
        return HANG, reason, {(lead.rank, None)}
    if g.never_entered:
        waiting = ",".join(str(r) for r in g.entered) or "none"
        return (
            HANG,
            f"rank(s) {_ranks(g.never_entered)} never entered {at}; rank(s) {waiting} wait inside it",
            {(r, None) for r in g.never_entered},
        )
    if g.no_dump:
        reason = f"rank(s) {_ranks(g.no_dump)} left no dump while the others wait in {at}"
        return HANG, reason, {(r, None) for r in g.no_dump}
    return (
        HANG,
        f"rank(s) {_ranks(s.rank for s in g.suspects)} stuck inside {at}" if lead else f"stuck in {at}",
        {(s.rank, None) for s in g.suspects},
    )


def _no_group_verdict(
    missing: Sequence[int], ras: RasReport | None, loaded: Loaded | None
) -> tuple[str, str, Named]:
    troubled = ras.troubled if ras else ()
    lagging = ras.lagging if ras else ()
    if loaded is None:
        if troubled or lagging:
            # Every rank RAS blames, dead or behind, counted once and named (the first few).
            said: dict[tuple[int, str | None], list[str]] = {}
            for r in troubled:
                said.setdefault(_ras_key(r), []).append(f"{_ras_name(r)} is {r.trouble}")
            for r, op, n, c in lagging:
                said.setdefault(_ras_key(r), []).append(f"{_ras_name(r)} made {n} {op}, the others {c}")
            parts = [w for words in said.values() for w in words]
            more = f"; {len(parts) - 5} more" if len(parts) > 5 else ""
            reason = f"NCCL RAS names {len(said)} troubled rank(s): " + "; ".join(parts[:5]) + more
            return HANG, reason, set(said) if not more else set()
        return NO_HANG, "NCCL RAS: every rank of every communicator is present and healthy", set()
    if missing:
        return (
            INCOMPLETE,
            f"nothing is stuck in the dumps there are, but rank(s) {_ranks(missing)} have none: "
            "the missing ones may be where it hangs",
            set(),
        )
    if troubled or lagging:
        return (
            INCOMPLETE,
            "every rank completed everything its dump recorded, yet NCCL RAS names troubled ranks "
            "(the dumps may predate the hang)",
            set(),
        )
    return NO_HANG, "every rank completed every collective its dump recorded", set()


def _ras_key(rr: RasRank) -> tuple[int, str | None]:
    return (rr.rank, rr.comm) if rr.global_rank is None else (rr.global_rank, None)


def _suspect_findings(
    found: _Findings,
    blame: Blame,
    g: GroupResult,
    s: Suspect,
    p: Placement | None,
    health: dict[tuple[str, int], list[dict[str, Any]]],
) -> None:
    """The finding that blames a group's suspect (and, but for one stuck inside, its GPU's health)."""
    c = g.collective
    at = (
        _at(g)
        if g.p2p
        else f"{c.op} (seq {c.seq}, sizes {c.sizes}, {'/'.join(c.dtype) or '?'}) of group {g.pg} ({g.desc})"
    )
    gpu = p.gpu_index if p else None
    where = _where(s.rank, p)
    on_gpu = health.get((p.host, gpu), []) if p and p.host and gpu is not None else []
    hw = [f for f in on_gpu if f.get("severity") == "problem" and f.get("category") in _HARDWARE_CATEGORIES]
    if s.why == NEVER_ENTERED:
        last = s.last_collective
        seen = f"; last seen in {last.op} seq {last.seq} of group {last.pg}" if last else ""
        frame = _user_frame(last.stack) if last and last.stack else None
        waiting = f"; rank(s) {_ranks(g.entered)} wait inside it" if g.entered else ""
        what = f"never entered {at}{waiting}{seen}" + (f", called from {frame}" if frame else "")
        finding = _finding(where, gpu, "process", what, _REMEDY[NEVER_ENTERED], "problem", "none")
    elif s.why == MISMATCH:
        finding = _finding(where, gpu, "config", f"{s.what} ({at})", _REMEDY[MISMATCH], "problem", "config")
    elif s.why == NO_DUMP:
        what = f"no dump, while the others wait in {at}"
        finding = _finding(where, gpu, "process", what, _REMEDY[NO_DUMP], "problem", "none")
    elif hw:  # stuck inside, on a GPU that reports a hardware problem
        evidence = "; ".join(str(f.get("what")) for f in hw)
        finding = _finding(
            where,
            gpu,
            str(hw[0].get("category")),
            f"stuck inside {at} on a GPU that reports: {evidence}",
            "the hardware: drain the node and service that GPU (" + str(hw[0].get("remedy", "")) + ")",
            "problem",
            "drain",
        )
    else:
        known = "" if on_gpu else " (gputopo has no health readings for that GPU here)"
        what = f"stuck inside {at}{known}"
        finding = _finding(where, gpu, "process", what, _REMEDY[STUCK_INSIDE], "problem", "monitor")
    found.blame(finding, blame)
    if s.why != STUCK_INSIDE:
        for f in on_gpu:
            found.add(dict(f))


def _finding(
    where: str, gpu: int | None, category: str, what: str, remedy: str, severity: str, action: str = "none"
) -> dict[str, Any]:
    """A finding in the one shape every command uses (docs/design.md); a dict until findings.Finding has
    the gpu/category/action fields."""
    return {
        "where": where,
        "gpu": gpu,
        "category": category,
        "what": what,
        "remedy": remedy,
        "severity": severity,
        "action": action,
    }


def _where(rank: int, p: Placement | None) -> str:
    if p is None or (p.host is None and p.gpu_index is None):
        return f"rank {rank}"
    bits = [p.host or "unknown host"]
    if p.gpu_index is not None:
        bits.append(f"GPU {p.gpu_index}")
    if p.pid is not None:
        bits.append(f"pid {p.pid}")
    return f"rank {rank} ({', '.join(bits)})"


_TORCH_FRAME = re.compile(r"[/\\](torch|multiprocessing|threading\.py|runpy\.py)[/\\]?")


def _user_frame(stack: Sequence[str]) -> str | None:
    """The innermost frame that is not torch's or the launcher's: where the user's code called it."""
    for frame in stack:
        if not _TORCH_FRAME.search(frame) and "(<string>" not in frame:
            return frame
    return None


def _ranks(ranks: Any) -> str:
    return ",".join(str(r) for r in ranks)


def user_frame(stack: Sequence[str]) -> str | None:
    """Public alias for the text renderer."""
    return _user_frame(stack)
