"""Judging probe measurements: the failure from the issue, and each kind's detector and remedy."""

from __future__ import annotations

import math

import pytest

from gputopo.probe.judge import p2p as p2p_judge
from gputopo.probe.judge import verdict
from gputopo.probe.judge.verdict import CheckResult, SetResult

NAN = float("nan")
# Reference curve of a healthy 2-GPU run (taken from a CPU run of the tiny ResNet).
REF = [2.48298, 2.46806, 2.64478, 2.58642, 2.72295]


def training(name, losses, ref=REF, ref2=REF, **extra):
    base = {
        "losses": losses,
        "ref_losses": ref,
        "ref2_losses": ref2,
        "nonfinite_grad_steps": [],
        "replica_mismatches": [],
        "desync_steps": [],
        "replicas": 2,
        "ranks": 2,
    }
    base.update(extra)
    return verdict.judge_dp(base) if name == "dp" else verdict.judge_ddp(base)


def test_the_issue_failure_dp_on_a_pcie_pair_goes_nan_and_says_p2p():
    # "2.33, 11.9, 3640, NaN within four steps" on 5,6; the reference stays near 2.3.
    result = training(
        "dp", [2.33, 11.9, 3640.0, NAN], ref=[2.33, 2.31, 2.30, 2.29], ref2=[2.33, 2.31, 2.30, 2.29]
    )
    assert result.verdict == "fail" and result.kind == "nan"
    assert "loss non-finite from step 3" in result.detail and "reference stayed finite" in result.detail
    assert (
        "diverged: off the reference from step 1" in result.detail
    )  # 11.9 and 3640 are also far off the curve
    assert "DataParallel" in result.remedy and "IOMMU" in result.remedy


def test_curves_within_float_noise_pass_with_the_gap_reported():
    close = [v + 2.4e-7 for v in REF]
    result = training("ddp", close)
    assert result.verdict == "pass" and result.kind is None
    assert result.metrics["max_loss_gap"] == pytest.approx(2.4e-7, rel=0.01)
    assert "bitwise equal across 2 ranks" in result.detail


def test_a_curve_that_drifts_beyond_the_noise_floor_diverged():
    drift = [REF[0], REF[1], REF[2] + 0.05, REF[3] + 0.2, REF[4] + 0.5]
    result = training("ddp", drift)
    assert result.kind == "diverged"
    assert "off the reference from step 2" in result.detail and "noise floor 0" in result.detail


def test_the_noise_floor_between_the_two_references_widens_the_tolerance():
    # On 3+ ranks the two valid float orders drift apart; the probe may drift as far, and a bit further.
    ref2 = [REF[0], REF[1], REF[2] + 0.01, REF[3] + 0.05, REF[4] + 0.1]
    drift = [REF[0], REF[1], REF[2] + 0.02, REF[3] + 0.1, REF[4] + 0.3]
    assert training("ddp", drift, ref2=ref2).verdict == "pass"
    assert training("ddp", [v + 1.5 for v in REF], ref2=ref2).kind == "diverged"


