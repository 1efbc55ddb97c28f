"""`gputopo run` runs a Python script inside torch's control plane, unchanged (launch/control_plane.py
places launch/worker_main.py in the command), so `gputopo slow --live` and `gputopo hang --live` read
each rank's Flight Recorder from a job started the ordinary way."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gputopo.hang.live import WORKER_SOCKET
from gputopo.launch import worker_main
from gputopo.launch.control_plane import wrap, wrapper_path

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parent / "src")
W = "/w/worker_main.py"


# (the user's command, --torchrun, where the wrapper goes: the index it is inserted at)
PLACES = [
    (["python", "train.py", "--lr", "1"], False, 1),
    (["/usr/bin/python3.11", "-u", "-X", "dev", "t.py"], False, 4),
    (["python3", "-m", "pkg.train", "a"], True, 1),
    (["train.py", "x"], True, 0),
    (["torchrun", "--nproc-per-node", "4", "train.py", "a"], False, 3),
    (["python", "-m", "torch.distributed.run", "--standalone", "t.py"], False, 4),
    (["torchrun", "--no-python", "python", "-u", "t.py"], False, 4),
]


@pytest.mark.parametrize(("command", "torchrun", "at"), PLACES)
def test_the_wrapper_goes_where_the_interpreter_takes_the_script(command, torchrun, at):
    got = wrap(command, W, torchrun)
    assert got.armed and list(got.command) == [*command[:at], W, *command[at:]]


@pytest.mark.parametrize(
    ("command", "torchrun", "why"),
    [
        (["./run.sh"], False, "not a Python script"),
        (["train.py"], False, "not a Python script"),  # run by its shebang: its interpreter is unknown
        (["python", "-c", "print(1)"], False, "python -c"),
        (["torchrun", "-m", "pkg.train"], False, "torchrun -m"),
        (["python"], False, "no script"),
    ],
)
def test_other_commands_run_as_written_with_the_reason(command, torchrun, why):
    got = wrap(command, W, torchrun)
    assert not got.armed and list(got.command) == command and why in (got.why_not or "")


def test_the_wrapper_and_the_live_reader_name_the_same_socket():
    assert worker_main.SOCKET == WORKER_SOCKET
    assert Path(wrapper_path()) == Path(worker_main.__file__)


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "user" / "train.py"
    script.parent.mkdir(exist_ok=True)
    (script.parent / "helper_mod.py").write_text("VALUE = 42\n")
    script.write_text(body)
    return script


def test_the_script_runs_as_python_would_run_it(tmp_path):
    """__name__ is __main__, sys.argv its own, its folder first on sys.path, its exit code passed on."""
    script = _script(
        tmp_path,
        "import json, sys\nimport helper_mod\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'argv': sys.argv, 'value': helper_mod.VALUE}))\n"
        "    sys.exit(3)\n",
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_WORKER_SERVER_SOCKET"}
    env["PYTHONPATH"] = ""  # the rank's Python need not have gputopo
    run = subprocess.run(
        [sys.executable, wrapper_path(), str(script), "--lr", "1"], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert run.returncode == 3, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == {"argv": [str(script), "--lr", "1"], "value": 42}


def test_the_control_plane_serves_while_the_script_runs_and_its_own_worker_main_still_works(tmp_path):
    """With torch: the socket <tempdir>/gputopo-worker-<pid>.sock answers while the script runs; a script
    that wraps its own main in worker_main() (docs/hang.md) does not start a second server and fail; the
    socket is gone afterwards."""
    pytest.importorskip("torch")
    script = _script(
        tmp_path,
        "import json, os, sys, tempfile\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from gputopo.system.worker_server import ask\n"
        "from torch.distributed.elastic.control_plane import worker_main\n"
        "path = os.path.join(tempfile.gettempdir(), f'gputopo-worker-{os.getpid()}.sock')\n"
        "with worker_main():\n"
        "    print(json.dumps({'path': path, 'ping': ask(path, 'ping').decode()}))\n",
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_WORKER_SERVER_SOCKET"}
    run = subprocess.run(
        [sys.executable, wrapper_path(), str(script), SRC], capture_output=True, text=True, env=env,
        timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(run.stdout.splitlines()[-1])
    assert doc["ping"] and not Path(doc["path"]).exists()


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "CUDA_VISIBLE_DEVICES"
        and not k.startswith(("NCCL_", "TORCH_FR_", "TORCH_NCCL_", "TORCH_WORKER"))
    }
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


@pytest.mark.slow
@pytest.mark.parametrize("armed", [True, False])
def test_slow_live_names_the_late_rank_of_an_unchanged_script_under_run(tmp_path, armed):
    """A 4-rank gloo job as a user writes it (no worker_main, no dump call) under `gputopo run --torchrun`,
    rank 2 25% slower: `gputopo slow --live RUN_DIR` names it while the job runs. With
    --no-control-plane: exit 2, one line that says what to do."""
    pytest.importorskip("torch")
    from gputopo.system.pyspy import find_pyspy

    if find_pyspy() is None:
        pytest.skip("py-spy is not installed (--live takes the ranks' stacks with it)")
    run_dir = tmp_path / "run"
    env = _clean_env({"PLAIN_TRAIN_RANK": "2", "PLAIN_TRAIN_EXTRA_MS": "5", "PLAIN_TRAIN_STEPS": "3000"})
    job = subprocess.Popen(
        [sys.executable, "-m", "gputopo", "run", "--n", "4", "--torchrun", "--input", "sample:seed-8gpu-nv4",
         "--run-dir", str(run_dir), *([] if armed else ["--no-control-plane"]), "--",
         str(HERE / "helpers" / "plain_train.py")],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        pids: list[int] = []
        while time.monotonic() < deadline and job.poll() is None:
            records = list(run_dir.glob("run-record-*.json"))
            if records:
                ranks = json.loads(records[0].read_text()).get("ranks") or []
                pids = [r["pid"] for r in ranks if r.get("pid")]
            sockets = [Path(tempfile.gettempdir()) / WORKER_SOCKET.format(pid=p) for p in pids]
            if len(pids) == 4 and (not armed or all(s.is_socket() for s in sockets)):
                break
            time.sleep(0.5)
        assert job.poll() is None and len(pids) == 4, "the job did not start its 4 ranks in time"
        time.sleep(6)  # some hundred all-reduces recorded
        live = subprocess.run(
            [sys.executable, "-m", "gputopo", "slow", "--live", str(run_dir), "--json"],
            capture_output=True, text=True, env=_clean_env({}), cwd=tmp_path, timeout=180,
        )  # fmt: skip
        if not armed:
            assert live.returncode == 2, live.stdout[-2000:] + live.stderr[-2000:]
            assert "no rank served its Flight Recorder" in live.stderr and "worker_main()" in live.stderr
            return
        assert live.returncode == 1, live.stdout[-2000:] + live.stderr[-2000:]
        doc = json.loads(live.stdout)
        assert doc["source"] == "flight-recorder"
        assert [(s["rank"], s["host"]) for s in doc["stragglers"]] == [(2, socket.gethostname())]
    finally:
        if job.poll() is None:
            job.terminate()
        try:
            job.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            job.communicate()


@pytest.mark.slow
def test_hang_live_reads_the_flight_recorder_of_an_unchanged_script_under_run(tmp_path):
    """tests/helpers/hang_job.py without its own worker_main (HANG_JOB_CONTROL_PLANE unset), rank 2
    stuck outside the collective, under `gputopo run --torchrun`: `gputopo hang --live` takes every rank's
    Flight Recorder into RUN_DIR/live/ and names rank 2."""
    pytest.importorskip("torch.distributed.elastic.control_plane")
    from gputopo.system.pyspy import find_pyspy

    if find_pyspy() is None:
        pytest.skip("py-spy is not installed")
    from test_hang_live import JOB, _env, _gputopo, _record

    run = tmp_path / "run"
    env = _env(HANG_JOB_DUMP_AFTER_S="never", HANG_JOB_TIMEOUT_S="300", HANG_JOB_STUCK_RANK="2")
    env.pop("HANG_JOB_CONTROL_PLANE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputopo", "run", "--n", "4", "--torchrun", "--input", "sample:seed-8gpu-nv4",
         "--run-dir", str(run), "--", str(JOB)],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        doc: dict = {}
        while time.monotonic() < deadline:
            if len(_record(run).get("ranks") or []) == 4:
                live = _gputopo("hang", "--live", str(run), "--json", cwd=tmp_path)
                doc = json.loads(live.stdout) if live.stdout.strip() else {}
                if doc.get("suspects") and len(list((run / "live").glob("*"))) == 4:
                    break
            assert proc.poll() is None, proc.communicate()
            time.sleep(2)
        assert [s["rank"] for s in doc.get("suspects", [])] == [2], doc
        assert len(list((run / "live").glob("*"))) == 4  # every rank's Flight Recorder, taken live
    finally:
        if proc.poll() is None:
            import signal as sig

            os.killpg(proc.pid, sig.SIGKILL)
            proc.wait()
