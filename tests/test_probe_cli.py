"""`gputopo probe` end to end on CPU ranks: real launches through torch's elastic launcher, real faults.

Each run gets a unique marker in its environment; every process it starts inherits it, so the tests can
prove that nothing is left running afterwards, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("torchvision")

from conftest import default_stop_signals  # noqa: E402
from gputopo.probe.shared import COLLECTIVE_TIMEOUT_GRACE_S  # noqa: E402
from own_procs import MARKER_VAR, leftovers, wait_for_none_left  # noqa: E402

# Each launch's processes carry a marker of their own (own_procs): only they are looked at.
TEST_MARKER = MARKER_VAR
BASE = ["--device", "cpu", "--gpus", "0,1", "--model", "tiny"]


def assert_nothing_left(marker: str) -> None:
    assert wait_for_none_left(marker, within_s=2.0) == []


def probe(tmp_path: Path, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{TEST_MARKER: marker}, COLUMNS="120", NO_COLOR="1")
    cmd = [sys.executable, "-m", "gputopo", "probe", *args, "--report-dir", str(tmp_path / "reports")]
    started = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert_nothing_left(marker)
    return done, elapsed


def checks_of(doc: dict) -> dict[str, dict]:
    (only_set,) = doc["sets"]
    return {c["name"]: c for c in only_set["checks"]}


@pytest.mark.slow
def test_healthy_cpu_run_of_every_check_passes_and_writes_its_report(tmp_path):
    # No wall-clock bound here: a shared machine's load decides it (benchmarks/ measures the speed).
    done, _ = probe(tmp_path, *BASE, "--mode", "all", "--steps", "5", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # the whole of stdout is one JSON document
    assert doc["schema"] == "gputopo/probe/v1" and doc["device"] == "cpu" and doc["verdict"] == "pass"
    checks = checks_of(doc)
    assert list(checks) == ["gpu", "p2p", "dp", "ddp", "allreduce"]
    assert checks["p2p"]["verdict"] == "skipped" and "CPU stand-ins" in checks["p2p"]["detail"]
    for name in ("dp", "ddp", "allreduce"):
        assert checks[name]["verdict"] == "pass", checks[name]["detail"]
    ddp = checks["ddp"]["metrics"]
    assert len(ddp["losses"]) == len(ddp["ref_losses"]) == 5
    # The second reference runs only for a curve off the fixed tolerance (a healthy CPU run never is).
    assert len(ddp["ref2_losses"]) == (5 if ddp["ref2_run"] else 0)
    assert ddp["desync_steps"] == [] and ddp["backend"] == "gloo" and len(ddp["rank_losses"]) == 2
    rows = checks["allreduce"]["metrics"]["rows"]
    assert [r["wrong"] for r in rows] == [0] * len(rows)
    assert all(r["busbw_gbps"] == pytest.approx(r["algbw_gbps"]) for r in rows)  # 2(n-1)/n = 1 for n = 2
    assert checks["allreduce"]["metrics"]["expected_busbw_gbps"] is None
    assert doc["environment"]["torch"] and doc["environment"]["devices"][1]["index"] == 1
    # Both report files exist, complete, and name each other.
    saved = json.loads(Path(doc["report"]["json"]).read_text())
    assert saved["sets"] == doc["sets"] and saved["report"] == doc["report"]
    md = Path(doc["report"]["markdown"]).read_text()
    assert "# gputopo probe: PASS" in md and "| 0,1 | ddp | pass |" in md
    assert (
        Path(doc["report"]["json"]).name.startswith("probe-")
        and Path(doc["report"]["json"]).parent.name == "reports"
    )


@pytest.mark.slow
def test_human_output_has_tables_and_the_verdict_panel(tmp_path):
    done, _ = probe(tmp_path, *BASE, "--mode", "allreduce", "--input", "sample:seed-8gpu-nv4")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "# all-reduce, set 0,1: 2 ranks, gloo, float32 sum" in out
    assert "#wrong" in out and "(GB/s)" in out
    assert "model estimate: 48.00 GB/s" in out  # NV4 pair in the sample, from the bandwidth model
    assert "gputopo probe: PASS" in out and "report:" in out
    assert "speed not judged" in out


@pytest.mark.slow
def test_planted_nan_gives_nan_in_dp_and_ddp(tmp_path):
    done, _ = probe(tmp_path, *BASE, "--mode", "all", "--steps", "4", "--inject", "nan", "--json")
    assert done.returncode == 1
    doc = json.loads(done.stdout)
    checks = checks_of(doc)
    assert doc["verdict"] == "fail"
    assert checks["dp"]["kind"] == "nan" and checks["ddp"]["kind"] == "nan"
    assert "gradients non-finite from step 2" in checks["ddp"]["detail"]
    assert checks["allreduce"]["verdict"] == "pass"
    assert "DataParallel" in checks["dp"]["remedy"] and "No set passed" in checks["dp"]["remedy"]


@pytest.mark.slow
def test_planted_corruption_gives_corrupt_desync_and_wrong_elements(tmp_path):
    done, _ = probe(tmp_path, *BASE, "--mode", "all", "--steps", "4", "--inject", "corrupt", "--json")
    assert done.returncode == 1
    checks = checks_of(json.loads(done.stdout))
    assert checks["dp"]["kind"] == "corrupt" and "replica 1" in checks["dp"]["detail"]
    assert checks["ddp"]["kind"] in ("desync", "diverged")
    assert checks["ddp"]["metrics"]["desync_steps"][0] == {"step": 2, "ranks": [1]}
    assert checks["allreduce"]["kind"] == "corrupt"
    assert all(r["wrong"] > 0 for r in checks["allreduce"]["metrics"]["rows"])
    assert "IOMMU" in checks["allreduce"]["remedy"]


@pytest.mark.slow
def test_planted_hang_is_called_hung_soon_after_the_timeout(tmp_path):
    timeout = 10
    done, elapsed = probe(
        tmp_path,
        *BASE,
        "--mode",
        "ddp",
        "--steps",
        "4",
        "--inject",
        "hang",
        "--timeout",
        str(timeout),
        "--json",
    )
    assert done.returncode == 1
    ddp = checks_of(json.loads(done.stdout))["ddp"]
    assert ddp["kind"] == "hung"
    assert "rank 1 last at ddp injected-hang" in ddp["detail"]
    assert "NCCL_P2P_DISABLE=1" in ddp["remedy"]
    # The parent called it, not the collectives' own timeout (--timeout plus a grace) turned crash.
    assert elapsed < timeout + COLLECTIVE_TIMEOUT_GRACE_S


@pytest.mark.slow
def test_planted_crash_names_rank_exit_code_and_stderr(tmp_path):
    done, _ = probe(tmp_path, *BASE, "--mode", "ddp", "--steps", "4", "--inject", "crash", "--json")
    assert done.returncode == 1
    ddp = checks_of(json.loads(done.stdout))["ddp"]
    assert ddp["kind"] == "crashed"
    assert ddp["detail"].startswith("rank 1 exited with exit code 86")
    assert ddp["metrics"]["rank"] == 1 and ddp["metrics"]["exitcode"] == 86
    assert "injected crash in rank 1 during ddp" in ddp["metrics"]["stderr_tail"]


@pytest.mark.slow
def test_ctrl_c_stops_every_rank(tmp_path):
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{TEST_MARKER: marker})
    cmd = [sys.executable, "-m", "gputopo", "probe", *BASE, "--mode", "ddp", "--steps", "100000"]
    cmd += ["--report-dir", str(tmp_path / "reports")]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        preexec_fn=default_stop_signals,  # Ctrl-C reaches it even if this runner ignores SIGINT
    )
    try:
        deadline = time.monotonic() + 60
        while sum("gputopo.probe.ranks.worker" in c for c in leftovers(marker)) < 2:
            assert time.monotonic() < deadline, "ranks never started"
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        # A guard against a hang, not a speed limit: at a load of 10 on 2 cores the stop took over 20 s.
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "interrupted" in err
    assert_nothing_left(marker)


EACH_PAIR = ["--device", "cpu", "--gpus", "0,1,2,3", "--each-pair", "--model", "tiny", "--mode", "ddp"]
EACH_PAIR += ["--steps", "2", "--batch-size", "4", "--json"]


@pytest.mark.slow
def test_each_pair_is_one_launch_with_disjoint_pairs_together(tmp_path):
    done, _ = probe(tmp_path, *EACH_PAIR, timeout=180)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [s["gpus"] for s in doc["sets"]] == [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]]
    assert all(s["verdict"] == "pass" for s in doc["sets"])
    (launch,) = doc["launches"]  # one pool of four ranks ran all six pairs
    assert launch["gpus"] == [0, 1, 2, 3] and launch["status"] == "ok" and launch["judged"] == 6
    assert len(launch["steps"]) == 3
    for step in launch["steps"]:
        assert len(step) == 2
        a, b = (set(j["gpus"]) for j in step)
        assert not a & b
    # Where the ranks' CPU went: each job's ranks in its step, and each rank's start, join and total.
    assert all(j["cpu_s"] > 0 for step in launch["steps"] for j in step)
    cpu = launch["rank_cpu_s"]
    assert all(len(cpu[k]) == 4 for k in ("start", "join", "idle", "total"))
    assert all(0 < start < total for start, total in zip(cpu["start"], cpu["total"], strict=True))
    jobs = sum(j["cpu_s"] for step in launch["steps"] for j in step)
    assert jobs + sum(cpu["start"]) + sum(cpu["join"]) + sum(cpu["idle"]) == pytest.approx(
        sum(cpu["total"]), abs=0.5
    )


@pytest.mark.slow
def test_a_crash_costs_one_pair_and_a_fresh_pool_judges_the_rest(tmp_path):
    """The crash kills one pair's rank; the agent stops the pool, pairs of other steps run in a new one.

    (A hang costs one set the same way: tests/test_doctor.py plants one in the doctor's run.)
    """
    done, _ = probe(tmp_path, *EACH_PAIR, "--inject", "crash", "--inject-gpus", "1,2", timeout=400)
    assert done.returncode == 1, done.stderr
    doc = json.loads(done.stdout)
    by_set = {tuple(s["gpus"]): s["checks"][0] for s in doc["sets"]}
    crashed = by_set.pop((1, 2))
    assert crashed["kind"] == "crashed" and crashed["detail"].startswith("rank 1 exited with exit code 86")
    assert all(c["verdict"] == "pass" for c in by_set.values()), by_set
    first, second = doc["launches"]
    assert first["status"] == "failed" and first["ended_by"] == [{"gpus": [1, 2], "kind": "crashed"}]
    assert second["status"] == "ok"
    # The fresh pool ran only what the first one had not judged.
    assert first["judged"] + second["judged"] == 6


def test_unknown_gpu_is_exit_2_listing_what_exists(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gputopo", "probe", "--device", "cpu", "--gpus", "0,9"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "no GPU 9" in done.stderr and "0-7" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "reports").exists()


def test_without_torch_exit_3_with_the_install_hint(monkeypatch):
    import importlib.util

    from gputopo.cli import app

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in ("torch", "torchvision") else real(n, *a)
    )
    result = CliRunner().invoke(app, ["probe", "--device", "cpu", "--gpus", "0,1"])
    assert result.exit_code == 3
    assert "pip install 'gputopo[probe]'" in result.output


def test_cuda_without_a_gpu_says_so_and_points_at_cpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run(
        [sys.executable, "-m", "gputopo", "probe", "--gpus", "0,1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 3
    assert "--device cuda" in done.stderr and "--device cpu" in done.stderr


def test_cli_and_probe_help_do_not_import_torch():
    code = (
        "import sys\n"
        "from gputopo.cli import app\n"
        "from typer.testing import CliRunner\n"
        "r = CliRunner().invoke(app, ['probe', '--help'])\n"
        "assert r.exit_code == 0 and '--inject' in r.output, r.output\n"
        "import gputopo.probe.pool.runner, gputopo.probe.pool.launch, gputopo.probe.report.document\n"
        "print('torch' in sys.modules, 'torchvision' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_a_set_listed_out_of_order_keeps_its_order_as_rank_order(tmp_path):
    """--gpus 1,0: GPU 1 is the set's rank 0; the subgroup must not sort it (the worker checks)."""
    done, _ = probe(tmp_path, "--device", "cpu", "--gpus", "1,0", "--mode", "allreduce", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["sets"][0]["gpus"] == [1, 0] and doc["verdict"] == "pass"


# --- issue 11: a PASS must mean something -----------------------------------------------------------------


def test_a_run_in_which_every_check_was_skipped_is_exit_2_with_the_reason(tmp_path):
    done, _ = probe(tmp_path, *BASE, "--mode", "p2p")
    assert done.returncode == 2, done.stdout
    assert "nothing was tested" in done.stderr
    assert "no peer-to-peer copies between CPU stand-ins" in done.stderr
    assert "PASS" not in done.stdout
    (saved,) = (tmp_path / "reports").glob("probe-*.json")
    assert json.loads(saved.read_text())["verdict"] == "skipped"


def test_gpu_indices_outside_the_input_topology_are_exit_2(tmp_path):
    done, _ = probe(tmp_path, "--device", "cpu", "--gpus", "0,5", "--input", "sample:quad-nv4-pairs-2socket")
    assert done.returncode == 2
    assert "no GPU5 on sample:quad-nv4-pairs-2socket" in done.stderr and "0-3" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["-b", "lots"], "expected a size such as 8, 1K, 256M"),
        (["-b", "1M", "-e", "1K"], "is below --min-bytes"),
        (["-b", "2"], "below one float32 element"),
        (["-f", "1"], "--step-factor 1: must be at least 2"),
        (["-n", "0"], "--iters 0: must be at least 1"),
    ],
)
def test_bad_sweep_options_are_exit_2(tmp_path, args, text):
    from gputopo.cli import app

    result = CliRunner().invoke(
        app, ["probe", *BASE, "--mode", "allreduce", *args, "--report-dir", str(tmp_path)]
    )
    assert result.exit_code == 2 and text in result.output, result.output


