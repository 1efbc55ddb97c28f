"""`gputopo topo` from the user's side: samples, snapshots, golden output, errors, start-up cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import check_golden, invoke, plain_env
from gputopo.topology import samples, snapshot

PLAIN_ENV = plain_env()


def run(*args: str, env: dict[str, str] | None = None):
    """Invoke the CLI in-process with colour off and a fixed width."""
    return invoke(*args, env=env)


def test_seed_box_golden_output():
    """The 8-GPU box with NV4 pairs, as a new user first sees it."""
    result = run("topo", "--input", "sample:seed-8gpu-nv4")
    assert result.exit_code == 0, result.output
    check_golden("topo_seed-8gpu-nv4.txt", result.stdout)


def test_dgx1_golden_output_with_nics():
    result = run("topo", "--input", "sample:dgx1-v100")
    assert result.exit_code == 0, result.output
    check_golden("topo_dgx1-v100.txt", result.stdout)


def test_list_samples_names_every_sample():
    result = run("topo", "--list-samples", "--json")
    assert result.exit_code == 0
    names = [s["name"] for s in json.loads(result.stdout)["samples"]]
    assert names == samples.names()
    assert len(names) >= 4


@pytest.mark.parametrize("name", samples.names())
def test_sample_json_shape_and_round_trip(name, tmp_path):
    """--json has the design doc's keys; reading it back with --input gives the same document."""
    first = run("topo", "--input", f"sample:{name}", "--json")
    assert first.exit_code == 0, first.output
    doc = json.loads(first.stdout)
    assert doc["schema"] == "gputopo/topology/v1"
    for g in doc["gpus"]:
        assert {"index", "name", "pci_bus_id", "uuid", "cpu_affinity", "numa_affinity"} <= g.keys()
    assert doc["matrix"]["labels"] == [f"GPU{g['index']}" for g in doc["gpus"]] + [
        n["label"] for n in doc["nics"]
    ]
    for i, row in enumerate(doc["matrix"]["cells"]):
        assert row[i] == "X"
    saved = tmp_path / "snap.json"
    saved.write_text(first.stdout)
    second = run("topo", "--input", str(saved), "--json")
    assert second.exit_code == 0, second.output
    doc2 = json.loads(second.stdout)
    assert doc2.pop("source") == str(saved)
    doc.pop("source")
    assert doc2 == doc


@pytest.mark.parametrize("name", samples.names())
def test_snapshot_round_trip_is_exact(name):
    topo = samples.load(name)
    assert snapshot.loads(snapshot.dumps(topo), source=topo.source) == topo


