"""DCGM's active diagnostic on this node: ``dcgmi diag -r LEVEL -j``, within a budget, never a stall.

``dcgmi`` is looked for on ``PATH`` and then where DCGM's packages put it; missing, it is "not checked" with
the reason. It runs in a session of its own. At the budget's end (less a grace) it gets SIGTERM, on which
``dcgmi`` asks the host engine to stop the diagnostic and waits for it (``dcgmi/Diag.cpp`` at 72fa3fe,
``handle_signal_during_diag`` and ``ExecuteDiagOnServer``, lines 93-108 and 522-570: SIGHUP, SIGINT,
SIGQUIT and SIGTERM all do so); at the budget's end its process group is killed. A stop signal to gputopo
does the same at once, with a short grace. ``dcgmi``'s own ``--timeout`` is not used: DCGM 3.2 has none.

What the output means is judged in ``health.dcgm_diag``; output that is not DCGM's JSON (no host engine:
``dcgmi`` prints a line of text and exits non-zero) is "not checked" with that line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import time

from gputopo.errors import UsageError, stop_held
from gputopo.health.dcgm_diag import DcgmDiagResult, judge_documents, not_checked, split_documents

DCGMI = "dcgmi"
SEARCH_DIRS = ("/usr/bin", "/usr/local/bin", "/usr/sbin", "/usr/local/dcgm/bin")
LEVELS = (1, 2, 3, 4)
# What each level usually takes (DCGM's dcgmi diag page: level 1 seconds, 2 about two minutes, 3 about
# fifteen, 4 longer), with room: the default budget of each.
DEFAULT_BUDGET_S = {1: 120.0, 2: 600.0, 3: 2700.0, 4: 7200.0}
# Below this no run is started: no level finishes in it.
MIN_BUDGET_S = 1.0
# Time given to dcgmi to stop the host engine's diagnostic after SIGTERM (DCGM itself waits up to 25 s).
STOP_GRACE_S = 25.0
SIGNAL_GRACE_S = 5.0  # the same, when gputopo itself is being stopped
MAX_OUTPUT_BYTES = 8 * 1024 * 1024


def dcgmi_path() -> str | None:
    """``dcgmi`` on ``PATH``, else in DCGM's install directories."""
    return shutil.which(DCGMI) or shutil.which(DCGMI, path=os.pathsep.join(SEARCH_DIRS))


def run_dcgm_diag(level: int, budget_s: float, exe: str | None = None) -> DcgmDiagResult:
    """Run ``dcgmi diag -r LEVEL -j`` and judge its answer, within ``budget_s`` seconds in all.

    Never raises for the machine's sake: no ``dcgmi``, a hang, a spent budget, or an answer that is not
    DCGM's JSON are each a result with ``status`` "not checked" and the ``reason``. A stop signal
    (``KeyboardInterrupt`` / ``errors.Interrupted``) stops ``dcgmi`` (and the diagnostic it started) and is
    raised again. The result records ``level``. ``level`` outside 1-4 is a ``UsageError``.
    """
    return dataclasses.replace(_run(level, budget_s, exe), level=level)


def _run(level: int, budget_s: float, exe: str | None) -> DcgmDiagResult:
    """``run_dcgm_diag``'s work, before the level is recorded."""
    if level not in LEVELS:
        raise UsageError(f"--dcgm-level {level}: DCGM's levels are 1 to 4", "e.g. --dcgm-level 3")
    command = [DCGMI, "diag", "-r", str(level), "-j"]
    line = shlex.join(command)
    exe = exe or dcgmi_path()
    if exe is None:
        return not_checked(f"{DCGMI} not found (PATH, {', '.join(SEARCH_DIRS)}): DCGM is not installed", line)
    if budget_s < MIN_BUDGET_S:
        return not_checked(f"`{line}` not run: the time budget was spent", line)
    started = time.monotonic()
    proc: subprocess.Popen[bytes] | None = None
    try:
        with stop_held():
            try:
                proc = subprocess.Popen(
                    [exe, *command[1:]],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as exc:
                return not_checked(f"`{line}` could not start: {exc.strerror or exc}", line)
        grace = min(STOP_GRACE_S, budget_s / 4)
        try:
            out, err = proc.communicate(timeout=max(0.1, budget_s - grace))
        except subprocess.TimeoutExpired:
            _stop(proc, max(0.1, budget_s - (time.monotonic() - started)))
            spent = time.monotonic() - started
            return not_checked(
                f"`{line}` did not finish within its budget of {budget_s:g} s (stopped after {spent:.0f} s)",
                line,
            )
    except KeyboardInterrupt:
        if proc is not None:
            _stop(proc, SIGNAL_GRACE_S)
        raise
    return judge_output(out[:MAX_OUTPUT_BYTES], err[:MAX_OUTPUT_BYTES], proc.returncode, line)


def judge_output(out: bytes, err: bytes, returncode: int | None, line: str) -> DcgmDiagResult:
    """``dcgmi``'s answer, judged: its JSON when it wrote some (it exits non-zero on a failed test, so the
    exit code alone says little), else "not checked" with its first words."""
    from gputopo.errors import InputError

    text = out.decode("utf-8", "replace")
    if "{" in text:
        try:
            return judge_documents(split_documents(text, f"`{line}`"), line)
        except InputError as exc:
            return not_checked(exc.message, line)
    said = next(
        (s.strip() for s in (text + "\n" + err.decode("utf-8", "replace")).splitlines() if s.strip()),
        "no output",
    )
    hint = " (is nv-hostengine running?)" if "host" in said.lower() or "connect" in said.lower() else ""
    return not_checked(f"`{line}` gave no JSON (exit {returncode}): {said[:200]}{hint}", line)


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to ``dcgmi``'s group (it stops the host engine's diagnostic); SIGKILL after ``grace_s``."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=grace_s)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        with contextlib.suppress(OSError):
            proc.kill()
    # A grandchild that left the group may still hold the pipes: give up on it after a second.
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=1.0)
