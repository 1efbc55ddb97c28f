"""``gputopo slow``: the rank the others wait for, from NCCL Inspector logs (written as the plugin writes
them: tests/inspector_logs.py), Flight Recorder creation times and nccl-tests -J files."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from gputopo.cli import app
from gputopo.slow import judge as J
from gputopo.slow import readers as R
from gputopo.slow.service import analyse
from inspector_logs import job_lines, write_job

RANK_COUNTS = (8, 16, 32, 64, 128, 256)


def _judge_lines(lines: dict[tuple[str, int], list[str]]) -> J.Judgement:
    read = R.InspectorRead()
    for ls in lines.values():
        R._parse_inspector(("\n".join(ls) + "\n").encode(), read)
    return J.judge(R.inspector_ops(read, R.inspector_world_ranks(read)))


def test_the_planted_late_rank_is_named_in_generated_jobs():
    """200 jobs of 8-256 ranks, one rank 5-30% late, 1% noise: named in at least 95%; never a waiting
    rank (they have the long kernel times)."""
    rng = random.Random(7)
    named = 0
    jobs = 200
    for i in range(jobs):
        ranks = RANK_COUNTS[i % len(RANK_COUNTS)]
        late = rng.randrange(ranks)
        frac = rng.uniform(0.05, 0.30)
        j = _judge_lines(job_lines(ranks, 24, late_rank=late, late_frac=frac, seed=i))
        blamed = {s.rank for s in j.stragglers}
        assert blamed <= {late}, f"job {i}: blamed {blamed}, the late rank is {late}"
        named += late in blamed
    assert named >= 0.95 * jobs, f"named in {named} of {jobs}"


def test_equal_ranks_have_no_straggler():
    for i in range(50):
        ranks = RANK_COUNTS[i % len(RANK_COUNTS)]
        j = _judge_lines(job_lines(ranks, 24, seed=1000 + i))
        assert not j.stragglers, f"job {i} ({ranks} ranks): {j.stragglers}"
        assert j.undecided is None


def test_one_spike_is_not_a_straggler():
    """Recurrence, not one spike: a rank 50% late in one operation of 40 is not named."""
    ops = []
    for sn in range(40):
        late = [0.01 * ((r * 7 + sn) % 5) for r in range(8)]
        if sn == 3:
            late[2] = 2.5
        ops.append(J.Op("world", "AllReduce", sn, 1 << 20, tuple(range(8)), tuple(late), 5.0, 40.0))
    assert not J.judge(ops).stragglers


def test_a_rank_5_percent_late_on_short_operations_is_caught():
    """The floor is relative to the operation: on 200 us operations 10 us late is found."""
    lines = job_lines(32, 30, late_rank=3, late_frac=0.05, work_us=200.0, seed=3)
    assert [s.rank for s in _judge_lines(lines).stragglers] == [3]


def test_too_few_operations_is_undecided(tmp_path):
    write_job(tmp_path, job_lines(8, 5, late_rank=1, late_frac=0.3))
    report = analyse(tmp_path)
    assert report.judgement.undecided and report.exit_code == 0
    assert report.document()["verdict"] == "undecided"


def test_cli_names_the_rank_with_host_pid_and_gpu_from_the_run_record(tmp_path):
    """A run folder: the Inspector logs under inspector/, the run record maps (host, pid) to the global
    rank and GPU; the comm rank of a sub-communicator is not the global rank."""
    run = tmp_path / "run"
    lines = job_lines(8, 40, late_rank=6, late_frac=0.2, seed=5, hosts=2)
    write_job(run / "inspector", lines)
    for node in range(2):
        host = f"node{node:03d}"
        record = {
            "schema": "gputopo/run-record/v1",
            "host": host,
            "node_rank": node,
            "ranks_per_node": 4,
            "world_size": 8,
            "rank_base": node * 4,
            "gpus": [{"local_rank": lr, "index": lr + 2, "uuid": f"GPU-{node}{lr}"} for lr in range(4)],
            "ranks": [
                {"rank": node * 4 + lr, "local_rank": lr, "pid": 10_000 + node * 4 + lr} for lr in range(4)
            ],
            "versions": {},
            "env": {},
        }
        (run / f"run-record-{host}.json").write_text(json.dumps(record))
    result = CliRunner().invoke(app, ["slow", str(run), "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "gputopo/slow/v1"
    [s] = doc["stragglers"]
    assert (s["rank"], s["host"], s["gpu"]) == (6, "node001", 4)
    assert 0 < s["waiting_share"] < 1 and s["lateness_ms"] > 0.5
    text = CliRunner().invoke(app, ["slow", str(run)])
    assert text.exit_code == 1 and "rank 6 on node001, GPU 4" in text.stdout


def test_truncated_last_line_is_skipped_and_counted(tmp_path):
    lines = job_lines(8, 40, seed=9)
    write_job(tmp_path, lines)
    victim = next(tmp_path.glob("*.log"))
    victim.write_text(victim.read_text() + '{"header":{"id":"0x7f8c49')
    report = analyse(tmp_path)
    assert report.exit_code == 0
    assert any("1 truncated last line" in n for n in report.notes)


def test_html_chart(tmp_path):
    write_job(tmp_path / "d", job_lines(8, 40, late_rank=2, late_frac=0.2, seed=11))
    out = tmp_path / "slow.html"
    result = CliRunner().invoke(app, ["slow", str(tmp_path / "d"), "--html", str(out)])
    assert result.exit_code == 1
    page = out.read_text()
    assert "<svg" in page and "rank 2" in page and "#d9534f" in page


def _nccl_tests_doc(slow_process: int | None, procs: int = 8) -> dict:
    """An nccl-tests -J document in util.cu's shape (jsonRankInfo devices, per-size results)."""
    rng = random.Random(4)
    results = []
    for size in (1 << 20, 1 << 24, 1 << 28):
        base = size / 2e4
        rows = []
        for p in range(procs):
            scale = 1.25 if p == slow_process else 1.0
            rows.append([base * scale * (1 + rng.gauss(0, 0.01)) for _ in range(20)])
        per = {
            "min_us": base,
            "max_us": base,
            "avg_us": base,
            "times_us": [max(c) for c in zip(*rows, strict=True)],
        }
        per["per_process_max_times_us"] = rows
        results.append(
            {
                "size": size,
                "count": size // 4,
                "type": "float",
                "redop": "sum",
                "root": "    -1",
                "out_of_place_per_iter": per,
            }
        )
    devices = [
        {
            "rank": p,
            "group": 0,
            "pid": 500 + p,
            "hostname": f"gpu-{p // 4:02d}",
            "device": p % 4,
            "device_hex": "0x1",
            "device_info": "NVIDIA H100",
        }
        for p in range(procs)
    ]
    return {"version": 1, "config": {"iterations": 20}, "devices": devices, "results": results}


