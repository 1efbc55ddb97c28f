"""The p2p check's decisions, driven on CPU tensors: the sentinel catches a copy that never lands, a pair
without peer access is a staged copy and never a P2P PASS, and the timing is many copies after a warm-up.

The CUDA engine itself (streams, events) needs two GPUs; its test is marked and skipped without them.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gputopo.probe.judge import p2p as p2p_judge  # noqa: E402
from gputopo.probe.judge import verdict  # noqa: E402
from gputopo.probe.ranks import context  # noqa: E402
from gputopo.probe.ranks import p2p as rank_p2p  # noqa: E402

NBYTES = 1 << 14


class DroppingEngine(rank_p2p.CopyEngine):
    """An IOMMU that faults every peer write: the copy is issued, nothing lands."""

    def copy(self, dst, src):
        pass


class HalfEngine(rank_p2p.CopyEngine):
    """A copy whose second half never lands."""

    def copy(self, dst, src):
        half = dst.numel() // 2
        dst[:half].copy_(src[:half])


class NoPeerEngine(rank_p2p.CopyEngine):
    """CUDA says no peer access for these pairs; torch still copies (through host memory)."""

    def __init__(self, no_peer):
        self.no_peer = set(no_peer)

    def can_access_peer(self, src, dst):
        return (src, dst) not in self.no_peer


class CountingEngine(rank_p2p.CopyEngine):
    """Records how each timing was asked for."""

    def __init__(self):
        self.timings = []

    def time_copies(self, directions, warmup, copies):
        self.timings.append((len(directions), directions[0][0].numel(), warmup, copies))
        return super().time_copies(directions, warmup, copies)


def test_a_dropped_write_over_memory_that_already_holds_the_pattern_is_caught():
    # The old check's blind spot: the caching allocator hands back a block that already holds the right
    # bytes from the previous pair, so a write that never lands compared equal.
    pattern = rank_p2p.pair_pattern(NBYTES, 0, 5, 6)
    stale = pattern.clone()  # exactly what a correct copy would have written
    wrong = rank_p2p.checked_copy(DroppingEngine(), stale, pattern.clone(), pattern, (0, 1))
    assert wrong == NBYTES  # every byte still holds the sentinel


def test_a_partial_write_is_counted_byte_for_byte():
    pattern = rank_p2p.pair_pattern(NBYTES, 0, 0, 1)
    dst = torch.empty(NBYTES, dtype=torch.uint8)
    assert rank_p2p.checked_copy(HalfEngine(), dst, pattern.clone(), pattern, (0, 1)) == NBYTES // 2
    assert rank_p2p.checked_copy(rank_p2p.CopyEngine(), dst, pattern.clone(), pattern, (0, 1)) == 0


def test_the_sentinel_differs_from_the_pattern_in_every_byte_and_patterns_differ_per_direction():
    pattern = rank_p2p.pair_pattern(NBYTES, 0, 5, 6)
    assert bool((rank_p2p.sentinel_of(pattern) != pattern).all())
    assert not torch.equal(pattern, rank_p2p.pair_pattern(NBYTES, 0, 6, 5))
    assert not torch.equal(pattern, rank_p2p.pair_pattern(NBYTES, 0, 5, 7))
    assert torch.equal(pattern, rank_p2p.pair_pattern(NBYTES, 0, 5, 6))


def test_dropped_writes_on_three_gpus_fail_every_direction_as_corrupt():
    m = rank_p2p.p2p_matrix(DroppingEngine(), [0, 1, 2], [4, 5, 6], nbytes=NBYTES, warmup=1, copies=20)
    assert len(m["pairs"]) == 6
    assert all(p["wrong_bytes_there"] == NBYTES for p in m["pairs"])
    result = p2p_judge.judge_p2p(m, {(a, b): "OK" for a in (4, 5, 6) for b in (4, 5, 6) if a != b})
    assert result.verdict == "fail" and result.kind == "corrupt"
    for a, b in ((4, 5), (5, 4), (4, 6), (6, 4), (5, 6), (6, 5)):
        assert f"{a}->{b} (peer to peer)" in result.detail


def test_healthy_copies_pass_with_every_ordered_pair_and_the_matrix():
    m = rank_p2p.p2p_matrix(rank_p2p.CopyEngine(), [0, 1, 2], [4, 5, 6], nbytes=NBYTES, warmup=1, copies=20)
    assert [(p["src"], p["dst"]) for p in m["pairs"]] == [(4, 5), (4, 6), (5, 4), (5, 6), (6, 4), (6, 5)]
    for p in m["pairs"]:
        assert p["path"] == "p2p" and p["unidir_gbps"] > 0 and p["bidir_gbps"] > 0 and p["latency_us"] > 0
    result = p2p_judge.judge_p2p(m, None)
    assert result.verdict == "pass" and "6 ordered pairs copied exactly peer to peer" in result.detail
    grid = result.metrics["matrix"]
    assert grid["gpus"] == [4, 5, 6] and grid["unidir_gbps"][0][0] is None
    assert grid["bidir_gbps"][0][1] == grid["bidir_gbps"][1][0]  # one measurement for both directions


def test_without_peer_access_the_outcome_is_a_staged_copy_never_a_p2p_pass():
    m = rank_p2p.p2p_matrix(
        NoPeerEngine({(0, 1), (1, 0)}), [0, 1], [5, 6], nbytes=NBYTES, warmup=1, copies=20
    )
    assert [p["path"] for p in m["pairs"]] == ["staged", "staged"]
    assert [p["can_access_peer"] for p in m["pairs"]] == [False, False]
    result = p2p_judge.judge_p2p(m, {(5, 6): "CNS", (6, 5): "CNS"})
    assert result.verdict == "skipped"
    assert result.detail.startswith("no peer-to-peer path: copies staged through host memory")
    assert "NVML P2P read status: CNS" in result.detail


def test_a_staged_pair_in_a_set_is_named_beside_the_pass_of_the_others():
    engine = NoPeerEngine({(0, 2), (2, 0)})
    m = rank_p2p.p2p_matrix(engine, [0, 1, 2], [0, 1, 2], nbytes=NBYTES, warmup=1, copies=20)
    result = p2p_judge.judge_p2p(m, {(0, 2): "CNS", (2, 0): "CNS"})
    assert result.verdict == "pass" and "4 ordered pairs copied exactly peer to peer" in result.detail
    assert "no peer-to-peer path: copies staged through host memory for 0->2, 2->0" in result.detail


def test_staged_copies_that_come_back_wrong_are_still_corrupt():
    class StagedAndDropping(DroppingEngine):
        def can_access_peer(self, src, dst):
            return False

    m = rank_p2p.p2p_matrix(StagedAndDropping(), [0, 1], [0, 1], nbytes=NBYTES, warmup=1, copies=20)
    result = p2p_judge.judge_p2p(m, None)
    assert result.kind == "corrupt" and "staged through host memory" in result.detail


def test_bandwidth_is_timed_over_at_least_20_copies_after_a_warm_up_one_way_both_ways_and_small():
    engine = CountingEngine()
    m = rank_p2p.p2p_matrix(engine, [0, 1], [0, 1], nbytes=NBYTES)
    assert m["timed_copies"] >= 20 and m["warmup_copies"] >= 1
    one_way = [t for t in engine.timings if t[0] == 1 and t[1] == NBYTES]
    both_ways = [t for t in engine.timings if t[0] == 2]
    small = [t for t in engine.timings if t[1] == rank_p2p.P2P_LATENCY_BYTES]
    assert len(one_way) == 2 and len(both_ways) == 1 and len(small) == 2
    assert all(copies >= 20 and warmup >= 1 for _, _, warmup, copies in engine.timings)


def test_the_gpu_engine_times_with_cuda_events():
    assert rank_p2p.CudaEngine.timing == "CUDA events"
    assert rank_p2p.P2P_TIMED_COPIES >= 20


def test_injected_corruption_reaches_the_copies_into_the_target(tmp_path):
    ctx = context.RankContext(
        0,
        2,
        0,
        torch.device("cpu"),
        {"gpus": [5, 6], "inject": "corrupt", "inject_checks": ["p2p"], "inject_rank": 1, "seed": 0},
        tmp_path,
    )
    m = rank_p2p.p2p_check(ctx, engine=rank_p2p.CopyEngine(), nbytes=NBYTES)
    # On CPU every tensor is on the one device, so every copy carries the planted byte, the timed
    # bidirectional round's included.
    assert all(p["wrong_bytes_there"] == 1 for p in m["pairs"])
    assert all(p["wrong_bytes_bidir"] == 1 for p in m["pairs"])
    result = p2p_judge.judge_p2p(m, None)
    assert result.kind == "corrupt" and "1 after the bidirectional round" in result.detail


class BidirOnlyEngine(rank_p2p.CopyEngine):
    """Quiet copies land; with both directions in flight, the second direction's writes land in the first
    direction's buffer (the concurrent-traffic fault a one-copy-at-a-time check never sees)."""

    def time_copies(self, directions, warmup, copies):
        seconds = super().time_copies(directions, warmup, copies)
        if len(directions) == 2:
            (dst0, _), (_, src1) = directions
            dst0.copy_(src1)
        return seconds


