"""GPU states (pure): failing vs not accessible vs not responding vs MIG, through recommend, findings,
the topo view and snapshots."""

from __future__ import annotations

import io
from dataclasses import replace

from gputopo.findings import NOTE, PROBLEM, link_findings
from gputopo.model import GPU_FAILING, GPU_NOT_ACCESSIBLE, GPU_NOT_RESPONDING, Gpu
from gputopo.recommend import Constraints, exclusions
from gputopo.topology import samples, snapshot
from gputopo.ui.topo_view import render_topology


def machine():
    topo = samples.load("seed-8gpu-nv4")
    gpus = list(topo.gpus)
    gpus[1] = replace(gpus[1], error="GPU is lost", state=GPU_FAILING)
    gpus[2] = replace(gpus[2], error="Insufficient Permissions", state=GPU_NOT_ACCESSIBLE)
    gpus[3] = replace(gpus[3], error="NVML did not answer GPU3 within 5 s", state=GPU_NOT_RESPONDING)
    gpus[4] = replace(gpus[4], mig_enabled=True, mig_devices=("MIG-1", "MIG-2"))
    gpus[5] = replace(gpus[5], nvlink_bridge=False, mig_enabled=False)
    return replace(topo, gpus=tuple(gpus))


def test_states_and_reasons() -> None:
    topo = machine()
    assert Gpu(0, error="GPU is lost").failing  # snapshots from before states: an error is failing
    assert topo.gpu(1).failing and not topo.gpu(2).failing and not topo.gpu(3).failing
    assert topo.gpu(2).unavailable_reason == "not accessible: Insufficient Permissions"
    assert topo.gpu(4).unavailable_reason.startswith("MIG enabled (2 MIG devices")
    assert topo.gpu(5).unavailable_reason is None


def test_recommend_excludes_each_with_its_reason() -> None:
    why = {e.gpu: e.why for e in exclusions(machine(), Constraints(n=2))}
    assert why[1] == "failing: GPU is lost"
    assert why[2] == "not accessible: Insufficient Permissions"
    assert why[3] == "not responding: NVML did not answer GPU3 within 5 s"
    assert why[4].startswith("MIG enabled")
    assert 5 not in why


def test_only_failing_and_hung_gpus_get_hardware_advice() -> None:
    found = {f.where: f for f in link_findings(machine())}
    assert found["GPU1"].severity == PROBLEM and "RMA" in found["GPU1"].remedy
    assert found["GPU3"].severity == PROBLEM and "Xid" in found["GPU3"].remedy
    assert found["GPU2"].severity == NOTE and "RMA" not in found["GPU2"].remedy
    assert found["GPU4"].severity == NOTE
    assert "GPU5" not in found


def test_topo_view_names_the_states() -> None:
    from rich.console import Console

    console = Console(width=200, no_color=True, record=True, file=io.StringIO())
    console.print(render_topology(replace(machine(), live=True)))
    text = console.export_text()
    assert "FAILING: GPU is lost" in text
    assert "not accessible from here: Insufficient Permissions" in text
    assert "NOT RESPONDING: NVML did not answer GPU3 within 5 s" in text
    assert "GPU4: MIG enabled, left out of probes and sets; MIG devices: MIG-1, MIG-2" in text
    assert "GPU5: has NVLinks but no bridge" in text


def test_snapshot_round_trip_keeps_the_states() -> None:
    topo = machine()
    back = snapshot.loads(snapshot.dumps(topo), source="x")
    assert back.gpus == topo.gpus
