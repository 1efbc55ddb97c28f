"""What ``check --drain/--resume-if-healthy`` may do to its Slurm node (pure): never overrule a person.

The rules, in order:

- a node drained or down by someone else (its reason does not start with ``gputopo:``) is left alone:
  neither drained again (its reason would be overwritten) nor resumed;
- only problems whose action takes a GPU out of service (``health.rules.DRAIN_ACTIONS``: reset, drain,
  replace, reboot) drain; ``monitor`` problems and notes never do;
- when ``--max-drained`` nodes of the cluster already carry a ``gputopo:`` drain, nothing more is drained
  (a bad driver roll-out or a wrong rule must not empty a cluster): reported, not done;
- only a node whose current reason is gputopo's own is resumed.

Every decision not to act says why (``held_back``), so the operator reads it in the check's output.
``scontrol show node`` text is parsed here; running it is ``system/slurm_node``'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gputopo.errors import UsageError
from gputopo.findings import PROBLEM, Finding
from gputopo.health.rules import DRAIN_ACTIONS

PREFIX = "gputopo:"
# ``gputopo accept --gate``'s own drains ("gputopo: accepting", "gputopo: accept rejected: ..."): only
# accept lifts them (when the node is accepted); check neither resumes nor rewrites them.
ACCEPT_PREFIX = "gputopo: accept"
# Slurm stores a node's reason as free text; `sinfo -R` shows it in a column and slurmctld's log in one
# line. gputopo keeps its reasons to this many characters, the count of further problems kept at the end.
REASON_CHARS = 200
# --max-drained's default: at most this share of the cluster's nodes carry a gputopo drain (at least one
# node may always be drained).
DEFAULT_MAX_DRAINED = "10%"
# Slurm node state flags that mean the node takes no new jobs (scontrol show node: State=IDLE+DRAIN, DOWN*,
# MIXED+DRAIN, FAIL, ...).
_OUT_OF_SERVICE = ("DRAIN", "DOWN", "FAIL", "MAINT", "REBOOT")


@dataclass(frozen=True)
class NodeInfo:
    """One node as ``scontrol show node`` prints it: its name, its state words and its reason (Slurm's
    ``[user@time]`` stamp taken off; ``None`` when it has none)."""

    name: str
    state: str
    reason: str | None = None

    @property
    def out_of_service(self) -> bool:
        words = re.split(r"[+*~#!%$@^-]+", self.state.upper())
        return any(w.startswith(flag) for w in words for flag in _OUT_OF_SERVICE)

    @property
    def ours(self) -> bool:
        """Whether the reason is gputopo's own (``gputopo: ...``)."""
        return bool(self.reason) and str(self.reason).startswith(PREFIX)

    @property
    def drained_by_gputopo(self) -> bool:
        return self.out_of_service and self.ours

    @property
    def held_by_accept(self) -> bool:
        """Drained by ``gputopo accept --gate`` (its reason starts ``gputopo: accept``)."""
        return self.out_of_service and str(self.reason or "").startswith(ACCEPT_PREFIX)

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "state": self.state, "reason": self.reason}


def parse_show_node(text: str) -> list[NodeInfo]:
    """The nodes of ``scontrol show node [NAME]`` (several lines a node, blocks parted by a blank line) or
    ``scontrol -o show node`` (one line a node)."""
    nodes: list[NodeInfo] = []
    for block in re.split(r"\n\s*\n|\n(?=NodeName=)", text.strip()):
        name = re.search(r"(?:^|\s)NodeName=(\S+)", block)
        if name is None:
            continue
        state = re.search(r"(?:^|\s)State=(\S+)", block)
        reason = None
        m = re.search(r"(?:^|\s)Reason=(.*)$", block, re.MULTILINE)
        if m:
            reason = m.group(1).strip()
            stamp = re.search(r"\s*\[[^\[\]]*@[^\[\]]*\]\s*$", reason)
            if stamp:
                reason = reason[: stamp.start()].rstrip()
            reason = reason or None
        nodes.append(NodeInfo(name.group(1), state.group(1) if state else "", reason))
    return nodes


