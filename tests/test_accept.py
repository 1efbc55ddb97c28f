"""``gputopo accept`` on the fake driver's boards (the real pynvml over tests/fakedriver), with CPU ranks
standing in for the GPUs: a healthy board accepted (floors "not applicable"), and each kind of sick board
rejected at the right step with the right action; the floors as data; the verdict's JSON shape and exit
codes; the verdict kept in the check state and made stale by a driver or GPU change.

No test here turns on a healthy stand-in's speed (a loaded machine may leave it "undecided", which passes);
the slow drill plants a quarter of the speed, far above any noise (tests/test_probe_pergpu_run.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import fake_driver
import own_procs
from test_health_reads import healthy

pytestmark = pytest.mark.skipif(
    fake_driver.compiler() is None, reason="no C compiler to build the fake driver"
)

FAST = ("--sample-s", "0.2", "--kernel-log", "/dev/null", "--nvml-timeout", "2")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def board(
    tmp_path: Path, n: int, *extra: str, driver_version: str = "570.86.15", name: str = "m.txt"
) -> Path:
    """``n`` sound H100 SXMs on NVSwitches (tests/test_health_reads.healthy) and ``extra`` lines."""
    lines = [f"driver {driver_version}", "cuda 12080", *(ln for i in range(n) for ln in healthy(i)), *extra]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def accept(
    driver: Path, machine: Path, tmp_path: Path, *args: str, timeout: float = 300
) -> tuple[int, dict, str]:
    """``gputopo accept --json`` on ``machine``; (exit code, document, stderr). Nothing it started is left."""
    marker = own_procs.new_marker()
    done = fake_driver.run(
        driver,
        machine,
        "accept",
        "--json",
        "--report-dir",
        str(tmp_path / "reports"),
        *FAST,
        *args,
        timeout=timeout,
        extra_env={own_procs.MARKER_VAR: marker},
    )
    assert not own_procs.wait_for_none_left(marker), "accept left processes running"
    assert done.stdout, done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout), done.stderr


def steps_of(doc: dict) -> dict[str, dict]:
    return {s["name"]: s for s in doc["steps"]}


# --- rejected before any probe (no torch needed) ------------------------------------------------------


def test_a_gpu_missing_against_expect_gpus_8_is_rejected_at_inventory(driver: Path, tmp_path: Path) -> None:
    code, doc, _ = accept(driver, board(tmp_path, 7), tmp_path, "--expect-gpus", "8", "--device", "cpu")
    assert code == 1 and doc["schema"] == "gputopo/accept/v1" and doc["verdict"] == "rejected"
    steps = steps_of(doc)
    assert list(steps) == ["inventory", "health", "per_gpu", "wiring"]  # no DCGM step unless asked
    inv = steps["inventory"]
    assert inv["status"] == "failed" and inv["summary"].startswith("7 GPUs present, 8 expected")
    assert inv["action"] == "replace the GPU"
    assert {steps[s]["status"] for s in ("health", "per_gpu", "wiring")} == {"not run"}
    assert doc["reason"].startswith("rejected at inventory: 7 GPUs present, 8 expected")
    assert doc["actions"] == [{"step": "inventory", "action": "replace the GPU", "why": inv["summary"]}]
    # The report files doctor writes: JSON, Markdown, HTML, named in the document.
    assert {k for k in doc["report"]} == {"json", "markdown", "html"}
    assert json.loads(Path(doc["report"]["json"]).read_text())["verdict"] == "rejected"
    assert "| inventory | failed |" in Path(doc["report"]["markdown"]).read_text()


def test_a_row_remapping_failure_is_rejected_at_health_with_its_action(driver: Path, tmp_path: Path) -> None:
    code, doc, _ = accept(driver, board(tmp_path, 2, "remap 1 0 2 0 1"), tmp_path, "--device", "cpu")
    assert code == 1 and doc["verdict"] == "rejected"
    steps = steps_of(doc)
    assert steps["inventory"]["status"] == "passed"
    health = steps["health"]
    assert health["status"] == "failed" and "row remapping failed on GPU1" in health["summary"]
    assert health["action"] in ("replace the GPU", "reset the GPU"), health["action"]
    assert any(f["gpu"] == 1 and f["severity"] == "problem" for f in health["findings"])
    assert steps["per_gpu"]["status"] == "not run" and steps["wiring"]["status"] == "not run"


def test_two_vbios_versions_on_one_model_and_a_wrong_model_fail_the_inventory(
    driver: Path, tmp_path: Path
) -> None:
    machine = board(tmp_path, 2, "vbios 1 96.00.99.00.02")
    code, doc, _ = accept(driver, machine, tmp_path, "--expect-model", "B200", "--device", "cpu")
    assert code == 1
    words = [f["what"] for f in steps_of(doc)["inventory"]["findings"]]
    assert any("2 VBIOS versions on one node" in w for w in words), words
    assert any("not 'B200' (--expect-model)" in w for w in words), words


def test_on_a_rack_tray_a_gpu_not_registered_with_the_fabric_or_in_another_domain_fails_the_inventory(
    driver: Path, tmp_path: Path
) -> None:
    # GPU1's fabric registration still in progress (state 2); GPU2 in another clique (8, not 7).
    machine = board(tmp_path, 3, "fabric 1 2 0 7 aa", "fabric 2 3 0 8 aa")
    code, doc, _ = accept(driver, machine, tmp_path, "--device", "cpu")
    assert code == 1
    inv = steps_of(doc)["inventory"]
    words = [f["what"] for f in inv["findings"]]
    assert inv["status"] == "failed" and inv["action"] == "contact support", inv  # the domain split is worst
    assert any(
        w.startswith("GPU1 is not registered with the NVLink fabric (registration in progress") for w in words
    )
    assert any("the tray's GPUs are in 2 NVLink domains" in w for w in words), words


def test_no_driver_is_not_checked_exit_3_naming_each_step(driver: Path, tmp_path: Path) -> None:
    """No NVML (the fake driver without a machine file answers DriverNotLoaded), no CUDA: nothing could be
    judged and nothing failed: "not checked", every step with its reason, exit 3."""
    env = fake_driver.env_for(driver, tmp_path / "none.txt")
    env.pop("FAKE_NVML_CONFIG")
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "gputopo", "accept", "--json", "--report-dir", str(tmp_path / "r"), *FAST],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    doc = json.loads(done.stdout)
    assert doc["verdict"] == "not checked"
    assert {s["status"] for s in doc["steps"]} == {"not checked"}
    assert [n["step"] for n in doc["not_checked"]] == ["inventory", "health", "per_gpu", "wiring"]
    assert all(n["why"] for n in doc["not_checked"])


@pytest.mark.parametrize(
    "args, words",
    [
        (("--budget", "0"), "--budget 0: must be more than 0 seconds"),
        (("--expect-gpus", "0"), "--expect-gpus 0: must be 1 or more"),
        (("--dcgm-level", "5"), "--dcgm-level 5: DCGM's levels are 1 to 4"),
        (("--dry-run",), "--dry-run: only with --gate"),
        (("--inject", "sdc"), "--inject sdc needs --inject-gpus"),
        (("--inject", "nan", "--inject-gpus", "1"), "accept plants only the per-GPU check's drills"),
        (("--device", "tpu"), "--device tpu: not a device"),
        (("--inject", "sdc", "--inject-gpus", "x"), "--inject-gpus"),
    ],
)
def test_bad_options_are_one_line_and_exit_2_before_anything_is_read(
    driver: Path, tmp_path: Path, args: tuple[str, ...], words: str
) -> None:
    done = fake_driver.run(driver, board(tmp_path, 1), "accept", *args, "--report-dir", str(tmp_path / "r"))
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_a_bad_floors_file_is_one_line_exit_2(driver: Path, tmp_path: Path) -> None:
    bad = tmp_path / "floors.json"
    bad.write_text(
        '{"schema": "gputopo/accept-floors/v1", "models": [{"model": "X", "pattern": "X", '
        '"memory_gbps": {"floor": -1, "source": "s"}}]}'
    )
    done = fake_driver.run(driver, board(tmp_path, 1), "accept", "--floors", str(bad))
    assert done.returncode == 2
    assert "models[0].memory_gbps.floor: a positive number is needed" in done.stderr
    truncated = tmp_path / "cut.json"
    truncated.write_text('{"schema": "gputopo/accept-floors/v1", "models": [')
    done = fake_driver.run(driver, board(tmp_path, 1), "accept", "--floors", str(truncated))
    assert done.returncode == 2 and "--floors" in done.stderr and "Traceback" not in done.stderr


def test_list_floors_json_is_the_shape_floors_reads_back(driver: Path, tmp_path: Path) -> None:
    done = fake_driver.run(driver, board(tmp_path, 1), "accept", "--list-floors", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    models = {m["model"]: m for m in doc["models"]}
    assert {"H100 SXM", "H100 PCIe", "H200 SXM", "B200", "GB200", "GB300", "A100 SXM4 80GB", "L40S"} <= set(
        models
    )
    h100 = models["H100 SXM"]
    assert (
        h100["matmul_tflops"]["bf16"]["basis"] == 798.0
        and h100["matmul_tflops"]["bf16"]["derived"] == "measured"
    )
    assert h100["matmul_tflops"]["bf16"]["floor"] == pytest.approx(0.75 * 798.0)
    assert "580.159" in h100["memory_gbps"]["source"]
    saved = tmp_path / "mine.json"
    saved.write_text(done.stdout)
    again = fake_driver.run(
        driver, board(tmp_path, 1), "accept", "--list-floors", "--json", "--floors", str(saved)
    )
    assert again.returncode == 0 and json.loads(again.stdout)["models"] == doc["models"]


# --- the probes on CPU stand-ins ----------------------------------------------------------------------------

torch_needed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None, reason="the probes need torch"
)


@torch_needed
@pytest.mark.slow
def test_a_healthy_board_is_accepted_with_floors_not_applicable_and_kept_in_the_state(
    driver: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    machine = board(tmp_path, 2)
    code, doc, _ = accept(driver, machine, tmp_path, "--device", "cpu", "--state", str(state))
    assert code == 0, doc
    assert doc["verdict"] == "accepted" and doc["reason"] == "accepted: 4 steps passed"
    steps = steps_of(doc)
    assert all(s["status"] == "passed" for s in steps.values()), steps
    per_gpu = steps["per_gpu"]["facts"]
    assert per_gpu["floors"] == "not applicable (CPU stand-ins)"
    assert all(f["status"] == "not applicable" for g in per_gpu["gpus"] for f in g["figures"].values())
    assert "floors not applicable" in steps["wiring"]["summary"]
    assert steps["wiring"]["facts"]["allreduce"]["status"] == "not applicable"
    for name in ("per_gpu", "wiring"):  # the probe's own reports, every figure, beside accept's
        (path,) = steps[name]["facts"]["probe_reports"]
        assert json.loads(Path(path).read_text())["schema"] == "gputopo/probe/v1"
    assert doc["state"] == str(state)
    kept = json.loads(state.read_text())
    assert kept["accept"]["verdict"] == "accepted" and kept["accept"]["driver"] == "570.86.15"
    assert [g["uuid"] for g in kept["accept"]["gpus"]] == [g["uuid"] for g in doc["gpus"]]
    assert kept["schema"] == "gputopo/check-state/v1"  # check reads the file without a warning

    # check --json carries the verdict while it holds, and says when it no longer does.
    env = {"GPUTOPO_CHECK_STATE": str(state)}
    fresh = fake_driver.run(driver, machine, "check", "--json", "--state", str(state), *FAST, extra_env=env)
    held = json.loads(fresh.stdout)["accept"]
    assert (
        held["verdict"] == "accepted" and held["stale"] is False and held["words"].startswith("accepted at ")
    )
    assert json.loads(state.read_text())["accept"]["verdict"] == "accepted"  # check kept accept's record
    upgraded = board(tmp_path, 2, driver_version="580.65.06", name="upgraded.txt")
    later = fake_driver.run(driver, upgraded, "check", "--json", "--state", str(state), *FAST, extra_env=env)
    stale = json.loads(later.stdout)["accept"]
    assert stale["stale"] is True
    assert stale["words"].startswith("not accepted since the driver changed (570.86.15 -> 580.65.06)")


@torch_needed
@pytest.mark.slow
def test_a_drain_p2p_gpu_is_rejected_at_the_wiring_a_node_is_accepted_whole(
    driver: Path, tmp_path: Path
) -> None:
    machine = board(tmp_path, 2, "field 1 230 3")  # NVML recovery action DRAIN_P2P on GPU1
    code, doc, _ = accept(driver, machine, tmp_path, "--device", "cpu")
    assert code == 1 and doc["verdict"] == "rejected"
    steps = steps_of(doc)
    assert steps["health"]["status"] == "passed"  # check only notes it: other jobs may run there
    assert steps["per_gpu"]["status"] == "passed"
    wiring = steps["wiring"]
    assert wiring["status"] == "failed" and wiring["action"] == "reset the GPU"
    assert wiring["summary"].startswith("GPU1: the driver asks to keep peer-to-peer work off it")
    assert "a node is accepted whole" in wiring["summary"]
    assert wiring["facts"]["drained"] == {"1": wiring["facts"]["drained"]["1"]}
    assert doc["reason"].startswith("rejected at the wiring (P2P, all-reduce): GPU1")


@torch_needed
@pytest.mark.slow
@pytest.mark.parametrize("fault, gpu, verdict", [("sdc", "2", "corrupt"), ("slow", "1", "slow")])
def test_a_planted_corrupting_or_slow_stand_in_is_caught_by_the_per_gpu_step(
    driver: Path, tmp_path: Path, fault: str, gpu: str, verdict: str
) -> None:
    machine = board(tmp_path, 4)
    code, doc, _ = accept(
        driver, machine, tmp_path, "--device", "cpu", "--inject", fault, "--inject-gpus", gpu
    )
    assert code == 1 and doc["verdict"] == "rejected"
    step = steps_of(doc)["per_gpu"]
    assert step["status"] == "failed"
    assert step["summary"].startswith(f"GPU{gpu} {verdict}:"), step["summary"]
    assert step["action"] == ("replace the GPU" if verdict == "corrupt" else "run the field diagnostic")
    assert [f["gpu"] for f in step["findings"] if f["severity"] == "problem"] == [int(gpu)]
    assert steps_of(doc)["wiring"]["status"] == "not run"


@torch_needed
@pytest.mark.slow
def test_keep_going_runs_every_step_after_a_failure(driver: Path, tmp_path: Path) -> None:
    code, doc, _ = accept(
        driver, board(tmp_path, 2, "remap 1 0 2 0 1"), tmp_path, "--device", "cpu", "--keep-going"
    )
    assert code == 1
    steps = steps_of(doc)
    assert steps["health"]["status"] == "failed"
    assert steps["per_gpu"]["status"] == "passed" and steps["wiring"]["status"] == "passed"


# --- the verdict kept, and when it no longer holds ------------------------------------------------------


def kept_state(tmp_path: Path, machine: Path, verdict: str = "accepted") -> Path:
    """A state file holding accept's record for the GPUs of ``machine`` (as `gputopo accept` writes it)."""
    from gputopo.accept import record

    lines = machine.read_text().splitlines()
    driver = next(ln.split()[1] for ln in lines if ln.startswith("driver "))
    gpus = [
        {"index": int(p[1]), "uuid": p[3], "name": " ".join(p[5:]), "vbios": None}
        for p in (ln.split() for ln in lines if ln.startswith("gpu "))
    ]
    vbios = {int(p[1]): p[2] for p in (ln.split() for ln in lines if ln.startswith("vbios "))}
    serial = {int(p[1]): p[2] for p in (ln.split() for ln in lines if ln.startswith("serial "))}
    for g in gpus:
        g["vbios"] = vbios.get(g["index"])
        g["serial"] = serial.get(g["index"])
    rec = record.make(
        at=1_800_000_000.0, verdict=verdict, reason=f"{verdict}: test", driver=driver, gpus=gpus
    )
    from gputopo.system.slurm_node import node_name

    path = tmp_path / "state.json"
    doc = {"schema": "gputopo/check-state/v1", "node": node_name(), record.KEY: rec}
    path.write_text(json.dumps(doc))
    return path


