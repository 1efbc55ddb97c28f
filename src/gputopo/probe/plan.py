"""Which launches run, with which checks, and which of them may run at the same time (pure).

One launch per set runs all of that set's distributed checks in one go, because starting ranks costs
more than most checks. With ``--each-pair`` the correctness checks (dp, ddp) of disjoint pairs run
concurrently, in the rounds of a round-robin tournament; the checks that measure bandwidth (p2p copies,
the all-reduce sweep) run one pair at a time, since pairs sharing a PCIe switch or a CPU link would
otherwise slow each other down and read as ``slow``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from gputopo.probe.config import ProbeConfig
from gputopo.probe.options import check_rank

# Checks whose numbers are bandwidths: never measured while another launch runs.
TIMED_CHECKS = frozenset({"p2p", "allreduce", "speed"})


@dataclass(frozen=True)
class Job:
    """One launch: the GPUs it runs on (one rank each) and the checks it runs, in order."""

    gpus: tuple[int, ...]
    checks: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """Rounds of jobs: the jobs of a round run concurrently, rounds run one after another.

    ``sets`` is the order in which sets are reported; a set's checks may come from several jobs.
    """

    rounds: tuple[tuple[Job, ...], ...]
    sets: tuple[tuple[int, ...], ...]

    @property
    def jobs(self) -> tuple[Job, ...]:
        """Every job, in run order."""
        return tuple(job for rnd in self.rounds for job in rnd)


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


def make_plan(config: ProbeConfig) -> Plan:
    """The launches for ``config``: one per set, or pair rounds for ``--each-pair``."""
    checks = tuple(sorted(config.checks, key=check_rank))
    if not config.each_pair:
        return Plan(rounds=tuple((Job(s, checks),) for s in config.sets), sets=config.sets)
    gpus = config.sets[0]
    pairs = tuple(combinations(gpus, 2))
    together = tuple(c for c in checks if c not in TIMED_CHECKS)
    alone = tuple(c for c in checks if c in TIMED_CHECKS)
    rounds: list[tuple[Job, ...]] = []
    if together:
        rounds.extend(tuple(Job(pair, together) for pair in rnd) for rnd in round_robin(gpus))
    if alone:
        rounds.extend((Job(pair, alone),) for pair in pairs)
    return Plan(rounds=tuple(rounds), sets=pairs)
