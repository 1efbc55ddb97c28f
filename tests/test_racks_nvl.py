"""``gputopo nodes`` on facts the fake NVML makes: two GB300 NVL72 racks of 18 trays, each tray's facts
written by ``gputopo topo --json`` on that tray (tests/nvl_machines.py: the values of a real GB300 capture,
rack R with its own cluster UUID and chassis serial, both racks reporting the clique 32766), one tray with
a fabric fault that its own ``gputopo check --state`` found, and an HGX B200 board in no domain.

All 36 trays run in-process on the Python fake (fast); one tray of each rack also runs through the real
nvidia-ml-py on the C fake driver, and gives the same domain.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fake_driver
import nvl_machines as m
from conftest import invoke

FAST = ("--sample-s", "0.2", "--kernel-log", "/dev/null")
RACKS = (1, 2)
SICK = "r2t07"


def node_name(rack: int, tray: int) -> str:
    return f"r{rack}t{tray + 1:02d}"


@pytest.fixture(scope="module")
def facts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("facts")
    for rack in RACKS:
        for tray in range(18):
            node = node_name(rack, tray)
            fake = m.tray("gb300", rack=rack, tray=tray)
            env = {"SLURMD_NODENAME": node, "GPUTOPO_CHECK_STATE": ""}
            if node == SICK:
                # ROUTE_UNHEALTHY on GPU2 (health mask 0x19a): the tray's own check finds it and keeps it.
                m.set_fabric(fake, 2, fabric=(m.COMPLETED, 0, 32766, 0x19A))
                env["GPUTOPO_CHECK_STATE"] = str(folder.parent / f"{node}.state")
                with fake.installed():
                    checked = invoke("check", "--json", "--state", env["GPUTOPO_CHECK_STATE"], *FAST, env=env)
                assert checked.exit_code == 1, checked.output
            with fake.installed():
                topo = invoke("topo", "--json", env=env)
            assert topo.exit_code == 0, topo.output
            (folder / f"{node}.json").write_text(topo.stdout)
    with m.board("b200").installed():
        board = invoke("topo", "--json", env={"SLURMD_NODENAME": "hgx01", "GPUTOPO_CHECK_STATE": ""})
    (folder / "hgx01.json").write_text(board.stdout)
    return folder


def test_two_gb300_racks_on_clique_32766_are_two_domains_with_their_trays(facts: Path) -> None:
    result = invoke("nodes", str(facts), "--segment", "8", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [d["id"] for d in doc["domains"]] == [f"{m.cluster_uuid(r)}.32766" for r in RACKS]
    for rack, d in zip(RACKS, doc["domains"], strict=True):
        assert d["nodes"] == [node_name(rack, t) for t in range(18)]
        assert d["chassis_serial"] == m.chassis_serial(rack)
    healthy, sick = doc["domains"]
    assert len(healthy["fit"]) == 18 and healthy["unfit"] == []
    # The tray with the fabric fault is left out and named with its check's finding.
    assert [u["node"] for u in sick["unfit"]] == [SICK] and "GPU2" in sick["unfit"][0]["why"]
    assert len(sick["fit"]) == 17
    assert len(healthy["segments"]) == 2 and len(sick["segments"]) == 2
    assert all(SICK not in s for s in sick["segments"])
    # The HGX B200 board is in no NVLink domain: listed apart, in no segment.
    assert doc["unknown_domain"] == ["hgx01"]
    # Every tray but the sick one is unchecked (no check ran there): fit, and said so.
    assert len(healthy["unchecked"]) == 18 and SICK not in sick["unchecked"]


@fake_driver.NEEDS_FABRIC_BINDINGS
def test_the_real_bindings_on_the_c_fake_driver_give_the_same_domains(facts: Path, tmp_path: Path) -> None:
    if fake_driver.compiler() is None:
        pytest.skip("no C compiler to build the fake driver")
    lib = fake_driver.build(tmp_path / "lib")
    for rack in RACKS:
        node = node_name(rack, 4)
        path = m.machine_file(tmp_path / f"{node}.txt", "gb300", rack=rack, tray_index=4)
        done = fake_driver.run(lib, path, "topo", "--json", extra_env={"SLURMD_NODENAME": node}, timeout=60)
        assert done.returncode == 0, done.stderr
        real = json.loads(done.stdout)
        fake = json.loads((facts / f"{node}.json").read_text())
        assert real["node"] == node
        assert real["nvlink_domain"]["id"] == fake["nvlink_domain"]["id"] == f"{m.cluster_uuid(rack)}.32766"
        assert real["nvlink_domain"]["tray_index"] == 4
