"""A running Python process's stacks, taken with py-spy (``py-spy dump --pid PID --json``), without
stopping it for more than the moment py-spy reads its memory.

py-spy 0.4's ``dump`` (``py-spy dump --help``): ``--pid``, ``--json`` ("Format output as JSON": a list of
threads, each with ``thread_name``, ``os_thread_id``, ``active``, ``owns_gil`` and ``frames``, innermost
first, each ``name``, ``filename``, ``line``), ``--nonblocking`` (not used: a consistent stack is worth the
pause). It reads the target with ptrace (``process_vm_readv``), so it needs the same user and, where Yama
is on (``/proc/sys/kernel/yama/ptrace_scope`` 1 or more), CAP_SYS_PTRACE or ptrace_scope 0; in a container,
``--cap-add SYS_PTRACE``. This module runs it (the machine tool) and hands back the parsed JSON or why
not, in words; the judging is ``hang.stacks``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DUMP_TIMEOUT_S = 10.0
MISSING = "py-spy is not installed"
MISSING_HINT = "pip install py-spy (it comes with gputopo's `live` extra: pip install 'gputopo[live]')"
PTRACE_HINT = (
    "py-spy reads the process with ptrace: run as the job's user, and where Yama restricts ptrace "
    "(/proc/sys/kernel/yama/ptrace_scope >= 1) run as root, give py-spy CAP_SYS_PTRACE "
    "(sudo setcap cap_sys_ptrace+ep $(which py-spy)) or set `sysctl kernel.yama.ptrace_scope=0`; in a "
    "container add --cap-add SYS_PTRACE"
)


@dataclass(frozen=True)
class StackRead:
    """py-spy's threads for one process, or why there are none (``error``, with ``hint``)."""

    pid: int
    threads: Any = None
    error: str | None = None
    hint: str | None = None


def find_pyspy() -> str | None:
    """py-spy on PATH, else beside this Python (a virtualenv's bin/, not always on PATH)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def ptrace_scope() -> int | None:
    """Yama's ptrace_scope, or ``None`` where Yama is not there."""
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


def dump(pid: int, timeout_s: float = DUMP_TIMEOUT_S, exe: str | None = None) -> StackRead:
    """One process's threads as py-spy sees them."""
    exe = exe or find_pyspy()
    if exe is None:
        return StackRead(pid, error=MISSING, hint=MISSING_HINT)
    try:
        done = subprocess.run(
            [exe, "dump", "--pid", str(pid), "--json"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return StackRead(pid, error=f"py-spy did not answer within {timeout_s:.0f} s")
    except OSError as exc:
        return StackRead(pid, error=f"cannot run py-spy ({exc.strerror or exc})", hint=MISSING_HINT)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        last = said[-1] if said else f"exit {done.returncode}"
        low = (done.stderr or "").lower()
        if "permission" in low or "not permitted" in low or "ptrace" in low:
            scope = ptrace_scope()
            return StackRead(
                pid,
                error=f"ptrace refused ({last})"
                + (f"; ptrace_scope is {scope}" if scope is not None else ""),
                hint=PTRACE_HINT,
            )
        if "no such process" in low or not Path(f"/proc/{pid}").exists():
            return StackRead(pid, error="the process is gone")
        return StackRead(pid, error=f"py-spy failed: {last[:200]}")
    try:
        return StackRead(pid, threads=json.loads(done.stdout))
    except ValueError:
        return StackRead(
            pid, error="py-spy's output is not JSON (py-spy older than 0.3.10?)", hint=MISSING_HINT
        )


def dump_many(pids: list[int], timeout_s: float = DUMP_TIMEOUT_S) -> dict[int, StackRead]:
    """Every process's threads, taken in parallel (one py-spy per process), within ``timeout_s``."""
    exe = find_pyspy()
    if not pids:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(pids))) as pool:
        reads = list(pool.map(lambda p: dump(p, timeout_s, exe), pids))
    return {r.pid: r for r in reads}