def test_the_stored_verdict_goes_stale_when_a_gpu_is_swapped_in_topo_and_nodes(
    driver: Path, tmp_path: Path
) -> None:
    machine = board(tmp_path, 2)
    state = kept_state(tmp_path, machine)
    env = {"GPUTOPO_CHECK_STATE": str(state)}
    same = fake_driver.run(driver, machine, "topo", "--json", *FAST[-2:], extra_env=env)
    assert same.returncode == 0, same.stderr
    held = json.loads(same.stdout)["accept"]
    assert held == {
        **held,
        "verdict": "accepted",
        "stale": False,
        "words": "accepted at 2027-01-15T08:00:00Z",
    }
    swapped_text = machine.read_text().replace("GPU-00000001-aaaa", "GPU-0000beef-aaaa")
    swapped = tmp_path / "swapped.txt"
    swapped.write_text(swapped_text)
    later = fake_driver.run(driver, swapped, "topo", "--json", *FAST[-2:], extra_env=env)
    facts = json.loads(later.stdout)
    assert facts["accept"]["stale"] is True
    assert facts["accept"]["words"].startswith(
        "not accepted since a GPU was swapped, removed or added (GPU1)"
    )
    (tmp_path / "facts").mkdir()
    (tmp_path / "facts" / "node.json").write_text(later.stdout)
    nodes = fake_driver.run(driver, swapped, "nodes", str(tmp_path / "facts"), "--json")
    assert nodes.returncode in (0, 1), nodes.stderr
    assert json.loads(nodes.stdout)["accept"][facts["node"]]["stale"] is True
    text = fake_driver.run(driver, swapped, "nodes", str(tmp_path / "facts"))
    assert f"accept  {facts['node']}: not accepted since a GPU was swapped" in text.stdout


