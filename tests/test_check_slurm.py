"""``gputopo check --drain`` / ``--resume-if-healthy`` against a recording ``scontrol`` on PATH (a real
child process standing in for Slurm's): the command line, dry runs, and never undraining an admin's drain.
A run against a real slurmctld/slurmd is left to the CI machine that can start one."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

import fake_driver
from test_check_cli import FAST, machine
from test_health_reads import healthy

pytestmark = pytest.mark.skipif(
    fake_driver.compiler() is None, reason="no C compiler to build the fake driver"
)


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


FAKE_SCONTROL = """#!{python}
# A stand-in for Slurm's scontrol: the cluster is a JSON file (node -> state, reason); `show node` prints
# it as scontrol does, `update` changes it; every call is logged. A file named hang makes it hang.
import json, os, sys, time
here = {here!r}
with open(os.path.join(here, "scontrol.log"), "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
if os.path.exists(os.path.join(here, "hang")):
    time.sleep(60)
path = os.path.join(here, "cluster.json")
nodes = json.load(open(path))
if sys.argv[1:3] == ["show", "node"]:
    for name, n in nodes.items():
        print(f"NodeName={{name}} Arch=x86_64 CoresPerSocket=1\\n   State={{n['state']}} ThreadsPerCore=1")
        if n.get("reason"):
            print(f"   Reason={{n['reason']}} [root@2026-11-25T09:00:00]")
        print()
elif sys.argv[1] == "update":
    kv = dict(a.split("=", 1) for a in sys.argv[2:])
    n = nodes[kv["NodeName"]]
    if kv["State"] == "DRAIN":
        n["state"], n["reason"] = "IDLE+DRAIN", kv["Reason"]
    elif kv["State"] == "RESUME":
        n["state"], n["reason"] = "IDLE", None
    # written whole (a temporary file and a rename): a `show node` beside it never reads half a file
    tmp = f"{{path}}.{{os.getpid()}}"
    json.dump(nodes, open(tmp, "w"))
    os.replace(tmp, path)
"""


def fake_scontrol(
    tmp_path: Path, reason: str | None, state: str | None = None, **others: tuple[str, str | None]
) -> tuple[Path, Path]:
    """A ``scontrol`` that logs its arguments (one call a line) and shows node gpu07 with ``reason`` (in
    ``state``: drained when it has a reason) beside ``others`` (name -> (state, reason))."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    cluster = {"gpu07": {"state": state or ("IDLE+DRAIN" if reason else "IDLE"), "reason": reason}}
    cluster.update({name: {"state": s, "reason": r} for name, (s, r) in others.items()})
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    script = bin_dir / "scontrol"
    script.write_text(FAKE_SCONTROL.format(python=sys.executable, here=str(tmp_path)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir, tmp_path / "scontrol.log"


def node(tmp_path: Path, name: str = "gpu07") -> dict[str, str | None]:
    return json.loads((tmp_path / "cluster.json").read_text())[name]


def set_node(tmp_path: Path, state: str, reason: str | None, name: str = "gpu07") -> None:
    cluster = json.loads((tmp_path / "cluster.json").read_text())
    cluster[name] = {"state": state, "reason": reason}
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))


def slurm_check(
    driver: Path, machine_file: Path, bin_dir: Path, *args: str, env: dict[str, str] | None = None
):  # type: ignore[no-untyped-def]
    base = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "SLURMD_NODENAME": "gpu07",
        "GPUTOPO_CHECK_STATE": "",  # no state file unless a test names one (never root's default here)
    }
    return fake_driver.run(
        driver, machine_file, "check", *FAST, *args, timeout=60, extra_env={**base, **(env or {})}
    )


