"""What a GPU holder is in its job, and whether its launcher is gone (pure).

kill-stale exists for the leftovers of a crashed or interrupted launch: ranks whose launcher died and
workers whose parent died. A worker is recognised only by what the launchers put there:

- **rank**: started by torchrun / torch.distributed.elastic (``TORCHELASTIC_RUN_ID`` with ``GROUP_RANK``
  or ``LOCAL_RANK`` in its start-up environment) or by torch.distributed.launch (``LOCAL_RANK``,
  ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``);
- **spawn worker**: a multiprocessing ``spawn`` or ``forkserver`` child (its command line runs
  ``multiprocessing.spawn.spawn_main`` with ``--multiprocessing-fork``, or ``multiprocessing.forkserver``);
- **fork worker**: a DataLoader or other ``fork`` worker, recognised by lineage: its parent runs the same
  command line (fork copies it; only ``exec`` changes it). Once the parent is gone that lineage is gone
  too, so an orphaned fork worker is recognised only when it also carries a rank's environment (a
  DataLoader worker of a torchrun rank inherits it).

Its launcher is **gone** when Linux has reparented it: its parent is now PID 1, or the pid of its parent
names a younger process, or it was adopted by a subreaper (PR_SET_CHILD_SUBREAPER: "reparented to the
nearest still living ancestor subreaper"). The kernel does not say who is a subreaper; adoption shows when
the worker, not a session leader, sits in another session than its parent (a child inherits its parent's
session and only ``setsid()`` changes it, making the caller a leader), or when the parent is a known
init. torchrun starts each rank in a session of its own (``start_new_session=True`` in
torch.distributed.elastic's SubprocessHandler), so a rank adopted by a subreaper that is not a known init
leaves no evidence and is not called stale; on most machines the adopter is PID 1.

Two exceptions: a new parent that is a process of the same job (a launcher, or a process with the same
rendezvous) keeps it, and so does PID 1 when PID 1 is itself the launcher (a container whose PID 1 is
torchrun or the training script). When PID 1 cannot be read, whether it is the launcher is unknown and
nothing is called stale for being its child. And a rank known only by ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and ``MASTER_ADDR`` (no ``TORCHELASTIC_*``) may be the own child of an init, a supervisor
or a batch script that set them, so for it only the session evidence counts.

A process without worker marks is never stale by these rules: with parent PID 1 it is **detached** (a
nohup'd training, a service, a notebook), otherwise a **process** with a live parent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gputopo.procs.holders import ProcessInfo

# Inits and supervisors: they adopt orphans (as PID 1, or as subreapers), and they start services too.
INIT_NAMES = frozenset(
    {
        "init",
        "systemd",
        "tini",
        "tini-static",
        "dumb-init",
        "docker-init",
        "catatonit",
        "s6-svscan",
        "s6-supervise",
        "runit",
        "runsv",
        "supervisord",
        "containerd-shim",
        "containerd-shim-runc-v2",
        "conmon",
    }
)

# Never a torch launcher when they are PID 1: the inits, and the shells and placeholders containers run
# as PID 1 (an entrypoint shell that ran torchrun is not torchrun). A live shell is an ordinary parent.
NOT_LAUNCHER_NAMES = INIT_NAMES | frozenset(
    {"sh", "bash", "dash", "zsh", "ash", "sleep", "jupyter", "jupyter-lab", "jupyter-notebook", "jupyterhub"}
)

# Command-line words that name a torch launcher (the script name, or the module run with ``-m``).
_LAUNCHER_WORDS = frozenset({"torchrun", "torch.distributed.run", "torch.distributed.launch"})
_LAUNCHER_PREFIXES = ("torch.distributed.elastic", "deepspeed.launcher")

_WEAK = " (RANK, WORLD_SIZE... are set by orchestrators and batch scripts too)"

_SPAWN_MARKS = ("from multiprocessing.spawn import spawn_main", "from multiprocessing.forkserver import main")


@dataclass(frozen=True)
class JobRole:
    """A holder's place in its job.

    ``kind`` is ``rank``, ``spawn worker``, ``fork worker``, ``detached`` or ``process``; ``marks`` says
    what it was recognised by; ``parent`` describes its launcher or parent; ``gone`` is why its launcher is
    gone (the stale reason), ``None`` when it is not; ``why`` says, when it is not stale, why not.
    """

    kind: str
    marks: str | None
    parent: str
    gone: str | None
    why: str | None

    @property
    def worker(self) -> bool:
        """True for a process that a launcher started (rank, spawn worker, fork worker)."""
        return self.kind in ("rank", "spawn worker", "fork worker")


def describe(info: ProcessInfo | None, pid: int | None = None) -> str:
    """``1234 (python)``, or the bare pid when the process could not be read."""
    if info is None:
        return f"{pid}" if pid is not None else "?"
    return f"{info.pid} ({info.name or '?'})"


def rank_marks(info: ProcessInfo) -> str | None:
    """What makes it a rank of a torch launcher, from its start-up environment; ``None`` if nothing."""
    env = info.env
    if "TORCHELASTIC_RUN_ID" in env and ("GROUP_RANK" in env or "LOCAL_RANK" in env):
        rank = env.get("RANK", env.get("LOCAL_RANK", "?"))
        return f"torchrun rank {rank} of run {env['TORCHELASTIC_RUN_ID']}"
    if all(k in env for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return f"torch.distributed.launch rank {env['RANK']} of {env['WORLD_SIZE']}"
    return None


def spawn_marks(info: ProcessInfo) -> str | None:
    """What makes it a multiprocessing spawn or forkserver child, from its command line."""
    cmdline = info.cmdline or ()
    if any(m in arg for arg in cmdline for m in _SPAWN_MARKS) or "--multiprocessing-fork" in cmdline:
        return "multiprocessing spawn/forkserver child"
    return None


def forked_from(info: ProcessInfo, parent: ProcessInfo | None) -> bool:
    """True when ``info`` looks forked (not exec'd) from its live parent: the same command line, and the
    parent its parent, not an adopter (see ``adopted``)."""
    if parent is None or not info.cmdline or adopted(info, parent):
        return False
    return parent.cmdline == info.cmdline


def is_launcher(info: ProcessInfo) -> bool:
    """True for a torch launcher: torchrun, ``python -m torch.distributed.run`` or ``.launch``, an elastic
    agent, or DeepSpeed's launcher."""
    for arg in info.cmdline or ():
        word = os.path.basename(arg)
        if word in _LAUNCHER_WORDS or any(word.startswith(p) for p in _LAUNCHER_PREFIXES):
            return True
    return any(n in _LAUNCHER_WORDS for n in info.identities)


def is_python(info: ProcessInfo) -> bool:
    """True for a Python interpreter (``python``, ``python3.11``; PyTorch may rename its main thread
    ``pt_main_thread``)."""
    return any(n.startswith("python") or n == "pt_main_thread" for n in info.identities)


def is_init(info: ProcessInfo) -> bool:
    """True for an init or supervisor (``INIT_NAMES``): it adopts orphans."""
    return any(n in INIT_NAMES for n in info.identities)


def never_launcher(info: ProcessInfo) -> bool:
    """True for an init, a shell or a placeholder (``NOT_LAUNCHER_NAMES``): not a torch launcher."""
    return any(n in NOT_LAUNCHER_NAMES for n in info.identities)


def same_rendezvous(a: ProcessInfo, b: ProcessInfo) -> bool:
    """True when two processes carry the same launch: one torchrun run id, or one master address, port
    and world size."""
    ea, eb = a.env, b.env
    if ea.get("TORCHELASTIC_RUN_ID") and ea.get("TORCHELASTIC_RUN_ID") == eb.get("TORCHELASTIC_RUN_ID"):
        return True
    keys = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
    return all(ea.get(k) for k in keys) and all(ea.get(k) == eb.get(k) for k in keys)


def launches(candidate: ProcessInfo, worker: ProcessInfo) -> bool:
    """True when ``candidate`` can be the launcher of (or a process of the same job as) ``worker``."""
    if never_launcher(candidate):
        return False
    if is_launcher(candidate) or same_rendezvous(candidate, worker):
        return True
    # The training script itself (mp.spawn, a DataLoader, a hand-written launcher) is a Python process.
    return is_python(candidate)


def _younger(parent: ProcessInfo, info: ProcessInfo) -> bool:
    """True when the process at ``info``'s parent pid started after ``info`` did: not its parent."""
    if parent.create_time_s is None or info.create_time_s is None:
        return False
    return parent.create_time_s > info.create_time_s


def left_session(info: ProcessInfo, other: ProcessInfo) -> bool:
    """True when ``info``, not a session leader, is in another session than ``other``: it cannot be
    ``other``'s own child (a child inherits its parent's session; only ``setsid()`` changes it, and makes
    the caller a leader)."""
    return info.sid is not None and other.sid is not None and info.sid != info.pid and info.sid != other.sid


def adopted(info: ProcessInfo, parent: ProcessInfo) -> bool:
    """The evidence that ``parent`` adopted ``info`` rather than started it (see the module docstring)."""
    return _younger(parent, info) or left_session(info, parent) or is_init(parent)


def role(info: ProcessInfo, parent: ProcessInfo | None, pid1: ProcessInfo | None) -> JobRole:
    """The holder's kind, its launcher or parent, and whether that launcher is gone."""
    marks = rank_marks(info)
    kind = "rank" if marks else None
    spawn = spawn_marks(info)
    # Only torchrun sets TORCHELASTIC_*, and only multiprocessing writes a spawn command line; the plain
    # RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR set can come from an orchestrator or a batch script, so a
    # process with only those may be its init's or supervisor's own child, and needs the session evidence.
    strong = "TORCHELASTIC_RUN_ID" in info.env or spawn is not None
    if spawn:
        kind, marks = "spawn worker", (f"{spawn}, {marks}" if marks else spawn)
    if forked_from(info, parent):
        assert parent is not None
        fork = f"forked from {describe(parent)} (same command line)"
        kind, marks = "fork worker", (f"{fork}, {marks}" if marks else fork)
    ppid = info.ppid
    parent_text = describe(parent, ppid) if ppid else "none"

    if kind is None:
        return _unmarked(info, parent, parent_text)
    if ppid is None or ppid == 0:
        return JobRole(kind, marks, parent_text, None, "no parent to judge by")
    if ppid == 1:
        if pid1 is None or pid1.error or not pid1.identities:
            return JobRole(
                kind, marks, "1", None, "PID 1 cannot be read, so whether it is the launcher is unknown"
            )
        first = f"PID 1 ({pid1.name or '?'})"
        if launches(pid1, info):
            return JobRole(kind, marks, describe(pid1), None, f"{first} is its launcher")
        if not strong and not left_session(info, pid1):
            return JobRole(kind, marks, describe(pid1), None, f"{first} may have started it itself{_WEAK}")
        return JobRole(kind, marks, describe(pid1), f"launcher gone: reparented to {first}", None)
    if parent is None:
        return JobRole(kind, marks, parent_text, None, f"its parent {ppid} could not be read")
    if _younger(parent, info):
        younger = f"launcher gone: pid {ppid} now names a younger process {describe(parent)}"
        return JobRole(kind, marks, parent_text, younger, None)
    if adopted(info, parent):
        if not strong and not left_session(info, parent):
            return JobRole(kind, marks, parent_text, None, f"{parent_text} may have started it itself{_WEAK}")
        if not is_init(parent) and (is_launcher(parent) or same_rendezvous(parent, info)):
            return JobRole(
                kind, marks, parent_text, None, f"adopted by {parent_text}, a process of the same job"
            )
        return JobRole(
            kind,
            marks,
            parent_text,
            f"launcher gone: adopted by {parent_text}, a subreaper outside its job",
            None,
        )
    return JobRole(kind, marks, parent_text, None, f"its launcher or parent {parent_text} is running")


def _unmarked(info: ProcessInfo, parent: ProcessInfo | None, parent_text: str) -> JobRole:
    unread = "" if info.launch_env is not None else " (its environment could not be read)"
    if info.ppid == 1 or (parent is not None and adopted(info, parent)):
        return JobRole(
            "detached",
            None,
            parent_text,
            None,
            f"detached: parent {parent_text} and no launcher marks{unread} "
            "(a nohup'd job, a service, a notebook)",
        )
    return JobRole(
        "process", None, parent_text, None, f"no launcher marks{unread}; its parent {parent_text} runs"
    )
