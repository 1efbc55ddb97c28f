"""``gputopo doctor --dcgm-diag FILE`` and ``--health-validation FILE``: saved files of each shape DCGM and
Health Validation write (tests/fake_dcgmi.py cites DCGM's writer) join doctor's findings, JSON and reports;
a bad file stops doctor at once, in one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fake_dcgmi as fake
from conftest import invoke


def _doctor(tmp_path: Path, *args: str):  # type: ignore[no-untyped-def]
    return invoke(
        "doctor", "--simulate", "--skip-probe", *args, "--json", "--report-dir", str(tmp_path / "reports")
    )


def _save(tmp_path: Path, doc: object, name: str) -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else fake.styled(doc))
    return path


def _dcgm(doc: dict) -> list[dict]:
    return [f for f in doc["findings"] if f["what"].startswith("dcgmi diag")]


def test_a_dcgm_failure_on_gpu3_is_a_problem_in_doctors_json_and_reports(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the HTML report draws its pictures with matplotlib")
    saved = _save(
        tmp_path, fake.doc_4x(level=3, outcome={("memory", 3): ("Fail", [fake.FAULTY_MEMORY_GPU3])}), "d.json"
    )
    result = _doctor(tmp_path, "--dcgm-diag", str(saved), "--html")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "problems"
    found = _dcgm(doc)
    [problem] = [f for f in found if f["severity"] == "problem"]
    assert (problem["gpu"], problem["category"], problem["rule"]) == (3, "memory", "dcgm_diag_fail")
    assert "DCGM_FR_FAULTY_MEMORY (52, category HARDWARE_MEMORY, severity ISOLATE)" in problem["what"]
    [summary] = [f for f in found if f["rule"] == "dcgm_diag"]
    assert summary["what"].startswith(f"dcgmi diag ({saved}): failed") and "DCGM 4.6.0" in summary["what"]
    for kind in ("markdown", "html"):  # the reports show it too
        assert "DCGM_FR_FAULTY_MEMORY" in Path(doc["report"][kind]).read_text(), kind
    saved_json = json.loads(Path(doc["report"]["json"]).read_text())
    assert any(f["rule"] == "dcgm_diag_fail" for f in saved_json["findings"])


@pytest.mark.parametrize(
    ("doc", "status", "exit_code"),
    [
        (fake.doc_4x(level=1), "passed", 0),
        (fake.doc_3x(fail_gpu=3), "failed", 1),
        (fake.doc_nvvs(), "passed", 0),
        (fake.iterations([fake.doc_4x(level=1)] * 3), "passed", 0),
        (fake.runtime_error(), "not checked", 0),
    ],
    ids=["4x-pass", "3x-fail", "nvvs-warn-skip", "iterations", "runtime-error"],
)
def test_every_saved_shape_is_imported(tmp_path: Path, doc: dict, status: str, exit_code: int) -> None:
    result = _doctor(tmp_path, "--dcgm-diag", str(_save(tmp_path, doc, "d.json")))
    assert result.exit_code == exit_code, result.output
    [summary] = [f for f in _dcgm(json.loads(result.stdout)) if f["rule"] == "dcgm_diag"]
    assert f": {status}" in summary["what"]


def test_health_validation_critical_is_a_problem_warning_a_note(tmp_path: Path) -> None:
    verdict = {
        "overall_severity": "CRITICAL",
        "affected_components": [
            {
                "category": "nvlink",
                "max_severity": "CRITICAL",
                "check_ids": ["nvlink_active"],
                "entities": ["GPU 2"],
            },
            {
                "category": "gpu",
                "max_severity": "WARNING",
                "check_ids": ["gpu_power_limit"],
                "entities": ["GPU 6"],
            },
        ],
    }
    result = _doctor(tmp_path, "--health-validation", str(_save(tmp_path, verdict, "hv.json")))
    assert result.exit_code == 1
    found = [f for f in json.loads(result.stdout)["findings"] if f["rule"] == "health_validation"]
    assert sorted((f["where"], f["severity"]) for f in found if f["gpu"] is not None) == [
        ("GPU2", "problem"),
        ("GPU6", "note"),
    ]
    ok = _doctor(
        tmp_path, "--health-validation", str(_save(tmp_path, {"overall_severity": "PASS"}, "ok.json"))
    )
    assert ok.exit_code == 0


@pytest.mark.parametrize(
    ("flag", "content", "words"),
    [
        ("--dcgm-diag", fake.styled(fake.doc_4x(level=1))[:300], "cut short"),
        ("--dcgm-diag", "Error: unable to connect\n", "no JSON in it"),
        ("--health-validation", '{"overall_severity": "CRIT', "not JSON"),
    ],
)
def test_a_bad_file_is_one_line_and_exit_2_before_anything_runs(
    tmp_path: Path, flag: str, content: str, words: str
) -> None:
    result = _doctor(tmp_path, flag, str(_save(tmp_path, content, "bad.json")))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert flag in result.output and words in result.output
    assert not (tmp_path / "reports").exists() or not any((tmp_path / "reports").iterdir())
