"""Link problems a topology shows by itself, on the fake NVML machines."""

from __future__ import annotations

from dataclasses import replace

from fake_nvml import NVSWITCH, FakeLink, FakeNvml
from gputopo.findings import NOTE, PROBLEM, link_findings
from gputopo.system.inventory import read_live
from gputopo.topology import samples


def test_sample_machine_has_no_findings():
    assert link_findings(samples.load("seed-8gpu-nv4")) == []


def test_busy_gpu_on_a_narrow_link_is_a_problem_idle_ones_are_not():
    with FakeNvml.pcie_box().installed():
        topo = read_live()
    problems = [f for f in link_findings(topo) if f.severity == PROBLEM]
    assert [f.where for f in problems] == ["GPU2"]
    assert "Gen4 x8 while busy" in problems[0].what
    notes = [f for f in link_findings(topo) if f.severity == NOTE]
    # GPU pairs across sockets report CNS: one note about host staging, not a problem per pair.
    assert len(notes) == 1
    assert "CNS on 15 pair(s)" in notes[0].what


def test_lost_gpu_and_its_nvlinks_down_are_problems():
    with FakeNvml.lost_gpu_box().installed():
        topo = read_live()
    found = link_findings(topo)
    assert found[0].where == "GPU5" and "does not answer NVML (GPU is lost)" in found[0].what
    assert found[0].severity == PROBLEM


def test_nvlinks_down_between_two_answering_gpus():
    with FakeNvml.nvlink_box().installed():
        topo = read_live()
    assert topo.nvlinks is not None
    degraded = tuple(
        replace(p, links_up=2, links_down=2) if {p.gpu, p.peer} == {6, 7} else p for p in topo.nvlinks
    )
    found = [f for f in link_findings(replace(topo, nvlinks=degraded)) if f.severity == PROBLEM]
    assert [(f.where, f.what) for f in found] == [("GPU6-GPU7", "2 of 4 NVLinks are down")]


def test_p2p_not_ok_over_nvlink_is_a_problem():
    with FakeNvml.nvlink_box().installed():
        topo = read_live()
    assert [f for f in link_findings(topo) if f.severity == PROBLEM] == []
    assert topo.p2p is not None
    broken = {
        cap: tuple(
            tuple(("CNS" if {i, j} == {0, 1} else c) for j, c in enumerate(row)) for i, row in enumerate(m)
        )
        for cap, m in topo.p2p.items()
    }
    found = [f for f in link_findings(replace(topo, p2p=broken)) if f.severity == PROBLEM]
    assert [(f.where, f.severity) for f in found] == [("GPU0-GPU1", PROBLEM)]
    assert "over NV4" in found[0].what


def test_nvswitch_links_down_are_the_gpus_once_not_every_pairs():
    # HGX H100: 2 of GPU3's 18 links to the NVSwitches are down. Every pair of GPU3 reads NV16 from
    # GPU3's side; the finding names GPU3 once, and no pair (issue 22 item 13).
    fake = FakeNvml.nvswitch_box()
    fake.gpus[3].links = tuple(FakeLink(NVSWITCH, up=k not in (4, 9)) for k in range(18))
    with fake.installed():
        topo = read_live()
    found = [f for f in link_findings(topo) if f.category == "nvlink"]
    assert [(f.where, f.gpu, f.what.split(" (")[0]) for f in found] == [
        ("GPU3", 3, "GPU3: 2 of its 18 NVLinks are down")
    ]
    assert found[0].severity == PROBLEM


def test_a_direct_nvlink_down_stays_the_pairs():
    # A bridge (direct GPU-GPU links) with a link down: that is the pair's, named by the pair.
    with FakeNvml.nvlink_box().installed():
        topo = read_live()
    assert topo.nvlinks is not None
    old = tuple(
        replace(p, links_up=3, links_down=1) if (p.gpu, p.peer) == (0, 1) else p for p in topo.nvlinks
    )
    found = [f for f in link_findings(replace(topo, nvlinks=old)) if f.category == "nvlink"]
    assert [(f.where, f.what) for f in found] == [("GPU0-GPU1", "1 of 4 NVLinks are down")]
