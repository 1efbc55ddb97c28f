"""Two process facts psutil does not give directly, for kill-stale: the pid in every PID namespace, and the
environment variables launchers put on their workers (touches the machine).

- ``NSpid`` in ``/proc/PID/status`` lists the process's pid in each PID namespace it belongs to, from the
  namespace of whoever mounted this ``/proc`` to the innermost one (proc_pid_status(5)). It is how a pid
  that NVML reports from another namespace can be matched to a process here.
- ``/proc/PID/environ`` is the environment the program was started with (``execve``), not what it set
  since (proc_pid_environ(5)); that is what launchers such as torchrun pass to their ranks. Reading it
  needs a ptrace "read" permission (PTRACE_MODE_READ_FSCREDS): in practice the same user or root, and even
  root is refused for some processes (in this project's CI container, root cannot read PID 1's). Only the
  launcher variables in ``LAUNCH_ENV_KEYS`` are kept: an environment can hold secrets.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

PROC_ROOT = Path("/proc")

# What torchrun / torch.distributed.elastic and torch.distributed.launch set on the workers they start
# (torch/distributed/elastic/agent/server/local_elastic_agent.py, torch/distributed/launch.py).
LAUNCH_ENV_KEYS = (
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "GROUP_RANK",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def read_nspid(pid: int, proc_root: Path = PROC_ROOT) -> tuple[int, ...] | None:
    """The ``NSpid`` line of ``/proc/PID/status``: the pid in each PID namespace, outermost first.

    ``None`` when the process is gone, the file cannot be read, or the kernel predates the field (4.1).
    """
    try:
        text = (proc_root / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            try:
                return tuple(int(v) for v in line.split()[1:])
            except ValueError:
                return None
    return None


def read_threads(pid: int, proc_root: Path = PROC_ROOT) -> tuple[tuple[int, str], ...] | None:
    """Every thread of ``pid`` as ``(tid, state letter)``, from ``/proc/PID/task/TID/stat`` (proc_pid_stat(5):
    the state is the first field after the parenthesised command name, which may itself hold spaces and
    parentheses, hence the split at the last ``)``). ``None`` when the task folder cannot be read."""
    try:
        tids = sorted(int(t) for t in os.listdir(proc_root / str(pid) / "task") if t.isdigit())
    except OSError:
        return None
    threads = []
    for tid in tids:
        state = _stat_state(proc_root / str(pid) / "task" / str(tid) / "stat")
        if state is not None:
            threads.append((tid, state))
    return tuple(threads)


def _stat_state(path: Path) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return fields[0] if fields else None


def zombie_leader_files(wanted: dict[str, str], proc_root: Path = PROC_ROOT) -> dict[int, tuple[str, ...]]:
    """Files of ``wanted`` (real path -> name to report) held by the live threads of an exited main thread.

    When a process's main thread exits while others run, the kernel keeps the main thread as a zombie until
    the last thread exits (torvalds/linux kernel/exit.c: ``release_task`` notifies the parent only once
    ``thread_group_empty``), and its ``/proc/PID/fd`` is empty: ``do_exit`` has dropped that thread's
    reference to the file table (``exit_files``), and ``/proc/PID/fd`` reads the main thread's. The files
    stay open through the other threads, ``/proc/PID/task/TID/fd``. lsof 4.95 (measured here) does not
    report them, and neither does a ``/proc/*/fd`` scan, so such a process would hold a GPU unseen.
    Only zombies are looked at (their state in ``/proc/PID/stat``)."""
    out: dict[int, tuple[str, ...]] = {}
    try:
        pids = [int(e.name) for e in os.scandir(proc_root) if e.name.isdigit()]
    except OSError:
        return out
    for pid in sorted(pids):
        if _stat_state(proc_root / str(pid) / "stat") != "Z":
            continue
        held: list[str] = []
        for tid, state in read_threads(pid, proc_root) or ():
            if tid == pid or state in "ZX":
                continue
            fd_dir = proc_root / str(pid) / "task" / str(tid) / "fd"
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(fd_dir / fd)
                except OSError:
                    continue
                if target in wanted and wanted[target] not in held:
                    held.append(wanted[target])
        if held:
            out[pid] = tuple(held)
    return out


def read_launch_env(proc: psutil.Process) -> tuple[tuple[str, str], ...] | None:
    """The launcher variables (``LAUNCH_ENV_KEYS``) in the process's start-up environment, in that order.

    ``None`` when the environment cannot be read (another user's process, a non-dumpable one, or gone).
    """
    try:
        env = proc.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, OSError):
        return None
    return tuple((k, env[k]) for k in LAUNCH_ENV_KEYS if k in env)


def not_the_same_process(pid: int, started: float | None) -> str | None:
    """Why ``pid`` is no longer the process that started at ``started`` (psutil's ``create_time``), or
    ``None`` when it still is (or no start time was recorded to compare with). A process is (pid, start
    time), never a bare pid: a PID the kernel gave to a new process must not be read as the old one."""
    try:
        now = psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return "the process is gone"
    except (psutil.AccessDenied, OSError):
        return None  # cannot tell; py-spy then says what it can
    # create_time is boot time + the start tick, computed the same way in every reader: a reused PID
    # differs by far more than the rounding between two reads.
    if started is not None and abs(now - started) > 0.05:
        return f"PID {pid} now belongs to another process (started {now:.2f}, the rank started {started:.2f})"
    return None


def environ_value(pid: int, key: str, proc_root: Path = PROC_ROOT) -> str | None:
    """One variable of ``/proc/PID/environ`` (the environment the process was started with), or
    ``None`` when it is not set or cannot be read. Only the one variable asked for is kept."""
    try:
        raw = (proc_root / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    prefix = key.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode("utf-8", "replace")
    return None
