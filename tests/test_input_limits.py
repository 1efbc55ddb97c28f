"""Inputs that could hang gputopo or exhaust the machine, and values that make no sense, as users hand them
over: real `gputopo` processes reading /dev/zero, a fifo nobody writes, too much on stdin, JSON nested
100,000 deep, a snapshot with a negative GPU index, a report with GPUs that are not indices, and
`--timeout inf`. Each must end with one error line and exit 2 (the subprocess timeout only guards against
a hang; nothing here measures time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gputopo.inputs import MAX_INPUT_BYTES, depth_exceeds

SAMPLE = "sample:workstation-2gpu-nvlink"


def gputopo(*args: str, stdin: bytes | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gputopo", *args],
        input=stdin,
        capture_output=True,
        timeout=120,
        cwd=cwd,
    )


def assert_refused(done: subprocess.CompletedProcess, words: str) -> None:
    err = done.stderr.decode()
    assert done.returncode == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], err
    assert "Traceback" not in err and "RecursionError" not in err


def test_dev_zero_ends_at_the_cap():
    assert_refused(gputopo("topo", "--input", "/dev/zero"), "larger than 16 MiB")


def test_a_fifo_nobody_writes_does_not_block(tmp_path):
    fifo = tmp_path / "topo.txt"
    os.mkfifo(fifo)
    assert_refused(gputopo("topo", "--input", str(fifo)), "empty")


def test_too_much_on_stdin_is_refused():
    assert_refused(gputopo("topo", "--input", "-", stdin=b" " * (MAX_INPUT_BYTES + 10)), "larger than 16 MiB")


def test_a_large_regular_file_is_refused_from_its_size(tmp_path):
    big = tmp_path / "big.json"
    with big.open("wb") as fh:  # sparse: the size is there, the disk is not used
        fh.truncate(MAX_INPUT_BYTES * 3)
    assert_refused(gputopo("topo", "--input", str(big)), "larger than 16 MiB")
    assert_refused(gputopo("report", str(big)), "larger than 16 MiB")


@pytest.mark.parametrize("command", ["topo", "report", "recommend"])
def test_json_nested_100k_deep_is_one_line(tmp_path, command):
    deep = tmp_path / "deep.json"
    deep.write_text('{"schema": "gputopo/topology/v1", "gpus": ' + "[" * 100_000 + "]" * 100_000 + "}")
    args = {
        "topo": ["topo", "--input", str(deep)],
        "report": ["report", str(deep)],
        "recommend": ["recommend", "--n", "2", "--input", SAMPLE, "--from-report", str(deep)],
    }[command]
    assert_refused(gputopo(*args), "nested deeper than")


def test_a_negative_gpu_index_in_a_snapshot_is_refused(tmp_path):
    done = gputopo("topo", "--input", SAMPLE, "--json")
    doc = json.loads(done.stdout)
    doc["gpus"][0]["index"] = -5
    bad = tmp_path / "snap.json"
    bad.write_text(json.dumps(doc))
    assert_refused(gputopo("topo", "--input", str(bad)), "GPU index -5")


def test_a_report_whose_set_names_no_gpu_indices_is_refused(tmp_path):
    reports = tmp_path / "reports"
    done = gputopo(
        "doctor", "--simulate", "--skip-probe", "--json", "--report-dir", str(reports), cwd=tmp_path
    )
    doc = json.loads(done.stdout)
    doc["probe"] = {"schema": "gputopo/probe/v1", "sets": [{"gpus": [99, "x"], "checks": []}]}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    assert_refused(gputopo("report", str(bad)), "not GPU indices")


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "0", "-1"])
def test_timeout_must_be_finite_and_positive(value):
    assert_refused(gputopo("doctor", "--simulate", "--skip-probe", f"--timeout={value}"), "--timeout")


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_every_number_option_must_be_finite(value):
    assert_refused(gputopo("kill-stale", f"--grace={value}"), "must be a finite number")
    assert_refused(gputopo("probe", "--device", "cpu", "--gpus", "0,1", f"--timeout={value}"), "finite")


def test_depth_is_counted_without_recursion():
    doc: list = []
    for _ in range(200_000):
        doc = [doc]
    assert depth_exceeds(doc, 64)
    assert not depth_exceeds({"a": [{"b": [1, 2]}]}, 4)
