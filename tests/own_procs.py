"""Processes a test started, and only those: a marker in the environment that every descendant inherits.

A test that asks "is anything left?" must not look at the rest of the machine: another gputopo run (a
second test session, a user's probe, a CI job beside this one) would fail it. Each launch gets its own
marker; ``leftovers`` lists the live processes that carry it, whoever their parent is now (an orphan
reparented to PID 1 keeps its environment, so it is still found).
"""

from __future__ import annotations

import os
import time
import uuid

import psutil

MARKER_VAR = "GPUTOPO_TEST_OWNER"


def new_marker() -> str:
    """A marker no other launch shares."""
    return uuid.uuid4().hex


def marked_env(marker: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the marker set."""
    return {**(os.environ if base is None else base), MARKER_VAR: marker}


def leftovers(marker: str) -> list[str]:
    """Command lines of the live (not zombie) processes that carry ``marker``."""
    found = []
    for proc in psutil.process_iter():
        try:
            # Reading another user's environment is refused: those processes are not ours anyway.
            if proc.environ().get(MARKER_VAR) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(proc.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_for_none_left(marker: str, within_s: float = 5.0) -> list[str]:
    """``leftovers`` after giving exiting processes up to ``within_s`` to go (empty: nothing left)."""
    deadline = time.monotonic() + within_s
    left = leftovers(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = leftovers(marker)
    return left