def test_a_vbios_flash_makes_the_verdict_stale_in_check_and_a_check_keeps_the_record(
    driver: Path, tmp_path: Path
) -> None:
    machine = board(tmp_path, 2)
    state = kept_state(tmp_path, machine)
    flashed = board(tmp_path, 2, "vbios 0 96.00.99.00.07", name="flashed.txt")
    done = fake_driver.run(driver, flashed, "check", "--json", "--state", str(state), *FAST)
    accept_obj = json.loads(done.stdout)["accept"]
    assert accept_obj["stale"] is True and "the VBIOS changed on GPU0" in accept_obj["words"]
    kept = json.loads(state.read_text())
    assert kept["accept"]["verdict"] == "accepted" and kept["schema"] == "gputopo/check-state/v1"


def test_record_status_words() -> None:
    from gputopo.accept import record

    rec = record.make(at=0.0, verdict="rejected", reason="r", driver="1", gpus=[{"index": 0, "uuid": "A"}])
    assert record.status(rec, "1", [{"index": 0, "uuid": "A"}])["words"] == "rejected at 1970-01-01T00:00:00Z"
    gone = record.status(rec, "1", [])
    assert gone["stale"] is False  # nothing read now: not judged stale
    moved = record.status(rec, "2", None)
    assert moved["stale"] is True and moved["changes"] == ["the driver changed (1 -> 2)"]
    assert record.status(None, "1", []) is None


