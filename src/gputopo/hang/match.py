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
- a group is its name, description and ranks, never its name alone: ``split_group`` (DeviceMesh) makes
  groups that share a name on different ranks (see ``_resolve_groups``, after torch's builder.py). Under
  gloo, torch 2.14 records every group in ``pg_config`` under the name ``''`` (each overwriting the
  last), while the entries name the group ``'0'``, ``'1'``...; this is why ``torchfrtrace`` raises
  ``KeyError: ('0', 0)`` on gloo dumps. Here the default group (``desc`` ``default_pg``) is every rank,
  and another group whose name is not in ``pg_config`` takes the ``''`` record of a rank that ran in it,
  when that record is not the whole world; what was assumed is said;
- two ranks' calls at one sequence id agree by torch's own rules, op by op (``hang.oprules``); point-to-
  point ops are paired by peer (``_match_p2p``); ``pg_status`` (last enqueued / started / completed
  collective) speaks for a rank whose ring buffer lost the entry, where states are real (NCCL).

The buffer is a ring (``TORCH_FR_BUFFER_SIZE`` entries): a rank whose oldest entry is later than a
sequence id has completed that sequence.
"""

from __future__ import annotations

import ast
import heapq
import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gputopo.gpulist import format_id_ranges
from gputopo.hang.load import MAX_RANKS, Dump, crafted_entry, deep_entry, paused_gc, shallow_entry
from gputopo.hang.oprules import ALL_TO_ALL, LOOSE, alltoall_totals, entry_key, op_name
from gputopo.hang.oprules import mismatch as oprules_mismatch

NEVER_ENTERED = "never_entered"
STUCK_INSIDE = "stuck_inside"
MISMATCH = "mismatch"
NO_DUMP = "no_dump"
DEFAULT_PG_DESC = "default_pg"
# A group as torch's analyzer keys it: (name, desc, global ranks); ranks None where no record says them.
GroupKey = tuple[str, str, "tuple[int, ...] | None"]


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
    peer: int | None = None  # point-to-point: the other side, as a global rank
    output_sizes: list[Any] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape of a call (``last_collective``)."""
        out = {
            "pg": self.pg,
            "seq": self.seq,
            "op": self.op,
            "backend": self.backend,
            "sizes": self.sizes,
            "dtype": self.dtype,
            "state": self.state,
        }
        if self.peer is not None:
            out["peer"] = self.peer
        return out


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
    p2p: bool = False  # a point-to-point op (collective.op is send or recv, collective.seq its p2p_seq_id)
    calls: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> op -> calls in the group
    calls_note: str | None = None  # "rank 2: 9 all_reduce, others 10; the first difference is at seq 6"
    pg_status: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> enqueued/started/completed

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
    # each rank's own groups: rank -> name -> (desc, global ranks); names can be shared (split_group)
    rank_groups: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = field(default_factory=dict)


def match_dumps(
    dumps: Iterable[Dump], world_size: int | None = None, unusable: Iterable[int] = ()
) -> MatchResult:
    """Match the dumps' collectives and point-to-point ops. ``world_size`` (from a run record) bounds the
    world; ranks in ``unusable`` had a dump that could not be read (they count as having none)."""
    ordered = sorted(dumps, key=lambda d: d.rank)
    with paused_gc():
        try:
            return _match_dumps(ordered, world_size, set(unusable))
        except (RecursionError, TypeError, _DeepEntry):
            # Comparing, hashing or showing an entry nested deeper than torch writes one: find the dump
            # (only now: the common path checks nothing) and refuse it in one line (exit 2).
            culprit = deep_entry(ordered)
            if culprit is None:
                raise
            raise crafted_entry(culprit) from None


class _DeepEntry(Exception):
    """An entry about to be shown nests deeper than torch writes one."""


def _match_dumps(dumps: list[Dump], world_size: int | None, unusable: set[int]) -> MatchResult:
    notes: list[str] = []
    world = _world(dumps, world_size, unusable)
    by_rank = {d.rank: d for d in dumps}
    keys, how = _resolve_groups(dumps, world)
    members: dict[GroupKey, tuple[int, ...]] = {}
    for (rank, _), key in keys.items():
        if key[2] is not None:
            members[key] = key[2]
        else:
            members[key] = tuple(sorted({*members.get(key, ()), rank}))
    groups: list[GroupResult] = []
    p2p: list[GroupResult] = []
    healthy: list[str] = []
    all_members: dict[str, tuple[str, tuple[int, ...]]] = {}
    rank_groups: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for (rank, name), key in keys.items():
        rank_groups.setdefault(rank, {})[name] = (key[1], members[key])
    names_seen = Counter(k[0] for k in members)
    for key in sorted(members, key=_group_sort_key):
        name, desc, _ = key
        ranks = list(members[key])
        all_members.setdefault(name, (desc, tuple(ranks)))
        label = _label(key, ranks, names_seen[name] > 1)
        if key in how:
            notes.append(f"group {label}: {how[key]}")
        membership = how.get(key, "pg_config")
        result = _match_group(key, ranks, membership, by_rank, keys)
        if result is None:
            healthy.append(name if names_seen[name] == 1 else f"{name} ranks {format_id_ranges(ranks)}")
        else:
            groups.append(result)
        stuck = _match_p2p(key, ranks, membership, by_rank, keys)
        if stuck is not None:
            p2p.append(stuck)
        for total in _alltoall_notes(key, ranks, by_rank, keys):
            notes.append(f"group {label}: {total}")
    return MatchResult(
        tuple(groups + p2p), tuple(world), tuple(healthy), tuple(notes), all_members, rank_groups
    )


def _label(key: GroupKey, ranks: list[int], ambiguous: bool) -> str:
    """A group as the output names it: ``1 (undefined)``, with its ranks when the name is shared."""
    name, desc, _ = key
    return f"{name} ({desc})" + (f" ranks {format_id_ranges(ranks)}" if ambiguous else "")


def _group_sort_key(key: GroupKey) -> tuple[int, int | str, tuple[int, ...]]:
    name = key[0]
    return (0, int(name), key[2] or ()) if name.isdigit() else (1, name, key[2] or ())


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
    if not isinstance(raw, str) or len(raw) > 16 * MAX_RANKS:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            return None
    if isinstance(value, (list, tuple)) and all(isinstance(r, int) and 0 <= r < MAX_RANKS for r in value):
        return list(value)
    return None


def _resolve_groups(dumps: list[Dump], world: list[int]) -> tuple[dict[tuple[int, str], GroupKey], dict]:
    """Which group each rank's entries of a name belong to, as torch's analyzer decides it: by the rank's
    own ``pg_config`` record of that name, keyed by name, description and ranks (builder.py,
    ``build_groups_memberships``: ``pg_guid = pg_uid + str(hash(frozenset(ranks)))``, "with the adoption of
    the split_group API, we can have multiple PGs with the same pg_guid"). Where the record is missing
    (gloo), the default group is the world, and another group takes the rank's unnamed ``''`` record
    when the rank is in it, it is not the world, and the rank ran in only that one other group (gloo
    2.14 records every group there, each overwriting the last). Returns the (rank, name) -> group map,
    and for each group whose ranks were not read from its own record, how they were found."""
    keys: dict[tuple[int, str], GroupKey] = {}
    how: dict[GroupKey, str] = {}
    everyone = tuple(world)
    for d in dumps:
        names: dict[str, str] = {name: desc for name, (desc, _) in d.groups.items()}
        for name, es in d.p2p.items():
            names.setdefault(name, str(es[0]["process_group"][1]))
        others = [n for n, desc in names.items() if desc != DEFAULT_PG_DESC]
        for name, desc in names.items():
            cfg = d.pg_config.get(name)
            ranks = _parse_ranks(cfg.get("ranks")) if isinstance(cfg, dict) else None
            if ranks:
                keys[(d.rank, name)] = (name, desc, tuple(sorted(ranks)))
                continue
            if desc == DEFAULT_PG_DESC:
                key: GroupKey = (name, desc, everyone)
                how.setdefault(key, "the default group: every rank (pg_config does not name it; gloo dumps)")
            else:
                unnamed = d.pg_config.get("")
                found = _parse_ranks(unnamed.get("ranks")) if isinstance(unnamed, dict) else None
                if found and d.rank in found and set(found) != set(world) and len(others) == 1:
                    key = (name, desc, tuple(sorted(found)))
                    how.setdefault(
                        key,
                        f"members {sorted(found)} assumed from rank {d.rank}'s unnamed pg_config record "
                        "(gloo records every group under '')",
                    )
                else:
                    key = (name, desc, None)
                    how[key] = "members assumed to be the ranks that recorded it"
            keys[(d.rank, name)] = key
    return keys, how


_SCALAR = (str, int, float, type(None))


def _plain_frame(f: Any) -> bool:
    """A frame as torch writes it: a dict of scalars (name, filename, line); anything deeper is not shown."""
    return isinstance(f, dict) and all(isinstance(v, _SCALAR) for v in f.values())


def _frames(e: dict[str, Any]) -> tuple[str, ...] | None:
    frames = e.get("frames")
    if not isinstance(frames, list):
        return None
    return tuple(
        f"{f.get('name', '?')} ({f.get('filename', '?')}:{f.get('line', '?')})"
        for f in frames
        if _plain_frame(f)
    )


def _call(e: dict[str, Any], pg_size: int = 0, order: list[int] | None = None) -> Call:
    if not shallow_entry(e):
        raise _DeepEntry  # what is shown is rendered and written as JSON: both recurse
    prof = str(e.get("profiling_name", ""))
    backend, _, op = prof.rpartition(":")
    peer = None
    p2p = _p2p_parse(e)
    if p2p is not None:
        kind, src, dst = p2p
        op = kind
        peer = _global(order, dst if kind == "send" else src)
    seq = e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id")
    return Call(
        pg=str(e["process_group"][0]),
        seq=seq if isinstance(seq, int) else -1,
        op=op or prof,
        backend=backend or None,
        sizes=e.get("input_sizes") or [],
        dtype=list(e.get("input_dtypes") or []),
        state=str(e.get("state", "scheduled")),
        stack=_frames(e),
        peer=peer,
        output_sizes=e.get("output_sizes") or [],
    )


def _tracked(entries: list[dict[str, Any]]) -> bool:
    """Whether the backend records real start/end events (NCCL does; gloo does not)."""
    return any(str(e.get("profiling_name", "")).startswith("nccl:") for e in entries)


def _done(entries: list[dict[str, Any]]) -> bool:
    return all(e.get("state") == "completed" or e.get("time_discovered_completed_ns") for e in entries)


def _sig(entries: list[dict[str, Any]]) -> tuple[Any, ...]:
    return tuple(entry_key(e) for e in entries)


def _status(d: Dump, seqs: dict[int, list[dict[str, Any]]]) -> dict[str, int] | None:
    """The group's ``pg_status`` on this rank (last enqueued, started, completed collective), found by the
    ``pg_id`` its entries carry (torch keys pg_status by pg id; JSON dumps write the numbers as text)."""
    if not d.pg_status or not seqs:
        return None
    pg_id = next(iter(seqs.values()))[-1].get("pg_id")
    raw = d.pg_status.get(str(pg_id))
    if not isinstance(raw, dict):
        return None
    out: dict[str, int] = {}
    for k in ("last_enqueued_collective", "last_started_collective", "last_completed_collective"):
        v = raw.get(k)
        try:
            out[k.split("_")[1]] = int(v)  # enqueued / started / completed
        except (TypeError, ValueError):
            continue
    return out or None


def _match_group(
    key: GroupKey,
    members: list[int],
    membership: str,
    by_rank: dict[int, Dump],
    keys: dict[tuple[int, str], GroupKey],
) -> GroupResult | None:
    name, desc, _ = key
    have = [r for r in members if r in by_rank]
    no_dump = [r for r in members if r not in by_rank]
    seqs: dict[int, dict[int, list[dict[str, Any]]]] = {
        r: by_rank[r].groups.get(name, ("", {}))[1] if keys.get((r, name)) == key else {} for r in have
    }
    first = {r: min(s) if s else None for r, s in seqs.items()}
    last = {r: max(s) if s else 0 for r, s in seqs.items()}
    if not any(f is not None for f in first.values()):
        return None
    status = {r: st for r in have if (st := _status(by_rank[r], seqs[r])) is not None}
    pg_size = len(members)
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
        inside_by_status: list[int] = []
        for r in have:
            f = first[r]
            if s > last[r]:
                st = status.get(r)
                if st is not None and st.get("completed", -1) >= s and _tracked_status(seqs[r]):
                    passed.append(r)  # pg_status: it completed s, its entry is gone from the ring
                elif st is not None and st.get("enqueued", -1) >= s and _tracked_status(seqs[r]):
                    inside_by_status.append(r)
                else:
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
        ref_rank = min(r for r in present if sigs[r] == ref_sig)
        mismatches = tuple(
            m
            for r in sorted(present)
            if sigs[r] != ref_sig and (m := _mismatch(r, present[r], present[ref_rank], pg_size)) is not None
        )
        mism = {m.rank for m in mismatches}
        alike = not absent and not mism and not no_dump and not inside_by_status
        completed: list[int] = list(passed)
        inside: list[int] = list(inside_by_status)
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
        reference = _call(present[ref_rank][-1], pg_size, members)
        tracked = any(_tracked(es) for es in present.values())
        suspects = _suspects(absent, mismatches, inside, completed, present, no_dump, tracked, by_rank, seqs)
        per_rank, note = _call_counts(seqs, have, first)
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
            calls=per_rank,
            calls_note=note,
            pg_status=dict(sorted(status.items())),
        )
    return None


