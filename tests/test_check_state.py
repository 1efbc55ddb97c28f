"""The check state file shared by many writers: real concurrent ``gputopo check`` processes (not threads)
over the fake driver and the recording ``scontrol`` stand-in, the lock ``<state>.lock``, unknown sections
carried through, a newer schema read only, the ``.old`` backup, and a path that is not to be trusted."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fake_driver
from test_check_cli import machine
from test_check_slurm import SICK, calls, fake_scontrol, node, set_node, slurm_check, xid_line
from test_health_reads import healthy

pytestmark = pytest.mark.skipif(
    fake_driver.compiler() is None, reason="no C compiler to build the fake driver"
)

# Generous: 20 checks at once on a loaded CI machine take far longer than one; no assertion here depends
# on a check being fast, only on none of them losing what another wrote.
SLOW_OK = ("--budget", "120")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def start(
    driver: Path, machine_file: Path, bin_dir: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``gputopo check ARGS`` started, not waited for (as test_check_slurm.slurm_check runs it)."""
    full = {
        **fake_driver.env_for(driver, machine_file),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "SLURMD_NODENAME": "gpu07",
        "GPUTOPO_CHECK_STATE": "",
        **(env or {}),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "gputopo", "check", "--kernel-log", "/dev/null", *args],
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(procs: list[subprocess.Popen[str]], timeout: float = 300) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append((p.returncode, stdout, stderr))
    return out


def updates(log: Path) -> list[str]:
    return [c for c in calls(log) if c.startswith("update")]


def saved(path: Path) -> dict:  # type: ignore[type-arg]
    return json.loads(path.read_text())


# --- the lock: many writers at once ----


@pytest.mark.parametrize("trials", [1, pytest.param(5, marks=pytest.mark.slow)])
def test_twenty_checks_and_one_drain_at_once_keep_the_drain_record(
    driver: Path, tmp_path: Path, trials: int
) -> None:
    """Before the lock, a plain check that read the file before the drain was saved wrote it back without
    the drain (the drain record lost in 5 of 5 trials); the person's resume then was not seen as one. One
    trial in the quick suite, five in the slow one (about 13 s each on 2 cores)."""
    sick = machine(tmp_path, SICK)
    for trial in range(trials):
        here = tmp_path / f"t{trial}"
        here.mkdir()
        bin_dir, log = fake_scontrol(here, None)
        state = here / "check-state.json"
        args = ("--state", str(state), *SLOW_OK, "--sample-s", "0.5")
        procs = [start(driver, sick, bin_dir, *args) for _ in range(10)]
        procs.append(start(driver, sick, bin_dir, *args, "--drain"))
        procs += [start(driver, sick, bin_dir, *args) for _ in range(9)]
        results = finish(procs)
        assert [r[0] for r in results] == [1] * 20, [r[2] for r in results if r[0] != 1]
        assert len(updates(log)) == 1 and node(here)["state"] == "IDLE+DRAIN"
        doc = saved(state)
        assert doc["drain"] is not None and doc["drain"]["reason"] == node(here)["reason"], trial
        assert doc["last"]["verdict"] == "problems"


