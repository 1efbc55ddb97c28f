"""Stop signals as schedulers and people send them (SIGTERM from `timeout`/scancel/docker stop, SIGHUP from a
dropped ssh session, SIGQUIT, Ctrl-C's SIGINT), sent to real `gputopo` processes with real process trees.

Each test starts gputopo in a session of its own with its own TMPDIR, collects the process tree gputopo
started (pid and start time, so a reused pid is never confused with ours), sends one signal to gputopo
alone, and then checks: exit 128 + signal, one "stopped by SIG...:" line, nothing of that tree left, the
temp folder empty.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import default_stop_signals
from own_procs import MARKER_VAR, leftovers, new_marker

SAMPLE = "sample:workstation-2gpu-nvlink"


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp))
    return subprocess.Popen(
        [sys.executable, "-m", "gputopo", *args],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_stop_signals,
    )


def tree(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_for(
    proc: subprocess.Popen[str], what: str, count: int, limit_s: float = 120
) -> set[tuple[int, float]]:
    """Wait until ``count`` processes of gputopo's tree have ``what`` in their command line; return the
    whole tree as (pid, start time)."""
    deadline = time.monotonic() + limit_s
    while True:
        assert proc.poll() is None, proc.communicate()
        kids = tree(proc)
        found = []
        for p in kids:
            try:
                if what in " ".join(p.cmdline()):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        if len(found) >= count:
            ids = set()
            for p in [psutil.Process(proc.pid), *kids]:
                try:
                    ids.add((p.pid, p.create_time()))
                except psutil.NoSuchProcess:
                    continue
            return ids
        assert time.monotonic() < deadline, f"never saw {count} x {what}"
        time.sleep(0.2)


def still_running(ids: set[tuple[int, float]]) -> list[str]:
    left = []
    for pid, started in ids:
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(p.cmdline())}")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return left


def stop(
    proc: subprocess.Popen[str], sig: signal.Signals, ids: set[tuple[int, float]], own_stderr: bool = True
) -> str:
    """Send ``sig`` to gputopo alone and check how it ended; ``own_stderr=False`` when the command gputopo
    runs writes to stderr itself (torchrun prints its own traceback when it is stopped)."""
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # a failed test must not leave its tree either
            for p in tree(proc):
                p.kill()
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [line for line in lines if f"stopped by {sig.name}:" in line] and len(lines) == 1, err
    assert "Traceback" not in err or not own_stderr
    deadline = time.monotonic() + 5  # SIGKILLed processes may take a moment to be reaped by init
    while still_running(ids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert still_running(ids) == []
    return err


PROBE = ["probe", "--device", "cpu", "--gpus", "0,1", "--model", "tiny", "--steps", "50"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_probe_stopped_by_signal_leaves_nothing(tmp_path, sig):
    pytest.importorskip("torch")
    proc = start(tmp_path, *PROBE, "--report-dir", str(tmp_path / "reports"))
    ids = wait_for(proc, "gputopo.probe.ranks.worker", 2)
    stop(proc, sig, ids)
    assert list((tmp_path / "tmp").iterdir()) == []
    (report,) = (tmp_path / "reports").glob("probe-*.json")
    doc = json.loads(report.read_text())
    assert doc["interrupted"] == sig.name
    assert doc["verdict"] == "interrupted"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGQUIT])
def test_doctor_stopped_by_signal_leaves_nothing(tmp_path, sig):
    pytest.importorskip("torch")
    proc = start(tmp_path, "doctor", "--simulate", "--no-html", "--report-dir", str(tmp_path / "reports"))
    ids = wait_for(proc, "gputopo.probe.ranks.worker", 2)
    stop(proc, sig, ids)
    assert list((tmp_path / "tmp").iterdir()) == []
    (report,) = (tmp_path / "reports").glob("doctor-*.json")
    doc = json.loads(report.read_text())
    assert doc["interrupted"] == sig.name
    assert doc["topology"]  # what was complete before the signal is there


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_run_stopped_by_signal_stops_the_command_tree(tmp_path, sig):
    # A command that starts a child in the background: the child outlives sh unless gputopo stops it.
    script = "sleep 300 & sleep 301; wait"
    proc = start(tmp_path, "run", "--n", "1", "--input", SAMPLE, "--", "sh", "-c", script)
    ids = wait_for(proc, "sleep 30", 2)
    stop(proc, sig, ids)


@pytest.mark.slow
def test_run_under_torchrun_stopped_by_sigterm_leaves_no_rank(tmp_path):
    pytest.importorskip("torch")
    args = ["run", "--n", "2", "--torchrun", "--input", SAMPLE, "--", "sh", "-c", "sleep 302"]
    proc = start(tmp_path, *args)
    ids = wait_for(proc, "sleep 302", 2)  # torch's agent started both ranks
    stop(proc, signal.SIGTERM, ids, own_stderr=False)


def test_a_second_signal_during_cleanup_does_not_cut_it_short(tmp_path):
    # sh ignores SIGTERM here, so gputopo waits out its grace; the second signal must not end gputopo early.
    script = "trap '' TERM; sleep 300 & sleep 301; wait"
    proc = start(tmp_path, "run", "--n", "1", "--input", SAMPLE, "--", "sh", "-c", script)
    ids = wait_for(proc, "sleep 30", 2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    stop(proc, signal.SIGTERM, ids)


def test_nohup_keeps_sighup_ignored(tmp_path):
    # Started with SIGHUP ignored (as nohup does), gputopo leaves it ignored: the command outlives a hang-up.
    env = dict(os.environ, TMPDIR=str(tmp_path))
    args = ["run", "--n", "1", "--input", SAMPLE, "--", "sh", "-c", "sleep 3; exit 5"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputopo", *args],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )
    try:
        wait_for(proc, "sleep 3", 1)  # type: ignore[arg-type]
        os.killpg(proc.pid, signal.SIGHUP)
        assert proc.wait(timeout=60) == 5
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


class _StartRace:
    """``subprocess.Popen`` that sends this process ``sig`` the moment the child exists, before the
    caller can hold it: the race a signal sent while gputopo starts a command runs into."""

    def __init__(self, sig: signal.Signals) -> None:
        self.sig, self.children = sig, []
        self.real = subprocess.Popen

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        child = self.real(*args, **kwargs)
        self.children.append(child)
        os.kill(os.getpid(), self.sig)  # the handler runs at the next bytecode, still inside "Popen"
        for _ in range(100):
            time.sleep(0.001)
        return child


@pytest.fixture
def stop_signals():
    """gputopo's stop handlers in this process, over the dispositions a terminal's shell leaves (this
    runner may have been started with SIGHUP or SIGINT ignored, which gputopo would keep)."""
    from gputopo.cli.common import install_stop_signals, restore_signals

    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    before = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (getattr(signal, n) for n in names)}
    previous = install_stop_signals()
    yield
    restore_signals(previous)
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_a_signal_while_run_starts_the_command_still_stops_it(monkeypatch, stop_signals, sig):
    """Seen under a CPU hog in CI: a signal that arrived inside Popen (the child started, gputopo not yet
    holding it) left the command running and its pipes open. Held back (errors.stop_held) until the
    child is held, it stops the command like any other signal."""
    from gputopo.errors import Interrupted
    from gputopo.system import launcher

    race = _StartRace(sig)
    monkeypatch.setattr(launcher.subprocess, "Popen", race)
    with pytest.raises(Interrupted) as stopped:
        launcher.run_supervised(["sleep", "60"], dict(os.environ), grace_s=1.0, on_ranks=lambda ranks: None)
    assert stopped.value.signum == sig
    (child,) = race.children
    assert child.poll() is not None, "the command was left running"


def test_a_signal_while_the_probe_agent_starts_leaves_it_for_stop_to_find(monkeypatch, stop_signals):
    from gputopo.errors import Interrupted
    from gputopo.probe.pool import launch

    race = _StartRace(signal.SIGTERM)
    monkeypatch.setattr(launch.subprocess, "Popen", race)
    monkeypatch.setattr(launch.sys, "executable", "sleep")  # `sleep -m ...` exits at once; any child does
    run = launch.Launch("gputopo-test-")
    try:
        with pytest.raises(Interrupted):
            run.start_launcher({}, 1, "race", dict(os.environ))
        assert run.proc is race.children[0]  # held: stop() will find and stop it
    finally:
        run.stop()
        run.cleanup()


def test_stop_held_raises_once_at_the_end_and_never_over_another_error():
    from gputopo.errors import Interrupted, defer_stop, stop_held

    assert defer_stop(Interrupted(signal.SIGTERM, "SIGTERM")) is False  # not holding: raise now
    with pytest.raises(Interrupted) as held, stop_held():
        inner = stop_held()
        inner.__enter__()
        assert defer_stop(Interrupted(signal.SIGTERM, "SIGTERM")) is True
        assert defer_stop(Interrupted(signal.SIGINT, "SIGINT")) is True
        inner.__exit__(None, None, None)  # the inner block ends: still held by the outer one
    assert held.value.name == "SIGTERM"  # the first signal, once, when the outer block ends
    with pytest.raises(ValueError), stop_held():
        defer_stop(Interrupted(signal.SIGTERM, "SIGTERM"))
        raise ValueError("the start failed")
    with stop_held():  # nothing left over from before
        pass


def _signal_soon(sig: signal.Signals, after_s: float = 0.5) -> None:
    import threading

    threading.Timer(after_s, os.kill, (os.getpid(), sig)).start()


def _hung_tool(tmp_path: Path, name: str) -> Path:
    """A tool that hangs (as a stuck srun or nvidia-imex-ctl would), started by gputopo in a session of its
    own; it inherits this test's marker (own_procs), so only it is looked for afterwards."""
    tool = tmp_path / name
    tool.write_text("#!/bin/sh\nexec python3 -c 'import time; time.sleep(60)'\n")
    tool.chmod(0o755)
    return tool