def _tracked_status(seqs: dict[int, list[dict[str, Any]]]) -> bool:
    """pg_status means something only where states do (NCCL): gloo counts a timed-out collective as
    completed (measured: last_completed_collective equals the one that timed out)."""
    return bool(seqs) and _tracked(next(iter(seqs.values())))


def _candidates(
    seqs: dict[int, dict[int, list[dict[str, Any]]]], last: dict[int, int], hi: int, dumps_missing: bool
) -> list[int]:
    """The sequence ids where a group can stop (a heap), found in one pass over every rank's entries, so
    that only those get the full look: where two ranks' calls differ, the first one some rank never
    entered, the last one when a rank has no dump (gloo cannot show it completed), and the first one a
    rank with real states (NCCL) has not completed."""
    found: set[int] = set()
    # per sequence id: the first rank's entries and, for a single entry, the fields compared below
    first_at: dict[int, tuple[list[dict[str, Any]], tuple[Any, ...] | None]] = {}
    for r, by_seq in seqs.items():
        tracked = bool(by_seq) and _tracked(by_seq[last[r]])
        undone = None
        for s, es in by_seq.items():
            # the common case inlined (one entry per sequence id): this loop sees every entry
            if len(es) == 1:
                get = es[0].get
                key = (get("profiling_name"), get("input_sizes"), get("output_sizes"), get("input_dtypes"))
            else:
                key = None
            ref = first_at.get(s)
            if ref is None:
                first_at[s] = (es, key)
            elif key is not None and ref[1] is not None:
                if key != ref[1] and (
                    key[0] != ref[1][0]
                    or op_name(es[0]) not in LOOSE
                    or entry_key(es[0]) != entry_key(ref[0][0])
                ):
                    found.add(s)
            elif len(es) != len(ref[0]) or _sig(es) != _sig(ref[0]):
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


