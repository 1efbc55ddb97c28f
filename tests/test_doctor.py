"""`gputopo doctor` and `gputopo report`: the whole check, simulated here, and the reports people open."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import invoke, plain_env
from gputopo.probe.judge.findings import probe_findings
from gputopo.services.doctor import DoctorOptions, pair_rows, recommendations, run_doctor
from gputopo.topology import samples
from gputopo.ui.doctor_markdown import to_markdown
from gputopo.ui.html_report import render_html

PLAIN_ENV = plain_env()


def run(*args: str):
    return invoke(*args)


def failed_probe_doc() -> dict:
    """A probe report where P2P on pair 0,1 returned wrong data and 2,3 passed (the IOMMU/ACS story)."""
    check = {
        "name": "allreduce",
        "verdict": "pass",
        "kind": None,
        "detail": "ok",
        "remedy": None,
        "metrics": {
            "rows": [
                {"bytes": 1 << 20, "time_us": 100.0, "algbw_gbps": 10.0, "busbw_gbps": 10.0, "wrong": 0}
            ],
            "peak_busbw_gbps": 10.0,
            "expected_busbw_gbps": 48.0,
        },
    }
    p2p_bad = {
        "name": "p2p",
        "verdict": "fail",
        "kind": "corrupt",
        "detail": "GPU0->GPU1: 4096 wrong bytes",
        "remedy": "IOMMU/ACS likely on; set NCCL_P2P_DISABLE=1",
        "metrics": {},
    }
    return {
        "schema": "gputopo/probe/v1",
        "device": "cuda",
        "verdict": "fail",
        "sets": [
            {"gpus": [0, 1], "verdict": "fail", "checks": [p2p_bad, check]},
            {"gpus": [2, 3], "verdict": "pass", "checks": [check]},
        ],
        "report": None,
    }


def test_doctor_without_gpu_simulates_on_the_sample_machine(tmp_path):
    doc = run_doctor(DoctorOptions(skip_probe=True, report_dir=tmp_path))
    assert doc["simulated"] is True
    assert "no NVIDIA driver" in doc["why_simulated"]
    assert doc["topology"]["source"] == "sample:quad-nv4-pairs-2socket"
    assert doc["verdict"] == "healthy"
    assert doc["headline"].startswith("SIMULATED: ")
    assert [r["n"] for r in doc["recommendations"]] == [2, 4]
    assert doc["recommendations"][0]["best"]["gpus"] == [0, 1]
    assert (
        doc["recommendations"][0]["export"] == "export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1"
    )
    assert doc["probe"] is None and doc["probe_note"] == "skipped (--skip-probe)"


def test_doctor_live_flags_link_problems_and_leaves_busy_gpus_out(tmp_path):
    from fake_nvml import FakeNvml

    with FakeNvml.pcie_box().installed():
        doc = run_doctor(DoctorOptions(skip_probe=True, report_dir=tmp_path))
    assert doc["simulated"] is False
    # A link trained narrower than its maximum is a slow link (a note, ranked lower), a problem only when
    # its replays rise too (issue 28): the verdict stays healthy, the busy GPU is still left out.
    assert doc["verdict"] == "healthy"
    assert any(
        f["where"] == "GPU2" and "while busy" in f["what"] and f["severity"] == "note"
        for f in doc["findings"]
    )
    assert [e["gpu"] for e in doc["left_out"]] == [2]
    for r in doc["recommendations"]:
        assert 2 not in r["best"]["gpus"]
    assert [r["n"] for r in doc["recommendations"]] == [2, 4, 7]


def test_failed_probe_becomes_a_problem_with_its_remedy_and_steers_the_recommendation():
    topo = samples.load("quad-nv4-pairs-2socket")
    probe = failed_probe_doc()
    found = probe_findings(probe)
    assert [(f.where, f.remedy) for f in found] == [
        ("GPUs 0,1", "IOMMU/ACS likely on; set NCCL_P2P_DISABLE=1")
    ]
    assert "p2p check failed (corrupt)" in found[0].what
    rows = pair_rows(topo, probe)
    assert rows[0] == {
        "gpus": [0, 1],
        "link": "NV4",
        "verdict": "fail",
        "measured_busbw_gbps": 10.0,
        "est_busbw_gbps": rows[0]["est_busbw_gbps"],
    }
    assert rows[0]["est_busbw_gbps"] > 40
    before = recommendations(topo, [2], None)[0]["best"]["gpus"]
    after = recommendations(topo, [2], probe)[0]["best"]["gpus"]
    assert before == [0, 1] and after == [2, 3]


def test_markdown_and_html_say_simulated_and_show_problems():
    doc = run_doctor(DoctorOptions(skip_probe=True))
    doc["probe"] = failed_probe_doc()
    doc["findings"] = [
        {
            "where": "GPUs 0,1",
            "what": "p2p check failed (corrupt)",
            "remedy": "IOMMU/ACS",
            "severity": "problem",
        }
    ]
    doc["pairs"] = pair_rows(samples.load("quad-nv4-pairs-2socket"), doc["probe"])
    doc["stale"] = {
        "holders": [
            {
                "pid": 4242,
                "user": "alice",
                "command": ["python", "train.py"],
                "stale": True,
                "protected": False,
                "reasons": ["orphaned: its parent exited"],
            },
            {
                "pid": 77,
                "user": "root",
                "command": ["nvidia-persistenced"],
                "stale": False,
                "protected": True,
                "reasons": ["protected: NVIDIA persistence daemon"],
            },
        ]
    }
    md = to_markdown(doc)
    assert "- pid 4242 (alice): stale; orphaned: its parent exited" in md
    assert "- pid 77 (root): protected; protected: NVIDIA persistence daemon" in md
    # The one finding shape; an older report's finding without GPU, category and action shows "-" there.
    row = "| GPUs 0,1 | - | - | p2p check failed (corrupt) | IOMMU/ACS | problem | - |"
    assert "(SIMULATED)" in md and row in md
    page = render_html(doc)
    assert "SIMULATED" in page and "p2p check failed (corrupt)" in page
    assert "<td>4242</td><td>alice</td><td>python train.py</td><td>stale</td>" in page
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 3  # topology graph, pair heatmaps, busbw curves; each a real picture
    from PIL import Image

    for data in images:
        img = Image.open(io.BytesIO(base64.b64decode(data)))
        assert img.width > 200 and img.height > 150
        lo_hi = img.convert("L").getextrema()
        assert lo_hi[0] < lo_hi[1]  # not a blank image


def test_report_command_rejects_what_is_not_a_gputopo_report(tmp_path):
    missing = run("report", str(tmp_path / "nope.json"))
    assert missing.exit_code == 2 and "no such file" in missing.stderr
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "gputopo/topology/v1"}))
    wrong = run("report", str(other))
    assert wrong.exit_code == 2 and "not a gputopo doctor or probe report" in wrong.stderr
    empty_probe = tmp_path / "probe.json"
    empty_probe.write_text(json.dumps({"schema": "gputopo/probe/v1"}))
    incomplete = run("report", str(empty_probe))
    assert incomplete.exit_code == 2 and "incomplete or damaged probe report" in incomplete.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert run("report", str(broken)).exit_code == 2


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
def test_doctor_end_to_end_on_cpu_ranks_writes_reports_a_browser_renders(tmp_path):
    """The quickstart: doctor on a machine without GPUs, then the HTML opened in a real headless browser."""
    env = {**os.environ, **PLAIN_ENV}
    out = subprocess.run(
        # --full: the full probe on CPU ranks (the speed table included), not the quick show
        [sys.executable, "-m", "gputopo", "doctor", "--full", "--steps", "2", "--report-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    # No driver: the simulation is shown and its reports written, but `doctor || alert` must fire.
    assert out.returncode == 3, out.stderr[-2000:]
    assert (
        "this machine's GPUs were not checked" in out.stderr and "--simulate" in out.stderr.splitlines()[-1]
    )
    assert "SIMULATED: no NVIDIA driver" in out.stdout
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1" in out.stdout
    json_path = next(tmp_path.glob("doctor-*.json"))
    doc = json.loads(json_path.read_text())
    assert doc["schema"] == "gputopo/doctor/v1" and doc["simulated"] is True
    assert len(doc["pairs"]) == 6 and all(p["verdict"] == "pass" for p in doc["pairs"])
    assert {tuple(s["gpus"]) for s in doc["probe"]["sets"]} >= {(0, 1), (2, 3), (0, 1, 2, 3)}
    # The speed table ran on the recommended sets, inside their set entries (no duplicate sets).
    speed = {tuple(s["gpus"]) for s in doc["probe"]["sets"] for c in s["checks"] if c["name"] == "speed"}
    assert speed == {(0, 1)}  # simulated: only the smallest recommended set is timed
    assert len({tuple(s["gpus"]) for s in doc["probe"]["sets"]}) == len(doc["probe"]["sets"])
    assert "## Speed: one GPU vs DataParallel vs DDP" in Path(doc["report"]["markdown"]).read_text()
    assert "(SIMULATED)" in Path(doc["report"]["markdown"]).read_text()
    html_path = Path(doc["report"]["html"])
    assert "SIMULATED" in html_path.read_text()

    shown = run("report", str(json_path), "--html", str(tmp_path / "again.html"))
    assert shown.exit_code == 0, shown.output
    assert "Which GPUs to use" in shown.stdout
    # Re-rendered from the saved JSON alone, the page is the same one doctor wrote.
    assert (tmp_path / "again.html").read_text() == html_path.read_text()

    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium here (CI installs it): the browser half of this test needs one")
    flags = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=10000",
    ]
    dom = subprocess.run(
        [*flags, "--dump-dom", html_path.as_uri()], capture_output=True, text=True, timeout=120
    )
    total = re.search(r'data-images-total="(\d+)"', dom.stdout)
    loaded = re.search(r'data-images-loaded="(\d+)"', dom.stdout)
    assert total and loaded, dom.stderr[-2000:]
    assert int(total.group(1)) == 5  # topology, pair heatmaps, busbw curves, per-GPU bars, speed bars
    assert loaded.group(1) == total.group(1)
    shot = tmp_path / "shot.png"
    subprocess.run(
        [*flags, "--window-size=1200,2000", f"--screenshot={shot}", html_path.as_uri()],
        capture_output=True,
        timeout=120,
    )
    from PIL import Image

    img = Image.open(shot)
    assert img.size == (1200, 2000)
    assert len(img.convert("L").getcolors(maxcolors=1 << 20) or ()) > 50  # a rendered page, not a blank one


def test_doctor_without_matplotlib_still_writes_json_and_markdown(tmp_path, monkeypatch):
    """An admin install has no matplotlib: the report loses its pictures, not the rest."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = run("doctor", "--simulate", "--skip-probe", "--html", "--report-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "no HTML report: matplotlib is not installed" in result.stderr
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md"]


