"""Run a Python script (or ``-m module``) inside torch's control plane, unchanged.

``gputopo run`` puts this file's path before the user's script: ``python worker_main.py train.py ARGS``
(or ``-m pkg.mod ARGS``). It runs in the rank's own Python, which need not have gputopo installed, so it
imports nothing of gputopo: the standard library and torch only. It names one control-plane socket per
rank where ``gputopo hang --live`` / ``gputopo slow --live`` look for it (``hang/live.WORKER_SOCKET``:
``<tempdir>/gputopo-worker-<pid>.sock``, unless ``TORCH_WORKER_SERVER_SOCKET`` is set), enters
``torch.distributed.elastic.control_plane.worker_main()`` (torch 2.4+: it serves ``fr_trace_json`` and
the other handlers on that socket from its own thread, and records an uncaught error for torchrun as
``errors.record`` does), and runs the script as ``python SCRIPT`` would: ``__name__ == "__main__"``,
``sys.argv`` the script and its arguments, the script's folder first on ``sys.path``. Without torch, or
with a torch whose control plane is missing, the script runs as it would have, without the socket.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress

SOCKET = "gputopo-worker-{pid}.sock"  # the same name as gputopo.hang.live.WORKER_SOCKET (a test checks)


@contextmanager
def control_plane() -> Iterator[str | None]:
    """Serve torch's control plane on this rank's socket while the block runs; yields the socket's path,
    or None where it could not be served (no torch, no control plane, the socket refused)."""
    path = os.environ.setdefault(
        "TORCH_WORKER_SERVER_SOCKET", os.path.join(tempfile.gettempdir(), SOCKET.format(pid=os.getpid()))
    )
    try:
        import torch.distributed.elastic.control_plane as cp  # noqa: TID251 -- runs in the rank, see above
    except Exception:  # no torch, or one without the control plane: the script runs anyway
        yield None
        return
    with ExitStack() as stack:
        ours = path == os.path.join(tempfile.gettempdir(), SOCKET.format(pid=os.getpid()))
        if ours and os.path.exists(path):
            os.unlink(path)  # left by an earlier process with this PID (torch does not remove it)
        try:
            stack.enter_context(cp.worker_main())
        except Exception as exc:  # e.g. a path too long for a Unix socket: run without it
            print(f"gputopo: torch's control plane not served on {path}: {exc}", file=sys.stderr)
            yield None
            return
        if ours:
            stack.callback(_unlink, path)
        # torch's WorkerServer binds in its constructor and listens from a thread; a shutdown that comes
        # before that thread listens is lost and the join waits forever (WorkerServer.cpp: shutdown() is
        # server_.stop() then serverThread_.join(); measured: a script that ends at once hung its rank).
        # So the script starts only once the server has answered.
        _wait_until_served(path)
        # A script that wraps its own main in worker_main() (docs/hang.md) would start a second server on
        # the same socket and fail ("already exists"): inside this process, worker_main() now only yields.
        stack.callback(setattr, cp, "worker_main", cp.worker_main)
        cp.worker_main = _served
        yield path


@contextmanager
def _served() -> Iterator[None]:
    yield  # the control plane already runs in this process


def _wait_until_served(path: str, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(2.0)
                sock.connect(path)
                sock.sendall(b"POST /handler/ping HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n")
                if sock.recv(16).startswith(b"HTTP/"):
                    return True
        except OSError:
            pass
        time.sleep(0.02)
    print(f"gputopo: torch's control plane on {path} did not answer in {within_s:g} s", file=sys.stderr)
    return False


def _unlink(path: str) -> None:
    with suppress(OSError):
        os.unlink(path)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: worker_main.py SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    with control_plane():
        if argv[0] == "-m" and len(argv) > 1:
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()  # as python -m does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as python SCRIPT does
            runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
