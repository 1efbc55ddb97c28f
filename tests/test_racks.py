"""``gputopo nodes``: NVLink racks from many nodes' facts (``topo --json``), fit trays, segments, the
``--nodelist`` line, Slurm's block topology, and the audit of what Slurm believes.

The racks are GB200/GB300 NVL72s: 18 trays of 4 GPUs each, one NVLink domain per rack named
``<clusterUuid>.<cliqueId>``; GB300 racks all report the clique 32766, so only the cluster UUID tells two
racks apart (torchcomms #3704).
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import invoke
from gputopo.findings import Finding
from gputopo.launch.slurm import expand_hostlist
from gputopo.launch.slurm_blocks import audit_blocks, audit_job, parse_blocks, parse_show_job
from gputopo.topology import domains as dom

GB300_CLIQUE = 32766
RACK_UUIDS = ("3c2b9a10-55e1-4f0e-9a7d-0d1c2b3a4f50", "a1f00d2e-7b3c-4c5d-8e9f-102030405060")
FABRIC_PROBLEM = {
    "where": "GPU2",
    "gpu": 2,
    "category": "nvlink",
    "what": "fabric health ROUTE_UNHEALTHY (mask 0x19a)",
    "remedy": "drain the tray; check the NVLink switch trays",
    "severity": "problem",
    "action": "drain",
    "rule": None,
}


def facts_doc(
    node: str,
    rack: int | None,
    tray: int = 0,
    check: dict[str, Any] | None = None,
    clique: int = GB300_CLIQUE,
) -> dict[str, Any]:
    """A tray's ``topo --json`` as gputopo writes it, with the ``nvlink_domain`` of issue "Racks, not
    boxes" (``None`` for a node in no domain)."""
    domain = None
    if rack is not None:
        uuid = RACK_UUIDS[rack]
        domain = {
            "id": f"{uuid}.{clique}",
            "cluster_uuid": uuid,
            "clique_id": clique,
            "chassis_serial": f"1821425{rack:06d}",
            "tray_index": tray,
            "slot": tray + 1,
        }
    return {
        "schema": "gputopo/topology/v1",
        "source": "nvml",
        "live": True,
        "gpus": [{"index": i, "name": "NVIDIA GB300", "uuid": f"GPU-{node}-{i}"} for i in range(4)],
        "nics": [],
        "matrix": {"labels": [], "cells": []},
        "warnings": [],
        "node": node,
        "check": check,
        "nvlink_domain": domain,
    }


def two_racks(
    folder: Path, unfit_tray: int | None = 6, unknown: tuple[str, ...] = ("login1", "cpu-01")
) -> Path:
    """Two GB300 racks of 18 trays (rack0-01.., rack1-01..), one tray of rack 1 with a fresh fabric
    problem, and nodes in no NVLink domain."""
    folder.mkdir(exist_ok=True)
    now = time.time()
    for rack in range(2):
        for tray in range(18):
            node = f"rack{rack}-{tray + 1:02d}"
            check = {"verdict": "healthy", "at": now, "problems": []}
            if rack == 1 and tray == unfit_tray:
                check = {"verdict": "problems", "at": now, "problems": [FABRIC_PROBLEM]}
            (folder / f"{node}.json").write_text(json.dumps(facts_doc(node, rack, tray, check)))
    for node in unknown:
        (folder / f"{node}.json").write_text(json.dumps(facts_doc(node, None)))
    return folder


