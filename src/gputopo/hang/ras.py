"""NCCL RAS: the output of ``ncclras -f json`` (read from a file) or the same asked of the local RAS port.

Built from NCCL's source, NVIDIA/nccl at 2.30.7 (commit 5067397c), and checked against the tags
v2.28.7-1 (the first with JSON output), v2.28.9-1, v2.29.2-1 and v2.30.3-1:
- ``src/ras/client_support.cc``: ``rasDumpCommsToJSON`` and the ``json*`` writers give the document:
  ``{"nccl_version", "cuda_runtime_version", "cuda_driver_version", "timestamp", "communicators_count",
  "communicators": [{"hash", "secondary_hash", "size", "ranks_count", "missing_ranks_count",
  "ranks": [{"rank", "host", "pid", "cuda_dev", "nvml_dev", "status": {"init_state", "async_error",
  "finalize_called", "destroy_flag", "abort_flag"}, "collective_counts": {...}}],
  "missing_ranks": [{"rank", "host", "pid", "cuda_dev", "nvml_dev", "status": {"unresponsive",
  "considered_dead"}}]}], "ras": {"collection_time_sec", "timeouts_count"}}``. In 2.28.7 a missing rank
  had no ``status`` (it ends at ``nvml_dev``); the reader takes both. ``host`` is the peer's IP address
  as text (``ncclSocketToHost``, no DNS) or ``"unknown"``; ``pid`` is -1 when unknown.
- each present rank carries ``collective_counts`` (``jsonWriteRankData``: one count per NCCL function,
  ``ncclFuncToString``: Broadcast, Reduce, AllGather, ReduceScatter, AllReduce, ...). RAS's text output
  says ``MISMATCH`` for a communicator whose ranks' counts differ from the first rank's
  (``rasAuxComm.firstCollOpCounts``, ``RAS_ACE_MISMATCH``): here the ranks whose count is below the most
  common one are named as lagging (``RasReport.lagging``);
- RAS numbers ranks within each communicator (``rank->commRank``), not globally: a global rank is found
  through the host and PID a run record gives it (``hang.triage``), never assumed.
- The port listens on ``localhost:28028`` unless ``NCCL_RAS_ADDR`` (``host:port``) says otherwise
  (``src/ras/client.cc``, ``rasClientInitSocket``). Talking to it (the client protocol) is machine work
  and lives in ``gputopo.system.nccl_ras``; this module only reads what comes back (pure).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputopo.errors import InputError
from gputopo.hang.files import read_named

DEFAULT_RAS_ADDR = "localhost:28028"
MAX_RAS_BYTES = 64 * 1024 * 1024
_HINT = "give the output of `ncclras -f json` (NCCL 2.28.7 or later)"


@dataclass(frozen=True)
class RasRank:
    """One rank RAS knows of: present (``missing`` False) or missing from its communicator."""

    comm: str
    rank: int
    host: str | None
    pid: int | None
    cuda_dev: int | None
    nvml_dev: int | None
    missing: bool
    unresponsive: bool = False
    dead: bool = False
    async_error: int = 0
    abort_flag: bool = False
    counts: tuple[tuple[str, int], ...] = ()  # collective_counts, as RAS gives them
    global_rank: int | None = None  # filled by triage from a run record (host and PID)

    @property
    def trouble(self) -> str | None:
        """Why this rank is a problem, in words, or ``None``."""
        if self.dead:
            return "considered dead by RAS"
        if self.missing and self.unresponsive:
            return "missing and not answering RAS"
        if self.missing:
            return "missing from its communicator"
        if self.async_error:
            return f"NCCL asynchronous error {self.async_error}"
        if self.abort_flag:
            return "communicator aborted"
        return None

    def as_dict(self) -> dict[str, Any]:
        return {
            "comm": self.comm,
            "rank": self.rank,
            "global_rank": self.global_rank,
            "host": self.host,
            "pid": self.pid,
            "gpu": {"index": self.nvml_dev, "cuda_dev": self.cuda_dev} if self.nvml_dev is not None else None,
            "trouble": self.trouble,
        }


@dataclass(frozen=True)
class RasReport:
    """What RAS said: the NCCL version, every communicator's size, and the ranks that are in trouble."""

    source: str
    nccl_version: str | None
    communicators: int
    ranks: tuple[RasRank, ...]
    timeouts: int | None

    @property
    def troubled(self) -> tuple[RasRank, ...]:
        return tuple(r for r in self.ranks if r.trouble)

    @property
    def lagging(self) -> tuple[tuple[RasRank, str, int, int], ...]:
        """(rank, function, its count, the most common count) for every present rank whose count of a
        collective is below the rest of its communicator's (RAS's ``MISMATCH``): it is behind, and the
        others wait for it."""
        out: list[tuple[RasRank, str, int, int]] = []
        by_comm: dict[str, list[RasRank]] = {}
        for r in self.ranks:
            if not r.missing and r.counts:
                by_comm.setdefault(r.comm, []).append(r)
        for ranks in by_comm.values():
            if len(ranks) < 2:
                continue
            names = sorted({n for r in ranks for n, _ in r.counts})
            for name in names:
                values = [dict(r.counts).get(name, 0) for r in ranks]
                common = max(set(values), key=lambda v: (values.count(v), v))
                for r, v in zip(ranks, values, strict=True):
                    if v < common:
                        out.append((r, name, v, common))
        return tuple(out)


