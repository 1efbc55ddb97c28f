"""Reports under reports/: names, atomic writes, and what the probe's JSON and Markdown hold."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import pytest

from gputopo.errors import UsageError
from gputopo.probe.judge.verdict import CheckResult, SetResult, judge_allreduce
from gputopo.probe.plan.config import DeviceInventory, Fault, build_config
from gputopo.probe.report.document import SCHEMA, allreduce_table, to_document, to_markdown
from gputopo.probe.shared import ProbeRun
from gputopo.report import report_paths, write_report

NOON = datetime(2026, 11, 21, 15, 30, 0, tzinfo=timezone.utc)


def test_report_names_carry_kind_and_utc_time(tmp_path):
    paths = write_report("probe", {"schema": "x"}, "# hi\n", tmp_path, now=NOON)
    assert paths == {
        "json": str(tmp_path / "probe-20261121T153000Z.json"),
        "markdown": str(tmp_path / "probe-20261121T153000Z.md"),
    }
    assert json.loads(Path(paths["json"]).read_text()) == {"schema": "x", "report": paths}
    assert Path(paths["markdown"]).read_text() == "# hi\n"
    assert sorted(os.listdir(tmp_path)) == ["probe-20261121T153000Z.json", "probe-20261121T153000Z.md"]


def test_a_second_report_in_the_same_second_does_not_overwrite(tmp_path):
    first = write_report("doctor", {"n": 1}, "1", tmp_path, now=NOON)
    second = write_report("doctor", {"n": 2}, "2", tmp_path, now=NOON)
    assert second["json"].endswith("doctor-20261121T153000Z-2.json")
    assert json.loads(Path(first["json"]).read_text())["n"] == 1


def test_local_times_are_named_in_utc(tmp_path):
    from datetime import timedelta

    local = NOON.astimezone(timezone(timedelta(hours=-5)))
    assert report_paths("probe", tmp_path, local)["json"].endswith("probe-20261121T153000Z.json")


def test_report_folder_is_created_and_an_unwritable_one_is_a_usage_error(tmp_path):
    nested = tmp_path / "a" / "b"
    write_report("probe", {}, "", nested, now=NOON)
    assert nested.is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(UsageError, match="cannot write the report"):
        write_report("probe", {}, "", blocker / "reports", now=NOON)


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(UsageError, match="No space left"):
        write_report("probe", {"big": 1}, "md", tmp_path, now=NOON)
    assert os.listdir(tmp_path) == []


def test_bad_kind_is_refused(tmp_path):
    with pytest.raises(ValueError):
        report_paths("../probe", tmp_path)


def _run() -> ProbeRun:
    config = build_config(
        DeviceInventory("cpu", (0, 1)), ["0,1"], model="tiny", steps=2, inject=Fault.CORRUPT
    )
    rows = [
        {
            "bytes": 65536,
            "count": 16384,
            "time_us": 2000.0,
            "algbw_gbps": 0.03,
            "busbw_gbps": 0.03,
            "wrong": 0,
        },
        {
            "bytes": 262144,
            "count": 65536,
            "time_us": 2000.0,
            "algbw_gbps": 0.13,
            "busbw_gbps": 0.13,
            "wrong": 2,
        },
    ]
    allreduce = judge_allreduce(
        {"ranks": 2, "rows": rows, "dtype": "float32", "warmup_iters": 2, "timed_iters": 5},
        None,
        judge_speed=False,
    )
    checks = (
        CheckResult("p2p", "skipped", detail="no peer-to-peer copies between CPU stand-ins"),
        CheckResult(
            "ddp",
            "pass",
            detail="ok",
            metrics={
                "losses": [2.5, 2.4],
                "ref_losses": [2.5, 2.4],
                "ref2_losses": [2.5, 2.4],
                "noise_floor": 0.0,
            },
        ),
        allreduce,
    )
    env = {
        "torch": "2.15.0",
        "nccl": None,
        "devices": [{"index": 0, "name": "CPU rank 0 (stand-in)", "pci_bus_id": None}],
    }
    return ProbeRun(config, (SetResult((0, 1), checks),), env, ("a note",), NOON, 5.5)


def test_document_follows_schema_v1():
    doc = to_document(_run(), {"json": "j", "markdown": "m"})
    assert doc["schema"] == SCHEMA == "gputopo/probe/v1"
    assert doc["device"] == "cpu" and doc["verdict"] == "fail"
    assert doc["report"] == {"json": "j", "markdown": "m"}
    (s,) = doc["sets"]
    assert s["gpus"] == [0, 1] and s["verdict"] == "fail"
    names = [c["name"] for c in s["checks"]]
    assert names == ["p2p", "ddp", "allreduce"]
    ar = s["checks"][2]
    assert ar["kind"] == "corrupt"
    assert set(ar["metrics"]["rows"][0]) >= {"bytes", "time_us", "algbw_gbps", "busbw_gbps", "wrong"}
    assert ar["metrics"]["peak_busbw_gbps"] == 0.13 and ar["metrics"]["expected_busbw_gbps"] is None
    assert doc["config"]["inject"] == "corrupt" and doc["config"]["inject_rank"] == 1
    assert doc["environment"]["torch"] == "2.15.0"
    json.dumps(doc)  # serialisable as is


def test_allreduce_table_reads_like_nccl_tests():
    doc = to_document(_run())
    lines = allreduce_table(doc, [0, 1], doc["sets"][0]["checks"][2])
    assert lines[0].startswith("# all-reduce, set 0,1: 2 ranks, gloo, float32 sum")
    assert lines[1].startswith("#  rank  0: cpu 0 CPU rank 0 (stand-in)")
    header = next(line for line in lines if "#wrong" in line)
    assert header.split()[1:] == ["size", "count", "type", "time", "algbw", "busbw", "#wrong"]
    data = [line.split() for line in lines if not line.startswith("#")]
    assert data[1] == ["262144", "65536", "float", "2000.0", "0.13", "0.13", "2"]
    assert lines[-1].startswith("# FAIL: all-reduce of known integers returned wrong elements")
    # nccl-tests' closing lines, which scripts grep for: wrong elements, then the mean busbw over sizes.
    assert "# Out of bounds values : 2 FAILED" in lines
    assert "# Avg bus bandwidth    : 0.08" in lines  # (0.03 + 0.13) / 2, printed as %g


def test_markdown_has_verdicts_remedies_environment_and_measurements():
    md = to_markdown(to_document(_run()))
    assert md.startswith("# gputopo probe: FAIL")
    assert "| 0,1 | allreduce | fail | corrupt |" in md
    assert "## What to do" in md and "IOMMU" in md
    assert "| torch | 2.15.0 |" in md
    assert "CPU rank 0 (stand-in)" in md
    assert "262144" in md and "# ddp, set 0,1" in md
    assert "- note: a note" in md