# --- the gate in Slurm (a recording scontrol on PATH stands in for Slurm's) ---------------------------

ACCEPTING = "gputopo: accepting"
SICK_BOARD = ("remap 1 0 2 0 1",)


def gated(driver: Path, machine: Path, tmp_path: Path, bin_dir: Path, *args: str) -> tuple[int, dict, str]:
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "SLURMD_NODENAME": "gpu07",
        "GPUTOPO_CHECK_STATE": "",
    }
    done = fake_driver.run(
        driver,
        machine,
        "accept",
        "--json",
        "--gate",
        "--device",
        "cpu",
        "--report-dir",
        str(tmp_path / "r"),
        *FAST,
        *args,
        timeout=300,
        extra_env=env,
    )
    assert done.stdout, done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout), done.stderr


def test_gate_on_a_sick_node_drains_first_and_leaves_it_drained_with_the_reason(
    driver: Path, tmp_path: Path
) -> None:
    from test_check_slurm import calls, fake_scontrol, node

    bin_dir, log = fake_scontrol(tmp_path, None)
    code, doc, _ = gated(driver, board(tmp_path, 2, *SICK_BOARD), tmp_path, bin_dir)
    assert code == 1 and doc["verdict"] == "rejected"
    log_lines = calls(log)
    assert log_lines[:2] == ["show node", f"update NodeName=gpu07 State=DRAIN Reason={ACCEPTING}"]
    assert log_lines[2] == "show node" and log_lines[3].startswith(
        "update NodeName=gpu07 State=DRAIN Reason=gputopo: accept rejected: a row remapping failed on GPU1"
    )
    assert len(log_lines) == 4  # never resumed
    assert node(tmp_path)["state"] == "IDLE+DRAIN"
    assert node(tmp_path)["reason"].startswith("gputopo: accept rejected: a row remapping failed on GPU1")
    assert [a["action"] for a in doc["gate"]["actions"]] == ["drain", "drain"]

    # check --resume-if-healthy never lifts accept's hold, even on a board it finds healthy.
    from test_check_slurm import slurm_check

    healed = slurm_check(driver, board(tmp_path, 2, name="healed.txt"), bin_dir, "--resume-if-healthy")
    assert healed.returncode == 0
    assert "not resumed: `gputopo accept --gate` holds gpu07" in healed.stderr
    assert node(tmp_path)["state"] == "IDLE+DRAIN"


