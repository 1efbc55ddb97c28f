"""scripts/gpu_acceptance.py: the document it assembles from canned step outputs, the matmul share, the
file name, the budget, a timed-out step, no GPU (exit 3), the package and wheel logic, the whole run wired
to a stand-in nvidia-smi and Python (no GPU here: the JSON after every step, the archive, nothing left
outside --out-dir, SIGTERM), and, marked slow, the whole run rehearsed on CPU in a bare venv that has only
torch."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
import time
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
# CUDA numbered the two GPUs the other way round: the share must follow the bus id, not the ordinal. The
# share divides the probe's median by the bare loop's median, never by its best repetition (tflops).
BARE = {
    "gpus": [
        {"cuda_index": 0, "pci_bus_id": "0000:2a:00.0", "tflops": 850.0, "median_tflops": 800.0},
        {"cuda_index": 1, "pci_bus_id": "0000:18:00.0", "tflops": 760.0, "median_tflops": 700.0},
    ]
}
SUSTAINED = {
    "mode": "sustain",
    "gpus": [
        {"pci_bus_id": "0000:2a:00.0", "median_tflops": 780.0, "drop": 0.02},
        {"pci_bus_id": "0000:18:00.0", "median_tflops": 560.0, "drop": 0.25},
    ],
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
        _step("sustained-matmul", json.dumps(SUSTAINED)),
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
    assert shares[0]["sustained_tflops"] == 560.0 and shares[0]["sustained_drop"] == 0.25
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
    (written,) = out.glob("*.json")
    steps = json.loads(written.read_text())["steps"]
    ran = [s for s in steps if not s.get("skipped")]
    assert len(ran) == 8 and all(s["timed_out"] for s in ran)
    assert "budget was spent" in steps[-1]["stderr_tail"]
    sustained = next(s for s in steps if s["name"] == "sustained-matmul")
    assert "budget left" in sustained["skipped"]


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

# A stand-in for the Python that has torch: answers each step as a GPU machine would (the package list
# in range, gputopo importable), but p2p fails and allreduce hangs past its timeout. The per-GPU probe
# reads the acceptance JSON as it stands while the probe runs (it must already hold every earlier step)
# and writes a report into --report-dir (it must land in the archive).
FAKE_PYTHON = f"""\
    #!{sys.executable}
    import glob, json, os, sys, time
    a = sys.argv[1:]
    if a[0] == "-c" and "is_available" in a[1] and "metadata" not in a[1]:
        sys.exit(0)
    if a[0] == "-c" and "metadata" in a[1]:
        names = json.loads(a[2])
        good = {{"nvidia-ml-py": "13.0", "psutil": "7.0", "typer": "0.28.0", "rich": "14.0"}}
        out = {{"python": [3, 12, 3], "versions": {{n: good.get(n, "1.0") for n in names}}}}
        if "--import" in a:
            out["gputopo"] = {{"version": "0", "file": os.environ["PYTHONPATH"].split(os.pathsep)[0]}}
        print(json.dumps(out))
    elif a[0].endswith("bare_matmul.py"):
        print(json.dumps({json.dumps(SUSTAINED)} if "--sustain" in a else {json.dumps(BARE)}))
    elif "probe" in a and "gpu" in a:
        reports = a[a.index("--report-dir") + 1]
        open(os.path.join(reports, "probe-x.json"), "w").write("{{}}")
        up = reports
        while not glob.glob(os.path.join(up, "gpu-acceptance-*.json")):
            up = os.path.dirname(up)
        (mine,) = glob.glob(os.path.join(up, "gpu-acceptance-*.json"))
        doc = json.load(open(mine))
        shallow = sorted(os.path.relpath(os.path.join(d, f), up) for d, _, fs in os.walk(up) for f in fs
                         if os.path.relpath(d, up).count(os.sep) < 2)
        print(json.dumps({{**{json.dumps(PROBE)}, "seen": [s["name"] for s in doc["steps"]],
                          "finished": doc["finished"], "tmp": os.environ["TMPDIR"], "shallow": shallow}}))
    elif "p2p" in a:
        print("p2p broke", file=sys.stderr); sys.exit(1)
    elif "allreduce" in a and os.environ.get("FAKE_HANG"):
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
            "20",
        ],
        capture_output=True,
        text=True,
        env={**_env(tmp_path), "FAKE_HANG": "1"},
        timeout=120,
    )
    assert run.returncode == 1, run.stderr  # p2p failed, allreduce timed out: recorded, file written
    written, archive = sorted(out.iterdir())  # two files, no work folder left behind
    assert written.name.startswith("gpu-acceptance-h100-80gb-hbm3-") and written.suffix == ".json"
    assert archive.name == written.name.removesuffix(".json") + ".tar.gz"
    doc = json.loads(written.read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == [
        "nvidia-smi",
        "wheels",
        "import",
        "check",
        "topo",
        "bare-matmul",
        "sustained-matmul",
        "probe-gpu",
        "probe-p2p",
        "probe-allreduce",
    ]
    # Written after every step: while the probe ran, the file already held each step before it.
    seen = steps["probe-gpu"]["output"]
    assert seen["seen"] == list(steps)[:7] and seen["finished"] is False and doc["finished"] is True
    assert seen["tmp"].startswith(str(out))  # the steps' temporary files stay under --out-dir
    # Mid-run, nothing but the two kept files lies within two folders of --out-dir (the rest is deeper).
    assert seen["shallow"] == sorted([written.name, archive.name])
    assert steps["wheels"]["skipped"].startswith("nothing to install")
    assert doc["environment"]["gputopo"]["file"] == str(ga.SRC)  # gputopo from the tree, first
    assert "budget left" in steps["sustained-matmul"]["skipped"]  # 20 s leave no sustained run
    with tarfile.open(archive) as tar:
        members = set(tar.getnames())
    assert {"reports/probe-x.json", "logs/probe-p2p.log", "logs/check.log"} <= members
    assert set(doc["archive_members"]) == members
    assert steps["check"]["output"] == {"step": "check"} and steps["check"]["command"][-2:] == [
        "check",
        "--json",
    ]
    assert steps["probe-p2p"]["rc"] == 1 and "p2p broke" in steps["probe-p2p"]["stderr_tail"]
    assert steps["probe-allreduce"]["timed_out"] and steps["probe-allreduce"]["timeout_s"] <= 20
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
    want = {"dtype": "bfloat16", "n": 8192, "matmuls_per_rep": 16, "mode": "each", "gpus": []}
    assert json.loads(done.stdout) == want


def test_the_sustained_run_is_as_long_as_asked_and_bounded_by_the_budget(tmp_path):
    _executable(tmp_path / "nvidia-smi", FAKE_SMI)
    _executable(tmp_path / "python", FAKE_PYTHON)
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--out-dir", str(out), "--python", str(tmp_path / "python")]
    run = subprocess.run(
        [*command, "--budget", "400", "--sustain-s", "10"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=120,
    )
    assert run.returncode == 1, run.stderr  # the fake p2p fails
    (written,) = out.glob("*.json")
    doc = json.loads(written.read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert steps["sustained-matmul"]["command"][-2:] == ["--sustain", "10"]
    assert steps["sustained-matmul"]["rc"] == 0
    rows = doc["matmul_share"]["gpus"]
    assert [r["sustained_drop"] for r in rows] == [0.25, 0.02]  # GPU0 is bus 18
    assert "sustained 560 (drop 25%)" in run.stdout


def test_sustain_seconds_leave_the_later_steps_their_time():
    assert ga.sustain_seconds(90, left=400, reserve=120) == 90
    assert ga.sustain_seconds(90, left=200, reserve=120) == 50
    assert ga.sustain_seconds(90, left=150, reserve=120) == 0.0  # under 10 s: not run at all
    assert ga.sustain_seconds(4, left=40, reserve=0, least=1) == 4


def test_requirements_follow_the_markers_of_the_python_they_run_on():
    text = (ga.ROOT / "pyproject.toml").read_text()
    on_312 = dict(ga.requirements(text, (3, 12)))
    assert on_312["typer"] == ">=0.28,<0.29" and "tomli" not in on_312 and "psutil" in on_312
    assert "tomli" in dict(ga.requirements(text, (3, 10)))


def test_versions_compare_by_release():
    assert ga.satisfies("0.28.1", ">=0.28,<0.29") and not ga.satisfies("0.29.0", ">=0.28,<0.29")
    assert ga.satisfies("2.11.0+cu130", ">=2.11") and not ga.satisfies("13.7.1", ">=13.8,<16")
    assert ga.satisfies("12.535.77", ">=12.535.77") and not ga.satisfies(None, ">=0")
    assert ga.satisfies("1.4.2", "~=1.4") and not ga.satisfies("2.0", "~=1.4")
    assert ga.wheel_dist("typing_extensions-4.12.2-py3-none-any.whl") == ("typing-extensions", "4.12.2")
    assert ga.wheel_dist("notes.txt") is None


NEEDS = [("typer", ">=0.28,<0.29"), ("rich", ">=13.8,<16"), ("psutil", ">=5.9.4"), ("torchvision", "")]
CARRIED = [
    "/w/typer-0.28.0-py3-none-any.whl",
    "/w/rich-15.0.0-py3-none-any.whl",
    "/w/psutil-7.2.2-cp36-abi3-manylinux_2_28_x86_64.whl",
    "/w/shellingham-1.5.4-py2.py3-none-any.whl",
    "/w/typing_extensions-4.16.0-py3-none-any.whl",
]


def test_carried_wheels_go_in_only_where_the_machine_lacks_a_package_or_its_range():
    machine = {
        "typer": "0.29.1",  # out of range: the carried 0.28 goes in
        "rich": "14.0.0",  # in range: the machine's stays
        "psutil": None,  # missing: the carried one goes in
        "shellingham": None,  # typer's need, missing: goes in
        "typing-extensions": "4.9.0",  # torch's, there: never replaced
        "torchvision": "0.26.0",
    }
    chosen, unmet = ga.plan_wheels(NEEDS, machine, CARRIED)
    assert [c.rsplit("/", 1)[1].split("-")[0] for c in chosen] == ["psutil", "shellingham", "typer"]
    assert unmet == []


def test_a_need_no_carried_wheel_meets_is_named():
    machine = {"typer": "0.29.1", "rich": "13.0", "psutil": "6.0", "torchvision": None}
    chosen, unmet = ga.plan_wheels(NEEDS, machine, ["/w/typer-0.29.0-py3-none-any.whl"])
    assert chosen == []
    assert [(u["package"], u["found"]) for u in unmet] == [
        ("typer", "0.29.1"),
        ("rich", "13.0"),
        ("torchvision", None),
    ]


def test_sigterm_keeps_the_record_so_far_and_removes_the_work_folder(tmp_path):
    _executable(tmp_path / "nvidia-smi", FAKE_SMI)
    _executable(tmp_path / "python", FAKE_PYTHON)
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--out-dir", str(out), "--python", str(tmp_path / "python")]
    proc = subprocess.Popen(
        [*command, "--budget", "400", "--sustain-s", "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_env(tmp_path), "FAKE_HANG": "1"},
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # until the hanging all-reduce step has started
            found = list(out.glob("*.json"))
            if found and "probe-p2p" in found[0].read_text():
                break
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    (written,) = out.glob("*.json")
    doc = json.loads(written.read_text())
    assert doc["finished"] is False and doc["passed"] is False
    assert [p.name for p in out.iterdir() if p.is_dir()] == []  # the work folder is gone


def test_the_bare_matmul_script_sustains_a_load_on_a_cpu_stand_in():
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, str(ga.BARE_MATMUL), "--device", "cpu", "--sustain", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["mode"] == "sustain" and doc["seconds"] == 2.0 and doc["dtype"] == "float32"
    (gpu,) = doc["gpus"]
    assert gpu["name"] == "CPU stand-in" and len(gpu["windows_tflops"]) == 2
    assert gpu["first_window_tflops"] > 0 and isinstance(gpu["drop"], float)
    assert sum(1 for _ in range(gpu["reps"])) >= 2


BARE_VENV_ENV = "GPUTOPO_BARE_VENV"


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A venv with only torch in it (``python3 -m venv``, ``pip install torch``), or the one named by
    GPUTOPO_BARE_VENV; skipped where pip cannot install torch."""
    named = os.environ.get(BARE_VENV_ENV)
    if named:
        return Path(named) / "bin" / "python"
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "torch"], capture_output=True, text=True, timeout=1500
    )
    if pip.returncode != 0:
        pytest.skip(f"pip could not install torch into a bare venv: {pip.stderr[-300:]}")
    return python


@pytest.mark.slow
def test_the_exact_command_rehearsed_in_a_bare_venv_with_only_torch(tmp_path, bare_python):
    """The command docs/development.md gives for a bare GPU machine, on CPU: from a copy of the working
    tree (as the machine gets it), with a Python that has torch and nothing of gputopo's, the missing
    packages carried as wheels. It runs every step, writes its JSON under --out-dir and leaves nothing
    outside it (the tree copy, HOME and TMPDIR stay as they were)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    tree = tmp_path / "tree"
    for name in listed.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    wheels = tree / ".whl"
    have = subprocess.run(
        [str(bare_python), "-c", "import torch, sys; print(torch.__version__.split('+')[0])"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert have.returncode == 0, have.stderr
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    pyver = subprocess.run(
        [str(bare_python), "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    # What the GPU machine has and the bare venv lacks: torchvision (for the probe) and numpy.
    fetch = subprocess.run(
        [
            sys.executable,
            str(tree / "scripts" / "gpu_acceptance.py"),
            "--download-wheels",
            str(wheels),
            "--wheels-python",
            pyver or version,
            "--also",
            "numpy",
            "--also",
            f"torchvision==0.{int(have.stdout.split('.')[1]) + 15}.*",  # torch 2.N: torchvision 0.N+15
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if fetch.returncode != 0:
        pytest.skip(f"pip could not download the wheels here: {fetch.stderr[-300:]}")
    before = {p.relative_to(tree) for p in tree.rglob("*")}
    home, tmp, out = tmp_path / "home", tmp_path / "tmp", tmp_path / "out"
    home.mkdir()
    tmp.mkdir()
    run = subprocess.run(
        [str(tree / "scripts" / "gpu-acceptance"), "--out-dir", str(out), "--device", "cpu"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=900,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmp), "PYTHON": str(bare_python)},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    written, archive = sorted(out.iterdir())
    doc = json.loads(written.read_text())
    assert doc["device"] == "cpu" and doc["passed"] and doc["finished"]
    assert doc["environment"]["gputopo"]["file"] == str(tree / "src" / "gputopo" / "__init__.py")
    installed = {w.split("-")[0] for w in doc["environment"]["installed"]}
    assert {"typer", "rich", "psutil", "nvidia_ml_py", "torchvision", "numpy"} <= installed
    steps = {s["name"]: s for s in doc["steps"]}
    assert steps["probe-gpu"]["rc"] == 0 and steps["probe-gpu"]["output"]["per_gpu"]["simulated"]
    assert steps["sustained-matmul"]["rc"] == 0 and steps["probe-allreduce"]["rc"] == 0
    assert steps["check"]["not_applicable"] and steps["probe-p2p"]["not_applicable"]
    assert any(m.startswith("reports/probe-") for m in doc["archive_members"])
    assert {p.relative_to(tree) for p in tree.rglob("*")} == before  # no bytecode, nothing in the tree
    assert list(home.iterdir()) == [] and list(tmp.iterdir()) == []


def _bench():
    path = ROOT / "benchmarks" / "bench_probe_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_probe_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_times_out_a_hung_command_and_pairs_through_the_acceptance_script():
    bench = _bench()
    with pytest.raises(SystemExit, match="timed out after 0.5 s"):
        bench._run([sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ), 0.5)
    assert bench._acceptance().matmul_shares is not None  # the pairing by bus id it uses
