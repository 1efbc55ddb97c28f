"""NCCL RAS: ask the local RAS port for its status in JSON, the way ``ncclras -f json`` does.

The machine-touching half of ``gputopo hang --ras``; the reading of the answer is pure and lives in
``gputopo.hang.ras``. The protocol, from NCCL's source (NVIDIA/nccl 2.30.7, ``src/ras/client.cc`` and
``client_support.cc``, ``rasClientRun*``): the client sends ``CLIENT PROTOCOL 2`` and the server answers
``SERVER PROTOCOL 2``; ``SET FORMAT json`` -> ``OK`` (NCCL 2.28.7 and later); ``STATUS`` -> the
document, then the server closes the connection. Collecting the status waits up to 5 s per leg
(``RAS_COLLECTIVE_LEG_TIMEOUT_SEC``, ras_internal.h), so the read deadline is longer than that.
"""

from __future__ import annotations

import socket

from gputopo.errors import InputError, UnavailableError

RAS_PROTOCOL = 2
CONNECT_TIMEOUT_S = 2.0
# NCCL waits up to 5 s per collection leg, plus as much again before the client gives up (client.cc).
READ_TIMEOUT_S = 15.0
MAX_RAS_BYTES = 64 * 1024 * 1024
_HINT = "give the output of `ncclras -f json` (NCCL 2.28.7 or later)"


def ask_ras_text(
    host: str,
    port: int,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    read_timeout_s: float = READ_TIMEOUT_S,
) -> str:
    """The RAS port's JSON status as text. Nothing listening (no NCCL job on this node, or RAS off with
    ``NCCL_RAS_ENABLE=0``) is an ``UnavailableError`` (exit 3); a port that speaks something else an
    ``InputError``."""
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
    return b"".join(chunks).decode("utf-8", errors="replace")


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
