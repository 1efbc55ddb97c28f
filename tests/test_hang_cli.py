"""``gputopo hang`` end to end: the JSON document, exit codes, run records mapping ranks to hosts, GPUs
and PIDs, and NCCL RAS from a file and from a RAS port."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import invoke
from gputopo.hang.ras import parse_ras_json
from hang_dumps import copy_dumps, real_dumps

UUIDS = ["GPU-1f2e3d4c-0000-0000-0000-00000000000" + str(i) for i in range(8)]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fr")


def _records(folder: Path) -> None:
    """Two nodes: node-a runs ranks 0-1 (placed by node rank, no PIDs), node-b rank 2 (explicit, with PID)."""
    node_a = {
        "schema": "gputopo/run-record/v1",
        "host": "node-a",
        "node_rank": 0,
        "nnodes": 2,
        "ranks_per_node": 2,
        "world_size": 3,
        "cuda_visible_devices": UUIDS[:2],
        "gpus": [{"local_rank": i, "index": i, "uuid": UUIDS[i]} for i in range(2)],
        "versions": {"nccl": "2.27.5", "torch": "2.14.1"},
        "env": {"NCCL_DEBUG": "WARN"},
    }
    node_b = {
        "schema": "gputopo/run-record/v1",
        "host": "node-b",
        "node_rank": 1,
        "ranks_per_node": 1,
        "world_size": 3,
        "cuda_visible_devices": [UUIDS[5]],
        "gpus": [{"local_rank": 0, "index": 5, "uuid": UUIDS[5]}],
        "ranks": [{"rank": 2, "local_rank": 0, "pid": 4242}],
    }
    (folder / "run-record-node-a.json").write_text(json.dumps(node_a))
    (folder / "run-record-node-b.json").write_text(json.dumps(node_b))


def test_json_document_has_the_issue_keys_and_exit_1(base: Path) -> None:
    result = invoke("hang", str(real_dumps("never", base)), "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["schema"] == "gputopo/hang/v1" and doc["verdict"] == "hang"
    assert set(doc) >= {"schema", "verdict", "groups", "missing_dumps", "findings"}
    (group,) = doc["groups"]
    assert set(group) >= {"pg", "ranks", "collective", "completed", "mismatches", "suspects"}
    assert set(group["collective"]) >= {"seq", "op", "sizes", "dtype"}
    (suspect,) = group["suspects"]
    assert set(suspect) >= {"rank", "why", "host", "local_rank", "gpu", "pid", "last_collective", "stack"}
    assert suspect["host"] is None and suspect["gpu"] is None  # no run record: unknown, not made up
    assert any("no run record" in a for a in doc["placement"]["assumed"])
    f = doc["findings"][0]
    assert set(f) == {"where", "gpu", "category", "what", "remedy", "severity", "action"}
    assert f["category"] == "process" and f["severity"] == "problem"


def test_run_records_beside_the_dumps_place_the_suspect(base: Path, tmp_path: Path) -> None:
    folder = copy_dumps(real_dumps("never", base), tmp_path / "run")
    _records(folder)
    result = invoke("hang", str(folder), "--json")
    doc = json.loads(result.stdout)
    suspect = doc["groups"][0]["suspects"][0]
    assert (suspect["rank"], suspect["host"], suspect["local_rank"], suspect["pid"]) == (2, "node-b", 0, 4242)
    assert suspect["gpu"] == {"index": 5, "uuid": UUIDS[5]}
    assert doc["placement"]["source"] == "run-record"
    assert any("node-a: global rank = node_rank 0" in a for a in doc["placement"]["assumed"])
    assert doc["findings"][0]["where"] == "rank 2 (node-b, GPU 5, pid 4242)"
    text = invoke("hang", str(folder)).output
    assert "host node-b  local rank 0  GPU 5 (" + UUIDS[5] + ")  pid 4242" in text


def test_a_run_record_that_does_not_parse_is_exit_2(base: Path, tmp_path: Path) -> None:
    folder = copy_dumps(real_dumps("never", base), tmp_path / "run")
    (folder / "run-record.json").write_text("{not json")
    result = invoke("hang", str(folder))
    assert result.exit_code == 2
    assert "run record" in result.output and "not JSON" in result.output
    other = tmp_path / "rec.json"
    other.write_text(json.dumps({"schema": "something/else"}))
    result = invoke("hang", str(real_dumps("never", base)), "--run-record", str(other))
    assert result.exit_code == 2 and "gputopo/run-record/v1" in result.output


def test_no_hang_is_exit_0_and_a_lost_dump_makes_its_rank_the_suspect(base: Path, tmp_path: Path) -> None:
    ok = real_dumps("ok", base)
    assert invoke("hang", str(ok)).exit_code == 0
    folder = copy_dumps(ok, tmp_path / "d")
    (folder / "rank_trace2").unlink()
    _records(folder)  # the records say the world is 3 ranks
    result = invoke("hang", str(folder), "--json")
    doc = json.loads(result.stdout)
    # gloo records no completion: ranks 0 and 1 ended in the same all_reduce, which nothing shows
    # completed without rank 2, so rank 2 (no dump) is the suspect, placed on node-b.
    assert doc["missing_dumps"] == [2] and doc["verdict"] == "hang" and result.exit_code == 1
    (suspect,) = doc["groups"][0]["suspects"]
    assert (suspect["rank"], suspect["why"], suspect["host"]) == (2, "no_dump", "node-b")


# --- NCCL RAS -------------------------------------------------------------------------------------------

# Written in the shape of NCCL 2.30.7's rasDumpCommsToJSON (src/ras/client_support.cc): two ranks
# present on 10.0.0.1, rank 2 missing and considered dead on 10.0.0.2 (NVML index 5).
RAS_JSON = """{
  "nccl_version": "2.30.7",
  "cuda_runtime_version": 13000,
  "cuda_driver_version": 13000,
  "timestamp": "2026-11-25 18:00:00",
  "communicators_count": 1,
  "communicators": [
    {
      "hash": "0x5a1e",
      "secondary_hash": "0x1:0x2",
      "size": 3,
      "ranks_count": 2,
      "missing_ranks_count": 1,
      "ranks": [
        {
          "rank": 0, "host": "10.0.0.1", "pid": 1000, "cuda_dev": 0, "nvml_dev": 0,
          "status": {"init_state": 0, "async_error": 0, "finalize_called": false, "destroy_flag": false,
                     "abort_flag": false},
          "collective_counts": {"Broadcast": 1, "Reduce": 0, "AllGather": 0, "ReduceScatter": 0,
                                "AllReduce": 5}
        },
        {
          "rank": 1, "host": "10.0.0.1", "pid": 1001, "cuda_dev": 1, "nvml_dev": 1,
          "status": {"init_state": 0, "async_error": 0, "finalize_called": false, "destroy_flag": false,
                     "abort_flag": false},
          "collective_counts": {"Broadcast": 1, "Reduce": 0, "AllGather": 0, "ReduceScatter": 0,
                                "AllReduce": 5}
        }
      ],
      "missing_ranks": [
        {
          "rank": 2, "host": "10.0.0.2", "pid": 2002, "cuda_dev": 0, "nvml_dev": 5,
          "status": {"unresponsive": true, "considered_dead": true}
        }
      ]
    }
  ],
  "ras": {"collection_time_sec": 5.002, "timeouts_count": 1}
}
"""


def test_ras_json_lists_the_dead_rank_with_host_pid_and_gpu(tmp_path: Path, base: Path) -> None:
    ras = tmp_path / "ras.json"
    ras.write_text(RAS_JSON)
    result = invoke("hang", "--ras-json", str(ras), "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["verdict"] == "hang"
    (dead,) = doc["ras"]["troubled"]
    assert (dead["rank"], dead["host"], dead["pid"], dead["gpu"]["index"]) == (2, "10.0.0.2", 2002, 5)
    assert dead["trouble"] == "considered dead by RAS"
    # With the dumps: RAS places the suspect (host, PID, NVML index) when no run record does.
    result = invoke("hang", str(real_dumps("never", base)), "--ras-json", str(ras), "--json")
    suspect = json.loads(result.stdout)["groups"][0]["suspects"][0]
    assert (suspect["host"], suspect["pid"], suspect["gpu"]["index"], suspect["placed_from"]) == (
        "10.0.0.2",
        2002,
        5,
        "ras",
    )


def test_dumps_that_say_no_hang_while_ras_names_a_dead_rank_are_incomplete(
    base: Path, tmp_path: Path
) -> None:
    ras = tmp_path / "ras.json"
    ras.write_text(RAS_JSON)
    result = invoke("hang", str(real_dumps("ok", base)), "--ras-json", str(ras), "--json")
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "incomplete" and result.exit_code == 3
    assert any("NCCL RAS: rank 2" in f["what"] for f in doc["findings"])


def ras_32(tmp_path: Path) -> Path:
    """A 32-rank job in NCCL's RAS JSON shape: 8 hosts of 4 ranks; rank 7 missing and not answering RAS
    (not yet considered dead), rank 12 one AllReduce behind the other 30 (RAS MISMATCH)."""

    def rank(r: int) -> dict:
        return {
            "rank": r,
            "host": f"10.0.0.{r // 4 + 1}",
            "pid": 3000 + r,
            "cuda_dev": r % 4,
            "nvml_dev": r % 4,
        }

    present = [
        {
            **rank(r),
            "status": {"init_state": 0, "async_error": 0, "finalize_called": False, "destroy_flag": False,
                       "abort_flag": False},
            "collective_counts": {"Broadcast": 1, "AllGather": 3, "AllReduce": 41 if r == 12 else 42},
        }
        for r in range(32)
        if r != 7
    ]  # fmt: skip
    missing = [{**rank(7), "status": {"unresponsive": True, "considered_dead": False}}]
    comm = {"hash": "0xbeef", "size": 32, "ranks_count": 31, "missing_ranks_count": 1}
    doc = {
        "nccl_version": "2.30.7",
        "communicators_count": 1,
        "communicators": [{**comm, "ranks": present, "missing_ranks": missing}],
        "ras": {"collection_time_sec": 5.0, "timeouts_count": 0},
    }
    path = tmp_path / "ras-32.json"
    path.write_text(json.dumps(doc))
    return path


def blamed_ranks(doc: dict) -> set[tuple[int, str | None]]:
    """The ranks the problem findings blame, read from their ``where`` ("rank N (...)", or "communicator C
    rank N (...)" for a RAS rank no record maps to a global rank)."""
    import re

    out = set()
    for f in doc["findings"]:
        m = re.match(r"(?:communicator (\S+) )?rank (\d+)\b", f["where"])
        if f["severity"] == "problem" and m:
            out.add((int(m.group(2)), m.group(1)))
    return out


def assert_one_answer(doc: dict) -> None:
    """Every rank a problem finding blames is a top-level suspect, and the headline counts them all."""
    suspects = {(s["rank"], s["communicator"]) for s in doc["suspects"]}
    assert blamed_ranks(doc) <= suspects, (blamed_ranks(doc), doc["suspects"])
    assert suspects <= blamed_ranks(doc)  # and no suspect without its finding
    reason = doc["reason"]
    counted = f"{len(suspects)} troubled rank(s)" in reason or f"{len(suspects)} suspect rank(s)" in reason
    named = all(f"rank {r}" in reason or f"rank(s) {r}" in reason for r, _ in suspects)
    assert len(suspects) <= 1 or counted or named, reason


def test_ras_unresponsive_and_lagging_ranks_are_both_suspects_and_both_counted(tmp_path: Path) -> None:
    result = invoke("hang", "--ras-json", str(ras_32(tmp_path)), "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["verdict"] == "hang"
    by_rank = {s["rank"]: s for s in doc["suspects"]}
    assert sorted(by_rank) == [7, 12]
    assert by_rank[7]["why"] == "ras_troubled" and by_rank[7]["what"] == "missing and not answering RAS"
    assert by_rank[12]["why"] == "ras_lagging" and by_rank[12]["what"] == "made 41 AllReduce, the others 42"
    # RAS placed them (one communicator as large as the job numbers its ranks as the global ranks)
    assert (by_rank[12]["host"], by_rank[12]["pid"], by_rank[12]["gpu"]) == ("10.0.0.4", 3012, 0)
    assert by_rank[7]["communicator"] is None
    assert doc["reason"].startswith("NCCL RAS names 2 troubled rank(s): ")
    assert "rank 7 of communicator 0xbeef is missing and not answering RAS" in doc["reason"]
    assert "rank 12 of communicator 0xbeef made 41 AllReduce, the others 42" in doc["reason"]
    assert_one_answer(doc)
    text = invoke("hang", "--ras-json", str(ras_32(tmp_path)))
    assert text.stdout.startswith("hang: NCCL RAS names 2 troubled rank(s)")


def test_ras_ranks_no_record_maps_are_suspects_by_their_communicators_numbering(tmp_path: Path) -> None:
    """Two communicators of other processes and no record: RAS's numbering is taken as global for the
    first (an assumption the report states); the second's ranks are named with their communicator, so
    its rank 1 and the first's rank 1 are two suspects, both counted."""
    import copy

    doc = json.loads(RAS_JSON)
    other = copy.deepcopy(doc["communicators"][0])
    other["hash"] = "0x77"
    other["missing_ranks"] = []
    for r in other["ranks"]:
        r["pid"] += 100
    doc["communicators"].append(other)
    for c in doc["communicators"]:
        c["ranks"].append({**copy.deepcopy(c["ranks"][0]), "rank": 3, "pid": c["ranks"][0]["pid"] + 3})
        c["ranks"][1]["collective_counts"]["AllReduce"] = 4
    path = tmp_path / "two.json"
    path.write_text(json.dumps(doc))
    report = json.loads(invoke("hang", "--ras-json", str(path), "--json").stdout)
    assert {(s["rank"], s["communicator"], s["why"]) for s in report["suspects"]} == {
        (1, None, "ras_lagging"),
        (2, None, "ras_troubled"),
        (1, "0x77", "ras_lagging"),
    }
    assert report["reason"].startswith("NCCL RAS names 3 troubled rank(s)"), report["reason"]
    assert_one_answer(report)


def test_dumps_and_ras_together_count_every_suspect(base: Path, tmp_path: Path) -> None:
    """The dumps blame rank 2 (never entered); RAS says rank 1 is behind: the headline names the dumps'
    rank and counts both, and both are suspects."""
    doc = json.loads(RAS_JSON)
    c = doc["communicators"][0]
    c["ranks"][1]["collective_counts"]["AllReduce"] = 4  # rank 0 made 5
    path = tmp_path / "ras.json"
    path.write_text(json.dumps(doc))
    result = invoke("hang", str(real_dumps("never", base)), "--ras-json", str(path), "--json")
    out = json.loads(result.stdout)
    assert result.exit_code == 1 and out["verdict"] == "hang"
    # RAS's communicator is as large as the world: its ranks are the global ranks (rank 2: dead in RAS,
    # never entered in the dumps; one rank, two reasons)
    assert sorted((s["rank"], s["why"]) for s in out["suspects"]) == [
        (1, "ras_lagging"),
        (2, "never_entered"),
        (2, "ras_troubled"),
    ]
    assert out["reason"].startswith("rank(s) 2 never entered all_reduce")
    assert out["reason"].endswith("; 2 suspect rank(s) in all, also 1"), out["reason"]
    assert_one_answer(out)


def test_every_input_gives_one_answer(base: Path, tmp_path: Path) -> None:
    """Flight Recorder alone, RAS alone, dumps that say no hang beside a RAS report: the findings and
    the suspects name the same ranks."""
    ras = tmp_path / "ras.json"
    ras.write_text(RAS_JSON)
    for args in (
        [str(real_dumps("never", base))],
        [str(real_dumps("crash", base))],
        ["--ras-json", str(ras)],
        [str(real_dumps("ok", base)), "--ras-json", str(ras)],
    ):
        assert_one_answer(json.loads(invoke("hang", *args, "--json").stdout))


def test_ras_json_of_nccl_2_28_7_without_missing_rank_status() -> None:
    old = RAS_JSON.replace(
        ',\n          "status": {"unresponsive": true, "considered_dead": true}', ""
    ).replace('"nccl_version": "2.30.7"', '"nccl_version": "2.28.7"')
    report = parse_ras_json(old, "old.json")
    assert [(r.rank, r.trouble) for r in report.troubled] == [(2, "missing from its communicator")]


def test_ras_json_that_is_not_ras_is_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "ras.json"
    bad.write_text('{"hello": 1}')
    result = invoke("hang", "--ras-json", str(bad))
    assert result.exit_code == 2 and "not NCCL RAS JSON" in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ras_with_nothing_listening_is_one_line_and_exit_3() -> None:
    port = _free_port()
    result = invoke("hang", "--ras", env={"NCCL_RAS_ADDR": f"127.0.0.1:{port}"})
    assert result.exit_code == 3
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert lines == [lines[0]] and f"no NCCL RAS listening at 127.0.0.1:{port}" in lines[0]


@pytest.fixture
def fake_ras() -> Iterator[tuple[int, list[str]]]:
    """A RAS port speaking NCCL's client protocol (client.cc / client_support.cc), answering RAS_JSON."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    heard: list[str] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            f = conn.makefile("rb")
            for line in f:
                cmd = line.decode().strip()
                heard.append(cmd)
                if cmd.upper().startswith("CLIENT PROTOCOL"):
                    conn.sendall(b"SERVER PROTOCOL 2\n")
                elif cmd.upper().startswith("SET FORMAT"):
                    conn.sendall(b"OK\n")
                elif cmd.upper() == "STATUS":
                    conn.sendall(RAS_JSON.encode())
                    break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], heard
    thread.join(5)
    server.close()


def test_ras_asks_the_port_like_ncclras(fake_ras: tuple[int, list[str]]) -> None:
    port, heard = fake_ras
    result = invoke("hang", "--ras", "--json", env={"NCCL_RAS_ADDR": f"127.0.0.1:{port}"})
    assert heard == ["CLIENT PROTOCOL 2", "SET FORMAT json", "STATUS"]
    doc = json.loads(result.stdout)
    assert doc["ras"]["nccl_version"] == "2.30.7" and doc["ras"]["troubled"][0]["rank"] == 2
    assert result.exit_code == 1


def test_nothing_to_analyse_is_a_usage_error() -> None:
    result = invoke("hang")
    assert result.exit_code == 2 and "nothing to analyse" in result.output


def test_a_suspect_on_this_machine_gets_its_gpu_health(base: Path, tmp_path: Path) -> None:
    """The suspect ran here: this machine's GPU health (the fake NVML standing in, GPU 1 lost), read through
    the one door into health (machine.read_live_health), joins the report."""
    import socket

    from fake_nvml import FakeNvml

    here = socket.gethostname()
    fake = FakeNvml.nvlink_box(health=True)
    fake.gpus[1].lost = True
    folder = copy_dumps(real_dumps("never", base), tmp_path / "run")
    record = {
        "schema": "gputopo/run-record/v1",
        "host": here,
        "world_size": 3,
        "gpus": [{"local_rank": i, "index": i % 2, "uuid": UUIDS[i]} for i in range(3)],
        "ranks": [{"rank": i, "local_rank": i, "pid": 100 + i} for i in range(3)],
    }
    (folder / "run-record.json").write_text(json.dumps(record))
    with fake.installed():
        doc = json.loads(invoke("hang", str(folder), "--json").stdout)
    suspect = doc["groups"][0]["suspects"][0]
    assert (suspect["rank"], suspect["host"], suspect["gpu"]["index"]) == (2, here, 0)
    assert suspect["health"] == []  # rank 2 ran on GPU 0, which is fine
    record["gpus"][2]["index"] = 1  # now rank 2 ran on the lost GPU
    (folder / "run-record.json").write_text(json.dumps(record))
    with fake.installed():
        doc = json.loads(invoke("hang", str(folder), "--json").stdout)
    (health,) = doc["groups"][0]["suspects"][0]["health"]
    assert health["gpu"] == 1 and "GPU is lost" in health["what"] and health["severity"] == "problem"
    assert health["category"] == "driver" and health["where"] == f"{here} GPU1"
    assert any(f["gpu"] == 1 and "GPU is lost" in f["what"] for f in doc["findings"])


def test_html_report_draws_the_ranks_per_host(base: Path, tmp_path: Path) -> None:
    folder = copy_dumps(real_dumps("never", base), tmp_path / "run")
    _records(folder)
    page = tmp_path / "hang.html"
    result = invoke("hang", str(folder), "--html", str(page))
    assert result.exit_code == 1
    html = page.read_text()
    assert "<b>node-a</b>" in html and "<b>node-b</b>" in html
    assert "class='rank never' title='rank 2 GPU 5: never entered'>2<" in html
    assert "class='rank inside' title='rank 0 GPU 0: entered, waiting inside'>0<" in html
    bad = invoke("hang", str(folder), "--html", str(tmp_path / "no" / "such" / "dir.html"))
    assert bad.exit_code == 2 and "cannot write" in bad.output


def test_nodes_with_different_nccl_are_a_config_problem(base: Path, tmp_path: Path) -> None:
    folder = copy_dumps(real_dumps("never", base), tmp_path / "run")
    _records(folder)
    rec_b = json.loads((folder / "run-record-node-b.json").read_text())
    rec_b["versions"] = {"nccl": "2.21.5", "torch": "2.14.1"}
    (folder / "run-record-node-b.json").write_text(json.dumps(rec_b))
    doc = json.loads(invoke("hang", str(folder), "--json").stdout)
    by_where = {f["where"]: f for f in doc["findings"] if f["category"] == "config"}
    nccl = by_where["NCCL version"]
    assert nccl["severity"] == "problem" and nccl["action"] == "config"
    assert "2.27.5 on node-a (node 0); 2.21.5 on node-b (node 1)" in nccl["what"]
    # node-b's record names no NCCL variable: node-a's NCCL_DEBUG is a difference, and only a note.
    assert by_where["NCCL_DEBUG"]["severity"] == "note"
    assert "WARN on node-a (node 0); (unset) on node-b (node 1)" in by_where["NCCL_DEBUG"]["what"]


def test_ras_ranks_are_named_by_their_global_rank_and_a_lagging_rank_is_named(tmp_path: Path) -> None:
    """RAS numbers ranks per communicator: a communicator of global ranks 4 and 5 calls them 0 and 1. The
    run record's PIDs give the global ranks; rank 1 one AllReduce behind the others (RAS MISMATCH) is
    named as lagging, by its global rank."""
    comm = json.loads(RAS_JSON)
    c = comm["communicators"][0]
    c["ranks"][0]["pid"], c["ranks"][1]["pid"] = 5004, 5005
    c["ranks"][1]["collective_counts"]["AllReduce"] = 4  # the others made 5
    c["missing_ranks"] = []
    c["ranks"].append({**c["ranks"][0], "rank": 2, "pid": 5006})
    ras = tmp_path / "ras.json"
    ras.write_text(json.dumps(comm))
    record = {
        "schema": "gputopo/run-record/v1",
        "host": "node-b",
        "gpus": [{"local_rank": i, "index": i} for i in range(3)],
        "ranks": [{"rank": 4 + i, "local_rank": i, "pid": 5004 + i} for i in range(3)],
    }
    (tmp_path / "run-record-node-b.json").write_text(json.dumps(record))
    result = invoke(
        "hang", "--ras-json", str(ras), "--run-record", str(tmp_path / "run-record-node-b.json"), "--json"
    )
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["verdict"] == "hang", doc["reason"]
    (lag,) = doc["ras"]["lagging"]
    assert (lag["rank"], lag["global_rank"], lag["op"], lag["count"], lag["others"]) == (
        1,
        5,
        "AllReduce",
        4,
        5,
    )
    assert "global rank 5 (rank 1 of communicator 0x5a1e) made 4 AllReduce" in doc["reason"]
    (finding,) = [f for f in doc["findings"] if "RAS MISMATCH" in f["what"]]
    assert finding["where"].startswith("rank 5 (")


def test_the_services_validate_their_options_when_built(tmp_path: Path) -> None:
    """services.hang and services.slow without the CLI: a cross-option rule is a UsageError when Options is
    built, before anything is read or taken from a running job."""
    from gputopo.errors import UsageError
    from gputopo.services import hang, slow

    for bad in (
        lambda: hang.Options(),
        lambda: hang.Options(live=True, paths=(tmp_path / "a", tmp_path / "b")),
        lambda: slow.Options(),
    ):
        with pytest.raises(UsageError):
            bad()
    hang.Options(ras_json=tmp_path / "ras.json")  # one source is enough
    slow.Options(live=True)  # --live: the newest run folder


def test_hangs_readers_share_one_way_to_open_a_named_file(tmp_path: Path) -> None:
    """--ras-json, --nccl-log and run records open their file through hang.files.read_named: a missing
    file, a folder and a file over the cap are each one InputError naming the option and the file."""
    from gputopo.errors import InputError
    from gputopo.hang.files import read_named

    big = tmp_path / "big.json"
    big.write_bytes(b"x" * 100)
    assert read_named(big, "--ras-json big", 100, "100 B", "hint") == b"x" * 100
    cases = [(big, 99, "--ras-json big: over 99 B"), (tmp_path / "nope", 100, "--ras-json big: no such file")]
    cases.append((tmp_path, 1 << 20, "--ras-json big: is a folder"))
    for path, cap, words in cases:
        with pytest.raises(InputError) as e:
            read_named(path, "--ras-json big", cap, f"{cap} B", "hint")
        assert str(e.value.message).startswith(words), e.value.message
    result = invoke("hang", "--nccl-log", str(tmp_path / "nope.log"))
    assert result.exit_code == 2 and "--nccl-log" in result.stderr and "no such file" in result.stderr
