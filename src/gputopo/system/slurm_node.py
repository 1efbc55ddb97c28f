"""Draining and resuming this Slurm node with ``scontrol`` (``gputopo check --drain/--resume-if-healthy``).

slurmd runs a ``HealthCheckProgram`` as root with almost no environment: no ``PATH``, only
``SLURMD_NODENAME`` (slurm.conf(5), HealthCheckProgram). So ``scontrol`` is looked for on ``PATH``, or
without one in the places Slurm packages install it (``system.scontrol.scontrol_path``), and the node is
``SLURMD_NODENAME`` or the short host name.

Only a drain whose reason starts with ``gputopo:`` is ever resumed: a node an administrator drained
stays drained.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from dataclasses import dataclass

from gputopo.system.scontrol import scontrol_path

PREFIX = "gputopo:"
TIMEOUT_S = 10.0


@dataclass(frozen=True)
class SlurmAction:
    """What was done (or would be, with ``--dry-run``): ``action`` drain|resume|none, the command as a
    shell line, and ``error`` when scontrol failed or is missing."""

    action: str
    command: str | None
    done: bool
    error: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"action": self.action, "command": self.command, "done": self.done, "error": self.error}


def scontrol() -> str | None:
    """The ``scontrol`` program: ``system.scontrol``'s one lookup (``PATH``, or with no ``PATH`` as under
    slurmd, the directories Slurm packages use)."""
    return scontrol_path()


def node_name() -> str:
    """``SLURMD_NODENAME`` (set by slurmd for its health check), else the short host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".", 1)[0]


def _run(args: list[str]) -> tuple[str | None, str | None]:
    try:
        done = subprocess.run(
            args,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None, f"scontrol did not answer within {TIMEOUT_S:g} s"
    except OSError as exc:
        return None, f"scontrol: {exc.strerror or exc}"
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[0]
        return None, first[:200]
    return done.stdout, None


def current_reason(exe: str, node: str) -> tuple[str | None, str | None]:
    """(the node's drain reason without Slurm's ``[user@time]`` stamp or ``None``, error)."""
    out, err = _run([exe, "show", "node", node])
    if out is None:
        return None, err
    for part in out.splitlines():
        part = part.strip()
        if part.startswith("Reason="):
            reason = part[len("Reason=") :]
            if reason.endswith("]") and " [" in reason:
                reason = reason[: reason.rindex(" [")]
            return reason.strip() or None, None
    return None, None


def drain(reason: str, dry_run: bool) -> SlurmAction:
    """``scontrol update NodeName=<node> State=DRAIN Reason="gputopo: <reason>"``."""
    exe = scontrol() or "scontrol"
    args = [exe, "update", f"NodeName={node_name()}", "State=DRAIN", f"Reason={PREFIX} {reason}"]
    line = shlex.join(args)
    if dry_run:
        return SlurmAction("drain", line, False)
    if scontrol() is None:
        return SlurmAction("drain", line, False, "scontrol not found (PATH, /usr/bin, /usr/local/bin, ...)")
    _, err = _run(args)
    return SlurmAction("drain", line, err is None, err)


def resume_if_ours(dry_run: bool) -> SlurmAction:
    """Resume the node only when its drain reason starts with ``gputopo:``."""
    exe = scontrol()
    node = node_name()
    if exe is None:
        return SlurmAction("none", None, False, "scontrol not found (PATH, /usr/bin, /usr/local/bin, ...)")
    reason, err = current_reason(exe, node)
    if err is not None:
        return SlurmAction("none", None, False, err)
    if not reason or not reason.startswith(PREFIX):
        return SlurmAction("none", None, False)
    args = [exe, "update", f"NodeName={node}", "State=RESUME"]
    line = shlex.join(args)
    if dry_run:
        return SlurmAction("resume", line, False)
    _, err = _run(args)
    return SlurmAction("resume", line, err is None, err)
