"""Which launches run and which run together: the health matrix of `--each-pair`."""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

from hypothesis import given
from hypothesis import strategies as st

from gputopo.probe.plan.config import DeviceInventory, Mode, build_config
from gputopo.probe.plan.schedule import TIMED_CHECKS, make_plan, round_robin

EIGHT_GPU_BOX = DeviceInventory("cuda", tuple(range(8)), tuple(str(i) for i in range(8)))


@given(st.lists(st.integers(0, 31), min_size=2, max_size=12, unique=True))
def test_round_robin_meets_every_pair_once_in_disjoint_rounds(gpus):
    rounds = round_robin(tuple(gpus))
    met = [pair for rnd in rounds for pair in rnd]
    assert sorted(met) == sorted(tuple(sorted(p)) for p in combinations(gpus, 2))
    for rnd in rounds:
        used = [g for pair in rnd for g in pair]
        assert len(used) == len(set(used)), "a GPU twice in one round"
    n = len(gpus)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def test_a_sets_checks_keep_their_order_and_overlapping_sets_never_share_a_step():
    plan = make_plan(build_config(EIGHT_GPU_BOX, ["5,6", "6,7"]))
    assert [[(j.gpus, j.checks) for j in rnd] for rnd in plan.rounds] == [
        [((5, 6, 7), ("gpu",))],  # every GPU on its own, once, first (reported as a set of its own)
        [((5, 6), ("p2p",))],
        [((6, 7), ("p2p",))],
        [((5, 6), ("dp", "ddp"))],
        [((6, 7), ("dp", "ddp"))],
        [((5, 6), ("allreduce",))],
        [((6, 7), ("allreduce",))],
    ]
    assert plan.sets == ((5, 6), (6, 7), (5, 6, 7)) and plan.gpus == (5, 6, 7)


def test_disjoint_sets_share_their_correctness_step():
    plan = make_plan(build_config(EIGHT_GPU_BOX, ["0,1", "2,3,4"], mode=Mode.DDP))
    assert [[j.gpus for j in rnd] for rnd in plan.rounds] == [[(0, 1), (2, 3, 4)]]


def test_each_pair_runs_training_checks_concurrently_and_timed_checks_alone():
    plan = make_plan(build_config(EIGHT_GPU_BOX, ["0,1,2,3"], each_pair=True, mode=Mode.ALL))
    assert plan.sets == (*combinations((0, 1, 2, 3), 2), (0, 1, 2, 3))
    assert [(j.gpus, j.checks) for j in plan.rounds[0]] == [((0, 1, 2, 3), ("gpu",))]
    plan = replace(plan, rounds=plan.rounds[1:], sets=plan.sets[:-1])  # the pairs' own steps, below
    together = [rnd for rnd in plan.rounds if rnd[0].checks == ("dp", "ddp")]
    alone = [rnd for rnd in plan.rounds if set(rnd[0].checks) <= TIMED_CHECKS]
    assert len(together) == 3 and all(len(rnd) == 2 for rnd in together)
    assert len(alone) == 12 and all(len(rnd) == 1 for rnd in alone)
    assert [rnd[0].checks for rnd in alone] == [("p2p",)] * 6 + [("allreduce",)] * 6
    assert len(plan.rounds) == len(together) + len(alone)
    # Every set's checks run p2p, then dp/ddp, then allreduce.
    for s in plan.sets:
        order = [c for rnd in plan.rounds for j in rnd if j.gpus == s for c in j.checks]
        assert order == ["p2p", "dp", "ddp", "allreduce"]


def test_more_sets_join_the_pairs_once_and_fill_rounds_first_fit():
    config = build_config(EIGHT_GPU_BOX, ["0,1,2,3,4,5"], each_pair=True, mode=Mode.DDP)
    plan = make_plan(config, more_sets=((0, 1), (0, 1, 2, 3), (0, 1, 2, 3, 4, 5)))
    assert plan.sets.count((0, 1)) == 1 and plan.sets[-2:] == ((0, 1, 2, 3), (0, 1, 2, 3, 4, 5))
    assert len(plan.rounds) == 5 + 2  # 6 GPUs: 5 pair rounds that use every GPU, then one per big set
    for rnd in plan.rounds:
        used = [g for j in rnd for g in j.gpus]
        assert len(used) == len(set(used))


def test_each_pair_with_only_allreduce_is_one_pair_at_a_time():
    plan = make_plan(build_config(EIGHT_GPU_BOX, ["0,1,2"], each_pair=True, mode=Mode.ALLREDUCE))
    assert all(len(rnd) == 1 for rnd in plan.rounds)
    assert [rnd[0].gpus for rnd in plan.rounds] == [(0, 1), (0, 2), (1, 2)]


def test_each_pair_ddp_only_has_no_serial_rounds():
    plan = make_plan(build_config(EIGHT_GPU_BOX, each_pair=True, mode=Mode.DDP))
    assert len(plan.rounds) == 7 and all(len(rnd) == 4 for rnd in plan.rounds)
    assert len(plan.jobs) == 28
