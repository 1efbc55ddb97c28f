"""`gputopo run` arms PyTorch's Flight Recorder and writes the run record; `gputopo hang` reads it.

Real children: torchrun (the installed torch's) started by `gputopo run` on the seed sample, printing
the environment each rank got; and a real gloo job where one rank never enters the all-reduce, whose
dumps `gputopo hang` reads beside the record to name the rank, its host and its GPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gputopo.launch.record import recorder_env, torchrun_layout
from gputopo.system.run_facts import version_from_code

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parent / "src")
# Each rank writes what it got to env-<LOCAL_RANK>.json beside the script (not stdout, which torchrun's
# children share).
PRINT_ENV = (
    "import json, os, pathlib; "
    "keep = ('TORCH_FR_', 'TORCH_NCCL_DUMP', 'TORCH_NCCL_DEBUG_INFO', 'TORCH_NCCL_TRACE', 'NCCL_RUN'); "
    "env = {k: v for k, v in os.environ.items() if k.startswith(keep)}; "
    "out = pathlib.Path(__file__).with_name('env-' + os.environ['LOCAL_RANK'] + '.json'); "
    "out.write_text(json.dumps(env))"
)


def _gputopo(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 180):
    clean = {
        k: v
        for k, v in os.environ.items()
        if k != "CUDA_VISIBLE_DEVICES" and not k.startswith(("NCCL_", "TORCH_FR_", "TORCH_NCCL_"))
    }
    full = {**clean, **(env or {})}
    full["PYTHONPATH"] = SRC + os.pathsep + full.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "gputopo", *args],
        capture_output=True,
        text=True,
        env=full,
        cwd=cwd,
        timeout=timeout,
    )


def _run_print_env(tmp_path: Path, *options: str, env: dict[str, str] | None = None):
    script = tmp_path / "print_env.py"
    script.write_text(PRINT_ENV + "\n")
    return _gputopo(
        "run", "--n", "2", "--torchrun", "--exclude", "0", "--input", "sample:seed-8gpu-nv4", *options,
        "--", str(script), env=env, cwd=tmp_path,
    )  # fmt: skip


def _rank_env(folder: Path) -> dict[int, dict[str, str]]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in folder.glob("env-*.json")}


def _record(folder: Path) -> dict:
    (path,) = folder.glob("run-record-*.json")
    return json.loads(path.read_text())


def test_run_arms_the_flight_recorder_and_writes_the_run_record(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    done = _run_print_env(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (folder,) = (tmp_path / "reports").glob("run-*")
    prefix = str(folder.resolve() / "fr-dump-")
    envs = _rank_env(tmp_path)
    assert sorted(envs) == [0, 1], (done.stdout, done.stderr)
    for env in envs.values():
        assert env == {
            "TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": prefix,
        }
    rec = _record(folder)
    assert rec["schema"] == "gputopo/run-record/v1"
    assert rec["host"] == socket.gethostname()
    assert (rec["node_rank"], rec["nnodes"], rec["ranks_per_node"], rec["world_size"]) == (0, 1, 2, 2)
    # --exclude 0 on the seed sample: the best pair is GPUs 2,3 (as test_launch shows); local rank i gets
    # the i-th visible device.
    assert [(g["local_rank"], g["index"]) for g in rec["gpus"]] == [(0, 2), (1, 3)]
    assert all(g["pci_bus_id"] for g in rec["gpus"])
    assert rec["cuda_visible_devices"] == ["2", "3"]  # the sample has no UUIDs; live runs record UUIDs
    import importlib.metadata

    assert rec["versions"]["torch"] == importlib.metadata.version("torch")
    assert rec["env"]["TORCH_FR_DUMP_TEMP_FILE"] == prefix
    fr = rec["flight_recorder"]
    assert (fr["buffer_size"], fr["dump_prefix"], fr["dump_on_timeout"], fr["set_by"]) == (
        2000,
        prefix,
        True,
        "gputopo",
    )
    assert f"gputopo hang {folder.relative_to(tmp_path)}" in done.stderr


def test_values_the_user_set_are_kept_and_said(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    old_prefix = str(tmp_path / "mine" / "trace_")
    done = _run_print_env(
        tmp_path,
        "--run-dir",
        str(tmp_path / "run"),
        env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": old_prefix},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    envs = _rank_env(tmp_path)
    assert sorted(envs) == [0, 1]
    for env in envs.values():
        # torch reads the new name first: setting it would have overridden the user's older one.
        assert "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_FR_DUMP_TEMP_FILE" not in env
        assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == old_prefix
        assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    kept = [ln for ln in done.stderr.splitlines() if "kept your" in ln]
    assert len(kept) == 1
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE=50" in kept[0]
    assert f"TORCH_NCCL_DEBUG_INFO_TEMP_FILE={old_prefix}" in kept[0]
    fr = _record(tmp_path / "run")["flight_recorder"]
    assert (fr["buffer_size"], fr["dump_prefix"], fr["set_by"]) == (50, old_prefix, "user")


def test_no_flight_recorder_sets_nothing_but_still_records(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    done = _run_print_env(tmp_path, "--no-flight-recorder", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert _rank_env(tmp_path) == {0: {}, 1: {}}
    rec = _record(tmp_path / "run")
    assert rec["flight_recorder"] is None and rec["ranks_per_node"] == 2


def test_nccl_diagnostics_sets_the_variable_and_says_when_nccl_is_too_old(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    done = _run_print_env(tmp_path, "--nccl-diagnostics", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-2000:]
    envs = _rank_env(tmp_path)
    assert sorted(envs) == [0, 1] and all(env["NCCL_RUN_DIAGNOSTICS"] == "1" for env in envs.values())
    nccl = _record(tmp_path / "run")["versions"]["nccl"]
    if nccl and tuple(int(x) for x in nccl.split(".")[:2]) < (2, 31):
        assert f"NCCL {nccl} has no NCCL_RUN_DIAGNOSTICS" in done.stderr


def test_a_hung_gloo_job_launched_by_run_is_named_by_hang_from_the_record(tmp_path: Path) -> None:
    """3 ranks under `gputopo run --torchrun` on GPUs 1,2,3 of the seed sample; rank 2 never enters the
    all-reduce; every rank's dump lands where run armed it; hang names rank 2 on this host, GPU 3."""
    pytest.importorskip("torch")
    run_dir = tmp_path / "run"
    done = _gputopo(
        "run", "--n", "3", "--torchrun", "--exclude", "0", "--input", "sample:seed-8gpu-nv4",
        "--run-dir", str(run_dir), "--", str(HERE / "helpers" / "hang_job.py"), cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in run_dir.glob("fr-dump-*")) == ["fr-dump-0", "fr-dump-1", "fr-dump-2"]
    gpus = [g["index"] for g in _record(run_dir)["gpus"]]
    hang = _gputopo("hang", str(run_dir), "--json", cwd=tmp_path)
    assert hang.returncode == 1, hang.stderr[-2000:]
    doc = json.loads(hang.stdout)
    assert doc["verdict"] == "hang"
    (group,) = doc["groups"]
    (suspect,) = group["suspects"]
    assert (suspect["rank"], suspect["why"]) == (2, "never_entered")
    assert suspect["host"] == socket.gethostname() and suspect["local_rank"] == 2
    assert suspect["gpu"]["index"] == gpus[2] == 3
    assert "stall_in_data_loader" in json.dumps(suspect["stack"]) or "hang_job.py" in json.dumps(
        suspect["stack"]
    )


