"""The per-GPU check's pure parts: the judge (peers, majority, second run, datasheet), the plan (one job
over every GPU, first), the drills' options, the report's table and section, doctor's findings and what
recommend --from-report leaves out. No torch here: the runs on CPU ranks are in test_probe_pergpu_run.py."""

from __future__ import annotations

import pytest

from gputopo.errors import UsageError
from gputopo.probe.judge.pergpu import (
    EXPECTED_FRACTION,
    judge_gpus,
    judge_rows,
    model_peak,
    per_gpu_section,
    unfinished_rows,
)
from gputopo.probe.plan.config import CPU_TOLERANCE, DEFAULT_TOLERANCE, DeviceInventory, build_config
from gputopo.probe.plan.options import Fault, Mode
from gputopo.probe.plan.schedule import make_plan
from gputopo.probe.plan.spec import fault_site

CPU = DeviceInventory("cpu", tuple(range(8)))
GOOD = "aaaaaaaaaaaaaaaa"
BAD = "bbbbbbbbbbbbbbbb"


# Four runs per number, as four rounds of CPU stand-ins give: the figure is the best, the others within 2%.
JITTER = (1.0, 0.99, 0.98, 0.995)
NUMBERS = ("matmul_tflops", "memory_gbps", "h2d_gbps", "d2h_gbps")


def row(gpu: int, tflops: float = 100.0, mem: float = 1000.0, h2d: float = 50.0, d2h: float = 50.0, **kw):
    out = {
        "gpu": gpu,
        "name": "CPU stand-in",
        "precision": "fp32",
        "matmul_tflops": tflops,
        "memory_gbps": mem,
        "h2d_gbps": h2d,
        "d2h_gbps": d2h,
        "result_hash": GOOD,
        "result_hash_rerun": GOOD,
        "timing": "process CPU time (stand-in)",
    }
    out.update(kw)
    out.setdefault("runs", {k: [out[k] * f for f in JITTER] for k in NUMBERS})
    return out


def verdicts(rows, tolerance=0.10):
    return {r["gpu"]: r["verdict"] for r in judge_rows(rows, tolerance)}


def test_healthy_gpus_pass_with_their_peers_median():
    rows = [row(0, 100), row(1, 96), row(2, 104), row(3, 99)]
    judged = judge_rows(rows, 0.10)
    assert [r["verdict"] for r in judged] == ["pass"] * 4
    assert judged[0]["peers_median"]["matmul_tflops"] == 99  # of GPUs 1-3, itself left out
    result = judge_gpus({"device": "cpu", "rows": rows}, 0.10)
    assert result.verdict == "pass" and "bit-identical" in result.detail


def test_a_gpu_more_than_the_tolerance_below_its_peers_is_slow_in_any_of_the_four_numbers():
    assert verdicts([row(0), row(1, 50), row(2), row(3)])[1] == "slow"
    assert verdicts([row(0), row(1), row(2, h2d=25), row(3)]) == {0: "pass", 1: "pass", 2: "slow", 3: "pass"}
    # 8% below is within 10%, 12% is not; --tolerance moves the line.
    assert verdicts([row(0), row(1, mem=920), row(2), row(3)])[1] == "pass"
    assert verdicts([row(0), row(1, mem=880), row(2), row(3)])[1] == "slow"
    assert verdicts([row(0), row(1, mem=880), row(2), row(3)], tolerance=0.15)[1] == "pass"
    result = judge_gpus({"device": "cpu", "rows": [row(0), row(1, 50), row(2), row(3)]}, 0.10)
    assert (
        result.verdict == "fail" and result.kind == "slow" and result.detail.startswith("GPU1 slow: matmul")
    )


