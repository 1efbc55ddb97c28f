"""DCGM's ``dcgmi diag -j`` and NVIDIA Health Validation's NodeVerdict, read into gputopo's findings; and
``dcgmi diag`` run within a budget against a fake ``dcgmi`` on PATH.

Each document is built as DCGM's writer builds it (tests/fake_dcgmi.py cites the lines of NVIDIA/DCGM at
72fa3fe for 4.x and v3.3.9 for 3.x); the code table is checked against ``dcgmlib/dcgm_errors.h`` where a
copy of DCGM is at hand.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

import fake_dcgmi as fake
from gputopo.errors import InputError, UsageError
from gputopo.findings import NOTE, PROBLEM
from gputopo.health import dcgm_diag
from gputopo.health.dcgm_diag import FAILED, NOT_CHECKED, PASSED, read_dcgm_diag
from gputopo.health.health_validation import read_health_validation
from own_procs import MARKER_VAR, new_marker, wait_for_none_left

DCGM_COMMIT = "72fa3feaa67d716a75323a8f47c34ff3ee73f824"


def write(tmp_path: Path, doc: object, name: str = "diag.json") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else fake.styled(doc))
    return path


# --- 4.x: Diag.cpp HelperJsonBuildOutput / HelperJsonAddResult (lines 1056-1289) ---------------------------


def test_all_pass_is_passed_with_the_serials_and_versions(tmp_path: Path) -> None:
    got = read_dcgm_diag(write(tmp_path, fake.doc_4x(level=3)))
    assert got.status == PASSED and got.reason is None and got.findings == ()
    assert (
        got.serials[3] == fake.SERIALS[3] and len(got.serials) == 8
    )  # entity_groups[].entities[].serial_num
    assert (got.dcgm_version, got.driver_version) == (fake.VERSION, fake.DRIVER)  # metadata
    assert got.counts == {"pass": 56, "fail": 0, "warn": 0, "skip": 0}  # 7 tests x 8 GPUs


def test_a_fail_on_gpu3_is_a_problem_on_gpu3_with_dcgms_code_and_category(tmp_path: Path) -> None:
    doc = fake.doc_4x(level=3, outcome={("memory", 3): ("Fail", [fake.FAULTY_MEMORY_GPU3])})
    got = read_dcgm_diag(write(tmp_path, doc))
    assert got.status == FAILED and "GPU3: DCGM_FR_FAULTY_MEMORY" in (got.reason or "")
    [problem] = got.findings
    assert (problem.severity, problem.gpu, problem.where) == (PROBLEM, 3, "GPU3")
    assert (problem.category, problem.action, problem.rule) == ("memory", "drain", "dcgm_diag_fail")
    assert problem.what.startswith("dcgmi diag: memory failed on GPU3 (serial 1650123450003)")
    assert "DCGM_FR_FAULTY_MEMORY (52, category HARDWARE_MEMORY, severity ISOLATE)" in problem.what
    assert "field diagnostic" in problem.remedy


def test_an_error_of_no_entity_is_read_from_the_test_summary(tmp_path: Path) -> None:
    # HelperJsonAddResult(includeAllErrors=true): only test_summary carries an error of DCGM_FE_NONE.
    node_err = fake.warning(122, 12, 2, "The IMEX domain is DEGRADED")
    doc = fake.doc_4x(level=1, global_errors={"software": [node_err]})
    got = read_dcgm_diag(write(tmp_path, doc))
    assert got.status == FAILED
    [problem] = got.findings
    assert (problem.where, problem.gpu, problem.category) == ("node", None, "nvlink")
    assert "DCGM_FR_IMEX_UNHEALTHY" in problem.what


def test_a_per_gpu_error_repeated_in_the_summary_is_one_finding(tmp_path: Path) -> None:
    doc = fake.doc_4x(level=2, outcome={("pcie", 1): ("Fail", [fake.warning(46, 13, 2, "PCIe width x8")])})
    got = read_dcgm_diag(write(tmp_path, doc))
    assert [(f.where, f.category) for f in got.findings] == [("GPU1", "pcie")]


@pytest.mark.parametrize(
    ("code", "action"),
    [(127, "drain"), (126, "reboot"), (125, "reset"), (128, "reset"), (120, "reboot")],
)
def test_the_drivers_recovery_codes_say_their_action(tmp_path: Path, code: int, action: str) -> None:
    doc = fake.doc_4x(level=1, outcome={("software", 2): ("Fail", [fake.warning(code, 15, 6, "recovery")])})
    [problem] = read_dcgm_diag(write(tmp_path, doc)).findings
    assert problem.action == action and problem.what.count(dcgm_diag.FR_CODES[code]) == 1


def test_a_warn_is_a_note_and_the_run_passes(tmp_path: Path) -> None:
    # DCGM 4.x writes a warning result as "Fail" (HelperDisplayDiagResult's default, lines 845-866); a
    # "Warn" (nvvs's WARN, or a later dcgmi) is read as a warning: a note.
    doc = fake.doc_4x(level=3, outcome={("targeted_power", 5): ("Warn", [fake.POWER_LOW])})
    got = read_dcgm_diag(write(tmp_path, doc))
    assert got.status == PASSED and "1 warning" in (got.reason or "")
    [note] = got.findings
    assert (note.severity, note.gpu, note.category, note.action) == (NOTE, 5, "power", "monitor")
    assert "DCGM_FR_TARGET_POWER" in note.what and note.rule == "dcgm_diag_warn"


def test_skips_are_not_checked_and_all_skipped_is_not_a_pass(tmp_path: Path) -> None:
    some = fake.doc_4x(level=4, outcome={("memtest", g): ("Skip", [fake.SKIPPED]) for g in range(8)})
    got = read_dcgm_diag(write(tmp_path, some))
    assert got.status == PASSED
    [note] = got.findings
    assert note.severity == NOTE and note.rule == "dcgm_diag_skip" and "memtest was skipped" in note.what
    assert "GPU0, GPU1" in note.what and "not checked" in note.what and "no CUDA device is free" in note.what
    every = {(t, g): ("Skip", []) for _, t in fake.LEVEL_TESTS[1] for g in range(8)}
    got = read_dcgm_diag(write(tmp_path, fake.doc_4x(level=1, outcome=every)))
    assert got.status == NOT_CHECKED and got.reason == "DCGM skipped every test it was asked to run"


def test_the_early_failure_document_is_not_checked_with_dcgms_words(tmp_path: Path) -> None:
    # HelperDisplayFailureMessage (Diag.cpp lines 634-653).
    got = read_dcgm_diag(write(tmp_path, fake.runtime_error()))
    assert got.status == NOT_CHECKED
    assert got.reason == (
        "DCGM's diagnostic stopped early: Error: Unable to complete diagnostic for group 0. Return: (-33) : "
        "Host engine connection invalid/disconnected"
    )
    [note] = got.findings
    assert note.severity == NOTE and note.rule == "dcgm_diag_error"


# --- 3.x: v3.3.9 dcgmi/Diag.cpp (gpu_id strings, root serials) and nvvs's JSON (gpu_ids) --------------------


def test_the_3x_shape_names_the_gpu_as_a_string(tmp_path: Path) -> None:
    got = read_dcgm_diag(write(tmp_path, fake.doc_3x(fail_gpu=3)))
    assert got.status == FAILED and got.dcgm_version == "3.3.9" and got.serials[3] == fake.SERIALS[3]
    [problem] = got.findings
    assert (problem.gpu, problem.category) == (3, "memory") and "serial 1650123450003" in problem.what
    assert read_dcgm_diag(write(tmp_path, fake.doc_3x())).status == PASSED


def test_nvvs_json_with_gpu_ids_upper_case_and_gaps(tmp_path: Path) -> None:
    got = read_dcgm_diag(write(tmp_path, fake.doc_nvvs()))
    assert got.status == PASSED and got.counts == {"pass": 2, "fail": 0, "warn": 1, "skip": 1}
    by_rule = {f.rule: f for f in got.findings}
    assert by_rule["dcgm_diag_warn"].gpu == 2
    assert by_rule["dcgm_diag_skip"].gpu == 0 and "ECC memory on GPU 0" in by_rule["dcgm_diag_skip"].what


def test_the_3x_deployment_message_under_warnings_is_read(tmp_path: Path) -> None:
    # v3.3.9 Diag.cpp line 1260 writes a deployment error's message under "warnings", not "warning".
    doc = fake.doc_3x()
    doc["DCGM GPU Diagnostic"]["test_categories"][0]["tests"][1]["results"] = [
        {
            "status": "Fail",
            "gpu_id": 1,
            "warnings": [
                {
                    "warnings": "Persistence mode for GPU 1 is disabled.",
                    "error_id": 29,
                    "error_category": 3,
                    "error_severity": 5,
                }
            ],
        }
    ]
    [problem] = read_dcgm_diag(write(tmp_path, doc)).findings
    assert problem.gpu == 1 and problem.action == "config" and "Persistence mode for GPU 1" in problem.what


# --- --iterations (Diag::RunStartDiag, lines 577-632) ------------------------------------------------------


def test_iterations_are_judged_as_one_run(tmp_path: Path) -> None:
    bad = fake.doc_4x(level=1, outcome={("software", 3): ("Fail", [fake.FAULTY_MEMORY_GPU3])})
    doc = fake.iterations([fake.doc_4x(level=1), bad, bad], failed="The GPU Diagnostic returned an error")
    got = read_dcgm_diag(write(tmp_path, doc))
    assert got.status == FAILED and got.iterations == 3
    [problem] = got.findings
    assert problem.what.endswith("(in 2 of 3 runs)")
    assert read_dcgm_diag(write(tmp_path, fake.iterations([fake.doc_4x(level=1)] * 2))).status == PASSED


def test_an_early_failure_printed_before_the_iterations_is_read_too(tmp_path: Path) -> None:
    # A runtime error mid-way is printed on its own (HelperDisplayFailureMessage) before the iterations.
    text = fake.styled(fake.runtime_error("Error: the diagnostic timed out")) + fake.styled(
        fake.iterations([fake.doc_4x(level=1)], failed="Timeout")
    )
    got = read_dcgm_diag(write(tmp_path, text))
    assert got.status == NOT_CHECKED and "timed out" in (got.reason or "")


def test_an_iterations_failure_with_no_result_is_still_a_failure(tmp_path: Path) -> None:
    doc = fake.iterations([fake.doc_4x(level=1)], failed="The GPU Diagnostic returned an error")
    got = read_dcgm_diag(write(tmp_path, doc))
    assert got.status == FAILED and "returned an error" in got.findings[0].what


# --- bad files: exit 2, one line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("", "no JSON in it"),
        ("Error: unable to establish a connection to the specified host: localhost\n", "no JSON in it"),
        (fake.styled(fake.doc_4x(level=1))[:500], "cut short"),
        ('{"hello": 1}', "not a dcgmi diag -j output"),
        (fake.styled(fake.doc_4x(level=1)) + "trailing words", "text after the JSON"),
        ("[" * 100 + "]" * 100, "no JSON in it"),
        ('{"a":' * 100 + "1" + "}" * 100, "nested deeper"),
        ('{"iterations": []}', "holds no run"),
    ],
)
def test_bad_or_cut_short_files_are_one_line_errors(tmp_path: Path, content: str, words: str) -> None:
    with pytest.raises(InputError) as err:
        read_dcgm_diag(write(tmp_path, content))
    assert words in err.value.message and "\n" not in err.value.message
    assert err.value.message.startswith("--dcgm-diag ")


def test_a_missing_file_or_folder_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        read_dcgm_diag(tmp_path / "nope.json")
    with pytest.raises(InputError, match="is a folder"):
        read_dcgm_diag(tmp_path)


def test_the_code_table_matches_dcgms_header() -> None:
    assert (
        dcgm_diag.FR_CODES[52] == "DCGM_FR_FAULTY_MEMORY"
        and dcgm_diag.FR_CODES[127] == "DCGM_FR_GPU_RECOVERY_DRAIN_P2P"
    )
    assert len(dcgm_diag.FR_CODES) == 133
    mirror = Path("/work/.mirror/NVIDIA+DCGM/repo")
    if not mirror.exists():
        pytest.skip("no copy of DCGM's dcgm_errors.h here (fetch github:NVIDIA/DCGM)")
    done = subprocess.run(
        ["git", "-C", str(mirror), "show", f"{DCGM_COMMIT}:dcgmlib/dcgm_errors.h"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        pytest.skip(f"DCGM {DCGM_COMMIT[:7]} is not in the copy at hand")
    enum = done.stdout[done.stdout.index("typedef enum dcgmError_enum") : done.stdout.index("} dcgmError_t;")]
    header = {int(n): name for name, n in re.findall(r"(DCGM_FR_[A-Z0-9_]+)\s*=\s*(\d+)", enum)}
    header.pop(133)  # DCGM_FR_ERROR_SENTINEL
    assert header == dcgm_diag.FR_CODES
    cats = done.stdout[done.stdout.index("typedef enum dcgmErrorCategory_enum") :]
    found = {int(n): name for name, n in re.findall(r"DCGM_FR_EC_([A-Z_]+)\s*=\s*(\d+)", cats)}
    assert found == {k: v[0] for k, v in dcgm_diag.ERROR_CATEGORIES.items()}


# --- NVIDIA Health Validation's NodeVerdict ---------------------------------------------------------------


def verdict(overall: str, *components: dict) -> dict:
    return {"overall_severity": overall, "hostname": "gpu-node-07", "affected_components": list(components)}


def test_health_validation_critical_and_unknown_are_problems_warning_a_note(tmp_path: Path) -> None:
    doc = verdict(
        "CRITICAL",
        {
            "category": "nvlink",
            "max_severity": "CRITICAL",
            "check_ids": ["nvlink_active"],
            "entities": ["GPU 3"],
        },
        {
            "category": "gpu",
            "max_severity": "WARNING",
            "check_ids": ["gpu_power_limit"],
            "entities": ["gpu5"],
        },
        {"category": "xid", "max_severity": "UNKNOWN", "check_ids": ["gpu_xid_79"], "entities": []},
    )
    got = read_health_validation(write(tmp_path, doc))
    assert got.status == "failed" and got.node == "gpu-node-07"
    problems = [f for f in got.findings if f.severity == PROBLEM]
    assert [(f.where, f.gpu, f.category) for f in problems] == [("GPU3", 3, "nvlink"), ("node", None, "xid")]
    assert problems[0].what == "health-validation: nvlink is CRITICAL (nvlink_active) on GPU 3"
    [note] = [f for f in got.findings if f.severity == NOTE]
    assert (note.gpu, note.action) == (5, "monitor")


def test_health_validation_pass_and_warning_verdicts_pass(tmp_path: Path) -> None:
    assert read_health_validation(write(tmp_path, verdict("PASS"))).findings == ()
    got = read_health_validation(write(tmp_path, verdict("warning")))
    assert got.status == "passed"
    got = read_health_validation(write(tmp_path, verdict("UNKNOWN")))
    assert got.status == "failed" and "could not be assessed" in got.findings[0].what


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('{"overall_severity": "CRITICAL", ', "not JSON"),
        ('{"verdict": "PASS"}', "no overall_severity"),
        ('{"overall_severity": "GREEN"}', "is none of PASS"),
        ("", "not JSON"),
    ],
)
def test_health_validation_bad_files(tmp_path: Path, content: str, words: str) -> None:
    with pytest.raises(InputError) as err:
        read_health_validation(write(tmp_path, content, "hv.json"))
    assert words in err.value.message and err.value.message.startswith("--health-validation ")


# --- the runner, against a fake dcgmi on PATH ---------------------------------------------------------------


@pytest.fixture
def dcgmi_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A fake ``dcgmi`` first on PATH; the test writes its answers with ``answer``."""
    bin_dir = tmp_path / "bin"
    marker = new_marker()
    monkeypatch.setenv(MARKER_VAR, marker)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")

    def answer(answers: dict) -> Path:
        fake.fake_dcgmi(bin_dir, answers)
        return bin_dir

    answer.marker = marker  # type: ignore[attr-defined]
    return answer