# --- the pure parts --------------------------------------------------------------------------------------


def test_torchrun_layout_reads_both_spellings_and_stops_at_the_script() -> None:
    layout = torchrun_layout(
        ["torchrun", "--nproc_per_node=4", "--nnodes", "2", "--node-rank", "1", "--standalone", "train.py",
         "--nnodes", "9"]
    )  # fmt: skip
    assert (layout.nproc_per_node, layout.nnodes, layout.node_rank) == (4, 2, 1)
    py = torchrun_layout([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "t.py"])
    assert (py.nproc_per_node, py.nnodes) == (8, None)
    assert torchrun_layout(["torchrun", "--nnodes", "1:4", "t.py"]).nnodes is None


def test_recorder_env_fills_only_what_is_missing() -> None:
    got = recorder_env({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, "/r/fr-dump-", diagnostics=True)
    assert got.env == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": "/r/fr-dump-",
        "NCCL_RUN_DIAGNOSTICS": "1",
    }
    assert got.kept == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"} and got.dump_on_timeout is False


def test_nccl_version_codes_old_and_new() -> None:
    assert version_from_code(23007) == "2.30.7"
    assert version_from_code(2804) == "2.8.4"


def test_a_ranks_recorded_start_time_reaches_hangs_placement(tmp_path: Path) -> None:
    """The start time `gputopo run` records beside each PID is what `hang --live` compares with the PID's
    now (a reused PID is never read): it must survive the record's reading."""
    from gputopo.hang.live import targets_here
    from gputopo.hang.record import find_records, place_ranks, read_record

    record = {
        "schema": "gputopo/run-record/v1",
        "host": "node-a",
        "world_size": 2,
        "gpus": [{"local_rank": i, "index": i, "uuid": f"GPU-{i}"} for i in range(2)],
        "ranks": [
            {"rank": 0, "local_rank": 0, "pid": 4242, "started": 1764300000.25},
            {"rank": 1, "local_rank": 1, "pid": 4243},
        ],
    }
    (tmp_path / "run-record.json").write_text(json.dumps(record))
    placed, _ = place_ranks([read_record(p) for p in find_records([tmp_path])])
    assert (placed[0].started, placed[1].started) == (1764300000.25, None)
    assert [(t.rank, t.pid, t.started) for t in targets_here(tmp_path, "node-a")] == [
        (0, 4242, 1764300000.25),
        (1, 4243, None),
    ]