def test_the_slow_verdict_states_the_noise_and_the_odds_of_chance():
    (judged,) = [r for r in judge_rows([row(0), row(1, 50), row(2), row(3)], 0.10) if r["gpu"] == 1]
    assert judged["speed"] == "slow" and judged["noise"]["matmul_tflops"] == pytest.approx(0.02)
    assert "(noise 2%; its 4 runs all below its peers' 12: 1 in 1820 by chance)" in judged["why"]
    # Two GPUs, four runs each: 1 in 70, still within MAX_CHANCE.
    two = judge_rows([row(0), row(1, 50)], 0.10)
    assert [r["verdict"] for r in two] == ["pass", "slow"] and "1 in 70 by chance" in two[1]["why"]


def noisy(gpu: int, tflops: float, runs: tuple[float, ...]) -> dict:
    base = row(gpu, tflops)
    base["runs"] = {**base["runs"], "matmul_tflops": list(runs)}
    return base


def test_a_gap_within_this_machines_noise_is_undecided_and_not_a_failure():
    # A healthy stand-in on a busy machine: 30% below its peers' median, but one peer's own runs spread
    # 40% (a burst of other work): the gap is not twice the noise.
    rows = [noisy(0, 100, (100, 60, 95, 97)), noisy(1, 70, (70, 66, 69, 68)), row(2), row(3)]
    judged = {r["gpu"]: r for r in judge_rows(rows, 0.25)}
    one = judged[1]
    assert one["verdict"] == "undecided" and one["undecided_about"] == "speed" and one["speed"] == "undecided"
    assert "noise is 40%" in one["why"] and "overlap" in one["why"]
    assert {g: r["verdict"] for g, r in judged.items() if g != 1} == {0: "pass", 2: "pass", 3: "pass"}
    result = judge_gpus({"device": "cpu", "rows": rows}, 0.25)
    assert result.verdict == "pass" and "3 of 4 within 25%" in result.detail
    assert "GPU1 speed undecided" in result.detail and "quieter machine" in result.detail


def test_runs_that_overlap_their_peers_leave_the_speed_undecided():
    # 20% below by its best run, but one peer's worst run is below that (and so its noise is as large).
    rows = [noisy(0, 100, (100, 99, 98, 79)), noisy(1, 80, (80, 79, 79, 78)), row(2), row(3)]
    one = judge_rows(rows, 0.10)[1]
    assert one["verdict"] == "undecided" and "its runs overlap its peers'" in one["why"]


def test_one_figure_each_cannot_be_told_from_chance():
    # Rows without runs (one figure each): all below is 1 in 4 by chance, above MAX_CHANCE.
    bare = [{k: v for k, v in row(g, 50 if g == 1 else 100).items() if k != "runs"} for g in range(4)]
    one = judge_rows(bare, 0.10)[1]
    assert one["verdict"] == "undecided" and "could fall so by chance (1 in 4" in one["why"]


def test_chance_below_is_one_over_the_ways_to_place_the_runs():
    from gputopo.probe.judge.pergpu import chance_below, spread

    assert chance_below([1, 2], [3, 4, 5]) == pytest.approx(1 / 10)  # C(5, 2)
    assert chance_below([1, 3.5], [3, 4]) is None and chance_below([], [1]) is None
    assert spread([100, 75]) == 0.25 and spread([5]) == 0.0


def test_doctor_says_an_undecided_speed_as_a_note_not_a_problem():
    from gputopo.probe.judge.findings import probe_findings

    rows = [noisy(0, 100, (100, 60, 95, 97)), noisy(1, 70, (70, 66, 69, 68)), row(2), row(3)]
    (found,) = probe_findings(_probe_doc(rows, tolerance=0.25))
    assert found.where == "GPU1" and found.severity == "note" and "speed undecided" in found.what


def test_gpus_of_different_models_are_not_compared():
    rows = [row(0, 100, name="NVIDIA A"), row(1, 100, name="NVIDIA A"), row(2, 20, name="NVIDIA B")]
    judged = judge_rows(rows, 0.10)
    assert [r["verdict"] for r in judged] == ["pass"] * 3
    assert judged[2]["peers"] == 0 and judged[2]["peers_median"]["matmul_tflops"] is None


