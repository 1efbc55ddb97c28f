"""Across the rack: the multi-node probe proves NCCL used the NVLink domain (issue 35 item 4).

The recorded logs below are node rank 0's NCCL INIT lines written from NCCL's own format strings (NVIDIA/nccl
at 5067397c2676d5aed50042fc39e5c8ee96eb0027): the ``host:pid:tid [dev] NCCL INFO`` and ``[dev] file:line
(func) NCCL WARN`` prefixes of ``src/debug.cc``; ``MNNVL busId 0x%lx fabric UUID %lx.%lx cliqueId 0x%x state
%d healthMask 0x%x`` and ``comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d``
(``src/init.cc``); ``MNNVL %d cliqueId %x cliqueSize %d cliqueRank %d nvlDomainSize %d`` and the two "is
available but not working" warnings (``src/mnnvl.cc``); ``NVLS comm %p headRank %d nHeads %d nvlsRanks %d
buffSize %zu nvlsPerRankSize %zu nvlsTotalSize %zu`` (``src/transport/nvls.cc``); ``Channel %02d/%d : %d[%d]
-> %d[%d] [send] via NET/%s/%d%s`` (``src/transport/net.cc``). Each node is a GB200 tray of 4 GPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gputopo.health import drift
from gputopo.probe.judge.mnnvl import drill_log, judge_mnnvl, nvlink_class_gbps, parse_mnnvl
from gputopo.probe.pool.multinode import nccl_net_lines
from gputopo.probe.report.nodes import add_nodes, internode_section, nodes_markdown

MIB = 1 << 20
HOST = "gb200-r01-t01"
UUID = "9a3c5e7f1b2d4f60.8e1a2b3c4d5e6f70"  # NCCL prints the 16-byte cluster UUID as two %lx
DOMAIN_A = "9a3c5e7f-1b2d-4f60-8e1a-2b3c4d5e6f70.32766"
DOMAIN_B = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0.32766"
BUS = (0x8000, 0x9000, 0x18000, 0x19000)  # a GB200 tray's four GPUs


def info(rank: int, text: str) -> str:
    return f"{HOST}:51234:{51300 + rank} [{rank}] NCCL INFO {text}"


def warn(rank: int, text: str) -> str:
    return f"{HOST}:51234:{51300 + rank} [{rank}] mnnvl.cc:86 (ncclMnnvlCheck) NCCL WARN {text}"


def fabric_lines(uuid: str = UUID, clique: int = 0x7FFE, state: int = 3) -> list[str]:
    return [
        info(r, f"MNNVL busId 0x{b:x} fabric UUID {uuid} cliqueId 0x{clique:x} state {state} healthMask 0x0")
        for r, b in enumerate(BUS)
    ]


def comm_lines(nranks: int, nnodes: int, mnnvl: int) -> list[str]:
    return [
        info(
            r,
            f"comm 0x55d{r}a000 rank {r} nRanks {nranks} nNodes {nnodes} localRanks 4 localRank {r} "
            f"MNNVL {mnnvl}",
        )  # fmt: skip
        for r in range(4)
    ]


# Two trays of one rack, MNNVL working: one clique of 8, NCCL counts it as one node, NVLS set up.
MNNVL_IN_USE = [
    *fabric_lines(),
    *(info(r, f"MNNVL 1 cliqueId 7ffe cliqueSize 8 cliqueRank {r} nvlDomainSize 8") for r in range(4)),
    *comm_lines(8, 1, 1),
    info(
        0,
        "NVLS comm 0x55d0a000 headRank 0 nHeads 1 nvlsRanks 8 buffSize 1048576 nvlsPerRankSize 201326592 "
        "nvlsTotalSize 201326592",
    ),  # fmt: skip
    info(0, "Using network IB"),  # NCCL names its network even when no channel uses it
    info(0, "Channel 00/0 : 0[0] -> 4[0] via P2P/CUMEM"),
]
# The same two trays with NCCL_MNNVL_ENABLE=0: ncclMnnvlCheck is never called, the comm spans 2 nodes and
# the channels between the trays go over the NICs.
NET_FALLBACK = [
    *fabric_lines(),
    *comm_lines(8, 2, 0),
    info(0, "Using network IB"),
    info(0, "Channel 00/0 : 0[0] -> 4[0] [send] via NET/IB/0/GDRDMA"),
    info(0, "Channel 01/0 : 4[0] -> 0[0] [receive] via NET/IB/0/GDRDMA"),
]
IMEX_CHANNEL_WARNING = [
    *fabric_lines(),
    warn(0, "MNNVL (cliqueSize 8) is available but not working on this system. Check the IMEX channel "
         "configuration (/dev/nvidia-caps-imex-channels). Set NCCL_MNNVL_ENABLE=0 to ignore this issue."),
]  # fmt: skip
IMEX_DOMAIN_WARNING = [
    *fabric_lines(),
    warn(0, "MNNVL (cliqueSize 8) is available but not working on this system. Check the IMEX configuration "
         "(nvidia-imex-ctl -N). Set NCCL_MNNVL_ENABLE=0 to ignore this issue."),
]  # fmt: skip
# Four trays in two racks: rack A (nodes 0, 1) and rack B (nodes 2, 3) both call their clique 32766
# (0x7ffe) but their cluster UUIDs differ; MNNVL inside each, the network between them.
TWO_RACKS = [
    *fabric_lines(),
    *(info(r, f"MNNVL 1 cliqueId 7ffe cliqueSize 8 cliqueRank {r} nvlDomainSize 8") for r in range(4)),
    *comm_lines(16, 2, 1),
    info(0, "Using network IB"),
    info(0, "Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA"),
]


def local(
    domains: dict[int, str | None], env: dict[str, str] | None = None, model: str = "NVIDIA GB200"
) -> dict:
    return {
        str(n): {
            "verdict": "pass",
            "sets": [],
            "findings": [],
            "net": {"ib": [], "eth": []},
            "config": {
                "gpu_model": [model],
                "nvlink_domain": {"id": d} if d else None,
                "env": dict(env or {}),
            },
        }
        for n, d in domains.items()
    }


def all_test(nodes: list[int], peak_gbs: float, kind: str = "all") -> dict:
    sizes = [MIB << k for k in range(9)]
    rows = [
        {"bytes": s, "time_us": 1.0, "algbw_gbps": 0.0, "busbw_gbps": peak_gbs * s / sizes[-1]} for s in sizes
    ]
    return {"kind": kind, "nodes": nodes, "rail": None, "wrong": 0, "rows": rows, "busbw_gbps": peak_gbs}


def run(lines: list[str], domains: dict[int, str | None], tests: list[dict], **kw) -> tuple[list, dict]:
    nnodes = len(domains)
    options = {"nnodes": nnodes, "node_rank": 0, "endpoint": "10.0.0.1:30000", "rdzv_id": "r",
               "rdzv_timeout_s": 60, "timeout_s": 60, "source": "flags"}  # fmt: skip
    ranks = [
        {"rank": n * 4 + g, "node": n, "host": f"gb200-t{n}", "local_rank": g, "gpu": g, "nic": None}
        for n in range(nnodes)
        for g in range(4)
    ]
    record = {"ranks": ranks, "tests": tests, "local": local(domains, **kw)}
    return internode_section(options, "ok", record, {}, {}, "", {"device": "cuda", "nccl_lines": lines})


def kinds(section: dict) -> list[tuple[str, list[int]]]:
    return [(f["kind"], f["nodes"]) for f in section["findings"]]


def test_the_lines_are_read_as_nccl_writes_them() -> None:
    log = parse_mnnvl(MNNVL_IN_USE)
    assert [g["bus_id"] for g in log["gpus"]] == ["8000", "9000", "18000", "19000"]
    assert log["gpus"][0] == {"bus_id": "8000", "uuid": UUID, "clique": 32766, "state": 3, "health_mask": 0}
    assert log["used"][0] == {"clique": 32766, "size": 8, "domain_size": 8}
    assert log["comms"][0] == {"nranks": 8, "nnodes": 1, "mnnvl": True} and log["nvls"] == 8
    # NCCL before nvlDomainSize was added ends the line at cliqueRank.
    assert (
        parse_mnnvl([info(0, "MNNVL 1 cliqueId 7ffe cliqueSize 4 cliqueRank 0")])["used"][0]["domain_size"]
        is None
    )
    assert parse_mnnvl(IMEX_CHANNEL_WARNING)["warnings"] == [{"what": "channels", "size": 8}]
    assert parse_mnnvl(IMEX_DOMAIN_WARNING)["warnings"] == [{"what": "domain", "size": 8}]


def test_mnnvl_in_use_passes_and_is_judged_against_nvlink_not_the_nics() -> None:
    rows, section = run(MNNVL_IN_USE, {0: DOMAIN_A, 1: DOMAIN_A}, [all_test([0, 1], 760.0)])
    assert section["findings"] == [] and [r["verdict"] for r in rows] == ["pass", "pass"]
    assert section["mnnvl"]["used"] and section["mnnvl"]["clique_size"] == 8
    doc = add_nodes({"verdict": "pass"}, rows, section)
    assert "- NVLink domain between nodes: used by NCCL (MNNVL, a clique of 8 GPUs, NVLink SHARP on)" in (
        nodes_markdown(doc)
    )
    # 200 GB/s would pass against the NICs; inside the domain it is far below GB200's 900 GB/s.
    _, section = run(MNNVL_IN_USE, {0: DOMAIN_A, 1: DOMAIN_A}, [all_test([0, 1], 200.0)])
    assert kinds(section) == [("slow", [0, 1])]
    assert "far below its class 900 GB/s (GB200 NVLink" in section["findings"][0]["detail"]
    # The class is overridable (a SKU the table lacks, or a partition with fewer NVLinks).
    _, section = run(MNNVL_IN_USE, {0: DOMAIN_A, 1: DOMAIN_A}, [all_test([0, 1], 200.0)])
    found, _, _, judged = judge_mnnvl("cuda", [all_test([0, 1], 200.0)], MNNVL_IN_USE,
                                      {0: None, 1: None}, [0, 1], "400")  # fmt: skip
    assert found == [] and judged == {0}
    assert nvlink_class_gbps(["NVIDIA GB300"]) == (900.0, "GB300 NVLink")
    assert nvlink_class_gbps(["NVIDIA H100 80GB HBM3"])[0] is None


def test_net_fallback_across_a_shared_domain_is_a_problem_with_the_imex_remedy() -> None:
    rows, section = run(NET_FALLBACK, {0: DOMAIN_A, 1: DOMAIN_A}, [all_test([0, 1], 160.0)])
    assert kinds(section) == [("mnnvl", [0, 1])] and [r["verdict"] for r in rows] == ["fail", "fail"]
    f = section["findings"][0]
    assert f["detail"].startswith(f"node 0, 1 share the NVLink domain {DOMAIN_A} but NCCL sent the traffic")
    assert "over NET/IB, not the NVLink domain (MNNVL 0)" in f["detail"]
    assert "nvidia-imex-ctl -N" in f["remedy"] and "/dev/nvidia-caps-imex-channels" in f["remedy"]
    assert "NCCL_MNNVL_ENABLE" in f["remedy"]
    # A tray whose fabric registration never completed is named as the reason.
    _, section = run([*fabric_lines(state=2), *NET_FALLBACK[4:]], {0: DOMAIN_A, 1: DOMAIN_A}, [])
    assert "GPU 8000's fabric registration is in progress" in section["findings"][0]["detail"]
    # Without NCCL's INIT lines nothing is claimed either way, and the note says why.
    _, section = run([], {0: DOMAIN_A, 1: DOMAIN_A}, [])
    assert section["findings"] == [] and any(
        "whether it used the domain is unknown" in n for n in section["notes"]
    )
    # Nodes in no domain (H100 boxes) going over IB: nothing to say about NVLink.
    _, section = run(NET_FALLBACK[4:], {0: None, 1: None}, [])
    assert section["findings"] == []


def test_nccl_mnnvl_enable_0_is_named_as_the_cause() -> None:
    _, section = run(NET_FALLBACK, {0: DOMAIN_A, 1: DOMAIN_A}, [], env={"NCCL_MNNVL_ENABLE": "0"})
    assert kinds(section) == [("mnnvl", [0, 1])]
    assert section["findings"][0]["detail"].endswith("(MNNVL 0): NCCL_MNNVL_ENABLE=0 is set")
    # NCCL skips the check just the same without P2P (ncclGetUserP2pLevel: LOC) or without cuMem.
    _, section = run(NET_FALLBACK, {0: DOMAIN_A, 1: DOMAIN_A}, [], env={"NCCL_P2P_LEVEL": "LOC"})
    assert section["findings"][0]["detail"].endswith("(MNNVL 0): NCCL_P2P_LEVEL=LOC is set")
    _, section = run(NET_FALLBACK, {0: DOMAIN_A, 1: DOMAIN_A}, [], env={"NCCL_CUMEM_ENABLE": "0"})
    assert section["findings"][0]["detail"].endswith("(MNNVL 0): NCCL_CUMEM_ENABLE=0 is set")


def test_the_imex_warnings_are_problems_even_when_the_run_crashed() -> None:
    for lines, why in (
        (IMEX_CHANNEL_WARNING, "the IMEX channel (/dev/nvidia-caps-imex-channels) is missing"),
        (IMEX_DOMAIN_WARNING, "could not be exported and imported through the IMEX daemon"),
    ):
        options = {"nnodes": 2, "node_rank": 0, "endpoint": "h:1", "rdzv_id": "r", "rdzv_timeout_s": 60,
                   "timeout_s": 60, "source": "flags"}  # fmt: skip
        message = "RuntimeError: NCCL error: unhandled system error"
        network = {"device": "cuda", "nccl_lines": lines}
        rows, section = internode_section(options, "failed", None, {"0": "a", "1": "b"}, {}, message, network)
        f = section["findings"][0]
        assert f["kind"] == "mnnvl" and f["nodes"] == [0] and rows[0]["verdict"] == "fail"
        assert (
            "NVLink domain (MNNVL, a clique of 8 GPUs) available but not working" in f["detail"]
            and why in f["detail"]
        )
        assert section["message"] == f["detail"]
        # After a run that did finish, the warning still fails the run.
        _, done = run(lines, {0: DOMAIN_A, 1: DOMAIN_A}, [])
        assert kinds(done) == [("mnnvl", [0, 1])]


def test_two_racks_two_cliques_use_nvlink_inside_and_the_network_between() -> None:
    domains = {0: DOMAIN_A, 1: DOMAIN_A, 2: DOMAIN_B, 3: DOMAIN_B}
    tests = [all_test([0, 1, 2, 3], 120.0), all_test([0, 1], 700.0, "pair"), all_test([2, 3], 150.0, "pair")]
    _, section = run(TWO_RACKS, domains, tests)
    # No MNNVL problem: the racks are two domains. Pair 2-3 (one rack) is slow against NVLink; the
    # all-nodes test crosses racks and is not judged against NVLink.
    assert kinds(section) == [("slow", [2, 3])]
    assert "pair 2-3 150.0 GB/s (17%)" in section["findings"][0]["detail"]
    assert any(n.startswith("the nodes are in 2 NVLink domains") for n in section["notes"])
    assert section["mnnvl"]["cliques"] == [32766]


def test_gloo_runs_without_nccl_lines_are_not_judged() -> None:
    found, notes, summary, judged = judge_mnnvl(
        "cpu", [all_test([0, 1], 1.0)], [], {0: None, 1: None}, [0, 1]
    )
    assert (found, notes, judged, summary["used"]) == ([], [], set(), False)


def test_the_parent_keeps_the_mnnvl_lines_and_the_drill_log_reads_as_the_warning(tmp_path: Path) -> None:
    (tmp_path / "nccl-rank0.log").write_text("\n".join([*MNNVL_IN_USE, info(0, "cudaDriverVersion 13000")]))
    lines = nccl_net_lines(tmp_path)
    assert info(0, "cudaDriverVersion 13000") not in lines
    assert parse_mnnvl(lines) == parse_mnnvl(MNNVL_IN_USE)
    drill = drill_log("node7", 4242, 1, 4)
    assert parse_mnnvl(drill)["warnings"] == [{"what": "channels", "size": 4}]
    assert parse_mnnvl(drill)["gpus"][0]["state"] == 3


def test_drift_compares_the_domain_the_rack_and_imex() -> None:
    facts = {
        "t1": {"nvlink_domain": {"id": DOMAIN_A}, "rack": "1821234567890", "imex": "daemon READY, 1 channel"},
        "t2": {
            "nvlink_domain": {"id": DOMAIN_A},
            "rack": "1821234567890",
            "imex": "daemon READY, no channel",
        },
        "t3": {"nvlink_domain": {"id": DOMAIN_B}, "rack": "1821234567999", "imex": "daemon READY, 1 channel"},
    }
    found = {d.key: d for d in drift.compare(facts)}
    assert set(found) == {"nvlink_domain", "rack", "imex"}
    assert found["nvlink_domain"].values_text() == f"{DOMAIN_A} on t1, t2; {DOMAIN_B} on t3"
    assert found["imex"].severity == "problem" and found["rack"].severity == "note"
    judged = drift.findings(drift.compare(facts))
    assert judged[0].where == "IMEX" and "nvidia-imex-ctl -N" in judged[0].remedy
    # Machines without NVLink domains or IMEX compare nothing new.
    assert drift.compare({"a": {"nvlink_domain": None, "imex": None}, "b": {}}) == []


@pytest.mark.slow
def test_the_cpu_rank_drill_fails_with_the_sentence(tmp_path: Path) -> None:
    """`probe --inject mnnvl` on two CPU-rank nodes: node 0's ranks write NCCL's log of a domain without an
    IMEX channel and stop as NCCL does; node 0's report names the cause and the remedy."""
    pytest.importorskip("torch")
    from test_multinode import probe_processes, run_nodes

    results = run_nodes(
        tmp_path, "--rdzv-timeout", "120", "--inject", "mnnvl", "--inject-node", "0", nnodes=2, start=(0, 1)
    )
    assert {r: code for r, (code, _, _) in results.items()} == {0: 1, 1: 1}
    doc = results[0][1]
    assert doc is not None and doc["verdict"] == "fail"
    first = doc["nodes"][0]["findings"][0]
    assert first["kind"] == "mnnvl"
    assert first["detail"].startswith(
        "NCCL found the NVLink domain (MNNVL, a clique of 2 GPUs) available but"
    )
    assert "/dev/nvidia-caps-imex-channels" in first["remedy"]
    assert probe_processes(tmp_path) == []