def test_gate_never_touches_a_node_an_admin_drained(driver: Path, tmp_path: Path) -> None:
    from test_check_slurm import calls, fake_scontrol, node

    bin_dir, log = fake_scontrol(tmp_path, "bad fan, ticket 123")
    code, doc, _ = gated(driver, board(tmp_path, 2, *SICK_BOARD), tmp_path, bin_dir)
    assert code == 1
    assert calls(log) == ["show node"]  # read, never updated
    assert node(tmp_path) == {"state": "IDLE+DRAIN", "reason": "bad fan, ticket 123"}
    assert "already IDLE+DRAIN by someone else (Reason=bad fan, ticket 123)" in doc["gate"]["note"]
    assert "never resumes it" in doc["gate"]["note"]


def test_gate_dry_run_prints_the_commands_and_changes_nothing(driver: Path, tmp_path: Path) -> None:
    from test_check_slurm import calls, fake_scontrol, node

    bin_dir, log = fake_scontrol(tmp_path, None)
    code, doc, _ = gated(driver, board(tmp_path, 2, *SICK_BOARD), tmp_path, bin_dir, "--dry-run")
    assert code == 1
    assert calls(log) == ["show node", "show node"] and node(tmp_path)["state"] == "IDLE"
    commands = [a["command"] for a in doc["gate"]["actions"]]
    assert commands[0].endswith(f"scontrol update NodeName=gpu07 State=DRAIN 'Reason={ACCEPTING}'")
    assert all(a["dry_run"] and not a["done"] for a in doc["gate"]["actions"])


@torch_needed
@pytest.mark.slow
def test_gate_on_a_healthy_node_resumes_it_only_when_accepted(driver: Path, tmp_path: Path) -> None:
    from test_check_slurm import calls, fake_scontrol, node

    bin_dir, log = fake_scontrol(tmp_path, None)
    code, doc, _ = gated(driver, board(tmp_path, 2), tmp_path, bin_dir)
    assert code == 0 and doc["verdict"] == "accepted"
    assert calls(log) == [
        "show node",
        f"update NodeName=gpu07 State=DRAIN Reason={ACCEPTING}",
        "show node",
        "update NodeName=gpu07 State=RESUME",
    ]
    assert node(tmp_path) == {"state": "IDLE", "reason": None}


# --- the verdict kept through the locked state (issue 44's system.state_file) --------------------------


def test_the_verdict_is_one_section_of_the_locked_state_the_rest_kept_with_a_backup(
    driver: Path, tmp_path: Path
) -> None:
    """accept changes only its ``accept`` section (update_section, under ``<state>.lock``): check's
    sections and a key this gputopo does not know survive, and the file it replaced is kept as ``.old``."""
    from gputopo.system.slurm_node import node_name

    state = tmp_path / "state.json"
    before = {
        "schema": "gputopo/check-state/v1",
        "node": node_name(),
        "drain": {"at": 5.0, "reason": "gputopo: Xid 79 on GPU0", "events": ["k"]},
        "from_the_future": {"kept": True},
    }
    state.write_text(json.dumps(before))
    code, doc, _ = accept(driver, board(tmp_path, 2, *SICK_BOARD), tmp_path, "--state", str(state))
    assert code == 1 and doc["verdict"] == "rejected" and doc["state"] == str(state)
    kept = json.loads(state.read_text())
    assert kept["accept"]["verdict"] == "rejected"
    assert kept["from_the_future"] == {"kept": True} and kept["drain"] == before["drain"]
    assert json.loads((tmp_path / "state.json.old").read_text()) == before


