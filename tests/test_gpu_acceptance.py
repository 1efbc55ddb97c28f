"""scripts/gpu_acceptance.py: the document it assembles from canned step outputs, the matmul share, the
file name, the budget, a timed-out step, no GPU (exit 3), and the whole run wired to a stand-in
nvidia-smi and Python (no GPU here)."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.py"
WRAPPER = ROOT / "scripts" / "gpu-acceptance"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ga = _load()
WHEN = datetime(2026, 11, 28, 23, 40, 5, tzinfo=timezone.utc)
SMI = (
    "0, NVIDIA H100 80GB HBM3, 570.86.15, GPU-aaa, 00000000:18:00.0\n"
    "1, NVIDIA H100 80GB HBM3, 570.86.15, GPU-bbb, 00000000:2A:00.0\n"
)
# CUDA numbered the two GPUs the other way round: the share must follow the bus id, not the ordinal.
BARE = {
    "gpus": [
        {"cuda_index": 0, "pci_bus_id": "0000:2a:00.0", "tflops": 800.0},
        {"cuda_index": 1, "pci_bus_id": "0000:18:00.0", "tflops": 700.0},
    ]
}
PROBE = {"per_gpu": {"gpus": [{"gpu": 0, "matmul_tflops": 630.0}, {"gpu": 1, "matmul_tflops": 760.0}]}}


def _step(name, stdout="", rc=0, **extra):
    return {
        "name": name,
        "command": ["x", name],
        "rc": rc,
        "stdout": stdout,
        "stderr": "",
        "wall_s": 1.234,
        **extra,
    }


def _steps():
    return [
        _step("nvidia-smi", SMI),
        _step("check", json.dumps({"verdict": "ok", "gpus": 2})),
        _step("topo", json.dumps({"gpus": [0, 1]})),
        _step("bare-matmul", json.dumps(BARE)),
        _step("probe-gpu", json.dumps(PROBE)),
        _step("probe-p2p", "", rc=None, timed_out=True, stderr="x" * 5000 + "last words"),
        _step("probe-allreduce", json.dumps({"verdict": "pass"})),
    ]


def test_assemble_carries_machine_steps_and_shares_matched_by_bus_id():
    doc = ga.assemble(_steps(), WHEN, 470.0, 300.0)
    assert doc["schema"] == "gputopo/gpu-acceptance/v1"
    assert doc["driver"] == "570.86.15"
    assert doc["gpu_models"] == ["NVIDIA H100 80GB HBM3"]
    assert [g["uuid"] for g in doc["gpus"]] == ["GPU-aaa", "GPU-bbb"]
    shares = {r["gpu"]: r for r in doc["matmul_share"]["gpus"]}
    assert shares[0]["share"] == pytest.approx(630 / 700, abs=1e-4)  # GPU0 is bus 18 = CUDA's 1
    assert shares[1]["share"] == pytest.approx(760 / 800, abs=1e-4)
    steps = {s["name"]: s for s in doc["steps"]}
    assert steps["check"]["output"] == {"verdict": "ok", "gpus": 2}
    assert steps["check"]["rc"] == 0 and steps["check"]["wall_s"] == 1.23
    p2p = steps["probe-p2p"]
    assert p2p["timed_out"] and p2p["output"] is None
    assert p2p["stderr_tail"].endswith("last words") and len(p2p["stderr_tail"]) == ga.STDERR_TAIL
    assert doc["passed"] is False  # a timed-out step is recorded and makes the run fail, never fatal


def test_a_clean_run_passes_and_skipped_steps_do_not_count():
    steps = [s for s in _steps() if s["name"] != "probe-p2p"]
    steps.append({"name": "probe-p2p", "command": ["x"], "skipped": "1 GPU: needs two or more"})
    doc = ga.assemble(steps, WHEN, 470.0, 10.0)
    assert doc["passed"] is True
    assert {s["name"]: s.get("skipped") for s in doc["steps"]}["probe-p2p"] == "1 GPU: needs two or more"


def test_a_gpu_without_a_figure_gets_no_share_and_says_why():
    probe = {"per_gpu": {"gpus": [{"gpu": 0, "matmul_tflops": 630.0}]}}
    rows = ga.matmul_shares(probe, {"gpus": [BARE["gpus"][0]]}, ga.parse_smi(SMI))
    assert rows[0]["share"] is None and "bare torch.matmul" in rows[0]["why"]  # bus 18 has no bare figure
    assert rows[1]["share"] is None and "per-GPU probe" in rows[1]["why"]
    assert ga.matmul_shares(None, None, ga.parse_smi(SMI))[0]["share"] is None


def test_file_name_is_the_model_and_utc_time():
    assert (
        ga.file_name(["NVIDIA H100 80GB HBM3"] * 2, WHEN)
        == "gpu-acceptance-h100-80gb-hbm3-20261128T234005Z.json"
    )
    mixed = ga.file_name(["NVIDIA A100-SXM4-40GB", "Tesla T4"], WHEN)
    assert mixed == "gpu-acceptance-a100-sxm4-40gb+tesla-t4-20261128T234005Z.json"
    assert ga.file_name([], WHEN).startswith("gpu-acceptance-unknown-")


def test_parse_smi_skips_lines_that_are_not_rows():
    assert ga.parse_smi("No devices were found\n") == []
    assert len(ga.parse_smi(SMI + "garbage\n")) == 2


def test_each_step_timeout_is_capped_by_the_budget_left():
    assert ga.step_timeout(120, started=0, now=100, budget=470) == 120
    assert ga.step_timeout(120, started=0, now=400, budget=470) == 70
    assert ga.step_timeout(120, started=0, now=480, budget=470) == 1.0


def test_steps_after_the_budget_is_spent_are_not_started_but_recorded(tmp_path):
    _executable(tmp_path / "nvidia-smi", FAKE_SMI)
    _executable(tmp_path / "python", FAKE_PYTHON)
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--out-dir", str(out), "--python", str(tmp_path / "python")]
    run = subprocess.run(
        [*command, "--budget", "1"], capture_output=True, text=True, env=_env(tmp_path), timeout=60
    )
    assert run.returncode == 1, run.stderr
    (written,) = out.iterdir()
    steps = json.loads(written.read_text())["steps"]
    assert len(steps) == 7 and all(s["timed_out"] for s in steps)
    assert "budget was spent" in steps[-1]["stderr_tail"]


def test_a_step_past_its_timeout_is_stopped_and_recorded():
    step = ga.run_step("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], 1.0)
    assert step["timed_out"] and step["rc"] != 0 and step["wall_s"] < 30


def _env(path_dir: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{path_dir}:/usr/bin:/bin"}


def test_without_a_gpu_it_exits_3_with_one_line_and_a_hint(tmp_path):
    run = subprocess.run(
        [str(WRAPPER), "--out-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**_env(tmp_path), "PYTHON": sys.executable},
        timeout=60,
    )
    assert run.returncode == 3
    lines = run.stderr.strip().splitlines()
    assert lines[0] == "gpu-acceptance: no NVIDIA GPU here: nvidia-smi is not on PATH"
    assert lines[1].startswith("hint: ") and len(lines) == 2
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def _executable(path: Path, text: str) -> None:
    path.write_text(textwrap.dedent(text))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


SMI_PRINTF = SMI.replace("\n", "\\n")
FAKE_SMI = f"""\
    #!/bin/sh
    if [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaa)"; exit 0; fi
    printf '{SMI_PRINTF}'
    """

# A stand-in for the Python that has gputopo and torch: answers each step as a GPU machine would, but
# p2p fails and allreduce hangs past its timeout.
FAKE_PYTHON = f"""\
    #!{sys.executable}
    import json, sys, time
    a = sys.argv[1:]
    if a[0] == "-c" and "is_available" in a[1]:
        sys.exit(0)
    if a[0].endswith("bare_matmul.py"):
        print(json.dumps({json.dumps(BARE)}))
    elif "probe" in a and "gpu" in a:
        print(json.dumps({json.dumps(PROBE)}))
    elif "p2p" in a:
        print("p2p broke", file=sys.stderr); sys.exit(1)
    elif "allreduce" in a:
        time.sleep(60)
    else:
        print(json.dumps({{"step": a[2]}}))
    """


def test_the_whole_run_writes_one_json_with_every_step(tmp_path):
    _executable(tmp_path / "nvidia-smi", FAKE_SMI)
    _executable(tmp_path / "python", FAKE_PYTHON)
    with_torch = subprocess.run([tmp_path / "python", "-c", "x.is_available()"], timeout=30)
    assert with_torch.returncode == 0
    out = tmp_path / "out"
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--out-dir",
            str(out),
            "--python",
            str(tmp_path / "python"),
            "--budget",
            "6",
        ],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=120,
    )
    assert run.returncode == 1, run.stderr  # p2p failed, allreduce timed out: recorded, file written
    (written,) = out.iterdir()
    assert written.name.startswith("gpu-acceptance-h100-80gb-hbm3-") and written.suffix == ".json"
    doc = json.loads(written.read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == [
        "nvidia-smi",
        "check",
        "topo",
        "bare-matmul",
        "probe-gpu",
        "probe-p2p",
        "probe-allreduce",
    ]
    assert steps["check"]["output"] == {"step": "check"} and steps["check"]["command"][-2:] == [
        "check",
        "--json",
    ]
    assert steps["probe-p2p"]["rc"] == 1 and "p2p broke" in steps["probe-p2p"]["stderr_tail"]
    assert steps["probe-allreduce"]["timed_out"] and steps["probe-allreduce"]["timeout_s"] <= 6
    assert [r["share"] for r in doc["matmul_share"]["gpus"]] == [pytest.approx(0.9, abs=1e-4), 0.95]
    assert doc["driver"] == "570.86.15" and doc["passed"] is False
    assert f"wrote {written}" in run.stdout


def test_the_bare_matmul_child_compiles_and_matches_the_probes_size():
    """One bare loop (scripts/bare_matmul.py) for the acceptance run and the benchmark, at the probe's
    size and products per repetition."""
    import ast

    text = ga.BARE_MATMUL.read_text()
    compile(text, "bare_matmul.py", "exec")
    bench = (Path(__file__).resolve().parents[1] / "benchmarks" / "bench_probe_gpu.py").read_text()
    assert '"scripts" / "bare_matmul.py"' in bench and "torch.matmul(" not in bench
    pytest.importorskip("torch")  # probe/ranks imports torch (the oldest-versions run has none)
    from gputopo.probe.ranks.pergpu import GPU_MATMULS_PER_REP, GPU_SIZES

    sizes = next(
        node.value
        for node in ast.parse(text).body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
    )
    assert ast.literal_eval(sizes)[:2] == (GPU_SIZES.matmul_n, GPU_MATMULS_PER_REP["bf16"])


def test_a_gpu_listed_but_torch_without_cuda_exits_3(tmp_path):
    _executable(tmp_path / "nvidia-smi", FAKE_SMI)
    stand_in = tmp_path / "python"  # torch answers "no CUDA", as the real one does on this machine
    _executable(stand_in, f"#!{sys.executable}\nimport sys\nsys.exit(1)\n")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--out-dir", str(tmp_path / "out"), "--python", str(stand_in)],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=60,
    )
    assert run.returncode == 3
    assert run.stderr.splitlines()[0].startswith("gpu-acceptance: torch has no CUDA here")
    assert not (tmp_path / "out").exists()


def test_the_bare_matmul_script_runs_and_without_a_gpu_names_none():
    pytest.importorskip("torch")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(ga.BARE_MATMUL), "0.1"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"dtype": "bfloat16", "n": 8192, "matmuls_per_rep": 16, "gpus": []}
