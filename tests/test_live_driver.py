"""The live path against the real nvidia-ml-py, with a fake driver library under it (tests/fakedriver).

Each test starts ``python -m gputopo`` with the fake ``libnvidia-ml.so.1`` first on ``LD_LIBRARY_PATH``,
so every call goes through pynvml's own ctypes marshalling, error classes and symbol lookup (a function
the fake driver lacks is FunctionNotFound, as on an old driver). The subprocess timeout is the guard
against a hang: a command that does not end in time fails the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import fake_driver
from fake_driver import bus, eight_gpu_machine, uuid

pytestmark = pytest.mark.skipif(
    fake_driver.compiler() is None, reason="no C compiler to build the fake driver"
)

# One deadline for every run here: short, since GPU6 of the test machine hangs on purpose.
TIMEOUT = ("--nvml-timeout", "2")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


@pytest.fixture(scope="module")
def old_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("old-driver"), old=True)


def machine(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "machine.txt"
    path.write_text(text)
    return path


def topo_json(lib: Path, machine_file: Path) -> dict:
    result = fake_driver.run(lib, machine_file, "topo", "--json", *TIMEOUT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def eight(driver: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``topo --json`` of the done-when machine (see fake_driver.EIGHT_GPU_LINES), read once."""
    return topo_json(driver, machine(tmp_path_factory.mktemp("eight"), eight_gpu_machine()))


def gpu(doc: dict, index: int) -> dict:
    return next(g for g in doc["gpus"] if g["index"] == index)


def test_matrix_of_the_gpus_that_answered(eight: dict) -> None:
    cells = eight["matrix"]["cells"]
    assert eight["source"] == "nvml" and eight["driver_version"] == "550.54.15"
    assert cells[0][1] == cells[1][0] == "NV4"
    assert cells[0][2] == cells[1][2] == "PHB"
    assert cells[5][7] == "PHB"
    assert cells[0][5] == cells[2][7] == "SYS"
    for broken in (3, 4, 6):  # lost, refused, hung: unknown, not guessed
        assert all(cells[broken][j] is None for j in range(8) if j != broken)
    assert eight["p2p"]["read"][0][7] == "OK" and eight["p2p"]["read"][0][3] is None


def test_lost_refused_and_hung_gpus_are_marked_each_in_its_own_way(eight: dict) -> None:
    lost, refused, hung = gpu(eight, 3), gpu(eight, 4), gpu(eight, 6)
    assert (lost["state"], lost["error"]) == ("failing", "GPU is lost")
    assert (refused["state"], refused["error"]) == ("not accessible", "Insufficient Permissions")
    assert hung["state"] == "not responding" and "within 2 s" in hung["error"]
    assert all(g[k] is None for g in (lost, refused, hung) for k in ("name", "uuid", "pci_bus_id"))


def test_gpus_next_to_the_broken_ones_are_intact(eight: dict) -> None:
    for i in (0, 1, 2, 5, 7):
        g = gpu(eight, i)
        assert (g["error"], g["state"], g["uuid"], g["pci_bus_id"]) == (None, None, uuid(i), bus(i))
        assert g["name"] == "NVIDIA H100 PCIe" and g["memory_total_mib"] == 81559


def test_one_field_error_blanks_that_field_only_with_a_warning(eight: dict) -> None:
    g0 = gpu(eight, 0)
    assert g0["utilization_pct"] is None and g0["error"] is None
    assert g0["cpu_affinity"] == "0-31" and g0["numa_affinity"] == "0"
    assert "GPU0: UtilizationRates is n/a: NVML said Unknown Error" in eight["warnings"]


def test_memory_used_comes_from_the_v2_call_without_the_drivers_reservation(eight: dict) -> None:
    assert gpu(eight, 0)["memory_used_mib"] == 0  # v1 would say 512 (the reservation)
    assert gpu(eight, 7)["memory_used_mib"] == 40000


def test_mig_gpu_lists_its_mig_devices(eight: dict) -> None:
    g5 = gpu(eight, 5)
    assert g5["mig_enabled"] is True
    assert g5["mig_devices"] == [
        "MIG-aaaaaaaa-0000-0000-0000-000000000001",
        "MIG-aaaaaaaa-0000-0000-0000-000000000002",
    ]
    assert gpu(eight, 0)["mig_enabled"] is False


def test_bridgeless_nvlink_card_is_not_links_down(eight: dict) -> None:
    assert gpu(eight, 2)["nvlink_bridge"] is False
    assert gpu(eight, 0)["nvlink_bridge"] is True and gpu(eight, 7)["nvlink_bridge"] is None
    assert not any("NVLinks are down" in w for w in eight["warnings"])
    assert {(p["gpu"], p["peer"]) for p in eight["nvlinks"]} == {(0, 1), (1, 0)}