def test_a_corrupted_bidirectional_round_is_caught_after_clean_quiet_copies():
    m = rank_p2p.p2p_matrix(BidirOnlyEngine(), [0, 1], [5, 6], nbytes=NBYTES, warmup=1, copies=20)
    by_pair = {(p["src"], p["dst"]): p for p in m["pairs"]}
    assert all(p["wrong_bytes_there"] == 0 and p["wrong_bytes_roundtrip"] == 0 for p in m["pairs"])
    assert by_pair[(5, 6)]["wrong_bytes_bidir"] > NBYTES // 2  # random bytes: ~255/256 of them differ
    assert by_pair[(6, 5)]["wrong_bytes_bidir"] == 0
    result = p2p_judge.judge_p2p(m, None)
    assert result.verdict == "fail" and result.kind == "corrupt"
    assert "5->6 (peer to peer): 0 wrong bytes there, 0 after the round trip" in result.detail
    assert result.metrics["matrix"]["wrong_bytes"][0][1] == by_pair[(5, 6)]["wrong_bytes_bidir"]


def test_the_bidirectional_round_uses_fresh_patterns_over_sentinel_filled_destinations():
    # A bidirectional round whose copies never land leaves the sentinel, even though the buffers held
    # the quiet round's (correct) bytes before.
    class NothingLandsInTheTimedRounds(rank_p2p.CopyEngine):
        def time_copies(self, directions, warmup, copies):
            return 1.0

    m = rank_p2p.p2p_matrix(NothingLandsInTheTimedRounds(), [0, 1], [5, 6], nbytes=NBYTES)
    assert [p["wrong_bytes_bidir"] for p in m["pairs"]] == [NBYTES, NBYTES]
    assert not torch.equal(
        rank_p2p.pair_pattern(NBYTES, 0, 5, 6), rank_p2p.pair_pattern(NBYTES, 0, 5, 6, round_=1)
    )
    assert m["latency_method"].startswith("torch Tensor.copy_ latency")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)
