"""The launch seam: what ranks are told, where faults go, and stopping real processes that resist."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from gputopo.probe import shared
from gputopo.probe.plan import spec as plan_spec
from gputopo.probe.plan.config import DeviceInventory, Fault, build_config
from gputopo.probe.plan.schedule import Job
from gputopo.probe.pool import launch
from gputopo.probe.pool import pool as rank_pool

CPU = DeviceInventory("cpu", tuple(range(8)))
GPU_BOX = DeviceInventory("cuda", tuple(range(8)), ("0", "1", "2", "3", "4", "5", "6", "7"))


def test_nan_and_corrupt_reach_every_check_with_a_detector():
    assert plan_spec.inject_checks("nan", ("p2p", "dp", "ddp", "allreduce")) == ("dp", "ddp")
    assert plan_spec.inject_checks("corrupt", ("dp", "ddp", "allreduce")) == ("dp", "ddp", "allreduce")
    assert plan_spec.inject_checks(None, ("dp",)) == ()


def test_hang_and_crash_go_into_the_first_distributed_check_only():
    assert plan_spec.inject_checks("hang", ("p2p", "dp", "ddp", "allreduce")) == ("dp",)
    assert plan_spec.inject_checks("crash", ("ddp", "allreduce")) == ("ddp",)
    assert plan_spec.inject_checks("crash", ("p2p",)) == ()


def test_spec_carries_options_and_the_fault():
    config = build_config(CPU, ["0,1"], model="tiny", steps=4, inject=Fault.CRASH, inject_rank=0)
    job = Job((0, 1), ("dp", "ddp"))
    spec = plan_spec.job_spec(config, job, ("ddp",), launch.Path("/tmp/x"))
    assert spec["checks"] == ["ddp"] and spec["gpus"] == [0, 1]
    assert (spec["inject"], spec["inject_rank"], spec["inject_checks"]) == ("crash", 0, ["ddp"])
    assert spec["model"] == "tiny" and spec["steps"] == 4 and spec["device"] == "cpu"


def test_inject_gpus_reach_every_set_holding_them_in_the_named_gpus_rank():
    config = build_config(GPU_BOX, ["4,5,6,7", "6,7", "5,6"], inject=Fault.CORRUPT, inject_gpus="5,6")
    all_checks = ("p2p", "dp", "ddp", "allreduce")
    big = plan_spec.job_spec(config, Job((4, 5, 6, 7), ("p2p",)), ("p2p",), launch.Path("/x"), all_checks)
    assert (big["inject"], big["inject_rank"], big["inject_ranks"]) == ("corrupt", 2, [1, 2])
    assert big["inject_checks"] == ["p2p"]
    spared = plan_spec.job_spec(config, Job((6, 7), all_checks), all_checks, launch.Path("/x"))
    assert spared["inject"] is None and spared["inject_checks"] == []


def test_a_hang_goes_into_the_sets_first_distributed_check_even_across_jobs():
    config = build_config(CPU, ["0,1"], inject=Fault.HANG)
    set_checks = ("dp", "ddp", "allreduce")
    later = plan_spec.job_spec(
        config, Job((0, 1), ("allreduce",)), ("allreduce",), launch.Path("/x"), set_checks
    )
    assert later["inject_checks"] == []
    first = plan_spec.job_spec(
        config, Job((0, 1), ("dp", "ddp")), ("dp", "ddp"), launch.Path("/x"), set_checks
    )
    assert first["inject_checks"] == ["dp"]


def test_cpu_ranks_get_one_thread_and_no_gpu():
    config = build_config(CPU, ["0,1"])
    env = plan_spec.rank_environment(config, Job((0, 1), ("ddp",)), "m1")
    assert env["OMP_NUM_THREADS"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env[plan_spec.MARKER_ENV] == "m1"


def test_cpu_ranks_keep_freed_memory_for_the_next_step_unless_the_user_set_it(monkeypatch):
    """glibc would unmap every freed batch and fault it in again, zeroed, at the next step."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4096")
    env = plan_spec.rank_environment(build_config(CPU, ["0,1"]), Job((0, 1), ("ddp",)), "m1")
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)  # glibc's largest on 64-bit
    assert env["MALLOC_TRIM_THRESHOLD_"] == "4096"  # the user's own
    gpu = plan_spec.rank_environment(build_config(GPU_BOX, ["5,6"]), Job((5, 6), ("ddp",)), "m2")
    assert "MALLOC_MMAP_THRESHOLD_" not in gpu


