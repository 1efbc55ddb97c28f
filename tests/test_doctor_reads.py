"""Doctor hands down what it read: on a live machine (the fake driver under the real nvidia-ml-py) it
reads the topology once and samples health once per window, and the probe step reads neither again.

Counted at the driver: the fake library appends every call it answers to ``FAKE_NVML_TRACE``, from every
process of the command (the NVML worker included), so a second topology pass or a third health sample
shows up whichever process makes it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

import fake_driver

pytestmark = pytest.mark.skipif(
    fake_driver.compiler() is None, reason="no C compiler to build the fake driver"
)

GPUS = 4
PAIR_CALL = "nvmlDeviceGetTopologyCommonAncestor"  # one per GPU pair per topology read
HEALTH_CALL = "nvmlDeviceGetRemappedRows"  # one per GPU per health sample


def _machine(path: Path) -> Path:
    lines = ["driver 550.54.15", "cuda 12040"]
    for i in range(GPUS):
        lines += [
            f"gpu {i} {fake_driver.bus(i)} {fake_driver.uuid(i)} {i} NVIDIA H100 PCIe",
            f"pcie {i} 5 5 16 16",
            f"mem {i} 81559 0 512",
            f"ecc {i} 1 1",
            f"eccerr {i} 0 0 0 0",
            f"remap {i} 0 0 0 0",
            f"clocks {i} 1",
            f"temp {i} 34",
            f"power {i} 71000 350000",
            f"replay {i} 0",
            f"persist {i} 1",
            f"field {i} 230 0",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _calls(driver: Path, machine: Path, trace: Path, *args: str) -> tuple[Counter[str], dict]:
    trace.unlink(missing_ok=True)
    done = fake_driver.run(driver, machine, *args, "--json", extra_env={"FAKE_NVML_TRACE": str(trace)})
    assert done.returncode in (0, 1), done.stderr
    calls = (
        Counter(line.split()[0] for line in trace.read_text().splitlines()) if trace.exists() else Counter()
    )
    return calls, json.loads(done.stdout)


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def test_a_live_doctor_reads_the_topology_once_and_health_once_per_window(driver: Path, tmp_path: Path):
    machine = _machine(tmp_path / "machine.txt")
    trace = tmp_path / "trace.txt"
    topo, _ = _calls(driver, machine, trace, "topo", "--no-health")
    per_read = topo[PAIR_CALL]
    assert per_read > 0 and topo[HEALTH_CALL] == 0  # what one topology read costs, and no health
    args = ("doctor", "--skip-speed", "--sample-s", "0.2", "--no-html", "--report-dir", str(tmp_path / "r"))
    doctor, doc = _calls(driver, machine, trace, *args)
    assert doc["health"]["checked"] is True
    # The probe step ran as far as this machine allows (no CUDA for torch here: it says so) and read the
    # machine through what doctor handed it, not through NVML again.
    assert doctor[PAIR_CALL] == per_read, f"{doctor[PAIR_CALL] // per_read} topology reads"
    assert doctor[HEALTH_CALL] == 2 * GPUS  # one window: two samples of every GPU, nothing more
