"""From a chosen set to a launch: the line (pure), recommend --launch, `gputopo run` with real children."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import invoke
from gputopo.findings import nccl_env_findings
from gputopo.launch.line import LaunchTools, build_launch, is_torchrun, nearest_nics
from gputopo.model import Gpu, Matrix, Nic, Topology
from gputopo.system.launcher import detect_tools, has_numa_binding
from gputopo.system.machine import load_topology

DGX_A100 = "topo/41_dgx-a100-12nic-mlx5-names-as-columns-tabs.txt"
READY = LaunchTools(torchrun=("torchrun",), torch_version="2.9.0", numa_binding=True, numactl=True)


@pytest.fixture
def dgx_a100(shared_fixtures: Path) -> Topology:
    """A DGX A100 `topo -m` paste: 8 compute NICs in PXB pairs beside GPU pairs, 4 storage NICs far away."""
    return load_topology(str(shared_fixtures / DGX_A100))


def test_two_nodes_name_the_nics_beside_the_gpus_exactly_and_leave_storage_nics_out(dgx_a100):
    plan = build_launch(dgx_a100, (0, 1), ["train.py"], torchrun=True, nnodes=2, tools=READY)
    assert plan.env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    assert "NCCL_IB_HCA==mlx5_0,mlx5_1 " in plan.command
    for storage in ("mlx5_4", "mlx5_5", "mlx5_10", "mlx5_11"):
        assert storage not in plan.env["NCCL_IB_HCA"]
    assert plan.argv[:5] == ("torchrun", "--nproc-per-node", "2", "--nnodes", "2")


def test_gpus_on_two_switches_get_both_pairs_of_nics(dgx_a100):
    names, notes = nearest_nics(dgx_a100, (0, 2))
    assert names == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert notes == []


def test_one_node_sets_no_nic_list(dgx_a100):
    plan = build_launch(dgx_a100, (0, 1), ["train.py"], torchrun=True, nnodes=1, tools=READY)
    assert "NCCL_IB_HCA" not in plan.env
    assert plan.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}


def test_numa_binding_only_when_torch_numactl_and_affinity_are_all_there(dgx_a100):
    plan = build_launch(dgx_a100, (4, 5), ["train.py"], torchrun=True, tools=READY)
    assert plan.argv == ("torchrun", "--nproc-per-node", "2", "--numa-binding", "node", "train.py")
    assert plan.notes == ()
    old = LaunchTools(torch_version="2.8.0", numa_binding=False, numactl=False)
    plan = build_launch(dgx_a100, (4, 5), ["train.py"], torchrun=True, tools=old)
    assert "--numa-binding" not in plan.argv
    (note,) = plan.notes
    assert "torch 2.8.0 has no torchrun --numa-binding (added in 2.9)" in note
    assert "numactl is not installed" in note


def _box(affinity: str | None, nics: tuple[Nic, ...] = (), nic_codes: tuple[str, ...] = ()) -> Topology:
    labels = ("GPU0", "GPU1", *(n.label for n in nics))
    cells = [["X", "PIX", *nic_codes], ["PIX", "X", *nic_codes]]
    for i, _ in enumerate(nics):
        cells.append([nic_codes[i], nic_codes[i], *("X" if j == i else "PIX" for j in range(len(nics)))])
    gpus = (Gpu(0, cpu_affinity=affinity, uuid="GPU-a"), Gpu(1, cpu_affinity=affinity, uuid="GPU-b"))
    return Topology("test", gpus, nics, Matrix(labels, tuple(tuple(r) for r in cells)))


def test_a_gpu_without_cpu_affinity_says_so_and_gets_no_binding():
    plan = build_launch(_box("N/A"), (0, 1), ["x"], torchrun=True, tools=READY)
    assert "--numa-binding" not in plan.argv
    assert plan.notes == ("no --numa-binding: GPU0, GPU1 have no CPU affinity",)


def test_uuids_where_known_and_nics_without_names_are_not_guessed():
    box = _box("0-7", (Nic("NIC0"),), ("PIX",))
    plan = build_launch(box, (0, 1), ["x"], torchrun=False, nnodes=2, prefer_uuid=True)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert "NCCL_IB_HCA" not in plan.env
    assert any("NIC0 have no device name" in n for n in plan.notes)
    assert plan.argv == ("x",)


def test_a_command_that_already_is_torchrun_is_not_wrapped_twice():
    assert is_torchrun(["torchrun", "--nproc-per-node", "2", "t.py"])
    assert is_torchrun(["python", "-m", "torch.distributed.run", "t.py"])
    assert not is_torchrun(["python", "train.py"])


def test_nccl_debug_variables_become_notes_of_the_launch(dgx_a100):
    findings = nccl_env_findings({"NCCL_P2P_DISABLE": "1"})
    plan = build_launch(dgx_a100, (0, 1), ["t.py"], torchrun=False, env_findings=findings)
    assert any("NCCL_P2P_DISABLE" in n or "direct GPU-to-GPU" in n for n in plan.notes)


def test_torchrun_numa_binding_is_read_from_torch_source_text(tmp_path):
    new = tmp_path / "new.py"
    new.write_text('parser.add_argument(\n    "--numa-binding",\n    "--numa_binding",\n)\n')
    old = tmp_path / "old.py"
    old.write_text('parser.add_argument("--nproc-per-node")\n')
    assert has_numa_binding(new)
    assert not has_numa_binding(old)
    assert not has_numa_binding(tmp_path / "missing.py")


def test_installed_torch_is_detected_without_importing_it():
    import importlib.metadata

    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch not installed")
    tools = detect_tools()
    assert tools.torch_version == version
    major, minor = (int(x) for x in version.split(".")[:2])
    assert tools.numa_binding == ((major, minor) >= (2, 9))


# --- the CLI ------------------------------------------------------------------------------------------------


def test_recommend_launch_on_dgx_a100_prints_the_exact_nic_list(shared_fixtures):
    path = str(shared_fixtures / DGX_A100)
    result = invoke("recommend", "--n", "2", "--launch", "train.py", "--nnodes", "2", "--input", path)
    assert result.exit_code == 0, result.output
    assert "NCCL_IB_HCA==mlx5_0,mlx5_1 " in result.stdout
    assert "mlx5_4" not in result.stdout.split("NCCL_IB_HCA=")[1]
    doc = json.loads(
        invoke(
            "recommend", "--n", "2", "--launch", "train.py", "--nnodes", "2", "--input", path, "--json"
        ).stdout
    )
    assert doc["launch"]["env"]["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    assert set(doc["launch"]) >= {"command", "env", "notes"}
    assert doc["launch"]["command"].endswith("train.py")


def test_recommend_nnodes_without_launch_is_a_usage_error():
    result = invoke("recommend", "--n", "2", "--nnodes", "2", "--input", "sample:seed-8gpu-nv4")
    assert result.exit_code == 2
    assert "--nnodes goes with --launch" in result.stderr


def _gputopo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # The test's own environment must not leak a device list or NCCL settings into what is checked.
    clean = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES" and not k.startswith("NCCL_")}
    full_env = {**clean, **(env or {})}
    src = str(Path(__file__).resolve().parents[1] / "src")
    full_env["PYTHONPATH"] = src + os.pathsep + full_env.get("PYTHONPATH", "")
    # In a folder of its own: `gputopo run` leaves its run folder (the run record) under ./reports.
    with tempfile.TemporaryDirectory(prefix="gputopo-run-test-") as here:
        return subprocess.run(
            [sys.executable, "-m", "gputopo", *args],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=120,
            cwd=here,
        )


CHILD = (
    "import os, sys; "
    "print(os.environ['CUDA_DEVICE_ORDER'], os.environ['CUDA_VISIBLE_DEVICES'], os.environ.get('KEEP')); "
    "sys.exit(int(sys.argv[1]))"
)


def _run_child(
    *options: str, code: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``gputopo run --n 2 OPTIONS --input <seed sample> -- python -c CHILD CODE``."""
    return _gputopo(
        "run", "--n", "2", *options, "--input", "sample:seed-8gpu-nv4", "--", sys.executable, "-c", CHILD,
        str(code), env=env,
    )  # fmt: skip


