"""Matching as torch's analyzer does it (issue 29): each op's own size rules on real gloo ranks (uneven
all_to_all_single, scatter, gather, all_gather), groups keyed by name, description and ranks, calls
counted per rank, and, in torch's NCCL dump format where gloo cannot record it, point-to-point ops,
groups that share a name (split_group) and pg_status. torch's own analyzer runs beside ours."""

from __future__ import annotations

import json
import pickle
import tracemalloc
from pathlib import Path

import pytest

from conftest import invoke
from gputopo.hang.load import CraftedDumpError, load_dumps, load_one
from gputopo.hang.match import match_dumps
from gputopo.hang.oprules import alltoall_totals, mismatch
from gputopo.hang.triage import triage
from hang_dumps import PREFIX, copy_dumps, real_dumps
from nccl_dumps import Rank, write

W4 = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fr")


def _analyse(folder: Path):
    loaded = load_dumps([folder])
    match = match_dumps(loaded.dumps)
    return loaded, match, triage(loaded, match)


def _torch_agrees(loaded, match) -> None:
    """torch's analyzer, fed the same dumps, names the same ranks (where it can run)."""
    pytest.importorskip("torch.distributed.flight_recorder.components.builder")
    from gputopo.hang.torch_check import ask_torch, compare

    opinion = ask_torch(list(loaded.dumps), match)
    assert opinion.ran and opinion.error is None, opinion.error
    assert compare(opinion, match, set()) == []


# --- real gloo ranks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_uneven_all_to_all_scatter_and_gather_match_and_the_later_hang_is_found(base: Path, fmt: str) -> None:
    """An MoE step with uneven splits is healthy (torch's Op.match skips their sizes); the rank that then
    never enters the all_reduce is the one named, not the ranks with their own split sizes."""
    folder = real_dumps("moe", base)
    loaded, match, report = _analyse(folder / "json" if fmt == "json" else folder)
    sizes = {d.rank: d.groups["0"][1][5][0]["input_sizes"] for d in loaded.dumps}
    assert sizes == {0: [[3]], 1: [[6]], 2: [[9]]}  # all_to_all_single: rank r sends r+1 to each of 3
    assert report.verdict == "hang" and report.exit_code == 1, report.reason
    (group,) = match.groups
    assert (group.collective.op, group.never_entered, group.mismatches) == ("all_reduce", (2,), ())
    assert [(s["rank"], s["why"]) for s in report.document()["suspects"]] == [(2, "never_entered")]
    if fmt == "pickle":
        _torch_agrees(loaded, match)


def test_subgroups_are_matched_within_their_own_ranks(base: Path) -> None:
    """4 gloo ranks, subgroups {0,1} and {2,3}: {2,3} is stuck (rank 3 never enters), {0,1} is fine."""
    loaded, match, report = _analyse(real_dumps("subgroups4", base))
    (group,) = match.groups
    assert (group.pg, group.ranks, group.never_entered, group.entered) == ("2", (2, 3), (3,), (2,))
    assert "1" in match.healthy_groups and "0" in match.healthy_groups
    _torch_agrees(loaded, match)


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_counts_point_at_the_skipped_call(base: Path, fmt: str) -> None:
    """Rank 2 skips one gradient all_reduce, then every rank calls barrier: the answer says rank 2 made
    one all_reduce fewer, and where its calls first differ (from the stacks: seq 10, the skipped one;
    JSON dumps carry no stacks, so there the first op that differs: the barrier at seq 12)."""
    folder = real_dumps("skip", base)
    _, match, report = _analyse(folder / "json" if fmt == "json" else folder)
    (group,) = match.groups
    assert group.calls[2] == {"all_reduce": 10, "barrier": 1, "broadcast": 1}
    assert group.calls[0] == {"all_reduce": 11, "broadcast": 1}
    first = 10 if fmt == "pickle" else 12
    note = f"rank 2: 10 all_reduce and 1 barrier, others 11 and 0; the first difference is at seq {first}"
    assert group.calls_note == note
    assert note in report.reason
    assert report.document()["groups"][0]["calls"]["note"] == note
    _torch_agrees(*_analyse(folder / "json" if fmt == "json" else folder)[:2])  # torch: rank 2, seq 12


def test_a_json_dump_without_entries_is_a_rank_that_never_entered(base: Path, tmp_path: Path) -> None:
    """torch's JSON writer leaves 'entries' out when nothing was recorded (dump_json); the rank has a
    dump, so it never entered: it did not die without one."""
    folder = copy_dumps(real_dumps("never", base), tmp_path / "d", json_dumps=True)
    doc = json.loads((folder / f"{PREFIX}2.json").read_text())
    del doc["entries"]
    (folder / f"{PREFIX}2.json").write_text(json.dumps(doc))
    result = invoke("hang", str(folder), "--json")
    out = json.loads(result.stdout)
    assert result.exit_code == 1 and out["missing_dumps"] == [] and out["skipped_dumps"] == []
    (suspect,) = out["groups"][0]["suspects"]
    assert (suspect["rank"], suspect["why"]) == (2, "never_entered")
    assert "recorded no operation" in suspect["what"]