def test_run_every_level_through_dcgmi_on_path(dcgmi_bin) -> None:  # type: ignore[no-untyped-def]
    from gputopo.system.dcgmi import run_dcgm_diag

    bad = fake.doc_4x(level=2, outcome={("memory", 3): ("Fail", [fake.FAULTY_MEMORY_GPU3])})
    skipped = fake.doc_4x(
        level=4, outcome={(t, g): ("Skip", [fake.SKIPPED]) for _, t in fake.LEVEL_TESTS[4] for g in range(8)}
    )
    bin_dir = dcgmi_bin(
        {
            "1": {"stdout": fake.styled(fake.doc_4x(level=1)), "rc": 0},
            "2": {"stdout": fake.styled(bad), "rc": 226},  # DCGM_ST_NVVS_ERROR (-30) as an exit code
            # A warning: no dcgmi writes "Warn" in its JSON (4.x writes "Fail", 3.x "Fail"); nvvs's JSON
            # writes "WARN", so the level-3 answer is that real shape.
            "3": {"stdout": fake.styled(fake.doc_nvvs()), "rc": 0},
            "4": {"stdout": fake.styled(skipped), "rc": 0},
        }
    )
    got = {level: run_dcgm_diag(level, budget_s=30) for level in (1, 2, 3, 4)}
    assert [got[lv].status for lv in (1, 2, 3, 4)] == [PASSED, FAILED, PASSED, NOT_CHECKED]
    assert got[2].findings[0].gpu == 3 and "DCGM_FR_FAULTY_MEMORY" in got[2].findings[0].what
    assert {(f.gpu, f.rule) for f in got[3].findings} == {(2, "dcgm_diag_warn"), (0, "dcgm_diag_skip")}
    assert all(f.severity == NOTE for f in got[3].findings) and got[3].level == 3
    assert got[1].source == "dcgmi diag -r 1 -j"
    assert fake.calls(bin_dir) == [["diag", "-r", str(lv), "-j"] for lv in (1, 2, 3, 4)]


