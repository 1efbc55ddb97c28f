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

# Variables the probe itself sets in the ranks to capture NCCL's transport choice; recorded apart from the
# user's, so the report never mistakes them for the user's settings.
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
            if name in CAPTURE_VARIABLES:
                continue
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
