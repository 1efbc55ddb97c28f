"""Running ``nvidia-smi topo -m``: the fallback when NVML cannot be loaded from Python.

Only the text comes from here; ``gputopo.topology.parse_smi`` reads it. ``nvidia-smi`` is looked up on
``PATH`` at call time, so tests put a fake one there.
"""

from __future__ import annotations

import shutil
import subprocess
from contextlib import suppress

from gputopo.errors import UnavailableError

DEFAULT_TIMEOUT_S = 15.0
_REAP_TIMEOUT_S = 2.0


class SmiUnavailable(UnavailableError):
    """``nvidia-smi topo -m`` could not be run or did not succeed (exit 3); the message says why."""


def topo_matrix_text(timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """The stdout of ``nvidia-smi topo -m``.

    Raises ``SmiUnavailable`` when ``nvidia-smi`` is not on ``PATH``, cannot be started, runs longer than
    ``timeout_s`` (it is killed), exits non-zero (e.g. "couldn't communicate with the NVIDIA driver"), or
    prints nothing.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise SmiUnavailable(
            "nvidia-smi is not on PATH", "install the NVIDIA driver, or put nvidia-smi on PATH"
        )
    try:
        proc = subprocess.Popen(
            [exe, "topo", "-m"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
    except OSError as exc:
        raise SmiUnavailable(
            f"cannot run {exe}: {exc.strerror or exc}", "check that it is executable"
        ) from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        # A process stuck inside the driver does not die even on SIGKILL until the driver lets go:
        # wait a little for it, but don't hang with it.
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_REAP_TIMEOUT_S)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        raise SmiUnavailable(
            f"`nvidia-smi topo -m` did not finish within {timeout_s:g} s",
            "the driver may be hung; check `dmesg` for Xid errors",
        ) from None
    if proc.returncode != 0:
        said = _first_line(stderr) or _first_line(stdout) or "no message"
        raise SmiUnavailable(
            f"`nvidia-smi topo -m` failed (exit {proc.returncode}): {said}",
            "check that the NVIDIA driver is loaded (`nvidia-smi` alone should list the GPUs)",
        )
    if not stdout.strip():
        raise SmiUnavailable("`nvidia-smi topo -m` printed nothing", "run it by hand to see what it says")
    return stdout


def _first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""