SICK = [*healthy(0), "remap 0 0 0 0 1"]
SICK_REASON = "gputopo: a row remapping failed on GPU0 (0 rows remapped for uncorrectable errors)"


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_problems_drain_the_node_with_the_reason(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    result = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain")
    assert result.returncode == 1
    # The node's state and reason are read first, then the one update.
    assert calls(log) == ["show node", f"update NodeName=gpu07 State=DRAIN Reason={SICK_REASON}"]
    assert node(tmp_path) == {"state": "IDLE+DRAIN", "reason": SICK_REASON}
    assert "slurm: " in result.stderr


def test_dry_run_prints_the_command_only(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    result = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain", "--dry-run")
    assert result.returncode == 1 and calls(log) == ["show node"]  # read only
    assert result.stdout.splitlines()[-1].endswith(
        f"scontrol update NodeName=gpu07 State=DRAIN 'Reason={SICK_REASON}'"
    )


def test_dry_run_when_the_nodes_state_cannot_be_read_shows_the_command_and_what_holds_it(
    driver: Path, tmp_path: Path
) -> None:
    """scontrol missing, or failing: nothing is run, and the dry run still previews the command the check
    calls for (stdout's last line) with what would hold it back (stderr and the JSON)."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    missing = {"PATH": str(empty)}
    result = slurm_check(driver, machine(tmp_path, SICK), empty, "--drain", "--dry-run", env=missing)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"scontrol update NodeName=gpu07 State=DRAIN 'Reason={SICK_REASON}'"
    )
    assert "slurm: not drained: the node's state could not be read (scontrol not found" in result.stderr
    doc = json.loads(
        slurm_check(
            driver, machine(tmp_path, SICK), empty, "--drain", "--dry-run", "--json", env=missing
        ).stdout
    )["slurm"]
    assert (doc["action"], doc["withheld"], doc["done"], doc["dry_run"]) == ("none", "drain", False, True)
    assert doc["command"].endswith("State=DRAIN 'Reason=" + SICK_REASON + "'")
    assert doc["held_back"].startswith("not drained: the node's state could not be read")
    # scontrol there but failing: its own words say why
    bin_dir, log = fake_scontrol(tmp_path, None)
    (tmp_path / "cluster.json").write_text("not json")
    result = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--resume-if-healthy", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].endswith("scontrol update NodeName=gpu07 State=RESUME")
    assert "slurm: not resumed: the node's state could not be read (" in result.stderr
    assert calls(log) == ["show node"]  # read only
    # without --dry-run: nothing run and no command printed, only what held it back
    result = slurm_check(driver, machine(tmp_path, SICK), empty, "--drain", env=missing)
    assert (
        "State=DRAIN" not in result.stdout
        and "not drained: the node's state could not be read" in result.stderr
    )


def test_dry_run_of_a_drain_held_back_by_a_person_or_max_drained_shows_both(
    driver: Path, tmp_path: Path
) -> None:
    bin_dir, log = fake_scontrol(tmp_path, "maint: PSU swap")
    result = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain", "--dry-run")
    assert result.stdout.splitlines()[-1].endswith(f"State=DRAIN 'Reason={SICK_REASON}'")
    assert "slurm: not drained: gpu07 is already IDLE+DRAIN by someone else (Reason=maint: PSU swap)" in (
        result.stderr
    )
    set_node(tmp_path, "IDLE", None)
    set_node(tmp_path, "IDLE+DRAIN", "gputopo: Xid 79", name="gpu01")
    result = slurm_check(
        driver, machine(tmp_path, SICK), bin_dir, "--drain", "--dry-run", "--max-drained", "1"
    )
    assert result.stdout.splitlines()[-1].endswith(f"State=DRAIN 'Reason={SICK_REASON}'")
    assert "slurm: not drained: 1 node already carry a gputopo drain (--max-drained 1)" in result.stderr
    assert [c for c in calls(log) if c.startswith("update")] == []


def test_a_healthy_node_is_not_drained_and_unknown_is_not_drained(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    assert slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--drain").returncode == 0
    empty = tmp_path / "no-dev"
    empty.mkdir()
    no_devices = {"GPUTOPO_DEV_ROOT": str(empty), "GPUTOPO_PROCFS_ROOT": str(empty)}
    result = slurm_check(driver, tmp_path / "no-driver.txt", bin_dir, "--drain", env=no_devices)
    assert result.returncode == 3
    assert [c for c in calls(log) if c.startswith("update")] == []


def test_a_broken_driver_on_a_gpu_node_drains(driver: Path, tmp_path: Path) -> None:
    # NVML cannot start (the fake answers DriverNotLoaded), but the node has GPUs: --expect-gpus says so,
    # or the device files do. Unknown is not healthy: a problem naming the driver, and the node drains.
    bin_dir, log = fake_scontrol(tmp_path, None)
    empty = tmp_path / "no-dev"
    empty.mkdir()
    env = {"GPUTOPO_DEV_ROOT": str(empty), "GPUTOPO_PROCFS_ROOT": str(empty)}
    result = slurm_check(
        driver, tmp_path / "no-driver.txt", bin_dir, "--drain", "--expect-gpus", "8", env=env
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("problems: the NVIDIA driver is broken: NVML could not start")
    assert "--expect-gpus 8" in result.stdout
    assert node(tmp_path)["reason"].startswith("gputopo: the NVIDIA driver is broken")
    devices = tmp_path / "dev"
    devices.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (devices / name).touch()
    proc = tmp_path / "proc" / "driver" / "nvidia"
    proc.mkdir(parents=True)
    (proc / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan  1\n")
    set_node(tmp_path, "IDLE", None)
    env = {"GPUTOPO_DEV_ROOT": str(devices), "GPUTOPO_PROCFS_ROOT": str(tmp_path / "proc")}
    result = slurm_check(driver, tmp_path / "no-driver.txt", bin_dir, "--drain", env=env)
    assert result.returncode == 1
    assert "NVIDIA driver (kernel module 570.86.15) is broken" in result.stdout
    assert "2 /dev/nvidia[0-9]* device files" in result.stdout
    assert node(tmp_path)["state"] == "IDLE+DRAIN"


BAD_FILES = {
    "rules.toml": b"no_such_rule = 3\n",
    "cut.json": b'{"schema": "gputopo/baseline/v1", "gpu_count": 3, "gpus": [',
    "topo.json": b'{"schema": "gputopo/topology/v1", "gpus": []}',
    "kern.bin": b"\x00\x01\x02\xff" * 64,
}


@pytest.mark.parametrize(
    "args",
    [
        ["--since", "5x"],
        ["--budget", "0"],
        ["--expect-gpus", "-1"],
        ["--sample-s", "nan"],
        ["--thresholds", "{dir}/rules.toml"],
        ["--baseline", "{dir}/cut.json"],
        ["--baseline", "{dir}/topo.json"],
        ["--kernel-log", "{dir}/kern.bin"],
    ],
)
def test_bad_input_never_drains(driver: Path, tmp_path: Path, args: list[str]) -> None:
    # The node is sick, so a check that ran would drain it: bad input must stop before anything is read.
    for name, data in BAD_FILES.items():
        (tmp_path / name).write_bytes(data)
    bin_dir, log = fake_scontrol(tmp_path, None)
    argv = [a.format(dir=tmp_path) for a in args]
    result = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain", *argv)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) <= 2  # the error and its hint
    assert not log.exists()


def test_resume_only_what_gputopo_drained(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, "gputopo: a row remapping failed on GPU0")
    result = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--resume-if-healthy")
    assert result.returncode == 0
    assert calls(log) == ["show node", "update NodeName=gpu07 State=RESUME"]


ADMIN = "maint: PSU swap (ticket 4711)"


def test_an_admins_drain_is_kept_through_a_sick_and_a_healed_board(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, ADMIN)
    both = ("--drain", "--resume-if-healthy")
    sick = slurm_check(driver, machine(tmp_path, SICK), bin_dir, *both)
    assert sick.returncode == 1
    assert f"slurm: not drained: gpu07 is already IDLE+DRAIN by someone else (Reason={ADMIN})" in sick.stderr
    healed = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, *both)
    assert healed.returncode == 0
    assert "slurm: not resumed: gpu07 is IDLE+DRAIN by someone else" in healed.stderr
    assert calls(log) == ["show node", "show node"]  # read, never updated
    assert node(tmp_path) == {"state": "IDLE+DRAIN", "reason": ADMIN}
    # Down by someone else is the same.
    set_node(tmp_path, "DOWN*", "Not responding")
    assert slurm_check(driver, machine(tmp_path, SICK), bin_dir, *both).returncode == 1
    assert node(tmp_path) == {"state": "DOWN*", "reason": "Not responding"}


def xid_line(
    code: int, when: float, bus: str = "0000:18:00", text: str = "GPU has fallen off the bus."
) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime(when))
    return f"{stamp} gpu07 kernel: NVRM: Xid (PCI:{bus}): {code}, pid=0, name=none, {text}\n"


def test_a_manual_resume_is_not_undone_by_an_old_xid_and_a_new_xid_drains(
    driver: Path, tmp_path: Path
) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    kern = tmp_path / "kern.log"
    kern.write_text(xid_line(79, time.time() - 60))
    state = tmp_path / "state" / "check-state.json"
    args = ("--drain", "--resume-if-healthy", "--state", str(state), "--kernel-log", str(kern))
    first = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, *args)
    assert first.returncode == 1 and node(tmp_path)["reason"].startswith("gputopo: Xid 79")
    saved = json.loads(state.read_text())
    assert saved["drain"]["events"] and saved["node"] == "gpu07"
    # The administrator fixes the GPU and resumes the node by hand.
    set_node(tmp_path, "IDLE", None)
    again = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, *args)
    assert again.returncode == 0, again.stdout
    assert (
        "acknowledged by a persons resume" in again.stdout.replace("'", "")
        or "acknowledged by a person" in again.stdout
    )
    assert node(tmp_path) == {"state": "IDLE", "reason": None}
    assert [c for c in calls(log) if c.startswith("update")] == [c for c in calls(log) if "DRAIN" in c][:1]
    # Checks go on: the old line stays acknowledged.
    assert slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, *args).returncode == 0
    # A new Xid (after the resume) drains again.
    time.sleep(1.1)
    with kern.open("a") as fh:
        fh.write(xid_line(48, time.time(), text="DBE (0x1) detected"))
    new = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, *args)
    assert new.returncode == 1
    assert node(tmp_path)["reason"].startswith("gputopo: Xid 48")


def test_a_corrupt_or_foreign_state_file_is_named_and_replaced(driver: Path, tmp_path: Path) -> None:
    bin_dir, _ = fake_scontrol(tmp_path, None)
    state = tmp_path / "check-state.json"
    for text, words in (
        ("{not json", "corrupt"),
        ('{"schema": "something/else"}', "not a gputopo check state"),
        ('{"schema": "gputopo/check-state/v1", "node": "gpu99"}', "the state of node 'gpu99'"),
    ):
        state.write_text(text)
        result = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--drain", "--state", str(state))
        assert result.returncode == 0, result.stderr
        assert f"--state {state}: {words}" in result.stderr and "Traceback" not in result.stderr
        assert json.loads(state.read_text())["node"] == "gpu07"


def test_max_drained_holds_a_drain_back_when_enough_nodes_carry_one(driver: Path, tmp_path: Path) -> None:
    theirs = {f"gpu0{i}": ("IDLE+DRAIN", f"gputopo: Xid 79 on GPU{i}") for i in (1, 2)}
    bin_dir, log = fake_scontrol(tmp_path, None, **theirs, gpu03=("IDLE+DRAIN", "admin: not ours"))
    held = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain", "--max-drained", "2")
    assert held.returncode == 1
    assert "slurm: not drained: 2 nodes already carry a gputopo drain (--max-drained 2)" in held.stderr
    assert node(tmp_path)["state"] == "IDLE"
    # 50% of 4 nodes is 2: held back too; 3 nodes allowed: drained.
    assert (
        "--max-drained 2"
        in slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain", "--max-drained", "50%").stderr
    )
    slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain", "--max-drained", "3")
    assert node(tmp_path) == {"state": "IDLE+DRAIN", "reason": SICK_REASON}


def test_a_monitor_problem_never_drains(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    rules = tmp_path / "rules.json"
    rules.write_text('{"persistence_off": {"severity": "problem", "action": "monitor"}}')
    result = slurm_check(
        driver,
        machine(tmp_path, [*healthy(0), "persist 0 0"]),
        bin_dir,
        "--drain",
        "--thresholds",
        str(rules),
    )
    assert result.returncode == 1
    assert "slurm: not drained: no problem asks for it (their action: monitor" in result.stderr
    assert node(tmp_path)["state"] == "IDLE"


def test_a_hung_scontrol_is_cut_off_inside_the_budget_and_reported(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    (tmp_path / "hang").touch()  # every scontrol call sleeps 60 s; the test's 60 s timeout would catch a wait
    result = slurm_check(
        driver, machine(tmp_path, SICK), bin_dir, "--drain", "--budget", "5", "--sample-s", "0.2"
    )
    assert result.returncode == 1
    assert "scontrol did not answer within" in result.stderr and "cut off to keep --budget" in result.stderr
    assert "could not none" not in result.stderr
