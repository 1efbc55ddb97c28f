"""torch's control plane: the HTTP server a rank runs on a Unix socket when its main is wrapped in
``torch.distributed.elastic.control_plane.worker_main()`` and ``TORCH_WORKER_SERVER_SOCKET`` names the
socket (torch/distributed/elastic/control_plane.py). Its handlers answer ``POST /handler/<name>``
(torch 2.14.1, measured: ``GET /handler/`` lists ``dump_nccl_trace_json``, ``dump_nccl_trace_pickle``,
``dump_traceback``, ``pyspy_dump``, ``wait_counter_values``, ``fr_trace_json``, ``ping``);
``fr_trace_json`` is the Flight Recorder's JSON dump of every backend, taken while the job runs.
"""

from __future__ import annotations

import http.client
import socket

TIMEOUT_S = 5.0


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def ask(socket_path: str, handler: str, timeout_s: float = TIMEOUT_S, limit: int = 256 << 20) -> bytes:
    """The body of ``handler``'s answer; ``OSError`` (or ``http.client.HTTPException``) when the socket
    is not there, does not answer in time or answers with an error."""
    conn = _UnixConnection(socket_path, timeout_s)
    try:
        conn.request("POST", f"/handler/{handler}")
        resp = conn.getresponse()
        body = resp.read(limit + 1)
        if resp.status != 200:
            raise OSError(f"{handler}: HTTP {resp.status}: {body[:200].decode('utf-8', 'replace')}")
        if len(body) > limit:
            raise OSError(f"{handler}: answer over {limit >> 20} MiB")
        return body
    finally:
        conn.close()
