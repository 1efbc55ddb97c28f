"""NCCL's evidence in a probe: the user's NCCL_DEBUG kept, each set's transports read from its own
communicator's lines only, and NCCL's WARN lines carried into a crashed or hung verdict.

The logs below are written from NCCL's format strings (NVIDIA/nccl): the line prefix from src/debug.cc
(``host:pid:tid [cudaDev] NCCL INFO``, and ``[timestamp] ... file:line (func) NCCL WARN`` for warnings), the
communicator lines from src/init.cc (``[Rank %d] %s comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId
%lx commId 0x%llx - Init START``, ``ncclCommSplit ... parent %p splitCount %d color %d key %d- Init START``,
``comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d``), the channel lines from
src/transport/p2p.cc and shm.cc. Pool rank 0 (GPU4) of a pool of GPUs 4-7 is in set {4,5} in step 0 and
in set {4,6} in step 1; it also runs DataParallel over {4,5}, whose communicators start and connect in
threads of their own (src/group.cc), as torch.cuda.nccl's ncclCommInitAll does.
"""

from __future__ import annotations

import pytest

from gputopo.probe.judge import environment as envmod
from gputopo.probe.judge import verdict

MAIN = "node7:4712:4712 [0] NCCL INFO"
WORLD = [
    f"{MAIN} Bootstrap: Using eth0:10.0.0.7<0>",
    f"{MAIN} [Rank 0] ncclCommInitRankConfig comm 0x5581a3c0 rank 0 nranks 4 cudaDev 0 nvmlDev 4 busId 1b000 "
    "commId 0x9e3c1f0a7b2d4e51 - Init START",
    f"{MAIN} comm 0x5581a3c0 rank 0 nRanks 4 nNodes 1 localRanks 4 localRank 0 MNNVL 0",
    f"{MAIN} ncclCommInitRankConfig comm 0x5581a3c0 rank 0 nranks 4 cudaDev 0 nvmlDev 4 busId 1b000 "
    "commId 0x9e3c1f0a7b2d4e51 - Init COMPLETE",
    # The world's first collective (all_gather_object) connects its rings at run time.
    f"{MAIN} Channel 00/0 : 0[4] -> 1[5] via P2P/CUMEM/read",
    f"{MAIN} Channel 01/0 : 0[4] -> 1[5] via P2P/CUMEM/read",
    f"{MAIN} Channel 02/0 : 0[4] -> 3[7] via P2P/CUMEM/read",
    f"{MAIN} Connected all rings, use ring PXN 0 GDR 1",
]
SET_45 = [
    f"{MAIN} ncclCommSplit comm 0x5581f000 rank 0 nranks 2 cudaDev 0 nvmlDev 4 busId 1b000 parent 0x5581a3c0 "
    "splitCount 1 color 1 key 0- Init START",
    f"{MAIN} ncclCommSplit comm 0x5581f000 rank 0 nranks 2 cudaDev 0 nvmlDev 4 busId 1b000 parent 0x5581a3c0 "
    "splitCount 1 color 1 key 0 - Init COMPLETE",
    f"{MAIN} Channel 00/0 : 0[4] -> 1[5] via P2P/CUMEM/read",
]
DATA_PARALLEL = [
    "node7:4712:4790 [0] NCCL INFO [Rank 0] ncclCommInitAll comm 0x55900000 rank 0 nranks 2 cudaDev 0 "
    "nvmlDev 4 busId 1b000 commId 0x0c1d2e3f40516273 - Init START",
    "node7:4712:4791 [1] NCCL INFO [Rank 1] ncclCommInitAll comm 0x55900800 rank 1 nranks 2 cudaDev 1 "
    "nvmlDev 5 busId 1c000 commId 0x0c1d2e3f40516273 - Init START",
    "node7:4712:4790 [0] NCCL INFO ncclCommInitAll comm 0x55900000 rank 0 nranks 2 cudaDev 0 nvmlDev 4 "
    "busId 1b000 commId 0x0c1d2e3f40516273 - Init COMPLETE",
    "node7:4712:4795 [0] NCCL INFO Channel 00/0 : 0[4] -> 1[5] via P2P/direct pointer/read",
    "node7:4712:4796 [1] NCCL INFO Channel 00/0 : 1[5] -> 0[4] via P2P/direct pointer/read",
]
AFTER_DP = [f"{MAIN} Channel 01/0 : 0[4] -> 1[5] via P2P/CUMEM/read"]  # set {4,5}'s tree, later
SET_46 = [
    f"{MAIN} [Rank 0] ncclCommInitRankConfig comm 0x55a00000 rank 0 nranks 2 cudaDev 0 nvmlDev 4 busId 1b000 "
    "commId 0x77aa12bc34de56f0 - Init START",
    f"{MAIN} ncclCommInitRankConfig comm 0x55a00000 rank 0 nranks 2 cudaDev 0 nvmlDev 4 busId 1b000 "
    "commId 0x77aa12bc34de56f0 - Init COMPLETE",
    f"{MAIN} Channel 00 : 0[4] -> 1[6] via SHM/direct/direct",
    f"{MAIN} Channel 01 : 0[4] -> 1[6] via SHM/direct/direct",
]


