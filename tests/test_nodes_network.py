"""Across nodes: the transport NCCL used and the bandwidth against the NICs' line rate (issue 22 item 2).

The log fixtures follow NCCL's own format strings (NVIDIA/nccl): the ``host:pid:tid [dev] NCCL INFO``
prefix of ``src/debug.cc``; ``Using network %s`` (``src/init.cc``); ``NET/IB : Using ...; OOB ...`` and
``NET/IB : No device found.`` (``src/transport/net_ib``); ``NET/Socket : Using [0]IF:ADDR<0>``
(``src/transport/net_socket.cc``); ``Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s%s`` and
its proxy form ``NET/%s/%d(%d)`` (``src/transport/net.cc``, ``sendSetup``/``recvSetup``).
"""

from __future__ import annotations

from pathlib import Path

from gputopo.probe.judge.network import (
    judge_network,
    line_rate,
    parse_ib_rate,
    parse_nccl_net,
    transport_name,
)
from gputopo.probe.pool.multinode import nccl_net_lines
from gputopo.probe.report.nodes import add_nodes, internode_section, nodes_markdown
from gputopo.system.net import read_nics

MIB = 1 << 20

# Node 0 of two DGX H100s (8 GPUs, 8 NDR rails each), ranks 0-7 here and 8-15 on node 1.
DGX_IB_LOG = [
    "dgx-a01:48121:48190 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. "
    "Using internal network plugin.",
    "dgx-a01:48121:48190 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB [2]mlx5_4:1/IB "
    "[3]mlx5_5:1/IB [4]mlx5_6:1/IB [5]mlx5_9:1/IB [6]mlx5_10:1/IB [7]mlx5_11:1/IB [RO]; "
    "OOB ibp12s0:10.10.1.1<0>",
    "dgx-a01:48121:48190 [0] NCCL INFO Using network IB",
    "dgx-a01:48121:48190 [0] NCCL INFO Channel 00/16 : 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    *(
        f"dgx-a01:48121:4819{r} [{r}] NCCL INFO Channel {c:02d}/0 : {r + 8}[{r}] -> {r}[{r}] [receive] "
        f"via NET/IB/{r}/GDRDMA"
        for r in range(8)
        for c in (0, 8)
    ),
    *(
        f"dgx-a01:48121:4819{r} [{r}] NCCL INFO Channel {c:02d}/0 : {r}[{r}] -> {r + 8}[{r}] [send] "
        f"via NET/IB/{r}/GDRDMA"
        for r in range(8)
        for c in (0, 8)
    ),
    "dgx-a01:48121:48193 [3] NCCL INFO Channel 03/0 : 3[3] -> 11[3] [send] via NET/IB/3(11)/GDRDMA",
    "dgx-a01:48121:48190 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
]

# Node 0 of a two-node cluster whose container lacks libibverbs: NCCL finds no IB device and falls back
# to TCP on the management network, although both nodes have an active HDR port.
SOCKET_FALLBACK_LOG = [
    "node01:2201:2240 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. "
    "Using internal network plugin.",
    "node01:2201:2240 [0] NCCL INFO NET/IB : No device found.",
    "node01:2201:2240 [0] NCCL INFO NET/Socket : Using [0]eno1:192.168.10.11<0>",
    "node01:2201:2240 [0] NCCL INFO Using network Socket",
    "node01:2201:2240 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0",
    "node01:2201:2240 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0",
    "node01:2201:2240 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[0] [send] via NET/Socket/0",
]


def dgx_nics(rate: str = "400 Gb/sec (4X NDR)") -> dict:
    """What ``read_nics`` answers on a DGX H100: eight NDR ports, a 100 GbE management port."""
    names = ("mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11")
    ib = [
        {"device": n, "port": "1", "rate": rate, "state": "4: ACTIVE", "link_layer": "InfiniBand"}
        for n in names
    ]
    return {"ib": ib, "eth": [{"name": "enp170s0f0", "speed": "100000", "operstate": "up"}]}


def hdr_node() -> dict:
    return {
        "ib": [
            {
                "device": "mlx5_0",
                "port": "1",
                "rate": "200 Gb/sec (4X HDR)",
                "state": "4: ACTIVE",
                "link_layer": "InfiniBand",
            },
        ],  # fmt: skip
        "eth": [{"name": "eno1", "speed": "1000", "operstate": "up"}],
    }