def test_run_runtime_error_and_text_are_not_checked(dcgmi_bin) -> None:  # type: ignore[no-untyped-def]
    from gputopo.system.dcgmi import run_dcgm_diag

    dcgmi_bin(
        {
            "1": {"stdout": fake.styled(fake.runtime_error()), "rc": 255},
            "2": {
                "stdout": "Error: unable to establish a connection to the specified host: localhost\n",
                "rc": 255,
            },
        }
    )
    early = run_dcgm_diag(1, budget_s=30)
    assert early.status == NOT_CHECKED and "Host engine connection" in (early.reason or "")
    text = run_dcgm_diag(2, budget_s=30)
    assert text.status == NOT_CHECKED and text.reason == (
        "`dcgmi diag -r 2 -j` gave no JSON (exit 255): Error: unable to establish a connection to the "
        "specified host: localhost (is nv-hostengine running?)"
    )


def test_no_dcgmi_is_not_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gputopo.system import dcgmi

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(dcgmi, "SEARCH_DIRS", (str(tmp_path),))
    got = dcgmi.run_dcgm_diag(3, budget_s=30)
    assert got.status == NOT_CHECKED and got.reason.startswith("dcgmi not found (PATH, ")  # type: ignore[union-attr]
    with pytest.raises(UsageError, match="levels are 1 to 4"):
        dcgmi.run_dcgm_diag(5, budget_s=30)


