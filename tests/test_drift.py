"""Configuration drift across nodes: two `gputopo probe` nodes meet at a real c10d rendezvous on
localhost (as tests/test_multinode.py starts them, one CPU rank each); node 1's environment differs (an
NCCL net plugin on its LD_LIBRARY_PATH, another NCCL_IB_HCA). Node rank 0's report shows each difference
as value -> nodes and judges it: the plugin is a problem (the run fails), the NIC list a note."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gputopo.health.drift import compare, findings

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(tmp_path: Path, env_of: dict[int, dict[str, str]]) -> dict[int, tuple[int, Any, str]]:
    port = _free_port()
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NCCL_", "TORCH_NCCL_")) and k != "LD_LIBRARY_PATH"
    }
    base["PYTHONPATH"] = SRC + os.pathsep + base.get("PYTHONPATH", "")
    procs = {}
    for r in (0, 1):
        argv = [
            sys.executable, "-m", "gputopo", "probe", "--device", "cpu", "--gpus", "0", "--mode", "allreduce",
            "--nnodes", "2", "--node-rank", str(r), "--rdzv-endpoint", f"localhost:{port}",
            "--rdzv-id", f"drift-{port}", "--timeout", "60", "--rdzv-timeout", "120",
            "--report-dir", str(tmp_path / f"node{r}"), "--json", "-b", "64K", "-e", "64K",
        ]  # fmt: skip
        procs[r] = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**base, **env_of.get(r, {})}
        )
    out = {}
    for r, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[r] = (proc.returncode, json.loads(stdout) if stdout.strip() else None, stderr)
    return out


@pytest.mark.slow
def test_a_node_with_another_net_plugin_and_nic_list_is_drift(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    plugin = plugin_dir / "libnccl-net.so"  # found, never loaded: its presence is what NCCL would dlopen
    plugin.write_bytes(b"")
    results = _two_nodes(
        tmp_path, {1: {"LD_LIBRARY_PATH": str(plugin_dir), "NCCL_IB_HCA": "=mlx5_9", "NCCL_DEBUG": "WARN"}}
    )
    code, doc, err = results[0]
    assert doc is not None, err[-3000:]
    host = socket.gethostname()
    drift = doc["internode"]["drift"]
    assert drift["nodes"] == 2
    diffs = {d["key"]: d for d in drift["differences"]}
    assert set(diffs) == {"net_plugin", "env NCCL_IB_HCA", "env NCCL_DEBUG"}, diffs
    plug = diffs["net_plugin"]
    assert plug["severity"] == "problem"
    assert {v["value"]: v["nodes"] for v in plug["values"]} == {
        "(none: NCCL's internal IB/socket transport)": [f"node 0 ({host})"],
        str(plugin): [f"node 1 ({host})"],
    }
    hca = diffs["env NCCL_IB_HCA"]
    assert hca["severity"] == "note"
    assert {v["value"]: v["nodes"] for v in hca["values"]} == {
        "(unset)": [f"node 0 ({host})"],
        "=mlx5_9": [f"node 1 ({host})"],
    }
    found = drift["findings"]
    assert [(f["where"], f["severity"], f["category"]) for f in found][0] == (
        "NCCL net plugin",
        "problem",
        "config",
    )
    assert all(f["category"] == "config" for f in found)
    # A problem fails the run; the notes name every difference for every view.
    assert doc["verdict"] == "fail" and code == 1
    assert any(
        n.startswith("configuration drift (problem): NCCL net plugin:") for n in doc["internode"]["notes"]
    )
    assert any(f["kind"] == "drift" for f in doc["internode"]["findings"])
    md = next((tmp_path / "node0").glob("*.md")).read_text()
    assert "configuration drift (note): NCCL_IB_HCA: (unset) on node 0" in md


def test_drift_groups_values_and_judges_only_count_nccl_and_plugin_as_problems() -> None:
    same = {"gpu_count": 8, "gpu_model": ["H100"], "nccl": "2.27.5", "net_plugin": None, "driver": "580.1"}
    facts = {
        "a": {**same, "env": {}},
        "b": {**same, "driver": "575.2", "env": {}},
        "c": {**same, "gpu_count": 7, "env": {}},
    }
    drifts = {d.key: d for d in compare(facts)}
    assert set(drifts) == {"gpu_count", "driver"}
    assert drifts["gpu_count"].groups == (("8", ("a", "b")), ("7", ("c",)))
    assert [f.severity for f in findings(list(drifts.values()))] == ["problem", "note"]
    # A fact no node knows is not a difference; one node alone has nothing to differ from.
    assert compare({"a": {"vbios": None}, "b": {"vbios": None}}) == []
    assert compare({"a": same}) == []