def test_nccl_tests_json_names_the_slow_process(tmp_path):
    f = tmp_path / "ar.json"
    f.write_text(json.dumps(_nccl_tests_doc(5)))
    result = CliRunner().invoke(app, ["slow", str(f), "--json"])
    assert result.exit_code == 1, result.output
    [s] = json.loads(result.stdout)["stragglers"]
    assert (s["rank"], s["host"], s["gpu"]) == (5, "gpu-01", 1)
    f.write_text(json.dumps(_nccl_tests_doc(None)))
    assert CliRunner().invoke(app, ["slow", str(f)]).exit_code == 0


@pytest.mark.parametrize("make", ["empty_dir", "missing", "not_json", "foreign_json"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, make):
    target = tmp_path / "x"
    if make == "empty_dir":
        target.mkdir()
    elif make == "not_json":
        target.write_text("hello\n")
    elif make == "foreign_json":
        target.write_text(json.dumps({"a": 1}))
    result = CliRunner().invoke(app, ["slow", str(target)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


def test_another_key_order_and_p2p_lines_read_the_same(tmp_path):
    """A log not in the writer's order (another version) or with point-to-point lines is read line by
    line with json: the same answer as the fast reading."""
    lines = job_lines(8, 40, late_rank=4, late_frac=0.2, seed=13)
    write_job(tmp_path / "fast", lines)
    reordered = {k: [json.dumps(json.loads(ln), sort_keys=True) for ln in v] for k, v in lines.items()}
    p2p = '{"header":{"id":"0x1","comm_name":"pp","rank":0,"n_ranks":2,"nnodes":1},"metadata":{},'
    p2p += '"p2p_perf":{"p2p":"Send","p2p_sn":1}}'
    for v in reordered.values():
        v.insert(3, p2p)
    write_job(tmp_path / "slow", reordered)
    fast, slow = analyse(tmp_path / "fast"), analyse(tmp_path / "slow")
    assert [s.rank for s in fast.judgement.stragglers] == [s.rank for s in slow.judgement.stragglers] == [4]
    assert fast.judgement.ranks == slow.judgement.ranks
    assert any("point-to-point" in n for n in slow.notes)


def test_live_on_a_folder_without_this_hosts_ranks_is_one_line(tmp_path):
    """--live asks the running job's ranks on this host (as `hang --live`): a folder whose record names
    none is bad input, one line, exit 2."""
    from gputopo.system.pyspy import find_pyspy

    if find_pyspy() is None:
        pytest.skip("py-spy is not installed")
    (tmp_path / "run-record-elsewhere.json").write_text(
        json.dumps({"schema": "gputopo/run-record/v1", "host": "elsewhere", "ranks": [], "gpus": []})
    )
    result = CliRunner().invoke(app, ["slow", "--live", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "names no rank with a PID on this host" in result.output
