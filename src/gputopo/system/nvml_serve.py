"""The NVML worker process itself: ``python -m gputopo.system.nvml_serve``, started by
``nvml_worker.Worker``.

It holds one NVML session for its whole life and answers the parent's requests in order (the reads are
``inventory.Served``'s), until its stdin closes. Apart from ``nvml_worker`` (the parent's side and the
frame protocol) so that the reads in ``inventory`` may use the worker's deadline without the two
modules importing each other."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from typing import Any

from gputopo.system import inventory, nvml, nvml_worker
from gputopo.system.nvml_worker import HEADER, read_exact, write_frame


def _call(request: tuple[Any, ...]) -> tuple[str, Any]:
    _, module, qualname, args, kwargs = request
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    try:
        return ("ok", target(*args, **kwargs))
    except Exception as exc:  # handed to the caller, which raises it there
        return ("raise", exc)


def _serve() -> None:
    """The child: one NVML session, answering ``inventory`` requests until stdin closes."""
    # The flag that ``nvml_worker.with_deadline`` reads: in here, calls run directly.
    nvml_worker._IN_WORKER = True

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    nvml._pynvml()  # import the bindings before saying ready: only NVML calls are on the clock
    write_frame(stdout, ("ready",))
    try:
        session = nvml.session()
        s = session.__enter__()
    except nvml.NvmlUnavailable as exc:
        write_frame(stdout, ("unavailable", exc.message, exc.hint, exc.not_installed))
        return
    try:
        write_frame(stdout, ("ok", None))
        served = inventory.Served(s)
        while True:
            head = read_exact(stdin, HEADER.size)
            if head is None:
                return
            frame = read_exact(stdin, HEADER.unpack(head)[0])
            if frame is None:
                return
            request = pickle.loads(frame)
            write_frame(stdout, _call(request) if request[0] == "call" else served.answer(request))
    finally:
        session.__exit__(None, None, None)


if __name__ == "__main__":
    _serve()
    sys.stdout.flush()
    os._exit(0)  # NVML is shut down and the answers are out: skip the interpreter's teardown
