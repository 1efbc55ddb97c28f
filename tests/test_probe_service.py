"""``services.probe``: the probe's options checked once, ``--gpus`` parsed once, the drain rule in one
function, and the report's document built in one place (no torch, no machine: CPU stand-ins, fakes)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from gputopo.errors import UsageError
from gputopo.findings import Finding
from gputopo.probe.plan.config import DeviceInventory, ProbeConfig
from gputopo.probe.plan.nodes import NodeOptions
from gputopo.probe.shared import ProbeRun
from gputopo.services import probe

NODE = NodeOptions(nnodes=2, node_rank=0, host="node01", port=29400, rdzv_id="t")


@dataclass(frozen=True)
class FakeHealth:
    """A judged health sample whose driver asks to drain P2P on some GPUs: the findings the drain rule
    (``services.machine.drained``) reads, as NVML's recovery action DRAIN_P2P makes them."""

    findings: tuple[Finding, ...]


def Health(drained: dict[int, str]) -> Any:  # noqa: N802 - stands in for a Judgement
    return FakeHealth(
        tuple(
            Finding(f"GPU{g}", what, "drain P2P work", gpu=g, action="drain", rule="recovery_drain_p2p")
            for g, what in drained.items()
        )
    )


def test_gpus_are_parsed_once_into_sets_and_handed_down_as_they_are(monkeypatch):
    sets = probe.gpu_sets(["1,0", "2,3"])
    assert sets == ((1, 0), (2, 3))  # rank order kept
    assert probe.gpu_sets(None) is None
    with pytest.raises(UsageError, match="--gpus"):
        probe.gpu_sets(["0,x"])

    # From here on nothing parses GPU lists again: the parsed sets reach the config as they are.
    def no_parsing(*_: object) -> None:
        raise AssertionError("--gpus parsed a second time")

    monkeypatch.setattr("gputopo.gpulist.parse_gpu_list", no_parsing)
    monkeypatch.setattr("gputopo.probe.plan.config.parse_gpu_list", no_parsing)
    # CPU stand-ins need torch to run, not to be planned: where torch is missing (the oldest-versions run)
    # the parsing is still checked.
    monkeypatch.setattr("gputopo.probe.pool.devices.require_torch", lambda: None)
    options = probe.Options(gpus=sets, device=probe.Device.CPU, dry_run=True, model=probe.ModelName.TINY)
    config = probe.configure(options, lambda _: None)
    assert config.sets == ((1, 0), (2, 3)) and config.device == "cpu"


def test_sizes_are_read_as_nccl_tests_reads_them():
    assert probe.byte_size("--min-bytes", "1K") == 1024
    assert probe.byte_size("--max-bytes", None) is None
    with pytest.raises(UsageError, match="--max-bytes"):
        probe.byte_size("--max-bytes", "lots")


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"each_pair": True}, "one set of its GPUs"),
        ({"gpus": ((0, 1), (2, 3))}, "one set of its GPUs"),
        ({"dry_run": True}, "one machine's plan"),
        ({"inject_gpus": "1"}, "--inject-node"),
        ({"inject_rank": 0}, "--inject-node"),
    ],
)
def test_options_across_nodes_refuse_what_only_one_machine_can_do(changes, words):
    with pytest.raises(UsageError, match=words):
        probe.Options(node=NODE, **changes)
    probe.Options(**changes)  # on one machine each is fine


def test_the_probe_leaves_a_drain_p2p_gpu_out_of_its_own_set_only():
    warned: list[str] = []
    health = Health({3: "recovery action DRAIN_P2P"})
    why = probe.p2p_left_out(health, (0, 1, 2, 3), None, warned.append)
    assert list(why) == [3] and "no multi-GPU set: recovery action DRAIN_P2P" in why[3]
    assert warned == [f"GPU3 left out: {why[3]}"]

    warned.clear()  # a set the user names keeps it, with a warning
    assert probe.p2p_left_out(health, (0, 1, 2, 3), ((2, 3),), warned.append) == {}
    assert warned == [
        "GPU3: the driver asks to keep P2P work off it (recovery action DRAIN_P2P); probed in a set as asked"
    ]

    warned.clear()  # alone it does no P2P work: nothing to say
    assert probe.p2p_left_out(health, (0, 1, 2, 3), ((3,),), warned.append) == {}
    assert probe.p2p_left_out(health, (3,), None, warned.append) == {}
    assert probe.p2p_left_out(Health({}), (0, 1), None, warned.append) == {}
    assert warned == []