@pytest.mark.parametrize("ignore_term", [False, True])
def test_a_hang_past_the_budget_is_not_checked_and_leaves_nothing(dcgmi_bin, ignore_term: bool) -> None:  # type: ignore[no-untyped-def]
    """A dcgmi that hangs (and one that starts a child and ignores SIGTERM, as one stuck in the host engine
    would) is stopped at the budget, its whole process group with it."""
    from gputopo.system.dcgmi import run_dcgm_diag

    dcgmi_bin({"3": {"hang_s": 600, "child": True, "ignore_term": ignore_term, "stdout": "{}"}})
    started = time.monotonic()
    got = run_dcgm_diag(3, budget_s=3)
    took = time.monotonic() - started
    assert got.status == NOT_CHECKED and "did not finish within its budget of 3 s" in (got.reason or "")
    assert took < 3 + 2.5  # the budget, and the second given to a grandchild holding the pipes
    assert wait_for_none_left(dcgmi_bin.marker) == []


def test_a_spent_budget_runs_nothing(dcgmi_bin) -> None:  # type: ignore[no-untyped-def]
    from gputopo.system.dcgmi import run_dcgm_diag

    bin_dir = dcgmi_bin({"*": {"stdout": "{}"}})
    got = run_dcgm_diag(1, budget_s=0.2)
    assert (
        got.status == NOT_CHECKED and "budget was spent" in (got.reason or "") and fake.calls(bin_dir) == []
    )