def test_twenty_drains_at_once_drain_once(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    state = tmp_path / "check-state.json"
    procs = [
        start(driver, machine(tmp_path, SICK), bin_dir, "--drain", "--state", str(state), *SLOW_OK)
        for _ in range(20)
    ]
    results = finish(procs)
    assert [r[0] for r in results] == [1] * 20, [r[2] for r in results if r[0] != 1]
    assert len(updates(log)) == 1, updates(log)
    assert node(tmp_path)["state"] == "IDLE+DRAIN"
    assert saved(state)["drain"]["reason"] == node(tmp_path)["reason"]
    # One run says it drained; the other 19 say they held back, or that the node is drained already, or
    # (a run that read the state after the drain was saved: its own drain, nothing to do) nothing at all:
    # which of these each says depends on when it started, so only the one drain is counted.
    assert sum("scontrol update" in r[2] for r in results) == 1, [r[2] for r in results]
    assert not any("could not" in r[2] for r in results), [r[2] for r in results]


def test_a_lock_held_past_the_budget_is_exit_3_and_no_scontrol_update(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    state = tmp_path / "check-state.json"
    state.write_text(json.dumps({"schema": "gputopo/check-state/v1", "node": "gpu07", "accept": {"x": 1}}))
    before = state.read_text()
    with open(tmp_path / "check-state.json.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        result = slurm_check(
            driver, machine(tmp_path, SICK), bin_dir, "--drain", "--state", str(state), "--budget", "4"
        )
        took = time.monotonic() - started
    assert result.returncode == 3, result.stderr
    assert updates(log) == [] and node(tmp_path)["state"] == "IDLE"
    assert state.read_text() == before
    assert "check-state.json.lock was held by another gputopo past the time allowed" in result.stderr
    assert "nothing done to Slurm, nothing saved" in result.stdout
    assert took < 60
    # A plain check without the lock: exit 3 too (nothing saved), the problem still named.
    with open(tmp_path / "check-state.json.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        plain = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--state", str(state), "--budget", "3")
    assert plain.returncode == 3 and "nothing saved" in plain.stdout and state.read_text() == before


def test_a_drain_racing_a_check_then_a_resume_then_two_checks_at_once_never_drain_again(
    driver: Path, tmp_path: Path
) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    kern = tmp_path / "kern.log"
    kern.write_text(xid_line(79, time.time() - 60))
    ok = machine(tmp_path, healthy(0))
    state = tmp_path / "check-state.json"
    common = ("--state", str(state), "--kernel-log", str(kern), *SLOW_OK)
    for _trial in range(3):
        state.unlink(missing_ok=True)
        set_node(tmp_path, "IDLE", None)
        log.unlink(missing_ok=True)
        # The plain check reads first and writes last (a longer sample): before the lock, it wrote the file
        # back without the drain record.
        plain = start(driver, ok, bin_dir, *common, "--sample-s", "2")
        results = finish([start(driver, ok, bin_dir, *common, "--drain"), plain])
        assert [r[0] for r in results] == [1, 1]
        assert len(updates(log)) == 1 and saved(state)["drain"] is not None
        set_node(tmp_path, "IDLE", None)  # the administrator resumes the node
        results = finish(
            [start(driver, ok, bin_dir, *common), start(driver, ok, bin_dir, *common, "--drain")]
        )
        assert node(tmp_path) == {"state": "IDLE", "reason": None}
        assert len(updates(log)) == 1, updates(log)
        doc = saved(state)
        assert doc["acknowledged"]["until"] is not None and doc["drain"] is None
        assert results[1][0] == 0, results[1]


def test_sections_written_by_many_processes_at_once_are_all_kept(tmp_path: Path) -> None:
    """``system.state_file.update_section``: the API another command (accept) uses for its own section."""
    state = tmp_path / "s" / "check-state.json"
    code = (
        "import sys; from pathlib import Path; from gputopo.system.state_file import update_section;"
        "r = update_section(Path(sys.argv[1]), 'gpu07', sys.argv[2], lambda old: {'n': sys.argv[2]}, 60);"
        "print(r.saved, r.why_not)"
    )
    env = {**os.environ, "PYTHONPATH": str(fake_driver.SRC)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(state), f"sec{i}"], env=env, stdout=subprocess.PIPE, text=True
        )
        for i in range(12)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(o.startswith("True") for o in outs), outs
    doc = saved(state)
    assert {k for k in doc if k.startswith("sec")} == {f"sec{i}" for i in range(12)}
    assert (
        oct(state.stat().st_mode & 0o777) == "0o644" and oct(state.parent.stat().st_mode & 0o777) == "0o755"
    )
    assert (tmp_path / "s" / "check-state.json.old").exists()


# --- nothing unknown destroyed, a newer schema read only, the backup ----


def test_an_unknown_section_survives_a_check(driver: Path, tmp_path: Path) -> None:
    bin_dir, _ = fake_scontrol(tmp_path, None)
    state = tmp_path / "check-state.json"
    accept = {"verdict": "accepted", "at": 1700000000, "nested": {"a": [1, 2]}}
    state.write_text(json.dumps({"schema": "gputopo/check-state/v1", "node": "gpu07", "accept": accept}))
    result = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain", "--state", str(state))
    assert result.returncode == 1
    doc = saved(state)
    assert doc["accept"] == accept and doc["drain"] is not None and doc["last"]["verdict"] == "problems"


def test_a_newer_schema_is_read_only_and_drain_exits_3(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    state = tmp_path / "check-state.json"
    state.write_text(json.dumps({"schema": "gputopo/check-state/v2", "node": "gpu07", "acks": {"x": 1}}))
    before = state.read_text()
    plain = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--state", str(state))
    assert plain.returncode == 0 and "written by a newer gputopo (schema v2" in plain.stderr
    acting = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain", "--state", str(state))
    assert acting.returncode == 3 and updates(log) == []
    assert "written by a newer gputopo" in acting.stdout
    assert state.read_text() == before and not (tmp_path / "check-state.json.old").exists()


def test_a_truncated_state_comes_back_from_its_backup_and_is_moved_aside(
    driver: Path, tmp_path: Path
) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    state = tmp_path / "check-state.json"
    args = ("--drain", "--state", str(state))
    assert slurm_check(driver, machine(tmp_path, SICK), bin_dir, *args).returncode == 1
    # a second save keeps the first as .old, both with the drain record
    assert slurm_check(driver, machine(tmp_path, SICK), bin_dir, *args).returncode == 1
    drain = saved(state)["drain"]
    assert drain is not None and saved(tmp_path / "check-state.json.old")["drain"] == drain
    text = state.read_text()
    state.write_text(text[: len(text) // 2])  # cut off mid-write by a full disk, a crash
    cut = state.read_text()
    again = slurm_check(driver, machine(tmp_path, SICK), bin_dir, *args)
    assert again.returncode == 1
    assert f"--state {state}: corrupt" in again.stderr and "check-state.json.old" in again.stderr
    assert "read its backup" in again.stderr and "moved aside to check-state.json.bad" in again.stderr
    assert saved(state)["drain"] == drain  # the record came back
    assert (tmp_path / "check-state.json.bad").read_text() == cut
    assert len(updates(log)) == 1  # the node, drained by gputopo, not drained again


# --- trust only what root could have written ----


def test_a_symlink_at_the_state_path_is_refused_and_its_target_untouched(
    driver: Path, tmp_path: Path
) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    target = tmp_path / "precious"
    target.write_text("root's own file\n")
    state = tmp_path / "check-state.json"
    state.symlink_to(target)
    plain = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--state", str(state))
    assert plain.returncode == 2 and "is a symbolic link" in plain.stderr and plain.stdout == ""
    acting = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain", "--state", str(state))
    assert acting.returncode == 3 and "is a symbolic link" in acting.stderr
    assert target.read_text() == "root's own file\n" and state.is_symlink() and updates(log) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="root's refusals need root")
def test_as_root_another_users_or_a_writable_state_is_refused(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    state = tmp_path / "check-state.json"
    ack = {"until": 4102444800, "keys": [], "by": "nobody"}  # 2100: every Xid "acknowledged"
    state.write_text(json.dumps({"schema": "gputopo/check-state/v1", "node": "gpu07", "acknowledged": ack}))
    os.chown(state, 65534, 65534)
    kern = tmp_path / "kern.log"
    kern.write_text(xid_line(79, time.time() - 60))
    args = ("--drain", "--state", str(state), "--kernel-log", str(kern))
    owned = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, *args)
    assert owned.returncode == 3 and "not root" in owned.stderr and "uid 65534" in owned.stderr
    assert "chown root:root" in owned.stderr and updates(log) == []
    os.chown(state, 0, 0)
    state.chmod(0o666)
    writable = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--state", str(state))
    assert writable.returncode == 2 and "writable by everyone (mode 0666)" in writable.stderr
    assert oct(state.stat().st_mode & 0o777) == "0o666"  # not rewritten either
    # A folder others can write, without the sticky bit.
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    open_folder = slurm_check(
        driver, machine(tmp_path, healthy(0)), bin_dir, "--state", str(folder / "s.json")
    )
    assert open_folder.returncode == 2 and "writable by others (mode 0777) without the sticky bit" in (
        open_folder.stderr
    )
    folder.chmod(0o1777)  # as /tmp: sticky
    sticky = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--state", str(folder / "s.json"))
    assert sticky.returncode == 0, sticky.stderr
    assert oct((folder / "s.json").stat().st_mode & 0o777) == "0o644"  # users read root's verdict
    # ... but only root opens the lock: flock needs no write permission, and a user holding root's lock
    # would stop every check.
    lock = folder / "s.json.lock"
    assert oct(lock.stat().st_mode & 0o777) == "0o600"


# --- every read through the one safe reader ----


def test_a_fifo_deep_or_huge_state_is_a_warning_within_the_budget(driver: Path, tmp_path: Path) -> None:
    bin_dir, _ = fake_scontrol(tmp_path, None)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    started = time.monotonic()
    result = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--state", str(fifo))
    assert time.monotonic() - started < 50
    assert result.returncode == 0, result.stderr
    assert f"--state {fifo}: is a fifo, not a regular file" in result.stderr
    deep = tmp_path / "deep.json"
    for machine_lines, code in ((healthy(0), 0), (SICK, 1)):
        deep.write_text("[" * 10000 + "]" * 10000)  # moved aside by each save
        result = slurm_check(driver, machine(tmp_path, machine_lines), bin_dir, "--state", str(deep))
        assert result.returncode == code, result.stderr
        assert "JSON nested deeper than" in result.stderr and "Traceback" not in result.stderr
    huge = tmp_path / "huge.json"
    with huge.open("wb") as fh:
        fh.truncate(100 * 1024 * 1024)
    result = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--state", str(huge))
    assert result.returncode == 0 and "larger than 4 MiB" in result.stderr


def test_a_bad_state_is_a_warning_in_the_commands_that_read_it(tmp_path: Path) -> None:
    """topo --json carried a bad file as ``"check": null`` with no word; recommend and run likewise."""
    from conftest import invoke
    from fake_nvml import FakeNvml

    state = tmp_path / "state.json"
    env = {"SLURMD_NODENAME": "rack1-07", "GPUTOPO_CHECK_STATE": str(state)}
    for content, words in (
        ("{cut", "corrupt"),
        ("[" * 10000 + "]" * 10000, "JSON nested deeper than"),
        ('{"schema": "gputopo/check-state/v9", "node": "rack1-07"}', "written by a newer gputopo"),
    ):
        state.write_text(content)
        with FakeNvml.nvlink_box().installed():
            result = invoke("topo", "--json", env=env)
        doc = json.loads(result.stdout)
        assert result.exit_code == 0 and doc["check"] is None
        assert any(words in w and str(state) in w for w in doc["warnings"]), doc["warnings"]
        assert words in result.stderr
        with FakeNvml.nvlink_box().installed():
            rec = invoke("recommend", "--n", "2", "--json", env=env)
        assert rec.exit_code == 0 and words in rec.stderr
        assert any(
            n["what"] == "the last gputopo check" for n in json.loads(rec.stdout)["health"]["not_checked"]
        )
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with FakeNvml.nvlink_box().installed():
        result = invoke("topo", "--json", env={**env, "GPUTOPO_CHECK_STATE": str(fifo)})
    assert result.exit_code == 0 and "is a fifo, not a regular file" in result.stderr


def test_the_last_check_reaches_the_other_commands_and_a_bad_one_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last check's judgement is read through the safe reader: its problems reach the other commands,
    and a bad file is one not-checked line there (machine.with_last_check)."""
    from gputopo.findings import Finding
    from gputopo.health.judge import Judgement
    from gputopo.health.state import CheckState, dumps, remember_judgement
    from gputopo.system.machine import with_last_check

    state = tmp_path / "state.json"
    sick = Finding(where="GPU1", gpu=1, what="row remap failed", remedy="drain", category="memory")
    state.write_text(dumps(remember_judgement(CheckState("n1"), time.time() - 30, "problems", [sick], None)))
    monkeypatch.setenv("GPUTOPO_CHECK_STATE", str(state))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    judged = with_last_check(Judgement((), ()), {1: None})
    assert [f.gpu for f in judged.findings] == [1] and judged.not_checked == ()
    state.write_text("{cut")
    judged = with_last_check(Judgement((), ()), {1: None})
    assert judged.findings == () and judged.not_checked[0].what == "the last gputopo check"
    assert "corrupt" in judged.not_checked[0].why


def test_a_healthy_check_of_one_rule_set_keeps_anothers_problems(driver: Path, tmp_path: Path) -> None:
    """One check per subsystem (node-problem-detector runs one rule each): the latest judgement is kept per
    --thresholds file, and the node's verdict for the other commands is the worst fresh one."""
    from gputopo.health.state import check_state, fresh_judgement, parse_doc

    bin_dir, _ = fake_scontrol(tmp_path, None)
    state = tmp_path / "check-state.json"
    quiet = tmp_path / "no-memory.json"
    quiet.write_text('{"row_remap_failure": {"enabled": false}}')
    sick = machine(tmp_path, SICK)
    assert slurm_check(driver, sick, bin_dir, "--state", str(state)).returncode == 1
    assert (
        slurm_check(driver, sick, bin_dir, "--state", str(state), "--thresholds", str(quiet)).returncode == 0
    )
    doc, _ = parse_doc(saved(state), "f", "gpu07")
    judged = check_state(doc, "gpu07")
    assert set(judged.results) == {"default", str(quiet)} and judged.verdict == "healthy"
    assert fresh_judgement(judged, time.time())["verdict"] == "problems"