def test_a_hash_off_the_majority_is_corrupt_and_named():
    rows = [row(0), row(1), row(2, result_hash=BAD), row(3)]
    assert verdicts(rows) == {0: "pass", 1: "pass", 2: "corrupt", 3: "pass"}
    result = judge_gpus({"device": "cpu", "rows": rows}, 0.10)
    assert result.kind == "corrupt" and "GPU2 corrupt" in result.detail and "3 of 4" in result.detail


def test_corrupt_comes_before_slow_and_both_are_named():
    rows = [row(0), row(1, 40), row(2, result_hash=BAD), row(3)]
    result = judge_gpus({"device": "cpu", "rows": rows}, 0.10)
    assert result.kind == "corrupt" and "GPU1 slow" in result.detail and "GPU2 corrupt" in result.detail


def test_two_gpus_fall_back_on_each_ones_second_run():
    # A transient flip: GPU1's first run differs from its second, which agrees with GPU0.
    assert verdicts([row(0), row(1, result_hash=BAD)]) == {0: "pass", 1: "corrupt"}
    # Each repeats its own different result: one is wrong, and this run cannot tell which.
    judged = judge_rows([row(0), row(1, result_hash=BAD, result_hash_rerun=BAD)], 0.10)
    assert [r["verdict"] for r in judged] == ["undecided", "undecided"]
    assert "could not be decided" in judged[0]["why"] and "GPU1" in judged[0]["why"]
    result = judge_gpus(
        {"device": "cpu", "rows": [row(0), row(1, result_hash=BAD, result_hash_rerun=BAD)]}, 0.1
    )
    assert result.verdict == "fail" and result.kind == "corrupt" and "third GPU" in result.remedy


def test_no_majority_uses_the_second_run_too():
    rows = [row(0), row(1, result_hash=BAD, result_hash_rerun=BAD), row(2, result_hash="c" * 16), row(3)]
    # 2 of 4 agree: no majority. GPU2's second run (GOOD) differs from its first: corrupt.
    got = verdicts(rows)
    assert got[2] == "corrupt" and got[1] == "undecided"


def test_a_lone_gpu_is_checked_against_its_own_second_run():
    assert verdicts([row(0)]) == {0: "pass"}
    assert verdicts([row(0, result_hash=BAD)]) == {0: "corrupt"}


def test_the_datasheet_floor_catches_a_machine_held_down_alike():
    name = "NVIDIA H100 80GB HBM3"
    peak = model_peak(name)
    assert (
        peak is not None and peak.model == "H100 SXM" and peak.matmul_tflops["bf16"] == pytest.approx(989.4)
    )
    assert model_peak("NVIDIA H100 PCIe").model == "H100 PCIe" and model_peak("Tesla T4") is None
    # TF32 has no measured figure: its floor is half the datasheet's, on the best run.
    low = EXPECTED_FRACTION * peak.matmul_tflops["tf32"] * 0.9
    cuda = {"name": name, "precision": "tf32", "timing": "CUDA events", "memory_gbps": 3000.0}
    rows = [row(g, low, **cuda) for g in range(4)]
    judged = judge_rows(rows, 0.10)
    assert {r["verdict"] for r in judged} == {"slow"}
    assert "datasheet" in judged[0]["why"] and judged[0]["peak"]["memory_gbps"] == 3350.0
    assert judged[0]["peak"]["floor"]["matmul_tflops"]["from"] == "datasheet"
    healthy = [row(g, 400.0, **cuda) for g in range(4)]
    assert {r["verdict"] for r in judge_rows(healthy, 0.10)} == {"pass"}


