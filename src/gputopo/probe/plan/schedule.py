"""Which checks run in which step of the rank pool, and which of them run at the same time (pure).

The whole run is one schedule of steps for one pool of ranks (one rank per GPU of the union of the
sets, see ``gputopo.probe``). A step is a tuple of jobs on disjoint GPUs that run at the same time; the
steps run one after another. Per set the checks keep their order: the exact P2P copy check first, so a
broken path is named before the training checks fail in its wake; then the correctness checks (dp,
ddp), which run concurrently with those of other sets on other GPUs (pairs of ``--each-pair`` in the
rounds of a round-robin tournament, other sets first-fit into the rounds); then the all-reduce sweep.
The checks that time bandwidth (p2p copies, the all-reduce sweep) run alone in their step, since sets
sharing a PCIe switch or a CPU link would otherwise slow each other down and read as ``slow``.
The per-GPU check (``gpu``: each GPU on its own, compared with its peers) is one job over the union of
the sets' GPUs, in the first step: a GPU is measured once however many sets hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from gputopo.probe.plan.config import ProbeConfig
from gputopo.probe.plan.options import check_rank

# Checks whose numbers are bandwidths: never measured while another set runs.
TIMED_CHECKS = frozenset({"gpu", "p2p", "allreduce", "speed"})
# The per-GPU check: one job over every GPU of the run, in a step of its own before any set's checks.
PER_GPU = "gpu"
# Timed checks that run before a set's correctness checks; the rest run after them.
_TIMED_FIRST = ("p2p",)


@dataclass(frozen=True)
class Job:
    """Some checks of one set, run by the pool ranks of its GPUs (one rank each), in order."""

    gpus: tuple[int, ...]
    checks: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """Steps of jobs: the jobs of a step run concurrently on disjoint GPUs, steps one after another.

    ``sets`` is the order in which sets are reported; a set's checks come from several jobs.
    """

    rounds: tuple[tuple[Job, ...], ...]
    sets: tuple[tuple[int, ...], ...]

    @property
    def jobs(self) -> tuple[Job, ...]:
        """Every job, in run order."""
        return tuple(job for rnd in self.rounds for job in rnd)

    @property
    def gpus(self) -> tuple[int, ...]:
        """The union of the sets' GPUs, ascending: pool rank ``r`` drives ``gpus[r]``."""
        return tuple(sorted({g for s in self.sets for g in s}))


def round_robin(gpus: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Every pair of ``gpus`` exactly once, grouped into rounds of disjoint pairs (circle method).

    n GPUs give n-1 rounds of n/2 pairs (n even) or n rounds of (n-1)/2 pairs (n odd).
    """
    players: list[int | None] = list(gpus)
    if len(players) % 2:
        players.append(None)  # the GPU drawn against None sits the round out
    n = len(players)
    rounds = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = players[i], players[n - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(tuple(sorted(pairs)))
        # Keep the first player fixed and rotate the rest by one.
        players = [players[0], players[-1], *players[1:-1]]
    return tuple(rounds)


def first_fit(
    rounds: list[list[tuple[int, ...]]], sets: tuple[tuple[int, ...], ...]
) -> list[list[tuple[int, ...]]]:
    """Put each set into the first round whose sets share none of its GPUs, or into a new round."""
    out = [list(r) for r in rounds]
    for s in sets:
        for rnd in out:
            if not any(set(s) & set(other) for other in rnd):
                rnd.append(s)
                break
        else:
            out.append([s])
    return out


def make_plan(config: ProbeConfig, more_sets: tuple[tuple[int, ...], ...] = ()) -> Plan:
    """The steps for ``config``: its sets (or every pair with ``--each-pair``), then ``more_sets``.

    ``more_sets`` lets one run probe every pair and a few larger sets (``gputopo doctor``); a set
    already planned is not planned twice.
    """
    checks = tuple(sorted(config.checks, key=check_rank))  # dp@fp16 sorts as dp
    pairs: tuple[tuple[int, ...], ...] = ()
    if config.each_pair:
        pairs = tuple(combinations(config.sets[0], 2))
        listed: tuple[tuple[int, ...], ...] = pairs
    else:
        listed = config.sets
    sets: list[tuple[int, ...]] = []
    for s in (*listed, *more_sets):
        if s not in sets and tuple(sorted(s)) not in {tuple(sorted(x)) for x in sets}:
            sets.append(s)
    steps: list[tuple[Job, ...]] = []
    reported = list(sets)
    if PER_GPU in checks:
        # One job over every GPU, reported under the set that holds exactly them; where none does, under
        # a set of its own (the only set, when no other check runs).
        checks = tuple(c for c in checks if c != PER_GPU)
        union = tuple(sorted({g for s in sets for g in s}))
        home = next((s for s in sets if tuple(sorted(s)) == union), union)
        if not checks:
            sets, reported = [], [home]
        elif home not in sets:
            reported.append(home)
        steps.append((Job(home, (PER_GPU,)),))
    first = tuple(c for c in checks if c in _TIMED_FIRST)
    together = tuple(c for c in checks if c not in TIMED_CHECKS)
    last = tuple(c for c in checks if c in TIMED_CHECKS and c not in _TIMED_FIRST)
    if first:
        steps.extend((Job(s, first),) for s in sets)
    if together:
        rounds: list[list[tuple[int, ...]]] = []
        if config.each_pair:
            rounds = [list(rnd) for rnd in round_robin(config.sets[0])]
        others = tuple(s for s in sets if s not in pairs)
        steps.extend(tuple(Job(s, together) for s in rnd) for rnd in first_fit(rounds, others))
    if last:
        steps.extend((Job(s, last),) for s in sets)
    return Plan(rounds=tuple(steps), sets=tuple(reported))
