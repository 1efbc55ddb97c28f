"""Matching collectives across ranks (pure): for each process group, the first collective that not every
rank completed, who never entered it, who entered it with another op, size or dtype, and who is inside it.

What a dump says, and how it is read here (torch 2.14, FlightRecorderDetail.hpp ``getCollectiveTrace``):
- each entry names its group as ``process_group = (name, desc)`` and numbers the group's collectives
  with ``collective_seq_id`` (1, 2, ...; point-to-point ops are numbered apart and left out here); the
  ops of a coalesced collective share one sequence id;
- ``state`` is ``completed`` when the end event was seen, ``started`` when the start event was, else
  ``scheduled``. NCCL records CUDA events, so its states are real. gloo records no events: its entries
  stay ``scheduled`` forever, and ``retired`` is set whenever the work finishes, by success or by timeout
  (measured), so neither says whether a gloo collective completed. For gloo a collective counts as
  completed when some rank of the group has gone on to a later one (it could not have without the
  others), or when every rank of the group entered it alike (then nothing in the dumps says it hung);
- ``pg_config`` maps a group's name to its ranks. Under gloo, torch 2.14 records every group under the
  name ``''`` (each overwriting the last), while the entries name the group ``'0'``, ``'1'``...; this is
  why ``torchfrtrace`` raises ``KeyError: ('0', 0)`` on gloo dumps. Here the default group (``desc``
  ``default_pg``) is every rank, and another group whose name is not in ``pg_config`` takes the ``''``
  record of a rank that ran in it, when that record is not the whole world; what was assumed is said.

The buffer is a ring (``TORCH_FR_BUFFER_SIZE`` entries): a rank whose oldest entry is later than a
sequence id has completed that sequence.
"""

from __future__ import annotations

import ast
import heapq
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gputopo.hang.load import MAX_RANKS, Dump, paused_gc

NEVER_ENTERED = "never_entered"
STUCK_INSIDE = "stuck_inside"
MISMATCH = "mismatch"
NO_DUMP = "no_dump"
DEFAULT_PG_DESC = "default_pg"