_NOT_USER = re.compile(r"[/\\](torch|multiprocessing|threading\.py|runpy\.py|c10d_logger\.py)")


def _site(e: dict[str, Any]) -> str | None:
    """Where the user's code made this call: the innermost frame outside torch and the launcher."""
    frames = e.get("frames")
    for f in frames if isinstance(frames, list) else ():
        if _plain_frame(f) and not _NOT_USER.search(str(f.get("filename", ""))):
            return f"{f.get('name')} ({f.get('filename')}:{f.get('line')})"
    return None


def _call_counts(
    seqs: dict[int, dict[int, list[dict[str, Any]]]], have: list[int], first: dict[int, int | None]
) -> tuple[dict[int, dict[str, int]], str | None]:
    """How many calls of each op every rank made in the group, over the sequence ids every rank's ring
    buffer still holds, and, when some rank's count differs from the most common one, the sentence that
    says so: "rank 2: 9 all_reduce, others 10; the first difference is at seq 6". The first difference
    is the first sequence id where that rank's call (op, the sizes torch compares, and the calling line
    where the dump has stacks) is not the most common one."""
    lo = max((f for f in first.values() if f is not None), default=1)
    per: dict[int, Counter[str]] = {}
    for r in have:
        names = Counter(es[-1].get("profiling_name") for s, es in seqs[r].items() if s >= lo)
        per[r] = Counter()
        for prof, n in names.items():
            per[r][op_name({"profiling_name": prof})] += n
    ops = sorted(set().union(*per.values())) if per else []
    odd: dict[int, list[tuple[str, int, int]]] = {}
    for op in ops:
        values = Counter(per[r].get(op, 0) for r in have)
        common = max(values, key=lambda v: (values[v], v))
        if values[common] * 2 <= len(have) and len(have) > 2:
            continue  # no majority to compare with
        for r in have:
            if per[r].get(op, 0) != common:
                odd.setdefault(r, []).append((op, per[r].get(op, 0), common))
    counts = {r: dict(sorted(per[r].items())) for r in have}
    if not odd or len(odd) == len(have):
        return counts, None
    hi = max((max(s) for s in seqs.values() if s), default=lo)
    typical = [r for r in have if r not in odd]
    said: list[str] = []
    for r in sorted(odd):
        mine = " and ".join(f"{n} {op}" for op, n, _ in odd[r])
        others = " and ".join(str(c) for _, _, c in odd[r])
        where = _first_difference(r, seqs, typical, lo, hi)
        said.append(
            f"rank {r}: {mine}, others {others}"
            + (f"; the first difference is at seq {where}" if where is not None else "")
        )
    return counts, "; ".join(said)