def test_only_the_default_simulation_is_the_quick_show():
    from gputopo.probe.plan.options import Fault
    from gputopo.services.doctor import Machine, quick_show, quick_words

    topo = samples.load("quad-nv4-pairs-2socket")
    simulated, live = Machine(topo, True, "no driver"), Machine(topo, False, None)
    assert quick_show(simulated, DoctorOptions())
    assert quick_show(simulated, DoctorOptions(simulate=True, steps=3))  # a chosen step count is kept
    assert not quick_show(live, DoctorOptions())  # a GPU machine is probed in full
    assert not quick_show(simulated, DoctorOptions(full=True))
    assert not quick_show(simulated, DoctorOptions(input="sample:dgx1-v100"))  # another machine: in full
    assert not quick_show(simulated, DoctorOptions(inject=Fault.CORRUPT, inject_gpus="0,1"))  # drills too
    assert not quick_show(simulated, DoctorOptions(skip_probe=True))
    assert quick_words(DoctorOptions()) == (
        "a quick show (micro model, 2 steps, no speed table; --full runs the full probe)"
    )


@pytest.mark.slow
def test_the_quick_show_probes_every_pair_with_the_micro_model_and_says_so(tmp_path):
    """The first run without a GPU: every pair and the 4-GPU set checked on CPU ranks, labelled."""
    out = subprocess.run(
        [sys.executable, "-m", "gputopo", "doctor", "--simulate", "--json", "--no-html"]
        + ["--report-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, **PLAIN_ENV},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert "a quick show (micro model, 2 steps" in doc["why_simulated"]
    config = doc["probe"]["config"]
    assert (config["model"], config["steps"]) == ("micro", 2)
    assert len(doc["pairs"]) == 6 and all(p["verdict"] == "pass" for p in doc["pairs"])
    checks = {c["name"] for s in doc["probe"]["sets"] for c in s["checks"]}
    assert {"dp", "ddp", "allreduce"} <= checks and "speed" not in checks
    assert doc["probe"]["environment"].get("torchvision") is not None  # its version, never its import


def test_heatmap_scales_are_shared_unless_the_measurement_is_simulated(monkeypatch):
    """Measured and estimated colours compare on GPUs; CPU stand-ins' tiny numbers get their own scale."""
    from gputopo.ui import figures

    seen = []
    real = figures._png

    def capture(fig):
        seen.append([im.get_clim()[1] for ax in fig.axes for im in ax.get_images()])
        return real(fig)

    monkeypatch.setattr(figures, "_png", capture)
    measured, estimated = {(0, 1): 1.5}, {(0, 1): 48.0}
    figures.pair_heatmaps([0, 1], measured, estimated, set(), same_scale=True)
    figures.pair_heatmaps([0, 1], measured, estimated, set(), same_scale=False)
    assert seen == [[48.0, 48.0], [1.5, 48.0]]


def test_unwritable_report_dir_fails_before_any_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = run("doctor", "--report-dir", str(blocker / "reports"))
    assert result.exit_code == 2
    assert "cannot write the report" in result.stderr
    probe = run("probe", "--device", "cpu", "--gpus", "0,1", "--report-dir", str(blocker / "r"))
    assert probe.exit_code == 2 and "cannot write the report" in probe.stderr


def _doctor(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """``gputopo doctor ... --json`` in a child process; asserts that no process it started is left."""
    from test_probe_cli import TEST_MARKER, assert_nothing_left

    marker = uuid.uuid4().hex
    env = {**os.environ, **PLAIN_ENV, TEST_MARKER: marker}
    cmd = [sys.executable, "-m", "gputopo", "doctor", *args, "--json", "--report-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert_nothing_left(marker)
    return done, json.loads(done.stdout) if done.stdout else {}


@pytest.mark.slow
def test_seed_drill_corrupt_path_between_5_and_6_in_one_launch(tmp_path):
    """The seed story: DataParallel on 5,6 goes wrong while 6,7 and 4,5 train fine."""
    done, doc = _doctor(
        tmp_path, "--input", "sample:seed-8gpu-nv4", "--inject", "corrupt", "--inject-gpus", "5,6",
        "--steps", "2", "--model", "tiny",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    sets = {tuple(s["gpus"]): s for s in doc["probe"]["sets"]}
    assert len(sets) == 28 + 2  # every pair, the 4-GPU set and all 8
    broken = {c["name"]: c for c in sets[(5, 6)]["checks"]}
    assert sets[(5, 6)]["verdict"] == "fail" and broken["dp"]["kind"] == "corrupt"
    assert broken["allreduce"]["kind"] == "corrupt"
    for s in sets.values():  # every set ran dp, ddp and the all-reduce, the exact check at every size
        ran = {c["name"]: c for c in s["checks"] if c["verdict"] != "skipped"}
        assert {"dp", "ddp", "allreduce"} <= set(ran), s
        sweep = ran["allreduce"]["metrics"]
        assert len(sweep["rows"]) == 4 and all("wrong" in row for row in sweep["rows"])
        # CPU stand-ins' all-reduce times are never judged: one warm-up and one timed run per size.
        assert (sweep["warmup_iters"], sweep["timed_iters"]) == (1, 1)
    for pair in ((6, 7), (4, 5)):
        assert sets[pair]["verdict"] == "pass", sets[pair]
    healthy = [s for gpus, s in sets.items() if not {5, 6} <= set(gpus)]
    assert all(s["verdict"] == "pass" for s in healthy)
    for rec in doc["recommendations"]:
        if rec["n"] in (2, 4):
            assert not {5, 6} <= set(rec["best"]["gpus"]), rec
    assert len(doc["probe"]["launches"]) == 1
    assert doc["verdict"] == "problems"


@pytest.mark.slow
def test_a_planted_hang_costs_its_sets_and_at_most_two_more_launches(tmp_path):
    done, doc = _doctor(
        tmp_path, "--input", "sample:quad-nv4-pairs-2socket", "--inject", "hang", "--inject-gpus", "2,3",
        "--steps", "2", "--model", "tiny", "--timeout", "20",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    probe = doc["probe"]
    hung = {tuple(s["gpus"]) for s in probe["sets"] if any(c["kind"] == "hung" for c in s["checks"])}
    assert hung == {(2, 3), (0, 1, 2, 3)}  # the sets holding both GPUs; nothing else
    for s in probe["sets"]:
        if tuple(s["gpus"]) not in hung:
            assert s["verdict"] == "pass", s
            assert all(
                c["verdict"] in ("pass", "skipped") and "not reached" not in c["detail"] for c in s["checks"]
            )
    launches = probe["launches"]
    assert len(launches) <= 3
    assert [e["kind"] for launch in launches for e in launch["ended_by"]] == ["hung", "hung"]


def test_drill_options_go_together_and_need_the_probes():
    from gputopo.errors import UsageError
    from gputopo.probe.plan.options import Fault

    with pytest.raises(UsageError, match="go together"):
        run_doctor(DoctorOptions(inject=Fault.CORRUPT))
    with pytest.raises(UsageError, match="--skip-probe skips them"):
        run_doctor(DoctorOptions(skip_probe=True, inject=Fault.CORRUPT, inject_gpus="0,1"))


def test_a_gpu_whose_driver_asks_to_drain_p2p_is_in_no_probed_pair_but_still_probed_alone(monkeypatch):
    """NVML recovery action DRAIN_P2P on GPU3: doctor's probes copy through it in no pair and no set,
    while GPU3 still gets the one-GPU checks and the per-GPU check. Taking the split out of
    ``probe_section`` puts GPU3 back into pairs 0-3, 1-3 and 2-3, and this fails."""
    from datetime import datetime, timezone

    from gputopo.probe import shared
    from gputopo.probe.plan import config as probe_config
    from gputopo.probe.plan.schedule import PER_GPU
    from gputopo.probe.pool import devices, runner
    from gputopo.services import doctor

    pytest.importorskip("torch")
    plans = []

    def fake_run_probe(config, on_progress=None, plan=None, **handed):
        plans.append(plan)
        return shared.ProbeRun(config, (), {}, (), datetime.now(timezone.utc), 0.0)

    inventory = probe_config.DeviceInventory("cuda", (0, 1, 2, 3), ("0", "1", "2", "3"))
    monkeypatch.setattr(runner, "run_probe", fake_run_probe)
    monkeypatch.setattr(devices, "detect_devices", lambda requested, **_options: inventory)
    machine = doctor.choose_machine("sample:quad-nv4-pairs-2socket")
    drained = {3: "GPU3: the driver asks for recovery: drain P2P (NVML recovery action 3)"}
    sets = doctor.choose_sets(machine.topology, {}, drained)
    best = [r["best"]["gpus"] for r in sets.first if r["best"]]
    assert all(3 not in b for b in best)
    doctor.probe_section(machine, sets.usable, best, DoctorOptions(steps=2), inventory, None, {}, drained)
    (plan,) = plans
    multi = [job for job in plan.jobs if len(job.gpus) > 1 and job.checks != (PER_GPU,)]
    assert multi and all(3 not in job.gpus for job in multi)
    assert {(0, 1), (0, 2), (1, 2)} <= {job.gpus for job in multi}
    alone = [job for job in plan.jobs if job.gpus == (3,)]
    assert alone, "GPU3 is still probed on its own"
    per_gpu = [job for job in plan.jobs if PER_GPU in job.checks]
    assert per_gpu and all(3 in job.gpus for job in per_gpu)