def test_the_result_json_is_plain_data(tmp_path: Path) -> None:
    doc = fake.doc_4x(level=1, outcome={("software", 3): ("Fail", [fake.FAULTY_MEMORY_GPU3])})
    out = read_dcgm_diag(write(tmp_path, doc)).to_json()
    assert (
        json.loads(json.dumps(out)) == out
        and out["status"] == FAILED
        and out["serials"]["3"] == fake.SERIALS[3]
    )
    assert out["findings"][0]["rule"] == "dcgm_diag_fail" and out["tool"] == "dcgmi diag"


@pytest.fixture
def stop_signals():  # type: ignore[no-untyped-def]
    """gputopo's stop handlers in this process (as tests/test_signals.py installs them)."""
    import signal

    from gputopo.cli.common import install_stop_signals, restore_signals

    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    before = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (getattr(signal, n) for n in names)}
    previous = install_stop_signals()
    yield
    restore_signals(previous)
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_stopping_gputopo_while_dcgmi_runs_stops_dcgmi_and_its_children(dcgmi_bin, stop_signals) -> None:  # type: ignore[no-untyped-def]
    import signal
    import threading

    from gputopo.errors import Interrupted
    from gputopo.system.dcgmi import run_dcgm_diag

    dcgmi_bin({"3": {"hang_s": 600, "child": True}})
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(Interrupted):
        run_dcgm_diag(3, budget_s=300)
    assert wait_for_none_left(dcgmi_bin.marker) == []