@pytest.mark.parametrize("code", [0, 7])
def test_run_execs_the_command_on_the_chosen_set_and_returns_its_exit_code(code):
    done = _run_child(code=code, env={"KEEP": "kept"})
    assert done.returncode == code, done.stderr
    assert done.stdout.split() == ["PCI_BUS_ID", "0,1", "kept"]
    assert "GPUs 0,1" in done.stderr
    assert "CUDA_VISIBLE_DEVICES=" not in done.stderr.split("GPUs 0,1")[0]  # nothing inherited to warn about


def test_run_says_when_it_replaces_an_inherited_device_list():
    done = _run_child(env={"CUDA_VISIBLE_DEVICES": "4,5"})
    assert done.returncode == 0
    assert done.stdout.split()[1] == "0,1"
    assert "CUDA_VISIBLE_DEVICES=4,5 was set" in done.stderr


def test_run_honours_exclude_like_recommend():
    done = _run_child("--exclude", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[1] == "2,3"


def test_run_dry_run_prints_the_torchrun_line_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    result = invoke(
        "run",
        "--n",
        "2",
        "--torchrun",
        "--dry-run",
        "--input",
        "sample:seed-8gpu-nv4",
        "--",
        "touch",
        str(marker),
    )
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert line.startswith("CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1 ")
    assert "--nproc-per-node 2" in line and line.endswith(f"touch {marker}")
    assert not marker.exists()


def test_run_with_an_unknown_command_is_one_line_and_exit_2():
    done = _gputopo("run", "--n", "2", "--input", "sample:seed-8gpu-nv4", "--", "no-such-program-gputopo")
    assert done.returncode == 2
    assert "command not found: no-such-program-gputopo" in done.stderr
    assert "Traceback" not in done.stderr


def test_run_without_a_command_is_a_usage_error():
    result = invoke("run", "--n", "2", "--input", "sample:seed-8gpu-nv4")
    assert result.exit_code == 2
    assert "no command given" in result.stderr


def test_run_warns_about_nccl_debug_variables_but_still_runs():
    done = _run_child(env={"NCCL_P2P_DISABLE": "1"})
    assert done.returncode == 0
    assert "NCCL_P2P_DISABLE" in done.stderr


def test_torchrun_runs_a_program_with_no_python_and_a_script_as_python(dgx_a100):
    program = build_launch(dgx_a100, (0, 1), ["python", "-m", "pkg.train"], torchrun=True, tools=READY)
    assert program.argv[-4:] == ("--no-python", "python", "-m", "pkg.train")
    script = build_launch(dgx_a100, (0, 1), ["train.py", "--lr", "1"], torchrun=True, tools=READY)
    assert "--no-python" not in script.argv


def test_the_torchrun_line_parses_with_the_installed_torchs_own_parser(dgx_a100):
    run = pytest.importorskip("torch.distributed.run")
    tools = LaunchTools(torchrun=("torchrun",), numa_binding=detect_tools().numa_binding, numactl=True)
    plan = build_launch(dgx_a100, (0, 1), ["python", "t.py"], torchrun=True, nnodes=2, tools=tools)
    args = run.get_args_parser().parse_args(list(plan.argv[1:]))
    assert (args.nproc_per_node, args.nnodes, args.no_python) == ("2", "2", True)
    assert args.training_script == "python" and args.training_script_args == ["t.py"]
    if tools.numa_binding:
        assert args.numa_binding == "node"


def test_run_under_real_torchrun_gives_the_rank_the_chosen_gpu():
    pytest.importorskip("torch")
    child = "import os; print(os.environ['LOCAL_RANK'], os.environ['CUDA_VISIBLE_DEVICES'])"
    done = _gputopo(
        "run", "--n", "1", "--torchrun", "--exclude", "0", "--input", "sample:seed-8gpu-nv4",
        "--", sys.executable, "-c", child,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "1"]
