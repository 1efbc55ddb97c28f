"""Asking Slurm itself to expand a node list: ``scontrol show hostnames NODELIST``.

The installed Slurm knows every hostlist form it writes (including ones
``gputopo.launch.slurm.expand_hostlist`` may not), so ``gputopo.launch.slurm.slurm_job`` asks it first and
expands the list itself only when this answers ``None``. ``scontrol`` is looked up on ``PATH`` at call
time, so tests put a fake one there.
"""

from __future__ import annotations

import shutil
import subprocess

DEFAULT_TIMEOUT_S = 5.0


def hostnames(nodelist: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str] | None:
    """The host names ``scontrol show hostnames NODELIST`` prints, one a line, in its order.

    ``None`` (so the caller expands the list itself) when ``scontrol`` is not on ``PATH`` or cannot be
    started, runs longer than ``timeout_s`` (it is killed), exits non-zero (e.g. it cannot parse the list,
    or a site's ``scontrol`` insists on reaching slurmctld), or prints nothing.
    """
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        # subprocess.run kills the child when the timeout expires.
        done = subprocess.run(
            [exe, "show", "hostnames", nodelist],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    hosts = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return hosts or None