def _mutations(doc: object, rng) -> object:  # type: ignore[no-untyped-def]
    """``doc`` with one node somewhere replaced by a value of another type."""
    import copy

    doc = copy.deepcopy(doc)
    spots: list[tuple[object, object]] = []
    stack = [doc]
    while stack:
        node = stack.pop()
        keys = (
            list(node.keys())
            if isinstance(node, dict)
            else range(len(node))
            if isinstance(node, list)
            else []
        )
        for k in keys:
            spots.append((node, k))
            stack.append(node[k])  # type: ignore[index]
    parent, key = rng.choice(spots)
    parent[key] = rng.choice([None, "x", "3", -1, 2**40, 1.5, True, [], {}, [None], {"status": 5}])  # type: ignore[index]
    return doc


@pytest.mark.parametrize(
    "doc",
    [
        fake.doc_4x(level=2, outcome={("memory", 3): ("Fail", [fake.FAULTY_MEMORY_GPU3])}),
        fake.doc_3x(fail_gpu=3),
        fake.doc_nvvs(),
        fake.iterations([fake.doc_4x(level=1)] * 2, failed="x"),
        fake.runtime_error(),
    ],
    ids=["4x", "3x", "nvvs", "iterations", "runtime-error"],
)
def test_any_odd_value_anywhere_is_judged_or_refused_never_a_traceback(doc: dict) -> None:
    import random

    rng = random.Random(45)
    for _ in range(300):
        mutated = _mutations(doc, rng)
        try:
            got = dcgm_diag.judge_documents([mutated], "fuzz", "--dcgm-diag fuzz")
        except InputError as exc:
            assert "\n" not in exc.message
            continue
        assert got.status in dcgm_diag.STATUSES
        json.dumps(got.to_json())