def _first_difference(
    r: int, seqs: dict[int, dict[int, list[dict[str, Any]]]], typical: list[int], lo: int, hi: int
) -> int | None:
    """The first sequence id where rank ``r``'s call differs from the calls of the ranks whose counts are
    the common ones (the most common of up to three of them: cheap at 2000 sequence ids)."""
    refs = typical[:3]
    for s in range(lo, hi + 1):
        mine = seqs[r].get(s)
        theirs = [seqs[q].get(s) for q in refs]
        if mine is not None and all(t is not None and t[-1] is mine[-1] for t in theirs):
            continue
        if mine is not None and all(
            t is not None
            and len(t) == len(mine)
            and all(
                a.get("profiling_name") == b.get("profiling_name")
                and a.get("input_sizes") == b.get("input_sizes")
                and a.get("output_sizes") == b.get("output_sizes")
                and a.get("input_dtypes") == b.get("input_dtypes")
                and a.get("frames") == b.get("frames")
                for a, b in zip(t, mine, strict=True)
            )
            for t in theirs
        ):
            continue  # the same call, from the same line (the cheap way: no key built)
        if mine is not None and all(
            t is not None and t[-1].get("profiling_name") == mine[-1].get("profiling_name") for t in theirs
        ):
            key = (_sig(mine), _site(mine[-1]))
            if all((_sig(t), _site(t[-1])) == key for t in theirs if t is not None):
                continue
        sigs: Counter[Any] = Counter((_sig(t), _site(t[-1])) if t else None for t in theirs)
        common = max(sigs, key=lambda k: sigs[k]) if sigs else None
        if ((_sig(mine), _site(mine[-1])) if mine else None) != common:
            return s
    return None


