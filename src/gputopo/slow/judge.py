"""Which rank the others wait for (pure): series of operations in, stragglers out.

In a synchronous job every rank waits inside each collective for the last one to arrive, so the slow
rank is the one that arrives late, and it is the waiting ranks that show long collective times. A
rank's *lateness* in one operation is measured from the operation's **typical member**, never from its
earliest: from NCCL Inspector, the median member's execution time minus the rank's own (the late rank
positive, the ranks that waited about zero, an eager rank negative); from the Flight Recorder, the
rank's creation time minus the median member's on the same host. Measured from the earliest arrival,
one eager rank would add its lead to every other member.

The floor's base is the operation's own time without the waiting: for Inspector the *shortest*
execution (the last arrival's, about the transfer time; ByteDance's what-if analysis, OSDI '25, keeps
only the time after the last rank arrives; AMD's TraceLens takes the minimum over ranks).

A rank is slow when, in at least half of the windows it took part in, its median lateness is an
outlier above the members' median: by more than ``k`` scaled MADs and by more than ``floor`` of the
operation's time. The test is one-sided: an early rank is never an outlier. A window is a run of
``window`` consecutive operations of one ``Series``: one communicator *instance* (its id, never its
name: every tensor-parallel group may be called ``mesh_tp``), one function (AllGather and ReduceScatter
of one size apart) and one message-size bucket, in sequence order. Recurrence, not one spike.

Propagation: a tensor-parallel group that waited for its straggler reaches the next data-parallel
collective late together, so the straggler's mates look late there too. They waited for it in their
shared communicator, where they are not late and it is: a flagged rank that is not late in a
communicator where another flagged rank is late waited for that rank. It goes in ``waited``, not in
``stragglers``.

Nothing here depends on a set's or a dict's hash order: series are judged in a sorted order, and every
tie is broken by rank, so the verdict is the same under any ``PYTHONHASHSEED``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# 1.4826 x MAD estimates the standard deviation of normal noise; 5 of those is far outside it.
K_MAD = 5.0
MAD_SCALE = 1.4826
# A rank must be at least this share of the operation's time later than the members' median.
FLOOR = 0.02
WINDOW = 10
MIN_RANKS = 3
# Recurrence: flagged in at least this share of the windows it took part in.
RECURRENCE = 0.5
MIN_WINDOWS = 2


@dataclass(frozen=True)
class Series:
    """The operations of one communicator instance, one function and one size bucket, in sequence order:
    ``rows[i][j]`` is rank ``ranks[j]``'s lateness (ms) in operation ``i`` (global ranks), ``optime_ms[i]``
    the operation's own time (the floor's base), ``busy_ms[i]`` every member's time in it, summed (the
    base of the waiting share). ``comm`` is the identity (the communicator id), ``label`` what is shown."""

    comm: str
    label: str
    name: str
    bucket: int
    ranks: tuple[int, ...]
    rows: Sequence[Sequence[float]]
    optime_ms: Sequence[float]
    busy_ms: Sequence[float]


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
class Waited:
    """A rank that looked late only because it waited for a straggler upstream (its communicator mate)."""

    rank: int
    waited_for: tuple[int, ...]
    communicators: tuple[str, ...]  # where it was not late and the straggler was


@dataclass(frozen=True)
class Judgement:
    stragglers: tuple[Straggler, ...]
    ranks: dict[int, float]  # rank -> median of its windows' median lateness (ms)
    windows: int
    operations: int
    spread_pct: float | None  # median over windows of (latest - earliest rank median) / op time
    undecided: str | None = None  # why nothing could be judged (too few operations or ranks)
    params: dict[str, float] = field(default_factory=dict)
    waited: tuple[Waited, ...] = ()


def size_bucket(size: int) -> int:
    """The power-of-two bucket of a message size (0 for unknown)."""
    return size.bit_length() if size > 0 else 0


def mid(values: Sequence[float]) -> float:
    """The median (the mean of the middle two for an even count), of a non-empty sequence."""
    s = sorted(values)
    n = len(s)
    h = n // 2
    return s[h] if n % 2 else (s[h - 1] + s[h]) / 2.0


def _bounds(n: int, size: int) -> list[tuple[int, int]]:
    """Consecutive runs of ``size`` operations; a short tail joins the window before it."""
    cuts = [(i, min(i + size, n)) for i in range(0, n, size)]
    if len(cuts) > 1 and cuts[-1][1] - cuts[-1][0] < size // 2:
        last = cuts.pop()
        cuts[-1] = (cuts[-1][0], last[1])
    return cuts


def judge(
    series: Iterable[Series],
    k: float = K_MAD,
    floor: float = FLOOR,
    window: int = WINDOW,
) -> Judgement:
    params = {"k": k, "floor": floor, "window": float(window), "recurrence": RECURRENCE}
    every = list(series)
    n_ops = sum(len(s.rows) for s in every)
    order = sorted((s for s in every if s.rows), key=lambda s: (s.comm, s.name, s.bucket, s.ranks))
    judged = [s for s in order if len(s.ranks) >= MIN_RANKS]
    pairs = [s for s in order if len(s.ranks) == 2]
    seen: dict[int, int] = {}
    # (rank, comm) -> [windows, flagged]: recurrence is judged per communicator instance.
    per_comm: dict[tuple[int, str], list[int]] = {}
    window_meds: dict[int, list[float]] = {}
    spreads: list[float] = []
    n_windows = 0
    for s in judged:
        for a, b in _bounds(len(s.rows), window):
            n_windows += 1
            cols = list(zip(*s.rows[a:b], strict=True))
            meds = [mid(col) for col in cols]
            optime = mid(s.optime_ms[a:b])
            m = mid(meds)
            across = k * MAD_SCALE * mid([abs(v - m) for v in meds])
            least = floor * optime
            over_time: float | None = None
            if optime > 0:
                spreads.append((max(meds) - min(meds)) / optime * 100.0)
            for r, v in zip(s.ranks, meds, strict=True):
                seen[r] = seen.get(r, 0) + 1
                window_meds.setdefault(r, []).append(v)
                tally = per_comm.setdefault((r, s.comm), [0, 0])
                tally[0] += 1
                over = v - m
                if over <= least:
                    continue
                if over <= across:
                    # In a small communicator one eager member inflates the MAD across members; the
                    # noise of a member's median over the window's operations (the MAD of each member's
                    # lateness around its own median, pooled) is not moved by a steady lead or lag.
                    if over_time is None:
                        over_time = k * MAD_SCALE * _noise_of_median(cols, meds)
                    if over <= over_time:
                        continue
                tally[1] += 1
    # Communicators of two members make no straggler (no typical member to measure from), but they say
    # who waited for whom: the later of the two, by more than the floor, is late there.
    big = {s.comm for s in judged}
    for s in pairs:
        for a, b in _bounds(len(s.rows), window):
            meds = [mid(col) for col in zip(*s.rows[a:b], strict=True)]
            least = floor * mid(s.optime_ms[a:b])
            for i, r in enumerate(s.ranks):
                tally = per_comm.setdefault((r, s.comm), [0, 0])
                tally[0] += 1
                if meds[i] - meds[1 - i] > least:
                    tally[1] += 1
    ranks = {r: mid(window_meds[r]) for r in sorted(window_meds)}
    spread = mid(spreads) if spreads else None
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
    # Late in a communicator: an outlier in at least half of its windows there, and in two or more.
    late_in = {key: t[1] >= MIN_WINDOWS and t[1] >= RECURRENCE * t[0] for key, t in per_comm.items()}
    slow = sorted({r for (r, c), v in late_in.items() if v and c in big})
    late_in = {key: v for key, v in late_in.items() if key[0] in slow}
    waited = _waited(slow, late_in)
    labels = {s.comm: s.label for s in order}
    stragglers = []
    for r in slow:
        if r in waited:
            continue
        comms = [c for (q, c), v in late_in.items() if q == r and v and c in big]
        n_flagged = sum(per_comm[(r, c)][1] for c in comms)
        n_seen = sum(per_comm[(r, c)][0] for c in comms)
        stragglers.append(_describe(r, judged, n_flagged, n_seen, comms, labels))
    stragglers.sort(key=lambda s: (-s.lateness_ms, s.rank))
    waited_out = tuple(
        Waited(r, tuple(sorted({y for y, _c in pairs})), tuple(sorted({labels[c] for _y, c in pairs})))
        for r, pairs in sorted(waited.items())
    )
    return Judgement(tuple(stragglers), ranks, n_windows, n_ops, spread, params=params, waited=waited_out)


def _noise_of_median(cols: list[tuple[float, ...]], meds: list[float]) -> float:
    """The standard-error-like spread of one member's median over a window: the pooled MAD of each
    member's lateness around its own median, x 1.2533 / sqrt(n) (the median's efficiency)."""
    devs = [abs(x - md) for col, md in zip(cols, meds, strict=True) for x in col]
    n = len(cols[0]) if cols else 1
    return mid(devs) * 1.2533 / n**0.5 if devs else 0.0


def _waited(slow: list[int], late_in: dict[tuple[int, str], bool]) -> dict[int, list[tuple[int, str]]]:
    """rank -> [(straggler, communicator)]: a flagged rank not late in a communicator where another
    flagged rank is late waited for that rank there. Only a rank that waited for a straggler that itself
    waited for no one is moved (two ranks that each look as if they waited for the other stay)."""
    late_by_comm: dict[str, list[int]] = {}
    for (r, c), v in sorted(late_in.items()):
        if v:
            late_by_comm.setdefault(c, []).append(r)
    candidates: dict[int, list[tuple[int, str]]] = {}
    for (r, c), v in sorted(late_in.items()):
        if v:
            continue
        for y in late_by_comm.get(c, []):
            if y != r:
                candidates.setdefault(r, []).append((y, c))
    roots = [r for r in slow if r not in candidates]
    out = {}
    for r, pairs in candidates.items():
        kept = [(y, c) for y, c in pairs if y in roots]
        if kept:
            out[r] = kept
    return out


def _describe(
    rank: int, judged: list[Series], n_flagged: int, n_seen: int, comms: list[str], labels: dict[str, str]
) -> Straggler:
    waited = 0.0
    busy = 0.0
    last = 0
    mine: list[float] = []
    names: set[str] = set()
    for s in judged:
        busy += sum(s.busy_ms)
        if rank not in s.ranks:
            continue
        j = s.ranks.index(rank)
        n = len(s.ranks)
        for row in s.rows:
            own = row[j]
            mine.append(own)
            if own >= max(row):  # the last to arrive (the common case for a straggler): C-level sums
                last += 1
                waited += own * n - sum(row)
            else:
                waited += sum(own - v for v in row if v < own)
        if s.comm in comms:
            names.add(s.name)
    return Straggler(
        rank=rank,
        lateness_ms=mid(mine) if mine else 0.0,
        waiting_share=min(1.0, waited / busy) if busy > 0 else 0.0,
        late_share=last / len(mine) if mine else 0.0,
        windows_flagged=n_flagged,
        windows=n_seen,
        communicators=tuple(sorted({labels[c] for c in comms})),
        operations=tuple(sorted(names)),
    )
