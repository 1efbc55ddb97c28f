"""--mode speed: one GPU vs DataParallel vs DDP vs DDP+AMP at the same global batch.

The judging runs on plain rows (speedups, efficiency, the flags); the end to end run times the four
configurations on CPU ranks, where the numbers are shown and never judged.
"""

from __future__ import annotations

import json

import pytest

from gputopo.probe.judge.speed import (
    CONFIGS,
    SCALING_FLOOR,
    judge_speed,
    speed_flags,
    speed_table,
    with_speedups,
)
from gputopo.probe.plan.options import Mode
from test_probe_cli import probe


def _rows(*samples_per_s: float, devices: int = 2) -> list[dict]:
    return [
        {"config": c, "devices": 1 if c == "1 GPU" else devices, "samples_per_s": s, "global_batch": 64}
        for c, s in zip(CONFIGS, samples_per_s, strict=True)
    ]


def test_speedup_and_efficiency_are_against_one_gpu():
    rows = with_speedups(_rows(100.0, 150.0, 180.0, 300.0))
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 1.5, 1.8, 3.0])
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 0.75, 0.9, 1.5])


def test_the_seed_table_is_flagged_dataparallel_slower_and_ddp_poor_scaling():
    # The seed's 4-GPU box: DataParallel slower than one GPU, DDP needing 4 GPUs for 2x.
    rows = with_speedups(_rows(100.0, 80.0, 200.0, 320.0, devices=4))
    flags = speed_flags(rows, 4)
    assert len(flags) == 2
    assert "DataParallel 0.80x" in flags[0] and "DistributedDataParallel" in flags[0]
    assert "efficiency 50%" in flags[1] and "gputopo recommend" in flags[1]


def test_a_set_that_scales_well_has_no_flags():
    efficient = 2 * SCALING_FLOOR + 0.1  # speedup on two GPUs just above the floor
    rows = with_speedups(_rows(100.0, 120.0, 100.0 * efficient, 250.0))
    assert speed_flags(rows, 2) == []


def test_ddp_just_below_the_floor_is_flagged():
    rows = with_speedups(_rows(100.0, 120.0, 100.0 * 2 * (SCALING_FLOOR - 0.01), 250.0))
    (flag,) = speed_flags(rows, 2)
    assert flag.startswith("DDP")


def test_cpu_stand_ins_are_shown_but_never_judged():
    metrics = {"ranks": 2, "rows": _rows(100.0, 30.0, 60.0, 60.0)}
    cpu = judge_speed(metrics, "cpu")
    assert cpu.verdict == "pass" and cpu.metrics["flags"] == [] and cpu.metrics["judged"] is False
    assert "not judged" in cpu.detail
    gpu = judge_speed(metrics, "cuda")
    assert gpu.verdict == "pass" and len(gpu.metrics["flags"]) == 2 and gpu.metrics["judged"] is True
    assert [r["speedup"] for r in gpu.metrics["rows"]] == pytest.approx([1.0, 0.3, 0.6, 0.6])


def test_the_table_has_a_row_and_a_bar_per_configuration():
    result = judge_speed({"ranks": 4, "rows": _rows(100.0, 80.0, 200.0, 400.0, devices=4)}, "cuda")
    lines = speed_table((0, 1, 2, 3), result.metrics, "cuda")
    assert lines[0].startswith("# speed, set 0,1,2,3: samples/s at global batch 64")
    body = [line for line in lines if not line.startswith("#")]
    assert [line.split()[0] for line in body] == ["1", "DataParallel", "DDP", "DDP+AMP"]
    assert body[-1].endswith("#" * 30)  # the fastest row has the full bar
    assert "4.00x" in body[-1] and sum(line.startswith("# FLAG") for line in lines) == 2


def test_speed_is_its_own_mode_not_part_of_all():
    assert Mode.SPEED.checks == ("speed",)
    assert "speed" not in Mode.ALL.checks


