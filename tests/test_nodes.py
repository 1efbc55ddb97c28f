"""Across nodes in plain data: the test plan, the bisection, stragglers by median and MAD, hang naming,
the options from flags and from a Slurm job, and the document sections (no torch, no processes)."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.errors import UsageError
from gputopo.launch.slurm import slurm_job
from gputopo.probe.judge import nodes
from gputopo.probe.judge import progress as judge_progress
from gputopo.probe.plan.nodes import parse_endpoint, resolve_nodes
from gputopo.probe.report.nodes import add_nodes, internode_section, local_summary, nodes_markdown


def table(nnodes: int, per_node: int = 1) -> list[dict[str, Any]]:
    """Ranks as the rendezvous might number them: not in node order."""
    rows = []
    order = list(range(nnodes))[::-1]  # c10d sorts agents by their descriptors, not by our node rank
    for rank in range(nnodes * per_node):
        node = order[rank // per_node]
        rows.append(
            {
                "rank": rank,
                "node": node,
                "host": f"n{node:02d}",
                "local_rank": rank % per_node,
                "gpu": rank % per_node,
                "nic": f"mlx5_{rank % per_node}",
            }
        )
    return rows


def simulate(
    nnodes: int,
    per_node: int = 1,
    bad: set[int] = frozenset(),
    bad_links: set[frozenset[int]] = frozenset(),
    slow: set[int] = frozenset(),
    slow_links: set[frozenset[int]] = frozenset(),
) -> tuple[nodes.Layout, list[dict[str, Any]]]:
    """Run ``next_step`` to the end against a model of the cluster: a test fails when it holds a bad
    node or both ends of a bad link; a slow node is late by 50 ms; a slow link halves the busbw."""
    layout = nodes.Layout.from_table(table(nnodes, per_node), nnodes)
    results: list[dict[str, Any]] = []
    steps = 0
    while (step := nodes.next_step(layout, results)) is not None:
        steps += 1
        assert steps < 50, "the plan never ends"
        used: set[int] = set()
        for test in step:
            members = set(test["nodes"])
            assert not used & members, "tests of one step share a node"
            used |= members
            wrong = any(n in bad for n in members) or any(link <= members for link in bad_links)
            slow_link = any(link <= members for link in slow_links)
            late = {str(n): (50.0 if n in slow and len(members) > 1 else 0.1) for n in members}
            results.append(
                {
                    **test,
                    "id": f"t{len(results)}",
                    "wrong": 4 if wrong else 0,
                    "busbw_gbps": 5.0 if slow_link else 10.0 + 0.01 * len(results),
                    "lateness_ms": late,
                    "late_rank": {str(n): layout.node_ranks(n)[0] for n in members},
                }
            )
    return layout, results


def test_the_plan_is_all_nodes_then_each_node_once_then_rails() -> None:
    layout, results = simulate(4, per_node=2)
    kinds = [(t["kind"], tuple(t["nodes"]), t["rail"]) for t in results]
    assert kinds == [
        ("all", (0, 1, 2, 3), None),
        ("pair", (0, 1), None),
        ("pair", (2, 3), None),
        ("rail", (0, 1, 2, 3), 0),
        ("rail", (0, 1, 2, 3), 1),
    ]
    assert nodes.findings(layout, results)[0] == []


def test_an_odd_count_runs_the_last_node_again_with_node_0() -> None:
    steps = nodes.pair_steps([0, 1, 2, 3, 4])
    assert [[t["nodes"] for t in s] for s in steps] == [[[0, 1], [2, 3]], [[0, 4]]]
    assert nodes.pair_steps([0, 1]) == []  # two nodes: the all-nodes test is the pair


def test_rail_ranks_are_gpu_k_of_every_node_and_groups_go_node_by_node() -> None:
    layout = nodes.Layout.from_table(table(3, per_node=2), 3)
    assert layout.test_ranks({"nodes": [0, 1, 2], "rail": None}) == [4, 5, 2, 3, 0, 1]
    assert layout.test_ranks({"nodes": [0, 1, 2], "rail": 1}) == [5, 3, 1]
    uneven = [*table(2, 2)[:3]]  # node 1 has two GPUs, node 0 one: no rails
    assert nodes.Layout.from_table(uneven, 2).rails == 0


@pytest.mark.parametrize("nnodes", [3, 4, 5, 8])
@pytest.mark.parametrize("culprit_at", ["first", "last"])
def test_a_corrupting_node_is_bisected_down_to_itself(nnodes: int, culprit_at: str) -> None:
    culprit = 0 if culprit_at == "first" else nnodes - 1
    layout, results = simulate(nnodes, bad={culprit})
    found, _ = nodes.findings(layout, results)
    assert [(f["kind"], f["nodes"]) for f in found] == [("corrupt", [culprit])]
    assert f"node {culprit} (n{culprit:02d})" in found[0]["detail"]
    # Far fewer runs than every pair of nodes.
    assert len(results) <= 1 + nnodes // 2 + 1 + 2 + 2 * nnodes.bit_length()


def test_a_bad_link_between_two_nodes_is_named_as_the_pair() -> None:
    layout, results = simulate(6, bad_links={frozenset({2, 3})})
    found, _ = nodes.findings(layout, results)
    assert [(f["kind"], f["nodes"]) for f in found] == [("corrupt", [2, 3])]
    assert "between node 2 (n02) and node 3 (n03)" in found[0]["detail"]


def test_two_corrupting_nodes_are_both_named() -> None:
    layout, results = simulate(8, bad={1, 6})
    found, _ = nodes.findings(layout, results)
    assert sorted(f["nodes"][0] for f in found) == [1, 6]


def test_with_no_healthy_node_the_pair_stays_unresolved_and_says_so() -> None:
    layout, results = simulate(2, bad={0, 1})
    found, _ = nodes.findings(layout, results)
    assert found[0]["nodes"] == [0, 1]
    assert "no node seen healthy" in found[0]["detail"]


def test_a_group_that_fails_only_whole_is_named_as_the_group() -> None:
    results = [
        {"kind": "all", "nodes": [0, 1, 2], "rail": None, "wrong": 3},
        {"kind": "pair", "nodes": [0, 1], "rail": None, "wrong": 0},
        {"kind": "pair", "nodes": [0, 2], "rail": None, "wrong": 0},
    ]
    # Three nodes are not halved (a node alone uses no link between nodes): the missing pair runs.
    culprits, needed = nodes.bisection(results)
    assert culprits == [] and [t["nodes"] for t in needed] == [[1, 2]]
    results.append({"kind": "bisect", "nodes": [1, 2], "rail": None, "wrong": 0})
    culprits, needed = nodes.bisection(results)
    assert needed == []
    assert [(c.kind, c.nodes) for c in culprits] == [("group", (0, 1, 2))]


def test_a_bad_link_across_the_halves_is_found_between_them() -> None:
    # Eight nodes, link 2-6: each half passes alone, so the pairs across the halves are tried.
    layout, results = simulate(8, bad_links={frozenset({2, 6})})
    found, _ = nodes.findings(layout, results)
    assert [(f["kind"], f["nodes"]) for f in found] == [("corrupt", [2, 6])]


def test_a_failed_rail_fails_the_run_and_names_its_nics() -> None:
    layout, results = simulate(4, per_node=2)
    results[-1] = {**results[-1], "wrong": 2}
    found, _ = nodes.findings(layout, results)
    assert [(f["kind"], f["nodes"]) for f in found] == [("corrupt", [0, 1, 2, 3])]
    assert "rail 1 (GPU 1 of every node, NICs mlx5_1)" in found[0]["detail"]


def test_passing_rails_do_not_make_a_node_a_healthy_reference() -> None:
    # A fault inside nodes 1 and 2 (their NVLinks): every test holding them fails but the rails pass.
    layout, results = simulate(3, per_node=2, bad={1, 2})
    assert [t["kind"] for t in results][-2:] == ["rail", "rail"]
    results[-2:] = [{**t, "wrong": 0} for t in results[-2:]]
    found, _ = nodes.findings(layout, results)
    assert all("all-reduce sums came back wrong in every group holding it" not in f["detail"] for f in found)


def test_a_straggler_is_named_by_median_and_mad() -> None:
    layout, results = simulate(4, slow={2})
    found, _ = nodes.findings(layout, results)
    assert [(f["kind"], f["nodes"]) for f in found] == [("straggler", [2])]
    assert "GPU 0, NIC mlx5_0" in found[0]["detail"]


def test_even_lateness_spread_names_no_one_and_small_clusters_are_not_judged() -> None:
    results = [
        {"kind": "all", "nodes": [0, 1, 2, 3], "lateness_ms": {"0": 1.0, "1": 2.5, "2": 0.3, "3": 1.7}}
    ]
    assert nodes.stragglers(results, [0, 1, 2, 3])[0] == []
    found, why = nodes.stragglers(
        [{"kind": "all", "nodes": [0, 1], "lateness_ms": {"0": 0, "1": 80}}], [0, 1]
    )
    assert found == [] and "at least 3 nodes" in (why or "")


def test_slow_links_need_three_pairs_then_are_bisected() -> None:
    layout, results = simulate(6, slow_links={frozenset({2, 3})})
    found, notes = nodes.findings(layout, results)
    assert [(f["kind"], f["nodes"]) for f in found] == [("slow", [2, 3])]
    layout, results = simulate(4, slow_links={frozenset({2, 3})})
    found, notes = nodes.findings(layout, results)
    assert found == [] and any("at least 3 pairs" in n for n in notes)


def test_the_layout_refuses_duplicate_or_missing_node_ranks() -> None:
    rows = table(3)
    rows[1]["node"] = rows[0]["node"]
    rows[1]["host"] = "other"
    with pytest.raises(ValueError, match="two nodes said --node-rank"):
        nodes.Layout.from_table(rows, 3)
    with pytest.raises(ValueError, match="no node said --node-rank 2"):
        nodes.Layout.from_table(table(2), 3)


def progress_row(rank: int, node: int, step: int, stage: str, seq: int = 0) -> dict[str, Any]:
    return {
        "rank": rank,
        "node": node,
        "host": f"n{node}",
        "gpu": 0,
        "seq": seq,
        "step": step,
        "test": "t3",
        "stage": stage,
    }


def test_a_hang_is_pinned_on_the_ranks_that_got_least_far_in_the_plan() -> None:
    # Step 2 runs bisect tests 1-5 and 0-4; nodes 2 and 3 sit it out (few rows, so a low count, but done
    # with the step); node 5 hangs before its all-reduce while node 1 waits inside it.
    progress = {
        0: progress_row(0, 0, 2, "gather", seq=30),
        1: progress_row(1, 1, 2, "collective", seq=28),
        2: progress_row(2, 2, 2, "gather", seq=12),
        3: progress_row(3, 3, 2, "gather", seq=12),
        4: progress_row(4, 4, 2, "gather", seq=30),
        5: progress_row(5, 5, 2, "enter", seq=27),
    }
    found = judge_progress.hang_findings(progress, 30)
    assert [f["nodes"] for f in found] == [[5]]
    assert "node 5 (n5), GPU 0: stopped at t3 (enter), before its all-reduce" in found[0]["detail"]
    # Everyone of a test inside its collective: the collective between those nodes hangs.
    stuck = {r: progress_row(r, r, 1, "size" if r < 2 else "gather") for r in range(4)}
    together = judge_progress.hang_findings(stuck, 30)
    assert (
        together[0]["nodes"] == [0, 1] and "the collective between these nodes hangs" in together[0]["detail"]
    )
    assert judge_progress.hang_findings({}, 30)[0]["nodes"] == []


def test_a_crash_is_pinned_on_the_ranks_that_left() -> None:
    progress = {r: progress_row(r, r, 1, "collective") for r in range(3)}
    progress[1] = progress_row(1, 1, 1, "injected-crash")
    progress[2] = progress_row(2, 2, 1, "gather")  # sat the step out
    found = judge_progress.crash_findings(progress, "Connection reset by peer")
    assert [f["nodes"] for f in found] == [[1]] and "stopped at t3 (injected-crash)" in found[0]["detail"]
    # Inside the collective a crash looks like its peers: nothing is named.
    assert (
        judge_progress.crash_findings({r: progress_row(r, r, 1, "collective") for r in range(3)}, "x") == []
    )


OPTIONS = {
    "nnodes": 4,
    "node_rank": 0,
    "endpoint": "n00:29400",
    "rdzv_id": "x",
    "rdzv_timeout_s": 20,
    "timeout_s": 30,
    "source": "flags",
}


def test_a_rendezvous_that_gave_up_names_who_never_came() -> None:
    rows, section = internode_section(OPTIONS, "rendezvous", None, {"0": "a", "1": "b", "3": "d"}, {}, "")
    assert "3 of 4 nodes joined (node rank 0, 1, 3); never came: node rank 2" in section["message"]
    assert [r["verdict"] for r in rows] == ["not tested", "not tested", "fail", "not tested"]
    doc = add_nodes({"verdict": "pass", "sets": []}, rows, section)
    assert doc["verdict"] == "fail"


def test_node_verdicts_and_the_report_sections() -> None:
    layout, results = simulate(4, bad={1})
    record = {
        "ranks": list(layout.ranks),
        "tests": results,
        "local": {
            "0": local_summary(0, None, "one GPU"),
            "3": local_summary(
                3,
                {
                    "verdict": "fail",
                    "sets": [
                        {
                            "gpus": [0, 1],
                            "verdict": "fail",
                            "checks": [
                                {
                                    "name": "p2p",
                                    "verdict": "fail",
                                    "kind": "corrupt",
                                    "detail": "copies wrong",
                                    "remedy": "disable ACS",
                                }
                            ],
                        }
                    ],
                },
            ),
        },
    }
    rows, section = internode_section(OPTIONS, "ok", record, {}, {}, "")
    assert [r["verdict"] for r in rows] == ["pass", "fail", "pass", "fail"]
    assert rows[3]["findings"][0]["detail"].startswith("node 3, GPUs 0,1, p2p: copies wrong")
    doc = add_nodes({"verdict": "pass", "sets": []}, rows, section)
    text = "\n".join(nodes_markdown(doc))
    assert "### Node 1 (n01): fail" in text and "| pair 0-1 | 0,1 | 4 |" in text
    assert doc["verdict"] == "fail"


def test_options_from_flags() -> None:
    node = resolve_nodes(4, 2, "head:1234", None, 30, None)
    assert node is not None
    assert (node.nnodes, node.node_rank, node.host, node.port, node.rdzv_id) == (
        4,
        2,
        "head",
        1234,
        "gputopo",
    )
    assert resolve_nodes(None, None, None, None, None, None) is None
    assert resolve_nodes(1, None, None, None, None, None) is None
    assert parse_endpoint("[fe80::1]:29500") == ("fe80::1", 29500)
    assert parse_endpoint("head") == ("head", 29400)
    with pytest.raises(UsageError, match="--node-rank"):
        resolve_nodes(4, None, "head", None, None, None)


# What `srun gputopo probe` gets on the third node of a four-node job (trimmed to what matters).
SLURM_ENV = {
    "SLURM_JOB_ID": "81234",
    "SLURM_JOB_NODELIST": "gpu-a[07-10]",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_STEP_NODELIST": "gpu-a[07-10]",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_STEP_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_GPUS": "0,1,2,3,4,5,6,7",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}


def test_a_slurm_node_meets_at_node_0s_address_and_goes_by_slurmd_nodename() -> None:
    env = {**SLURM_ENV, "SLURM_NODEID": "0", "SLURM_STEP_NODEID": "0", "SLURMD_NODENAME": "gpu-a07"}
    job = slurm_job(env, hostnames=lambda _: None, node_addr=lambda name: "10.12.0.7")
    node = resolve_nodes(None, None, None, None, None, None, job)
    assert node is not None
    assert (node.endpoint, node.hostname, node.store_is_host) == ("10.12.0.7:32327", "gpu-a07", True)
    # Several slurmd on one machine share a host name; SLURMD_NODENAME tells them apart.
    env = {**env, "SLURM_NODEID": "1", "SLURM_STEP_NODEID": "1", "SLURMD_NODENAME": "gpu-a08"}
    node = resolve_nodes(None, None, None, None, None, None, slurm_job(env, hostnames=lambda _: None))
    assert node is not None and (node.node_rank, node.hostname, node.store_is_host) == (1, "gpu-a08", False)


def test_options_default_from_the_slurm_job() -> None:
    job = slurm_job(SLURM_ENV, hostnames=lambda _: None)
    node = resolve_nodes(None, None, None, None, None, None, job)
    assert node is not None
    # The job's own port (29501 + 81234 % 3267 = 32327), never torch's shared default 29400.
    assert (node.nnodes, node.node_rank, node.endpoint, node.rdzv_id, node.source) == (
        4,
        2,
        "gpu-a07:32327",
        "gputopo-81234",
        "slurm",
    )
    # Named as Slurm names the node (its place in the node list), not by gethostname().
    assert node.hostname == "gpu-a09"
    # A derived endpoint: only node 0 hosts the store, said outright, so a held port is an error in torch
    # rather than a silent join of another job's store.
    assert node.store_is_host is False
    # Flags win over the job; the user's endpoint is left to torch to host as torchrun would.
    node = resolve_nodes(None, None, "login:5000", "mine", None, None, job)
    assert node is not None and (node.endpoint, node.rdzv_id, node.node_rank) == ("login:5000", "mine", 2)
    assert node.store_is_host is None and node.hostname == "gpu-a09"
    # One task per GPU (srun's habit for training scripts) would start eight gputopo per node.
    crowded = slurm_job({**SLURM_ENV, "SLURM_STEP_NUM_TASKS": "32"}, hostnames=lambda _: None)
    with pytest.raises(UsageError, match="32 tasks on 4 nodes"):
        resolve_nodes(None, None, None, None, None, None, crowded)
    # A one-node step is a run on this machine.
    one = slurm_job(
        {
            **SLURM_ENV,
            "SLURM_STEP_NODELIST": "gpu-a07",
            "SLURM_STEP_NUM_NODES": "1",
            "SLURM_NNODES": "1",
            "SLURM_NODEID": "0",
            "SLURM_STEP_NODEID": "0",
        },
        hostnames=lambda _: None,
    )
    assert resolve_nodes(None, None, None, None, None, None, one) is None
