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


def read_launch_env(proc: psutil.Process) -> tuple[tuple[str, str], ...] | None:
    """The launcher variables (``LAUNCH_ENV_KEYS``) in the process's start-up environment, in that order.

    ``None`` when the environment cannot be read (another user's process, a non-dumpable one, or gone).
    """
    try:
        env = proc.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, OSError):
        return None
    return tuple((k, env[k]) for k in LAUNCH_ENV_KEYS if k in env)
