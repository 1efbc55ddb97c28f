"""``gputopo kill-stale`` against real processes and the real lsof.

Files in a temporary folder stand in for ``/dev/nvidia*`` (``--device-files``); child processes from
``tests/helpers/gpu_holder.py`` hold them open. NVML is faked at the ``system.inventory`` seam. Every
test ends by killing what is left and checking that none of its processes still exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from typer.testing import CliRunner

from gputopo.cli import app
from gputopo.procs.holders import ProcessRef
from gputopo.procs.stale import StopResult
from gputopo.procs.terminate import stop_processes
from gputopo.system import inventory
from gputopo.system.inventory import ProcessListing

HELPER = Path(__file__).resolve().parent / "helpers" / "gpu_holder.py"
REPO = Path(__file__).resolve().parents[1]
PLAIN_ENV = {"NO_COLOR": "1", "COLUMNS": "200", "TERM": "dumb"}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="kill-stale reads Linux processes")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from /proc/PID/stat; ``None`` when the pid is free.

    Read directly, not through psutil, so that tests which patch psutil cannot blind the cleanup.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[19])


def running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has exited: it does not run)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


class Procs:
    """Starts helper processes and guarantees none outlives the test."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen[str]] = []
        self.started: list[tuple[int, int]] = []  # (pid, start ticks): a process, not a bare pid

    def start(self, role: str, *args: str, argv0: str | None = None) -> dict[str, int]:
        """Start a helper and wait for its ``ready`` line; returns its fields (``pid``, ``zombie``)."""
        cmd = [argv0 or sys.executable, str(HELPER), role, *args]
        popen = subprocess.Popen(cmd, executable=sys.executable, stdout=subprocess.PIPE, text=True)
        self.popens.append(popen)
        self._track(popen.pid)
        assert popen.stdout is not None
        readable, _, _ = select.select([popen.stdout], [], [], 15)
        assert readable, f"helper {role} never became ready"
        line = popen.stdout.readline().split()
        assert line and line[0] == "ready", line
        fields = {k: int(v) for k, v in (f.split("=") for f in line[1:])}
        for pid in fields.values():
            self._track(pid)
        return fields

    def _track(self, pid: int) -> None:
        stat = _stat(pid)
        assert stat is not None, f"helper process {pid} vanished"
        if all(p != pid for p, _ in self.started):
            self.started.append((pid, stat[1]))

    def _exists(self, pid: int, ticks: int) -> bool:
        stat = _stat(pid)
        return stat is not None and stat[1] == ticks

    def finish(self) -> None:
        """Kill whatever is left (newest first, so subreapers reap their descendants), wait, and check."""
        for pid, ticks in reversed(self.started):
            if self._exists(pid, ticks):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for popen in self.popens:
            popen.wait(timeout=15)
            if popen.stdout:
                popen.stdout.close()
        deadline = time.monotonic() + 10
        while any(self._exists(*s) for s in self.started) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [p for p, t in self.started if self._exists(p, t)], "a test process was left behind"


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.finish()


@pytest.fixture
def devices(tmp_path: Path) -> dict[str, str]:
    """Stand-ins for /dev/nvidia0, /dev/nvidia1 and /dev/nvidiactl, and the glob naming them."""
    files = {name: tmp_path / name for name in ("nvidia0", "nvidia1", "nvidiactl")}
    for f in files.values():
        f.write_text("")
    out = {k: str(v) for k, v in files.items()}
    out["glob"] = str(tmp_path / "nvidia*")
    return out


@pytest.fixture(autouse=True)
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML unavailable unless a test says otherwise (as on a machine without the driver)."""
    set_nvml(monkeypatch, processes=None, minors=None)


def comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def set_nvml(monkeypatch: pytest.MonkeyPatch, processes, minors, refused=None, names=None) -> None:  # type: ignore[no-untyped-def]
    """Fake NVML at the ``system.inventory`` seam: ``processes`` is a list of (pid, gpu, MiB), or a
    callable giving one, or ``None`` (NVML unavailable). NVML's names are the processes' own unless
    ``names`` says otherwise (NVML reads them from /proc: see ``system.nvml.process_name``)."""

    def listing() -> ProcessListing | None:
        found = processes() if callable(processes) else processes
        if found is None:
            return None
        entries = tuple((pid, gpu, mib, "compute") for pid, gpu, mib in found)
        given = names or {}
        return ProcessListing(
            entries, dict(refused or {}), {pid: given.get(pid, comm(pid)) for pid, *_ in found}
        )

    monkeypatch.setattr(inventory, "process_listing", listing)
    monkeypatch.setattr(inventory, "minor_numbers", lambda: minors)


def orphaned(procs: Procs, role: str, *files: str) -> tuple[int, int]:
    """Start a worker under a launcher (``launch-rank`` or ``launch-spawn``), kill the launcher and wait
    until the worker is adopted; returns (worker, dead launcher). A rank leads its own session, as
    torchrun's do, so its subreaper is named like one (tini)."""
    extra = ("--comm", "tini") if role == "launch-rank" else ()
    fields = procs.start(role, *files, *extra)
    worker, launcher = fields["pid"], fields["launcher"]
    os.kill(launcher, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while psutil.Process(worker).ppid() == launcher:
        assert time.monotonic() < deadline, "the worker was never adopted"
        time.sleep(0.01)
    return worker, launcher


def kill_stale(*args: str, input: str | None = None):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, ["kill-stale", *args], env=PLAIN_ENV, input=input)