# --- torch's NCCL format ------------------------------------------------------------------------------


def _pipeline() -> list[Rank]:
    """4 ranks: two all_reduces everywhere; pipeline group 'pp' = global ranks 1 and 3 (group ranks 0, 1).
    Rank 1's second send to rank 3 waits; rank 3 never posted the receive."""
    ranks = [Rank(i) for i in W4]
    for r in ranks:
        for _ in range(2):
            r.collective("0", "default_pg", W4, "all_reduce", [[8]])
    ranks[1].send("1", "pp", [1, 3], 1, [4, 4], "completed")
    ranks[3].recv("1", "pp", [1, 3], 0, [4, 4], "completed")
    ranks[1].send("1", "pp", [1, 3], 1, [4, 4], "scheduled")
    return ranks


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_a_send_stuck_on_a_receive_never_posted_names_the_receiver(tmp_path: Path, fmt: str) -> None:
    loaded, match, report = _analyse(write(_pipeline(), tmp_path, fmt))
    assert report.verdict == "hang" and report.exit_code == 1, report.reason
    (group,) = match.groups
    assert group.p2p and group.pg == "1" and group.ranks == (1, 3)
    # the profiling name says "send 0->1" in group ranks; shown as global ranks
    assert (group.collective.op, group.collective.peer, group.collective.seq) == ("send", 3, 2)
    assert [(s.rank, s.why) for s in group.suspects] == [(3, "never_entered")]
    assert "rank 3 never posted the recv from rank 1" in report.reason
    _torch_agrees(loaded, match)


def test_a_p2p_size_mismatch_and_a_pair_stuck_inside(tmp_path: Path) -> None:
    ranks = [Rank(i) for i in (0, 1)]
    ranks[0].send("0", "default_pg", [0, 1], 1, [4], "started")
    ranks[1].recv("0", "default_pg", [0, 1], 0, [8], "scheduled")
    _, match, report = _analyse(write(ranks, tmp_path / "size"))
    assert report.verdict == "mismatch" and match.groups[0].mismatches[0].rank == 1
    ranks = [Rank(i) for i in (0, 1)]
    ranks[0].send("0", "default_pg", [0, 1], 1, [4], "started")
    ranks[1].recv("0", "default_pg", [0, 1], 0, [4], "scheduled")
    _, match, _ = _analyse(write(ranks, tmp_path / "inside"))
    assert [(s.rank, s.why) for s in match.groups[0].suspects] == [(1, "stuck_inside")]


def _split_groups() -> list[Rank]:
    """DeviceMesh's split_group: TP groups {0,1} and {2,3} are both named '2' (desc 'tp'). {0,1} made two
    all_reduces; in {2,3} rank 2 started the second and rank 3 never entered it."""
    ranks = [Rank(i) for i in W4]
    for r in ranks:
        tp = [0, 1] if r.rank < 2 else [2, 3]
        r.collective("0", "default_pg", W4, "all_reduce", [[8]])
        r.collective("2", "tp", tp, "all_reduce", [[4]])
        if r.rank < 2:
            r.collective("2", "tp", tp, "all_reduce", [[4]])
        elif r.rank == 2:
            r.collective("2", "tp", tp, "all_reduce", [[4]], state="started")
    return ranks


def test_groups_sharing_a_name_are_told_apart_by_their_ranks(tmp_path: Path) -> None:
    loaded, match, report = _analyse(write(_split_groups(), tmp_path))
    (group,) = match.groups
    assert (group.pg, group.desc, group.ranks, group.never_entered, group.entered) == (
        "2",
        "tp",
        (2, 3),
        (3,),
        (2,),
    )
    assert "2 ranks 0-1" in match.healthy_groups
    assert report.exit_code == 1
    _torch_agrees(loaded, match)


