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
- ``src/ras/client.cc`` and ``client_support.cc`` (``rasClientRun*``): the protocol on the port: the
  client sends ``CLIENT PROTOCOL 2``, the server answers ``SERVER PROTOCOL 2``; ``SET FORMAT json`` ->
  ``OK``; ``STATUS`` -> the document, then the server closes the connection. The port listens on
  ``localhost:28028`` unless ``NCCL_RAS_ADDR`` (``host:port``) says otherwise (``rasClientInitSocket``).
  Collecting the status waits up to 5 s per leg (``RAS_COLLECTIVE_LEG_TIMEOUT_SEC``, ras_internal.h).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputopo.errors import InputError, UnavailableError
from gputopo.inputs import read_capped

DEFAULT_RAS_ADDR = "localhost:28028"
RAS_PROTOCOL = 2
CONNECT_TIMEOUT_S = 2.0
# NCCL waits up to 5 s per collection leg, plus as much again before the client gives up (client.cc).
READ_TIMEOUT_S = 15.0
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
            ranks.append(
                RasRank(
                    comm=name,
                    rank=_int(r.get("rank"), -1),
                    host=_host(r.get("host")),
                    pid=_pid(r.get("pid")),
                    cuda_dev=_opt_int(r.get("cuda_dev")),
                    nvml_dev=_opt_int(r.get("nvml_dev")),
                    missing=False,
                    async_error=_int(st.get("async_error"), 0),
                    abort_flag=bool(st.get("abort_flag")),
                )
            )
        for r in comm.get("missing_ranks") or []:
            st = r.get("status") or {}
            ranks.append(
                RasRank(
                    comm=name,
                    rank=_int(r.get("rank"), -1),
                    host=_host(r.get("host")),
                    pid=_pid(r.get("pid")),
                    cuda_dev=_opt_int(r.get("cuda_dev")),
                    nvml_dev=_opt_int(r.get("nvml_dev")),
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
    try:
        if path.stat().st_size > MAX_RAS_BYTES:
            raise InputError(f"--ras-json {path}: over {MAX_RAS_BYTES // 2**20} MiB", _HINT)
        text = read_capped(path, f"--ras-json {path}", MAX_RAS_BYTES, _HINT).decode("utf-8", "replace")
    except FileNotFoundError:
        raise InputError(f"--ras-json {path}: no such file", _HINT) from None
    except OSError as exc:
        raise InputError(f"--ras-json {path}: cannot read ({exc.strerror or exc})", _HINT) from None
    return parse_ras_json(text, f"--ras-json {path}")


def ras_address(env: dict[str, str] | None = None) -> tuple[str, int]:
    """(host, port) of the local RAS port: ``NCCL_RAS_ADDR`` or localhost:28028."""
    raw = (env if env is not None else os.environ).get("NCCL_RAS_ADDR") or DEFAULT_RAS_ADDR
    host, sep, port = raw.rpartition(":")
    if not sep or not port.isdigit():
        raise InputError(f"NCCL_RAS_ADDR={raw}: not host:port", "e.g. NCCL_RAS_ADDR=localhost:28028")
    return host.strip("[]") or "localhost", int(port)


def ask_ras(
    address: tuple[str, int] | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    read_timeout_s: float = READ_TIMEOUT_S,
) -> RasReport:
    """Ask the local NCCL RAS port for its status in JSON, the way ``ncclras -f json`` does.

    The one function in ``hang`` that reaches outside the process. Nothing listening (no NCCL job on
    this node, or RAS off with ``NCCL_RAS_ENABLE=0``) is an ``UnavailableError`` (exit 3)."""
    host, port = address or ras_address()
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except OSError as exc:
        raise UnavailableError(
            f"no NCCL RAS listening at {where} ({exc.strerror or exc})",
            "RAS runs inside NCCL >= 2.24 processes while a job is alive; set NCCL_RAS_ADDR if the job "
            "moved it, or give a saved `ncclras -f json` output with --ras-json",
        ) from None
    with sock:
        sock.settimeout(read_timeout_s)
        try:
            _say(sock, f"CLIENT PROTOCOL {RAS_PROTOCOL}\n")
            reply = _line(sock)
            if not reply.upper().startswith("SERVER PROTOCOL"):
                raise InputError(f"RAS at {where} answered {reply!r}, not a protocol line", _HINT)
            _say(sock, "SET FORMAT json\n")
            reply = _line(sock)
            if reply.strip().upper() != "OK":
                raise UnavailableError(
                    f"RAS at {where} has no JSON output ({reply.strip()!r})",
                    "JSON output needs NCCL 2.28.7 or later; run `ncclras` for the text status",
                )
            _say(sock, "STATUS\n")
            chunks: list[bytes] = []
            total = 0
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
                total += len(data)
                if total > MAX_RAS_BYTES:
                    raise InputError(f"RAS at {where} sent over {MAX_RAS_BYTES // 2**20} MiB", _HINT)
        except TimeoutError:
            raise UnavailableError(
                f"RAS at {where} did not answer within {read_timeout_s:g} s",
                "the NCCL process may be stuck in its own RAS thread; try `ncclras -t 30`",
            ) from None
        except OSError as exc:
            raise UnavailableError(f"RAS at {where}: {exc.strerror or exc}") from None
    return parse_ras_json(b"".join(chunks).decode("utf-8", errors="replace"), f"RAS at {where}")


def _say(sock: socket.socket, text: str) -> None:
    sock.sendall(text.encode())


def _line(sock: socket.socket) -> str:
    buf = b""
    while not buf.endswith(b"\n") and len(buf) < 4096:
        data = sock.recv(1)
        if not data:
            break
        buf += data
    return buf.decode(errors="replace")


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _pid(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _host(v: Any) -> str | None:
    return v if isinstance(v, str) and v and v != "unknown" else None