@dataclass(frozen=True)
class Call:
    """One rank's call of a collective, as its dump recorded it."""

    pg: str
    seq: int
    op: str  # "all_reduce", "broadcast", ... (the profiling name without its backend)
    backend: str | None  # "nccl", "gloo", ...
    sizes: list[Any]  # input sizes, one list per tensor
    dtype: list[str]  # input dtypes as torch names them ("Float", "Int", ...)
    state: str  # as recorded: "scheduled" | "started" | "completed"
    stack: tuple[str, ...] | None  # innermost first, "function (file:line)"; None when not dumped

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape of a call (``last_collective``)."""
        return {
            "pg": self.pg,
            "seq": self.seq,
            "op": self.op,
            "backend": self.backend,
            "sizes": self.sizes,
            "dtype": self.dtype,
            "state": self.state,
        }


@dataclass(frozen=True)
class Mismatch:
    """A rank that entered the collective differently from the others."""

    rank: int
    kind: str  # "op" | "size" | "dtype"
    what: str


@dataclass(frozen=True)
class Suspect:
    """A rank that holds the group up, why, and what it was last seen doing."""

    rank: int
    why: str  # NEVER_ENTERED | STUCK_INSIDE | MISMATCH | NO_DUMP
    last_collective: Call | None
    what: str


@dataclass(frozen=True)
class GroupResult:
    """One process group that is stuck or mismatched, at its first collective not completed by all."""

    pg: str
    desc: str
    ranks: tuple[int, ...]
    membership: str  # where ``ranks`` came from, in words
    collective: Call  # the reference call (what most ranks entered)
    completed: tuple[int, ...]
    entered: tuple[int, ...]  # ranks inside it (entered, not completed)
    never_entered: tuple[int, ...]
    no_dump: tuple[int, ...]
    states: dict[int, str]  # rank -> recorded state at this collective
    mismatches: tuple[Mismatch, ...]
    suspects: tuple[Suspect, ...]
    state_tracked: bool  # False for gloo: states say nothing about progress

    @property
    def kind(self) -> str:
        """``mismatch`` when ranks disagree on the call, else ``hang``."""
        return "mismatch" if self.mismatches else "hang"


@dataclass(frozen=True)
class MatchResult:
    """Every stuck group (first by process group name), the world, and what was assumed."""

    groups: tuple[GroupResult, ...]
    world: tuple[int, ...]
    healthy_groups: tuple[str, ...]
    notes: tuple[str, ...]
    members: dict[str, tuple[str, tuple[int, ...]]]  # every group seen: name -> (desc, global ranks)


def match_dumps(
    dumps: Iterable[Dump], world_size: int | None = None, unusable: Iterable[int] = ()
) -> MatchResult:
    """Match the dumps' collectives. ``world_size`` (from a run record) bounds the world; ranks in
    ``unusable`` had a dump that could not be read (they count as having none)."""
    with paused_gc():
        return _match_dumps(sorted(dumps, key=lambda d: d.rank), world_size, set(unusable))


def _match_dumps(dumps: list[Dump], world_size: int | None, unusable: set[int]) -> MatchResult:
    notes: list[str] = []
    world = _world(dumps, world_size, unusable)
    index = {d.rank: d.groups for d in dumps}
    pgs: dict[str, str] = {}
    for per_pg in index.values():
        for name, (desc, _) in per_pg.items():
            pgs.setdefault(name, desc)
    groups: list[GroupResult] = []
    healthy: list[str] = []
    all_members: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in sorted(pgs, key=_pg_sort_key):
        desc = pgs[name]
        members, how = _members(name, desc, dumps, index, world)
        all_members[name] = (desc, tuple(members))
        if how:
            notes.append(f"group {name} ({desc}): {how}")
        result = _match_group(name, desc, members, how or "pg_config", dumps, index)
        if result is None:
            healthy.append(name)
        else:
            groups.append(result)
    return MatchResult(tuple(groups), tuple(world), tuple(healthy), tuple(notes), all_members)


def _pg_sort_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def _world(dumps: list[Dump], world_size: int | None, unusable: set[int]) -> list[int]:
    """Every global rank: the run record's world size, the largest rank list any dump records, and the
    ranks that have (or had) a dump."""
    top = max([d.rank for d in dumps] + list(unusable), default=-1) + 1
    if world_size:
        top = max(top, min(world_size, MAX_RANKS))
    for d in dumps:
        for cfg in d.pg_config.values():
            ranks = _parse_ranks(cfg.get("ranks") if isinstance(cfg, dict) else None)
            if ranks:
                top = max(top, max(ranks) + 1)
    return list(range(top))


def _parse_ranks(raw: Any) -> list[int] | None:
    """pg_config's ``ranks``: a string like ``'[0, 1, 2]'`` (torch writes it so) or a list."""
    if isinstance(raw, list):
        return [r for r in raw if isinstance(r, int) and 0 <= r < MAX_RANKS]
    if not isinstance(raw, str):
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            return None
    if isinstance(value, (list, tuple)) and all(isinstance(r, int) and 0 <= r < MAX_RANKS for r in value):
        return list(value)
    return None


def _members(
    name: str, desc: str, dumps: list[Dump], index: dict[int, Any], world: list[int]
) -> tuple[list[int], str]:
    """The group's global ranks and, when not read from ``pg_config`` under its own name, how they were
    found."""
    for d in dumps:
        cfg = d.pg_config.get(name)
        if isinstance(cfg, dict):
            ranks = _parse_ranks(cfg.get("ranks"))
            if ranks:
                return sorted(ranks), ""
    if desc == DEFAULT_PG_DESC:
        return list(world), "the default group: every rank (pg_config does not name it; gloo dumps)"
    seen = [r for r in index if name in index[r]]
    for r in seen:
        cfg = next((d.pg_config.get("") for d in dumps if d.rank == r), None)
        ranks = _parse_ranks(cfg.get("ranks")) if isinstance(cfg, dict) else None
        if ranks and set(seen) <= set(ranks) and set(ranks) != set(world):
            return sorted(ranks), f"members {ranks} assumed from rank {r}'s unnamed pg_config record"
    return sorted(seen), f"members assumed to be the ranks that recorded it: {seen}"