def test_pg_status_speaks_for_a_rank_whose_entries_left_the_ring(tmp_path: Path) -> None:
    """Rank 1's ring holds nothing of the default group any more (a small TORCH_FR_BUFFER_SIZE and a
    busy other group), but its pg_status says it enqueued and started seq 3: it is inside, not a rank
    that never entered."""
    ranks = [Rank(i) for i in (0, 1, 2)]
    for r in ranks:
        r.collective("0", "default_pg", [0, 1, 2], "all_reduce", [[8]])
        r.collective("0", "default_pg", [0, 1, 2], "all_reduce", [[8]])
        r.collective("0", "default_pg", [0, 1, 2], "all_reduce", [[8]], state="started")
    ranks[1].entries = [e for e in ranks[1].entries if e["collective_seq_id"] < 3]
    ranks[1].entries = ranks[1].entries[:1]  # the ring kept only seq 1
    ranks[1].pg_status["0"]["last_completed_collective"] = 2
    for fmt in ("pickle", "json"):
        _, match, _ = _analyse(write(ranks, tmp_path / fmt, fmt))
        (group,) = match.groups
        assert group.never_entered == () and 1 in group.entered, fmt
        assert group.pg_status[1] == {"enqueued": 3, "started": 3, "completed": 2}
    del ranks[1].pg_status["0"]
    _, match, _ = _analyse(write(ranks, tmp_path / "without", "pickle"))
    assert match.groups[0].never_entered == (1,)  # without pg_status, the entry's absence is all we have


def test_a_coalesced_call_is_matched_op_by_op(tmp_path: Path) -> None:
    """The ops of a coalesced call share one sequence id, closed by a ``coalesced`` entry (compared by its
    type only); rank 1's second op has other sizes: a size mismatch inside the coalesced call."""
    ranks = [Rank(i) for i in (0, 1)]
    for r in ranks:
        r.collective("0", "default_pg", [0, 1], "all_reduce", [[8]])
        first = r.collective("0", "default_pg", [0, 1], "all_reduce", [[2]], state="scheduled")
        second = r.collective(
            "0", "default_pg", [0, 1], "all_reduce", [[4 if r.rank else 3]], state="scheduled"
        )
        closing = r.collective("0", "default_pg", [0, 1], "coalesced", [], state="scheduled")
        for e in (second, closing):  # one sequence id for the whole coalesced call
            e["collective_seq_id"] = first["collective_seq_id"]
    _, match, report = _analyse(write(ranks, tmp_path))
    (group,) = match.groups
    assert report.verdict == "mismatch" and group.collective.seq == 2
    assert [(m.rank, m.kind) for m in group.mismatches] == [(1, "size")]


def test_torchs_size_rules_op_by_op() -> None:
    def e(op: str, ins, outs, dt="Float", odt=None):
        return {
            "profiling_name": f"nccl:{op}",
            "input_sizes": ins,
            "output_sizes": outs,
            "input_dtypes": [dt] * len(ins),
            "output_dtypes": [odt or dt] * len(outs),
        }

    assert mismatch(e("all_to_all", [[3]], [[9]]), e("all_to_all", [[6]], [[9]]), 3) is None
    assert mismatch(e("scatter", [], [[2]]), e("scatter", [[2], [2]], [[2]]), 2) is None
    assert mismatch(e("gather", [[2]], []), e("gather", [[2]], [[2], [2]]), 2) is None
    assert mismatch(e("all_gather", [[2]], [[8]]), e("all_gather", [[2]], [[8]]), 4) is None
    assert mismatch(e("all_gather", [[2]], [[6]]), e("all_gather", [[2]], [[6]]), 4)[0] == "size"
    assert mismatch(e("reduce_scatter", [[8]], [[2]]), e("reduce_scatter", [[8]], [[2]]), 4) is None
    assert mismatch(e("reduce_scatter", [[6]], [[2]]), e("reduce_scatter", [[6]], [[2]]), 4)[0] == "size"
    assert mismatch(e("all_reduce", [[8]], [[8]]), e("all_reduce", [[4]], [[4]]), 2)[0] == "size"
    assert mismatch(e("all_reduce", [[8]], [[8]], "Int"), e("all_reduce", [[8]], [[8]]), 2)[0] == "dtype"
    assert mismatch(e("broadcast", [[8]], [[8]]), e("all_reduce", [[8]], [[8]]), 2)[0] == "op"
    assert mismatch(e("coalesced", [[1]], [[1]]), e("coalesced", [[2]], [[2]]), 2) is None
    assert alltoall_totals([e("all_to_all", [[3]], [[9]]), e("all_to_all", [[6]], [[9]])]) == (9, 18)
    assert alltoall_totals([e("all_to_all", [[3]], [[3]]), e("all_to_all", [[3]], [[3]])]) is None


# --- bad input ------------------------------------------------------------------------------------------