def test_any_odd_value_in_a_verdict_is_judged_or_refused() -> None:
    import random

    from gputopo.health.health_validation import judge_verdict

    rng = random.Random(45)
    doc = verdict(
        "CRITICAL",
        {
            "category": "nvlink",
            "max_severity": "CRITICAL",
            "check_ids": ["nvlink_active"],
            "entities": ["GPU 3"],
        },
    )
    for _ in range(200):
        try:
            got = judge_verdict(_mutations(doc, rng), "fuzz", "--health-validation fuzz")
        except InputError as exc:
            assert "\n" not in exc.message
            continue
        json.dumps(got.to_json())


def test_a_result_is_matched_to_this_machines_gpus_by_serial(tmp_path: Path) -> None:
    doc = fake.doc_4x(level=1, gpus=4, outcome={("software", 3): ("Fail", [fake.FAULTY_MEMORY_GPU3])})
    got = read_dcgm_diag(write(tmp_path, doc))
    same = {i: fake.SERIALS[i] for i in range(4)}
    assert dcgm_diag.match_serials(got, same).findings == got.findings
    # DCGM's GPU3 is NVML's GPU1 here: the problem moves to GPU1.
    swapped = {0: fake.SERIALS[0], 1: fake.SERIALS[3], 2: fake.SERIALS[2], 3: fake.SERIALS[1]}
    [problem] = dcgm_diag.match_serials(got, swapped).findings
    assert (problem.gpu, problem.where) == (1, "GPU1") and "on GPU1 (DCGM's GPU3) (serial" in problem.what
    # A GPU swapped in since: a pass is not a pass for it.
    passed = read_dcgm_diag(write(tmp_path, fake.doc_4x(level=1, gpus=4)))
    new = {**same, 2: "1650999999999"}
    held = dcgm_diag.match_serials(passed, new)
    assert held.status == NOT_CHECKED and "GPU2 (serial 1650999999999)" in (held.reason or "")
    assert dcgm_diag.match_serials(got, new).status == FAILED  # a failure found stays one
    early = read_dcgm_diag(write(tmp_path, fake.runtime_error()))
    assert dcgm_diag.match_serials(early, same) == early
    nvvs = read_dcgm_diag(write(tmp_path, fake.doc_nvvs()))
    assert "cannot be matched" in dcgm_diag.match_serials(nvvs, same).findings[-1].what


@pytest.mark.parametrize(
    ("kind", "status"),
    [
        ("pass", PASSED),
        ("fail_gpu3", FAILED),
        ("warn", PASSED),
        ("skips", NOT_CHECKED),
        ("runtime_error", NOT_CHECKED),
        ("text", NOT_CHECKED),
    ],
)
def test_the_ready_answers_say_what_they_are_named(dcgmi_bin, kind: str, status: str) -> None:  # type: ignore[no-untyped-def]
    from gputopo.system.dcgmi import run_dcgm_diag

    dcgmi_bin({"*": fake.answer(kind, level=2)})
    got = run_dcgm_diag(2, budget_s=30)
    assert got.status == status
    if kind == "fail_gpu3":
        assert got.failed_gpus == (3,)
