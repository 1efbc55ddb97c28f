"""Asking Slurm itself: ``scontrol show hostnames NODELIST`` and ``scontrol show node NAME``.

The installed Slurm knows every hostlist form it writes (including ones that
``gputopo.launch.slurm.expand_hostlist`` may not), so ``gputopo.launch.slurm.slurm_job`` asks it first and
expands the list itself only when this answers ``None``; and it knows the address to reach a node at
(``NodeAddr``), which need not be the node's name.
``scontrol`` is looked up on ``PATH`` at call time, so tests put a fake one there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

DEFAULT_TIMEOUT_S = 5.0

_NODE_ADDR = re.compile(r"(?:^|\s)NodeAddr=(\S+)")
_NODE_NAME = re.compile(r"(?:^|\s)NodeName=(\S+)")

# Where scontrol lives when there is no PATH at all: slurmd runs a HealthCheckProgram with nothing in its
# environment but SLURMD_NODENAME (and PWD); measured on Slurm 22.05 (tests/test_slurm_real.py), and so
# in the source (src/slurmd/slurmd/slurmd.c, ``run_script_health_check``: a fresh env array). Debian's
# packages put it in /usr/bin, builds from source in /usr/local/bin, many sites under /opt/slurm.
NO_PATH_DIRS = ("/usr/bin", "/bin", "/usr/local/bin", "/opt/slurm/bin", "/usr/sbin", "/usr/local/sbin")


def scontrol_path() -> str | None:
    """``scontrol`` on ``PATH``; with no ``PATH`` in the environment, in ``NO_PATH_DIRS``."""
    if "PATH" in os.environ:
        return shutil.which("scontrol")
    return shutil.which("scontrol", path=os.pathsep.join(NO_PATH_DIRS))


def _run(args: list[str], timeout_s: float) -> str | None:
    """What ``scontrol ARGS`` prints on stdout; ``None`` when it is missing, fails or runs too long."""
    exe = scontrol_path()
    if exe is None:
        return None
    try:
        # subprocess.run kills the child when the timeout expires.
        done = subprocess.run(
            [exe, *args],
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
    return done.stdout


def show(args: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """What ``scontrol ARGS`` prints (``show topology``, ``show job ID`` for ``gputopo nodes --audit``);
    ``None`` when scontrol is missing, fails or runs past ``timeout_s`` (it is killed)."""
    return _run(args, timeout_s)


def node_addr(name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """The address Slurm has for node ``name`` (``scontrol -o show node NAME``: ``NodeAddr``).

    ``None`` when ``scontrol`` is missing, cannot reach slurmctld in ``timeout_s``, does not know the node,
    or prints no address; the caller then uses the name.
    """
    text = _run(["-o", "show", "node", name], timeout_s)
    return node_addr_from_show_node(text, name) if text else None


def node_addr_from_show_node(text: str, name: str) -> str | None:
    """``NodeAddr`` of node ``name`` in what ``scontrol show node NAME`` (or ``scontrol -o show node``)
    printed; ``None`` when the node is not there or has no address (Slurm prints ``(null)``).

    The output is ``Key=Value`` pairs, a record per node starting with ``NodeName=`` (one line each with
    ``-o``, else a paragraph): ``NodeAddr=10.1.0.7 NodeHostName=gpu-a07 Port=6818 ...``.
    """
    records = re.split(r"(?=(?:^|\s)NodeName=)", text)
    for record in records:
        found = _NODE_NAME.search(record)
        if found is None or found.group(1) != name:
            continue
        addr = _NODE_ADDR.search(record)
        if addr is None or addr.group(1) in ("(null)", "n/a", ""):
            return None
        return addr.group(1)
    return None


def hostnames(nodelist: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str] | None:
    """The host names ``scontrol show hostnames NODELIST`` prints, one a line, in its order.

    ``None`` (so the caller expands the list itself) when ``scontrol`` is not on ``PATH`` or cannot be
    started, runs longer than ``timeout_s`` (it is killed), exits non-zero (e.g. it cannot parse the list,
    or a site's ``scontrol`` insists on reaching slurmctld), or prints nothing.
    """
    out = _run(["show", "hostnames", nodelist], timeout_s)
    if out is None:
        return None
    hosts = [line.strip() for line in out.splitlines() if line.strip()]
    return hosts or None
