"""One read per fact (issue 41, item 4): a live doctor reads the PCIe path table once for its own steps
(the health check's network half reads it once more, for the ports) and the device inventory once, for
its probes and for the inter-node tests alike. Counted at the readers: ``fabric``'s sysfs path reader and
the probe's device detection, each wrapped with a counter; the probe run and the inter-node launch are
stand-ins, so nothing here starts torch.

Before the service handed these down, the same run read the path table four times (the health check,
the first sets, the probe findings, the sets again) and the inventory twice (probes, then nodes)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from fake_nvml import FakeNvml
from gputopo.probe import shared
from gputopo.probe.plan.config import DeviceInventory
from gputopo.probe.plan.nodes import NodeOptions
from gputopo.probe.pool import devices, multinode, runner
from gputopo.services import doctor, fabric

GPUS = (0, 1, 2, 3, 4, 5, 6, 7)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """The readers, each call recorded: ``paths`` (fabric's PCIe path table) and ``inventory``."""
    calls: dict[str, list[Any]] = {"paths": [], "inventory": [], "probe": [], "cross": []}
    real_read_paths = fabric.read_paths

    def read_paths(bus_ids, fs=None):
        calls["paths"].append(list(bus_ids))
        return real_read_paths(bus_ids, fs)

    def detect_devices(requested, **options):
        calls["inventory"].append(requested)
        return DeviceInventory("cuda", GPUS, tuple(str(g) for g in GPUS))

    def run_probe(config, on_progress=None, plan=None, **handed):
        calls["probe"].append(plan)
        return shared.ProbeRun(config, (), {}, (), datetime.now(timezone.utc), 0.0)

    def run_cross(config, node, local, nics, on_row=None):
        calls["cross"].append(config)
        return None

    def judge_outcome(node, config, outcome):
        return [{"node_rank": 0, "verdict": "pass"}], {"status": "ok", "findings": []}

    monkeypatch.setattr(fabric, "read_paths", read_paths)
    monkeypatch.setattr(devices, "detect_devices", detect_devices)
    monkeypatch.setattr(devices, "require_torch", lambda: None)
    monkeypatch.setattr(runner, "run_probe", run_probe)
    monkeypatch.setattr(multinode, "run_cross", run_cross)
    monkeypatch.setattr(multinode, "judge_outcome", judge_outcome)
    return calls


def _live(tmp_path, **options: Any) -> dict[str, Any]:
    with FakeNvml.pcie_box().installed():
        return doctor.run_doctor(
            doctor.Options(health_sample_s=0, skip_speed=True, report_dir=tmp_path, env={}, **options)
        )


def test_a_live_doctor_reads_the_pcie_path_table_once_for_its_steps(tmp_path, counted):
    doc = _live(tmp_path)
    assert doc["simulated"] is False and doc["health"]["checked"] is True
    assert counted["probe"], "the probes ran (the sets are chosen again from their evidence)"
    # One read, by the health check's network half (every GPU's path, and the NICs'); doctor's own steps
    # (sets, probe findings, sets again) take the redirected pairs from it.
    assert len(counted["paths"]) == 1, counted["paths"]
    assert len(counted["paths"][0]) >= len(GPUS)  # every GPU's bus id (and each NIC's)


def test_the_inventory_is_read_once_for_the_probes_and_the_nodes(tmp_path, counted):
    node = NodeOptions(nnodes=2, node_rank=0, host="localhost", port=29999, rdzv_id="t")
    doc = _live(tmp_path, node=node)
    assert counted["probe"] and counted["cross"], "both the probes and the inter-node tests ran"
    assert counted["inventory"] == [None]  # one read, live (CUDA if any)
    assert doc["nodes"] == [{"node_rank": 0, "verdict": "pass"}] and doc["internode"]["status"] == "ok"
    assert doc["headline"].endswith("; across 2 nodes: every node passed")


def test_no_inventory_is_read_where_nothing_is_probed(tmp_path, counted):
    _live(tmp_path, skip_probe=True)
    assert counted["inventory"] == [] and counted["probe"] == []


def test_a_run_stopped_during_the_probes_hands_up_the_report_so_far(tmp_path, counted, monkeypatch):
    import signal

    from gputopo.errors import Interrupted

    def stopped(config, on_progress=None, plan=None, **handed):
        raise Interrupted(signal.SIGTERM, "SIGTERM")

    monkeypatch.setattr(runner, "run_probe", stopped)
    with pytest.raises(Interrupted) as caught:
        _live(tmp_path)
    report = caught.value.partial
    assert isinstance(report, doctor.DoctorReport)
    doc = report.document()
    assert doc["verdict"] == "interrupted" and doc["interrupted"] == "SIGTERM"
    assert doc["headline"].startswith("interrupted by SIGTERM; ") and doc["topology"]["gpus"]
    assert "report" not in doc  # written as it stops: it names no files
    assert report.exit_code == 1


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"model": "bogus"}, "--model bogus: unknown model"),
        ({"health_sample_s": 61.0}, "--sample-s 61: must be 0 to 60 seconds"),
        ({"steps": 0}, "--steps 0: must be at least 1"),
        ({"timeout_s": 0.0}, "--timeout 0: must be positive"),
        ({"inject_gpus": "0,1"}, "--inject and --inject-gpus go together"),
    ],
)
def test_options_are_validated_once_when_built(options, words):
    """Every cross-option rule of doctor sits in ``Options.__post_init__``: bad input is refused before
    anything is read (exit 2), whoever builds the options."""
    from gputopo.errors import UsageError

    with pytest.raises(UsageError, match=words):
        doctor.Options(**options)