def _alltoall_notes(
    key: GroupKey, members: list[int], by_rank: dict[int, Dump], keys: dict[tuple[int, str], GroupKey]
) -> list[str]:
    """all_to_all's one cross-rank size rule (torch's ``check_size_alltoall``), where every member's dump
    holds the call: the elements sent must be the elements received."""
    name = key[0]
    if not members or any(r not in by_rank or keys.get((r, name)) != key for r in members):
        return []
    out: list[str] = []
    seq_maps = [by_rank[r].groups.get(name, ("", {}))[1] for r in members]
    for s, es in seq_maps[0].items():
        if op_name(es[-1]) not in ALL_TO_ALL:
            continue
        calls = [m[s][-1] for m in seq_maps if s in m]
        if len(calls) != len(members):
            continue
        totals = alltoall_totals(calls)
        if totals:
            out.append(
                f"{op_name(es[-1])} seq {s}: the ranks send {totals[0]} elements in all "
                f"and receive {totals[1]}"
            )
            break
    return out


_SEND = re.compile(r"^send (\d+)->(\d+)$")
_RECV = re.compile(r"^recv (\d+)<-(\d+)$")


def _p2p_parse(e: dict[str, Any]) -> tuple[str, int, int] | None:
    """("send" | "recv", src, dst) in group ranks, from a point-to-point profiling name: torch's analyzer
    reads ``nccl:send 1->2`` and ``nccl:recv 3<-0`` (types.py, ``Op.__init__``: ``s, d =
    meta.split("->")``, ``d, s = meta.split("<-")``)."""
    if not e.get("is_p2p"):
        return None
    name = str(e.get("profiling_name", "")).rpartition(":")[2]
    m = _SEND.match(name)
    if m:
        return "send", int(m[1]), int(m[2])
    m = _RECV.match(name)
    if m:
        return "recv", int(m[2]), int(m[1])
    return None