def as_json(*args: str) -> tuple[int, dict]:
    result = kill_stale(*args, "--json")
    return result.exit_code, json.loads(result.stdout)


def by_pid(doc: dict) -> dict[int, dict]:
    return {h["pid"]: h for h in doc["holders"]}


def test_rank_whose_launcher_was_killed_is_stale_and_goes_with_yes(
    procs: Procs, devices: dict[str, str]
) -> None:
    rank, launcher = orphaned(procs, "launch-rank", devices["nvidia0"], devices["nvidiactl"])
    worker = procs.start("hold", devices["nvidia1"])["pid"]

    result = kill_stale("--device-files", devices["glob"])
    assert result.exit_code == 0, result.output
    assert "launcher gone" in result.stdout and "would stop" in result.stdout
    assert "Dry run: --yes would stop 1 process" in result.stdout
    assert running(rank)

    code, doc = as_json("--device-files", devices["glob"])
    assert code == 0 and doc["schema"] == "gputopo/stale/v1" and doc["dry_run"] is True
    held = by_pid(doc)
    assert held[rank]["kind"] == "rank" and "torchrun rank 0 of run test-run" in held[rank]["marks"]
    assert held[rank]["stale"] is True and held[rank]["action"] == "listed"
    assert any(
        "adopted by" in r and "(tini), a subreaper outside its job" in r for r in held[rank]["reasons"]
    )
    assert held[rank]["parent"] != str(launcher) and held[rank]["ppid"] != launcher
    assert held[rank]["devices"] == [devices["nvidia0"], devices["nvidiactl"]]
    assert held[worker]["stale"] is False and held[worker]["action"] == "spared"
    assert held[worker]["kind"] == "process"
    assert running(rank)

    code, doc = as_json("--device-files", devices["glob"], "--yes", "--grace", "1")
    assert code == 0
    assert by_pid(doc)[rank]["action"] == "terminated" and by_pid(doc)[rank]["gone"] is True
    assert by_pid(doc)[worker]["action"] == "spared"
    assert not running(rank)
    assert running(worker)


def test_spawn_child_whose_parent_was_killed_is_stale(procs: Procs, devices: dict[str, str]) -> None:
    child, _ = orphaned(procs, "launch-spawn", devices["nvidia0"])

    code, doc = as_json("--device-files", devices["glob"], "--yes", "--grace", "1")
    assert code == 0
    held = by_pid(doc)[child]
    assert held["kind"] == "spawn worker" and "multiprocessing" in held["marks"]
    assert held["stale"] is True and any(r.startswith("launcher gone") for r in held["reasons"])
    assert held["action"] == "terminated"
    assert not running(child)


@pytest.mark.parametrize("role", ["launch-rank", "launch-spawn"])
def test_workers_whose_launcher_runs_are_not_stale(procs: Procs, devices: dict[str, str], role: str) -> None:
    fields = procs.start(role, devices["nvidia0"])
    worker, launcher = fields["pid"], fields["launcher"]

    code, doc = as_json("--device-files", devices["glob"], "--yes", "--grace", "1")
    assert code == 0
    held = by_pid(doc)[worker]
    assert held["kind"] in ("rank", "spawn worker") and held["stale"] is False
    assert held["parent"].startswith(f"{launcher} (") and "is running" in held["why"]
    assert held["action"] == "spared" and held["spared_reasons"][0].startswith("not stale")
    assert running(worker) and running(launcher)


