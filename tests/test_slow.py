"""``gputopo slow``: the rank the others wait for, from NCCL Inspector logs (written as the plugin writes
them: tests/inspector_logs.py), Flight Recorder creation times and nccl-tests -J files."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from gputopo.cli import app
from gputopo.services.slow import analyse
from gputopo.slow import judge as J
from gputopo.slow import readers as R
from inspector_logs import job_lines, ranks_of, write_job

RANK_COUNTS = (8, 16, 32, 64, 128, 256)


def _judge_lines(lines: dict[tuple[str, int], list[str]]) -> J.Judgement:
    read = R.InspectorRead()
    for ls in lines.values():
        R.parse_inspector(("\n".join(ls) + "\n").encode(), read)
    return J.judge(R.inspector_series(read, ranks_of(lines)).series)


def _job(
    i: int, rng: random.Random, late: bool = True, counts: tuple[int, ...] = RANK_COUNTS
) -> tuple[int, dict]:
    """Job ``i`` of the generated set: 8-256 ranks; one world communicator NCCL calls "unknown", or
    tensor-parallel groups (every one ``mesh_tp`` or "unknown") with data-parallel groups across them
    (two message sizes, three functions; DP groups of two where TP is half the job); a third with an
    eager rank; half with point-to-point lines."""
    ranks = counts[i % len(counts)]
    kw: dict = {"seed": i, "hosts": max(1, ranks // 8), "p2p": i % 2 == 0}
    if late:
        kw["late_rank"] = rng.randrange(ranks)
        kw["late_frac"] = rng.uniform(0.05, 0.30)
    if i % 3 == 0:
        kw["eager_rank"] = rng.choice([r for r in range(ranks) if r != kw.get("late_rank")])
        kw["eager_frac"] = rng.uniform(0.05, 0.30)
    layout = i % 4
    if layout == 0:
        kw["names"] = "unknown"
    elif layout == 1:
        kw.update(tp=8, names="shared")
    elif layout == 2:
        kw.update(tp=4, names="shared", tp_colls=("AllReduce",), dp_per_step=2)
    else:
        kw.update(tp=4, names="unknown")
    return ranks, kw


def _generated(jobs: int, seed: int = 7) -> tuple[int, list[str]]:
    rng = random.Random(seed)
    named = 0
    wrong = []
    for i in range(jobs):
        ranks, kw = _job(i, rng)
        j = _judge_lines(job_lines(ranks, 24, **kw))
        blamed = {s.rank for s in j.stragglers}
        if blamed - {kw["late_rank"]}:
            wrong.append(f"job {i} ({ranks} ranks, {kw}): blamed {sorted(blamed)}")
        named += kw["late_rank"] in blamed
    return named, wrong


def test_the_planted_late_rank_is_named_and_no_other_on_a_sample_of_generated_jobs():
    """The first 24 of the generated jobs (every layout, rank count, eager rank and p2p mix)."""
    named, wrong = _generated(24)
    assert not wrong, wrong
    assert named >= 23, f"named in {named} of 24"


@pytest.mark.slow
def test_the_planted_late_rank_is_named_in_200_generated_jobs():
    """200 jobs of 8-256 ranks, one rank 5-30% late, 1% noise, a third with an eager rank (5-30% early:
    the longest kernel times), half with p2p lines, communicator names shared: named in at least 95%,
    and no other rank named in any job (neither a waiting rank nor the eager rank's mates)."""
    named, wrong = _generated(200)
    assert not wrong, wrong
    assert named >= 0.95 * 200, f"named in {named} of 200"


def test_equal_ranks_have_no_straggler():
    rng = random.Random(11)
    for i in range(50):
        ranks, kw = _job(i, rng, late=False, counts=(8, 16, 32, 64))
        j = _judge_lines(job_lines(ranks, 24, **kw))
        assert not j.stragglers, f"job {i} ({ranks} ranks, {kw}): {j.stragglers}"
        assert j.undecided is None


def test_the_eager_ranks_mates_are_not_named():
    """The issue's job: 64 ranks, 8 per host, TP groups of 8 all named mesh_tp, late rank 19, eager rank
    51 (its TP mates 48-50 used to be named from a pooled window)."""
    lines = job_lines(
        64,
        24,
        late_rank=19,
        late_frac=0.1,
        eager_rank=51,
        eager_frac=0.3,
        seed=3,
        hosts=8,
        tp=8,
        names="shared",
    )
    j = _judge_lines(lines)
    assert [s.rank for s in j.stragglers] == [19]
    assert j.ranks[51] < 0  # early: negative lateness, never an outlier
    assert any(c.startswith("mesh_tp (0x") for c in j.stragglers[0].communicators)


def test_a_straggler_s_tp_mates_waited_for_it():
    """TP groups of 4 wait for one late member, then reach each DP all-reduce late together: only the
    straggler in ``stragglers``, its mates in ``waited`` (waited_for the straggler), in every job. (The
    DP mates it held back carry the wait into their own TP groups: they are listed as waiting for it too.)"""
    for seed in range(6):
        late = (5 + 7 * seed) % 32
        lines = job_lines(
            32,
            24,
            late_rank=late,
            late_frac=0.15,
            seed=seed,
            hosts=4,
            tp=4,
            names="shared",
            tp_colls=("AllReduce",),
            dp_per_step=2,
        )
        j = _judge_lines(lines)
        mates = sorted(set(range(late - late % 4, late - late % 4 + 4)) - {late})
        assert [s.rank for s in j.stragglers] == [late], f"seed {seed}"
        waited = {w.rank: w.waited_for for w in j.waited}
        assert set(mates) <= set(waited) and set(waited.values()) == {(late,)}, f"seed {seed}: {waited}"


def test_the_verdict_is_the_same_under_any_hash_seed(tmp_path):
    """No set or dict order decides: the same verdicts (stragglers, waited, every rank's lateness)
    under three PYTHONHASHSEEDs, on jobs with shared names, eager ranks and several sizes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "verdicts.py"
    script.write_text(
        "import json, random, sys\n"
        "sys.path[:0] = sys.argv[1:3]\n"
        "import test_slow as T\n"
        "rng = random.Random(5)\n"
        "out = []\n"
        "for i in range(12):\n"
        "    ranks, kw = T._job(i, rng, counts=(8, 16, 32))\n"
        "    j = T._judge_lines(T.job_lines(ranks, 24, **kw))\n"
        "    out.append([[s.rank for s in j.stragglers], [(w.rank, w.waited_for) for w in j.waited],"
        " sorted(j.ranks.items()), j.windows])\n"
        "print(json.dumps(out))\n"
    )
    here = Path(__file__).resolve().parent
    src = str(here.parent / "src")
    answers = set()
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, str(script), src, str(here)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        answers.add(run.stdout)
    assert len(answers) == 1


def test_one_spike_is_not_a_straggler():
    """Recurrence, not one spike: a rank 50% late in one operation of 40 is not named."""
    rows = []
    for sn in range(40):
        late = [0.01 * ((r * 7 + sn) % 5) for r in range(8)]
        if sn == 3:
            late[2] = 2.5
        rows.append(late)
    s = J.Series("0x1", "world", "AllReduce", 21, tuple(range(8)), rows, [5.0] * 40, [40.0] * 40)
    assert not J.judge([s]).stragglers


def test_a_rank_5_percent_late_on_short_operations_is_caught():
    """The floor is relative to the operation: on 200 us operations 10 us late is found."""
    lines = job_lines(32, 30, late_rank=3, late_frac=0.05, work_us=200.0, seed=3)
    assert [s.rank for s in _judge_lines(lines).stragglers] == [3]


def test_lateness_is_measured_from_the_median_member():
    """The late rank positive, the waiting ranks about zero, an eager rank negative; the floor's base is
    the shortest execution (the last arrival's), not the longest (which holds the waiting)."""
    lines = job_lines(8, 24, late_rank=2, late_frac=0.2, eager_rank=5, eager_frac=0.3, seed=1)
    read = R.InspectorRead()
    for ls in lines.values():
        R.parse_inspector(("\n".join(ls) + "\n").encode(), read)
    [s] = R.inspector_series(read, ranks_of(lines)).series
    late = J.mid([row[2] for row in s.rows])
    eager = J.mid([row[5] for row in s.rows])
    others = [J.mid([row[r] for row in s.rows]) for r in (0, 1, 3, 4, 6, 7)]
    assert 0.8 < late < 1.2 and -1.7 < eager < -1.3 and max(abs(v) for v in others) < 0.15
    assert 4.5 < J.mid(s.optime_ms) < 5.5  # the work, about 5 ms, without the 1 ms of waiting


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
    # util.cu's writeDeviceReport writes "devices" inside "config" (analyze_perf_json.py reads
    # data['config']['devices']).
    return {"version": 1, "config": {"iterations": 20, "devices": devices}, "results": results}


def test_nccl_tests_top_level_devices_still_place_processes(tmp_path):
    """A hand-made file with ``devices`` at the top level (not how nccl-tests writes it) is still read."""
    doc = _nccl_tests_doc(2)
    doc["devices"] = doc["config"].pop("devices")
    f = tmp_path / "ar.json"
    f.write_text(json.dumps(doc))
    [s] = analyse(f).document()["stragglers"]
    assert (s["rank"], s["host"], s["gpu"]) == (2, "gpu-00", 2)


def test_nccl_tests_one_spike_does_not_decide(tmp_path):
    """Per size, the median over iterations of (a process's time - the iteration's median): one
    process with one iteration 50x longer in every size is not slow."""
    doc = _nccl_tests_doc(None)
    for r in doc["results"]:
        r["out_of_place_per_iter"]["per_process_max_times_us"][3][7] *= 50
    f = tmp_path / "ar.json"
    f.write_text(json.dumps(doc))
    assert analyse(f).exit_code == 0


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


def _fr_entries(rank: int, late: int | None, eager: int | None, steps: int = 40) -> list[dict]:
    """Flight Recorder entries as torch writes them: process_group (name, desc), collective_seq_id,
    time_created_ns, profiling_name, input_sizes."""
    rng = random.Random(rank)
    out = []
    for seq in range(1, steps + 1):
        t = seq * 25_000_000 + int(rng.gauss(0, 100_000))
        if rank == late:
            t += 4_000_000
        if rank == eager:
            t -= 8_000_000
        out.append(
            {
                "process_group": ["0", "default_pg"],
                "collective_seq_id": seq,
                "time_created_ns": t,
                "profiling_name": "gloo:all_reduce",
                "input_sizes": [[1024]],
            }
        )
    return out


def test_flight_recorder_lateness_is_from_the_median_member_on_the_same_host():
    """Creation times: an eager rank (8 ms early every step) adds nothing to the others' lateness; the
    late rank (4 ms) alone is named, on each host judged among its own ranks."""
    entries = {r: _fr_entries(r, late=6, eager=1) for r in range(8)}
    hosts = {r: f"node{r // 4}" for r in range(8)}
    series = R.fr_series(entries, hosts)
    assert {s.comm for s in series} == {"0@node0", "0@node1"}
    assert all(s.label.startswith("default_pg (0)@node") for s in series)
    j = J.judge(series)
    assert [s.rank for s in j.stragglers] == [6]
    assert j.ranks[1] < -7 and abs(j.ranks[0]) < 0.5


def test_two_processes_in_one_file_read_the_same(tmp_path):
    """The pattern trusts a file to be one process's only where every line it took names the same host
    and PID; two logs joined into one file are read line by line, to the same answer."""
    lines = job_lines(8, 30, late_rank=5, late_frac=0.2, seed=17, hosts=2)
    write_job(tmp_path / "apart", lines)
    joined = tmp_path / "joined"
    write_job(joined, lines)
    a, b = sorted(joined.glob("*.log"))[:2]
    a.write_text(a.read_text() + b.read_text())
    b.unlink()
    apart, together = analyse(tmp_path / "apart"), analyse(joined)
    assert (
        [s.rank for s in apart.judgement.stragglers] == [s.rank for s in together.judgement.stragglers] == [5]
    )
    assert apart.judgement.ranks == together.judgement.ranks


def test_live_without_dumps_says_what_to_do(tmp_path):
    """--live took stacks but no rank served its Flight Recorder: the error names the fix."""
    from gputopo.errors import InputError

    with pytest.raises(InputError) as e:
        analyse(tmp_path, live=True)
    assert "no rank served its Flight Recorder" in str(e.value) and "gputopo run" in (e.value.hint or "")