def _vias(connections):
    return sorted({(c["src_dev"], c["dst_dev"], c["via"], c["channel"]) for c in connections})


def test_a_sets_transports_come_from_its_own_communicator_not_the_world_or_dataparallel():
    log = envmod.parse_nccl_log(WORLD + SET_45 + DATA_PARALLEL + AFTER_DP)
    got = envmod.set_connections(log, 0, 2)
    assert _vias(got) == [(4, 5, "P2P/CUMEM/read", 0), (4, 5, "P2P/CUMEM/read", 1)]
    # Before: every Channel line of the file, the world's (0->3 included) and DataParallel's pointers.
    everything = envmod.parse_transport_lines(WORLD + SET_45 + DATA_PARALLEL + AFTER_DP)
    assert (4, 7, "P2P/CUMEM/read", 2) in _vias(everything)
    assert any(c["transport"] == "P2P/direct" for c in everything)


def test_a_later_set_reads_its_own_lines_not_an_earlier_sets():
    log = envmod.parse_nccl_log(WORLD + SET_45 + DATA_PARALLEL + AFTER_DP + SET_46)
    got = envmod.set_connections(log, 0, 2)
    assert _vias(got) == [(4, 6, "SHM/direct/direct", 0), (4, 6, "SHM/direct/direct", 1)]
    comms = list(log["comms"].values())
    assert [c["func"] for c in comms] == [
        "ncclCommInitRankConfig",
        "ncclCommSplit",
        "ncclCommInitAll",
        "ncclCommInitAll",
        "ncclCommInitRankConfig",
    ]
    assert comms[1]["parent"] == "0x5581a3c0" and comms[4]["comm_id"] == "0x77aa12bc34de56f0"


def test_the_set_of_the_whole_pool_is_not_the_world_group():
    # Same size, same place: the newer communicator is the set's.
    whole = [line.replace("nranks 2", "nranks 4") for line in SET_45]
    whole[-1] = f"{MAIN} Channel 00/0 : 0[4] -> 1[5] via P2P/IPC"
    got = envmod.set_connections(envmod.parse_nccl_log(WORLD + whole), 0, 4)
    assert _vias(got) == [(4, 5, "P2P/IPC", 0)]


def test_an_older_nccl_connecting_inside_init_and_naming_no_function():
    # NCCL 2.18: "comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %lx commId 0x%llx - Init START",
    # connections made between START and COMPLETE; DataParallel's pointer connections in its own comm.
    old = [
        "node7:4712:4712 [0] NCCL INFO comm 0x5581a3c0 rank 0 nranks 2 cudaDev 0 nvmlDev 4 busId 1b000 "
        "commId 0x9e3c1f0a7b2d4e51 - Init START",
        "node7:4712:4712 [0] NCCL INFO Channel 00/0 : 0[4] -> 1[5] via P2P/IPC/read",
        "node7:4712:4712 [0] NCCL INFO comm 0x5581a3c0 rank 0 nranks 2 cudaDev 0 nvmlDev 4 busId 1b000 "
        "commId 0x9e3c1f0a7b2d4e51 - Init COMPLETE",
        "node7:4712:4790 [0] NCCL INFO comm 0x55900000 rank 0 nranks 2 cudaDev 0 nvmlDev 4 busId 1b000 "
        "commId 0x0c1d2e3f40516273 - Init START",
        "node7:4712:4790 [0] NCCL INFO Channel 00/0 : 0[4] -> 1[5] via P2P/direct pointer",
    ]
    got = envmod.set_connections(envmod.parse_nccl_log(old), 0, 2)
    assert _vias(got) == [(4, 5, "P2P/IPC/read", 0)]


def test_a_log_without_communicator_lines_keeps_every_connection_but_dataparallels():
    lines = [
        f"{MAIN} Channel 00/0 : 0[4] -> 1[5] via P2P/CUMEM",
        f"{MAIN} Channel 00/0 : 0[4] -> 1[5] via P2P/direct pointer",
    ]
    got = envmod.set_connections(envmod.parse_nccl_log(lines), 0, 2)
    assert [c["via"] for c in got] == ["P2P/CUMEM"]


def test_transports_read_in_the_ranks_come_from_the_sets_logs_only(tmp_path):
    torch = pytest.importorskip("torch")
    from gputopo.probe.ranks import context, numerics

    (tmp_path / "nccl-rank0.log").write_text("\n".join(WORLD + SET_45 + DATA_PARALLEL + AFTER_DP + SET_46))
    rank2 = [
        line.replace("4712:4712 [0]", "4714:4714 [0]").replace("nvmlDev 4", "nvmlDev 6") for line in WORLD
    ] + [
        "node7:4714:4714 [0] NCCL INFO ncclCommInitRankConfig comm 0x56100000 rank 1 nranks 2 cudaDev 0 "
        "nvmlDev 6 busId 3d000 commId 0x77aa12bc34de56f0 - Init COMPLETE",
        "node7:4714:4714 [0] NCCL INFO Channel 00 : 1[6] -> 0[4] via SHM/direct/direct",
    ]
    (tmp_path / "nccl-rank2.log").write_text("\n".join(rank2))
    (tmp_path / "nccl-rank1.log").write_text("\n".join(SET_45))  # not in the set: never read
    ctx = context.RankContext(
        0, 2, 0, torch.device("cpu"), {"ranks": [0, 2]}, tmp_path / "job", log_dir=tmp_path
    )
    rows = numerics.nccl_transports(ctx)
    assert [(r["src"], r["dst"], r["via"], r["channels"]) for r in rows] == [
        (4, 6, "SHM/direct/direct", [0, 1]),
        (6, 4, "SHM/direct/direct", [0]),
    ]


