"""What the ranks' environment did to the test: recorded variables, the caveats they put on a verdict, and
which NCCL transport each connection used (pure: strings and dicts in, strings and dicts out).

A probe run under ``NCCL_P2P_DISABLE=1`` (the tool's own interim remedy for broken P2P) passes dp, ddp
and all-reduce without touching the P2P path; the verdict has to say so, or the next probe reads as a
clean bill of health. The variables are captured in every rank, since the ranks are what NCCL reads.

NCCL tells which transport it picked per connection only through its debug log: with ``NCCL_DEBUG=INFO``
and ``NCCL_DEBUG_SUBSYS=INIT`` each rank writes, per channel, lines such as (format strings from
NVIDIA/nccl ``src/transport/p2p.cc``, ``shm.cc`` and ``net.cc``)::

    host:pid:tid [0] NCCL INFO Channel 00/0 : 0[5] -> 1[6] via P2P/CUMEM/read      (2.19+, cuMem on)
    host:pid:tid [0] NCCL INFO Channel 00/0 : 0[5] -> 1[6] via P2P/IPC             (legacy CUDA IPC)
    host:pid:tid [0] NCCL INFO Channel 00/0 : 0[5] -> 1[6] via P2P/direct pointer  (same process)
    host:pid:tid [1] NCCL INFO Channel 00 : 1[6] -> 0[5] via SHM/direct/direct
    host:pid:tid [1] NCCL INFO Channel 00/0 : 1[6] -> 0[5] [send] via NET/Socket/0

where ``r[d]`` is the rank in the communicator and, since NCCL 2.19, the NVML device index (nvidia-smi's
numbering); older releases print the PCI bus id in hex there instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# The families of variables recorded from every rank.
RECORDED_PREFIXES = ("NCCL_", "CUDA_")

# Variables the probe itself sets in the ranks (where the user set none) to capture NCCL's transport
# choice; recorded apart from the user's, so the report never mistakes them for the user's settings.
CAPTURE_VARIABLES = ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE")

_OFF = {"0", "false", "no", "off", ""}


def recorded_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """Every ``NCCL_*`` and ``CUDA_*`` variable in ``environ``, sorted by name."""
    return {k: environ[k] for k in sorted(environ) if k.startswith(RECORDED_PREFIXES)}


def _on(value: str) -> bool:
    return value.strip().lower() not in _OFF


def variable_caveats(name: str, value: str) -> list[str]:
    """What setting ``name=value`` takes out of the test, in words (empty when it changes nothing tested).

    The names and meanings are NCCL's (docs.nvidia.com/deeplearning/nccl, "Environment Variables").
    """
    shown = f"{name}={value}"
    if name == "NCCL_P2P_DISABLE" and _on(value):
        return [f"P2P path not tested: {shown}"]
    if name == "NCCL_P2P_LEVEL":
        if value.strip().upper() in ("LOC", "0"):
            return [f"P2P path not tested: {shown}"]
        return [f"P2P used only up to path type {value.strip()}: {shown}"]
    if name == "NCCL_SHM_DISABLE" and _on(value):
        return [f"SHM path not tested: {shown}"]
    if name == "NCCL_ALGO":
        return [f"all-reduce algorithm forced: {shown}"]
    if name == "NCCL_PROTO":
        return [f"NCCL protocol forced: {shown}"]
    if name == "NCCL_NVLS_ENABLE" and not _on(value):
        return [f"NVLink SHARP (NVLS) not tested: {shown}"]
    if name == "NCCL_CUMEM_ENABLE" and not _on(value):
        return [f"P2P through legacy CUDA IPC instead of cuMem: {shown}"]
    if name == "NCCL_P2P_USE_CUDA_MEMCPY" and _on(value):
        return [f"P2P through copy engines instead of kernels: {shown}"]
    if name in ("NCCL_MAX_NCHANNELS", "NCCL_MAX_CTAS", "NCCL_MIN_NCHANNELS"):
        return [f"NCCL channel count constrained, bandwidth may differ: {shown}"]
    # The probe keeps a user's NCCL logging (worker.prepare_rank_environment): say what that costs.
    if name == "NCCL_DEBUG" and value.strip().upper() not in ("INFO", "TRACE"):
        return [f"NCCL transports not logged: {shown} (your level is kept; INFO names them)"]
    if name == "NCCL_DEBUG_SUBSYS" and not {"INIT", "ALL"} & set(value.upper().split(",")):
        return [f"NCCL transports not logged: {shown} lacks INIT"]
    if name == "NCCL_DEBUG_FILE":
        return [f"NCCL log not read by the probe (transports, WARN lines): {shown} is yours and kept"]
    if name == "CUDA_LAUNCH_BLOCKING" and _on(value):
        return [f"timings serialised by {shown}"]
    return []


def environment_caveats(rank_variables: Mapping[int, Mapping[str, str]], backend: str) -> list[str]:
    """Caveats for a run whose ranks got ``rank_variables`` (rank -> recorded variables).

    NCCL variables change nothing between gloo CPU ranks, so they add caveats only on ``nccl``. A setting
    that only some ranks got is named with those ranks.
    """
    if not rank_variables:
        return []
    ranks = sorted(rank_variables)
    seen: dict[tuple[str, str], list[int]] = {}
    for rank in ranks:
        for name, value in rank_variables[rank].items():
            seen.setdefault((name, value), []).append(rank)
    out: list[str] = []
    for (name, value), who in sorted(seen.items()):
        if name.startswith("NCCL_") and backend != "nccl":
            continue
        for text in variable_caveats(name, value):
            if len(who) < len(ranks):
                text += f" (rank {','.join(map(str, who))} only)"
            if text not in out:
                out.append(text)
    return out


# --- NCCL's transport lines ---------------------------------------------------------------------------

_CHANNEL_RE = re.compile(
    r"NCCL INFO Channel (?P<channel>\d+)(?:/(?P<conn>\d+))? : "
    r"(?P<src_rank>\d+)\[(?P<src_dev>[0-9a-fA-Fx]+)\] -> (?P<dst_rank>\d+)\[(?P<dst_dev>[0-9a-fA-Fx]+)\]"
    r"(?: \[(?P<side>send|receive)\])? via (?P<via>.+?)\s*$"
)


def transport_kind(via: str) -> str:
    """NCCL's ``via`` text reduced to the transport: ``P2P/IPC``, ``P2P/CUMEM``, ``P2P/direct``,
    ``P2P/MNNVL``, ``SHM`` or ``NET`` (anything else is returned as its first word)."""
    parts = via.split("/")
    head = parts[0]
    if head == "P2P" and len(parts) > 1:
        second = parts[1].split()[0]  # "direct pointer" -> "direct"
        return f"P2P/{second}"
    if head in ("SHM", "NET"):
        return head
    return via.split()[0] if via.split() else via


def _device(text: str) -> int | str:
    # NCCL 2.19+ prints the NVML index (decimal); older releases the bus id in hex (e.g. 1b000).
    return int(text) if text.isdigit() and len(text) <= 3 else text


def parse_transport_lines(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Every channel connection NCCL logged, in order: channel, ranks, devices, transport and NCCL's text."""
    out = []
    for line in lines:
        m = _CHANNEL_RE.search(line)
        if m is None:
            continue
        out.append(
            {
                "channel": int(m["channel"]),
                "src_rank": int(m["src_rank"]),
                "dst_rank": int(m["dst_rank"]),
                "src_dev": _device(m["src_dev"]),
                "dst_dev": _device(m["dst_dev"]),
                "side": m["side"],
                "transport": transport_kind(m["via"]),
                "via": m["via"],
            }
        )
    return out