@pytest.mark.parametrize("name", samples.names())
def test_samples_are_symmetric_and_square(name):
    topo = samples.load(name)
    cells = topo.matrix.cells
    n = len(topo.matrix.labels)
    assert len(cells) == n and all(len(r) == n for r in cells)
    assert all(cells[i][j] == cells[j][i] for i in range(n) for j in range(n))


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not valid JSON"),
        ('{"schema": "other/v9"}', "schema is 'other/v9'"),
        (
            '{"schema": "gputopo/topology/v1", "gpus": [{"index": 0}], "matrix": {"labels": ["GPU0"], '
            '"cells": [["X", "NV4"]]}}',
            "matrix is not 1x1",
        ),
        (
            '{"schema": "gputopo/topology/v1", "gpus": [{"index": 0}], "matrix": {"labels": ["GPU0"], '
            '"cells": [["QQ"]]}}',
            "unknown link code 'QQ'",
        ),
        ('{"schema": "gputopo/topology/v1", "gpus": "nope", "matrix": {}}', "malformed topology snapshot"),
    ],
)
def test_bad_snapshot_is_one_line_exit_2(tmp_path, content, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    result = run("topo", "--input", str(bad))
    assert result.exit_code == 2
    assert needle in result.stderr
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_missing_file_and_unknown_sample_exit_2(tmp_path):
    missing = run("topo", "--input", str(tmp_path / "nope.txt"))
    assert missing.exit_code == 2
    assert "no such file" in missing.stderr
    assert "hint:" in missing.stderr
    unknown = run("topo", "--input", "sample:nope")
    assert unknown.exit_code == 2
    assert "seed-8gpu-nv4" in unknown.stderr
    folder = run("topo", "--input", str(tmp_path))
    assert folder.exit_code == 2


def test_json_mode_prints_only_json():
    result = run("topo", "--input", "sample:hgx-h100-nvswitch", "--json")
    json.loads(result.stdout)  # the whole of stdout is one document


def test_topo_does_not_import_torch_or_pynvml_offline():
    """topo must start fast: no torch ever, and no pynvml when reading a saved machine."""
    code = (
        "import sys\n"
        "from gputopo.cli import app\n"
        "try:\n"
        "    app(['topo', '--input', 'sample:seed-8gpu-nv4'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'no-torch')\n"
        "print('PYNVML' if 'pynvml' in sys.modules else 'no-pynvml')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "no-torch" in out
    assert "no-pynvml" in out


def test_importing_gputopo_is_light():
    code = "import sys, gputopo; print(sorted(m for m in ('torch', 'pynvml', 'rich') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_python_dash_m_works():
    out = subprocess.run(
        [sys.executable, "-m", "gputopo", "topo", "--input", "sample:workstation-2gpu-nvlink"],
        capture_output=True,
        text=True,
        env={**os.environ, **PLAIN_ENV},
    )
    assert out.returncode == 0, out.stderr
    assert "NV4" in out.stdout


# --- live, through the fake NVML at the system/ seam ------------------------------------------------


def test_live_pcie_box_golden_flags_busy_link_below_max():
    """A PCIe box where GPU2 runs at Gen4 x8 while 97% busy; idle GPUs at Gen1 are not flagged."""
    from fake_nvml import FakeNvml

    with FakeNvml.pcie_box().installed():
        result = run("topo")
    assert result.exit_code == 0, result.output
    assert "BELOW MAX WHILE BUSY" in result.stdout
    assert result.stdout.count("BELOW MAX WHILE BUSY") == 1
    check_golden("topo_live_pcie_box.txt", result.stdout)


def test_live_nvlink_box_shows_nvlinks_p2p_and_round_trips(tmp_path):
    from fake_nvml import FakeNvml

    with FakeNvml.nvlink_box().installed():
        human = run("topo")
        machine = run("topo", "--json")
    assert human.exit_code == 0, human.output
    assert "NVLink per peer" in human.stdout
    assert "P2P status" in human.stdout
    doc = json.loads(machine.stdout)
    assert doc["live"] is True and doc["source"] == "nvml"
    assert doc["gpus"][0]["uuid"] and doc["gpus"][0]["pci_bus_id"]
    saved = tmp_path / "live.json"
    saved.write_text(machine.stdout)
    again = json.loads(run("topo", "--input", str(saved), "--json").stdout)
    doc.pop("source"), again.pop("source")
    assert again == doc


def test_live_lost_gpu_renders_the_others(tmp_path):
    """One GPU fell off the bus: it shows as failing, the rest render, and the snapshot keeps nulls."""
    from fake_nvml import FakeNvml

    with FakeNvml.lost_gpu_box().installed():
        human = run("topo")
        machine = run("topo", "--json")
    assert human.exit_code == 0, human.output
    assert "FAILING: GPU is lost" in human.stdout
    assert "GPU7" in human.stdout
    assert "GPU is lost" in human.stderr
    doc = json.loads(machine.stdout)
    assert doc["gpus"][5]["error"] == "GPU is lost"
    assert doc["matrix"]["cells"][4][5] is None
    saved = tmp_path / "lost.json"
    saved.write_text(machine.stdout)
    assert json.loads(run("topo", "--input", str(saved), "--json").stdout)["p2p"] == doc["p2p"]


def test_no_driver_exits_3_with_a_hint(monkeypatch):
    """No NVML and no nvidia-smi: one line, exit 3, and how to read a saved output or a sample."""
    from fake_nvml import FakeNvml

    monkeypatch.setenv("PATH", "/nonexistent")
    with FakeNvml.no_driver().installed():
        result = run("topo")
    assert result.exit_code == 3
    assert "no NVIDIA driver or NVML" in result.stderr
    assert "--input" in result.stderr and "sample:" in result.stderr
    assert "Traceback" not in result.output


def test_real_machine_without_driver_exits_3_in_a_subprocess():
    """On this machine for real (no fake): exit 3 without a driver, or 0 where a GPU exists."""
    out = subprocess.run(
        [sys.executable, "-m", "gputopo", "topo"],
        capture_output=True,
        text=True,
        env={**os.environ, **PLAIN_ENV},
    )
    assert out.returncode in (0, 3), out.stderr
    assert "Traceback" not in out.stderr
    if out.returncode == 3:
        assert out.stderr.startswith("error: no NVIDIA driver")


def test_the_program_loads_only_the_command_it_runs():
    """`gputopo topo` builds only topo's parser (start-up); `gputopo --help` still lists every command."""
    code = (
        "import sys, runpy\n"
        "sys.argv = ['gputopo', 'topo', '--input', 'sample:workstation-2gpu-nvlink']\n"
        "try:\n"
        "    runpy.run_module('gputopo', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('gputopo.cli.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "['gputopo.cli.common', 'gputopo.cli.topo']"
    listed = subprocess.run(
        [sys.executable, "-m", "gputopo", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, **PLAIN_ENV},
    ).stdout
    for name in ("doctor", "report", "probe", "recommend", "kill-stale", "topo"):
        assert f"  {name} " in listed