@pytest.mark.slow
def test_nccl_tests_options_and_summary_lines_environment_and_numerics_on_record(tmp_path):
    env_extra = {"NCCL_P2P_DISABLE": "1", "CUDA_LAUNCH_BLOCKING": "0"}
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{TEST_MARKER: marker}, COLUMNS="200", NO_COLOR="1", **env_extra)
    cmd = [sys.executable, "-m", "gputopo", "probe", *BASE, "--mode", "allreduce", "-b", "8", "-e", "1K"]
    cmd += ["-f", "4", "-n", "3", "--report-dir", str(tmp_path / "reports")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert_nothing_left(marker)
    assert done.returncode == 0, done.stderr
    data = [line.split() for line in done.stdout.splitlines() if line.startswith("  ") and "float" in line]
    assert [int(row[0]) for row in data] == [8, 32, 128, 512]
    assert "1 warm-up + 3 timed iterations" in done.stdout  # CPU stand-ins: one warm-up (never judged)
    assert "# Out of bounds values : 0 OK" in done.stdout
    avg = next(line for line in done.stdout.splitlines() if line.startswith("# Avg bus bandwidth    : "))
    float(avg.split(":")[1])  # a number, as nccl-tests prints it
    (saved,) = (tmp_path / "reports").glob("probe-*.json")
    doc = json.loads(saved.read_text())
    env_doc = doc["environment"]
    # Every rank's NCCL_*/CUDA_* variables are on record; on gloo they take nothing out of the test.
    assert set(env_doc["rank_variables"]) == {"0", "1"}
    for rank in ("0", "1"):
        assert env_doc["rank_variables"][rank]["NCCL_P2P_DISABLE"] == "1"
        assert env_doc["rank_variables"][rank]["CUDA_VISIBLE_DEVICES"] == ""
    assert doc["caveats"] == []
    numerics = env_doc["numerics"]
    assert env_doc["numerics_same_in_every_rank"] is True
    assert numerics["deterministic_algorithms"] and numerics["cudnn_deterministic"]
    assert numerics["cudnn_benchmark"] is False
    assert numerics["tf32"]["api"] in ("fp32_precision", "allow_tf32")
    md = Path(doc["report"]["markdown"]).read_text()
    assert "numerics: deterministic algorithms True" in md and "| NCCL_P2P_DISABLE | 1 | 1 |" in md
    html = Path(doc["report"]["html"]).read_text()
    assert "All-reduce bandwidth" in html and html.count("<img ") == 1
    assert "NCCL_P2P_DISABLE" in html

    # `gputopo report` re-renders the probe's own report, in the terminal and as HTML.
    again = CliRunner().invoke(
        __import__("gputopo.cli", fromlist=["app"]).app,
        ["report", str(saved), "--html", str(tmp_path / "again.html")],
        env={"COLUMNS": "200", "NO_COLOR": "1"},
    )
    assert again.exit_code == 0, again.output
    assert "# Avg bus bandwidth" in again.output and "gputopo probe: PASS" in again.output
    assert (tmp_path / "again.html").read_text() == html