def test_stopping_gputopo_while_srun_gathers_stops_srun_too(tmp_path, monkeypatch, stop_signals):
    from gputopo.errors import Interrupted
    from gputopo.system import slurm_gather

    marker = new_marker()
    monkeypatch.setenv(MARKER_VAR, marker)
    srun = _hung_tool(tmp_path, "srun")
    monkeypatch.setattr(slurm_gather, "srun_path", lambda: str(srun))
    _signal_soon(signal.SIGTERM)
    with pytest.raises(Interrupted):
        slurm_gather.run_on_nodes("node[1-2]", 2, ["true"], timeout_s=30)
    assert leftovers(marker) == []


def test_stopping_gputopo_while_imex_ctl_answers_stops_the_tool_too(tmp_path, monkeypatch, stop_signals):
    from gputopo.errors import Interrupted
    from gputopo.system import imex

    marker = new_marker()
    monkeypatch.setenv(MARKER_VAR, marker)
    ctl = _hung_tool(tmp_path, "nvidia-imex-ctl")
    _signal_soon(signal.SIGTERM)
    with pytest.raises(Interrupted):
        imex.run_ctl(str(ctl), ["-q"], time.monotonic() + 60)
    assert leftovers(marker) == []


def test_stop_held_in_another_thread_holds_nothing():
    """Signal handlers run in the main thread: a stop held by a worker thread's block would be raised in
    that worker, where nothing stops the program."""
    import threading

    from gputopo.errors import Interrupted, defer_stop, stop_held

    answers = []

    def worker() -> None:
        with stop_held():
            answers.append(defer_stop(Interrupted(signal.SIGTERM, "SIGTERM")))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert answers == [False]