def test_judge_curve_reports_noise_and_first_bad_step():
    j = verdict.judge_curve([1.0, 1.0, 2.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    assert not j.ok and j.first_bad_step == 2 and j.noise_floor == 0.0 and j.max_gap == 1.0
    assert verdict.allowed_gap(1.0, 0.0) == pytest.approx(verdict.ABS_TOL + verdict.REL_TOL)
    assert verdict.allowed_gap(1.0, 0.5) == pytest.approx(verdict.NOISE_FACTOR * 0.5)


def test_ddp_ranks_out_of_step_is_desync_even_when_the_loss_looks_fine():
    result = training("ddp", REF, desync_steps=[{"step": 2, "ranks": [1]}, {"step": 3, "ranks": [1]}])
    assert result.kind == "desync"
    assert "rank 1" in result.detail and "after step 2" in result.detail and "2 of 5" in result.detail
    assert "NCCL_P2P_DISABLE=1" in result.remedy


def test_a_replica_unlike_the_master_after_broadcast_is_corrupt():
    result = training("dp", REF, replica_mismatches=[{"step": 2, "replica": 1, "tensors": 1}])
    assert result.kind == "corrupt"
    assert "replica 1" in result.detail and "step 2" in result.detail
    assert "ACS" in result.remedy and "NCCL_P2P_DISABLE=1" in result.remedy


def test_nan_gradients_are_caught_in_the_step_they_appear():
    losses = [REF[0], REF[1], REF[2], NAN, NAN]
    result = training("ddp", losses, nonfinite_grad_steps=[2, 3, 4])
    assert result.kind == "nan" and "gradients non-finite from step 2" in result.detail


def test_nan_in_the_reference_too_blames_the_setup_not_the_gpus():
    bad = [2.3, 50.0, NAN, NAN, NAN]
    result = training("dp", bad, ref=bad, ref2=bad)
    assert result.kind == "nan" and "--lr" in result.remedy


def allreduce_metrics(wrong=0, busbw=(1.0, 20.0, 40.0), ranks=2):
    rows = [
        {
            "bytes": 1 << (20 + i),
            "count": 1 << (18 + i),
            "time_us": 10.0,
            "algbw_gbps": b,
            "busbw_gbps": b,
            "wrong": 0,
        }
        for i, b in enumerate(busbw)
    ]
    rows[-1]["wrong"] = wrong
    return {"ranks": ranks, "rows": rows, "dtype": "float32", "warmup_iters": 5, "timed_iters": 20}


def test_allreduce_wrong_elements_are_corrupt():
    result = verdict.judge_allreduce(allreduce_metrics(wrong=3), 48.0, judge_speed=True)
    assert result.kind == "corrupt" and "3 at 4194304 B" in result.detail


def test_allreduce_peak_and_expected_are_in_the_metrics():
    result = verdict.judge_allreduce(allreduce_metrics(), 48.0, judge_speed=True)
    assert result.verdict == "pass"
    assert result.metrics["peak_busbw_gbps"] == 40.0 and result.metrics["expected_busbw_gbps"] == 48.0


def test_allreduce_far_below_the_model_is_slow():
    result = verdict.judge_allreduce(allreduce_metrics(busbw=(1.0, 5.0, 10.0)), 48.0, judge_speed=True)
    assert result.kind == "slow" and "10 GB/s vs model 48 GB/s" in result.detail
    assert "PCIe" in result.remedy


def test_allreduce_speed_is_not_judged_without_an_estimate_or_on_cpu():
    slowish = allreduce_metrics(busbw=(0.1, 0.5, 1.0))
    unknown = verdict.judge_allreduce(slowish, None, judge_speed=True, speed_note="no topology")
    assert unknown.verdict == "pass" and "no topology" in unknown.detail
    assert unknown.metrics["expected_busbw_gbps"] is None
    cpu = verdict.judge_allreduce(slowish, 48.0, judge_speed=False, speed_note="CPU stand-ins")
    assert cpu.verdict == "pass" and "CPU stand-ins" in cpu.detail


def _pair(src, dst, wrong_there=0, wrong_back=0, peer=True, one_way=9.1, both=17.0):
    return {
        "src": src,
        "dst": dst,
        "can_access_peer": peer,
        "path": "p2p" if peer else "staged",
        "wrong_bytes_there": wrong_there,
        "wrong_bytes_roundtrip": wrong_back,
        "unidir_gbps": one_way,
        "bidir_gbps": both,
        "latency_us": 2.5,
    }


def test_p2p_wrong_bytes_fail_even_when_nvml_says_ok():
    pairs = [_pair(5, 6, 4096, 8192), _pair(6, 5)]
    result = p2p_judge.judge_p2p(
        {"bytes": 64 << 20, "gpus": [5, 6], "pairs": pairs}, {(5, 6): "OK", (6, 5): "OK"}
    )
    assert result.kind == "corrupt"
    assert "5->6 (peer to peer): 4096 wrong bytes there" in result.detail
    assert "NVML P2P read OK" in result.detail
    assert "6->5" not in result.detail
    assert result.metrics["pairs"][0]["nvml_p2p_read"] == "OK"
    # The matrix view: row = source, column = destination.
    assert result.metrics["matrix"]["wrong_bytes"] == [[None, 4096 + 8192], [0, None]]


def test_p2p_exact_copies_pass_and_name_the_slowest():
    pairs = [_pair(6, 7, one_way=48.2, both=90.0), _pair(7, 6, one_way=49.0, both=90.0)]
    result = p2p_judge.judge_p2p(
        {"bytes": 64 << 20, "gpus": [6, 7], "pairs": pairs}, None, expected_gbps=lambda a, b: 48.0
    )
    assert (
        result.verdict == "pass"
        and "48.2 GB/s one way" in result.detail
        and "90 GB/s both ways" in result.detail
    )
    assert result.metrics["pairs"][0]["nvml_p2p_read"] is None
    assert result.metrics["matrix"]["unidir_gbps"] == [[None, 48.2], [49.0, None]]
    assert result.metrics["matrix"]["expected_gbps"] == [[None, 48.0], [48.0, None]]


def test_hung_names_where_each_rank_stopped():
    progress = {
        0: {"t": 100.0, "rank": 0, "check": "ddp", "stage": "step", "done": 3, "total": 20},
        1: {"t": 95.0, "rank": 1, "check": "ddp", "stage": "injected-hang", "done": 0, "total": 0},
    }
    # Stopped after 5 s without progress (the pool's deadline runs from each set's last row).
    result = verdict.hung("ddp", 5.0, progress, now=110.0)
    assert result.kind == "hung"
    assert "--timeout 5 s" in result.detail
    assert "rank 0 last at ddp step 3/20 (10.0 s before)" in result.detail
    assert "rank 1 last at ddp injected-hang (15.0 s before)" in result.detail


def test_crashed_carries_rank_exit_code_and_stderr():
    result = verdict.crashed("ddp", 1, 86, None, "Traceback ...\nRuntimeError: boom", "RuntimeError: boom")
    assert result.kind == "crashed"
    assert result.detail == "rank 1 exited with exit code 86: RuntimeError: boom"
    assert result.metrics == {
        "rank": 1,
        "exitcode": 86,
        "signal": None,
        "stderr_tail": "Traceback ...\nRuntimeError: boom",
        "nccl_warnings": [],
    }
    killed = verdict.crashed("ddp", 0, -9, "SIGKILL", "", None)
    assert killed.detail == "rank 0 exited with exit code -9 (SIGKILL)"


def test_remedies_name_the_healthy_sets():
    good = SetResult((6, 7), (CheckResult("dp", "pass"),))
    bad = SetResult((5, 6), (training("dp", [2.33, 11.9, 3640.0, NAN], ref=[2.33] * 4, ref2=[2.33] * 4),))
    out = verdict.with_healthy_sets([bad, good])
    assert out[0].checks[0].remedy.endswith("Healthy sets in this run: 6,7.")
    assert out[1].checks[0].remedy is None
    only_bad = verdict.with_healthy_sets([bad])
    assert only_bad[0].checks[0].remedy.endswith("No set passed in this run.")


def test_set_verdicts_and_json_shape():
    s = SetResult((0, 1), (CheckResult("p2p", "skipped", detail="cpu"), CheckResult("dp", "pass")))
    assert s.verdict == "pass"
    assert SetResult((0,), (CheckResult("p2p", "skipped"),)).verdict == "skipped"
    d = s.to_dict()
    assert d["gpus"] == [0, 1] and d["verdict"] == "pass"
    assert set(d["checks"][0]) == {"name", "verdict", "kind", "detail", "remedy", "metrics"}
    assert all(not math.isnan(0.0) for _ in d["checks"])
