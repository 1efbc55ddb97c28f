"""Golden baselines: saved on a known-good HGX H100 node, compared on the same node after things broke and
on a sibling of the same build (other UUIDs, same bus ids)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gputopo.errors import EXIT_USAGE, InputError
from gputopo.findings import NOTE, PROBLEM
from gputopo.health import baseline
from gputopo.health.readings import GpuHealth, HealthSample, NvlinkHealth
from gputopo.model import Matrix, NvlinkPeer, PcieLink, Topology
from gputopo.topology import samples


def hgx() -> Topology:
    """The built-in HGX H100 sample with its NVSwitch links as NVML reports them (18 per pair)."""
    topo = samples.load("hgx-h100-nvswitch")
    peers = tuple(NvlinkPeer(a, b, 18) for a in range(8) for b in range(8) if a != b)
    return replace(topo, nvlinks=peers, driver_version="570.86.15", cuda_driver_version="12.8")


def health(
    topo: Topology, links_up: dict[int, int] | None = None, vbios: str = "96.00.99.00.01"
) -> HealthSample:
    links_up = links_up or {}
    gpus = tuple(
        GpuHealth(
            index=g.index,
            pci_bus_id=g.pci_bus_id,
            vbios_version=vbios,
            nvlinks=tuple(NvlinkHealth(k, k < links_up.get(g.index, 18), "switch") for k in range(18)),
        )
        for g in topo.gpus
    )
    return HealthSample(gpus, 0.0)


def saved() -> dict:
    topo = hgx()
    return baseline.loads(baseline.dumps(baseline.baseline_from(topo, health(topo))).encode(), "golden.json")


def test_the_baseline_holds_the_nodes_picture() -> None:
    doc = saved()
    assert doc["schema"] == "gputopo/baseline/v1" and doc["gpu_count"] == 8
    g0 = doc["gpus"][0]
    assert g0["pci_bus_id"] == hgx().gpus[0].pci_bus_id and g0["nvlinks_up"] == 18
    assert (g0["pcie_gen_max"], g0["pcie_width_max"], g0["vbios"]) == (5, 16, "96.00.99.00.01")
    assert g0["cpu_affinity"] and g0["numa_affinity"] is not None
    assert len(doc["nvlink_pairs"]) == 28 and {p["links"] for p in doc["nvlink_pairs"]} == {18}
    assert doc["matrix"]["labels"][:2] == ["GPU0", "GPU1"] and doc["nics"]
    assert (doc["driver_version"], doc["cuda_driver_version"]) == ("570.86.15", "12.8")


def test_the_same_node_compares_clean() -> None:
    topo = hgx()
    assert baseline.compare(saved(), baseline.baseline_from(topo, health(topo))) == []


def test_a_missing_gpu_is_a_problem_and_its_pairs_are_not_double_counted() -> None:
    topo = hgx()
    keep = [g for g in topo.gpus if g.index != 5]
    labels = [g.label for g in keep] + [n.label for n in topo.nics]
    idx = [topo.matrix.labels.index(lab) for lab in labels]
    cells = tuple(tuple(topo.matrix.cells[r][c] for c in idx) for r in idx)
    broken = replace(
        topo,
        gpus=tuple(keep),
        matrix=Matrix(tuple(labels), cells),
        nvlinks=tuple(p for p in topo.nvlinks or () if 5 not in (p.gpu, p.peer)),
    )
    found = baseline.compare(saved(), baseline.baseline_from(broken, health(broken)))
    assert [(f.where, f.severity, f.action) for f in found] == [
        ("node", PROBLEM, "drain"),
        (f"GPU at {topo.gpus[5].pci_bus_id}", PROBLEM, "drain"),
    ]
    assert "7 GPUs, the baseline has 8" in found[0].what


def test_an_nvlink_fewer_per_gpu_and_per_pair() -> None:
    topo = hgx()
    fewer = replace(
        topo,
        nvlinks=tuple(
            replace(p, links_up=16, links_down=0) if {p.gpu, p.peer} == {0, 1} else p
            for p in topo.nvlinks or ()
        ),
    )
    found = baseline.compare(saved(), baseline.baseline_from(fewer, health(fewer, links_up={3: 16})))
    assert {(f.where, f.severity, f.category) for f in found} == {
        ("GPU3", PROBLEM, "nvlink"),
        ("GPU0-GPU1", PROBLEM, "nvlink"),
    }
    assert any("16 NVLinks up, the baseline has 18" in f.what for f in found)


def test_a_lower_max_pcie_width_is_a_problem() -> None:
    topo = hgx()
    narrow = replace(
        topo,
        gpus=tuple(
            replace(g, pcie=PcieLink(gen_max=5, width_max=8)) if g.index == 2 else g for g in topo.gpus
        ),
    )
    (f,) = baseline.compare(saved(), baseline.baseline_from(narrow, health(narrow)))
    assert (f.where, f.gpu, f.severity, f.category) == ("GPU2", 2, PROBLEM, "pcie")
    assert "maximum PCIe width x8, the baseline has x16" in f.what


def test_a_changed_matrix_cell_or_a_missing_nic_is_a_problem() -> None:
    topo = hgx()
    cells = [list(r) for r in topo.matrix.cells]
    nic0 = topo.matrix.labels.index(topo.nics[0].label)
    old = cells[0][nic0]
    cells[0][nic0] = cells[nic0][0] = "SYS" if old != "SYS" else "PIX"
    moved = replace(topo, matrix=Matrix(topo.matrix.labels, tuple(tuple(r) for r in cells)))
    (f,) = baseline.compare(saved(), baseline.baseline_from(moved, health(moved)))
    assert (f.severity, f.category) == (PROBLEM, "topology") and f"the baseline has {old}" in f.what
    no_nic = replace(topo, nics=topo.nics[1:])
    found = baseline.compare(saved(), baseline.baseline_from(no_nic, health(no_nic)))
    assert [f.where for f in found if f.severity == PROBLEM] == [
        f"NIC {topo.nics[0].name or topo.nics[0].label}"
    ]


def test_a_sibling_node_matches_by_bus_id_uuid_driver_and_vbios_changes_are_notes() -> None:
    topo = hgx()
    sibling = replace(
        topo,
        gpus=tuple(replace(g, uuid=f"GPU-sibling-{g.index}") for g in topo.gpus),
        driver_version="575.51.03",
    )
    doc = saved()
    for g in doc["gpus"]:
        g["uuid"] = f"GPU-golden-{g['index']}"
    found = baseline.compare(doc, baseline.baseline_from(sibling, health(sibling, vbios="96.00.A0.00.01")))
    assert found and {f.severity for f in found} == {NOTE}
    whats = " / ".join(f.what for f in found)
    assert "driver 575.51.03, the baseline has 570.86.15" in whats
    assert "VBIOS 96.00.A0.00.01" in whats and "UUID GPU-sibling-0, the baseline has GPU-golden-0" in whats


def test_bus_ids_match_across_domain_widths() -> None:
    doc = saved()
    for g in doc["gpus"]:
        g["pci_bus_id"] = g["pci_bus_id"][4:].lower()  # 0000:1b:00.0, as older tools wrote it
    topo = hgx()
    assert baseline.compare(doc, baseline.baseline_from(topo, health(topo))) == []


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"schema": "gputopo/topology/v1", "gpus": []}', "schema 'gputopo/topology/v1', expected"),
        (b'{"schema": "gputopo/baseline/v1", "gpu_count": 8, "gpus": [', "truncated"),
        (b"not json at all", "not JSON"),
        (b'{"schema": "gputopo/baseline/v1", "gpu_count": 8}', "no gpus, nvlink_pairs, matrix, nics"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[1, 2]", "schema None"),
    ],
)
def test_a_bad_baseline_is_one_line_and_exit_2(data: bytes, message: str) -> None:
    with pytest.raises(InputError) as err:
        baseline.loads(data, "golden.json")
    assert message in err.value.message and "\n" not in err.value.message
    assert err.value.exit_code == EXIT_USAGE


def test_a_baseline_cut_short_anywhere_is_refused() -> None:
    text = baseline.dumps(saved())
    for cut in (len(text) // 3, len(text) // 2, len(text) - 3):
        with pytest.raises(InputError):
            baseline.loads(text[:cut].encode(), "golden.json")


def test_a_part_of_the_wrong_shape_is_refused() -> None:
    doc = saved()
    doc["nvlink_pairs"] = [{"a": "x"}]
    with pytest.raises(InputError, match="wrong shape"):
        baseline.loads(json.dumps(doc).encode(), "golden.json")