def _global(order: list[int] | None, group_rank: int) -> int:
    """A group rank as a global rank: the group's global ranks sorted, indexed (torch's
    ``Op._init_global_src_dst``: ``sorted(pg_ranks)[self._src]``)."""
    if order and 0 <= group_rank < len(order):
        return order[group_rank]
    return group_rank


def _match_p2p(
    key: GroupKey,
    members: list[int],
    membership: str,
    by_rank: dict[int, Dump],
    keys: dict[tuple[int, str], GroupKey],
) -> GroupResult | None:
    """The oldest point-to-point op of the group that is not completed, and who holds it up.

    Sends and receives are paired per (sender, receiver) in the order each rank recorded them (torch's
    ``match_coalesced_groups`` Rule 3: "sends to the same dest or recvs from the src should be in a
    consistent order"); only ops not completed are paired, so a ring buffer that lost old ops does not
    shift the pairing. A send waiting with no receive posted on its peer names the peer (it never
    posted it), and the other way round; a pair whose sizes differ (torch: the send's input sizes must
    equal the receive's output sizes) is a mismatch; a pair both inside names the one whose kernel never
    started. Only backends that record states (NCCL) can be read so: gloo records no p2p ops at all
    (measured with torch 2.14.1: ``send``/``recv`` leave no entry)."""
    name = key[0]
    order = sorted(members)
    sends: dict[tuple[int, int], list[tuple[int, dict[str, Any]]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, dict[str, Any]]]] = {}
    for r in members:
        d = by_rank.get(r)
        if d is None or keys.get((r, name)) != key:
            continue
        for e in d.p2p.get(name, ()):
            parsed = _p2p_parse(e)
            if parsed is None or not _tracked([e]) or _done([e]):
                continue
            kind, src, dst = parsed
            channel = (_global(order, src), _global(order, dst))
            (sends if kind == "send" else recvs).setdefault(channel, []).append((r, e))
    issues: list[tuple[int, tuple[int, int], dict[str, Any] | None, dict[str, Any] | None]] = []
    for channel in set(sends) | set(recvs):
        ss, rs = sends.get(channel, []), recvs.get(channel, [])
        for i in range(max(len(ss), len(rs))):
            s = ss[i][1] if i < len(ss) else None
            rv = rs[i][1] if i < len(rs) else None
            born = min(int(x.get("time_created_ns") or 0) for x in (s, rv) if x is not None)
            issues.append((born, channel, s, rv))
    if not issues:
        return None
    issues.sort(key=lambda t: (t[0], t[1]))
    _, (src, dst), send, recv = issues[0]
    size = len(members)
    ref = send if send is not None else recv
    assert ref is not None
    call = _call(ref, size, order)
    entered = sorted({src} if send is not None else set()) + sorted({dst} if recv is not None else set())
    mismatches: tuple[Mismatch, ...] = ()
    suspects: list[Suspect] = []
    never: list[int] = []
    no_dump = [r for r in (src, dst) if r not in by_rank]
    if send is not None and recv is not None:
        if send.get("input_sizes") != recv.get("output_sizes"):
            what = (
                f"receives {recv.get('output_sizes')} from rank {src}, which sends "
                f"{send.get('input_sizes')} (p2p seq {call.seq})"
            )
            mismatches = (Mismatch(dst, "size", what),)
            suspects.append(Suspect(dst, MISMATCH, _call(recv, size, order), what))
        else:
            order_state = {"scheduled": 0, "started": 1}
            states = {
                src: order_state.get(str(send.get("state")), 1),
                dst: order_state.get(str(recv.get("state")), 1),
            }
            least = min(states.values())
            for r in sorted(states):
                if states[r] == least:
                    mine = send if r == src else recv
                    c = _call(mine, size, order)
                    suspects.append(
                        Suspect(
                            r, STUCK_INSIDE, c, f"inside {c.op} with rank {c.peer} ({c.state}), not completed"
                        )
                    )
    elif send is not None:
        who, peer_call = dst, call
        if dst in by_rank:
            never.append(dst)
            last = _last_any(by_rank[dst])
            suspects.append(
                Suspect(
                    dst,
                    NEVER_ENTERED,
                    last,
                    f"never posted the recv from rank {src} that rank {src}'s send (p2p seq {peer_call.seq}) "
                    "waits for",
                )
            )
        else:
            suspects.append(
                Suspect(who, NO_DUMP, None, "no dump: the process may have died before it could write one")
            )
    else:
        assert recv is not None
        if src in by_rank:
            never.append(src)
            suspects.append(
                Suspect(
                    src,
                    NEVER_ENTERED,
                    _last_any(by_rank[src]),
                    f"never sent what rank {dst}'s recv (p2p seq {call.seq}) waits for",
                )
            )
        else:
            suspects.append(
                Suspect(src, NO_DUMP, None, "no dump: the process may have died before it could write one")
            )
    return GroupResult(
        pg=name,
        desc=key[1],
        ranks=tuple(members),
        membership=membership,
        collective=call,
        completed=(),
        entered=tuple(entered),
        never_entered=tuple(never),
        no_dump=tuple(no_dump),
        states={r: str(x.get("state")) for r, x in ((src, send), (dst, recv)) if x is not None},
        mismatches=mismatches,
        suspects=tuple(sorted(suspects, key=lambda s: s.rank)),
        state_tracked=True,
        p2p=True,
    )


