"""Racks, not boxes (issue 34): the NVLink domain of GB200/GB300 trays and the fabric judged without false
alarms, on fake machines that carry the values of NVIDIA's real captures (tests/nvl_machines.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pynvml
import pytest

import fake_driver
import nvl_machines as m
from conftest import invoke
from gputopo.system import nvml

KINDS = ("gb300", "gb200", "b200", "h100")
FAST = ("--sample-s", "0.2", "--kernel-log", "/dev/null")
GB300_DOMAIN = "00000001-0000-0000-0000-000000000001.32766"
GB200_DOMAIN = "00000001-0000-0000-0000-000000000001.2"


def topo_json(fake: Any) -> dict[str, Any]:
    with fake.installed():
        result = invoke("topo", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def check_json(fake: Any) -> tuple[int, dict[str, Any]]:
    with fake.installed():
        result = invoke("check", "--json", *FAST)
    return result.exit_code, json.loads(result.stdout)


def test_each_tray_shows_its_domain_rack_and_tray_above_the_matrix() -> None:
    with m.tray("gb300").installed():
        text = invoke("topo", "--no-health").stdout
    assert f"NVLink domain: {GB300_DOMAIN} (clique 32766)" in text
    assert "Place: rack (chassis) 1820000000001, tray 15, slot 25" in text
    assert text.index("NVLink domain") < text.index("Legend:")  # above the matrix
    assert "Fabric: completed" in text and "Fabric health: healthy" in text
    with m.board("b200").installed():
        board = invoke("topo", "--no-health").stdout
    assert "NVLink domain: none (not multi-node NVLink" in board


@pytest.mark.parametrize(
    ("kind", "domain"),
    [("gb300", GB300_DOMAIN), ("gb200", GB200_DOMAIN), ("b200", None), ("h100", None)],
)
def test_topo_json_carries_the_domain_per_gpu_and_once_for_the_node(kind: str, domain: str | None) -> None:
    doc = topo_json(m.machine(kind))
    fabrics = [g["fabric"] for g in doc["gpus"]]
    assert all(f["state"] == "completed" and f["domain"] == domain for f in fabrics)
    if domain is None:
        assert doc["nvlink_domain"] is None
        return
    serial, tray, slot = ("1820000000001", 15, 25) if kind == "gb300" else ("1820000000001", 4, 14)
    assert doc["nvlink_domain"] == {
        "id": domain,
        "cluster_uuid": "00000001-0000-0000-0000-000000000001",
        "clique_id": int(domain.rsplit(".", 1)[1]),
        "chassis_serial": serial,
        "tray_index": tray,
        "slot": slot,
    }
    assert [f["module_id"] for f in fabrics] == [2, 1, 4, 3] and all(f["c2c"] for f in fabrics)


def test_two_racks_that_both_report_clique_32766_are_two_domains() -> None:
    a = topo_json(m.tray("gb300", rack=1, tray=3))["nvlink_domain"]
    b = topo_json(m.tray("gb300", rack=2, tray=3))["nvlink_domain"]
    assert a["clique_id"] == b["clique_id"] == 32766
    assert a["id"] != b["id"] and b["id"] == "00000002-0000-0000-0000-000000000002.32766"
    assert (a["chassis_serial"], b["chassis_serial"]) == ("1820000000001", "1820000000002")


@pytest.mark.parametrize("kind", KINDS)
def test_check_is_healthy_on_all_four_captures(kind: str) -> None:
    code, doc = check_json(m.machine(kind))
    fabric = [f for f in doc["findings"] if f["rule"] and f["rule"].startswith("fabric_")]
    assert fabric == [] and code == 0, doc["findings"]


FAULTS = {
    "registration stuck in progress": ({"fabric": (2, 0, 32766, 0x1AA)}, "fabric_in_progress", "note"),
    "status error with clique 0": ({"fabric": (3, 999, 0, 0x1AA)}, "fabric_not_ready", "problem"),
    "summary UNHEALTHY, bandwidth full": ({"fabric_summary": 2}, "fabric_summary_unhealthy", "problem"),
    "ROUTE_UNHEALTHY 0x19a": ({"fabric": (3, 0, 32766, 0x19A)}, "fabric_unhealthy", "problem"),
    "INSUFFICIENT_NVLINKS 0x5aa": ({"fabric": (3, 0, 32766, 0x5AA)}, "fabric_unhealthy", "problem"),
    "another cluster UUID": ({"fabric_uuid": m.cluster_uuid(9)}, "fabric_domain_split", "problem"),
    "in a rack, zero UUID": ({"fabric_uuid": m.ZERO_UUID}, "fabric_no_domain", "problem"),
    # Issue 42: the mask is judged in every registration state, as DCGM 4.6 MonitorFabricFields reads it
    # (DcgmHealthWatch.cpp lines 3612-3674 at 72fa3fe), and PARTITION_ASSIGNED FALSE (0x2000) is named.
    "NO_PARTITION 0x4aa while in progress": (
        {"fabric": (2, 0, 32766, 0x4AA), "fabric_summary": 2},
        "fabric_unhealthy",
        "problem",
    ),
    "PARTITION_ASSIGNED FALSE 0x21aa": ({"fabric": (3, 0, 32766, 0x21AA)}, "fabric_unhealthy", "problem"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fabric_fault_is_named_once(fault: str) -> None:
    change, rule, severity = FAULTS[fault]
    fake = m.tray("gb300")
    m.set_fabric(fake, 2, **change)
    code, doc = check_json(fake)
    fabric = [
        (f["gpu"], f["rule"], f["severity"]) for f in doc["findings"] if f["rule"].startswith("fabric_")
    ]
    assert fabric == [(2, rule, severity)], doc["findings"]
    assert code == (1 if severity == "problem" else 0)


def test_reads_the_oldest_bindings_lack_are_not_supported_never_errors() -> None:
    """nvidia-ml-py 12.535.77 has nvmlDeviceGetGpuFabricInfo (v1) only: no versioned call, no v4, no
    platform info, no C2C mode (its pynvml.py). Each is "not supported": the v1 registration still reads."""
    old = frozenset(
        {
            "nvmlDeviceGetGpuFabricInfoV",
            "nvmlDeviceGetGpuFabricInfo_v4",
            "nvmlDeviceGetPlatformInfo",
            "nvmlDeviceGetC2cModeInfoV",
        }
    )
    fake = m.tray("gb300", absent=old)
    with fake.installed(), nvml.session() as s:
        dev = s.device(0)
        info = dev.fabric_info()
        platform, c2c = dev.platform_info(), dev.c2c_enabled()
        assert s.warnings == []
    assert info.ok and info.value.version == 1 and info.value.health_mask is None
    assert info.value.cluster_uuid == m.cluster_uuid(1) and info.value.clique_id == 32766
    assert platform.code == nvml.NOT_IN_BINDINGS and c2c.code == nvml.NOT_IN_BINDINGS
    code, doc = check_json(m.tray("gb300", absent=old))
    assert code == 0 and not [f for f in doc["findings"] if f["rule"].startswith("fabric_")]
    assert topo_json(m.tray("gb300", absent=old))["nvlink_domain"]["id"] == GB300_DOMAIN


def test_a_driver_without_v3_answers_v2_and_one_without_v4_has_no_clique_list() -> None:
    fake = m.tray("gb200")
    for g in fake.gpus:
        g.health.fabric_summary = None  # ARGUMENT_VERSION_MISMATCH for v3
    m.set_fabric(fake, 1, fabric_cliques=((0, 2), (1, 2), (2, 7)), fabric_summary=1)
    with fake.installed(), nvml.session() as s:
        v2, v3 = s.device(0).fabric_info().value, s.device(1).fabric_info().value
    assert (v2.version, v2.health_summary, v2.health_mask, v2.cliques) == (2, None, 0xAA, None)
    assert (v3.version, v3.health_summary, v3.cliques) == (3, 1, ((0, 2), (1, 2), (2, 7)))


# --- The real nvidia-ml-py against the fake driver (tests/fakedriver/fake_nvml.c) ---------------------------

needs_cc = pytest.mark.skipif(fake_driver.compiler() is None, reason="no C compiler to build the fake driver")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


@needs_cc
@pytest.mark.parametrize("kind", KINDS)
def test_the_real_bindings_read_the_captures_through_the_fake_driver(
    driver: Path, tmp_path: Path, kind: str
) -> None:
    path = m.machine_file(tmp_path / f"{kind}.txt", kind, rack=2, tray_index=7)
    topo = fake_driver.run(driver, path, "topo", "--json", timeout=60)
    assert topo.returncode == 0, topo.stderr
    doc = json.loads(topo.stdout)
    checked = fake_driver.run(driver, path, "check", "--json", *FAST, timeout=60)
    report = json.loads(checked.stdout)
    assert checked.returncode == 0 and not [f for f in report["findings"] if f["rule"].startswith("fabric_")]
    fabric = doc["gpus"][0]["fabric"]
    if not hasattr(pynvml, "nvmlDeviceGetPlatformInfo"):
        # nvidia-ml-py 12.535.77 (the oldest allowed): the v1 registration only, the rest not supported.
        assert fabric["health_mask"] is None and fabric["chassis_serial"] is None
        return
    if kind in ("b200", "h100"):
        assert doc["nvlink_domain"] is None and fabric["clique_id"] == 0
        assert fabric["module_id"] == (6 if kind == "b200" else None)
        return
    assert doc["nvlink_domain"] == {
        "id": f"{m.cluster_uuid(2)}.{32766 if kind == 'gb300' else 2}",
        "cluster_uuid": "00000002-0000-0000-0000-000000000002",
        "clique_id": 32766 if kind == "gb300" else 2,
        "chassis_serial": "1820000000002",
        "tray_index": 7,
        "slot": 17,
    }
    assert fabric["health_summary"] == "healthy" and fabric["c2c"] is True


@needs_cc
def test_a_split_tray_is_one_problem_through_the_fake_driver(driver: Path, tmp_path: Path) -> None:
    lines = m.machine_lines("gb300", rack=1)
    lines = [
        ln.replace(m.cluster_uuid(1), m.cluster_uuid(5)) if ln.startswith("fabricv3 3 ") else ln
        for ln in lines
    ]
    path = tmp_path / "split.txt"
    path.write_text("\n".join(lines) + "\n")
    report = json.loads(fake_driver.run(driver, path, "check", "--json", *FAST, timeout=60).stdout)
    fabric = [(f["gpu"], f["rule"]) for f in report["findings"] if f["rule"].startswith("fabric_")]
    assert fabric == [(3, "fabric_domain_split")]  # the v1 struct of the oldest bindings has the UUID too


def test_doctor_and_its_reports_show_the_domain_and_the_fabric_findings(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # the HTML report's pictures (the probe extra)
    from gputopo.services.doctor import DoctorOptions, run_doctor
    from gputopo.topology import parse_smi
    from gputopo.ui.doctor_markdown import to_markdown, topology_text
    from gputopo.ui.html_report import render_html

    fake = m.tray("gb300")
    m.set_fabric(fake, 1, fabric=(3, 0, 32766, 0x5AA))  # INSUFFICIENT_NVLINKS
    with fake.installed():
        doc = run_doctor(DoctorOptions(skip_probe=True, report_dir=tmp_path))
    assert doc["topology"]["nvlink_domain"]["id"] == GB300_DOMAIN
    found = [f for f in doc["findings"] if f.get("rule") == "fabric_unhealthy"]
    assert [(f["gpu"], f["severity"]) for f in found] == [(1, "problem")]
    assert "insufficient NVLinks" in found[0]["what"]
    md, page = to_markdown(doc), render_html(doc)
    for text in (md, page):
        assert f"NVLink domain: {GB300_DOMAIN}" in text and "tray 15" in text
        assert "insufficient NVLinks" in text
    # The report's topology still reads back as `nvidia-smi topo -m` text.
    again = parse_smi.parse_topo_text(topology_text(doc["topology"]))
    assert again.matrix.labels[:4] == ("GPU0", "GPU1", "GPU2", "GPU3")


@needs_cc
@pytest.mark.skipif(
    not fake_driver.bindings_read_fabric_health(), reason="no fabric v2/v3 call to read a mask"
)
def test_a_mask_fault_in_progress_is_a_problem_through_the_fake_driver(driver: Path, tmp_path: Path) -> None:
    # Issue 42: GPU 1 stuck "in progress" with mask 0x4aa (NO_PARTITION) and summary UNHEALTHY: DCGM fails
    # it; before, gputopo gave a note. GPU 2: 0x21aa, PARTITION_ASSIGNED FALSE.
    lines = m.machine_lines("gb300", rack=1)
    lines = [
        "fabric 1 2 0 32766 4aa"
        if ln.startswith("fabric 1 ")
        else ln.replace(" 1aa", " 21aa")
        if ln.startswith("fabric 2 ")
        else "fabricv3 1 " + ln.split()[2] + " 2"
        if ln.startswith("fabricv3 1 ")
        else ln
        for ln in lines
    ]
    path = tmp_path / "stuck.txt"
    path.write_text("\n".join(lines) + "\n")
    done = fake_driver.run(driver, path, "check", "--json", *FAST, timeout=60)
    report = json.loads(done.stdout)
    fabric = {f["gpu"]: f for f in report["findings"] if f["rule"].startswith("fabric_")}
    assert sorted(fabric) == [1, 2] and done.returncode == 1, report["findings"]
    assert fabric[1]["severity"] == "problem" and "no partition" in fabric[1]["what"]
    assert "registration in progress" in fabric[1]["what"]
    assert "PARTITION_ASSIGNED FALSE" in fabric[2]["what"]