def test_each_node_reports_its_domain_rack_and_imex_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from gputopo.model import Gpu, GpuFabric
    from gputopo.system.run_facts import imex_state, nvlink_facts
    from gputopo.system.sysfs import FsView

    fabric = GpuFabric(state="completed", status=0, cluster_uuid=DOMAIN_A.split(".")[0], clique_id=32766,
                       chassis_serial="1821234567890", tray_index=3, slot=12)  # fmt: skip
    topo = SimpleNamespace(gpus=[Gpu(index=i, fabric=fabric) for i in range(4)])
    facts = nvlink_facts(topo)
    assert facts["nvlink_domain"]["id"] == DOMAIN_A and facts["rack"] == "1821234567890"
    assert nvlink_facts(SimpleNamespace(gpus=[Gpu(index=0)])) == {"nvlink_domain": None, "rack": None}
    # IMEX: no configuration and no channels folder: nothing to compare.
    etc = tmp_path / "etc"
    (etc / "nvidia-imex").mkdir(parents=True)
    fs = FsView(tmp_path / "sys", tmp_path / "proc", etc)
    channels = tmp_path / "nvidia-caps-imex-channels"
    assert imex_state(str(channels), fs) is None
    channels.mkdir()
    assert imex_state(str(channels), fs) == "not configured, no channel"
    (channels / "channel0").touch()
    # A node configuration with members, and no nvidia-imex-ctl anywhere it is looked for.
    (etc / "nvidia-imex" / "nodes_config.cfg").write_text("10.0.0.1\n10.0.0.2\n")
    monkeypatch.setattr("gputopo.system.imex.ctl_path", lambda: None)
    assert imex_state(str(channels), fs) == "nvidia-imex-ctl missing, 1 channel"


def test_inject_mnnvl_on_one_machine_is_a_usage_error() -> None:
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "gputopo", "probe", "--device", "cpu", "--gpus", "0,1", "--inject", "mnnvl"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "GPUTOPO_SLURM": "0"},
    )  # fmt: skip
    assert done.returncode == 2 and "--inject mnnvl is a drill of the inter-node tests" in done.stderr
    assert "Traceback" not in done.stderr
