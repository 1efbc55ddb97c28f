"""NCCL settings left in the environment: debugging-only variables and NCCL_IB_HCA without its '='."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import invoke
from gputopo.findings import NCCL_DEBUG_ONLY, NOTE, PROBLEM, nccl_env_findings
from gputopo.services.doctor import DoctorOptions, run_doctor
from gputopo.ui.doctor_markdown import to_markdown
from gputopo.ui.html_report import render_html


def test_a_clean_environment_has_nothing_to_say():
    assert (
        nccl_env_findings({"PATH": "/usr/bin", "NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "=mlx5_0,mlx5_1"}) == []
    )


@pytest.mark.parametrize("name", sorted(NCCL_DEBUG_ONLY))
def test_each_debugging_only_variable_is_a_problem_with_what_it_does_and_how_to_undo_it(name):
    (f,) = nccl_env_findings({name: "1"})
    assert f.severity == PROBLEM
    assert f.where == f"{name}=1"
    assert NCCL_DEBUG_ONLY[name] in f.what and "debugging" in f.what
    assert f"unset {name}" in f.remedy


def test_ib_hca_by_prefix_is_a_problem_when_the_machine_has_the_longer_names():
    nics = [f"mlx5_{i}" for i in range(12)]
    (f,) = nccl_env_findings({"NCCL_IB_HCA": "mlx5_1,mlx5_2"}, nics)
    assert f.severity == PROBLEM
    assert "mlx5_1 also matches mlx5_10, mlx5_11" in f.what
    assert "NCCL_IB_HCA==mlx5_1,mlx5_2" in f.remedy


def test_ib_hca_by_prefix_is_a_note_when_nothing_else_matches_here():
    (f,) = nccl_env_findings({"NCCL_IB_HCA": "mlx5_0:1"}, ["mlx5_0", "mlx5_1"])
    assert f.severity == NOTE
    assert "by prefix" in f.what and "NCCL_IB_HCA==mlx5_0:1" in f.remedy


def test_ib_hca_exclusion_keeps_its_caret_before_the_equals():
    (f,) = nccl_env_findings({"NCCL_IB_HCA": "^mlx5_1"}, ["mlx5_1", "mlx5_10"])
    assert "leaves out" in f.what and "NCCL_IB_HCA=^=mlx5_1" in f.remedy
    assert nccl_env_findings({"NCCL_IB_HCA": "^=mlx5_1"}, ["mlx5_1", "mlx5_10"]) == []


def test_an_equals_inside_the_list_is_called_out():
    (f,) = nccl_env_findings({"NCCL_IB_HCA": "mlx5_0,=mlx5_1"})
    assert "'=' inside the list (=mlx5_1)" in f.what


def test_doctor_json_and_reports_carry_the_nccl_findings(tmp_path: Path):
    env = {"NCCL_P2P_DISABLE": "1", "NCCL_ALGO": "Ring"}
    doc = run_doctor(DoctorOptions(skip_probe=True, report_dir=tmp_path, env=env))
    wheres = [f["where"] for f in doc["findings"]]
    assert "NCCL_P2P_DISABLE=1" in wheres and "NCCL_ALGO=Ring" in wheres
    assert doc["verdict"] == "problems"
    md = to_markdown(doc)
    assert "NCCL_P2P_DISABLE=1" in md and "unset NCCL_P2P_DISABLE" in md
    assert "NCCL_ALGO=Ring" in render_html(doc)


def test_doctor_cli_reads_the_real_environment(tmp_path: Path):
    result = invoke(
        "doctor",
        "--simulate",  # without a driver a run that was not asked to simulate exits 3, not by its verdict
        "--skip-probe",
        "--json",
        "--report-dir",
        str(tmp_path),
        env={"NCCL_PROTO": "Simple"},
    )
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    (f,) = [f for f in doc["findings"] if f["where"] == "NCCL_PROTO=Simple"]
    assert f["severity"] == "problem" and "protocols" in f["what"]
    md = Path(doc["report"]["markdown"]).read_text()
    assert "NCCL_PROTO=Simple" in md


def test_a_family_prefix_is_deliberate_and_not_flagged():
    assert nccl_env_findings({"NCCL_IB_HCA": "mlx5"}, ["mlx5_0", "mlx5_1"]) == []
    assert nccl_env_findings({"NCCL_IB_HCA": "^mlx5_bond"}) == []


def test_a_mixed_list_is_spelled_out_from_the_machines_nics():
    nics = ["mlx5_0", "mlx5_1", "mlx5_10", "mlx5_bond_0", "mlx5_bond_1"]
    (f,) = nccl_env_findings({"NCCL_IB_HCA": "mlx5_1:1,mlx5_bond"}, nics)
    assert f.severity == PROBLEM and "mlx5_1 also matches mlx5_10" in f.what
    assert "NCCL_IB_HCA==mlx5_1:1,mlx5_bond_0,mlx5_bond_1" in f.remedy
    (f,) = nccl_env_findings({"NCCL_IB_HCA": "mlx5_1,mlx5_bond"})
    assert "full device names" in f.remedy


def test_probe_warns_about_nccl_debug_variables_before_it_starts():
    pytest.importorskip("torch")
    # --steps 0 stops the probe at its option check, right after the environment was looked at.
    result = invoke("probe", "--gpus", "0,1", "--device", "cpu", "--steps", "0", env={"NCCL_ALGO": "Tree"})
    assert result.exit_code == 2
    assert "NCCL_ALGO=Tree forces the collective algorithms" in result.stderr