def test_gpu_ranks_see_their_set_in_nvidia_smi_order(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    config = build_config(GPU_BOX, ["5,6"])
    env = plan_spec.rank_environment(config, Job((5, 6), ("ddp",)), "m2")
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and env["CUDA_VISIBLE_DEVICES"] == "5,6"


def test_every_pool_rank_sees_every_gpu_of_the_pool():
    """Pool rank r drives the r-th GPU of the union; the rank running DataParallel reaches all of them."""
    config = build_config(GPU_BOX, ["5,6", "2,6"])
    pool = rank_pool.Pool(
        config, [((Job((5, 6), ("ddp",)), ("ddp",)),), ((Job((2, 6), ("ddp",)), ("ddp",)),)]
    )
    try:
        assert pool.gpus == (2, 5, 6)
        assert [j.ranks for j in pool.jobs] == [(1, 2), (0, 2)]
        env = plan_spec.rank_environment(config, Job(pool.gpus, ()), "m3")
        assert env["CUDA_VISIBLE_DEVICES"] == "2,5,6"
        spec = pool.spec()
        assert [[j["ranks"] for j in step] for step in spec["schedule"]] == [[[1, 2]], [[0, 2]]]
    finally:
        pool.cleanup()


def test_the_launch_record_splits_each_ranks_cpu_by_step_from_the_stamps_it_wrote():
    """Ranks stamp their CPU time as they join, are ready, enter each step and end; a pool stopped
    mid-step has no end stamp, and that step is left out rather than counted negative."""
    config = build_config(CPU, ["0,1,2"])
    steps = [((Job((0, 1), ("ddp",)), ("ddp",)),), ((Job((1, 2), ("ddp",)), ("ddp",)),)]
    pool = rank_pool.Pool(config, steps)
    try:
        marks = {("join", 0): 2.0, ("ready", 0): 2.5, ("step", 0): 2.6, ("step", 1): 4.6, ("end", 2): 5.0}
        pool.cpu_marks = {0: dict(marks), 1: {**marks, ("step", 1): 4.0, ("end", 2): 6.5}, 2: dict(marks)}
        assert pool.step_cpu_s(0, (0, 1)) == pytest.approx(2.0 + 1.4)
        assert pool.step_cpu_s(1, (1, 2)) == pytest.approx(2.5 + 0.4)
        cpu = pool.rank_cpu_s()
        assert cpu["start"] == [2.0, 2.0, 2.0] and cpu["join"] == [0.5, 0.5, 0.5]
        assert cpu["idle"] == [0.4, 0.0, 2.0]  # rank 0 waits out step 1, rank 2 step 0
        assert cpu["total"] == [5.0, 6.5, 5.0]
        del pool.cpu_marks[2][("end", 2)]  # stopped in step 1
        assert pool.step_cpu_s(1, (1, 2)) is None
        assert pool.rank_cpu_s()["idle"][2] == 2.0 and pool.rank_cpu_s()["total"][2] is None
    finally:
        pool.cleanup()


STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def _child(code, marker=None):
    env = None
    if marker:
        import os

        env = dict(os.environ, **{plan_spec.MARKER_ENV: marker})
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_terminate_all_stops_a_polite_process_at_once():
    polite = _child("import time; print('ready', flush=True); time.sleep(60)")
    started = time.monotonic()
    assert launch.terminate_all([psutil.Process(polite.pid)]) == 1
    assert time.monotonic() - started < launch.STOP_GRACE_S
    assert not psutil.pid_exists(polite.pid)


def test_terminate_all_kills_what_ignores_sigterm_after_the_grace():
    stubborn = _child(STUBBORN)
    started = time.monotonic()
    assert launch.terminate_all([psutil.Process(stubborn.pid)]) == 1
    assert launch.STOP_GRACE_S - 0.2 <= time.monotonic() - started < launch.STOP_GRACE_S + 3
    assert not psutil.pid_exists(stubborn.pid)


def test_terminate_all_leaves_a_process_whose_pid_was_reused_alone():
    proc = _child("import time; print('ready', flush=True); time.sleep(60)")
    handle = psutil.Process(proc.pid)
    # Pretend the pid was recycled: psutil compares the creation time before signalling.
    handle._create_time = handle.create_time() - 1000  # noqa: SLF001
    handle._ident = (handle.pid, handle._create_time)  # noqa: SLF001
    try:
        assert launch.terminate_all([handle]) == 0
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_marked_processes_finds_only_this_runs_processes():
    marker = uuid.uuid4().hex
    mine = _child("import time; print('ready', flush=True); time.sleep(60)", marker=marker)
    other = _child("import time; print('ready', flush=True); time.sleep(60)", marker=uuid.uuid4().hex)
    try:
        assert [p.pid for p in launch.marked_processes(marker)] == [mine.pid]
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


@pytest.mark.parametrize("lines", [0, 3])
def test_tail_reads_the_last_lines(tmp_path, lines):
    path = tmp_path / "stderr.log"
    path.write_text("".join(f"line {i}\n" for i in range(lines)))
    assert shared.tail(path, 2) == "\n".join(f"line {i}" for i in range(max(0, lines - 2), lines))
    assert shared.tail(tmp_path / "missing") == ""


def test_root_cause_is_the_rank_that_crashed_not_the_peer_that_lost_it():
    """Both ranks failed in the same second: the one whose peer vanished is the consequence."""
    from gputopo.probe.judge.failures import root_cause_order

    lost = {
        "rank": 0,
        "message": None,
        "timestamp": 100,
        "stderr_tail": "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:4567",
    }
    crashed = {"rank": 1, "message": None, "timestamp": 100, "stderr_tail": "injected crash in rank 1"}
    later = {"rank": 2, "message": "boom", "timestamp": 101, "stderr_tail": ""}
    assert sorted([lost, later, crashed], key=root_cause_order) == [crashed, later, lost]
    assert sorted([later, crashed], key=root_cause_order)[0] is crashed


def test_a_rank_the_agent_stopped_is_never_the_root_cause():
    """In a pool, a crash in one set makes the agent SIGTERM the ranks of every other set."""
    from gputopo.probe.judge.failures import root_cause_order

    stopped = {"rank": 0, "signal": "SIGTERM", "message": None, "timestamp": 100, "stderr_tail": ""}
    crashed = {"rank": 2, "signal": None, "message": None, "timestamp": 100, "stderr_tail": "injected"}
    assert sorted([stopped, crashed], key=root_cause_order)[0] is crashed


def _pool_with_rows(rows, steps):
    """A pool that never started, fed the progress rows its ranks would have written."""
    config = build_config(CPU, ["0,1,2,3"], each_pair=True, model="tiny")
    pool = rank_pool.Pool(config, steps)
    for row in rows:
        with (pool.dir / f"progress-rank{row['pool_rank']}.jsonl").open("a") as fh:
            fh.write(json.dumps({"t": 0.0, "done": 0, "total": 0, **row}) + "\n")
    pool._read_progress()  # noqa: SLF001
    pool.ended = time.monotonic()
    return pool


DDP = ("ddp",)
TWO_STEPS = [
    ((Job((0, 1), DDP), DDP), (Job((2, 3), DDP), DDP)),
    ((Job((0, 2), DDP), DDP), (Job((1, 3), DDP), DDP)),
]


def _entered_step_0(ranks=range(4)):
    rows = [{"pool_rank": r, "rank": r, "task": None, "check": "pool", "stage": "ready"} for r in ranks]
    rows += [
        {"pool_rank": r, "rank": r, "task": None, "check": "pool", "stage": "step", "done": 0} for r in ranks
    ]
    return rows


def test_a_step_past_the_timeout_judges_its_unfinished_job_hung_and_keeps_the_finished_one():
    rows = _entered_step_0()
    rows += [{"pool_rank": r, "rank": r, "task": "j0", "check": "task", "stage": "done"} for r in (0, 1)]
    rows += [{"pool_rank": 3, "rank": 1, "task": "j1", "check": "ddp", "stage": "injected-hang"}]
    pool = _pool_with_rows(rows, TWO_STEPS)
    try:
        pool.timed_out = True
        out = pool.outcome()
    finally:
        pool.cleanup()
    assert [(o.job.gpus, o.status) for o in out.judged] == [((0, 1), "ok"), ((2, 3), "timeout")]
    hung = out.judged[1]
    assert hung.last_progress[1]["stage"] == "injected-hang"  # rank within the set, not in the pool
    assert hung.last_progress[0]["check"] == "pool"  # silent in the job: where the pool last saw it
    assert out.record["ended_by"] == [{"gpus": [2, 3], "kind": "hung"}] and out.record["judged"] == 2


def test_a_crash_is_charged_to_the_job_of_the_rank_that_died():
    rows = _entered_step_0()
    pool = _pool_with_rows(rows, TWO_STEPS)
    died = {"rank": 2, "exitcode": 86, "signal": None, "pid": 1, "message": None, "stderr_tail": "boom"}
    stopped = {"rank": 0, "exitcode": -15, "signal": "SIGTERM", "pid": 2, "message": None, "stderr_tail": ""}
    (pool.dir / launch.LAUNCH_RESULT).write_text(
        json.dumps({"status": "failed", "failures": [died, stopped]})
    )
    try:
        out = pool.outcome()
    finally:
        pool.cleanup()
    (only,) = out.judged
    assert only.job.gpus == (2, 3) and only.status == "failed"
    assert only.failures[0].rank == 0 and only.failures[0].exitcode == 86  # pool rank 2 is rank 0 of 2,3
    assert out.record["ended_by"] == [{"gpus": [2, 3], "kind": "crashed"}]


def test_a_pool_that_never_started_charges_every_job_at_once():
    """An import error or a rendezvous hang blames no set, and a fresh pool would fail alike."""
    pool = _pool_with_rows([], TWO_STEPS)
    failure = {
        "rank": 0,
        "exitcode": 1,
        "signal": None,
        "pid": 1,
        "message": "ImportError: x",
        "stderr_tail": "",
    }
    (pool.dir / launch.LAUNCH_RESULT).write_text(json.dumps({"status": "failed", "failures": [failure]}))
    try:
        out = pool.outcome()
    finally:
        pool.cleanup()
    assert len(out.judged) == 4 and all(o.status == "failed" for o in out.judged)
    assert [e["kind"] for e in out.record["ended_by"]] == ["crashed"] * 4