def all_test(nodes: list[int], peak_gbs: float, top_bytes: int = 256 * MIB) -> dict:
    """An all-reduce test over whole nodes whose sweep peaks at ``peak_gbs`` bus bandwidth."""
    sizes = [MIB << k for k in range(9) if MIB << k <= top_bytes]
    rows = [
        {"bytes": s, "time_us": 1.0, "algbw_gbps": 0.0, "busbw_gbps": peak_gbs * s / sizes[-1]} for s in sizes
    ]
    return {"kind": "all", "nodes": nodes, "rail": None, "wrong": 0, "rows": rows, "busbw_gbps": peak_gbs}


def test_nccls_network_lines_are_read_as_nccl_writes_them() -> None:
    nccl = parse_nccl_net(DGX_IB_LOG)
    assert nccl["network"] == "IB" and transport_name(nccl) == "NET/IB"
    assert nccl["devices"][0] == "mlx5_0:1" and nccl["devices"][7] == "mlx5_11:1"
    assert nccl["used"] == list(range(8)) and nccl["gdr"] is True
    assert nccl["via"] == {"IB": 33}  # the P2P line inside the node is not a network
    assert nccl["plugin"].startswith("NET/Plugin: Could not find")
    sock = parse_nccl_net(SOCKET_FALLBACK_LOG)
    assert transport_name(sock) == "NET/Socket" and sock["ib_missing"] and sock["socket_ifs"] == ["eno1"]
    assert parse_ib_rate("400 Gb/sec (4X NDR)") == 400.0 and parse_ib_rate("2.5 Gb/sec (1X SDR)") == 2.5
    assert parse_ib_rate(None) is None and parse_ib_rate("garbage") is None


def test_the_line_rate_is_the_nics_nccl_used_times_the_rails() -> None:
    rate = line_rate(parse_nccl_net(DGX_IB_LOG), dgx_nics())
    assert rate is not None and rate["rails"] == 8 and rate["gbit"] == 3200 and rate["gbs"] == 400
    # Sockets: the interface NCCL named, at its Ethernet speed (sysfs: Mb/s).
    rate = line_rate(parse_nccl_net(SOCKET_FALLBACK_LOG), hdr_node())
    assert rate is not None and rate["gbit"] == 1.0 and rate["nics"] == ["eno1 1 Gb/s"]
    # A link whose speed sysfs cannot give (-1: down, or a virtual NIC) leaves the rate unknown.
    assert line_rate(parse_nccl_net(SOCKET_FALLBACK_LOG), {"eth": [{"name": "eno1", "speed": "-1"}]}) is None


def test_sockets_between_nodes_with_active_infiniband_is_a_problem_even_on_two_nodes() -> None:
    found, _, summary = judge_network(
        "cuda", [all_test([0, 1], 0.11)], SOCKET_FALLBACK_LOG, {0: hdr_node(), 1: hdr_node()}, [0, 1]
    )
    # The 1 GbE link itself is full (0.11 of 0.125 GB/s): the transport is what is wrong, not the link.
    assert [f["kind"] for f in found] == ["transport"]
    transport = found[0]
    assert transport["nodes"] == [0, 1]
    assert "TCP sockets (NET/Socket on eno1)" in transport["detail"]
    assert (
        "active InfiniBand/RoCE ports (mlx5_0:1 IB 200 Gb/s): NCCL found no IB device" in transport["detail"]
    )
    assert "libibverbs" in transport["remedy"]
    assert summary["transport"] == "NET/Socket" and summary["judged"] is True


def test_a_two_node_ib_run_is_judged_against_the_line_rate() -> None:
    nets = {0: dgx_nics(), 1: dgx_nics()}
    found, notes, summary = judge_network("cuda", [all_test([0, 1], 365.0)], DGX_IB_LOG, nets, [0, 1])
    assert found == [] and summary["line_rate_gbs"] == 400.0 and summary["rails"] == 8
    found, _, _ = judge_network("cuda", [all_test([0, 1], 48.0)], DGX_IB_LOG, nets, [0, 1])
    assert [f["kind"] for f in found] == ["slow"] and found[0]["nodes"] == [0, 1]
    assert "far below the line rate 400.0 GB/s" in found[0]["detail"]
    assert "8 rails on node 0; NET/IB): all nodes 48.0 GB/s (12%)" in found[0]["detail"]