# --- which communicator a line belongs to ----------------------------------------------------------------
#
# A rank's log holds every communicator it made: the world group's, each set's it was in, DataParallel's
# (``ncclCommInitAll`` in rank 0). Channel lines do not name their communicator; the lines around them do.
# NVIDIA/nccl src/debug.cc prefixes every line with ``host:pid:tid [cudaDev]``; src/init.cc logs each
# communicator's start and end as (2.23+; 2.19-2.22 print the function name without ``[Rank r]``, older
# releases neither)::
#
#     node7:4712:4712 [0] NCCL INFO [Rank 0] ncclCommInitRankConfig comm 0x55d0c8a0 rank 0 nranks 2
#         cudaDev 0 nvmlDev 5 busId 1b000 commId 0x7f3a94e1c2d3b4a5 - Init START
#     node7:4712:4712 [0] NCCL INFO ncclCommSplit comm 0x55d0d1f0 rank 0 nranks 2 cudaDev 0 nvmlDev 5
#         busId 1b000 parent 0x55d0c8a0 splitCount 1 color 1 key 0- Init START
#
# and other lines name ``comm 0x...`` too (e.g. init.cc's ``comm %p rank %d nRanks %d nNodes ...``).
# Connections are made by the thread that called NCCL: inside init, or since 2.22 (NCCL_RUNTIME_CONNECT,
# src/group.cc: a group of one communicator runs its connect job in the calling thread) at the
# communicator's first collective of each algorithm. A channel line therefore belongs to the last
# communicator its own thread named. DataParallel's communicators start and connect in threads of
# their own (a group of several jobs, src/group.cc ``asyncJobLaunch``), so their lines never join a set's.

_PREFIX_RE = re.compile(r"(?P<host>[^\s:\[\]]+):(?P<pid>\d+):(?P<tid>\d+) \[\d+\] NCCL ")
_INIT_RE = re.compile(
    r"(?:(?P<func>nccl\w+) )?comm (?P<comm>0x[0-9a-fA-F]+) rank (?P<rank>\d+) nranks (?P<nranks>\d+) "
    r"cudaDev \d+(?: nvmlDev (?P<dev>\d+))? busId [0-9a-fA-F]+(?P<rest>.*?)- ?Init (?P<stage>START|COMPLETE)"
)
_COMM_RE = re.compile(r"\bcomm (0x[0-9a-fA-F]+)\b")
_WARN_RE = re.compile(r"NCCL WARN (?P<text>.*\S)")
DATA_PARALLEL_INIT = "ncclCommInitAll"  # torch.cuda.nccl's communicators (DataParallel)


