"""One command on every node of a Slurm allocation, within a deadline (``gputopo nodes --slurm``).

``srun --nodes=N --nodelist=LIST --ntasks-per-node=1 --label CMD`` starts one task per node; ``--label``
prefixes each line a task prints with its task number and ``": "`` (srun(1), ``-l, --label``), so the
tasks' outputs are told apart on one stdout. srun is started in its own session: when the deadline
passes it gets SIGINT twice (srun(1): a second Ctrl-C within one second cancels the step), then SIGKILL;
what the tasks had printed by then is kept, and the caller names the nodes that did not answer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

from gputopo.errors import stop_held
from gputopo.system.scontrol import NO_PATH_DIRS

# How long srun may take to wind down after the deadline before it is killed.
GRACE_S = 3.0


def srun_path() -> str | None:
    if "PATH" in os.environ:
        return shutil.which("srun")
    return shutil.which("srun", path=os.pathsep.join(NO_PATH_DIRS))


def run_on_nodes(
    nodelist: str, count: int, argv: Sequence[str], timeout_s: float
) -> tuple[dict[int, str], str | None]:
    """Run ``argv`` once on each of the ``count`` nodes of ``nodelist``; each task's output by task
    number, and what went wrong (srun missing, failed, or past ``timeout_s``) or ``None``."""
    exe = srun_path()
    if exe is None:
        return {}, "srun not found (PATH, /usr/bin, /usr/local/bin, ...)"
    cmd = [
        exe,
        f"--nodes={count}",
        f"--nodelist={nodelist}",
        "--ntasks-per-node=1",
        "--label",
        "--kill-on-bad-exit=0",
        *argv,
    ]
    error = None
    proc: subprocess.Popen[str] | None = None
    try:
        with stop_held():  # a stop signal meanwhile is raised below, where srun is stopped with gputopo
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    errors="replace",
                    start_new_session=True,
                )
            except OSError as exc:
                return {}, f"srun could not start ({exc.strerror or exc})"
        out, err = proc.communicate(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        assert proc is not None
        out, err = _stop(proc)
        error = f"srun ran past the budget ({timeout_s:.0f} s) and was stopped"
    except KeyboardInterrupt:  # gputopo stopped (Ctrl-C, scancel): srun's own session goes with it
        if proc is not None:
            _stop(proc)
        raise
    if error is None and proc.returncode != 0:
        last = (err or "").strip().splitlines()
        error = f"srun exited {proc.returncode}" + (f": {last[-1][:200]}" if last else "")
    return split_labelled(out or ""), error


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGINT twice (srun cancels the step), then SIGKILL to its session; what it printed."""
    for _ in range(2):
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except OSError:
            break
        time.sleep(0.2)
    try:
        return proc.communicate(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            return proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:  # a task that left the session still holds the pipes
            return "", ""


def split_labelled(text: str) -> dict[int, str]:
    """``--label`` output (``"0: line"``, the number right-aligned when there are more tasks) -> each
    task's lines, joined."""
    tasks: dict[int, list[str]] = {}
    for line in text.splitlines():
        head, sep, rest = line.partition(": ")
        if not sep or not head.strip().isdigit():
            continue
        tasks.setdefault(int(head.strip()), []).append(rest)
    return {t: "\n".join(lines) for t, lines in tasks.items()}