def test_a_lone_gpu_is_held_to_three_quarters_of_a_measured_healthy_one():
    """One GPU has no peers: its only speed verdict is the floor. Against a measured figure it is 0.75 of
    it (as DCGM sets floors), which catches a GPU a third below healthy that half the datasheet passed."""
    name = "NVIDIA H100 80GB HBM3"
    peak = model_peak(name)
    assert peak.measured_tflops["bf16"] == 798.0 and peak.measured_memory_gbps == 3000.0
    cuda = {"name": name, "precision": "bf16", "timing": "CUDA events"}
    third_below = 798.0 * 0.66  # 527: above half the datasheet (495), below 0.75 x 798 (598.5)
    assert third_below > EXPECTED_FRACTION * peak.matmul_tflops["bf16"]
    (judged,) = judge_rows([row(0, third_below, mem=2900.0, **cuda)], 0.10)
    assert judged["verdict"] == "slow" and judged["peers"] == 0
    assert "below its floor 598" in judged["why"] and "measured" in judged["why"]
    assert judged["peak"]["floor"]["matmul_tflops"] == {
        "value": pytest.approx(598.5),
        "from": "measured",
        "what": judged["peak"]["floor"]["matmul_tflops"]["what"],
    }
    # Its median counts, not its best run: a GPU whose best run reached the floor but whose median did
    # not (it throttled) is slow.
    runs = {"matmul_tflops": [620.0, 560.0, 550.0, 540.0], "memory_gbps": [2900.0] * 4}
    (throttled,) = judge_rows([row(0, 550.0, mem=2900.0, runs=runs, **cuda)], 0.10)
    assert throttled["verdict"] == "slow"
    (memory,) = judge_rows([row(0, 780.0, mem=2000.0, **cuda)], 0.10)  # below 0.75 x 3000 GB/s
    assert memory["verdict"] == "slow" and memory["why"].startswith("memory 2e+03 GB/s")
    (healthy,) = judge_rows([row(0, 770.0, mem=2950.0, **cuda)], 0.10)
    assert healthy["verdict"] == "pass"
    from gputopo.probe.report.document import gpu_table

    lone = [row(0, 770.0, mem=2950.0, **cuda)]
    check = judge_gpus({"device": "cuda", "precision": "bf16", "rows": lone}, 0.1)
    floor_line = next(line for line in gpu_table([0], check.to_dict()) if line.strip().startswith("floor"))
    assert "598.5" in floor_line and "2250" in floor_line and "measured" in floor_line


def test_the_h200_row_is_not_a_gh200_nor_an_h200_nvl():
    assert model_peak("NVIDIA H200").model == "H200 SXM"
    assert model_peak("NVIDIA H200 NVL").model == "H200 NVL"
    assert model_peak("NVIDIA H200 NVL").memory_gbps == 4800.0
    assert model_peak("NVIDIA H200 NVL").measured_tflops == {}  # the H200's measured figure is not its
    assert model_peak("NVIDIA GH200 480GB") is None and model_peak("NVIDIA GH200 144G HBM3e") is None
    assert model_peak("NVIDIA H100 NVL") is None


def test_unfinished_rows_name_the_crashed_gpu():
    rows = unfinished_rows((4, 5, 6), "crashed", 1)
    assert [r["verdict"] for r in rows] == ["not judged", "crashed", "not judged"]
    assert {r["verdict"] for r in unfinished_rows((4, 5), "hung", None)} == {"hung"}


def test_the_report_section_carries_the_four_numbers_hash_and_median():
    check = judge_gpus({"device": "cpu", "precision": "fp32", "rows": [row(0), row(1, 40), row(2)]}, 0.1)
    section = per_gpu_section(check.to_dict())
    assert section["verdict"] == "fail" and section["simulated"] is True and section["tolerance"] == 0.1
    first = section["gpus"][1]
    assert first["gpu"] == 1 and first["verdict"] == "slow" and first["result_hash"] == GOOD
    for key in ("matmul_tflops", "memory_gbps", "h2d_gbps", "d2h_gbps"):
        assert first[key] > 0 and first["peers_median"][key] > 0
    assert per_gpu_section(None) is None


