"""Stopping processes safely: SIGTERM, wait a grace period, then SIGKILL (psutil).

A process is ``(pid, create_time)``. Before every signal the pid is looked up afresh and its start time
compared with the one recorded when it was listed: if they differ, the pid now belongs to another
process and nothing is sent. A zombie counts as gone (it has exited and released its files and GPU
memory; only its parent's ``wait()`` is missing) unless other threads of it live on: then only its main
thread has exited, the process still runs and holds its files, and a signal to its pid reaches them.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from enum import Enum

import psutil

from gputopo.procs.holders import ProcessRef
from gputopo.procs.stale import StopOutcome, StopResult

# How long a process may take to vanish after SIGKILL before it is reported as failed.
KILL_WAIT_S = 5.0
_POLL_S = 0.05


class _State(Enum):
    ALIVE = "alive"
    GONE = "gone"
    REUSED = "reused"
    DENIED = "denied"


def _look(ref: ProcessRef) -> tuple[_State, psutil.Process | None]:
    """Whether ``ref`` still runs, judged on a fresh lookup (psutil caches the start time per object)."""
    try:
        proc = psutil.Process(ref.pid)
        if proc.create_time() != ref.create_time_s:
            return _State.REUSED, None
        if proc.status() == psutil.STATUS_ZOMBIE and proc.num_threads() <= 1:
            return _State.GONE, None
    except psutil.NoSuchProcess:  # ZombieProcess is a NoSuchProcess too
        return _State.GONE, None
    except psutil.AccessDenied:
        return _State.DENIED, None
    return _State.ALIVE, proc


def _send(ref: ProcessRef, sig: signal.Signals) -> _State:
    """Send ``sig`` to ``ref`` only if the pid still names the same process; ALIVE means it was sent."""
    state, proc = _look(ref)
    if state is not _State.ALIVE or proc is None:
        return state
    try:
        # psutil checks once more that the pid was not reused since ``proc`` was made, just before kill().
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        return _State.GONE
    except (psutil.AccessDenied, PermissionError):
        return _State.DENIED
    return _State.ALIVE


def _wait_gone(
    refs: Sequence[ProcessRef],
    timeout_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> list[ProcessRef]:
    """Poll until every process in ``refs`` is gone or ``timeout_s`` passes; returns those still alive."""
    deadline = clock() + timeout_s
    alive = list(refs)
    while True:
        alive = [r for r in alive if _look(r)[0] in (_State.ALIVE, _State.DENIED)]
        if not alive or clock() >= deadline:
            return alive
        sleep(min(_POLL_S, max(0.0, deadline - clock())))


def stop_processes(
    refs: Sequence[ProcessRef],
    grace_s: float,
    kill_wait_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[StopOutcome]:
    """Stop ``refs``: SIGTERM to all, wait up to ``grace_s``, SIGKILL to the survivors, wait up to
    ``kill_wait_s`` (default ``KILL_WAIT_S``). Returns one outcome per ref, in the order given. Never
    raises for a process that vanished, was reused, or may not be signalled: those are outcomes."""
    if kill_wait_s is None:
        kill_wait_s = KILL_WAIT_S
    outcomes: dict[ProcessRef, StopOutcome] = {}
    signalled: list[ProcessRef] = []
    for ref in dict.fromkeys(refs):
        state = _send(ref, signal.SIGTERM)
        if state is _State.ALIVE:
            signalled.append(ref)
        elif state is _State.GONE:
            outcomes[ref] = StopOutcome(ref, StopResult.ALREADY_GONE, "exited before it was signalled")
        elif state is _State.REUSED:
            outcomes[ref] = StopOutcome(
                ref, StopResult.ALREADY_GONE, f"pid {ref.pid} now belongs to another process; not signalled"
            )
        else:
            outcomes[ref] = StopOutcome(ref, StopResult.ACCESS_DENIED, "not permitted to signal it")

    survivors = _wait_gone(signalled, grace_s, clock, sleep)
    for ref in signalled:
        if ref not in survivors:
            outcomes[ref] = StopOutcome(ref, StopResult.TERMINATED, "exited after SIGTERM")

    killed: list[ProcessRef] = []
    for ref in survivors:
        state = _send(ref, signal.SIGKILL)
        if state is _State.ALIVE:
            killed.append(ref)
        elif state in (_State.GONE, _State.REUSED):
            outcomes[ref] = StopOutcome(
                ref, StopResult.TERMINATED, "exited after SIGTERM, at the end of the grace"
            )
        else:
            outcomes[ref] = StopOutcome(
                ref, StopResult.ACCESS_DENIED, f"ignored SIGTERM for {grace_s:g} s and SIGKILL was refused"
            )

    stuck = _wait_gone(killed, kill_wait_s, clock, sleep)
    for ref in killed:
        if ref in stuck:
            outcomes[ref] = StopOutcome(ref, StopResult.FAILED, _stuck_detail(ref, kill_wait_s))
        else:
            outcomes[ref] = StopOutcome(ref, StopResult.KILLED, f"ignored SIGTERM for {grace_s:g} s; SIGKILL")
    return [outcomes[ref] for ref in dict.fromkeys(refs)]


def _stuck_detail(ref: ProcessRef, waited_s: float) -> str:
    """Why a process outlived SIGKILL, as far as its state tells."""
    state, proc = _look(ref)
    status = None
    if state is _State.ALIVE and proc is not None:
        try:
            status = proc.status()
        except psutil.Error:
            status = None
    if status == psutil.STATUS_DISK_SLEEP:
        return (
            f"still running {waited_s:g} s after SIGKILL, in uninterruptible sleep (stuck in the kernel, "
            "likely the GPU driver): a GPU reset or a reboot may be needed"
        )
    return f"still running {waited_s:g} s after SIGKILL (state {status or 'unknown'})"