def parse_nccl_log(lines: Iterable[str]) -> dict[str, Any]:
    """One rank's NCCL log: its communicators (``comms``, in order of appearance, keyed ``0x..#k``: a
    destroyed communicator's address may come back for a new one) and its channel connections, each with
    the ``comm`` it belongs to (``None`` where no line of its thread named one)."""
    comms: dict[str, dict[str, Any]] = {}
    latest: dict[str, str] = {}  # address -> the key of the newest communicator there
    current: dict[str, str] = {}  # pid:tid -> the communicator that thread named last
    connections = []
    for line in lines:
        prefix = _PREFIX_RE.search(line)
        thread = f"{prefix['pid']}:{prefix['tid']}" if prefix else ""
        init = _INIT_RE.search(line)
        if init is not None:
            address = init["comm"]
            key = latest.get(address)
            if key is None or (init["stage"] == "START" and comms[key]["complete"]):
                key = latest[address] = f"{address}#{len(comms)}"
                comm_id = re.search(r"commId (0x[0-9a-fA-F]+)", init["rest"])
                parent = re.search(r"parent (0x[0-9a-fA-F]+)", init["rest"])
                comms[key] = {
                    "func": init["func"],
                    "rank": int(init["rank"]),
                    "nranks": int(init["nranks"]),
                    "nvml_dev": int(init["dev"]) if init["dev"] is not None else None,
                    "comm_id": comm_id[1] if comm_id else None,
                    "parent": parent[1] if parent else None,
                    "complete": False,
                }
            comms[key]["complete"] = comms[key]["complete"] or init["stage"] == "COMPLETE"
            current[thread] = key
            continue
        named = _COMM_RE.search(line)
        if named is not None and named[1] in latest:
            current[thread] = latest[named[1]]
            continue
        for conn in parse_transport_lines([line]):
            connections.append({**conn, "comm": current.get(thread)})
    return {"comms": comms, "connections": connections}


def set_connections(log: dict[str, Any], rank_in_set: int, set_size: int) -> list[dict[str, Any]]:
    """The connections of a set's communicator in one rank's parsed log (``parse_nccl_log``).

    The set's communicator is the newest one with the set's size and this rank's place in it that is
    not DataParallel's (made by ``ncclCommInitAll``, or, where an older NCCL names no function, one that
    connected by ``P2P/direct pointer``, which only ranks in one process do). Newest, because the world
    group (same size when the set is the whole pool) and earlier sets came before it. A log without any
    communicator line (``NCCL_DEBUG_SUBSYS`` without INIT) falls back to every connection that is not
    DataParallel's pointer one.
    """
    comms, connections = log["comms"], log["connections"]
    if not comms:
        return [c for c in connections if c["transport"] != "P2P/direct"]
    direct = {c["comm"] for c in connections if c["transport"] == "P2P/direct"}
    mine = [
        key
        for key, c in comms.items()
        if c["nranks"] == set_size
        and c["rank"] == rank_in_set
        and c["func"] != DATA_PARALLEL_INIT
        and key not in direct
    ]
    return [c for c in connections if mine and c["comm"] == mine[-1]]


def nccl_warnings(lines: Iterable[str], most: int = 5) -> list[str]:
    """NCCL's ``WARN`` lines (the root cause NCCL states before a rank fails), the last ``most`` distinct
    ones in order, without the host:pid:tid prefix (src/debug.cc writes ``... [dev] file:line NCCL WARN
    text``)."""
    seen: list[str] = []
    for line in lines:
        m = _WARN_RE.search(line)
        if m is not None and m["text"] not in seen:
            seen.append(m["text"])
    return seen[-most:]


def summarize_transports(connections: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (source, destination, NCCL's ``via``): the transport and on how many channels."""
    rows: dict[tuple[Any, Any, str], dict[str, Any]] = {}
    for c in connections:
        key = (c["src_dev"], c["dst_dev"], c["via"])
        row = rows.setdefault(
            key,
            {
                "src": c["src_dev"],
                "dst": c["dst_dev"],
                "transport": c["transport"],
                "via": c["via"],
                "channels": [],
            },
        )
        if c["channel"] not in row["channels"]:
            row["channels"].append(c["channel"])
    return sorted(rows.values(), key=lambda r: (str(r["src"]), str(r["dst"]), r["via"]))


def transport_counts(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """How many connections (source, destination pairs) each transport carried."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["transport"]] = counts.get(r["transport"], 0) + 1
    return dict(sorted(counts.items()))


def describe_transports(rows: list[Mapping[str, Any]]) -> str:
    """``GPU5->GPU6 P2P/CUMEM/read (24 channels); ...`` for the verdict and the reports."""
    if not rows:
        return "no connection logged"

    def dev(d: Any) -> str:
        return f"GPU{d}" if isinstance(d, int) else str(d)

    return "; ".join(
        f"{dev(r['src'])}->{dev(r['dst'])} {r['via']} ({len(r['channels'])} channel"
        f"{'s' if len(r['channels']) != 1 else ''})"
        for r in rows
    )