def test_a_state_path_that_is_a_link_is_refused_before_anything_runs(driver: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    link = tmp_path / "state.json"
    link.symlink_to(target)
    done = fake_driver.run(driver, board(tmp_path, 2), "accept", "--state", str(link), *FAST)
    assert done.returncode == 2 and "is a symbolic link" in done.stderr
    assert "Traceback" not in done.stderr and target.read_text() == "{}"


def test_gate_without_the_state_lock_changes_nothing_in_slurm_and_exits_3(
    driver: Path, tmp_path: Path
) -> None:
    """Another gputopo holds ``<state>.lock`` for the whole run: the gate neither drains nor resumes (no
    ``scontrol update``), the verdict is not kept (said), and the run exits 3 whatever the verdict."""
    import fcntl

    from test_check_slurm import calls, fake_scontrol, node

    bin_dir, log = fake_scontrol(tmp_path, None)
    state = tmp_path / "state.json"
    with open(tmp_path / "state.json.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        code, doc, err = gated(
            driver,
            board(tmp_path, 2, *SICK_BOARD),
            tmp_path,
            bin_dir,
            "--state",
            str(state),
            "--budget",
            "20",
        )
    assert code == 3, err[-2000:]
    assert doc["verdict"] == "rejected"  # the verdict as judged, but not kept and not acted on
    assert not [c for c in calls(log) if c.startswith("update")] and node(tmp_path)["state"] == "IDLE"
    assert "the node was not drained: the lock" in doc["gate"]["note"]
    assert doc["state"].startswith("not kept: the lock") and not state.exists()
    assert "the verdict was not kept" in err


def test_gate_and_eight_concurrent_drain_checks_keep_both_records_and_never_resume(
    driver: Path, tmp_path: Path
) -> None:
    """Real processes on one state file: ``accept --gate`` on a sick board while 8 ``check --drain`` run
    at once. Every writer re-reads under the lock, so accept's verdict and check's judgement are both in
    the file at the end, and the sick node is never resumed, whoever's drain it carries."""
    from test_check_slurm import calls, fake_scontrol, node
    from test_check_state import finish, start

    bin_dir, log = fake_scontrol(tmp_path, None)
    state = tmp_path / "state.json"
    sick = board(tmp_path, 2, *SICK_BOARD)
    checks = [
        start(driver, sick, bin_dir, "--drain", "--state", str(state), *FAST[:2], "--budget", "120")
        for _ in range(8)
    ]
    code, doc, err = gated(driver, sick, tmp_path, bin_dir, "--state", str(state))
    done = finish(checks)
    assert code == 1 and doc["verdict"] == "rejected" and doc["state"] == str(state), err[-2000:]
    assert all(rc == 1 for rc, _, _ in done), [e[-500:] for _, _, e in done]
    kept = json.loads(state.read_text())
    assert kept["accept"]["verdict"] == "rejected" and kept["results"], sorted(kept)
    assert "DRAIN" in node(tmp_path)["state"]
    assert not [c for c in calls(log) if "State=RESUME" in c]


def _report(status: str = "passed") -> object:
    from gputopo.accept import steps
    from gputopo.services.accept import AcceptReport

    done = tuple(steps.StepResult(n, status, "ok") for n in ("inventory", "health", "per_gpu", "wiring"))
    return AcceptReport(
        steps=done,
        node="gpu07",
        device="cpu",
        driver="1",
        gpus=(),
        started_utc="x",
        elapsed_s=1.0,
        budget_s=9,
    )


def test_an_accepted_gate_lost_to_a_held_lock_leaves_the_node_drained_and_exits_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ending (resume) happens only under the lock: not got in time, Slurm is not touched."""
    import fcntl

    import gputopo.services.check
    from gputopo.services import accept as service

    def no_slurm(*_: object) -> None:
        raise AssertionError("Slurm read or changed without the lock")

    monkeypatch.setattr(gputopo.services.check, "read_node_view", no_slurm)
    monkeypatch.setattr(service, "MIN_LOCK_WAIT_S", 0.2)
    state = tmp_path / "state.json"
    options = service.Options(gate=True, state_path=state, device="cpu")
    gate = service._Gate(options, service.Hooks(), "gpu07")
    gate.ours = True  # accept drained it at the start
    with open(tmp_path / "state.json.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        report = service._keep(options, _report(), service.Hooks(), gate, 0.0)
    assert report.verdict == "accepted" and report.exit_code == 3
    assert report.saved.startswith("not kept: the lock") and "stays drained" in report.gate_note
    assert not state.exists()


def test_gate_never_resumes_a_node_a_check_drained_while_accept_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """accept drained the node; a check whose view predates that drain re-drained it with its own reason
    (an Xid): accepted or not, accept leaves the check's drain for the check to lift."""
    import gputopo.services.check
    from gputopo.health.node_action import NodeInfo
    from gputopo.services import accept as service
    from gputopo.system import slurm_node

    drained = NodeInfo("gpu07", "IDLE+DRAIN", "gputopo: Xid 79 on GPU0 (fell off the bus)")
    view = gputopo.services.check.NodeView("gpu07", drained)
    monkeypatch.setattr(gputopo.services.check, "read_node_view", lambda _d: view)

    def no_update(*_: object) -> None:
        raise AssertionError("accept changed a check's drain")

    monkeypatch.setattr(slurm_node, "resume", no_update)
    monkeypatch.setattr(slurm_node, "drain", no_update)
    state = tmp_path / "state.json"
    options = service.Options(gate=True, state_path=state, device="cpu")
    gate = service._Gate(options, service.Hooks(), "gpu07")
    gate.ours = True
    report = service._keep(options, _report(), service.Hooks(), gate, 0.0)
    assert report.exit_code == 0 and report.saved == str(state)
    assert "drained by a gputopo check while accept ran" in report.gate_note
    assert json.loads(state.read_text())["accept"]["verdict"] == "accepted"


# --- DCGM's diagnostics (a fake dcgmi on PATH answers with JSON of DCGM's real shapes: tests/fake_dcgmi) -


def with_dcgmi(driver: Path, machine: Path, tmp_path: Path, kind: str, *args: str) -> tuple[int, dict, str]:
    """accept with ``--dcgm-level 3`` and a fake ``dcgmi`` answering ``kind``. No ``--device cpu``: with no
    CUDA here the probes' steps are "not checked" at once, so the DCGM step is what is judged."""
    import fake_dcgmi

    bin_dir = tmp_path / "dcgm-bin"
    fake_dcgmi.fake_dcgmi(bin_dir, {"*": fake_dcgmi.answer(kind, 3, gpus=8)})
    marker = own_procs.new_marker()
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", own_procs.MARKER_VAR: marker}
    done = fake_driver.run(
        driver,
        machine,
        "accept",
        "--json",
        "--report-dir",
        str(tmp_path / "r"),
        "--dcgm-level",
        "3",
        *FAST,
        *args,
        timeout=200,
        extra_env=env,
    )
    assert not own_procs.wait_for_none_left(marker), "a dcgmi or its child was left running"
    assert done.stdout, done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout), done.stderr