def test_the_text_table_shows_numbers_median_and_verdicts():
    from gputopo.probe.report.document import check_table

    check = judge_gpus(
        {
            "device": "cpu",
            "precision": "fp32",
            "sizes": {"matmul_n": 8},
            "rows": [row(0), row(1, 40), row(2)],
        },
        0.1,
    ).to_dict()
    text = "\n".join(check_table({}, [0, 1, 2], check))
    assert "median" in text and "slow: matmul 40" in text and "simulated" in text and text.count(GOOD) == 3


# --- the plan and the options ---------------------------------------------------------------------------


def test_the_per_gpu_job_is_first_and_over_every_gpu_once():
    plan = make_plan(build_config(CPU, ["0,1", "2,3"], mode=Mode.ALL))
    first = plan.rounds[0]
    assert [(j.gpus, j.checks) for j in first] == [((0, 1, 2, 3), ("gpu",))]
    assert plan.sets == ((0, 1), (2, 3), (0, 1, 2, 3))
    assert all("gpu" not in j.checks for rnd in plan.rounds[1:] for j in rnd)
    # The union set gets no other check: it exists only to report the GPUs.
    assert [j.checks for rnd in plan.rounds for j in rnd if j.gpus == (0, 1, 2, 3)] == [("gpu",)]


def test_mode_gpu_reports_one_set_and_a_set_that_is_every_gpu_hosts_it():
    plan = make_plan(build_config(CPU, ["0,1", "2,3"], mode=Mode.GPU))
    assert plan.sets == ((0, 1, 2, 3),) and len(plan.rounds) == 1
    plan = make_plan(build_config(CPU, ["3,2,1,0"], mode=Mode.ALL))
    assert plan.rounds[0][0].gpus == (3, 2, 1, 0) and plan.sets == ((3, 2, 1, 0),)
    plan = make_plan(build_config(CPU, ["0,1,2"], each_pair=True, mode=Mode.ALL))
    assert plan.rounds[0][0].gpus == (0, 1, 2) and plan.sets[-1] == (0, 1, 2)
    assert "gpu" in Mode.ALL.checks and "speed" not in Mode.ALL.checks


def test_the_drills_land_in_the_per_gpu_job_of_the_named_gpus_only():
    config = build_config(CPU, ["0,1,2,3"], mode=Mode.ALL, inject=Fault.SDC, inject_gpus="2")
    site = fault_site(config, (0, 1, 2, 3), ("gpu", "dp", "ddp", "allreduce"))
    assert site.checks == ("gpu",) and site.ranks == (2,)
    config = build_config(CPU, ["0,1,2,3"], mode=Mode.GPU, inject=Fault.SLOW, inject_gpus="1")
    assert fault_site(config, (0, 1, 2, 3), ("gpu",)).checks == ("gpu",)
    # A hang goes into the first training check; with only the per-GPU check, into it.
    hang = build_config(CPU, ["0,1"], mode=Mode.ALL, inject=Fault.HANG)
    assert fault_site(hang, (0, 1), ("gpu", "dp", "ddp")).checks == ("dp",)
    hang = build_config(CPU, ["0,1"], mode=Mode.GPU, inject=Fault.HANG)
    assert fault_site(hang, (0, 1), ("gpu",)).checks == ("gpu",)


def test_per_gpu_drills_and_tolerance_are_checked_before_anything_runs():
    with pytest.raises(UsageError, match="per-GPU check"):
        build_config(CPU, ["0,1"], mode=Mode.DDP, inject=Fault.SDC)
    with pytest.raises(UsageError, match="--tolerance"):
        build_config(CPU, ["0,1"], mode=Mode.GPU, tolerance=1.5)
    assert build_config(CPU, ["0,1"], mode=Mode.GPU).per_gpu_tolerance == CPU_TOLERANCE
    gpus = DeviceInventory("cuda", (0, 1))
    assert build_config(gpus, ["0,1"], mode=Mode.GPU).per_gpu_tolerance == DEFAULT_TOLERANCE
    assert build_config(gpus, ["0,1"], mode=Mode.GPU, tolerance=0.2).per_gpu_tolerance == 0.2