def _one_line_exit_2(result, name: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert lines[0].startswith("error:") and name in lines[0] and "Traceback" not in result.output


def test_a_deeply_nested_json_dump_is_refused_in_one_line(tmp_path: Path) -> None:
    deep = '{"version": "2.10", "entries": [{"input_sizes": ' + "[" * 100_000 + "]" * 100_000 + "}]}"
    (tmp_path / f"{PREFIX}0.json").write_text(deep)
    _one_line_exit_2(invoke("hang", str(tmp_path)), f"{PREFIX}0.json")


def test_a_pickle_of_empty_lists_is_refused_before_it_is_loaded(tmp_path: Path) -> None:
    """2 million EMPTY_LISTs appended into each other: 4 MB that would load to about 200 MB."""
    n = 2_000_000
    data = b"\x80\x04]" + b"]" * n + b"a" * n + b"."
    path = tmp_path / f"{PREFIX}0"
    path.write_bytes(data)
    with pytest.raises(CraftedDumpError):
        load_one(0, path)
    _one_line_exit_2(invoke("hang", str(tmp_path)), f"{PREFIX}0")


def test_an_entry_nested_deeper_than_torch_writes_is_refused(base: Path, tmp_path: Path) -> None:
    folder = copy_dumps(real_dumps("never", base), tmp_path / "d")
    doc = pickle.loads((folder / f"{PREFIX}1").read_bytes())
    nested: list = []
    for _ in range(400):
        nested = [nested]
    doc["entries"][0]["input_sizes"] = nested
    (folder / f"{PREFIX}1").write_bytes(pickle.dumps(doc))
    _one_line_exit_2(invoke("hang", str(folder)), f"{PREFIX}1")


def test_loading_a_real_dump_costs_what_its_data_costs(base: Path, tmp_path: Path) -> None:
    doc = pickle.loads((real_dumps("never", base) / f"{PREFIX}0").read_bytes())
    entries = doc["entries"]
    doc["entries"] = [dict(entries[i % len(entries)], record_id=i) for i in range(2000)]
    path = tmp_path / f"{PREFIX}0"
    path.write_bytes(pickle.dumps(doc))
    size = path.stat().st_size

    def peak_of(fn) -> int:
        tracemalloc.start()
        fn()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return peak

    bare = peak_of(lambda: pickle.loads(path.read_bytes()))
    ours = peak_of(lambda: load_one(0, path))
    # what the data itself costs, the file's bytes, the index by sequence id and the unpickler's 1 MiB
    # read buffer (load.safe_loads): nothing that grows with the file beyond those
    assert ours < 1.5 * bare + 2 * size + 1.5 * 2**20, (ours, bare, size)


def test_a_name_that_is_neither_a_path_nor_a_prefix_is_exit_2(tmp_path: Path) -> None:
    _one_line_exit_2(invoke("hang", str(tmp_path / "run-typo")), "run-typo")


def test_the_help_examples_run_as_written(base: Path, tmp_path: Path, monkeypatch) -> None:
    """Every example in `gputopo hang --help` names files the way `gputopo run` writes them, and runs
    (in a folder laid out as run leaves it) without a usage error."""
    import re
    import shlex
    import shutil

    from gputopo.cli.hang import hang_command  # noqa: F401 (registers the command)
    from gputopo.launch.record import DUMP_PREFIX_NAME

    help_text = invoke("hang", "--help").output
    examples = [ln.strip() for ln in help_text.splitlines() if ln.strip().startswith("gputopo hang ")]
    assert len(examples) >= 6
    monkeypatch.chdir(tmp_path)
    run_dir = Path("reports/run-20260101T120000Z")
    run_dir.mkdir(parents=True)
    src = real_dumps("never", base)
    for r in range(3):
        shutil.copy(src / f"{PREFIX}{r}", run_dir / f"{DUMP_PREFIX_NAME}{r}")
    shutil.copytree(run_dir, "dumps")
    record = {"schema": "gputopo/run-record/v1", "host": "node0", "ranks": [{"rank": 0, "local_rank": 0}]}
    Path("node0.json").write_text(json.dumps(record))
    Path("node1.json").write_text(json.dumps({**record, "host": "node1", "ranks": [{"rank": 1}]}))
    from test_hang_cli import RAS_JSON

    Path("ras.json").write_text(RAS_JSON)
    Path("job.log").write_text("node0:1 NCCL DIAG nothing to say\n")
    for line in examples:
        argv = shlex.split(line, comments=True)[2:]  # as a shell reads it: "#" starts a comment
        if "--live" in argv:
            continue  # needs a running job: test_hang_live runs `gputopo hang --live RUN_DIR` on one
        result = invoke("hang", *argv)
        assert result.exit_code in (0, 1, 3), (line, result.output)
        if "--ras" not in argv or "--ras-json" in argv:
            assert result.exit_code == 1, (line, result.output)  # the never scenario: a hang
    assert any(re.search(r"reports/run-\d{8}T\d{6}Z\b", e) for e in examples)