def _mismatch(
    rank: int, mine: list[dict[str, Any]], ref: list[dict[str, Any]], pg_size: int
) -> Mismatch | None:
    if len(mine) != len(ref):
        a, b = op_name(mine[-1]), op_name(ref[-1])
        return Mismatch(
            rank, "op", f"a coalesced call of {len(mine)} ops ({a}) where the others make {len(ref)} ({b})"
        )
    for x, y in zip(mine, ref, strict=True):
        found = oprules_mismatch(x, y, pg_size)
        if found is not None:
            return Mismatch(rank, found[0], found[1])
    return None


def _suspects(
    absent: list[int],
    mismatches: tuple[Mismatch, ...],
    inside: list[int],
    completed: list[int],
    present: dict[int, list[dict[str, Any]]],
    no_dump: list[int],
    tracked: bool,
    by_rank: dict[int, Dump],
    seqs: dict[int, dict[int, list[dict[str, Any]]]],
) -> tuple[Suspect, ...]:
    out: list[Suspect] = []
    for r in absent:
        mine = seqs[r]
        last = _call(mine[max(mine)][-1]) if mine else _last_any(by_rank[r])
        if last is not None:
            seen = f"last seen in {last.op} seq {last.seq} of group {last.pg}"
        elif not by_rank[r].entries:
            seen = "its dump recorded no operation at all"
        else:
            seen = "no collective recorded"
        out.append(Suspect(r, NEVER_ENTERED, last, f"never entered the collective ({seen})"))
    for m in mismatches:
        out.append(Suspect(m.rank, MISMATCH, _call(present[m.rank][-1]), m.what))
    if not absent and not mismatches and not no_dump and inside:
        if tracked and not completed:
            # Nobody completed it: the ranks whose kernel never started are behind the others.
            order = {"scheduled": 0, "started": 1}
            least = min(order.get(str(present[r][-1].get("state")), 1) if r in present else 1 for r in inside)
            inside = [
                r
                for r in inside
                if (order.get(str(present[r][-1].get("state")), 1) if r in present else 1) == least
            ]
        for r in inside:
            if r in present:
                call = _call(present[r][-1])
                out.append(
                    Suspect(r, STUCK_INSIDE, call, f"inside the collective ({call.state}), not completed")
                )
            else:
                out.append(
                    Suspect(
                        r,
                        STUCK_INSIDE,
                        None,
                        "inside the collective by its pg_status (enqueued, not completed)",
                    )
                )
    for r in no_dump:
        out.append(Suspect(r, NO_DUMP, None, "no dump: the process may have died before it could write one"))
    return tuple(sorted(out, key=lambda s: s.rank))


def _last_any(d: Dump) -> Call | None:
    for e in reversed(d.entries):
        return _call(e)
    return None
