"""`gputopo probe --mode gpu` and `gputopo doctor` on CPU ranks standing in for GPUs: real launches, the
per-GPU check measured one stand-in at a time, and its drills (sdc, slow) named on the right stand-in.

No test here turns on a healthy stand-in's speed: on a busy machine the judge may leave it ``undecided``
(never ``slow`` unless the gap outlasts the noise measured in the same run), so healthy stand-ins are
asserted not slow and not corrupt, and the slow drill plants a slowdown (a quarter of the speed) far
above any noise a loaded machine puts on the figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchvision")

from test_probe_cli import probe  # noqa: E402

FOUR = ["--mode", "gpu", "--device", "cpu", "--gpus", "0,1,2,3", "--json"]
NUMBERS = ("matmul_tflops", "memory_gbps", "h2d_gbps", "d2h_gbps")
HEALTHY = {"pass", "undecided"}  # a healthy stand-in: what its speed may read on a busy machine


def per_gpu(tmp_path, *args: str) -> tuple[int, dict]:
    done, _ = probe(tmp_path, *FOUR, *args)
    assert done.stdout, done.stderr[-2000:]
    return done.returncode, json.loads(done.stdout)


@pytest.mark.slow
def test_healthy_stand_ins_all_pass_with_four_positive_numbers(tmp_path):
    code, doc = per_gpu(tmp_path)
    assert code == 0 and doc["verdict"] == "pass"
    (only,) = doc["sets"]
    assert only["gpus"] == [0, 1, 2, 3] and [c["name"] for c in only["checks"]] == ["gpu"]
    section = doc["per_gpu"]
    assert section["simulated"] is True and [r["gpu"] for r in section["gpus"]] == [0, 1, 2, 3]
    for r in section["gpus"]:
        assert r["verdict"] in HEALTHY and all(r[k] > 0 for k in NUMBERS), r
        assert r["verdict"] == "pass" or r["undecided_about"] == "speed", r
        assert all(r["peers_median"][k] > 0 for k in NUMBERS)
        # every figure is its best round, with the four rounds beside it
        assert all(len(r["runs"][k]) == 4 and r[k] == max(r["runs"][k]) for k in NUMBERS), r
    assert len({r["result_hash"] for r in section["gpus"]}) == 1
    markdown = Path(doc["report"]["markdown"]).read_text()
    assert "# gpu, set 0,1,2,3: every CPU stand-in on its own" in markdown


@pytest.mark.slow
def test_sdc_drill_names_the_corrupt_stand_in_and_only_it(tmp_path):
    code, doc = per_gpu(tmp_path, "--inject", "sdc", "--inject-gpus", "2")
    assert code == 1 and doc["verdict"] == "fail"
    verdicts = {r["gpu"]: r["verdict"] for r in doc["per_gpu"]["gpus"]}
    assert verdicts[2] == "corrupt" and {verdicts[g] for g in (0, 1, 3)} <= HEALTHY, verdicts
    check = doc["sets"][0]["checks"][0]
    assert check["kind"] == "corrupt" and check["detail"].startswith("GPU2 corrupt")


@pytest.mark.slow
def test_sdc_drill_on_two_stand_ins_is_told_by_the_second_run(tmp_path):
    done, _ = probe(tmp_path, "--mode", "gpu", "--device", "cpu", "--gpus", "0,1", "--json",
                    "--inject", "sdc", "--inject-gpus", "1")  # fmt: skip
    doc = json.loads(done.stdout)
    verdicts = {r["gpu"]: r["verdict"] for r in doc["per_gpu"]["gpus"]}
    assert verdicts[1] == "corrupt" and verdicts[0] in HEALTHY, verdicts  # GPU0's speed is not the point


@pytest.mark.slow
def test_slow_drill_names_the_slow_stand_in_at_a_quarter_speed(tmp_path):
    code, doc = per_gpu(tmp_path, "--inject", "slow", "--inject-gpus", "1")
    assert code == 1
    rows = {r["gpu"]: r for r in doc["per_gpu"]["gpus"]}
    assert rows[1]["verdict"] == "slow" and {rows[g]["verdict"] for g in (0, 2, 3)} <= HEALTHY, rows
    ratio = rows[1]["matmul_tflops"] / rows[1]["peers_median"]["matmul_tflops"]
    assert ratio < 0.5  # four times the work: about a quarter of the speed
    assert "(noise " in rows[1]["why"] and "1 in 1820 by chance" in rows[1]["why"]
    assert doc["sets"][0]["checks"][0]["kind"] == "slow"


@pytest.mark.slow
def test_a_crash_in_the_per_gpu_check_names_its_gpu_and_recommend_leaves_it_out(tmp_path):
    done, _ = probe(tmp_path, "--mode", "gpu", "--device", "cpu", "--gpus", "0,1,2", "--json",
                    "--inject", "crash", "--inject-gpus", "1")  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    doc = json.loads(done.stdout)
    check = doc["sets"][0]["checks"][0]
    assert check["name"] == "gpu" and check["kind"] == "crashed", check["detail"]
    assert check["metrics"]["rank"] == 1, check["detail"]
    verdicts = {r["gpu"]: r["verdict"] for r in doc["per_gpu"]["gpus"]}
    assert verdicts == {0: "not judged", 1: "crashed", 2: "not judged"}
    from gputopo.recommend import evidence_from_report

    assert [g.gpus for g in evidence_from_report(doc, "r.json").failed] == [(1,)]


@pytest.mark.slow
def test_doctor_runs_it_on_every_gpu_of_the_simulated_machine(tmp_path):
    from test_doctor import _doctor

    done, doc = _doctor(tmp_path, "--simulate", "--steps", "2", "--inject", "sdc", "--inject-gpus", "3")
    assert done.returncode == 1, done.stderr[-2000:]
    rows = doc["probe"]["per_gpu"]["gpus"]
    assert [r["gpu"] for r in rows] == [0, 1, 2, 3]  # every GPU of the sample machine
    verdicts = {r["gpu"]: r["verdict"] for r in rows}
    assert verdicts[3] == "corrupt" and {verdicts[g] for g in (0, 1, 2)} <= HEALTHY, verdicts
    found = [f for f in doc["findings"] if f["where"] == "GPU3"]
    assert found and found[0]["category"] == "compute" and found[0]["gpu"] == 3
    for rec in doc["recommendations"]:
        assert rec["best"] is None or 3 not in rec["best"]["gpus"], rec


def test_html_report_draws_a_bar_per_gpu_beside_the_table():
    pytest.importorskip("matplotlib")
    from gputopo.probe.judge.pergpu import judge_gpus, per_gpu_section
    from gputopo.ui.html_report import render_probe_html

    rows = [
        {"gpu": g, "name": "CPU stand-in", "matmul_tflops": 1.0 if g != 1 else 0.5, "memory_gbps": 9.0,
         "h2d_gbps": 3.0, "d2h_gbps": 3.0, "result_hash": "a" * 16, "result_hash_rerun": "a" * 16}
        for g in range(4)
    ]  # fmt: skip
    for r in rows:  # four rounds each, alike: no noise
        r["runs"] = {k: [r[k]] * 4 for k in NUMBERS}
    check = judge_gpus({"device": "cpu", "rows": rows}, 0.25).to_dict()
    doc = {"device": "cpu", "verdict": "fail", "sets": [{"gpus": [0, 1, 2, 3], "checks": [check]}]}
    html = render_probe_html({**doc, "per_gpu": per_gpu_section(check)})
    assert "<h2>Every GPU on its own</h2>" in html and html.count("data:image/png") == 1
    assert "0.5 (peers 1)" in html and "slow: matmul 0.5" in html