# --- every rank stays in the record; NCCL's Inspector armed; gputopo slow on a real job --------------------


def test_a_rank_that_exits_first_stays_in_the_record() -> None:
    from gputopo.launch.record import with_ranks

    record = {"host": "h", "gpus": [{"local_rank": i, "index": i} for i in range(4)], "ranks": []}
    everyone = [{"rank": r, "local_rank": r, "pid": 100 + r, "started": 1.0} for r in range(4)]
    record = with_ranks(record, everyone)
    record = with_ranks(record, everyone[2:])  # ranks 0 and 1 ended first
    rows = {r["rank"]: r for r in record["ranks"]}
    assert sorted(rows) == [0, 1, 2, 3]
    assert [rows[r]["exited"] for r in range(4)] == [True, True, False, False]
    assert rows[0]["pid"] == 100 and rows[0]["gpu"] == 0


def test_inspector_env_arms_the_plugin_and_keeps_what_the_user_set() -> None:
    from gputopo.launch.record import inspector_env

    env, kept = inspector_env(
        {"NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS": "500"}, "/x/lib.so", "/r/inspector"
    )
    assert env["NCCL_PROFILER_PLUGIN"] == "/x/lib.so" and env["NCCL_INSPECTOR_ENABLE"] == "1"
    assert env["NCCL_INSPECTOR_DUMP_DIR"] == "/r/inspector"
    assert kept == {"NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS": "500"}
    assert inspector_env({}, None, "/r/inspector") == ({}, {})


def test_run_inspector_without_the_plugin_says_how_and_runs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    done = _run_print_env(
        tmp_path, "--inspector", "--run-dir", str(tmp_path / "run"), env={"LD_LIBRARY_PATH": ""}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Inspector plugin (libnccl-profiler-inspector.so) was not found" in done.stderr
    assert _record(tmp_path / "run")["inspector"]["armed"] is False
    assert sorted(_rank_env(tmp_path)) == [0, 1]


def test_run_inspector_with_a_named_plugin_arms_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    plugin = tmp_path / "libnccl-profiler-inspector.so"
    plugin.write_bytes(b"")  # never loaded: the ranks are CPU ranks, NCCL does not start
    script = tmp_path / "print_env.py"
    script.write_text(PRINT_ENV.replace("'NCCL_RUN'", "'NCCL_RUN', 'NCCL_INSPECTOR', 'NCCL_PROFILER'") + "\n")
    run = tmp_path / "run"
    done = _gputopo(
        "run", "--n", "2", "--torchrun", "--exclude", "0", "--input", "sample:seed-8gpu-nv4",
        "--inspector-plugin", str(plugin), "--run-dir", str(run), "--", str(script), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    envs = _rank_env(tmp_path)
    for env in envs.values():
        assert env["NCCL_PROFILER_PLUGIN"] == str(plugin) and env["NCCL_INSPECTOR_ENABLE"] == "1"
        assert env["NCCL_INSPECTOR_DUMP_DIR"] == str((run / "inspector").resolve())
    assert _record(run)["inspector"]["armed"] is True and (run / "inspector").is_dir()
    bad = _gputopo(
        "run", "--n", "1", "--inspector-plugin", str(tmp_path / "nope.so"), "--", "true", cwd=tmp_path
    )
    assert bad.returncode == 2 and "no such file" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("slow_rank", [5, None])
def test_slow_names_the_late_rank_of_a_real_job_under_run(tmp_path: Path, slow_rank: int | None) -> None:
    """8 gloo CPU ranks under `gputopo run`, 40 steps of 20 ms and one all-reduce; rank 5 sleeps 30 ms
    more each step. `gputopo slow RUN_DIR` names it from the Flight Recorder's creation times, on this
    host, with its GPU from the run record; without the sleep there is no straggler."""
    pytest.importorskip("torch")
    run_dir = tmp_path / "run"
    env = {"SLOW_JOB_EXTRA_MS": "30"}
    if slow_rank is not None:
        env["SLOW_JOB_RANK"] = str(slow_rank)
    done = _gputopo(
        "run", "--n", "8", "--torchrun", "--input", "sample:seed-8gpu-nv4", "--run-dir", str(run_dir),
        "--", str(HERE / "helpers" / "slow_job.py"), env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(run_dir.glob("fr-dump-*"))) == 8
    assert len(_record(run_dir)["ranks"]) == 8  # every rank, also those that ended first
    slow = _gputopo("slow", str(run_dir), "--json", cwd=tmp_path)
    doc = json.loads(slow.stdout)
    if slow_rank is None:
        assert slow.returncode == 0, slow.stdout[-2000:]
        assert doc["stragglers"] == []
        return
    assert slow.returncode == 1, slow.stdout[-2000:]
    (s,) = doc["stragglers"]
    gpus = {g["local_rank"]: g["index"] for g in _record(run_dir)["gpus"]}
    assert (s["rank"], s["host"], s["gpu"]) == (slow_rank, socket.gethostname(), gpus[slow_rank])
    assert s["lateness_ms"] > 10
