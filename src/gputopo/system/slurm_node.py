"""Draining and resuming this Slurm node with ``scontrol`` (``gputopo check --drain/--resume-if-healthy``).

slurmd runs a ``HealthCheckProgram`` as root with almost no environment: no ``PATH``, only
``SLURMD_NODENAME`` (slurm.conf(5), HealthCheckProgram). So ``scontrol`` is looked for on ``PATH``, or
without one in the places Slurm packages install it (``system.scontrol.scontrol_path``), and the node is
``SLURMD_NODENAME`` or the short host name.

What may be done is decided in ``health.node_action`` (pure: never overrule a person); this module reads
the nodes (``scontrol show node``) and runs the one update, each call cut off at the time left in the
check's ``--budget`` (a hung ``scontrol`` is killed and reported, never waited on).
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from dataclasses import dataclass

from gputopo.health.node_action import PREFIX, NodeInfo, parse_show_node
from gputopo.system.scontrol import scontrol_path

__all__ = ["PREFIX", "SlurmAction", "command_line", "drain", "node_name", "read_nodes", "resume", "scontrol"]

# The longest one scontrol call may take when the budget leaves more.
TIMEOUT_S = 10.0
NOT_FOUND = "scontrol not found (PATH, /usr/bin, /usr/local/bin, ...)"


@dataclass(frozen=True)
class SlurmAction:
    """What was done (or would be, with ``--dry-run``): ``action`` drain|resume|none, the command as a
    shell line, ``error`` when scontrol failed or is missing, ``held_back`` why nothing was done where
    something could have been, the node as Slurm showed it before, and the drain reason given. A dry run
    of an action that is held back has ``action`` none, ``withheld`` the action and ``command`` its line."""

    action: str
    command: str | None
    done: bool
    error: str | None = None
    held_back: str | None = None
    node: NodeInfo | None = None
    reason: str | None = None
    dry_run: bool = False
    withheld: str | None = None  # drain|resume: what the check calls for and ``held_back`` stops

    def to_json(self) -> dict[str, object]:
        return {
            "action": self.action,
            "command": self.command,
            "done": self.done,
            "error": self.error,
            "held_back": self.held_back,
            "node": self.node.to_json() if self.node is not None else None,
            "reason": self.reason,
            "dry_run": self.dry_run,
            "withheld": self.withheld,
        }


def scontrol() -> str | None:
    """The ``scontrol`` program: ``system.scontrol``'s one lookup (``PATH``, or with no ``PATH`` as under
    slurmd, the directories Slurm packages use)."""
    return scontrol_path()


def node_name() -> str:
    """``SLURMD_NODENAME`` (set by slurmd for its health check), else the short host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".", 1)[0]


def _run(args: list[str], timeout_s: float) -> tuple[str | None, str | None]:
    if timeout_s <= 0:
        return None, "not run: the time budget (--budget) was spent"
    limit = min(TIMEOUT_S, timeout_s)
    try:
        done = subprocess.run(
            args,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=limit,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None, f"scontrol did not answer within {limit:.1f} s (cut off to keep --budget)"
    except OSError as exc:
        return None, f"scontrol: {exc.strerror or exc}"
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[0]
        return None, first[:200]
    return done.stdout, None


def read_nodes(timeout_s: float) -> tuple[list[NodeInfo] | None, str | None]:
    """Every node as ``scontrol show node`` prints it (state and reason), or (``None``, why not)."""
    exe = scontrol()
    if exe is None:
        return None, NOT_FOUND
    out, err = _run([exe, "show", "node"], timeout_s)
    if out is None:
        return None, err
    return parse_show_node(out), None


def _drain_args(node: str, reason: str) -> list[str]:
    return [scontrol() or "scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]


def _resume_args(node: str) -> list[str]:
    return [scontrol() or "scontrol", "update", f"NodeName={node}", "State=RESUME"]


def command_line(action: str, node: str, reason: str | None = None) -> str:
    """The ``scontrol`` line that drains (with ``reason``) or resumes ``node``, as a shell line; nothing
    is run (a dry run's preview, also of an action that is held back)."""
    return shlex.join(_drain_args(node, reason or "") if action == "drain" else _resume_args(node))


def drain(node: str, reason: str, dry_run: bool, timeout_s: float) -> SlurmAction:
    """``scontrol update NodeName=<node> State=DRAIN Reason="<reason>"`` (``reason`` starts with
    ``gputopo:``)."""
    args = _drain_args(node, reason)
    line = shlex.join(args)
    if dry_run:
        return SlurmAction("drain", line, False, dry_run=True)
    if scontrol() is None:
        return SlurmAction("drain", line, False, NOT_FOUND)
    _, err = _run(args, timeout_s)
    return SlurmAction("drain", line, err is None, err)


def resume(node: str, dry_run: bool, timeout_s: float) -> SlurmAction:
    """``scontrol update NodeName=<node> State=RESUME`` (the caller has seen gputopo's own reason)."""
    args = _resume_args(node)
    line = shlex.join(args)
    if dry_run:
        return SlurmAction("resume", line, False, dry_run=True)
    _, err = _run(args, timeout_s)
    return SlurmAction("resume", line, err is None, err)
