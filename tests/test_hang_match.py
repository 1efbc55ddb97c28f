"""Matching on real dumps from real gloo ranks: each fault of issue 24 names the right suspect, from the
pickle dumps and from the JSON ones; torch's own analyzer, fed the same dumps, agrees where it can."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from gputopo.hang.load import Dump, load_dumps, make_dump
from gputopo.hang.match import match_dumps
from gputopo.hang.triage import triage
from hang_dumps import real_dumps

# scenario -> (verdict, {suspect rank: why}, collective op, seq, mismatch kind)
EXPECTED = {
    "never": ("hang", {2: "never_entered"}, "all_reduce", 5, None),
    "op": ("mismatch", {2: "mismatch"}, "all_reduce", 5, "op"),
    "size": ("mismatch", {1: "no_dump", 2: "mismatch"}, "all_reduce", 5, "size"),
    "size_small": ("hang", {2: "no_dump"}, "all_reduce", 5, None),
    "dtype": ("mismatch", {2: "mismatch"}, "all_reduce", 5, "dtype"),
    "crash": ("hang", {2: "no_dump"}, "all_reduce", 5, None),
    "subgroup": ("hang", {1: "never_entered"}, "all_reduce", 1, None),
    "ok": ("no_hang", {}, None, None, None),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fr")


@pytest.mark.parametrize("fmt", ["pickle", "json"])
@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_each_fault_names_its_suspect(scenario: str, fmt: str, base: Path) -> None:
    folder = real_dumps(scenario, base)
    loaded = load_dumps([folder / "json" if fmt == "json" else folder])
    assert {d.format for d in loaded.dumps} == {fmt}
    match = match_dumps(loaded.dumps)
    report = triage(loaded, match)
    verdict, suspects, op, seq, kind = EXPECTED[scenario]
    assert report.verdict == verdict, report.reason
    doc = report.document()
    if not suspects:
        assert doc["groups"] == [] and report.exit_code == 0
        return
    assert report.exit_code == 1
    (group,) = doc["groups"]
    assert {s["rank"]: s["why"] for s in group["suspects"]} == suspects
    assert (group["collective"]["op"], group["collective"]["seq"]) == (op, seq)
    if kind:
        assert [m["kind"] for m in group["mismatches"]] == [kind]
    for s in group["suspects"]:
        if s["why"] == "no_dump":
            assert s["last_collective"] is None and s["rank"] in doc["missing_dumps"]
        else:
            assert s["last_collective"]["op"]
            # pickle dumps carry the Python stack, and it leads to the scenario's own code
            if fmt == "pickle":
                assert any("fr_dumps.py" in f for f in s["stack"])
            else:
                assert s["stack"] is None


def test_the_never_entered_rank_was_last_seen_in_its_previous_collective(base: Path) -> None:
    loaded = load_dumps([real_dumps("never", base)])
    (group,) = match_dumps(loaded.dumps).groups
    (suspect,) = group.suspects
    assert (suspect.last_collective.op, suspect.last_collective.seq) == ("broadcast", 4)
    assert group.entered == (0, 1) and group.completed == ()


def test_a_wrong_op_names_both_ops(base: Path) -> None:
    (group,) = match_dumps(load_dumps([real_dumps("op", base)]).dumps).groups
    assert group.mismatches[0].what == "calls broadcast where the others call all_reduce"


def test_subgroup_membership_is_recovered_from_the_unnamed_gloo_record(base: Path) -> None:
    match = match_dumps(load_dumps([real_dumps("subgroup", base)]).dumps)
    (group,) = match.groups
    assert group.pg == "1" and group.ranks == (0, 1)
    assert "0" in match.healthy_groups
    assert any("assumed" in n for n in match.notes)


@pytest.mark.parametrize("scenario", ["never", "op", "size", "dtype", "subgroup", "ok"])
def test_torch_analyzer_agrees_where_it_works(scenario: str, base: Path) -> None:
    pytest.importorskip("torch.distributed.flight_recorder.components.builder")
    from gputopo.hang.torch_check import ask_torch, compare

    loaded = load_dumps([real_dumps(scenario, base)])
    ours = match_dumps(loaded.dumps)
    opinion = ask_torch(list(loaded.dumps), ours)
    assert opinion.ran and opinion.error is None, opinion.error
    missing = {r for r in ours.world if r not in {d.rank for d in loaded.dumps}}
    assert compare(opinion, ours, missing) == []
    if ours.groups:
        g = ours.groups[0]
        assert (g.pg, g.collective.seq) in opinion.problems


def test_torch_analyzer_fed_the_raw_gloo_dump_fails_as_measured(base: Path) -> None:
    """The failure issue 24 measured (KeyError on pg_config '' vs '0'), and ours answering instead."""
    pytest.importorskip("torch.distributed.flight_recorder.components.builder")
    from gputopo.hang.torch_check import ask_torch

    loaded = load_dumps([real_dumps("never", base)])
    ours = match_dumps(loaded.dumps)
    raw = copy.copy(ours)
    object.__setattr__(raw, "members", {"": ("", (0, 1, 2))})  # what the dump's pg_config says
    object.__setattr__(raw, "rank_groups", {})
    opinion = ask_torch(list(loaded.dumps), raw)
    assert opinion.error is not None and opinion.error.startswith("KeyError")
    assert ours.groups[0].never_entered == (2,)


def test_torch_analyzer_cannot_decide_without_the_crashed_ranks_dump(base: Path) -> None:
    pytest.importorskip("torch.distributed.flight_recorder.components.builder")
    from gputopo.hang.torch_check import ask_torch, compare

    loaded = load_dumps([real_dumps("crash", base)])
    ours = match_dumps(loaded.dumps)
    opinion = ask_torch(list(loaded.dumps), ours)
    assert opinion.problems == {}  # "We cannot decide what's wrong ... missed FR dumps from ranks ({2})"
    assert any("cannot decide" in m for m in opinion.messages)
    assert compare(opinion, ours, {2}) == []  # not a disagreement: ours names the rank without a dump


def _as_nccl(dump: Dump, states: dict[int, str]) -> Dump:
    """A real gloo dump re-labelled as NCCL would write it (``nccl:`` names and event states): NCCL's
    states cannot be produced without GPUs. ``states`` maps a sequence id to the state to give it."""
    entries = []
    for e in dump.entries:
        e = dict(e)
        e["profiling_name"] = "nccl:" + e["profiling_name"].split(":", 1)[1]
        e["state"] = states.get(e["collective_seq_id"], "completed")
        entries.append(e)
    return make_dump(dump.rank, dump.path, entries, fmt=dump.format, version=dump.version)


def test_nccl_states_name_the_rank_stuck_inside_and_join_its_gpu_health(base: Path) -> None:
    from gputopo.hang.record import Placement

    loaded = load_dumps([real_dumps("ok", base)])
    # every rank entered seq 5; ranks 0 and 1 started it, rank 2's kernel never started
    dumps = [_as_nccl(d, {5: "scheduled" if d.rank == 2 else "started"}) for d in loaded.dumps]
    match = match_dumps(dumps)
    (group,) = match.groups
    assert group.state_tracked and group.completed == () and group.entered == (0, 1, 2)
    assert [(s.rank, s.why) for s in group.suspects] == [(2, "stuck_inside")]
    place = {2: Placement(2, "node-b", 1, 0, 5, "GPU-5", 4242, "run-record")}
    nvlink = {
        "where": "node-b GPU5",
        "gpu": 5,
        "category": "nvlink",
        "what": "NVLink 3 replay errors rising (12/s)",
        "remedy": "reset or reseat",
        "severity": "problem",
        "action": "drain",
    }
    report = triage(loaded, match, place, health={("node-b", 5): [nvlink]})
    finding = report.findings[0]
    assert finding["category"] == "nvlink" and finding["action"] == "drain" and finding["gpu"] == 5
    assert "NVLink 3 replay errors" in finding["what"] and "node-b" in finding["where"]
    suspect = report.document()["groups"][0]["suspects"][0]
    assert suspect["health"] == [nvlink] and suspect["gpu"] == {"index": 5, "uuid": "GPU-5"}
    # without health readings it is still named, as a process to watch, and says it knows no health
    bare = triage(loaded, match, place).findings[0]
    assert bare["action"] == "monitor" and "no health readings" in bare["what"]


def test_a_wrapped_ring_buffer_still_finds_the_hang(base: Path) -> None:
    """TORCH_FR_BUFFER_SIZE keeps the last N entries: a rank whose oldest entries are gone went past them."""
    loaded = load_dumps([real_dumps("never", base)])
    wrapped = []
    for d in loaded.dumps:
        entries = d.entries[2:] if d.rank == 0 else d.entries  # rank 0 lost seq 1 and 2 to the ring
        wrapped.append(make_dump(d.rank, d.path, entries, fmt=d.format, version=d.version))
    (group,) = match_dumps(wrapped).groups
    assert group.collective.seq == 5 and group.never_entered == (2,)


def test_dumps_gathered_from_two_nodes(base: Path, tmp_path: Path) -> None:
    """Each node's folder holds its own ranks' dumps and its run record; both folders are given."""
    import json
    import shutil

    from conftest import invoke

    src = real_dumps("never", base)
    for host, ranks in (("node-a", (0, 1)), ("node-b", (2,))):
        folder = tmp_path / host
        folder.mkdir()
        for r in ranks:
            shutil.copy(src / f"rank_trace{r}", folder / f"rank_trace{r}")
        record = {
            "schema": "gputopo/run-record/v1",
            "host": host,
            "gpus": [{"local_rank": i, "index": i, "uuid": f"GPU-{host}-{i}"} for i in range(len(ranks))],
            "ranks": [{"rank": r, "local_rank": i, "pid": 1000 + r} for i, r in enumerate(ranks)],
        }
        (folder / "run-record.json").write_text(json.dumps(record))
    result = invoke("hang", str(tmp_path / "node-a"), str(tmp_path / "node-b"), "--json")
    doc = json.loads(result.stdout)
    (suspect,) = doc["groups"][0]["suspects"]
    assert (suspect["rank"], suspect["host"], suspect["gpu"]["uuid"], suspect["pid"]) == (
        2,
        "node-b",
        "GPU-node-b-0",
        1002,
    )
    assert doc["missing_dumps"] == [] and doc["dumps"]["count"] == 3