def test_the_left_out_gpu_is_out_of_the_sets_and_named_in_the_plan(monkeypatch):
    inventory = DeviceInventory("cuda", (0, 1, 2, 3), ("a", "b", "c", "d"))
    sets, after = probe._keep_p2p_off(inventory, None, Health({3: "DRAIN_P2P"}), lambda _: None)
    assert sets == ((0, 1, 2),)
    assert after.gpus == (0, 1, 2, 3) and "DRAIN_P2P" in after.why_not[3]
    assert probe._keep_p2p_off(inventory, ((2, 3),), Health({3: "x"}), lambda _: None) == (
        ((2, 3),),
        inventory,
    )


def _run(tmp_path: Path) -> ProbeRun:
    config = ProbeConfig(device="cpu", sets=((0, 1),), checks=("ddp",), report_dir=tmp_path)
    return ProbeRun(config, (), {}, (), datetime(2026, 12, 6, tzinfo=timezone.utc), 1.0)


def test_the_report_builds_its_whole_document_in_one_place(tmp_path):
    report = probe.ProbeReport(_run(tmp_path), tmp_path, ("5,6: behind an ACS bridge",), "no check ran")
    doc = report.document()
    assert doc["schema"] == "gputopo/probe/v1" and doc["verdict"] == "skipped"
    assert doc["path_causes"] == ["5,6: behind an ACS bridge"] and doc["report"] is None
    keys = list(doc)
    assert keys.index("verdict") < keys.index("sets") and keys[-1] == "path_causes"  # keys where they were
    written = report.with_files({"json": "r.json", "markdown": "r.md"})
    assert written.document()["report"] == {"json": "r.json", "markdown": "r.md"}
    assert report.document()["report"] is None  # frozen: with_files makes a new report
    with pytest.raises(UsageError, match="nothing was tested: no check ran") as refused:
        probe.refuse_untested(written)
    assert "r.json" in str(refused.value.hint)
    assert written.exit_code == 0
    plain = probe.ProbeReport(_run(tmp_path), tmp_path)
    assert "path_causes" not in plain.document() and plain.document()["verdict"] == "pass"
    probe.refuse_untested(plain)  # something was tested: nothing raised


def test_a_node_report_names_its_files_and_fails_with_the_run():
    report = probe.NodesReport({"verdict": "fail", "report": None, "nodes": []}, None)
    assert report.exit_code == 1 and report.document()["report"] is None
    assert report.with_files({"json": "n.json"}).document()["report"] == {"json": "n.json"}
    assert probe.PlanReport({"schema": "gputopo/probe-plan/v1"}).exit_code == 0


def _invoke(monkeypatch: pytest.MonkeyPatch, report: probe.Report, *args: str) -> Any:
    """``gputopo probe ARGS`` in this process, its service's run replaced by ``report``."""
    from typer.testing import CliRunner

    from gputopo.cli import app

    monkeypatch.setattr(probe, "run", lambda options, hooks: report)
    return CliRunner().invoke(app, ["probe", "--device", "cpu", "--gpus", "0,1", *args])


def test_the_cli_writes_the_report_once_through_finish_with_one_warning_without_matplotlib(
    tmp_path, monkeypatch
):
    def no_matplotlib(doc: dict[str, Any]) -> str:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr("gputopo.ui.html_report.render_probe_html", no_matplotlib)
    reports = tmp_path / "reports"
    report = probe.ProbeReport(_run(tmp_path), reports, ("5,6: behind an ACS bridge",))
    result = _invoke(monkeypatch, report, "--json", "--report-dir", str(reports))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["path_causes"] == ["5,6: behind an ACS bridge"]
    assert sorted(doc["report"]) == ["json", "markdown"]  # no HTML without matplotlib
    assert sorted(p.suffix for p in reports.iterdir()) == [".json", ".md"]  # each file written once
    assert json.loads(Path(doc["report"]["json"]).read_text()) == doc  # the file is the document shown
    assert result.stderr.count("matplotlib is not installed") == 1


def test_the_cli_exits_2_naming_the_report_when_nothing_was_tested(tmp_path, monkeypatch):
    reports = tmp_path / "reports"
    result = _invoke(monkeypatch, probe.ProbeReport(_run(tmp_path), reports, None, "no check ran"), "--json")
    assert result.exit_code == 2 and result.stdout == ""
    assert "nothing was tested: no check ran" in result.stderr
    (written,) = reports.glob("*.json")
    assert str(written) in result.stderr.replace("\n", "")
    assert json.loads(written.read_text())["verdict"] == "skipped"


def test_the_cli_shows_the_dry_run_plan_and_writes_nothing(tmp_path, monkeypatch):
    plan = probe.PlanReport({"schema": "gputopo/probe-plan/v1", "device": "cpu", "launches": []})
    result = _invoke(monkeypatch, plan, "--json", "--report-dir", str(tmp_path / "reports"))
    assert result.exit_code == 0 and json.loads(result.stdout)["launches"] == []
    assert not (tmp_path / "reports").exists()
