"""Health reads through the real nvidia-ml-py over the fake driver (tests/fakedriver): every signal, the
older driver without the newer symbols, NOT_SUPPORTED per field, permission refused per call, a GPU lost
or hung mid-read, and counters that rise between the two samples.

Each test runs the reads in a fresh Python (only a new process can load the fake ``libnvidia-ml.so.1``),
through the NVML worker with its deadline, exactly as ``gputopo check`` will.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fake_driver

pytestmark = pytest.mark.skipif(
    fake_driver.compiler() is None, reason="no C compiler to build the fake driver"
)

SWITCH = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH

READ = """
import json
from gputopo.health.judge import judge
from gputopo.system.health_reads import read_two_samples

first, second = read_two_samples({window}, timeout_s={timeout})
result = judge(first, second)
print(json.dumps({{
    "driver": second.driver_version,
    "first": {{g.index: g.to_json() for g in first.gpus}},
    "second": {{g.index: g.to_json() for g in second.gpus}},
    "window_s": second.taken_s - first.taken_s,
    "findings": [f.to_json() for f in result.findings],
    "not_checked": [n.to_json() for n in result.not_checked],
}}))
"""


def bus(i: int) -> str:
    return f"00000000:{0x18 + 0x10 * i:02X}:00.0"


def h100(i: int) -> list[str]:
    return [
        f"gpu {i} {bus(i)} GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x} {i} NVIDIA H100 80GB HBM3",
        f"pcie {i} 5 5 16 16",
    ]


def healthy(i: int, links: int = 4) -> list[str]:
    """Every health value of a sound H100 SXM on NVSwitches."""
    return [
        *h100(i),
        f"ecc {i} 1 1",
        f"eccerr {i} 0 0 0 0",
        f"remap {i} 0 0 0 0",
        f"clocks {i} 1",
        f"temp {i} 34",
        f"power {i} 71000 700000",
        f"replay {i} 0",
        f"persist {i} 1",
        f"vbios {i} 96.00.99.00.01",
        f"field {i} 230 0",
        f"fabric {i} 3 0 7 aa",  # every health field answered and fine (nvml.h: 2 = FALSE)
        *(f"link {i} {k} 1 - {SWITCH}" for k in range(links)),
        *(f"nverr {i} {k} 0 0 0 0" for k in range(links)),
    ]


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


@pytest.fixture(scope="module")
def old_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("old-driver"), old=True)


def read(lib: Path, tmp_path: Path, lines: list[str], window: float = 0.2, timeout: float = 10) -> dict:
    machine = tmp_path / "machine.txt"
    machine.write_text("\n".join(["driver 570.86.15", "cuda 12080", *lines]) + "\n")
    done = fake_driver.run_python(lib, machine, READ.format(window=window, timeout=timeout))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    doc["first"] = {int(k): v for k, v in doc["first"].items()}
    doc["second"] = {int(k): v for k, v in doc["second"].items()}
    return doc


def problems(doc: dict, gpu: int) -> list[dict]:
    return [f for f in doc["findings"] if f["gpu"] == gpu and f["severity"] == "problem"]


@fake_driver.NEEDS_FABRIC_BINDINGS
def test_a_sound_node_reads_every_signal_and_is_healthy(driver: Path, tmp_path: Path) -> None:
    doc = read(driver, tmp_path, [*healthy(0), *healthy(1)])
    g = doc["second"][0]
    assert doc["driver"] == "570.86.15"
    assert (g["ecc_enabled"], g["ecc_volatile_uncorrected"], g["ecc_aggregate_corrected"]) == (True, 0, 0)
    assert (g["remapped_rows_pending"], g["remapped_rows_failure"], g["clocks_event_reasons"]) == (
        False,
        False,
        1,
    )
    assert (g["temperature_c"], g["power_w"], g["power_limit_w"]) == (34, 71.0, 700.0)
    assert (g["pcie_gen_current"], g["pcie_width_max"], g["pcie_replays"], g["persistence_mode"]) == (
        5,
        16,
        0,
        True,
    )
    assert (g["recovery_action"], g["fabric_state"], g["fabric_status"], g["fabric_clique_id"]) == (
        0,
        3,
        0,
        7,
    )
    assert g["vbios_version"] == "96.00.99.00.01"
    assert [(n["link"], n["up"], n["remote_kind"], n["crc_flit_errors"]) for n in g["nvlinks"]] == [
        (k, True, "switch", 0) for k in range(4)
    ]
    assert g["unknown"] == []
    assert doc["findings"] == [] and doc["not_checked"] == []


def test_the_sick_node_of_the_issue(driver: Path, tmp_path: Path) -> None:
    lines = [
        *healthy(0),
        "remap 0 12 3 1 0",  # pending remap (the later line wins)
        *healthy(1),
        "eccerr 1 0 1 0 1",
        *healthy(2),
        "clocks 2 48",  # HW slowdown + HW thermal (0x8 | 0x40)
        "temp 2 92",
        *healthy(3, links=18),
        "link 3 7 0 - 2",
        "link 3 9 0 - 2",
        "rise 3 nvl_crc_flit 400 0",
        *healthy(4),
        "pcie 4 5 5 8 16",
        "field 4 230 1",  # the driver asks for a GPU reset
    ]
    doc = read(driver, tmp_path, lines, window=0.5)
    # A pending remap is reset-when-convenient (DCGM warns): a note, never a drain.
    assert [(f["severity"], f["what"]) for f in doc["findings"] if f["gpu"] == 0] == [
        ("note", "a row remapping is pending on GPU0")
    ]
    assert "1 uncorrectable ECC errors on GPU1" in problems(doc, 1)[0]["what"]
    assert {f["category"] for f in problems(doc, 2)} == {"power", "thermal"}
    nv = problems(doc, 3)
    assert nv[0]["what"].startswith("GPU3: 2 of its 18 NVLinks are down (link 7, 9, to NVSwitches)")
    assert "NVLink CRC flit errors rose by 400" in nv[1]["what"]
    assert [f["what"] for f in problems(doc, 4)] == [
        "GPU4: the driver asks for recovery: GPU reset (NVML recovery action 1)"
    ]
    assert [(f["gpu"], f["severity"]) for f in doc["findings"] if "x8 of x16" in f["what"]] == [(4, "note")]


def test_counters_rise_between_the_samples(driver: Path, tmp_path: Path) -> None:
    lines = [
        *healthy(0),
        "replay 0 1000",
        "rise 0 pcie_replay 7",
        "rise 0 ecc_vol_corr 2",
        "rise 0 nvl_replay 1 2",
    ]
    doc = read(driver, tmp_path, lines)
    a, b = doc["first"][0], doc["second"][0]
    assert (a["pcie_replays"], b["pcie_replays"]) == (1000, 1007)
    assert (a["ecc_volatile_corrected"], b["ecc_volatile_corrected"]) == (0, 2)
    assert (a["nvlinks"][2]["replay_errors"], b["nvlinks"][2]["replay_errors"]) == (0, 1)
    whats = [f["what"] for f in problems(doc, 0)]
    assert any("NVLink replay errors rose by 1" in w and "link 2: +1" in w for w in whats)
    # 7 replays in the window stay under the Gen5 x16 link's 31 a minute (DCGM's per-minute count).
    assert not any("PCIe replays" in f["what"] for f in doc["findings"])
    assert doc["window_s"] >= 0.2


def test_the_old_driver_lacks_the_newer_symbols(old_driver: Path, tmp_path: Path) -> None:
    lines = [*healthy(0), "clocks 0 40", "retired 0 2 1 0"]  # HW thermal, read through the throttle name
    doc = read(old_driver, tmp_path, lines)
    g = doc["second"][0]
    assert g["clocks_event_reasons"] == 0x40
    assert g["remapped_rows_pending"] is None and (g["retired_pages_sbe"], g["retired_pages_dbe"]) == (2, 1)
    assert g["fabric_state"] is None
    assert [f["category"] for f in problems(doc, 0)] == ["thermal"]
    # Page retirement answered, so the missing row remapper is no gap; the fabric on NVSwitches is.
    assert doc["not_checked"] == [{"what": "GPU0: NVLink fabric state", "why": "Function Not Found"}]


def test_not_supported_per_field_and_refused_per_call_are_unknown_with_why(
    driver: Path, tmp_path: Path
) -> None:
    lines = [
        *healthy(0),
        "fielderr 0 230 3",  # this driver has field values but not the recovery action field
        "err 0 nvmlDeviceGetRemappedRows 4",  # Insufficient Permissions
        "err 0 nvmlDeviceGetCurrentClocksEventReasons 3",
    ]
    doc = read(driver, tmp_path, lines)
    g = doc["second"][0]
    assert g["recovery_action"] is None and g["clocks_event_reasons"] is None
    assert g["ecc_enabled"] is True  # the other values are still read
    assert {(u["what"], u["why"]) for u in g["unknown"]} == {
        ("driver recovery action", "Not Supported"),
        ("remapped rows", "Insufficient Permissions"),
        ("retired pages", "Not Supported"),
        ("clocks event reasons", "Not Supported"),
    }
    assert doc["findings"] == []  # unknown is never a fault...
    assert {n["what"] for n in doc["not_checked"]} >= {"GPU0: driver recovery action", "GPU0: remapped rows"}


def test_a_pcie_card_without_health_support_lists_what_it_lacks(driver: Path, tmp_path: Path) -> None:
    doc = read(driver, tmp_path, h100(0))  # nothing but name and link: every health call NOT_SUPPORTED
    assert doc["findings"] == []
    checked = {n["what"] for n in doc["not_checked"]}
    assert {"GPU0: ECC mode", "GPU0: clocks event reasons", "GPU0: driver recovery action"} <= checked
    assert "GPU0: NVLink fabric state" not in checked  # no NVSwitch links: nothing to register


def test_a_gpu_lost_or_hung_mid_read_is_marked_and_the_others_are_read(driver: Path, tmp_path: Path) -> None:
    lines = [
        *healthy(0),
        *healthy(1),
        "err 1 nvmlDeviceGetEccMode 15",  # GPU is lost
        *healthy(2),
        "hang 2 nvmlDeviceGetTemperature",
        *healthy(3),
    ]
    doc = read(driver, tmp_path, lines, timeout=2)
    assert (doc["second"][1]["error"], doc["second"][1]["state"]) == ("GPU is lost", "failing")
    hung = doc["second"][2]
    assert hung["state"] == "not responding" and "within 2 s" in hung["error"]
    assert doc["second"][3]["ecc_enabled"] is True and doc["second"][3]["error"] is None
    assert {f["gpu"] for f in doc["findings"] if f["severity"] == "problem"} == {1, 2}


def test_a_gpu_the_budget_cut_from_the_second_sample_keeps_its_first_reading() -> None:
    # GPU1 was read in the first sample (a row remap pending) but the budget ran out before the second
    # read it: its states are still judged, and its counters' rise is "not checked", never "no rise".
    from gputopo.health.judge import judge as judge_samples
    from gputopo.health.readings import BUDGET_SPENT, NOT_READ, GpuHealth, HealthSample, Unknown
    from gputopo.system.health_reads import _keep_first_reads

    def sound(i: int, **kw: object) -> GpuHealth:
        return GpuHealth(index=i, ecc_enabled=True, ecc_volatile_uncorrected=0, **kw)  # type: ignore[arg-type]

    cut = GpuHealth(index=1, unknown=(Unknown(NOT_READ, BUDGET_SPENT),))
    first = HealthSample((sound(0), sound(1, remapped_rows_failure=True)), 0.0)
    second = HealthSample((sound(0), cut), 2.0)
    one, two = _keep_first_reads(first, second)
    assert two.gpu(1) == first.gpu(1) and one.gpu(1) is None and one.gpu(0) == first.gpu(0)
    j = judge_samples(one, two)
    assert [f.what for f in j.problems] == [
        "a row remapping failed on GPU1 (None rows remapped for uncorrectable errors)"
    ]
    assert any(n.what == "GPU1: error counters' rise" and n.why == "one sample only" for n in j.not_checked)
