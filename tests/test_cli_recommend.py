"""`gputopo recommend` from the user's side: golden output, the export line, JSON, reports, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import check_golden, invoke, plain_env
from gputopo.topology import samples, snapshot

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "topo"
PLAIN_ENV = plain_env(100)
SEED = "sample:seed-8gpu-nv4"


def run(*args: str, env: dict[str, str] | None = None):
    """``gputopo recommend ARGS`` in-process, colour off, 100 columns."""
    return invoke("recommend", *args, columns=100, env=env)


def test_seed_box_golden_output():
    """The box with NV4 pairs, and a user who wants to train on 2 of its 8 GPUs."""
    result = run("--n", "2", "--input", SEED)
    assert result.exit_code == 0, result.output
    check_golden("recommend_seed-8gpu-nv4_n2.txt", result.stdout)


def test_four_side_by_side_golden_output():
    """Four 2-GPU experiments side by side: the four NV4 pairs, one export line each."""
    result = run("--n", "2", "--sets", "4", "--input", SEED, "--top", "1")
    assert result.exit_code == 0, result.output
    check_golden("recommend_seed-8gpu-nv4_n2_sets4.txt", result.stdout)


def test_export_line_is_exact_and_last():
    result = run("--n", "2", "--input", SEED, "--exclude", "0,1,2,3,4,5")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=6,7"


def test_export_line_is_never_wrapped(tmp_path):
    """16 UUIDs do not fit in 100 columns; the line must still paste as one."""
    topo = samples.load("dgx2-v100-16gpu")
    gpus = tuple(replace(g, uuid=f"GPU-{i:08x}-1111-2222-3333-444455556666") for i, g in enumerate(topo.gpus))
    path = tmp_path / "dgx2.json"
    path.write_text(snapshot.dumps(replace(topo, gpus=gpus)))
    result = run("--n", "16", "--input", str(path), "--format", "uuid")
    assert result.exit_code == 0, result.output
    last = result.stdout.splitlines()[-1]
    assert last.startswith("export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=GPU-00000000-")
    assert last.count("GPU-") == 16


def test_json_is_one_document(tmp_path):
    result = run("--n", "4", "--input", SEED, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "gputopo/recommendation/v1" and doc["n"] == 4
    assert doc["best"]["gpus"] == [0, 1, 2, 3] and doc["best"]["bottleneck"] == "NODE"
    assert doc["env"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert {"candidates", "excluded", "assumptions"} <= set(doc)


def test_busy_gpus_from_a_snapshot_are_excluded_with_reasons(tmp_path):
    topo = samples.load("seed-8gpu-nv4")
    gpus = list(topo.gpus)
    gpus[6] = replace(gpus[6], compute_pids=(31337,), memory_used_mib=30000)
    path = tmp_path / "busy.json"
    path.write_text(snapshot.dumps(replace(topo, gpus=tuple(gpus), live=True)))
    result = run("--n", "2", "--input", str(path), "--json")
    doc = json.loads(result.stdout)
    assert (
        doc["excluded"][0]["gpu"] == 6 and "busy: 1 compute process (pid 31337)" in doc["excluded"][0]["why"]
    )
    human = run("--n", "7", "--input", str(path))
    assert human.exit_code == 0
    assert "excluded: GPU6: busy: 1 compute process (pid 31337)" in human.stdout
    allowed = run("--n", "8", "--input", str(path), "--allow-busy", "--json")
    assert json.loads(allowed.stdout)["excluded"] == []


def test_probe_report_keeps_the_failing_pair_apart(tmp_path):
    """The canonical case: DP on GPUs 5,6 went to NaN. Never recommend them together again."""
    report = {
        "schema": "gputopo/probe/v1",
        "device": "cuda",
        "verdict": "fail",
        "sets": [
            {"gpus": [5, 6], "verdict": "fail", "checks": [{"name": "dp", "verdict": "fail", "kind": "nan"}]},
            {
                "gpus": [6, 7],
                "verdict": "pass",
                "checks": [{"name": "allreduce", "verdict": "pass", "metrics": {"peak_busbw_gbps": 44.5}}],
            },
        ],
    }
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(report))
    result = run("--n", "2", "--input", SEED, "--from-report", str(path), "--sets", "3", "--exclude", "0,1")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())  # long paths wrap at 100 columns
    assert f"kept apart: GPU5 + GPU6: dp check failed (nan) in {path}" in text
    assert result.stdout.splitlines()[-2:] == [
        "# set 3: 44.5 GB/s",
        "export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=6,7",
    ]
    doc = json.loads(
        run("--n", "2", "--input", SEED, "--from-report", str(path), "--json", "--top", "8").stdout
    )
    assert [5, 6] not in [c["gpus"] for c in doc["candidates"]]
    measured = next(c for c in doc["candidates"] if c["gpus"] == [6, 7])
    assert measured["est_busbw_gbps"] == 44.5 and measured["bottleneck_measured"] is True
    assert "measured 44.5 GB/s in the probe report (model: 48.0)" in measured["reasons"][0]


def test_text_input_says_what_it_assumed():
    path = FIXTURES / "00_seed-8gpu-nv4-pairs-greek-chi.txt"
    if not path.exists():
        pytest.skip(f"fixture not available: {path}")
    result = run("--n", "2", "--input", str(path))
    assert result.exit_code == 0, result.output
    assert "assumed: NVLink 20 GB/s per link (GPU model unknown: NCCL's default)" in result.stdout
    corrected = run("--n", "2", "--input", str(path), "--nvlink-gbps", "12", "--pcie-gen", "4")
    assert "given: NVLink 12 GB/s per link (from --nvlink-gbps)" in corrected.stdout
    assert "given: PCIe Gen4 x16 = 24 GB/s (from --pcie-gen)" in corrected.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--n", "0"], "error: --n 0: a set needs at least one GPU"),
        (["--n", "9"], "error: --n 9: only 8 of 8 GPUs available"),
        (
            ["--n", "8", "--exclude", "2"],
            "error: --n 8: only 7 of 8 GPUs available (GPU2 excluded by --exclude)",
        ),
        (["--n", "3", "--sets", "3"], "error: --n 3 --sets 3 needs 9 GPUs: only 8 of 8 GPUs available"),
        (["--n", "2", "--exclude", "99"], "error: --exclude 99: there is no GPU99 on sample:seed-8gpu-nv4"),
        (["--n", "2", "--exclude", "three"], "error: --exclude three: 'three' is not a GPU index"),
        (["--n", "2", "--format", "uuid"], "error: --format uuid: GPU UUIDs are not known for this input"),
        (["--n", "2", "--pcie-gen", "9"], "error: --pcie-gen 9: not a PCIe generation"),
        (["--n", "2", "--nvlink-gbps", "0"], "error: --nvlink-gbps 0.0: must be above 0"),
        (
            ["--n", "2", "--from-report", "/nonexistent/probe.json"],
            "error: --from-report /nonexistent/probe.json",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = run(*args, "--input", SEED)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0].startswith(message), result.stderr
    assert len(lines) <= 2 and "Traceback" not in result.stderr


def test_too_many_names_the_exclusions(tmp_path):
    result = run("--n", "8", "--input", SEED, "--exclude", "3")
    assert "(GPU3 excluded by --exclude)" in result.stderr.splitlines()[0]


@pytest.mark.parametrize(
    ("content", "why"), [("{not json", "not JSON"), ('{"schema": "x"}', "not a gputopo probe")]
)
def test_bad_report_is_exit_2(tmp_path, content, why):
    path = tmp_path / "r.json"
    path.write_text(content)
    result = run("--n", "2", "--input", SEED, "--from-report", str(path))
    assert result.exit_code == 2 and why in result.stderr


def test_recommend_does_not_import_torch():
    """recommend must start fast: no torch, no pynvml with --input."""
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from gputopo.cli import app\n"
        "r = CliRunner().invoke(app, ['recommend', '--n', '2', '--input', 'sample:seed-8gpu-nv4'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in ('torch', 'pynvml') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_live_machine_through_the_fake_nvml():
    """Live: a GPU running a job is left out, a lost GPU is left out, and UUIDs can name the set."""
    fake_nvml = pytest.importorskip("fake_nvml")
    with fake_nvml.FakeNvml.nvlink_box(processes={0: [(4242, 2048)]}).installed():
        result = run("--n", "2", "--format", "uuid")
    assert result.exit_code == 0, result.output
    assert "excluded: GPU0: busy: 1 compute process (pid 4242)" in result.stdout
    last = result.stdout.splitlines()[-1]
    assert last.startswith("export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=GPU-")
    assert last.count("GPU-") == 2
    with fake_nvml.FakeNvml.lost_gpu_box().installed():
        doc = json.loads(run("--n", "2", "--json").stdout)
    assert {"gpu": 5, "why": "failing: GPU is lost"} in doc["excluded"]
    assert all(5 not in c["gpus"] for c in doc["candidates"])


def test_a_schedulers_preset_allocation_is_chosen_within():
    """Slurm gave this job GPUs 4-7 (as UUIDs): the best pair comes from them, not from 0-3."""
    fake_nvml = pytest.importorskip("fake_nvml")
    uuids = ",".join(f"GPU-a6000000-0000-0000-0000-00000000000{i}" for i in (4, 5, 6, 7))
    with fake_nvml.FakeNvml.nvlink_box().installed():
        doc = json.loads(run("--n", "2", "--json", env={"CUDA_VISIBLE_DEVICES": uuids}).stdout)
        assert all(set(c["gpus"]) <= {4, 5, 6, 7} for c in doc["candidates"]) and doc["candidates"]
        outside = {e["gpu"]: e["why"] for e in doc["excluded"]}
        assert set(outside) == {0, 1, 2, 3}
        assert outside[0].startswith(f"not in CUDA_VISIBLE_DEVICES={uuids}")
        # Only two GPUs allowed: a set of four cannot be found inside the allocation.
        two = ",".join(uuids.split(",")[:2])
        result = run("--n", "4", env={"CUDA_VISIBLE_DEVICES": two})
        assert result.exit_code != 0 and "not in CUDA_VISIBLE_DEVICES" in result.output
        # --ignore-visible-devices chooses among every GPU again.
        doc = json.loads(
            run("--n", "2", "--json", "--ignore-visible-devices", env={"CUDA_VISIBLE_DEVICES": two}).stdout
        )
        assert not doc["excluded"]


def test_run_chooses_within_the_preset_allocation(tmp_path):
    fake_nvml = pytest.importorskip("fake_nvml")
    uuids = ",".join(f"GPU-a6000000-0000-0000-0000-00000000000{i}" for i in (6, 7))
    with fake_nvml.FakeNvml.nvlink_box().installed():
        result = invoke(
            "run", "--n", "2", "--dry-run", "--json", "--", "python", "train.py",
            env={"CUDA_VISIBLE_DEVICES": uuids},
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["launch"]["gpus"] == [6, 7]
        result = invoke(
            "run", "--n", "2", "--dry-run", "--json", "--ignore-visible-devices", "--", "python", "train.py",
            env={"CUDA_VISIBLE_DEVICES": uuids},
        )  # fmt: skip
        assert json.loads(result.stdout)["launch"]["gpus"] != [6, 7]


def test_a_preset_says_nothing_about_a_topology_read_from_a_file():
    result = run("--n", "2", "--input", "sample:seed-8gpu-nv4", env={"CUDA_VISIBLE_DEVICES": "0"})
    assert result.exit_code == 0
    assert "CUDA_VISIBLE_DEVICES=0 describes this machine" in result.output