def _rank(comm: str, r: dict[str, Any], **state: Any) -> RasRank:
    """One rank entry of a communicator (``ranks`` or ``missing_ranks``: the same fields, other states)."""
    return RasRank(
        comm=comm,
        rank=_int(r.get("rank"), -1),
        host=_host(r.get("host")),
        pid=_pid(r.get("pid")),
        cuda_dev=_opt_int(r.get("cuda_dev")),
        nvml_dev=_opt_int(r.get("nvml_dev")),
        **state,
    )


def parse_ras_json(text: str, source: str) -> RasReport:
    """Read ``ncclras -f json`` output; ``InputError`` naming ``source`` when it is not that."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{source}: not JSON (line {exc.lineno}: {exc.msg})", _HINT) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("communicators"), list):
        raise InputError(f"{source}: not NCCL RAS JSON (no 'communicators' list)", _HINT)
    ranks: list[RasRank] = []
    for comm in doc["communicators"]:
        if not isinstance(comm, dict):
            raise InputError(f"{source}: a communicator is not an object", _HINT)
        name = str(comm.get("hash", "?"))
        for r in comm.get("ranks") or []:
            st = r.get("status") or {}
            counts = r.get("collective_counts") if isinstance(r.get("collective_counts"), dict) else {}
            ranks.append(
                _rank(
                    name,
                    r,
                    missing=False,
                    async_error=_int(st.get("async_error"), 0),
                    abort_flag=bool(st.get("abort_flag")),
                    counts=tuple((str(k), _int(v, 0)) for k, v in counts.items()),
                )
            )
        for r in comm.get("missing_ranks") or []:
            st = r.get("status") or {}
            ranks.append(
                _rank(
                    name,
                    r,
                    missing=True,
                    unresponsive=bool(st.get("unresponsive")),
                    dead=bool(st.get("considered_dead")),
                )
            )
    ras = doc.get("ras") if isinstance(doc.get("ras"), dict) else {}
    return RasReport(
        source=source,
        nccl_version=doc.get("nccl_version") if isinstance(doc.get("nccl_version"), str) else None,
        communicators=len(doc["communicators"]),
        ranks=tuple(ranks),
        timeouts=_opt_int(ras.get("timeouts_count")),
    )


def read_ras_file(path: Path) -> RasReport:
    """``--ras-json FILE``."""
    label, over = f"--ras-json {path}", f"{MAX_RAS_BYTES // 2**20} MiB"
    text = read_named(path, label, MAX_RAS_BYTES, over, _HINT).decode("utf-8", "replace")
    return parse_ras_json(text, label)


def ras_address(env: dict[str, str] | None = None) -> tuple[str, int]:
    """(host, port) of the local RAS port: ``NCCL_RAS_ADDR`` or localhost:28028."""
    raw = (env if env is not None else os.environ).get("NCCL_RAS_ADDR") or DEFAULT_RAS_ADDR
    host, sep, port = raw.rpartition(":")
    if not sep or not port.isdigit():
        raise InputError(f"NCCL_RAS_ADDR={raw}: not host:port", "e.g. NCCL_RAS_ADDR=localhost:28028")
    return host.strip("[]") or "localhost", int(port)


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _pid(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _host(v: Any) -> str | None:
    return v if isinstance(v, str) and v and v != "unknown" else None