# --- doctor and recommend --------------------------------------------------------------------------------


def _probe_doc(rows, tolerance=0.1):
    check = judge_gpus({"device": "cuda", "rows": rows}, tolerance).to_dict()
    return {
        "schema": "gputopo/probe/v1",
        "device": "cuda",
        "sets": [{"gpus": [0, 1, 2, 3], "checks": [check]}],
    }


def test_doctor_names_each_slow_or_corrupt_gpu_in_the_one_finding_shape():
    from gputopo.probe.judge.findings import probe_findings

    doc = _probe_doc([row(0), row(1, 40), row(2, result_hash=BAD), row(3)])
    found = {f.where: f for f in probe_findings(doc)}
    assert set(found) == {"GPU1", "GPU2"}
    assert found["GPU1"].gpu == 1 and found["GPU1"].category == "compute" and "slow" in found["GPU1"].what
    assert found["GPU2"].action == "drain" and "corrupt" in found["GPU2"].what


def test_recommend_from_report_leaves_the_slow_and_corrupt_gpus_out():
    from gputopo.recommend import evidence_from_report

    evidence = evidence_from_report(
        _probe_doc([row(0), row(1, 40), row(2, result_hash=BAD), row(3)]), "r.json"
    )
    assert sorted(g.gpus for g in evidence.failed) == [(1,), (2,)]
    assert evidence_from_report(_probe_doc([row(0), row(1)]), "r.json").failed == ()


def test_doctor_views_show_each_gpu_beside_its_peers_median():
    from rich.console import Console

    from gputopo.ui.doctor_markdown import per_gpu_markdown
    from gputopo.ui.doctor_view import per_gpu_tables

    probe = _probe_doc([row(0), row(1, 40), row(2), row(3)])
    probe["per_gpu"] = per_gpu_section(probe["sets"][0]["checks"][0])
    console = Console(width=140, record=True, color_system=None)
    for part in per_gpu_tables(probe["per_gpu"]):
        console.print(part)
    text = console.export_text()
    assert "Every GPU on its own" in text and "40 (100)" in text and "slow" in text
    markdown = "\n".join(per_gpu_markdown(probe))
    assert markdown.startswith("## Every GPU on its own") and "slow: matmul 40" in markdown
    assert per_gpu_tables(None) == [] and per_gpu_markdown({"sets": []}) == []


def test_a_crashed_or_hung_per_gpu_job_names_each_gpus_part():
    from gputopo.probe.plan.schedule import Job
    from gputopo.probe.pool.launch import LaunchOutcome, RankFailure
    from gputopo.probe.pool.runner import judge_outcome
    from gputopo.probe.shared import TopologyView

    config = build_config(CPU, ["4,5,6"], mode=Mode.GPU)
    died = RankFailure(1, 86, None, 123, "injected crash", "")
    outcome = LaunchOutcome(Job((4, 5, 6), ("gpu",)), "failed", {}, None, (died,), {}, 1.0, 10.0)
    result = judge_outcome(outcome, ("gpu",), TopologyView(None), config)["gpu"]
    assert result.kind == "crashed"
    assert [r["verdict"] for r in result.metrics["rows"]] == ["not judged", "crashed", "not judged"]
    hung = LaunchOutcome(Job((4, 5, 6), ("gpu",)), "timeout", {}, None, (), {}, 20.0, 10.0)
    result = judge_outcome(hung, ("gpu",), TopologyView(None), config)["gpu"]
    assert result.kind == "hung" and {r["verdict"] for r in result.metrics["rows"]} == {"hung"}
