"""The rank-side checks in this process: checksums, the reference's two float orders, and DataParallel on CPU.

DataParallel's primitives exist only for CUDA; on CPU the probe runs the same four steps through
``CpuDataParallel``. These tests train it against the reference on CPU and feed the curves to the judge.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")

from gputopo.probe.judge import verdict  # noqa: E402
from gputopo.probe.ranks import allreduce as rank_allreduce  # noqa: E402
from gputopo.probe.ranks import context  # noqa: E402
from gputopo.probe.ranks import training as checks  # noqa: E402
from gputopo.probe.ranks.models import IMAGE_SHAPE, NUM_CLASSES, build_model, synthetic_batch  # noqa: E402


def make_ctx(tmp_path, world=2, steps=3, **spec):
    base = {"model": "tiny", "seed": 0, "steps": steps, "batch_size": 4, "lr": 0.05, "inject": None}
    base.update(spec)
    return context.RankContext(0, world, 0, torch.device("cpu"), base, tmp_path)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    checks._REFERENCE_CACHE.clear()  # each test computes its own references
    yield
    torch.set_num_threads(before)


def test_a_pool_rank_runs_each_reference_once_per_set_size(tmp_path):
    """Sets of one size in one pool rank share their reference: same model, seed, data, device."""
    ctx = make_ctx(tmp_path)
    first = checks.reference_run(ctx, "run 1", per_chunk_backward=False)
    again = checks.reference_run(ctx, "run 1", per_chunk_backward=False)
    assert again is first
    rows = (tmp_path / "progress-rank0.jsonl").read_text().splitlines()
    assert len(rows) == ctx.spec["steps"] + 1 and '"cached": true' in rows[-1]
    bigger = checks.reference_run(make_ctx(tmp_path, world=4), "run 1", per_chunk_backward=False)
    assert bigger is not first


def test_a_pool_rank_builds_each_model_once_and_hands_out_untrained_copies(tmp_path, monkeypatch):
    """Every reference, dp and ddp run of every set starts from the seeded weights, built once per rank."""
    built = []
    monkeypatch.setattr(context, "_PRISTINE", {})
    monkeypatch.setattr(context, "build_model", lambda name: built.append(name) or build_model(name))
    ctx = make_ctx(tmp_path)
    first = context.fresh_model(ctx, ctx.device)
    with torch.no_grad():
        for p in first.parameters():
            p.add_(1.0)  # a check trains its copy
    second = context.fresh_model(ctx, ctx.device)
    torch.manual_seed(0)
    as_built = build_model("tiny")
    assert second is not first and built == ["tiny"]
    for a, b in zip(second.state_dict().values(), as_built.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    context.fresh_model(make_ctx(tmp_path, seed=1), ctx.device)
    assert built == ["tiny", "tiny"]  # another seed is another model


def test_checksum_sees_one_flipped_bit_and_nothing_else():
    torch.manual_seed(0)
    params = [torch.randn(1000), torch.randn(3, 4)]
    same = [p.clone() for p in params]
    assert torch.equal(context.checksum(params), context.checksum(same))
    flipped = [p.clone() for p in params]
    flipped[0].view(torch.int32)[17] ^= 1  # the last mantissa bit of one element
    assert not torch.equal(context.checksum(params), context.checksum(flipped))
    assert context.checksum(params).shape == (2,)


def test_synthetic_data_is_seeded_and_cifar_sized():
    a_images, a_labels = synthetic_batch(3, 7, 8)
    b_images, b_labels = synthetic_batch(3, 7, 8)
    assert torch.equal(a_images, b_images) and torch.equal(a_labels, b_labels)
    assert a_images.shape == (8, *IMAGE_SHAPE) and int(a_labels.max()) < NUM_CLASSES
    assert not torch.equal(synthetic_batch(3, 8, 8)[0], a_images)


def test_models_are_torchvision_resnets():
    from torchvision.models.resnet import ResNet

    tiny = build_model("tiny")
    assert isinstance(tiny, ResNet)
    assert sum(p.numel() for p in tiny.parameters()) < sum(
        p.numel() for p in build_model("resnet18").parameters()
    )
    with pytest.raises(ValueError):
        build_model("vgg")


def test_known_integer_values_sum_exactly():
    world = 8
    total = sum(rank_allreduce.known_values(1000, r, torch.device("cpu")) for r in range(world))
    assert torch.equal(total, rank_allreduce.known_sum(1000, world, torch.device("cpu")))


def _float32_tree_sum(rows: torch.Tensor) -> torch.Tensor:
    """Pairwise float32 additions, as a tree all-reduce makes them (padded with zeros to a power of two)."""
    while rows.shape[0] > 1:
        if rows.shape[0] % 2:
            rows = torch.cat([rows, torch.zeros_like(rows[:1])])
        rows = rows[0::2] + rows[1::2]
    return rows[0]


def test_the_exact_all_reduce_check_stays_exact_at_512_ranks_in_ring_order():
    # A 64-node cluster of 8 GPUs: the old values, (i % 251 + 1) * (rank + 1), lost exactness past 365
    # ranks and about 15,000 of 65,536 elements of a healthy sum compared wrong.
    cpu, count, world = torch.device("cpu"), 1 << 16, 512
    total = torch.zeros(count, dtype=torch.float32)
    for r in range(world):  # a ring adds one rank's contribution after another
        total += rank_allreduce.known_values(count, r, cpu)
    expected = rank_allreduce.known_sum(count, world, cpu)
    assert int((total != expected).sum()) == 0


def test_the_exact_all_reduce_check_is_exact_up_to_its_stated_bound_and_refuses_past_it():
    cpu, count = torch.device("cpu"), 48
    world = rank_allreduce.MAX_EXACT_RANKS
    assert world >= 4096
    # Every rank's values at once (the same formula as known_values, checked against it on a sample).
    i, r = torch.arange(count), torch.arange(world)[:, None]
    rows = ((i * rank_allreduce.KNOWN_STRIDE + r) % rank_allreduce.KNOWN_PERIOD + 1).to(torch.float32)
    for k in (0, 1, 4095, world - 1):
        assert torch.equal(rows[k], rank_allreduce.known_values(count, k, cpu))
    exact = rows.to(torch.int64).sum(0)
    assert int(exact.max()) <= 2**24  # every partial sum is an integer float32 holds exactly
    expected = rank_allreduce.known_sum(count, world, cpu)
    assert torch.equal(expected.to(torch.int64), exact)
    assert torch.equal(_float32_tree_sum(rows), expected)
    with pytest.raises(ValueError, match="up to"):
        rank_allreduce.known_sum(count, world + 1, cpu)


def test_a_corrupted_or_missing_contribution_changes_the_known_sum():
    cpu, count, world = torch.device("cpu"), 64, 512
    good = rank_allreduce.known_sum(count, world, cpu)
    missing = sum(rank_allreduce.known_values(count, r, cpu) for r in range(world) if r != 300)
    assert int((missing != good).sum()) == count


def _references(ctx):
    first = checks.reference_run(ctx, "run 1", per_chunk_backward=False)
    second = checks.reference_run(ctx, "run 2", per_chunk_backward=True)
    return checks.References(first, second["losses"], "cpu")


def test_the_two_reference_orders_agree_to_float_noise_on_two_chunks(tmp_path):
    ctx = make_ctx(tmp_path)
    refs = _references(ctx)
    gaps = [abs(a - b) for a, b in zip(refs.first["losses"], refs.second_losses, strict=True)]
    assert max(gaps) < 1e-5
    assert (tmp_path / "progress-rank0.jsonl").read_text().count('"reference"') == 2 * ctx.spec["steps"]


def test_the_second_reference_runs_only_when_a_curve_leaves_the_fixed_tolerance(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ctx = make_ctx(tmp_path, world=1)
        refs = checks.reference_runs(ctx)
        assert refs is not None and refs.second_losses is None and refs.metrics()["ref2_run"] is False
        # Within ABS_TOL + REL_TOL x |loss| of run 1 at every step: run 2 could not change the verdict.
        near = [v + 1e-5 for v in refs.first["losses"]]
        checks.second_run_if_needed(ctx, refs, near, verdict.REL_TOL)
        assert refs.second_losses is None and refs.metrics()["ref2_losses"] == []
        # One step off: run 2 now sets the noise floor the judge needs, once.
        off = [*refs.first["losses"][:-1], refs.first["losses"][-1] + 0.5]
        checks.second_run_if_needed(ctx, refs, off, verdict.REL_TOL)
        assert refs.second_losses is not None and len(refs.second_losses) == ctx.spec["steps"]
        assert refs.metrics()["ref2_run"] is True and refs.metrics()["ref2_device"] == "cpu rank 0"
        assert verdict.judge_ddp({**refs.metrics(), "losses": off, "ranks": 1}).kind == "diverged"
    finally:
        dist.destroy_process_group()


def test_dataparallel_on_cpu_matches_the_reference_and_passes_the_judge(tmp_path):
    ctx = make_ctx(tmp_path)
    metrics = checks.dp_check(ctx, _references(ctx))
    assert metrics["replica_mismatches"] == [] and metrics["nonfinite_grad_steps"] == []
    assert metrics["path"].startswith("DataParallel algorithm on CPU")
    result = verdict.judge_dp(metrics)
    assert result.verdict == "pass", result.detail
    assert result.metrics["max_loss_gap"] < 1e-5


def test_dataparallel_gradients_reach_the_master_like_a_single_device(tmp_path):
    # Gradients of the replicas' copies must sum back into the master, as DataParallel's broadcast does.
    ctx = make_ctx(tmp_path, steps=1)
    torch.manual_seed(0)
    master = build_model("tiny")
    torch.manual_seed(0)
    single = build_model("tiny")
    images, labels = synthetic_batch(0, 0, 8)
    dp = checks.CpuDataParallel(master, 2, checks._ReplicaInspector(ctx, master))
    torch.nn.functional.cross_entropy(dp(images), labels).backward()
    chunk_losses = [
        torch.nn.functional.cross_entropy(single(x), y)
        for x, y in zip(images.chunk(2), labels.chunk(2), strict=True)
    ]
    (sum(chunk_losses) / 2).backward()
    for a, b in zip(master.parameters(), single.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_a_corrupted_replica_is_caught_at_the_planted_step(tmp_path):
    ctx = make_ctx(tmp_path, steps=4, inject="corrupt", inject_rank=1, inject_checks=["dp"])
    metrics = checks.dp_check(ctx, _references(ctx))
    assert metrics["replica_mismatches"] == [{"step": 2, "replica": 1, "tensors": 1}]
    result = verdict.judge_dp(metrics)
    assert result.kind == "corrupt"


def test_a_nan_gradient_in_one_replica_is_caught(tmp_path):
    ctx = make_ctx(tmp_path, steps=4, inject="nan", inject_rank=1, inject_checks=["dp"])
    metrics = checks.dp_check(ctx, _references(ctx))
    assert metrics["nonfinite_grad_steps"][0] == 2
    assert verdict.judge_dp(metrics).kind == "nan"


def test_faults_reach_only_their_checks(tmp_path):
    ctx = make_ctx(tmp_path, inject="corrupt", inject_checks=["allreduce"], inject_rank=1)
    assert (
        ctx.fault("corrupt", "allreduce")
        and not ctx.fault("corrupt", "dp")
        and not ctx.fault("nan", "allreduce")
    )
    assert ctx.inject_rank == 1 and ctx.inject_step == ctx.spec["steps"] // 2