def parse_max_drained(text: str) -> tuple[int | None, float | None]:
    """``--max-drained N`` (nodes) or ``N%`` (of the cluster's nodes) as (count, fraction); ``UsageError``
    for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(%?)\s*", text or "")
    if not m or (not m.group(2) and "." in m.group(1)):
        raise UsageError(
            f"--max-drained {text}: not a node count or a percentage",
            f"e.g. --max-drained 2 or --max-drained 10% (the default, {DEFAULT_MAX_DRAINED})",
        )
    if m.group(2):
        pct = float(m.group(1))
        if not 0 < pct <= 100:
            raise UsageError(f"--max-drained {text}: a percentage above 0 and at most 100", "e.g. 10%")
        return None, pct / 100
    return int(m.group(1)), None


def max_drained_nodes(count: int | None, fraction: float | None, cluster_nodes: int) -> int:
    """The limit in nodes: ``count``, or ``fraction`` of the cluster rounded down, and never below 1."""
    if count is not None:
        return count
    return max(1, math.floor((fraction or 0) * cluster_nodes + 1e-9))


def slurm_reason(problems: Sequence[Finding], limit: int = REASON_CHARS) -> str:
    """The drain reason: ``gputopo: <first problem> (+N more)``, one line within ``limit`` characters; the
    first problem's words are cut, never the count."""
    first = _flat(problems[0].what) if problems else "problems found"
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    room = limit - len(PREFIX) - 1 - len(more)
    if len(first) > room:
        first = first[: max(0, room - 3)].rstrip() + "..."
    return f"{PREFIX} {first}{more}"


def _flat(text: str) -> str:
    return " ".join(text.replace('"', "").replace("'", "").replace("`", "").split())


@dataclass(frozen=True)
class Decision:
    """``action`` drain|resume|none; ``reason`` the drain reason; ``held_back`` why nothing (or less) was
    done, in words an operator reads; ``withheld`` the action (drain|resume) the check calls for that
    ``held_back`` stops, so a dry run can show the command it would otherwise run."""

    action: str
    reason: str | None = None
    held_back: str | None = None
    withheld: str | None = None


def drain_worthy(findings: Sequence[Finding]) -> list[Finding]:
    """The problems whose action takes a GPU out of service (never ``monitor``, never a note)."""
    return [f for f in findings if f.severity == PROBLEM and f.action in DRAIN_ACTIONS]


def decide(
    verdict: str,
    findings: Sequence[Finding],
    node: NodeInfo | None,
    *,
    drain: bool,
    resume: bool,
    drained_elsewhere: int = 0,
    max_drained: int | None = None,
) -> Decision:
    """What to do to ``node`` (as Slurm shows it now; ``None`` when it could not be read: nothing is done)
    after a check ended in ``verdict`` with ``findings``. ``drained_elsewhere`` counts the other nodes
    that carry a gputopo drain; ``max_drained`` the most that may (``None``: no limit)."""
    if verdict == "problems" and drain:
        worthy = drain_worthy(findings)
        if not worthy:
            actions = sorted({f.action for f in findings if f.severity == PROBLEM})
            return Decision(
                "none",
                held_back="not drained: no problem asks for it (their action: "
                f"{', '.join(actions) or 'none'}; only {', '.join(DRAIN_ACTIONS)} drain)",
            )
        reason = slurm_reason(worthy)
        if node is None:
            return Decision("none", reason, "not drained: the node's state could not be read", "drain")
        if node.out_of_service and not node.ours:
            return Decision(
                "none",
                reason,
                f"not drained: {node.name} is already {node.state} by someone else "
                f"(Reason={node.reason or 'none'}); their reason is kept",
                "drain",
            )
        if node.held_by_accept:  # accept's gate holds it already; its reason stays
            return Decision("none", reason, None)
        if node.drained_by_gputopo:
            if node.reason == reason:
                return Decision("none", reason, None)
            return Decision("drain", reason)  # gputopo's own reason, brought up to date
        if max_drained is not None and drained_elsewhere >= max_drained:
            return Decision(
                "none",
                reason,
                f"not drained: {drained_elsewhere} node{'s' if drained_elsewhere != 1 else ''} already "
                f"carry a gputopo drain (--max-drained {max_drained}); a bad roll-out must not empty the "
                "cluster: look at them first",
                "drain",
            )
        return Decision("drain", reason)
    if verdict == "healthy" and resume:
        if node is None:
            return Decision(
                "none", held_back="not resumed: the node's state could not be read", withheld="resume"
            )
        if node.held_by_accept:
            return Decision(
                "none",
                held_back=f"not resumed: `gputopo accept --gate` holds {node.name} (Reason={node.reason}); "
                "it resumes the node when the node is accepted",
                withheld="resume",
            )
        if node.drained_by_gputopo:
            return Decision("resume")
        if node.out_of_service:
            return Decision(
                "none",
                held_back=f"not resumed: {node.name} is {node.state} by someone else "
                f"(Reason={node.reason or 'none'})",
                withheld="resume",
            )
    return Decision("none")