def test_dcgm_fail_on_gpu3_rejects_at_the_dcgm_step_with_dcgms_code(driver: Path, tmp_path: Path) -> None:
    code, doc, _ = with_dcgmi(driver, board(tmp_path, 8), tmp_path, "fail_gpu3")
    assert code == 1 and doc["verdict"] == "rejected"
    steps = steps_of(doc)
    assert list(steps) == ["inventory", "health", "dcgm", "per_gpu", "wiring"]
    dcgm = steps["dcgm"]
    assert dcgm["status"] == "failed" and dcgm["facts"]["level"] == 3
    problems = [f for f in dcgm["findings"] if f["severity"] == "problem"]
    assert problems and problems[0]["gpu"] == 3
    assert "DCGM_FR_FAULTY_MEMORY" in problems[0]["what"] + problems[0]["where"] + str(problems[0]["rule"])
    assert dcgm["action"] in ("replace the GPU", "run the field diagnostic", "reset the GPU")
    assert steps["per_gpu"]["status"] == "not run"
    assert doc["reason"].startswith("rejected at DCGM diagnostics")


@pytest.mark.parametrize(
    "kind, status, words",
    [
        ("pass", "passed", "passed"),
        ("warn", "passed", "passed"),
        ("skips", "not checked", "skip"),
        ("runtime_error", "not checked", "host engine"),
    ],
)
def test_dcgm_pass_warn_skips_and_runtime_error(
    driver: Path, tmp_path: Path, kind: str, status: str, words: str
) -> None:
    code, doc, _ = with_dcgmi(driver, board(tmp_path, 8), tmp_path, kind)
    dcgm = steps_of(doc)["dcgm"]
    assert dcgm["status"] == status, dcgm
    assert words in dcgm["summary"].lower() or words in str(dcgm["why_not"]).lower(), dcgm
    if kind == "warn":
        assert any(f["severity"] == "note" for f in dcgm["findings"])
    assert code == 3  # the probes' steps could not run here (no CUDA): not checked, never accepted


def test_a_hung_dcgmi_is_not_checked_within_the_budget_and_left_running_nowhere(
    driver: Path, tmp_path: Path
) -> None:
    code, doc, _ = with_dcgmi(driver, board(tmp_path, 2), tmp_path, "hang", "--budget", "15")
    assert code == 3
    dcgm = steps_of(doc)["dcgm"]
    assert dcgm["status"] == "not checked" and dcgm["why_not"]
    assert doc["elapsed_s"] < 15 + 30


def test_no_dcgmi_installed_is_not_checked(driver: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    done = fake_driver.run(
        driver,
        board(tmp_path, 2),
        "accept",
        "--json",
        "--report-dir",
        str(tmp_path / "r"),
        "--dcgm-level",
        "1",
        *FAST,
        extra_env={"PATH": f"{empty}{os.pathsep}{Path(sys.executable).parent}"},
    )
    dcgm = steps_of(json.loads(done.stdout))["dcgm"]
    assert dcgm["status"] == "not checked" and "dcgmi" in dcgm["why_not"]


def test_a_saved_dcgm_result_is_read_with_dcgm_diag_and_a_bad_one_is_exit_2(
    driver: Path, tmp_path: Path
) -> None:
    import fake_dcgmi

    saved = tmp_path / "diag.json"
    saved.write_text(fake_dcgmi.answer("fail_gpu3", 3, gpus=8)["stdout"])
    code, doc, _ = accept(driver, board(tmp_path, 8), tmp_path, "--dcgm-diag", str(saved))
    assert code == 1 and steps_of(doc)["dcgm"]["status"] == "failed"
    assert steps_of(doc)["dcgm"]["facts"]["source"].endswith("diag.json")
    cut = tmp_path / "cut.json"
    cut.write_text(saved.read_text()[:200])
    done = fake_driver.run(driver, board(tmp_path, 8), "accept", "--dcgm-diag", str(cut), *FAST)
    assert (
        done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 2
    )


@torch_needed
@pytest.mark.slow
def test_ctrl_c_during_the_per_gpu_step_leaves_nothing_running(driver: Path, tmp_path: Path) -> None:
    import signal
    import subprocess

    from conftest import default_stop_signals
    from test_signals import stop, wait_for

    env = fake_driver.env_for(driver, board(tmp_path, 2))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gputopo",
            "accept",
            "--device",
            "cpu",
            "--report-dir",
            str(tmp_path / "r"),
            *FAST,
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_stop_signals,
    )
    ids = wait_for(proc, "gputopo.probe.ranks", 2, limit_s=180)
    stop(proc, signal.SIGINT, ids)  # exit 130, one "stopped by SIGINT" line, every process of its tree gone


# --- floors judged (pure) -------------------------------------------------------------------------------


def gpu_row(gpu: int, name: str, matmul: float, memory: float) -> dict:
    runs = {
        "matmul_tflops": [matmul] * 4,
        "memory_gbps": [memory] * 4,
        "h2d_gbps": [50.0] * 4,
        "d2h_gbps": [50.0] * 4,
    }
    return {"gpu": gpu, "name": name, "verdict": "pass", "runs": runs, **{k: v[0] for k, v in runs.items()}}


