"""`gputopo hang --live` and the evidence a stopped `gputopo run` leaves, on a real hanging 4-rank gloo job
(tests/helpers/hang_job.py under `gputopo run --torchrun`): rank 2 sits in its own function
(stall_in_data_loader) while ranks 0, 1 and 3 wait in all_reduce. Stacks are taken with the real py-spy.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gputopo.hang.stacks import from_pyspy, judge
from gputopo.system import pyspy

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parent / "src")
JOB = HERE / "helpers" / "hang_job.py"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_FR_", "TORCH_NCCL_"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


def _gputopo(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gputopo", *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=cwd,
        timeout=timeout,
    )


def test_pyspy_reads_a_rank_in_its_own_function(tmp_path: Path) -> None:
    """The real py-spy on a real process: its stack leads to the function it sits in."""
    if pyspy.find_pyspy() is None:
        pytest.skip("py-spy is not installed")
    script = tmp_path / "job.py"
    script.write_text("import time\n\ndef load_next_batch():\n    time.sleep(60)\n\nload_next_batch()\n")
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        time.sleep(1.0)
        read = pyspy.dump(proc.pid)
        assert read.error is None, read.error
        stack = from_pyspy(read.threads, 2, "here", 2, proc.pid, 2)
        kind, what, frame = stack.where()
        assert (kind, what, str(frame)) == ("own_code", "load_next_batch", "load_next_batch (job.py:4)")
        assert proc.poll() is None  # py-spy did not stop it
    finally:
        proc.kill()
        proc.wait()


def test_a_refused_ptrace_is_one_line_with_how_to_allow_it(tmp_path: Path) -> None:
    """py-spy's own refusal (what it prints when ptrace is not allowed) becomes a sentence and a hint."""
    fake = tmp_path / "py-spy"
    fake.write_text(
        "#!/bin/sh\n"
        "echo 'Error: Failed to attach to process: Operation not permitted (os error 1)' >&2\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    read = pyspy.dump(os.getpid(), exe=str(fake))
    assert read.error and read.error.startswith("ptrace refused") and "ptrace_scope" in (read.hint or "")


def test_live_without_pyspy_is_exit_3_with_the_install_line(tmp_path: Path, monkeypatch) -> None:
    from conftest import invoke

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setattr(pyspy, "find_pyspy", lambda: None)
    result = invoke("hang", "--live", str(run))
    assert result.exit_code == 3
    assert "py-spy is not installed" in result.output and "pip install py-spy" in result.output


def test_stacks_alone_name_the_odd_rank_out() -> None:
    def threads(*frames: tuple[str, str]) -> list[dict]:
        return [
            {
                "thread_name": "MainThread",
                "os_thread_id": 1,
                "frames": [{"name": n, "filename": f, "line": 3} for n, f in frames],
            }
        ]

    wait = threads(
        ("all_reduce", "/venv/torch/distributed/distributed_c10d.py"),
        ("wrapper", "/venv/torch/distributed/c10d_logger.py"),
        ("train_step", "/job/train.py"),
    )
    odd = threads(("load_next_batch", "/job/data.py"), ("train", "/job/train.py"))
    stacks = [from_pyspy(wait if r != 2 else odd, r, "h", r, 100 + r, r) for r in range(4)]
    verdict = judge(stacks)
    assert verdict is not None
    assert [(s.rank, s.why, s.frame) for s in verdict.suspects] == [
        (2, "not_in_collective", "load_next_batch (data.py:3)")
    ]
    assert verdict.sentence == (
        "rank 2 is in load_next_batch (data.py:3), not in a collective; rank(s) 0, 1, 3 wait in all_reduce"
    )


def _record(run: Path) -> dict:
    paths = list(run.glob("run-record-*.json"))
    return json.loads(paths[0].read_text()) if paths else {}


@pytest.mark.slow
def test_live_names_rank_2_keeps_the_job_and_sigterm_leaves_the_evidence(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    if pyspy.find_pyspy() is None:
        pytest.skip("py-spy is not installed")
    run = tmp_path / "run"
    job_env = _env(HANG_JOB_DUMP_AFTER_S="never", HANG_JOB_TIMEOUT_S="300", HANG_JOB_STUCK_RANK="2")
    # --no-control-plane: this test is about the stacks alone (a job that serves no Flight Recorder);
    # with it, --live also reads the ranks' dumps and rank 2 is named as never having entered.
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputopo", "run", "--n", "4", "--torchrun", "--input", "sample:seed-8gpu-nv4",
         "--no-control-plane", "--run-dir", str(run), "--", str(JOB)],
        cwd=tmp_path, env=job_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        # `gputopo run` writes every rank's PID, local rank and GPU into the record as the ranks start
        deadline = time.monotonic() + 180
        while len(_record(run).get("ranks") or []) < 4:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks never showed up in the run record"
            time.sleep(0.5)
        record = _record(run)
        ranks = {r["rank"]: r for r in record["ranks"]}
        assert sorted(ranks) == [0, 1, 2, 3]
        assert all(r["host"] == socket.gethostname() and psutil.pid_exists(r["pid"]) for r in ranks.values())
        assert [ranks[i]["local_rank"] for i in range(4)] == [0, 1, 2, 3]
        assert [ranks[i]["gpu"] for i in range(4)] == [g["index"] for g in record["gpus"]]
        # --live, until the ranks have reached where they hang (torch's import takes a while on 2 cores)
        doc: dict = {}
        while time.monotonic() < deadline:
            live = _gputopo("hang", "--live", str(run), "--json", cwd=tmp_path)
            assert live.returncode in (0, 1, 3), live.stderr
            doc = json.loads(live.stdout)
            if doc["suspects"] and len([s for s in doc["stacks"] if s["in"] == "collective"]) == 3:
                break
            time.sleep(2)
        assert live.returncode == 1, live.stderr
        (suspect,) = doc["suspects"]
        assert suspect["rank"] == 2 and suspect["why"] == "not_in_collective"
        assert suspect["frame"].startswith("stall_in_data_loader (hang_job.py:")
        assert (suspect["pid"], suspect["local_rank"], suspect["gpu"]) == (
            ranks[2]["pid"],
            2,
            ranks[2]["gpu"],
        )
        assert suspect["host"] == socket.gethostname()
        assert "rank(s) 0, 1, 3 wait in all_reduce" in doc["reason"]
        # the job keeps running after --live
        time.sleep(1.0)
        assert proc.poll() is None and all(psutil.pid_exists(r["pid"]) for r in ranks.values())
        tree = psutil.Process(proc.pid).children(recursive=True)
        (run / f"stacks-{socket.gethostname()}.json").unlink()  # what follows must come from the stop
        # SIGTERM to gputopo alone (as `kill`, or a scheduler that signals the launcher)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
        assert "taking the ranks' stacks before stopping the job" in err
        left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert left == [], left
        stacks = json.loads((run / f"stacks-{socket.gethostname()}.json").read_text())
        assert stacks["why"] == "stopped by SIGTERM" and len(stacks["ranks"]) == 4
        after = _gputopo("hang", str(run), "--json", cwd=tmp_path)
        assert after.returncode == 1, after.stderr
        (suspect,) = json.loads(after.stdout)["suspects"]
        assert suspect["rank"] == 2 and suspect["frame"].startswith("stall_in_data_loader")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_live_reads_the_flight_recorder_through_torchs_control_plane(tmp_path: Path) -> None:
    """A job that runs inside worker_main() on the socket the docs name: --live takes each rank's Flight
    Recorder while it hangs (fr_trace_json), and the matching names rank 2 with the stacks."""
    pytest.importorskip("torch.distributed.elastic.control_plane")
    if pyspy.find_pyspy() is None:
        pytest.skip("py-spy is not installed")
    run = tmp_path / "run"
    job_env = _env(
        HANG_JOB_DUMP_AFTER_S="never",
        HANG_JOB_TIMEOUT_S="300",
        HANG_JOB_STUCK_RANK="2",
        HANG_JOB_CONTROL_PLANE="1",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputopo", "run", "--n", "3", "--torchrun", "--input", "sample:seed-8gpu-nv4",
         "--run-dir", str(run), "--", str(JOB)],
        cwd=tmp_path, env=job_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        doc: dict = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            if len(_record(run).get("ranks") or []) == 3:
                live = _gputopo("hang", "--live", str(run), "--json", cwd=tmp_path)
                doc = json.loads(live.stdout) if live.stdout else {}
                if doc.get("groups") and len([s for s in doc["stacks"] if s["in"] == "collective"]) == 2:
                    break
            time.sleep(2)
        assert doc.get("groups"), doc
        assert sorted(p.name for p in (run / "live").iterdir()) == [f"fr-live-{r}.json" for r in range(3)]
        assert doc["dumps"]["count"] == 3 and doc["dumps"]["formats"] == ["json"]
        (group,) = doc["groups"]
        assert group["never_entered"] == [2] and group["collective"]["op"] == "all_reduce"
        (suspect,) = [s for s in doc["suspects"] if s["rank"] == 2]
        assert suspect["frame"].startswith("stall_in_data_loader")  # the stack joins the dump's answer
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_stack_files_of_several_nodes_in_one_run_folder_are_read_together(tmp_path: Path) -> None:
    """Each node's `--live` writes its own stacks-<host>.json into the shared run folder; `gputopo hang
    RUN_DIR` reads them all (the newest stack of each rank), and the HTML report shows them."""
    from conftest import invoke
    from gputopo.hang.stacks import write_stacks

    def threads(name: str, filename: str) -> list[dict]:
        return [{"thread_name": "MainThread", "frames": [{"name": name, "filename": filename, "line": 7}]}]

    wait = threads("all_reduce", "/v/torch/distributed/distributed_c10d.py")
    for host, ranks in (("node-a", (0, 1)), ("node-b", (2, 3))):
        stacks = [
            from_pyspy(
                threads("read_shard", "/job/data.py") if r == 3 else wait, r, host, r % 2, 100 + r, r % 2
            )
            for r in ranks
        ]
        (tmp_path / f"stacks-{host}.json").write_text(
            write_stacks(stacks, host, "2026-11-28T04:00:00Z", "live")
        )
    result = invoke("hang", str(tmp_path), "--json", "--html", str(tmp_path / "hang.html"))
    doc = json.loads(result.stdout)
    assert result.exit_code == 1, result.output
    assert [s["rank"] for s in doc["stacks"]] == [0, 1, 2, 3]
    (suspect,) = doc["suspects"]
    assert (suspect["rank"], suspect["host"], suspect["pid"], suspect["frame"]) == (
        3,
        "node-b",
        103,
        "read_shard (data.py:7)",
    )
    assert "read_shard (data.py:7), not in a collective" in (tmp_path / "hang.html").read_text()


def test_live_never_reads_a_pid_the_kernel_gave_to_another_process(tmp_path: Path) -> None:
    """A process is (pid, start time): a rank whose recorded start time is not the PID's now (the PID
    was reused) is reported as such and never handed to py-spy; a live one with its own time is read."""
    from gputopo.hang.live import Target, take
    from gputopo.system import procfs

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=_env(GPUTOPO_X="on"))
    try:
        started = psutil.Process(proc.pid).create_time()
        assert procfs.not_the_same_process(proc.pid, started) is None
        # Popen returns once exec has closed its error pipe, which the kernel does before it lays out the
        # new program's environment (fs/exec.c begin_new_exec, then load_elf_binary's create_elf_tables):
        # /proc/PID/environ can read empty for that moment.
        deadline = time.monotonic() + 5.0
        while procfs.environ_value(proc.pid, "GPUTOPO_X") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "another process" in (procfs.not_the_same_process(proc.pid, started - 100.0) or "")
        assert procfs.environ_value(proc.pid, "GPUTOPO_X") == "on"
        assert procfs.environ_value(proc.pid, "GPUTOPO_NOT_SET") is None
        reused = Target(rank=1, pid=proc.pid, local_rank=1, gpu=1, started=started - 100.0)
        ev = take(tmp_path, [reused], "here", "live", timeout_s=5.0)
        (stack,) = ev.stacks
        assert stack.rank == 1 and "another process" in (stack.error or "")
        assert not stack.threads
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    assert procfs.not_the_same_process(proc.pid, started) == "the process is gone"