def _call(e: dict[str, Any]) -> Call:
    prof = str(e.get("profiling_name", ""))
    backend, _, op = prof.rpartition(":")
    frames = e.get("frames")
    stack = None
    if isinstance(frames, list):
        stack = tuple(
            f"{f.get('name', '?')} ({f.get('filename', '?')}:{f.get('line', '?')})"
            for f in frames
            if isinstance(f, dict)
        )
    return Call(
        pg=str(e["process_group"][0]),
        seq=e["collective_seq_id"],
        op=op or prof,
        backend=backend or None,
        sizes=e.get("input_sizes") or [],
        dtype=list(e.get("input_dtypes") or []),
        state=str(e.get("state", "scheduled")),
        stack=stack,
    )


def _sig(entries: list[dict[str, Any]]) -> tuple[Any, ...]:
    return tuple(
        (e.get("profiling_name"), repr(e.get("input_sizes")), repr(e.get("input_dtypes"))) for e in entries
    )


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether two ranks' calls at one sequence id agree on op, input sizes and dtypes."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is y:
            continue
        if (
            x.get("profiling_name") != y.get("profiling_name")
            or x.get("input_sizes") != y.get("input_sizes")
            or x.get("input_dtypes") != y.get("input_dtypes")
        ):
            return False
    return True


def _tracked(entries: list[dict[str, Any]]) -> bool:
    """Whether the backend records real start/end events (NCCL does; gloo does not)."""
    return any(str(e.get("profiling_name", "")).startswith("nccl:") for e in entries)


def _done(entries: list[dict[str, Any]]) -> bool:
    return all(e.get("state") == "completed" or e.get("time_discovered_completed_ns") for e in entries)


def _match_group(
    name: str,
    desc: str,
    members: list[int],
    membership: str,
    dumps: list[Dump],
    index: dict[int, Any],
) -> GroupResult | None:
    have = [r for r in members if r in index]
    no_dump = [r for r in members if r not in index]
    seqs: dict[int, dict[int, list[dict[str, Any]]]] = {r: index[r].get(name, ("", {}))[1] for r in have}
    first = {r: min(s) if s else None for r, s in seqs.items()}
    last = {r: max(s) if s else 0 for r, s in seqs.items()}
    starts = [f for f in first.values() if f is not None]
    if not starts:
        return None
    hi = max(last.values())
    candidates = _candidates(seqs, last, hi, bool(no_dump))
    tried: set[int] = set()
    while candidates:
        s = heapq.heappop(candidates)
        if s in tried or s > hi:
            continue
        tried.add(s)
        present: dict[int, list[dict[str, Any]]] = {}
        absent: list[int] = []
        passed: list[int] = []
        for r in have:
            f = first[r]
            if s > last[r]:
                absent.append(r)
            elif f is not None and s < f:
                passed.append(r)  # its ring buffer begins after s: it went past s
            else:
                got = seqs[r].get(s)
                if got is None:
                    passed.append(r)
                else:
                    present[r] = got
        if not present:
            heapq.heappush(candidates, s + 1)  # nobody recorded s: the next one may be where it stops
            continue
        sigs = {r: _sig(es) for r, es in present.items()}
        counts = Counter(sigs.values())
        ref_sig = max(counts, key=lambda g: (counts[g], -min(r for r in sigs if sigs[r] == g)))
        mism = [r for r in present if sigs[r] != ref_sig]
        alike = not absent and not mism and not no_dump
        completed: list[int] = list(passed)
        inside: list[int] = []
        for r, es in present.items():
            if _done(es):
                completed.append(r)
            elif not _tracked(es) and (s < hi or alike) and not mism:
                # gloo: some rank went on past s (so s finished), or everyone entered it alike
                completed.append(r)
            else:
                inside.append(r)
        if not absent and not mism and not inside:
            continue
        ref_rank = min(r for r in present if sigs[r] == ref_sig)
        reference = _call(present[ref_rank][-1])
        mismatches = tuple(_mismatch(r, present[r], present[ref_rank]) for r in sorted(mism))
        tracked = any(_tracked(es) for es in present.values())
        suspects = _suspects(
            name, absent, mismatches, inside, completed, present, no_dump, tracked, dumps, seqs
        )
        return GroupResult(
            pg=name,
            desc=desc,
            ranks=tuple(members),
            membership=membership,
            collective=reference,
            completed=tuple(sorted(completed)),
            entered=tuple(sorted(inside)),
            never_entered=tuple(sorted(absent)),
            no_dump=tuple(no_dump),
            states={r: str(present[r][-1].get("state", "scheduled")) for r in sorted(present)},
            mismatches=mismatches,
            suspects=suspects,
            state_tracked=tracked,
        )
    return None


