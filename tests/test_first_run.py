"""The first run talks (issue 23 item 8): doctor's first line comes before anything slow, the plain
progress lines carry real times and one "(set done)" per set, and a loaded machine's slow ranks are not
called hung (the pool's deadline runs from the last progress, and a stop while ranks still moved is
"slow under load")."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

from rich.console import Console

from conftest import plain_env
from gputopo.probe.judge import verdict
from gputopo.probe.plan.config import DeviceInventory, build_config
from gputopo.probe.plan.schedule import Job
from gputopo.probe.pool import pool as pool_module
from gputopo.probe.pool.pool import LOAD_CAP, Pool
from gputopo.ui.probe_view import ProbeProgress


def test_doctor_says_its_first_line_before_reading_the_machine(tmp_path):
    # The first stderr line is the start line, said once the machine is read, before health reads and the
    # ranks (a bad option or input is still one error line and a hint: tests/test_bad_input.py).
    env = {**os.environ, **plain_env()}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gputopo",
            "doctor",
            "--simulate",
            "--skip-probe",
            "--report-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    first = done.stderr.splitlines()[0]
    assert first == (
        "gputopo doctor: sample:quad-nv4-pairs-2socket, 4 GPU(s), simulated on CPU ranks: "
        "health, links and processes"
    )


def test_plain_progress_has_real_times_and_one_set_done_per_set():
    # As the pool runs a set: dp and ddp in one step, allreduce in a later one, speed last.
    first = Job((0, 1), ("dp", "ddp"))
    second = Job((0, 1), ("allreduce",))
    other = Job((2, 3), ("dp", "ddp"))

    class _Plan:
        jobs = (first, other, second)

    buf = io.StringIO()
    t0 = 1_700_000_000.0
    with ProbeProgress(Console(file=buf, force_terminal=False, width=200), _Plan()) as bars:  # type: ignore[arg-type]
        for job, row in (
            (first, {"rank": 0, "check": "dp", "stage": "step", "done": 1, "total": 3, "t": t0}),
            (other, {"rank": 0, "check": "dp", "stage": "step", "done": 1, "total": 3, "t": t0 + 0.1}),
            (first, {"rank": 0, "check": "dp", "stage": "done", "t": t0 + 2.5}),
            (first, {"rank": 0, "check": "ddp", "stage": "done", "t": t0 + 4.0}),
            (other, {"rank": 0, "check": "ddp", "stage": "done", "t": t0 + 3.1}),
            (second, {"rank": 0, "check": "allreduce", "stage": "size", "done": 1, "total": 2, "t": t0 + 5}),
            (second, {"rank": 0, "check": "allreduce", "stage": "done", "t": t0 + 5.75}),
        ):
            bars.update(job, row)
    assert buf.getvalue().splitlines() == [
        "set 0,1: started",
        "set 2,3: started",
        "set 0,1: dp done [2.5 s]",
        "set 0,1: ddp done [1.5 s]",
        "set 2,3: ddp done (set done) [3.0 s]",
        "set 0,1: allreduce done (set done) [0.8 s]",
    ]


def test_a_stop_while_ranks_still_reported_is_slow_under_load_not_hung():
    now = 1000.0
    moving = {0: {"check": "ddp", "stage": "step", "done": 3, "total": 5, "t": now - 2.0}}
    result = verdict.hung("ddp", 30.0, moving, now)
    assert result.kind == "slow" and "slow under load" in result.detail
    stuck = {0: {"check": "ddp", "stage": "step", "done": 3, "total": 5, "t": now - 31.0}}
    result = verdict.hung("ddp", 30.0, stuck, now)
    assert result.kind == "hung" and "no progress within --timeout 30 s" in result.detail


def _pool(timeout_s: float) -> Pool:
    config = build_config(DeviceInventory("cpu", (0, 1)), ["0,1"], timeout_s=timeout_s)
    job = Job((0, 1), ("ddp",))
    pool = Pool(config, [((job, ("ddp",)),)])
    shutil.rmtree(pool.dir, ignore_errors=True)  # nothing is started: only the clock is tested
    pool.joined = {0, 1}
    pool.step_seen = {0: 0, 1: 0}
    return pool


def test_the_pool_deadline_runs_from_the_last_progress_not_the_step_start(monkeypatch):
    pool = _pool(timeout_s=30.0)
    clock = [100.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: clock[0])
    pool.step_clock = {0: 100.0}
    (job,) = pool.jobs
    # Slow but moving: a row every 20 s for five minutes is not overdue (the old rule stopped it at 30 s).
    for k in range(1, 16):
        clock[0] = 100.0 + 20.0 * k
        job.last_row = clock[0]
        assert not pool._overdue()
    clock[0] = job.last_row + 30.5  # then silence past --timeout: hung
    assert pool._overdue()


def test_a_step_that_keeps_moving_is_still_stopped_at_the_load_cap(monkeypatch):
    pool = _pool(timeout_s=10.0)
    now = [0.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    pool.step_clock = {0: 0.0}
    (job,) = pool.jobs
    now[0] = LOAD_CAP * 10.0 - 1
    job.last_row = now[0]
    assert not pool._overdue()
    now[0] = LOAD_CAP * 10.0 + 1
    job.last_row = now[0]
    assert pool._overdue()


def test_only_the_silent_set_of_a_step_is_hung_the_moving_one_runs_again(monkeypatch):
    config = build_config(DeviceInventory("cpu", (0, 1, 2, 3)), ["0,1", "2,3"], timeout_s=30.0)
    quiet, busy = Job((0, 1), ("ddp",)), Job((2, 3), ("ddp",))
    pool = Pool(config, [((quiet, ("ddp",)), (busy, ("ddp",)))])
    shutil.rmtree(pool.dir, ignore_errors=True)
    pool.joined = {0, 1, 2, 3}
    pool.step_seen = dict.fromkeys(range(4), 0)
    pool.step_clock = {0: 0.0}
    now = [0.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    stalled_job, moving_job = pool.jobs
    stalled_job.last_row = 5.0
    moving_job.last_row = 34.0
    now[0] = 36.0
    assert pool._overdue() and pool.stalled == {stalled_job.id}