@pytest.mark.slow
def test_speed_mode_on_cpu_ranks_gives_the_four_rows_with_speedups(tmp_path):
    args = ["--device", "cpu", "--gpus", "0,1", "--model", "tiny", "--batch-size", "2", "--steps", "1"]
    done, _ = probe(tmp_path, *args, "--mode", "speed", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# config" in done.stdout and "DDP+AMP" in done.stdout and "not judged" in done.stdout
    (report,) = (tmp_path / "reports").glob("probe-*.json")
    (only_set,) = json.loads(report.read_text())["sets"]
    (speed,) = only_set["checks"]
    rows = speed["metrics"]["rows"]
    assert [r["config"] for r in rows] == list(CONFIGS)
    assert all(r["samples_per_s"] > 0 and r["global_batch"] == 4 for r in rows)
    assert rows[0]["speedup"] == 1.0
    assert all(r["speedup"] == pytest.approx(r["samples_per_s"] / rows[0]["samples_per_s"]) for r in rows)
    assert rows[3]["autocast_dtype"] == "bfloat16"  # CPU autocast's dtype on stand-ins
    # Timed under torch's defaults with cuDNN autotuning, not the correctness checks' pinning.
    assert speed["metrics"]["numerics"].startswith("torch defaults with cudnn.benchmark on")
    flags = speed["metrics"]["numerics_flags"]
    assert flags["cudnn_benchmark"] and not flags["deterministic_algorithms"]
    assert "# numerics: torch defaults" in done.stdout
    markdown = report.with_suffix(".md").read_text()
    assert "DDP+AMP" in markdown and "speedup" in markdown
    page = report.with_suffix(".html").read_text()
    assert "Is DataParallel or DDP worth it?" in page  # the probe's HTML report draws the bars


def test_doctor_report_shows_the_speed_table_and_draws_the_bars():
    import re

    from gputopo.services.doctor import DoctorOptions, run_doctor
    from gputopo.ui.doctor_markdown import to_markdown
    from gputopo.ui.html_report import render_html

    speed = judge_speed({"ranks": 2, "rows": _rows(100.0, 80.0, 120.0, 200.0)}, "cuda").to_dict()
    ddp = {"name": "ddp", "verdict": "pass", "kind": None, "detail": "ok", "remedy": None, "metrics": {}}
    sets = [{"gpus": [0, 1], "verdict": "pass", "checks": [ddp, speed]}]

    doc = run_doctor(DoctorOptions(skip_probe=True))
    doc["probe"] = {"device": "cuda", "verdict": "pass", "sets": sets}
    md = to_markdown(doc)
    assert "## Speed: one GPU vs DataParallel vs DDP" in md and "DDP+AMP" in md and "# FLAG" in md
    page = render_html(doc)
    assert "Is DataParallel or DDP worth it?" in page and "use DistributedDataParallel" in page
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 2  # topology graph and speed bars


@pytest.mark.parametrize(
    ("skip_speed", "device", "timed"),
    [
        (False, "cuda", ((0, 1), (0, 1, 2, 3))),  # GPUs: every recommended set
        (False, "cpu", ((0, 1),)),  # stand-ins are not judged: the smallest set only
        (True, "cuda", None),
    ],
)
def test_doctor_times_the_recommended_sets_unless_skip_speed(monkeypatch, skip_speed, device, timed):
    from datetime import datetime, timezone

    from gputopo.probe import shared
    from gputopo.probe.plan import config as probe_config
    from gputopo.probe.pool import devices, runner
    from gputopo.services import doctor

    plans = []

    def fake_run_probe(config, on_progress=None, plan=None, **handed):  # handed: view, sick
        plans.append(plan)
        return shared.ProbeRun(config, (), {}, (), datetime.now(timezone.utc), 0.0)

    inventory = probe_config.DeviceInventory(
        device, (0, 1, 2, 3), ("0", "1", "2", "3") if device == "cuda" else ()
    )
    monkeypatch.setattr(runner, "run_probe", fake_run_probe)
    monkeypatch.setattr(devices, "detect_devices", lambda requested, **_options: inventory)
    machine = doctor.choose_machine("sample:quad-nv4-pairs-2socket")
    options = doctor.DoctorOptions(steps=2, skip_speed=skip_speed)
    doctor.probe_section(machine, [0, 1, 2, 3], [[0, 1], [0, 1, 2, 3]], options, inventory)
    (plan,) = plans  # one run, one pool: the speed steps come after the checks
    speed = [job.gpus for job in plan.jobs if job.checks == ("speed",)]
    assert speed == list(timed or ())
    assert all("speed" not in job.checks for job in plan.jobs if job.checks != ("speed",))
