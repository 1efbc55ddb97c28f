"""The ranks' process groups, recorded through a stand-in for torch.distributed: every subgroup gets the
run's timeout, ranks that wait while rank 0 drives the set's GPUs wait in a gloo (CPU) group, and a set's
groups are destroyed after its last step.

A real NCCL subgroup needs GPUs; the calls torch would receive are what these tests look at (the CPU
pool runs the same code with real gloo groups in tests/test_probe_cli.py).
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from gputopo.probe.ranks import context, worker  # noqa: E402
from gputopo.probe.shared import COLLECTIVE_TIMEOUT_GRACE_S  # noqa: E402


class RecordingDist:
    """The calls the worker makes on torch.distributed, each group a numbered name."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.made = 0

    def new_group(self, ranks, **kwargs):
        self.made += 1
        name = f"{kwargs.get('backend') or 'default'}{self.made}:{','.join(map(str, ranks))}"
        self.calls.append(("new_group", {"ranks": list(ranks), "name": name, **kwargs}))
        return name

    def get_group_rank(self, group, rank):
        return [int(r) for r in group.split(":")[1].split(",")].index(rank)

    def barrier(self, group=None, device_ids=None):
        self.calls.append(("barrier", {"group": group, "device_ids": device_ids}))

    def destroy_process_group(self, group=None):
        self.calls.append(("destroy", {"group": group}))


def test_every_subgroup_gets_the_runs_timeout_not_ncclS_ten_minute_default():
    dist = RecordingDist()
    spec = {"timeout_s": 900}
    group, wait = worker.set_groups([2, 0], spec, "cuda", dist.new_group)
    made = [kw for name, kw in dist.calls if name == "new_group"]
    assert len(made) == 2
    want = timedelta(seconds=900 + COLLECTIVE_TIMEOUT_GRACE_S)
    assert all(kw["timeout"] == want and kw["ranks"] == [2, 0] for kw in made)
    # The set's own group takes the world's backend (NCCL); the waiting group is gloo.
    assert made[0].get("backend") is None and made[1]["backend"] == "gloo"
    assert group != wait


def test_the_waiting_group_keeps_the_sets_order_and_backend_through_compat(monkeypatch):
    import torch.distributed as real

    from gputopo.probe.ranks import compat

    dist = RecordingDist()
    monkeypatch.setattr(real, "new_group", dist.new_group)
    monkeypatch.setattr(compat, "_new_group_takes_sort_ranks", lambda: True)
    compat.new_group_in_order([1, 0], timeout=timedelta(seconds=5), backend="gloo")
    ((_, kw),) = dist.calls
    assert kw["sort_ranks"] is False and kw["backend"] == "gloo" and kw["timeout"] == timedelta(seconds=5)


def test_cpu_ranks_wait_in_the_sets_own_gloo_group():
    dist = RecordingDist()
    group, wait = worker.set_groups([0, 1], {"timeout_s": 30}, "cpu", dist.new_group)
    assert group == wait and len(dist.calls) == 1


def _cuda_ctx(tmp_path, rank, wait_group):
    # A CUDA device object needs no GPU; nothing here touches it.
    return context.RankContext(
        rank, 2, rank, torch.device("cuda", rank), {"checks": ["p2p"]}, tmp_path, wait_group=wait_group
    )


def test_waiting_ranks_wait_on_the_cpu_group_never_an_nccl_barrier_on_their_gpu(tmp_path, monkeypatch):
    dist = RecordingDist()
    monkeypatch.setattr(context, "dist", dist)
    context.wait_for_others(_cuda_ctx(tmp_path, 1, "gloo-set"), "nccl-set")
    assert dist.calls == [("barrier", {"group": "gloo-set", "device_ids": None})]
    # Without a CPU group (CPU ranks), the set's group, as before.
    dist.calls.clear()
    cpu = context.RankContext(1, 2, 0, torch.device("cpu"), {}, tmp_path)
    context.wait_for_others(cpu, "gloo-set")
    assert dist.calls == [("barrier", {"group": "gloo-set", "device_ids": None})]


def test_the_p2p_check_keeps_ranks_1_to_n_off_the_gpus_rank_0_times(tmp_path, monkeypatch):
    from gputopo.probe.ranks import p2p

    dist = RecordingDist()
    monkeypatch.setattr(context, "dist", dist)
    driven = []
    monkeypatch.setattr(p2p, "p2p_check", lambda ctx, devices: driven.append(ctx.rank) or {"pairs": []})
    for rank in (0, 1):
        ctx = _cuda_ctx(tmp_path, rank, "gloo-set")
        ctx._progress_file = open(tmp_path / f"progress-{rank}.jsonl", "a")  # noqa: SIM115
        worker.run_checks(ctx, "nccl-set", [0, 1])
        ctx._progress_file.close()
    assert driven == [0]
    assert [kw["group"] for name, kw in dist.calls if name == "barrier"] == ["gloo-set", "gloo-set"]


def test_a_sets_groups_are_destroyed_after_its_last_step(tmp_path, monkeypatch):
    import torch.distributed as real

    dist = RecordingDist()
    for name in ("get_group_rank", "barrier", "destroy_process_group"):
        monkeypatch.setattr(real, name, getattr(dist, name))
    monkeypatch.setattr(worker, "new_group_in_order", dist.new_group)  # (torch's, keeping the order)
    ran = []
    monkeypatch.setattr(worker, "run_checks", lambda ctx, group, devices: ran.append((ctx.task, group)))
    job = {"checks": ["allreduce"], "out_dir": str(tmp_path)}
    schedule = [
        [{**job, "id": "a", "ranks": [0, 1]}],
        [{**job, "id": "b", "ranks": [0]}],
        [{**job, "id": "c", "ranks": [0, 1]}],
    ]
    spec = {"timeout_s": 60, "out_dir": str(tmp_path), "schedule": schedule}
    with open(tmp_path / "progress.jsonl", "a") as log:
        worker.run_schedule(spec, 0, SimpleNamespace(type="cpu", index=None), log)
    order = [(name, kw.get("name") or kw.get("group")) for name, kw in dist.calls if name != "barrier"]
    # [0, 1]'s group lives on to step 2 (its last); [0]'s ends after step 1.
    assert order == [
        ("new_group", "default1:0,1"),
        ("new_group", "default2:0"),
        ("destroy", "default2:0"),
        ("destroy", "default1:0,1"),
    ]
    assert [t for t, _ in ran] == ["a", "b", "c"]
    made = [kw for name, kw in dist.calls if name == "new_group"]
    assert all(kw["timeout"] == timedelta(seconds=60 + COLLECTIVE_TIMEOUT_GRACE_S) for kw in made)
