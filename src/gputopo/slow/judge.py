"""Which rank the others wait for (pure): operations in, stragglers out.

In a synchronous job every rank waits inside each collective for the last one to arrive, so the slow
rank is the one that arrives late, and it is the waiting ranks that show long collective times. So a
rank's *lateness* in one operation is how much later than the earliest rank it arrived: from NCCL
Inspector, the longest execution time of the operation minus the rank's own (the last to arrive waits
least); from the Flight Recorder, the rank's creation time minus the earliest rank's.

A rank is slow when, in at least half of the windows of the run, its median lateness is an outlier
among the ranks: above the ranks' median by more than ``k`` scaled MADs and by more than ``floor`` of
the operation's time (a floor relative to the operation, since an absolute one would hide a rank 5% late
on short operations). A window is a run of ``window`` consecutive operations of one communicator of
three or more ranks, and of one message-size bucket, so one spike never makes a straggler: recurrence
does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import median

# 1.4826 x MAD estimates the standard deviation of normal noise; 5 of those is far outside it.
K_MAD = 5.0
MAD_SCALE = 1.4826
# A rank must be at least this share of the operation's time later than the ranks' median.
FLOOR = 0.02
WINDOW = 10
MIN_RANKS = 3
# Recurrence: flagged in at least this share of the windows it took part in.
RECURRENCE = 0.5
MIN_WINDOWS = 2


@dataclass(frozen=True)
class Op:
    """One operation as every rank saw it: ``lateness`` in ms of each of ``ranks`` (global ranks, in
    the same order; operations of one communicator share one ``ranks`` tuple), ``duration_ms`` the
    operation's time (the longest execution, or the time to the communicator's next operation),
    ``busy_ms`` every rank's time in it, summed (the base of the waiting share)."""

    comm: str
    name: str
    seq: int
    size: int
    ranks: tuple[int, ...]
    lateness: tuple[float, ...]
    duration_ms: float
    busy_ms: float


@dataclass(frozen=True)
class Straggler:
    rank: int
    lateness_ms: float  # median over its operations
    waiting_share: float  # of every rank's time in these operations, the share spent waiting for it
    late_share: float  # share of its operations in which it arrived last
    windows_flagged: int
    windows: int
    communicators: tuple[str, ...]
    operations: tuple[str, ...]


@dataclass(frozen=True)
class Judgement:
    stragglers: tuple[Straggler, ...]
    ranks: dict[int, float]  # rank -> median lateness (ms) over all its operations
    windows: int
    operations: int
    spread_pct: float | None  # median over windows of (latest - earliest rank median) / op time
    undecided: str | None = None  # why nothing could be judged (too few operations or ranks)
    params: dict[str, float] = field(default_factory=dict)


def size_bucket(size: int) -> int:
    """The power-of-two bucket of a message size (0 for unknown)."""
    return size.bit_length() if size > 0 else 0


def judge(
    ops: Iterable[Op],
    k: float = K_MAD,
    floor: float = FLOOR,
    window: int = WINDOW,
) -> Judgement:
    groups: dict[tuple[str, int], list[Op]] = {}
    n_ops = 0
    for op in ops:
        n_ops += 1
        if len(op.ranks) >= MIN_RANKS:
            groups.setdefault((op.comm, size_bucket(op.size)), []).append(op)
    flagged: dict[int, int] = {}
    seen: dict[int, int] = {}
    flagged_in: dict[int, set[str]] = {}
    spreads: list[float] = []
    n_windows = 0
    for (comm, _bucket), members in groups.items():
        members.sort(key=lambda o: o.seq)
        for chunk in _windows(members, window):
            n_windows += 1
            meds = _rank_medians(chunk)
            optime = median([op.duration_ms for op in chunk])
            values = list(meds.values())
            m = median(values)
            mad = median([abs(v - m) for v in values])
            bar = max(k * MAD_SCALE * mad, floor * optime)
            if optime > 0:
                spreads.append((max(values) - min(values)) / optime * 100.0)
            for r, v in meds.items():
                seen[r] = seen.get(r, 0) + 1
                if v - m > bar:
                    flagged[r] = flagged.get(r, 0) + 1
                    flagged_in.setdefault(r, set()).add(comm)
    ranks = _rank_medians([op for members in groups.values() for op in members])
    ranks = dict(sorted(ranks.items()))
    params = {"k": k, "floor": floor, "window": float(window), "recurrence": RECURRENCE}
    spread = median(spreads) if spreads else None
    if n_windows == 0:
        why = (
            f"no communicator of {MIN_RANKS} or more ranks recorded an operation"
            if n_ops
            else "no operation was recorded"
        )
        return Judgement((), ranks, 0, n_ops, spread, undecided=why, params=params)
    most = max(seen.values())
    if most < MIN_WINDOWS:
        return Judgement(
            (),
            ranks,
            n_windows,
            n_ops,
            spread,
            undecided=f"too few operations to tell recurrence from a spike ({most} window of {window} "
            f"operations; {MIN_WINDOWS} needed)",
            params=params,
        )
    slow = [r for r, n in flagged.items() if n >= RECURRENCE * seen[r] and seen[r] >= MIN_WINDOWS]
    stragglers = tuple(
        sorted(
            (_describe(r, groups, flagged[r], seen[r], flagged_in[r], ranks[r]) for r in slow),
            key=lambda s: -s.lateness_ms,
        )
    )
    return Judgement(stragglers, ranks, n_windows, n_ops, spread, params=params)


def _rank_medians(ops: list[Op]) -> dict[int, float]:
    """Each rank's median lateness over ``ops``: column by column where the operations share one rank
    tuple (the common case: one communicator), rank by rank where they do not."""
    by_ranks: dict[tuple[int, ...], list[tuple[float, ...]]] = {}
    for op in ops:
        by_ranks.setdefault(op.ranks, []).append(op.lateness)
    if len(by_ranks) == 1:
        [(ranks, rows)] = by_ranks.items()
        return {r: median(col) for r, col in zip(ranks, zip(*rows, strict=True), strict=True)}
    per: dict[int, list[float]] = {}
    for ranks, rows in by_ranks.items():
        for r, col in zip(ranks, zip(*rows, strict=True), strict=True):
            per.setdefault(r, []).extend(col)
    return {r: median(vs) for r, vs in per.items()}


def _windows(members: list[Op], size: int) -> list[list[Op]]:
    """Consecutive runs of ``size`` operations; a short tail joins the window before it."""
    chunks = [members[i : i + size] for i in range(0, len(members), size)]
    if len(chunks) > 1 and len(chunks[-1]) < size // 2:
        chunks[-2].extend(chunks.pop())
    return chunks


def _describe(
    rank: int,
    groups: dict[tuple[str, int], list[Op]],
    n_flagged: int,
    n_seen: int,
    comms: set[str],
    lateness: float,
) -> Straggler:
    waited = 0.0
    busy = 0.0
    last = 0
    mine = 0
    names: set[str] = set()
    for members in groups.values():
        for op in members:
            busy += op.busy_ms
            if rank not in op.ranks:
                continue
            own = op.lateness[op.ranks.index(rank)]
            mine += 1
            if own >= max(op.lateness):
                last += 1
            waited += sum(own - v for v in op.lateness if v < own)
            if op.comm in comms:
                names.add(op.name)
    return Straggler(
        rank=rank,
        lateness_ms=lateness,
        waiting_share=min(1.0, waited / busy) if busy > 0 else 0.0,
        late_share=last / mine if mine else 0.0,
        windows_flagged=n_flagged,
        windows=n_seen,
        communicators=tuple(sorted(comms)),
        operations=tuple(sorted(names)),
    )