def test_cuda_engine_on_two_gpus(tmp_path):
    m = rank_p2p.p2p_matrix(rank_p2p.CudaEngine(), [0, 1], [0, 1], nbytes=8 << 20)
    result = p2p_judge.judge_p2p(m, None)
    assert result.verdict in ("pass", "skipped"), result.detail
    assert all(p["wrong_bytes_there"] == 0 and p["unidir_gbps"] > 0 for p in m["pairs"])


def _p2p_doc(engine):
    m = rank_p2p.p2p_matrix(engine, [0, 1, 2], [4, 5, 6], nbytes=NBYTES, warmup=1, copies=20)
    result = p2p_judge.judge_p2p(m, {(4, 6): "CNS", (6, 4): "CNS"}, expected_gbps=lambda a, b: 48.0)
    s = verdict.SetResult((4, 5, 6), (result,))
    return {
        "schema": "gputopo/probe/v1",
        "device": "cuda",
        "verdict": s.verdict,
        "caveats": [],
        "sets": [s.to_dict()],
        "config": {"backend": "nccl"},
        "environment": {"torch": "2.14"},
    }


def test_the_matrix_reads_like_p2p_bandwidth_latency_test_in_the_terminal():
    from gputopo.probe.report.document import set_tables

    doc = _p2p_doc(NoPeerEngine({(0, 2), (2, 0)}))
    ((gpus, lines),) = set_tables(doc)
    assert gpus == [4, 5, 6]
    titles = [line for line in lines if line.startswith("# ") and "(" in line and "src" not in line]
    assert any("unidirectional bandwidth (GB/s)" in t for t in titles)
    assert any("bidirectional bandwidth" in t for t in titles)
    assert any("latency of a 4 B torch copy_ (us, with torch's stream barrier)" in t for t in titles)
    assert any("model estimate, one way (GB/s)" in t for t in titles)
    rows = [line.split() for line in lines if not line.startswith("#")]
    assert rows[0][0] == "4" and rows[0][1] == "-" and rows[0][3].endswith("*")  # 4->6 staged
    assert any("4->6 (NVML P2P read CNS)" in line for line in lines)
    assert lines[-1].startswith("# PASS: 4 ordered pairs copied exactly peer to peer")


def test_the_html_report_draws_the_matrix_beside_the_estimate():
    pytest.importorskip("matplotlib")
    from gputopo.ui.html_report import render_probe_html

    doc = _p2p_doc(DroppingEngine())
    doc["warnings"] = ["line 9: GPU4's row is cut short"]
    page = render_probe_html(doc)
    assert "GPU4&#x27;s row is cut short" in page
    assert "Peer-to-peer copies, set 4,5,6" in page and page.count("<img ") == 1
    assert "FAIL: a copy came back wrong" in page and "gputopo probe: FAIL" in page


def test_the_runner_puts_the_model_estimate_and_nvml_status_beside_each_pair():
    from gputopo.probe.plan.config import DeviceInventory, build_config
    from gputopo.probe.pool.runner import _judge
    from gputopo.probe.shared import TopologyView
    from gputopo.system.machine import load_topology

    topo = load_topology("sample:seed-8gpu-nv4")
    config = build_config(DeviceInventory("cuda", tuple(range(8))), ["5,6"], mode=verdict_mode("p2p"))
    m = rank_p2p.p2p_matrix(rank_p2p.CopyEngine(), [0, 1], [5, 6], nbytes=NBYTES, warmup=1, copies=20)
    result = _judge("p2p", m, (5, 6), TopologyView(topo), config)
    pair = result.metrics["pairs"][0]
    assert pair["expected_gbps"] == TopologyView(topo).expected_busbw_gbps((5, 6))[0] > 0


def verdict_mode(name):
    from gputopo.probe.plan.options import Mode

    return Mode(name)