def test_dataloader_worker_whose_rank_died_is_stale_while_the_launcher_lives(
    procs: Procs, devices: dict[str, str]
) -> None:
    fields = procs.start("launch-rank", devices["nvidia0"], "--fork-worker", "--comm", "tini")
    rank, launcher, worker = fields["pid"], fields["launcher"], fields["worker"]

    code, doc = as_json("--device-files", devices["glob"])
    held = by_pid(doc)
    assert held[worker]["kind"] == "fork worker" and f"forked from {rank}" in held[worker]["marks"]
    assert held[worker]["stale"] is False and held[rank]["stale"] is False
    assert held[rank]["ppid"] == launcher

    os.kill(rank, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while psutil.Process(worker).ppid() == rank:
        assert time.monotonic() < deadline, "the worker was never adopted"
        time.sleep(0.01)
    code, doc = as_json("--device-files", devices["glob"], "--yes", "--grace", "1")
    assert code == 0
    held = by_pid(doc)
    assert held[worker]["kind"] == "rank"  # its parent is gone; it still carries the rank's environment
    assert held[worker]["reasons"][0].startswith("launcher gone: adopted by")
    assert held[worker]["action"] == "terminated"
    assert not running(worker) and running(launcher)


def test_detached_sleeper_is_not_stale_and_goes_only_with_all_or_pid(
    procs: Procs, devices: dict[str, str]
) -> None:
    sleeper = procs.start("orphan", devices["nvidia0"])["pid"]  # adopted, no launcher marks
    other = procs.start("hold", devices["nvidia1"])["pid"]

    code, doc = as_json("--device-files", devices["glob"], "--yes", "--grace", "1")
    assert code == 0
    held = by_pid(doc)[sleeper]
    assert held["kind"] == "detached" and held["stale"] is False and held["action"] == "spared"
    assert "detached" in held["why"] and "--all or --pid would stop it" in held["spared_reasons"][0]
    assert running(sleeper)

    code, doc = as_json("--device-files", devices["glob"], "--pid", str(sleeper), "--yes", "--grace", "1")
    assert code == 0
    assert by_pid(doc)[sleeper]["action"] == "terminated"
    assert by_pid(doc)[other]["action"] == "spared"
    assert by_pid(doc)[other]["spared_reasons"] == ["not named by --pid"]
    assert not running(sleeper) and running(other)

    again = procs.start("orphan", devices["nvidia0"])["pid"]
    code, doc = as_json("--device-files", devices["glob"], "--all", "--yes", "--grace", "1")
    assert code == 0
    assert by_pid(doc)[again]["action"] == "terminated" and by_pid(doc)[other]["action"] == "terminated"
    assert not running(again) and not running(other)


def _pid1_may_launch() -> bool:
    """True when this machine's PID 1 could be a launcher (Python or torchrun): then its children are
    not orphans, by design, and the PID 1 tests below do not apply."""
    from gputopo.procs.jobs import is_init, launches
    from gputopo.system.lsof import read_process

    pid1 = read_process(1)
    assert pid1 is not None
    worker = read_process(os.getpid())
    assert worker is not None
    return not is_init(pid1) and launches(pid1, worker)


def _pid1_reaps() -> bool:
    """True when PID 1 here reaps an orphan that exits (a process that is not an init may not)."""
    out = subprocess.run(
        ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    )
    orphan = int(out.stdout)
    os.kill(orphan, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _stat(orphan) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.skipif(_pid1_may_launch(), reason="PID 1 here is a Python process or a launcher")
def test_pid_1_of_this_machine_adopts_a_detached_job_and_an_orphaned_rank(
    procs: Procs, devices: dict[str, str]
) -> None:
    if not _pid1_reaps():
        pytest.skip("PID 1 here does not reap orphans, so the test could not clean up after itself")
    detached = procs.start("pid1-hold", devices["nvidia1"])["pid"]
    fields = procs.start("pid1-rank", devices["nvidia0"])
    rank, launcher = fields["pid"], fields["launcher"]
    os.kill(launcher, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while psutil.Process(rank).ppid() != 1:
        assert time.monotonic() < deadline, "PID 1 never adopted the rank"
        time.sleep(0.01)

    code, doc = as_json("--device-files", devices["glob"], "--yes", "--grace", "1")
    assert code == 0
    held = by_pid(doc)
    assert held[detached]["ppid"] == 1 and held[detached]["kind"] == "detached"
    assert held[detached]["stale"] is False and held[detached]["action"] == "spared"
    assert held[rank]["ppid"] == 1 and held[rank]["kind"] == "rank"
    assert held[rank]["reasons"][0].startswith("launcher gone: reparented to PID 1 (")
    assert held[rank]["action"] == "terminated"
    assert running(detached) and not running(rank)

    code, doc = as_json("--device-files", devices["glob"], "--pid", str(detached), "--yes", "--grace", "1")
    assert code == 0 and by_pid(doc)[detached]["action"] == "terminated"
    assert not running(detached)


def test_pid_keeps_every_protection_and_names_unknown_pids(procs: Procs, devices: dict[str, str]) -> None:
    daemon = procs.start(
        "hold", devices["nvidiactl"], "--comm", "nvidia-persistenced", argv0="nvidia-persistenced"
    )["pid"]
    me = os.getpid()
    with open(devices["nvidia0"]):
        result = kill_stale(
            "--device-files",
            devices["glob"],
            "--pid",
            str(daemon),
            "--pid",
            str(me),
            "--pid",
            "4194305",
            "--yes",
            "--json",
        )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["policy"]["pids"] == sorted([daemon, me, 4194305])
    assert by_pid(doc)[daemon]["action"] == "spared" and by_pid(doc)[daemon]["protected"] is True
    assert by_pid(doc)[me]["protected_reasons"] == ["this gputopo process"]
    assert any("--pid 4194305" in n for n in doc["notes"])
    assert running(daemon)

    result = kill_stale("--device-files", devices["glob"], "--pid", "0")
    assert result.exit_code == 2 and "positive" in result.stderr


def test_holder_with_live_parent_is_stopped_only_with_all(procs: Procs, devices: dict[str, str]) -> None:
    worker = procs.start("hold", devices["nvidia0"])["pid"]

    code, doc = as_json("--device-files", devices["glob"], "--yes", "--grace", "1")
    assert code == 0
    assert by_pid(doc)[worker]["stale"] is False
    assert by_pid(doc)[worker]["spared_reasons"][0].startswith("not stale: no launcher marks")
    assert running(worker)

    code, doc = as_json("--device-files", devices["glob"], "--all", "--yes", "--grace", "1")
    assert code == 0
    assert by_pid(doc)[worker]["action"] == "terminated"
    assert not running(worker)


def test_holder_ignoring_sigterm_is_killed_after_the_grace(procs: Procs, devices: dict[str, str]) -> None:
    stubborn = procs.start("hold", devices["nvidia0"], "--ignore-term")["pid"]

    started = time.monotonic()
    result = kill_stale("--device-files", devices["glob"], "--all", "--yes", "--grace", "1")
    elapsed = time.monotonic() - started
    assert result.exit_code == 0, result.output
    assert "killed" in result.stdout and "Stopped 1 of 1: 1 killed." in result.stdout
    assert elapsed >= 1.0
    assert not running(stubborn)


def test_holder_named_like_a_protected_daemon_survives_all_yes(procs: Procs, devices: dict[str, str]) -> None:
    daemon = procs.start(
        "hold", devices["nvidiactl"], "--comm", "nvidia-persistenced", argv0="nvidia-persistenced"
    )["pid"]
    other = procs.start("hold", devices["nvidia0"])["pid"]

    code, doc = as_json("--device-files", devices["glob"], "--all", "--yes", "--grace", "1")
    assert code == 0
    held = by_pid(doc)
    assert held[daemon]["protected"] is True and held[daemon]["action"] == "spared"
    assert any("NVIDIA persistence daemon" in r for r in held[daemon]["protected_reasons"])
    assert held[other]["action"] == "terminated"
    assert running(daemon)
    assert not running(other)


def test_never_targets_itself_or_its_ancestors(procs: Procs, devices: dict[str, str]) -> None:
    bystander = procs.start("hold", devices["nvidia1"])["pid"]
    with open(devices["nvidia0"]):  # pytest (an ancestor of the tool run below) holds a device too
        tool = [sys.executable, "-m", "gputopo", "kill-stale", "--device-files", devices["glob"]]
        launcher = subprocess.Popen(
            [sys.executable, str(HELPER), "run", devices["nvidia0"], "--", *tool, "--all", "--yes", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **PLAIN_ENV},
            start_new_session=True,  # its own process group, so a hang can be ended whole
        )
        try:
            stdout, stderr = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
            raise
        assert launcher.returncode == 0, stderr
        doc = json.loads(stdout)
        held = by_pid(doc)
        me = os.getpid()
        tool_runs = [h for h in doc["holders"] if "this gputopo process" in h["protected_reasons"]]
        assert len(tool_runs) == 1 and not tool_runs[0]["targeted"]
        ancestors = {
            h["pid"]: h for h in doc["holders"] if any("ancestor" in r for r in h["protected_reasons"])
        }
        assert tool_runs[0]["ppid"] in ancestors  # the helper that launched the tool, holding the device
        assert me in ancestors  # and pytest, two generations up
        assert not any(h["targeted"] for h in ancestors.values())
        assert held[bystander]["action"] == "terminated"

        # In-process, the test runner itself is the tool: listed as such, never a target.
        code, doc = as_json("--device-files", devices["glob"], "--all", "--yes")
        assert code == 0
        assert by_pid(doc)[me]["protected_reasons"] == ["this gputopo process"]
        assert by_pid(doc)[me]["targeted"] is False
    assert not running(bystander)


def test_reused_pid_is_not_signalled(procs: Procs, devices: dict[str, str]) -> None:
    live = procs.start("hold", devices["nvidia0"])["pid"]
    listed = ProcessRef(live, psutil.Process(live).create_time() - 30.0)  # what was listed before reuse

    [outcome] = stop_processes([listed], grace_s=1)
    assert outcome.result is StopResult.ALREADY_GONE
    assert "now belongs to another process" in outcome.detail
    assert running(live)  # a plain holder dies on SIGTERM: it was not signalled


def test_access_denied_on_signal_is_reported_not_a_crash(
    procs: Procs, devices: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    guarded_pid = procs.start("hold", devices["nvidia0"])["pid"]
    other = procs.start("hold", devices["nvidia1"])["pid"]
    real_send = psutil.Process.send_signal

    def send_signal(self: psutil.Process, sig: int) -> None:
        if self.pid == guarded_pid:
            raise psutil.AccessDenied(self.pid)
        real_send(self, sig)

    monkeypatch.setattr(psutil.Process, "send_signal", send_signal)
    result = kill_stale("--device-files", devices["glob"], "--all", "--yes", "--grace", "1", "--json")
    assert result.exit_code == 1
    held = by_pid(json.loads(result.stdout))
    assert held[guarded_pid]["action"] == "failed" and held[guarded_pid]["result"] == "access denied"
    assert held[other]["action"] == "terminated"
    assert "could not be stopped" in result.stderr and "Traceback" not in result.output
    assert running(guarded_pid)


def test_unreadable_process_is_listed_not_signalled(
    procs: Procs, devices: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    hidden = procs.start("hold", devices["nvidia0"])["pid"]
    real_create_time = psutil.Process.create_time

    def create_time(self: psutil.Process) -> float:
        if self.pid == hidden:
            raise psutil.AccessDenied(self.pid)
        return real_create_time(self)

    monkeypatch.setattr(psutil.Process, "create_time", create_time)
    code, doc = as_json("--device-files", devices["glob"], "--all", "--yes", "--grace", "1")
    assert code == 0
    held = by_pid(doc)[hidden]
    assert held["protected"] is True and "cannot be read (access denied)" in held["protected_reasons"]
    assert held["action"] == "spared"
    assert running(hidden)


def test_failed_when_a_process_outlives_sigkill(
    procs: Procs, devices: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stuck = procs.start("hold", devices["nvidia0"], "--ignore-term")["pid"]
    real_send = psutil.Process.send_signal

    def send_signal(self: psutil.Process, sig: int) -> None:
        if sig != signal.SIGKILL:  # stands in for a process stuck in the driver, which SIGKILL cannot end
            real_send(self, sig)

    monkeypatch.setattr(psutil.Process, "send_signal", send_signal)
    monkeypatch.setattr("gputopo.procs.terminate.KILL_WAIT_S", 0.3)
    result = kill_stale("--device-files", devices["glob"], "--all", "--yes", "--grace", "0.2")
    assert result.exit_code == 1
    assert "failed" in result.stdout and "still running" in result.stdout
    assert running(stuck)


def test_a_zombie_holder_never_makes_its_live_parent_a_target(
    procs: Procs, devices: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fields = procs.start("zombie-parent", devices["nvidia1"])
    parent, zombie = fields["pid"], fields["zombie"]
    assert psutil.Process(zombie).status() == psutil.STATUS_ZOMBIE

    # An exited process has closed its files (do_exit's exit_files comes before exit_notify), so no scan
    # can see one holding a device: the scan is told that the (real) zombie holds one, as when a process
    # exits between lsof and the process read.
    import gputopo.system.lsof as lsof_mod
    from gputopo.procs.holders import OpenDevices

    real_find = lsof_mod.find_open_devices

    def find_open_devices(files):  # type: ignore[no-untyped-def]
        records, source, warnings = real_find(files)
        return [*records, OpenDevices(zombie, (devices["nvidia0"],))], source, warnings

    monkeypatch.setattr(lsof_mod, "find_open_devices", find_open_devices)

    code, doc = as_json("--device-files", devices["glob"], "--pid", str(zombie), "--yes", "--grace", "1")
    held = by_pid(doc)
    assert code == 0
    assert held[zombie]["action"] == "spared" and held[zombie].get("target_pid") in (None, zombie)
    assert running(parent)  # the parent holds a GPU file and runs: it is never stopped for its child


LEADER_EXIT_C = Path(__file__).resolve().parent / "helpers" / "leader_exit.c"


@pytest.fixture(scope="module")
def leader_exit(tmp_path_factory: pytest.TempPathFactory) -> str:
    """tests/helpers/leader_exit.c, built with the system's C compiler (skipped without one)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the exited-main-thread helper")
    out = tmp_path_factory.mktemp("leader") / "leader_exit"
    subprocess.run([cc, "-O1", "-pthread", "-o", str(out), str(LEADER_EXIT_C)], check=True, timeout=120)
    return str(out)


def wait_for_state(pid: int, state: str, timeout_s: float = 10.0) -> bool:
    """Whether process ``pid`` reaches ``state`` (as /proc/PID/stat shows it) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = _stat(pid)
        if now is not None and now[0] == state:
            return True
        time.sleep(0.02)
    return False


def thread_state(pid: int, tid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_an_exited_main_thread_whose_thread_holds_the_gpu_is_found_and_stopped_not_its_parent(
    procs: Procs, devices: dict[str, str], leader_exit: str
) -> None:
    fields = procs.start("leader-exit", leader_exit, "run", devices["nvidia0"])
    parent, leader, thread = fields["pid"], fields["leader"], fields["thread"]
    assert wait_for_state(leader, "Z")  # the helper reports its ids just before its main thread exits
    assert thread_state(leader, thread) in ("S", "R")

    # lsof and /proc/PID/fd miss what the live thread holds; gputopo reads /proc/PID/task/TID/fd.
    code, doc = as_json("--device-files", devices["glob"], "--pid", str(leader))
    held = by_pid(doc)
    assert code == 0 and leader in held and held[leader]["devices"] == [devices["nvidia0"]]
    assert held[leader]["action"] == "listed" and held[leader]["target_pid"] == leader

    code, doc = as_json("--device-files", devices["glob"], "--pid", str(leader), "--yes", "--grace", "2")
    assert code == 0, doc
    assert by_pid(doc)[leader]["action"] == "terminated"
    assert thread_state(leader, thread) in (None, "Z", "X")  # the thread is gone, the GPU file closed
    assert running(parent)


def test_an_exited_main_thread_stuck_in_the_kernel_is_reported_and_nothing_is_signalled(
    procs: Procs, devices: dict[str, str], leader_exit: str
) -> None:
    fields = procs.start("leader-exit", leader_exit, "d", devices["nvidia0"])
    parent, leader, thread = fields["pid"], fields["leader"], fields["thread"]
    procs._track(fields["child"])
    deadline = time.monotonic() + 10
    while thread_state(leader, thread) != "D":  # waiting for its vfork child, in the kernel
        assert time.monotonic() < deadline, "the helper thread never reached state D"
        time.sleep(0.01)
    assert wait_for_state(leader, "Z")

    code, doc = as_json("--device-files", devices["glob"], "--all", "--yes", "--grace", "1")
    held = by_pid(doc)
    assert code == 0
    assert held[leader]["stale"] is True and held[leader]["action"] == "spared"
    assert held[leader]["reasons"][0].startswith(
        f"stuck in the driver: its main thread exited; thread {thread}"
    )
    assert thread_state(leader, thread) == "D" and running(parent)  # nothing was signalled


def test_older_than_spares_young_stale_holders(procs: Procs, devices: dict[str, str]) -> None:
    orphan, _ = orphaned(procs, "launch-rank", devices["nvidia0"])

    code, doc = as_json("--device-files", devices["glob"], "--older-than", "1h", "--yes")
    assert code == 0
    held = by_pid(doc)[orphan]
    assert held["stale"] is True and held["action"] == "spared"
    assert any("younger than --older-than 1h" in r for r in held["spared_reasons"])
    assert running(orphan)

    result = kill_stale("--device-files", devices["glob"], "--older-than", "ten minutes")
    assert result.exit_code == 2 and "not a duration" in result.stderr


def test_interactive_terminal_asks_before_stopping(
    procs: Procs, devices: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    orphan, _ = orphaned(procs, "launch-rank", devices["nvidia0"])
    monkeypatch.setattr("gputopo.cli.stale._stdin_is_tty", lambda: True)

    result = kill_stale("--device-files", devices["glob"], input="n\n")
    assert result.exit_code == 0
    assert "Stop 1 process(es) now" in result.stderr
    assert "would stop" in result.stdout and "Nothing was signalled." in result.stdout
    assert running(orphan)

    result = kill_stale("--device-files", devices["glob"], "--grace", "1", input="y\n")
    assert result.exit_code == 0, result.output
    assert "Stopped 1 of 1: 1 terminated." in result.stdout
    assert not running(orphan)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a holder as another user")
def test_other_users_processes_need_all_users(procs: Procs, devices: dict[str, str]) -> None:
    nobody = pwd.getpwnam("nobody").pw_uid
    theirs = procs.start("hold", devices["nvidia0"], "--uid", str(nobody))["pid"]

    code, doc = as_json("--device-files", devices["glob"], "--all", "--yes", "--grace", "1")
    assert code == 0
    held = by_pid(doc)[theirs]
    assert held["protected"] is True and any("add --all-users" in r for r in held["protected_reasons"])
    assert running(theirs)

    code, doc = as_json("--device-files", devices["glob"], "--all", "--all-users", "--yes", "--grace", "1")
    assert code == 0 and by_pid(doc)[theirs]["action"] == "terminated"
    assert not running(theirs)


def test_gpus_come_from_nvml_lists_and_invisible_is_only_a_note(
    procs: Procs, devices: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``seen`` opened every GPU's device file (CUDA without CUDA_VISIBLE_DEVICES) but works on GPU 0 only;
    # ``client`` holds GPU 1's file without a context, as an NVML client or a forked worker does.
    seen = procs.start("hold", devices["nvidia0"], devices["nvidia1"], devices["nvidiactl"])["pid"]
    client = procs.start("hold", devices["nvidia1"], devices["nvidiactl"])["pid"]

    set_nvml(monkeypatch, lambda: [(seen, 0, 1234)] if running(seen) else [], {0: 0, 1: 1})
    code, doc = as_json("--device-files", devices["glob"])
    held = by_pid(doc)
    assert doc["nvml"]["pids_usable"] is True
    assert held[seen]["gpus"] == [0] and held[seen]["gpu_basis"] == "nvml"
    assert held[seen]["gpu_memory_mib"] == 1234 and held[seen]["stale"] is False
    assert held[client]["gpus"] == [] and held[client]["nvml_listed"] is False
    assert held[client]["stale"] is False and held[client]["reasons"] == []
    assert any("NVML lists no context" in n for n in held[client]["notes"])

    code, doc = as_json("--device-files", devices["glob"], "--gpus", "1")
    assert doc["holders"] == []  # neither has a context on GPU 1, whatever files they hold

    code, doc = as_json("--device-files", devices["glob"], "--gpus", "0", "--all", "--yes", "--grace", "1")
    assert code == 0 and [h["pid"] for h in doc["holders"]] == [seen]
    assert by_pid(doc)[seen]["memory_freed_mib"] == 1234 and doc["summary"]["memory_freed_mib"] == 1234
    assert running(client)

    result = kill_stale("--device-files", devices["glob"], "--gpus", "7")
    assert result.exit_code == 2 and "no GPU 7" in result.stderr


def test_gpus_from_device_files_when_nvml_pids_are_foreign(
    procs: Procs, devices: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    one = procs.start("hold", devices["nvidia1"], devices["nvidiactl"])["pid"]
    # Host pids from a container: none is a process here (pid_max is at most 2**22).
    set_nvml(monkeypatch, [(2**22 + 1, 1, 10), (2**22 + 2, 0, 10)], {0: 0, 1: 1})
    code, doc = as_json("--device-files", devices["glob"], "--gpus", "1")
    held = by_pid(doc)
    assert doc["nvml"]["pids_usable"] is False and held[one]["gpu_memory_mib"] is None
    assert held[one]["gpus"] == [1] and held[one]["gpu_basis"] == "device files"
    assert held[one]["nvml_listed"] is None and held[one]["stale"] is False
    assert any("GPUs from the device files" in n for n in held[one]["notes"])
    assert any("cannot be matched" in n for n in doc["notes"])

    # A device file whose minor NVML does not know: the holder's GPUs are unknown, never selected.
    set_nvml(monkeypatch, [(2**22 + 1, 0, 10)], {0: 0})
    result = kill_stale("--device-files", devices["glob"], "--gpus", "0", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["holders"] == []
    assert f"pid {one}" in result.stderr and "--gpus does not select it" in result.stderr


def test_gpus_without_nvml_is_refused_with_a_hint(devices: dict[str, str]) -> None:
    result = kill_stale("--device-files", devices["glob"], "--gpus", "1")
    assert result.exit_code == 3
    assert "--gpus needs NVML" in result.stderr and "--device-files" in result.stderr


def test_proc_fallback_finds_the_same_holders(
    procs: Procs, devices: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert shutil.which("lsof"), "lsof is needed for these tests (.ci/run installs it)"
    orphan, _ = orphaned(procs, "launch-spawn", devices["nvidia0"])
    worker = procs.start("hold", devices["nvidia1"], devices["nvidiactl"])["pid"]
    code, with_lsof = as_json("--device-files", devices["glob"])
    assert with_lsof["source"] == "lsof"

    monkeypatch.setenv("PATH", str(tmp_path))  # no lsof on PATH
    result = kill_stale("--device-files", devices["glob"], "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["source"] == "/proc" and "lsof not found" in result.stderr
    assert {h["pid"]: h["devices"] for h in doc["holders"]} == {
        h["pid"]: h["devices"] for h in with_lsof["holders"]
    }
    assert {orphan, worker} <= set(by_pid(doc))
    assert by_pid(doc)[orphan]["stale"] is True


def test_exit_3_when_neither_lsof_nor_proc_can_be_read(
    devices: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("gputopo.system.lsof.PROC_ROOT", tmp_path / "no-proc")
    result = kill_stale("--device-files", devices["glob"])
    assert result.exit_code == 3
    assert "lsof is not available" in result.stderr and "install lsof" in result.stderr


def test_no_matching_device_files(tmp_path: Path) -> None:
    result = kill_stale("--device-files", str(tmp_path / "nvidia*"))
    assert result.exit_code == 2 and "no file matches" in result.stderr


def test_kill_stale_does_not_import_torch() -> None:
    code = (
        "import sys; from gputopo.cli import app; import gputopo.cli.stale, gputopo.procs.terminate, "
        "gputopo.system.lsof, gputopo.ui.stale_view; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


def test_machine_without_nvidia_device_files_has_nothing_to_stop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("gputopo.system.lsof.DEFAULT_DEVICE_GLOB", str(tmp_path / "nvidia*"))
    result = kill_stale()
    assert result.exit_code == 0
    assert "No file matches" in result.stdout and "the NVIDIA driver is not loaded" in result.stderr


def test_survey_for_doctor_lists_without_signalling(procs: Procs, devices: dict[str, str]) -> None:
    from gputopo.procs.stale import Policy
    from gputopo.procs.survey import Survey

    worker = procs.start("hold", devices["nvidia0"])["pid"]
    run = Survey.take(devices["glob"], Policy(all=True)).run()
    assert run.dry_run and run.source == "lsof"
    assert [(h.assessment.holder.pid, h.action) for h in run.holders] == [(worker, "listed")]
    assert running(worker)


def test_cli_default_grace_matches_the_service():
    from gputopo.cli.stale import DEFAULT_GRACE_S as cli_grace
    from gputopo.procs.survey import DEFAULT_GRACE_S as service_grace

    assert cli_grace == service_grace


def test_one_survey_reads_nvml_process_lists_once(monkeypatch, procs: Procs, devices: dict[str, str]):
    """Memory figures, GPUs and the PID-namespace verdict come from the same NVML reading."""
    from gputopo.procs.survey import Survey

    holder = procs.start("hold", devices["nvidia0"])["pid"]
    calls = []

    def listing():
        calls.append(1)
        return ProcessListing(((holder, 0, 512, "compute"),), {}, {holder: comm(holder)})

    monkeypatch.setattr(inventory, "process_listing", listing)
    monkeypatch.setattr(inventory, "minor_numbers", lambda: {0: 0})
    survey = Survey.take(devices["glob"])
    assert len(calls) == 1
    assert survey.nvml.sees_pid_namespace is True and survey.nvml.pid_map == {holder: holder}
    [h] = survey.report.assessments
    assert h.holder.gpus == (0,) and h.holder.gpu_memory_mib == 512


def _stale_options(glob: str, act: bool = False) -> Any:
    from gputopo.services import stale

    return stale.Options(
        act=act,
        all_holders=False,
        all_users=False,
        older_than=None,
        grace_s=1.0,
        gpus=None,
        device_files=glob,
        pids=(),
    )


def test_the_service_asks_its_confirm_hook_and_a_no_signals_nothing(
    procs: Procs, devices: dict[str, str]
) -> None:
    from gputopo.services import stale

    orphan, _ = orphaned(procs, "launch-rank", devices["nvidia0"])
    asked: list[tuple[bool, int]] = []

    def no(run: Any, targets: int) -> bool:
        asked.append((run.dry_run, targets))
        return False

    report = stale.run(_stale_options(devices["glob"]), stale.Hooks(confirm=no))
    assert asked == [(True, 1)]  # shown the dry run, with how many it would stop
    assert report.declined and report.exit_code == 0 and report.failure is None
    assert report.document()["schema"] == "gputopo/stale/v1"
    assert running(orphan)
    # No one to ask (no hook): a dry run, never a question, never a signal.
    quiet = stale.run(_stale_options(devices["glob"]), stale.Hooks())
    assert not quiet.declined and quiet.run.dry_run and running(orphan)

    done = stale.run(_stale_options(devices["glob"]), stale.Hooks(confirm=lambda run, n: True))
    assert not done.declined and not done.run.dry_run and done.exit_code == 0
    assert not running(orphan)