def test_a_gpu_below_its_models_floor_fails_the_per_gpu_step_by_the_median_of_its_runs() -> None:
    from gputopo.accept.floors import packaged
    from gputopo.accept.steps import judge_per_gpu

    rows = [
        gpu_row(0, "NVIDIA H100 80GB HBM3", 790.0, 2990.0),
        gpu_row(1, "NVIDIA H100 80GB HBM3", 790.0, 1900.0),
    ]
    rows[0]["runs"]["matmul_tflops"] = [100.0, 780.0, 790.0, 800.0]  # one bad run: the median holds
    step = judge_per_gpu({"precision": "bf16", "gpus": rows}, packaged(), "cuda")
    assert step.status == "failed" and step.action == "run the field diagnostic"
    (problem,) = [f for f in step.findings if f.severity == "problem"]
    assert problem.gpu == 1 and "memory_gbps 1900" in problem.what and "below the floor 2250" in problem.what
    figures = {r["gpu"]: r["figures"] for r in step.facts["gpus"]}
    assert figures[0]["matmul_tflops"]["status"] == "pass" and figures[0]["matmul_tflops"]["value"] == 785.0
    assert figures[1]["memory_gbps"]["floor"]["derived"] == "measured"


def test_a_model_with_no_row_is_judged_against_its_peers_only_and_says_so() -> None:
    from gputopo.accept.floors import packaged
    from gputopo.accept.steps import judge_per_gpu

    rows = [gpu_row(g, "NVIDIA RTX PRO 6000", 100.0, 1000.0) for g in range(2)]
    step = judge_per_gpu({"precision": "bf16", "gpus": rows}, packaged(), "cuda")
    assert (
        step.status == "passed"
        and "no floors for NVIDIA RTX PRO 6000: judged against its peers only" in step.summary
    )
    assert step.facts["relative_only"] == ["NVIDIA RTX PRO 6000"]


def test_floors_file_overrides_and_the_h200_row_is_not_gh200_or_h200_nvl(tmp_path: Path) -> None:
    from gputopo.accept.floors import load, packaged
    from gputopo.accept.steps import judge_per_gpu

    table = packaged()
    assert table.for_name("NVIDIA H200").model == "H200 SXM"
    assert table.for_name("NVIDIA GH200 480GB") is None and table.for_name("NVIDIA H200 NVL") is None
    assert table.for_name("NVIDIA H100 PCIe").model == "H100 PCIe"
    mine = tmp_path / "floors.json"
    mine.write_text(
        json.dumps(
            {
                "schema": "gputopo/accept-floors/v1",
                "models": [
                    {
                        "model": "RTX",
                        "pattern": "RTX PRO",
                        "memory_gbps": {"floor": 1500, "source": "our own run"},
                    }
                ],
            }
        )
    )
    rows = [gpu_row(g, "NVIDIA RTX PRO 6000", 100.0, 1000.0) for g in range(2)]
    step = judge_per_gpu({"precision": "bf16", "gpus": rows}, load(mine), "cuda")
    assert step.status == "failed" and "below the floor 1500 (our own run" in step.summary


def serials(n: int, **changed: str) -> list[str]:
    """``serial I TEXT`` lines: DCGM's fake serials (tests/fake_dcgmi.SERIALS), GPU ``gI=...`` changed."""
    import fake_dcgmi

    return [f"serial {i} {changed.get(f'g{i}', fake_dcgmi.SERIALS[i])}" for i in range(n)]


def test_a_gpu_serial_change_makes_the_verdict_stale(driver: Path, tmp_path: Path) -> None:
    machine = board(tmp_path, 2, *serials(2))
    state = kept_state(tmp_path, machine)
    assert json.loads(state.read_text())["accept"]["gpus"][1]["serial"] == "1650123450001"
    same = fake_driver.run(driver, machine, "check", "--json", "--state", str(state), *FAST)
    assert json.loads(same.stdout)["accept"]["stale"] is False
    swapped = board(tmp_path, 2, *serials(2, g1="1650999999999"), name="swapped.txt")
    later = fake_driver.run(driver, swapped, "check", "--json", "--state", str(state), *FAST)
    acc = json.loads(later.stdout)["accept"]
    assert acc["stale"] is True
    assert "a GPU was swapped (GPU1 (serial 1650123450001 -> 1650999999999))" in acc["words"], acc


def test_dcgm_result_held_against_the_gpus_serials(driver: Path, tmp_path: Path) -> None:
    """A saved DCGM pass whose serials cover every GPU here passes; a GPU swapped in since (a serial DCGM
    never diagnosed) leaves the step not checked, naming it."""
    import fake_dcgmi

    saved = tmp_path / "diag.json"
    saved.write_text(fake_dcgmi.answer("pass", 3, gpus=8)["stdout"])
    code, doc, _ = accept(driver, board(tmp_path, 8, *serials(8)), tmp_path, "--dcgm-diag", str(saved))
    assert steps_of(doc)["dcgm"]["status"] == "passed", steps_of(doc)["dcgm"]
    swapped = board(tmp_path, 8, *serials(8, g5="1650999999999"), name="swapped.txt")
    code, doc, _ = accept(driver, swapped, tmp_path, "--dcgm-diag", str(saved))
    dcgm = steps_of(doc)["dcgm"]
    assert dcgm["status"] == "not checked" and "GPU5" in dcgm["why_not"], dcgm