def test_small_messages_gloo_and_silent_logs_are_not_judged_and_say_so() -> None:
    nets = {0: dgx_nics(), 1: dgx_nics()}
    found, notes, _ = judge_network(
        "cuda", [all_test([0, 1], 5.0, top_bytes=4 * MIB)], DGX_IB_LOG, nets, [0, 1]
    )
    assert found == [] and any(n.startswith("no inter-node test reached 64 MiB") for n in notes)
    found, notes, summary = judge_network("cpu", [all_test([0, 1], 0.1)], None, nets, [0, 1])
    assert found == [] and notes == [
        "transport and line rate between nodes: not judged (gloo: CPU ranks, not NCCL)"
    ]
    assert summary == {"transport": "gloo", "judged": False}
    found, notes, _ = judge_network("cuda", [all_test([0, 1], 0.1)], [], nets, [0, 1])
    assert found == [] and "NCCL logged no network between nodes" in notes[0]


def test_a_socket_fallback_fails_the_run_and_every_node_in_the_document() -> None:
    options = {"nnodes": 2, "node_rank": 0, "endpoint": "10.0.0.1:30000", "rdzv_id": "r",
               "rdzv_timeout_s": 60, "timeout_s": 60, "source": "flags"}  # fmt: skip
    ranks = [
        {"rank": r, "node": r, "host": f"node0{r + 1}", "local_rank": 0, "gpu": 0, "nic": "mlx5_0"}
        for r in (0, 1)
    ]
    local = {str(n): {"verdict": "pass", "sets": [], "findings": [], "net": hdr_node()} for n in (0, 1)}
    record = {"ranks": ranks, "tests": [all_test([0, 1], 0.11)], "local": local}
    network = {"device": "cuda", "nccl_lines": SOCKET_FALLBACK_LOG}
    rows, section = internode_section(options, "ok", record, {}, {}, "", network)
    assert [r["verdict"] for r in rows] == ["fail", "fail"]
    assert section["network"]["transport"] == "NET/Socket"
    doc = add_nodes({"verdict": "pass"}, rows, section)
    assert doc["verdict"] == "fail"
    assert "- network between nodes: NET/Socket, line rate 0.1 GB/s (1 rails)" in nodes_markdown(doc)
    # The same run over gloo passes, with the note.
    rows, section = internode_section(options, "ok", record, {}, {}, "", {"device": "cpu", "nccl_lines": []})
    assert [r["verdict"] for r in rows] == ["pass", "pass"]
    assert "not judged (gloo" in section["notes"][-1]


def test_the_parent_keeps_only_the_network_lines_of_its_ranks_logs(tmp_path: Path) -> None:
    (tmp_path / "nccl-rank0.log").write_text("\n".join([*DGX_IB_LOG, "x NCCL INFO cudaDriverVersion 13000"]))
    (tmp_path / "nccl-rank1.log").write_text("\n".join(SOCKET_FALLBACK_LOG))
    lines = nccl_net_lines(tmp_path)
    assert "x NCCL INFO cudaDriverVersion 13000" not in lines
    assert (
        "dgx-a01:48121:48190 [0] NCCL INFO Using network IB" in lines
        and len(lines) == len(DGX_IB_LOG) - 2 + 7
    )


def test_read_nics_reads_sysfs_as_the_kernel_lays_it_out(tmp_path: Path) -> None:
    port = tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")  # RoCE
    eno = tmp_path / "class" / "net" / "eno1"
    eno.mkdir(parents=True)
    (eno / "device").mkdir()
    (eno / "speed").write_text("25000\n")
    (eno / "operstate").write_text("up\n")
    (tmp_path / "class" / "net" / "lo").mkdir()  # no device: not a NIC
    nics = read_nics(tmp_path)
    assert nics["ib"] == [
        {
            "device": "mlx5_0",
            "port": "1",
            "rate": "200 Gb/sec (4X HDR)",
            "state": "4: ACTIVE",
            "link_layer": "Ethernet",
        }
    ]
    assert nics["eth"] == [{"name": "eno1", "speed": "25000", "operstate": "up"}]
    assert read_nics(tmp_path / "nothing") == {"ib": [], "eth": []}