def _candidates(
    seqs: dict[int, dict[int, list[dict[str, Any]]]], last: dict[int, int], hi: int, dumps_missing: bool
) -> list[int]:
    """The sequence ids where a group can stop (a heap), found in one pass over every rank's entries, so
    that only those get the full look: where two ranks' calls differ, the first one some rank never
    entered, the last one when a rank has no dump (gloo cannot show it completed), and the first one a
    rank with real states (NCCL) has not completed."""
    found: set[int] = set()
    first_at: dict[int, list[dict[str, Any]]] = {}
    for r, by_seq in seqs.items():
        tracked = bool(by_seq) and _tracked(by_seq[last[r]])
        undone = None
        for s, es in by_seq.items():
            f = first_at.get(s)
            if f is None:
                first_at[s] = es
            elif len(es) == 1 == len(f):  # _same inlined for the common case: this loop sees every entry
                x, y = es[0], f[0]
                if (
                    x.get("profiling_name") != y.get("profiling_name")
                    or x.get("input_sizes") != y.get("input_sizes")
                    or x.get("input_dtypes") != y.get("input_dtypes")
                ):
                    found.add(s)
            elif not _same(es, f):
                found.add(s)
            if tracked and undone is None and not _done(es):
                undone = s
        if undone is not None:
            found.add(undone)
    lowest_last = min(last.values(), default=hi)
    if lowest_last < hi:
        found.add(lowest_last + 1)
    if dumps_missing:
        found.add(hi)
    out = sorted(found)
    heapq.heapify(out)
    return out


def _mismatch(rank: int, mine: list[dict[str, Any]], ref: list[dict[str, Any]]) -> Mismatch:
    a, b = _call(mine[-1]), _call(ref[-1])
    if a.op != b.op or len(mine) != len(ref):
        return Mismatch(rank, "op", f"calls {a.op} where the others call {b.op}")
    if a.sizes != b.sizes:
        return Mismatch(rank, "size", f"{a.op} with input sizes {a.sizes} where the others have {b.sizes}")
    if a.dtype != b.dtype:
        return Mismatch(rank, "dtype", f"{a.op} with dtype {a.dtype} where the others have {b.dtype}")
    return Mismatch(rank, "op", f"a coalesced call that differs from the others' ({len(mine)} ops)")


def _suspects(
    pg: str,
    absent: list[int],
    mismatches: tuple[Mismatch, ...],
    inside: list[int],
    completed: list[int],
    present: dict[int, list[dict[str, Any]]],
    no_dump: list[int],
    tracked: bool,
    dumps: list[Dump],
    seqs: dict[int, dict[int, list[dict[str, Any]]]],
) -> tuple[Suspect, ...]:
    out: list[Suspect] = []
    by_rank = {d.rank: d for d in dumps}
    for r in absent:
        mine = seqs[r]
        last = _call(mine[max(mine)][-1]) if mine else _last_any(by_rank[r])
        seen = (
            f"last seen in {last.op} seq {last.seq} of group {last.pg}" if last else "no collective recorded"
        )
        out.append(Suspect(r, NEVER_ENTERED, last, f"never entered the collective ({seen})"))
    for m in mismatches:
        out.append(Suspect(m.rank, MISMATCH, _call(present[m.rank][-1]), m.what))
    if not absent and not mismatches and not no_dump and inside:
        if tracked and not completed:
            # Nobody completed it: the ranks whose kernel never started are behind the others.
            order = {"scheduled": 0, "started": 1}
            least = min(order.get(str(present[r][-1].get("state")), 1) for r in inside)
            inside = [r for r in inside if order.get(str(present[r][-1].get("state")), 1) == least]
        for r in inside:
            call = _call(present[r][-1])
            out.append(Suspect(r, STUCK_INSIDE, call, f"inside the collective ({call.state}), not completed"))
    for r in no_dump:
        out.append(Suspect(r, NO_DUMP, None, "no dump: the process may have died before it could write one"))
    return tuple(sorted(out, key=lambda s: s.rank))


def _last_any(d: Dump) -> Call | None:
    for e in reversed(d.entries):
        return _call(e)
    return None