def test_pcie_downclocked_while_busy_and_narrowed_while_idle(eight: dict) -> None:
    g7, g1 = gpu(eight, 7), gpu(eight, 1)
    assert g7["utilization_pct"] == 95 and g7["compute_pids"] == [4242]
    assert (g7["pcie"]["gen_current"], g7["pcie"]["gen_max"]) == (3, 5)
    assert (g1["pcie"]["width_current"], g1["pcie"]["width_max"]) == (8, 16)


def test_topo_text_names_each_state(driver: Path, tmp_path: Path) -> None:
    result = fake_driver.run(driver, machine(tmp_path, eight_gpu_machine()), "topo", *TIMEOUT)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # The health column: a lost or hung GPU is a problem; one refused for permission is unknown.
    assert "GPU3  PROBLEM  FAILING: GPU is lost" in out
    assert "GPU4  ?        not accessible from here: Insufficient Permissions" in out
    assert "GPU6  PROBLEM  NOT RESPONDING: NVML did not answer GPU6 within 2 s" in out
    assert "GPU5: MIG enabled, left out of probes and sets" in out
    assert "GPU2: has NVLinks but no bridge" in out
    assert "GPU4 is not accessible from here" in result.stderr


def test_recommend_leaves_out_lost_refused_mig_and_hung_gpus_with_the_reason(
    driver: Path, tmp_path: Path
) -> None:
    result = fake_driver.run(
        driver, machine(tmp_path, eight_gpu_machine()), "recommend", "-n", "2", "--json", *TIMEOUT
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    why = {e["gpu"]: e["why"] for e in doc["excluded"]}
    assert why[3] == "failing: GPU is lost"
    assert why[4] == "not accessible: Insufficient Permissions"
    assert why[5].startswith("MIG enabled (2 MIG devices")
    assert why[6].startswith("not responding: NVML did not answer GPU6")
    assert why[7].startswith("busy: 1 compute process (pid 4242)")
    assert set(why) == {3, 4, 5, 6, 7}
    assert doc["candidates"][0]["gpus"] == [0, 1]


def test_driver_without_memory_v2_or_mig_functions(old_driver: Path, tmp_path: Path) -> None:
    doc = topo_json(old_driver, machine(tmp_path, eight_gpu_machine()))
    g0, g5 = gpu(doc, 0), gpu(doc, 5)
    assert g0["memory_used_mib"] == 512  # v1: the reservation counts as used
    assert g5["mig_enabled"] is None and g5["error"] is None
    # FunctionNotFound is "not available here", never a warning or a failing GPU.
    assert not any("FunctionNotFound" in w or "Function Not Found" in w for w in doc["warnings"])
    assert gpu(doc, 2)["nvlink_bridge"] is False


@pytest.mark.parametrize(
    "code, words",
    [(999, "Unknown Error"), (27, "Not Ready"), (29, "Invalid State"), (14, "Corrupted infoROM")],
)
def test_unexpected_errors_on_one_value_keep_the_row(
    driver: Path, tmp_path: Path, code: int, words: str
) -> None:
    text = eight_gpu_machine(
        f"err 1 nvmlDeviceGetMemoryInfo_v2 {code}",
        f"err 1 nvmlDeviceGetMemoryInfo {code}",
        f"err 0 nvmlDeviceGetNvLinkRemotePciInfo_v2 {code}",
    )
    doc = topo_json(driver, machine(tmp_path, text))
    g1 = gpu(doc, 1)
    assert g1["error"] is None and g1["memory_used_mib"] is None and g1["uuid"] == uuid(1)
    assert f"GPU1: MemoryInfo is n/a: NVML said {words}" in doc["warnings"]
    # GPU0's NVLinks lost their far end: the links are not guessed, GPU0 itself stays.
    assert gpu(doc, 0)["error"] is None and gpu(doc, 0)["uuid"] == uuid(0)
    assert doc["warnings"].count(f"GPU0: NvLinkRemotePciInfo is n/a: NVML said {words}") == 1
    assert "GPU0: 4 NVLinks lead to a device NVML does not name; not counted" in doc["warnings"]


def test_links_down_because_the_bridged_partner_is_lost_stay_a_problem(driver: Path, tmp_path: Path) -> None:
    lines = [ln for ln in eight_gpu_machine().splitlines() if not ln.startswith("link 0 ")]
    lines += [f"link 0 {k} 0 {bus(1)} 0" for k in range(4)] + ["handle 1 15"]
    doc = topo_json(driver, machine(tmp_path, "\n".join(lines) + "\n"))
    assert gpu(doc, 1)["state"] == "failing"
    assert "GPU0: 4 of 4 NVLinks are down" in doc["warnings"]
    assert gpu(doc, 0)["nvlink_bridge"] is True  # bridged, its partner gone: not "no bridge"


def test_nvml_init_that_never_returns_ends_the_command(driver: Path, tmp_path: Path) -> None:
    result = fake_driver.run(driver, machine(tmp_path, "hang-init\n"), "topo", *TIMEOUT, timeout=60)
    assert result.returncode == 3
    assert "NVML did not answer nvmlInit within 2 s" in result.stderr
    assert "Traceback" not in result.stderr


def test_no_driver_config_is_driver_not_loaded(driver: Path, tmp_path: Path) -> None:
    result = fake_driver.run(driver, tmp_path / "absent.txt", "topo", *TIMEOUT)
    assert result.returncode == 3
    assert "no NVIDIA driver or NVML found" in result.stderr


def test_bad_nvml_timeout_is_a_usage_error(driver: Path, tmp_path: Path) -> None:
    result = fake_driver.run(driver, machine(tmp_path, eight_gpu_machine()), "topo", "--nvml-timeout", "0")
    assert result.returncode == 2
    assert "--nvml-timeout 0: must be positive" in result.stderr


def dry_run(driver: Path, tmp_path: Path, *args: str, preset: str | None = None):
    extra = {"CUDA_VISIBLE_DEVICES": preset} if preset is not None else {}
    extra["NCCL_DEBUG"] = "INFO"
    return fake_driver.run(
        driver, machine(tmp_path, eight_gpu_machine()), "probe", "--dry-run", *args, *TIMEOUT, extra_env=extra
    )


def test_probe_dry_run_names_the_uuids_without_a_preset(driver: Path, tmp_path: Path) -> None:
    result = dry_run(driver, tmp_path, "--json", "--gpus", "7,1")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["schema"] == "gputopo/probe-plan/v1" and doc["device"] == "cuda"
    launches = doc["launches"]
    assert [c for launch in launches for c in launch["checks"]] == ["gpu", "p2p", "dp", "ddp", "allreduce"]
    for launch in launches:
        assert launch["gpus"] == [7, 1] and launch["uuids"] == [uuid(7), uuid(1)]
        assert launch["bus_ids"] == [bus(7), bus(1)]
        # One pool of ranks, pool rank r on the r-th GPU in ascending order: GPU1 is rank 0, GPU7 rank 1.
        assert launch["ranks"] == [1, 0]
        assert launch["env"]["CUDA_VISIBLE_DEVICES"] == f"{uuid(1)},{uuid(7)}"
        assert launch["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert launch["env"]["NCCL_DEBUG"] == "INFO"  # inherited by the ranks
    assert doc["pool"]["gpus"] == [1, 7]
    assert {e["gpu"] for e in doc["left_out"]} == {3, 4, 5, 6}


def test_probe_dry_run_default_set_leaves_out_what_cannot_be_probed(driver: Path, tmp_path: Path) -> None:
    result = dry_run(driver, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "round 0: GPUs 0,1,2,7: gpu" in result.stdout and "round 1: GPUs 0,1,2,7: p2p" in result.stdout
    assert "GPUs 0,1,2,7: allreduce" in result.stdout
    assert "GPU5 left out: MIG enabled" in result.stdout


def test_probe_dry_run_with_a_preset_of_uuids(driver: Path, tmp_path: Path) -> None:
    result = dry_run(driver, tmp_path, "--json", "--gpus", "2,1", preset=f"{uuid(1)},{uuid(2)}")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["gpus_allowed"] == [1, 2]
    assert doc["launches"][0]["gpus"] == [2, 1]
    assert doc["launches"][0]["env"]["CUDA_VISIBLE_DEVICES"] == f"{uuid(1)},{uuid(2)}"


def test_probe_dry_run_refuses_a_gpu_outside_the_preset(driver: Path, tmp_path: Path) -> None:
    result = dry_run(driver, tmp_path, "--gpus", "0,1", preset=f"{uuid(1)},{uuid(2)}")
    assert result.returncode == 2
    assert "GPU0 cannot be probed: not in CUDA_VISIBLE_DEVICES" in result.stderr
    assert "the GPUs you may probe are 1,2" in result.stderr


def test_probe_dry_run_refuses_the_mig_gpu_with_the_reason(driver: Path, tmp_path: Path) -> None:
    result = dry_run(driver, tmp_path, "--gpus", "5,7")
    assert result.returncode == 2
    assert "GPU5 cannot be probed: MIG enabled" in result.stderr


def test_probe_dry_run_starts_no_torch(driver: Path, tmp_path: Path) -> None:
    # A torch that cannot even be imported: the dry run must not need it.
    stub = tmp_path / "stub"
    (stub / "torch").mkdir(parents=True)
    (stub / "torch" / "__init__.py").write_text("raise ImportError('torch must not be imported')\n")
    result = fake_driver.run(
        driver,
        machine(tmp_path, eight_gpu_machine()),
        "probe",
        "--dry-run",
        "--json",
        *TIMEOUT,
        extra_env={"PYTHONPATH": f"{fake_driver.SRC}:{stub}"},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["launches"][0]["gpus"] == [0, 1, 2, 7]


LISTINGS = """
import sys
from gputopo.system import nvml_worker
from gputopo.system.inventory import gpu_processes, minor_numbers
nvml_worker.LIST_TIMEOUT_S = float(sys.argv[1])
print(repr((gpu_processes(), minor_numbers())))
"""


def listings(lib: Path, machine_file: Path, timeout_s: float) -> str:
    """kill-stale's NVML listings, in a process started on the fake machine (the loader reads
    LD_LIBRARY_PATH at start, so this process cannot switch to the fake driver)."""
    env = fake_driver.env_for(lib, machine_file)
    done = subprocess.run(
        [sys.executable, "-c", LISTINGS, str(timeout_s)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_process_and_minor_listings_come_from_the_worker(driver: Path, tmp_path: Path) -> None:
    got = listings(driver, machine(tmp_path, eight_gpu_machine()), 30)
    assert got == (
        "([GpuProcess(pid=4242, gpu_index=7, used_memory_mib=40000)], {0: 0, 1: 1, 2: 2, 5: 5, 6: 6, 7: 7})"
    )


def test_process_listing_on_a_hung_gpu_ends_unknown(driver: Path, tmp_path: Path) -> None:
    assert listings(driver, machine(tmp_path, eight_gpu_machine("hang 7 *")), 1) == "(None, None)"


def test_doctor_on_the_eight_gpu_machine_ends_and_advises_only_where_it_should(
    driver: Path, tmp_path: Path
) -> None:
    result = fake_driver.run(
        driver,
        machine(tmp_path, eight_gpu_machine()),
        "doctor",
        "--skip-probe",
        "--json",
        "--report-dir",
        str(tmp_path / "reports"),
        *TIMEOUT,
    )
    assert result.returncode == 1, result.stderr  # problems found: the lost and the hung GPU
    findings = {f["where"]: f for f in json.loads(result.stdout)["findings"]}
    assert findings["GPU3"]["severity"] == "problem" and "reset the GPU" in findings["GPU3"]["remedy"]
    assert (
        findings["GPU6"]["severity"] == "problem"
        and "did not answer NVML in time" in findings["GPU6"]["what"]
    )
    # Not yours, and MIG: notes without hardware advice.
    assert findings["GPU4"]["severity"] == "note" and "RMA" not in findings["GPU4"]["remedy"]
    assert findings["GPU5"]["severity"] == "note" and "MIG is enabled" in findings["GPU5"]["what"]
    assert "GPU2" not in findings  # no bridge is not a fault


def test_a_pair_query_that_hangs_leaves_that_pair_unknown_and_the_rest_read(
    driver: Path, tmp_path: Path
) -> None:
    # Every P2P query asked from GPU7's side hangs (the fake matches the first device of a pair).
    doc = topo_json(driver, machine(tmp_path, eight_gpu_machine("hang 7 nvmlDeviceGetP2PStatus")))
    assert gpu(doc, 7)["error"] is None and gpu(doc, 7)["uuid"] == uuid(7)
    assert doc["matrix"]["cells"][0][1] == "NV4" and doc["p2p"]["read"][0][1] == "OK"
    assert doc["matrix"]["cells"][5][7] is None  # its path was asked in the request that hung
    assert "NVML did not answer GPU5-GPU7 within 2 s; its path and P2P status are unknown" in doc["warnings"]


@pytest.mark.parametrize("code, words", [(4, "Insufficient Permissions"), (17, "The operating system")])
def test_handles_refused_for_permission_or_by_cgroups_are_not_accessible(
    driver: Path, tmp_path: Path, code: int, words: str
) -> None:
    lines = [ln for ln in eight_gpu_machine().splitlines() if not ln.startswith(("handle", "hang"))]
    lines += [f"handle 6 {code}", f"handle 7 {code}"]
    doc = topo_json(driver, machine(tmp_path, "\n".join(lines) + "\n"))
    for i in (6, 7):
        assert gpu(doc, i)["state"] == "not accessible" and gpu(doc, i)["error"].startswith(words)
    assert gpu(doc, 3)["state"] is None and gpu(doc, 3)["uuid"] == uuid(3)


def recovery_board(tmp_path: Path) -> Path:
    """Eight idle H100s; NVML recovery action (field 230) DRAIN_P2P (3) on GPU3, GPU_RESET (1) on GPU6."""
    lines = [
        "driver 570.86.15",
        *(f"gpu {i} {bus(i)} {uuid(i)} {i} NVIDIA H100 PCIe" for i in range(8)),
        *(f"pcie {i} 5 5 16 16" for i in range(8)),
        *(f"mem {i} 81559 0 512" for i in range(8)),
        *(f"mig {i} 0 0" for i in range(8)),
        *(f"field {i} 230 {({3: 3, 6: 1}).get(i, 0)}" for i in range(8)),
    ]
    return machine(tmp_path, "\n".join(lines) + "\n")


def test_recommend_on_a_recovery_action_board_keeps_p2p_work_off_a_drain_p2p_gpu(
    driver: Path, tmp_path: Path
) -> None:
    """NVML's recovery action read through the real pynvml (field 230): DRAIN_P2P (3) on GPU3 keeps it out
    of every set of two or more, said why; GPU_RESET (1) on GPU6 keeps it out of every set; n=1 may use 3."""
    board = recovery_board(tmp_path)
    result = fake_driver.run(driver, board, "recommend", "--n", "4", "--json", *TIMEOUT)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    why = {e["gpu"]: e["why"] for e in doc["excluded"]}
    assert set(why) == {3, 6}, why
    assert "the driver asks to keep P2P work off it" in why[3] and "GPU reset" in why[6]
    assert not {3, 6} & set(doc["candidates"][0]["gpus"])
    one = json.loads(fake_driver.run(driver, board, "recommend", "--n", "1", "--json", *TIMEOUT).stdout)
    assert [e["gpu"] for e in one["excluded"]] == [6]


def test_doctor_sets_on_a_recovery_action_board_keep_p2p_work_off_a_drain_p2p_gpu(
    driver: Path, tmp_path: Path
) -> None:
    """doctor's health window sees DRAIN_P2P on GPU3 (a note) and GPU_RESET on GPU6 (a problem): no
    recommended set holds either, GPU3 is listed as left out of the sets with the driver's reason."""
    result = fake_driver.run(
        driver,
        recovery_board(tmp_path),
        "doctor",
        "--skip-probe",
        "--json",
        "--report-dir",
        str(tmp_path / "reports"),
        *TIMEOUT,
    )
    assert result.returncode == 1, result.stderr  # GPU6's reset is a problem
    doc = json.loads(result.stdout)
    why = {e["gpu"]: e["why"] for e in doc["left_out"]}
    assert set(why) == {3, 6}, why
    assert "the driver asks to keep P2P work off it, so no multi-GPU set" in why[3]
    recs = {r["n"]: r for r in doc["recommendations"]}
    assert sorted(recs) == [2, 4, 6], recs  # six GPUs left for a set: 0,1,2,4,5,7
    for r in recs.values():
        assert r["best"] is not None and not {3, 6} & set(r["best"]["gpus"]), r


def test_probe_default_set_on_a_recovery_action_board_leaves_the_drain_p2p_gpu_out(
    driver: Path, tmp_path: Path
) -> None:
    """probe's own pick (no --gpus) leaves GPU3 out with the reason; a set the user names keeps it, warned."""
    board = recovery_board(tmp_path)
    result = fake_driver.run(driver, board, "probe", "--dry-run", "--json", *TIMEOUT)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert {g for launch in doc["launches"] for g in launch["gpus"]} == {0, 1, 2, 4, 5, 6, 7}
    left = {e["gpu"]: e["why"] for e in doc["left_out"]}
    assert "the driver asks to keep P2P work off it" in left[3]
    assert "GPU3 left out: the driver asks to keep P2P work off it" in result.stderr
    named = fake_driver.run(driver, board, "probe", "--dry-run", "--json", "--gpus", "2,3", *TIMEOUT)
    assert named.returncode == 0, named.stderr
    assert [launch["gpus"] for launch in json.loads(named.stdout)["launches"]][0] == [2, 3]
    assert "GPU3: the driver asks to keep P2P work off it" in named.stderr
    one = fake_driver.run(driver, board, "probe", "--dry-run", "--json", "--gpus", "3", *TIMEOUT)
    assert one.returncode == 0 and "P2P" not in one.stderr, one.stderr