# --- the user's NCCL_DEBUG -------------------------------------------------------------------------------


def test_a_users_nccl_debug_level_is_kept_and_info_is_added_only_when_unset(tmp_path):
    from gputopo.probe.ranks import worker

    environ = {"NCCL_DEBUG": "WARN"}
    added = worker.prepare_rank_environment(environ, "cuda", tmp_path, 3)
    assert environ["NCCL_DEBUG"] == "WARN" and "NCCL_DEBUG_SUBSYS" not in environ
    assert "NCCL_DEBUG" not in added and added["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl-rank3.log")

    environ = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": "/var/log/n.%h.%p"}
    added = worker.prepare_rank_environment(environ, "cuda", tmp_path, 0)
    assert not {"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"} & set(added)
    assert environ["NCCL_DEBUG_SUBSYS"] == "INIT,NET" and environ["NCCL_DEBUG_FILE"] == "/var/log/n.%h.%p"

    environ = {}
    added = worker.prepare_rank_environment(environ, "cuda", tmp_path, 0)
    assert added["NCCL_DEBUG"] == "INFO" and added["NCCL_DEBUG_SUBSYS"] == "INIT"  # said: set_by_probe


@pytest.mark.parametrize(
    ("name", "value", "caveat"),
    [
        ("NCCL_DEBUG", "WARN", "NCCL transports not logged: NCCL_DEBUG=WARN (your level is kept"),
        (
            "NCCL_DEBUG_SUBSYS",
            "NET,COLL",
            "NCCL transports not logged: NCCL_DEBUG_SUBSYS=NET,COLL lacks INIT",
        ),
        ("NCCL_DEBUG_FILE", "/tmp/n.%p", "NCCL log not read by the probe (transports, WARN lines)"),
    ],
)
def test_what_a_users_nccl_logging_costs_is_said(name, value, caveat):
    (got,) = envmod.environment_caveats({0: {name: value}}, "nccl")
    assert got.startswith(caveat)
    assert (
        envmod.environment_caveats({0: {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}}, "nccl") == []
    )


# --- NCCL WARN lines into the verdict ----------------------------------------------------------------------

CRASH_LOG = [
    *SET_46,
    "",
    "[2026-11-25 19:04:11] node7:4712:4799 [0] transport/net_socket.cc:552 NCCL WARN NET/Socket : peer "
    "10.0.0.8<41877> shutdown",
    "",
    "[2026-11-25 19:04:11] node7:4712:4712 [0] misc/socket.cc:49 (ncclSocketRecv) NCCL WARN socketProgress: "
    "Connection closed by remote peer node8<41877>",
    "[2026-11-25 19:04:11] node7:4712:4712 [0] misc/socket.cc:49 (ncclSocketRecv) NCCL WARN socketProgress: "
    "Connection closed by remote peer node8<41877>",
]


def test_nccl_warn_lines_are_read_without_their_prefix_and_once_each():
    assert envmod.nccl_warnings(CRASH_LOG) == [
        "NET/Socket : peer 10.0.0.8<41877> shutdown",
        "socketProgress: Connection closed by remote peer node8<41877>",
    ]
    assert envmod.nccl_warnings(SET_46) == []


def test_a_crash_and_a_hang_carry_nccls_warn_lines(tmp_path):
    from gputopo.probe.pool.pool import set_nccl_warnings

    (tmp_path / "nccl-rank2.log").write_text("\n".join(CRASH_LOG))
    (tmp_path / "nccl-rank0.log").write_text("\n".join(SET_46))
    warnings = set_nccl_warnings(tmp_path, (0, 2))  # pool ranks of the set; rank 1 of the set is pool 2
    assert warnings == (
        "rank 1: NET/Socket : peer 10.0.0.8<41877> shutdown",
        "rank 1: socketProgress: Connection closed by remote peer node8<41877>",
    )
    crash = verdict.crashed(
        "allreduce", 1, 1, None, "Traceback ...\nDistBackendError: NCCL error", None, warnings
    )
    assert crash.detail == (
        "rank 1 exited with exit code 1; NCCL WARN rank 1: socketProgress: Connection closed by remote peer "
        "node8<41877>"
    )
    assert crash.metrics["nccl_warnings"] == list(warnings)
    hang = verdict.hung("allreduce", 30.0, {}, 0.0, warnings)
    assert hang.kind == "hung" and "NCCL WARN rank 1: socketProgress" in hang.detail
    assert verdict.crashed("ddp", 0, 1, None, "", "boom").metrics["nccl_warnings"] == []
