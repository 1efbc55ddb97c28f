"""Which failure of a launch is the root cause: pure, on the records the agent writes."""

from __future__ import annotations

from typing import Any

# What a rank prints when it fails only because a peer went away first: a consequence, not the cause.
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
    "Socket Timeout",
)


def root_cause_order(failure: dict[str, Any]) -> tuple[bool, float, int]:
    """Sort key putting the root cause first: ranks that did not merely lose a peer or get stopped by
    the agent (SIGTERM, which it sends to every other rank once one has failed), then the earliest
    (torch's timestamps have one-second resolution, so a rank that crashed and the peer that lost it
    often tie), then the lowest rank."""
    text = f"{failure.get('message') or ''}\n{failure.get('stderr_tail') or ''}"
    lost_peer = any(p in text for p in _PEER_LOST) or failure.get("signal") == "SIGTERM"
    stamp = failure.get("timestamp")
    return (lost_peer, float(stamp) if stamp is not None else float("inf"), int(failure["rank"]))