def nodes_json(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    result = invoke("nodes", *args, "--json", env=env)
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else {}


# --- node facts: what `topo --json` carries -----------------------------------------------------------


def test_topo_json_carries_the_node_name_and_the_last_fresh_check(tmp_path):
    from fake_nvml import FakeNvml
    from gputopo.health.state import CheckState, dumps, remember_judgement

    state = tmp_path / "state.json"
    sick = Finding(where="GPU1", gpu=1, what="fabric UNHEALTHY", remedy="drain", category="nvlink")
    judged = remember_judgement(CheckState("rack1-07"), time.time() - 60, "problems", [sick], None)
    state.write_text(dumps(judged))
    env = {"SLURMD_NODENAME": "rack1-07", "GPUTOPO_CHECK_STATE": str(state)}
    with FakeNvml.nvlink_box().installed():
        fresh = json.loads(invoke("topo", "--json", env=env).stdout)
        state.write_text(
            dumps(remember_judgement(CheckState("rack1-07"), time.time() - 3600, "problems", [sick], None))
        )
        stale = json.loads(invoke("topo", "--json", env=env).stdout)
    assert fresh["node"] == "rack1-07"
    assert (
        fresh["check"]["verdict"] == "problems"
        and fresh["check"]["problems"][0]["what"] == "fabric UNHEALTHY"
    )
    assert time.time() - fresh["check"]["at"] == pytest.approx(60, abs=30)
    # An hour-old check is not fresh (15 min): the node counts as fit, unchecked.
    assert stale["node"] == "rack1-07" and stale["check"] is None
    # The facts read back: a saved snapshot is the node's facts.
    saved = tmp_path / "facts.json"
    saved.write_text(json.dumps(fresh))
    again = json.loads(invoke("topo", "--input", str(saved), "--json").stdout)
    assert again["node"] == "rack1-07" and again["check"] == fresh["check"]
    facts = dom.facts_from_doc(fresh, "facts.json")
    assert facts.why_unfit == "GPU1: fabric UNHEALTHY"


# --- domains, fit, segments -------------------------------------------------------------------------------


def test_two_racks_two_domains_right_members_unfit_named_unknown_apart(tmp_path):
    code, doc = nodes_json(str(two_racks(tmp_path / "facts")), "--segment", "8")
    assert code == 0
    assert doc["schema"] == "gputopo/nodes/v1"
    # Both racks report clique 32766: kept apart by their cluster UUIDs.
    ids = [d["id"] for d in doc["domains"]]
    assert ids == sorted(f"{u}.{GB300_CLIQUE}" for u in RACK_UUIDS)
    by_rack = {d["nodes"][0].split("-")[0]: d for d in doc["domains"]}
    assert by_rack["rack0"]["nodes"] == [f"rack0-{t:02d}" for t in range(1, 19)]
    assert by_rack["rack1"]["nodes"] == [f"rack1-{t:02d}" for t in range(1, 19)]
    assert len(by_rack["rack0"]["fit"]) == 18 and by_rack["rack0"]["unfit"] == []
    # The tray with a fabric problem is left out, and named with why.
    assert by_rack["rack1"]["unfit"] == [
        {"node": "rack1-07", "why": "GPU2: fabric health ROUTE_UNHEALTHY (mask 0x19a)"}
    ]
    assert "rack1-07" not in by_rack["rack1"]["fit"] and len(by_rack["rack1"]["fit"]) == 17
    # 18 fit: two segments of 8; 17 fit: still two (not three), none holding the unfit tray.
    assert len(by_rack["rack0"]["segments"]) == 2 and len(by_rack["rack1"]["segments"]) == 2
    assert all(len(s) == 8 for d in doc["domains"] for s in d["segments"])
    assert all("rack1-07" not in s for s in by_rack["rack1"]["segments"])
    # Nodes in no domain are listed apart, never mixed into a segment.
    assert doc["unknown_domain"] == ["cpu-01", "login1"]
    segment_nodes = {n for d in doc["domains"] for s in d["segments"] for n in s}
    assert not segment_nodes & {"cpu-01", "login1"}


def test_text_view_names_the_unfit_tray_and_the_unknown_nodes(tmp_path):
    result = invoke("nodes", str(two_racks(tmp_path / "facts")), "--segment", "8", columns=200)
    assert result.exit_code == 0, result.output
    assert "2 NVLink domains, 36 nodes, 35 fit" in result.stdout
    assert "unfit  rack1-07" in result.stdout and "ROUTE_UNHEALTHY" in result.stdout
    assert "NVLink domain unknown (never mixed into a domain's segments): cpu-01,login1" in result.stdout


def test_same_clique_and_uuid_is_one_domain_other_uuid_another():
    a = dom.facts_from_doc(facts_doc("a", 0), "a")
    b = dom.facts_from_doc(facts_doc("b", 0, 1), "b")
    c = dom.facts_from_doc(facts_doc("c", 1), "c")
    p = dom.plan([a, b, c])
    assert [d.nodes for d in p.domains] == [("a", "b"), ("c",)]


def test_a_check_with_problems_but_none_listed_and_an_unknown_verdict_are_unfit():
    doc = facts_doc("x", 0, check={"verdict": "unknown", "at": 1.0, "problems": []})
    assert dom.facts_from_doc(doc, "x").why_unfit == "gputopo check: unknown"
    doc = facts_doc("y", 0, check={"verdict": "healthy", "at": 1.0, "problems": []})
    assert dom.facts_from_doc(doc, "y").why_unfit is None


def test_nodes_n_segment_s_picks_whole_segments_and_prints_the_nodelist(tmp_path):
    folder = two_racks(tmp_path / "facts")
    result = invoke("nodes", str(folder), "--nodes", "16", "--segment", "8")
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert line.startswith("--nodelist=")
    chosen = expand_hostlist(line.removeprefix("--nodelist="))
    # One rack holds both segments: the job stays inside one NVLink domain.
    assert len(chosen) == 16 and len({n.split("-")[0] for n in chosen}) == 1
    code, doc = nodes_json(str(folder), "--nodes", "32", "--segment", "8")
    assert code == 0
    chosen = expand_hostlist(doc["nodelist"].removeprefix("--nodelist="))
    assert len(chosen) == 32 and "rack1-07" not in chosen
    assert all(len({n.split("-")[0] for n in p["nodes"]}) == 1 for p in doc["picked"])


def test_nodes_that_cannot_be_met_exit_1_and_say_what_is_missing(tmp_path):
    result = invoke("nodes", str(two_racks(tmp_path / "facts")), "--nodes", "40", "--segment", "8")
    assert result.exit_code == 1
    assert "needs 5 segments of 8 fit nodes; the domains hold 4" in result.stderr
    assert "1 missing" in result.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--nodes", "10", "--segment", "8"], "is not whole segments"),
        (["--segment", "0"], "not a positive number"),
        (["--nodelist", "x[1-2]"], "--nodelist gathers over Slurm"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(tmp_path, args, words):
    result = invoke("nodes", str(two_racks(tmp_path / "facts")), *args)
    assert result.exit_code == 2 and words in result.stderr
    assert "Traceback" not in result.output


def test_the_service_validates_its_options_once_and_builds_the_whole_document(tmp_path):
    """services.nodes without the CLI: a cross-option rule is a UsageError when Options is built, and
    the report's document() holds the pick (or what it misses) and the exit code says so."""
    from gputopo.errors import UsageError
    from gputopo.services import nodes

    folder = two_racks(tmp_path / "facts")
    for bad in ({"facts": (folder,), "slurm": True}, {}, {"facts": (folder,), "nodes": 10, "segment": 8}):
        with pytest.raises(UsageError):
            nodes.Options(**bad)
    warned: list[str] = []
    met = nodes.run(nodes.Options(facts=(folder,), nodes=16, segment=8), nodes.Hooks(warn=warned.append))
    doc = met.document()
    assert met.exit_code == 0 and doc["nodelist"].startswith("--nodelist=") and len(doc["picked"]) == 2
    assert "missing" not in doc and "findings" not in doc and "block_topology" not in doc
    short = nodes.run(nodes.Options(facts=(folder,), nodes=40, segment=8))
    assert short.exit_code == 1 and short.document()["nodelist"] is None
    assert short.failure is not None and "1 missing" in short.failure.message
    assert warned == []


def test_bad_facts_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "junk.json").write_text("{not json")
    assert "not JSON" in invoke("nodes", str(tmp_path / "junk.json")).stderr
    (tmp_path / "other.json").write_text(json.dumps({"schema": "gputopo/check/v1"}))
    result = invoke("nodes", str(tmp_path / "other.json"))
    assert result.exit_code == 2 and "not a `gputopo topo --json` document" in result.stderr
    nameless = facts_doc("n", 0)
    nameless["node"] = None
    (tmp_path / "nameless.json").write_text(json.dumps(nameless))
    assert "names no node" in invoke("nodes", str(tmp_path / "nameless.json")).stderr
    (tmp_path / "a.json").write_text(json.dumps(facts_doc("same", 0)))
    (tmp_path / "b.json").write_text(json.dumps(facts_doc("same", 0)))
    result = invoke("nodes", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert result.exit_code == 2 and "comes twice" in result.stderr
    assert invoke("nodes").exit_code == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no .json facts files" in invoke("nodes", str(empty)).stderr


# --- Slurm's hostlist and block topology -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "expr"),
    [
        ([f"gpu-{i:02d}" for i in range(1, 9)], "gpu-[01-08]"),
        (["gpu-08", "gpu-09", "gpu-10", "gpu-12"], "gpu-[08-10,12]"),
        (["n9", "n10", "n11"], "n[9-11]"),
        (["node5"], "node5"),
        (["login", "b1", "a2", "a1", "a3"], "a[1-3],b1,login"),
        (["x07", "x8"], "x[07,8]"),
    ],
)
def test_hostlists_are_written_as_slurm_writes_them_and_read_back(names, expr):
    assert dom.compress_hostlist(names) == expr
    assert sorted(expand_hostlist(expr)) == sorted(names)


# topology.conf(5) as Slurm documents it for topology/block: "Parameter names are case insensitive", "#"
# starts a comment to the end of the line, one BlockName=NAME Nodes=HOSTLIST per block, BlockSizes a
# comma list whose first value is the base block size and every other a power-of-two multiple of it;
# SchedMD/slurm block_record.c: a block with fewer nodes than the base block is fatal, a name repeated too.
def _parse_topology_conf(text: str) -> tuple[dict[str, list[str]], list[int]]:
    blocks: dict[str, list[str]] = {}
    sizes: list[int] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        pairs = dict((k.lower(), v) for k, v in (item.split("=", 1) for item in line.split()))
        if "blockname" in pairs:
            assert pairs["blockname"] not in blocks and re.fullmatch(r"[A-Za-z][\w-]*", pairs["blockname"])
            blocks[pairs["blockname"]] = _expand(pairs["nodes"])
        else:
            assert set(pairs) == {"blocksizes"}
            sizes = [int(s) for s in pairs["blocksizes"].split(",")]
    base = sizes[0]
    assert all(s % base == 0 and (s // base) & (s // base - 1) == 0 for s in sizes)
    assert all(len(nodes) >= base for nodes in blocks.values())
    return blocks, sizes


def _expand(expr: str) -> list[str]:
    out = []
    for prefix, body, bare in re.findall(r"([^,\[]*)\[([^\]]*)\]|([^,\[\]]+)", expr):
        if bare:
            out.append(bare)
            continue
        for part in body.split(","):
            lo, _, hi = part.partition("-")
            out.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1))
    return out


def test_block_topology_parses_as_topology_conf_with_every_member(tmp_path):
    result = invoke("nodes", str(two_racks(tmp_path / "facts")), "--slurm-topology")
    assert result.exit_code == 0, result.output
    blocks, sizes = _parse_topology_conf(result.stdout)
    assert sorted(blocks.values()) == [[f"rack{r}-{t:02d}" for t in range(1, 19)] for r in range(2)]
    # All members, fit or not: Slurm's own drain keeps rack1-07 idle.
    assert sizes == [18, 36]
    assert "login1" not in str(blocks)
    # gputopo's own audit reads it back without a finding.
    parsed, _ = parse_blocks(result.stdout, "printed")
    p = dom.plan(_facts(tmp_path / "facts"))
    assert audit_blocks(p, parsed) == []


def test_block_sizes_start_at_the_smallest_domain():
    facts = [dom.facts_from_doc(facts_doc(f"a{i}", 0, i), "x") for i in range(18)]
    facts += [dom.facts_from_doc(facts_doc(f"b{i}", 1, i), "x") for i in range(9)]
    assert dom.block_sizes(dom.plan(facts)) == [9, 18]


# --- the audit: what Slurm believes ----------------------------------------------------------------------


def _facts(folder: Path) -> list[dom.NodeFacts]:
    return [dom.facts_from_doc(json.loads(p.read_text()), p.name) for p in sorted(folder.glob("*.json"))]


SHOW_TOPOLOGY_MIXED = """\
BlockName=b1 BlockIndex=0 Nodes=rack0-[01-17] BlockSize=17
BlockName=b2 BlockIndex=1 Nodes=rack0-18,rack1-[01-16] BlockSize=17
BlockName=b3 BlockIndex=2 Nodes=rack1-[17-18] BlockSize=17
AggregatedBlock=b[1-2] BlockIndex=3 Nodes=rack0-[01-18],rack1-[01-16] BlockSize=34
"""


def test_audit_flags_a_block_mixing_two_racks_and_split_domains(tmp_path):
    p = dom.plan(_facts(two_racks(tmp_path / "facts")))
    blocks, _ = parse_blocks(SHOW_TOPOLOGY_MIXED, "scontrol show topology")
    assert [b.name for b in blocks] == ["b1", "b2", "b3"]  # the aggregated block is not audited
    found = audit_blocks(p, blocks)
    mixed = [f for f in found if f.where == "Slurm block b2"]
    assert len(mixed) == 1 and mixed[0].severity == "problem" and "mixes 2 NVLink domains" in mixed[0].what
    split = [f for f in found if "split across" in f.what]
    assert len(split) == 2 and all(f.severity == "problem" and f.action == "config" for f in split)


def fake_scontrol(tmp_path: Path, job_text: str, topology_text: str = "") -> dict[str, str]:
    """An ``scontrol`` on PATH that answers ``show job`` with ``job_text`` and ``show topology`` with
    ``topology_text`` (exit 1 when that is empty, as without a topology plugin)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "job.txt").write_text(job_text)
    (bin_dir / "topology.txt").write_text(topology_text)
    script = bin_dir / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        f'[ "$1 $2" = "show job" ] && exec cat {bin_dir / "job.txt"}\n'
        f'[ "$1 $2" = "show topology" ] && [ -s {bin_dir}/topology.txt ] && exec cat {bin_dir}/topology.txt\n'
        "exit 1\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def three_blocks_of_17(folder: Path) -> tuple[Path, Path]:
    """SchedMD/slurm #225's cluster: three racks of 17 (worker-rack0-[0-16]...), blocks matching them."""
    folder.mkdir()
    uuids = (*RACK_UUIDS, "77777777-8888-4999-aaaa-bbbbbbbbbbbb")
    for r, uuid in enumerate(uuids):
        for t in range(17):
            doc = facts_doc(f"worker-rack{r}-{t}", 0, t)
            doc["nvlink_domain"]["id"] = f"{uuid}.{GB300_CLIQUE}"
            doc["nvlink_domain"]["cluster_uuid"] = uuid
            (folder / f"worker-rack{r}-{t}.json").write_text(json.dumps(doc))
    conf = folder.parent / "topology.conf"
    conf.write_text(
        "# three NVL racks\n"
        + "".join(f"BlockName=rack{r} Nodes=worker-rack{r}-[0-16]\n" for r in range(3))
        + "BlockSizes=17\n"
    )
    return folder, conf


JOB_17_17_2 = (
    "JobId=4242 JobName=train UserId=u(1000) JobState=RUNNING Reason=None NumNodes=36\n"
    "   NodeList=worker-rack0-[0-16],worker-rack1-[0-16],worker-rack2-[0-1] BatchHost=worker-rack0-0\n"
)
JOB_12_12_12 = JOB_17_17_2.replace(
    "worker-rack0-[0-16],worker-rack1-[0-16],worker-rack2-[0-1]",
    "worker-rack0-[0-11],worker-rack1-[0-11],worker-rack2-[0-11]",
)


def test_audit_flags_the_17_17_2_job_and_a_clean_layout_has_no_finding(tmp_path):
    folder, conf = three_blocks_of_17(tmp_path / "facts")
    env = fake_scontrol(tmp_path, JOB_17_17_2)
    code, doc = nodes_json(str(folder), "--audit", str(conf), "--job", "4242", "--segment", "12", env=env)
    assert code == 1
    assert [f["where"] for f in doc["findings"]] == ["Slurm job 4242", "Slurm job 4242"]
    assert all(f["severity"] == "problem" for f in doc["findings"])
    assert "split 17+17+2 across Slurm blocks" in doc["findings"][1]["what"]
    assert "SchedMD/slurm #225" in doc["findings"][0]["remedy"]
    # The blocks themselves are right; the job placed as asked (12+12+12) is clean.
    env = fake_scontrol(tmp_path, JOB_12_12_12)
    code, doc = nodes_json(str(folder), "--audit", str(conf), "--job", "4242", "--segment", "12", env=env)
    assert (code, doc["findings"]) == (0, [])
    result = invoke("nodes", str(folder), "--audit", str(conf), env=env)
    assert result.exit_code == 0 and "no finding" in result.stdout


def test_audit_asks_scontrol_show_topology(tmp_path):
    env = fake_scontrol(tmp_path, JOB_12_12_12, SHOW_TOPOLOGY_MIXED)
    code, doc = nodes_json(str(two_racks(tmp_path / "facts")), "--audit", "scontrol", env=env)
    assert code == 1 and any(f["where"] == "Slurm block b2" for f in doc["findings"])
    env = fake_scontrol(tmp_path, JOB_12_12_12, "")
    result = invoke("nodes", str(tmp_path / "facts"), "--audit", "scontrol", env=env)
    assert result.exit_code == 2 and "`scontrol show topology` failed" in result.stderr


def test_job_without_a_segment_across_domains_is_a_note():
    facts = [dom.facts_from_doc(facts_doc(f"a{i}", i // 2, i), "x") for i in range(4)]
    job = parse_show_job("JobState=RUNNING NodeList=a[0-3]", "7")
    found = audit_job(dom.plan(facts), None, job, None)
    assert [(f.severity, f.what.split(" (")[0]) for f in found] == [("note", "job 7")]
    assert "split 2+2" in found[0].what


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("SwitchName=s0 Nodes=a[1-4]\n", "topology/tree"),
        ("BlockName=b1\n", "has no Nodes="),
        ("BlockName=b1 Nodes=a[1-4]\nBlockName=b1 Nodes=a[5-8]\n", "defined twice"),
        ("# nothing\n", "no BlockName="),
        ("BlockName=b1 Nodes=a[1-\n", "bad Slurm hostlist"),
    ],
)
def test_an_unreadable_slurm_view_is_one_line_exit_2(tmp_path, text, words):
    conf = tmp_path / "topology.conf"
    conf.write_text(text)
    result = invoke("nodes", str(two_racks(tmp_path / "facts")), "--audit", str(conf))
    assert result.exit_code == 2 and words in result.stderr, result.output


# --- gathering over Slurm -------------------------------------------------------------------------------


def test_slurm_outside_an_allocation_asks_for_one():
    env = {"SLURM_JOB_NODELIST": "", "SLURM_NODELIST": ""}
    result = invoke("nodes", "--slurm", env=env)
    assert result.exit_code == 2 and "no allocation" in result.stderr


def test_gathering_names_the_nodes_that_did_not_answer(tmp_path):
    """A recording ``srun`` on PATH: node1 and node2 answer with their facts (labelled lines), node3
    prints nothing; the command still answers, naming node3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lines = []
    for task, node in enumerate(("node1", "node2")):
        text = json.dumps(facts_doc(node, 0, task), indent=1)
        lines += [f"{task}: {line}" for line in text.splitlines()]
    (bin_dir / "out.txt").write_text("\n".join(lines) + "\n")
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" > {bin_dir / "args"}\ncat {bin_dir / "out.txt"}\n')
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    code, doc = nodes_json("--slurm", "--nodelist", "node[1-3]", env=env)
    assert code == 0
    assert doc["domains"][0]["nodes"] == ["node1", "node2"]
    assert doc["unanswered"] == [{"node": "node3", "why": "no facts came back"}]
    args = (bin_dir / "args").read_text()
    assert "--nodes=3 --nodelist=node[1-3] --ntasks-per-node=1 --label" in args and "topo --json" in args


# --- on the real 3-node Slurm (scripts/slurm-local) ------------------------------------------------------


@pytest.mark.slurm
def test_slurm_gathers_each_nodes_own_facts_on_a_real_cluster(slurm_cluster, tmp_path):
    """``gputopo nodes --slurm`` over node1..node3: srun starts one ``topo --json`` per node (on the fake
    driver), each names itself by Slurm's name (all three share this host's hostname), none is missing."""
    import fake_driver

    lib = fake_driver.build(tmp_path / "lib")
    machine = tmp_path / "tray.txt"
    machine.write_text(
        "driver 570.133.20\ncuda 12080\n"
        + "".join(f"gpu {i} {fake_driver.bus(i)} {fake_driver.uuid(i)} {i} NVIDIA GB200\n" for i in range(4))
    )
    env = slurm_cluster.env(**{**fake_driver.env_for(lib, machine), "SLURM_CONF": str(slurm_cluster.conf)})
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    done = slurm_cluster.run(
        sys.executable, "-m", "gputopo", "nodes", "--slurm", "--nodelist", "node[1-3]", "--budget", "120",
        "--json", env=env, timeout_s=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["unanswered"] == [] and doc["domains"] == []
    # Not in an NVLink domain (a board without a fabric): each node listed apart, by its own name.
    assert doc["unknown_domain"] == ["node1", "node2", "node3"]


def test_gathering_stops_at_the_budget_and_keeps_what_came_back(tmp_path):
    """An srun whose third task hangs: after --budget the step is stopped (SIGINT, then SIGKILL), the two
    answers are kept and node3 is named with why, well within the budget plus srun's grace."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    lines = []
    for task, node in enumerate(("node1", "node2")):
        lines += [f"{task}: {line}" for line in json.dumps(facts_doc(node, 0, task)).splitlines()]
    (bin_dir / "out.txt").write_text("\n".join(lines) + "\n")
    # exec: the sleep is srun itself, as a hung step would be; it ignores nothing, so SIGINT ends it.
    (bin_dir / "srun").write_text(f"#!/bin/sh\ncat {bin_dir / 'out.txt'}\nexec sleep 60\n")
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    start = time.monotonic()
    code, doc = nodes_json("--slurm", "--nodelist", "node[1-3]", "--budget", "1", env=env)
    assert time.monotonic() - start < 30
    assert code == 0 and doc["domains"][0]["nodes"] == ["node1", "node2"]
    assert doc["unanswered"] == [{"node": "node3", "why": "srun ran past the budget (1 s) and was stopped"}]


def test_gathering_where_no_node_answers_is_exit_1_naming_why(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\necho 'srun: error: Unable to allocate resources' >&2\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = invoke("nodes", "--slurm", "--nodelist", "gpu-[1-2]", env=env)
    assert result.exit_code == 1
    assert (
        "no node answered (2 asked: srun exited 1: srun: error: Unable to allocate resources)"
        in result.stderr
    )


def test_the_budget_default_is_written_once():
    from gputopo.cli.nodes import DEFAULT_BUDGET_S
    from gputopo.services import nodes

    assert DEFAULT_BUDGET_S == nodes.DEFAULT_BUDGET_S


def test_a_failed_nodes_n_prints_nothing_on_stdout_so_the_sbatch_line_fails_plainly(tmp_path):
    # Issue 42, as a new user tried it: 3 unfit trays, `--segment 4 --nodes 32` (7 segments of 4 fit).
    # docs/nodes.md's `sbatch $(gputopo nodes facts/ --nodes N --segment S) job.sh` must not hand the
    # table to sbatch as its arguments: on failure stdout stays empty, the table and the reason on stderr.
    folder = two_racks(tmp_path / "facts")
    for node, rack, tray in (("rack1-10", 1, 9), ("rack1-13", 1, 12)):  # with rack1-07: 15 fit in rack 1
        doc = facts_doc(
            node, rack, tray, {"verdict": "problems", "at": time.time(), "problems": [FABRIC_PROBLEM]}
        )
        (folder / f"{node}.json").write_text(json.dumps(doc))
    result = invoke("nodes", str(folder), "--nodes", "32", "--segment", "4")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "needs 8 segments of 4 fit nodes; the domains hold 7" in result.stderr
    assert "rack1-07" in result.stderr  # the table, with the unfit trays and why, for the person
    # Through a real shell, as the docs write it: the command substitution is empty and fails.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    line = f'"{sys.executable}" -m gputopo nodes "{folder}" --nodes 32 --segment 4'
    script = f'args=$({line}) || echo "failed:$args:"'
    import subprocess

    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout == "failed::\n", done.stdout
    # The JSON document still goes to stdout (a tool reads it), with what is missing.
    code, doc = nodes_json(str(folder), "--nodes", "32", "--segment", "4")
    assert code == 1 and doc["nodelist"] is None and "the domains hold 7" in doc["missing"]
