"""Probes across nodes, simulated on this machine: several `gputopo probe` processes, one per "node", meet
at one c10d rendezvous on localhost through torch's real elastic agent, with one CPU rank each (gloo).

What the issue asks of a multi-node run, end to end: four healthy nodes pass and node rank 0's report
lists all four; a planted straggler, a corrupting node and a hung node are each named, and every node
exits 1; a node that never starts ends the run on the others after --rdzv-timeout, saying how many
joined, with no process left behind.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from own_procs import marked_env, wait_for_none_left

pytest.importorskip("torch")

pytestmark = pytest.mark.slow

NNODES = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_nodes(
    tmp_path: Path,
    *extra: str,
    start: tuple[int, ...] = tuple(range(NNODES)),
    timeout_s: float = 60,
    nnodes: int = NNODES,
) -> dict[int, tuple[int, dict[str, Any] | None, str]]:
    """Start one `gputopo probe --json` per node in ``start``; wait for all; (exit code, doc, stderr)."""
    port = free_port()
    procs = {}
    env = {**marked_env(_marker(tmp_path)), "GPUTOPO_DEBUG": "0"}
    for r in start:
        argv = [
            sys.executable, "-m", "gputopo", "probe", "--device", "cpu", "--gpus", "0", "--mode", "allreduce",
            "--nnodes", str(nnodes), "--node-rank", str(r), "--rdzv-endpoint", f"localhost:{port}",
            "--rdzv-id", f"test-{port}", "--timeout", str(timeout_s),
            "--report-dir", str(tmp_path / f"node{r}"), "--json", "-b", "64K", "-e", "256K", *extra,
        ]  # fmt: skip
        procs[r] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    out = {}
    for r, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[r] = (proc.returncode, json.loads(stdout) if stdout.strip() else None, stderr)
    return out


def _marker(tmp_path: Path) -> str:
    # One marker per test (its tmp_path is its own), inherited by every node's launcher and ranks.
    return f"multinode:{tmp_path}"


def probe_processes(tmp_path: Path) -> list[str]:
    """What is left of the nodes this test started (never another run on the machine: issue 23 item 7)."""
    return wait_for_none_left(_marker(tmp_path))


def test_four_healthy_nodes_pass_and_node_0_reports_all_of_them(tmp_path: Path) -> None:
    results = run_nodes(tmp_path, "--rdzv-timeout", "120")
    for r, (code, doc, err) in results.items():
        assert code == 0, f"node {r}: {err}"
        assert doc is not None and doc["verdict"] == "pass"
    doc = results[0][1]
    assert doc is not None
    assert [n["node_rank"] for n in doc["nodes"]] == [0, 1, 2, 3]
    assert all(n["verdict"] == "pass" and n["findings"] == [] for n in doc["nodes"])
    tests = doc["internode"]["tests"]
    assert [t["kind"] for t in tests] == ["all", "pair", "pair"]
    assert all(t["wrong"] == 0 and t["busbw_gbps"] > 0 for t in tests)
    # One report, on node rank 0, with a section per node; the other nodes print and write nothing.
    written = json.loads(Path(doc["report"]["json"]).read_text())
    assert [n["node_rank"] for n in written["nodes"]] == [0, 1, 2, 3]
    markdown = Path(doc["report"]["markdown"]).read_text()
    assert all(f"### Node {r} " in markdown for r in range(NNODES))
    assert "Between nodes" in Path(doc["report"]["html"]).read_text()
    assert not any(
        (tmp_path / f"node{r}").exists() and any((tmp_path / f"node{r}").iterdir()) for r in (1, 2, 3)
    )
    assert probe_processes(tmp_path) == []


def findings_of(doc: dict[str, Any] | None) -> list[tuple[str, list[int]]]:
    assert doc is not None
    return [(f["kind"], f["nodes"]) for n in doc["nodes"] for f in n["findings"]]


def test_a_slow_node_is_named_the_straggler_and_every_node_exits_1(tmp_path: Path) -> None:
    results = run_nodes(tmp_path, "--rdzv-timeout", "120", "--inject", "slow", "--inject-node", "2")
    assert {r: code for r, (code, _, _) in results.items()} == {0: 1, 1: 1, 2: 1, 3: 1}
    doc = results[0][1]
    assert findings_of(doc) == [("straggler", [2])]
    assert doc is not None and [n["verdict"] for n in doc["nodes"]] == ["pass", "pass", "fail", "pass"]


def test_a_corrupting_node_is_bisected_down_to_it(tmp_path: Path) -> None:
    results = run_nodes(tmp_path, "--rdzv-timeout", "120", "--inject", "corrupt", "--inject-node", "1")
    assert {r: code for r, (code, _, _) in results.items()} == {0: 1, 1: 1, 2: 1, 3: 1}
    doc = results[0][1]
    assert findings_of(doc) == [("corrupt", [1])]
    assert doc is not None
    assert [t["kind"] for t in doc["internode"]["tests"]].count("bisect") == 2


def test_a_node_that_never_starts_ends_the_run_after_the_rendezvous_timeout(tmp_path: Path) -> None:
    results = run_nodes(tmp_path, "--rdzv-timeout", "10", start=(0, 1, 3))
    for r, (code, doc, err) in results.items():
        assert code == 1, f"node {r}: {err}"
        assert "3 of 4 nodes joined (node rank 0, 1, 3); never came: node rank 2" in err
        assert doc is not None and doc["internode"]["status"] == "rendezvous"
    doc = results[0][1]
    assert doc is not None and [n["verdict"] for n in doc["nodes"]][2] == "fail"
    assert probe_processes(tmp_path) == []


def test_a_hung_node_is_named_from_the_rendezvous_store(tmp_path: Path) -> None:
    results = run_nodes(
        tmp_path, "--rdzv-timeout", "120", "--inject", "hang", "--inject-node", "2", timeout_s=8
    )
    assert {r: code for r, (code, _, _) in results.items()} == {0: 1, 1: 1, 2: 1, 3: 1}
    doc = results[0][1]
    assert findings_of(doc) == [("hung", [2])]
    assert "node rank 0's report names the node" in results[3][2]
    assert probe_processes(tmp_path) == []


def run_doctors(tmp_path: Path, *extra: str) -> dict[int, tuple[int, dict[str, Any] | None, str]]:
    """`gputopo doctor --json` on two simulated two-GPU nodes (their own probes skipped)."""
    port = free_port()
    procs = {}
    for r in (0, 1):
        argv = [
            sys.executable, "-m", "gputopo", "doctor", "--input", "sample:workstation-2gpu-nvlink",
            "--skip-probe",
            "--nnodes", "2", "--node-rank", str(r), "--rdzv-endpoint", f"localhost:{port}",
            "--rdzv-timeout", "120", "--report-dir", str(tmp_path / f"node{r}"), "--json", *extra,
        ]  # fmt: skip
        procs[r] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for r, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[r] = (proc.returncode, json.loads(stdout) if stdout.strip() else None, stderr)
    return out


def test_doctor_across_two_nodes_tests_every_rail_and_reports_once(tmp_path: Path) -> None:
    results = run_doctors(tmp_path)
    for r, (code, doc, err) in results.items():
        assert code == 0, f"node {r}: {err}"
        assert doc is not None and doc["verdict"] == "healthy"
    doc = results[0][1]
    assert doc is not None
    assert [(n["node_rank"], n["gpus"], n["verdict"]) for n in doc["nodes"]] == [
        (0, [0, 1], "pass"),
        (1, [0, 1], "pass"),
    ]
    # Two GPUs per node: GPU k of every node is a rail of its own.
    assert [(t["kind"], t["rail"]) for t in doc["internode"]["tests"]] == [
        ("all", None),
        ("rail", 0),
        ("rail", 1),
    ]
    assert "## Nodes" in Path(doc["report"]["markdown"]).read_text()
    assert results[1][1] is not None and results[1][1]["report"] is None


def test_doctor_across_nodes_fails_every_node_on_corrupt_sums(tmp_path: Path) -> None:
    results = run_doctors(tmp_path, "--inject", "corrupt")
    assert {r: code for r, (code, _, _) in results.items()} == {0: 1, 1: 1}
    doc = results[0][1]
    assert doc is not None and doc["verdict"] == "problems"
    # Two nodes and no third to compare with: both are named, and the report says why it cannot tell.
    assert findings_of(doc) == [("corrupt", [0, 1]), ("corrupt", [0, 1])]
    assert "no node seen healthy" in doc["nodes"][0]["findings"][0]["detail"]


def test_a_crashed_node_is_named_by_node_rank_0(tmp_path: Path) -> None:
    results = run_nodes(
        tmp_path,
        "--rdzv-timeout",
        "120",
        "--inject",
        "crash",
        "--inject-node",
        "1",
        start=(2, 1, 0),
        nnodes=3,
    )
    assert {r: code for r, (code, _, _) in results.items()} == {0: 1, 1: 1, 2: 1}
    assert findings_of(results[0][1]) == [("crashed", [1])]
    assert "injected crash" in results[1][2]
    assert probe_processes(tmp_path) == []
