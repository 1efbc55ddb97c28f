"""What a launch needs from this machine (torchrun and its flags, numactl), and the launch itself.

torch is not imported: finding its files and reading ``torch/distributed/run.py`` as text tells whether
torchrun has ``--numa-binding`` in a few milliseconds, where ``import torch`` takes seconds.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputopo.errors import UnavailableError, UsageError, stop_held
from gputopo.model import LaunchTools

# Every process of a `gputopo run` launch carries this in its environment (torchrun passes its environment
# to the ranks), so a stop finds them even once they are reparented away from the command.
RUN_MARKER_ENV = "GPUTOPO_RUN_ID"
# How long the command has to stop by itself after the signal gputopo got is passed on (torchrun stops
# its ranks, a script saves its state), before every process of the launch is stopped.
COMMAND_GRACE_S = 10.0
KILL_GRACE_S = 3.0


def detect_tools() -> LaunchTools:
    """torchrun (on PATH, else ``python -m torch.distributed.run``), its ``--numa-binding``, numactl."""
    spec = importlib.util.find_spec("torch")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return LaunchTools(torchrun=None, numa_binding=None, numactl=shutil.which("numactl") is not None)
    run_py = Path(next(iter(spec.submodule_search_locations))) / "distributed" / "run.py"
    numa_binding = has_numa_binding(run_py)
    try:
        version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    torchrun = ("torchrun",) if shutil.which("torchrun") else (sys.executable, "-m", "torch.distributed.run")
    return LaunchTools(
        torchrun=torchrun,
        torch_version=version,
        numa_binding=numa_binding,
        numactl=shutil.which("numactl") is not None,
    )


def has_numa_binding(run_py: Path) -> bool:
    """True when this torchrun source (``torch/distributed/run.py``) defines ``--numa-binding``."""
    try:
        return '"--numa-binding"' in run_py.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


# How often the ranks' PIDs are looked for: often while the job starts, then now and then (an elastic
# restart gives the ranks new PIDs).
RANK_POLL_FAST_S = 0.5
RANK_POLL_FAST_FOR_S = 120.0
RANK_POLL_SLOW_S = 5.0


@dataclass(frozen=True)
class RankProcess:
    """A rank of the launch as the machine shows it: its global rank and local rank (from the
    environment torch's elastic agent gives each worker: RANK, LOCAL_RANK; torch/distributed/elastic/
    agent/server/local_elastic_agent.py, ``_start_workers``), its PID and start time."""

    rank: int
    local_rank: int | None
    pid: int
    started: float


def find_ranks(root_pid: int, marker: str | None = None) -> list[RankProcess]:
    """The ranks among ``root_pid``'s descendants: each process whose environment has RANK (and this
    launch's marker, when given) and whose parent does not have the same RANK (a rank's own children,
    data loader workers, inherit its environment). Only our own user's processes can be read."""
    import psutil

    try:
        kids = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    rank_of: dict[int, int] = {}
    facts: dict[int, tuple[int | None, float, int]] = {}
    for p in kids:
        try:
            env = p.environ()
            if marker is not None and env.get(RUN_MARKER_ENV) != marker:
                continue
            raw = env.get("RANK")
            if raw is None or not raw.isdigit():
                continue
            local = env.get("LOCAL_RANK")
            rank_of[p.pid] = int(raw)
            facts[p.pid] = (int(local) if local and local.isdigit() else None, p.create_time(), p.ppid())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    out = []
    for pid, rank in rank_of.items():
        local, started, parent = facts[pid]
        if rank_of.get(parent) == rank:
            continue  # a child of the rank (a data loader worker), not the rank
        out.append(RankProcess(rank, local, pid, started))
    return sorted(out, key=lambda r: r.rank)


class RankWatcher(threading.Thread):
    """Looks for the launch's ranks until told to stop, and calls ``on_change`` with every new set (the
    run record is rewritten with them)."""

    def __init__(self, root_pid: int, marker: str, on_change: Callable[[list[RankProcess]], None]) -> None:
        super().__init__(name="gputopo-rank-watcher", daemon=True)
        self.root_pid, self.marker, self.on_change = root_pid, marker, on_change
        self.stopped = threading.Event()
        self.latest: list[RankProcess] = []

    def run(self) -> None:
        begun = time.monotonic()
        seen: list[RankProcess] = []
        while not self.stopped.is_set():
            try:
                found = find_ranks(self.root_pid, self.marker)
            except Exception:  # noqa: BLE001 -- a failed look must not take the launch down; look again
                found = seen
            if found and found != seen:
                seen = found
                self.latest = found
                with contextlib.suppress(Exception):
                    self.on_change(found)
            fast = time.monotonic() - begun < RANK_POLL_FAST_FOR_S
            self.stopped.wait(RANK_POLL_FAST_S if fast else RANK_POLL_SLOW_S)


def run_supervised(
    argv: Sequence[str],
    env: Mapping[str, str],
    grace_s: float = COMMAND_GRACE_S,
    on_ranks: Callable[[list[RankProcess]], None] | None = None,
    on_stop: Callable[[int, list[RankProcess]], None] | None = None,
) -> int:
    """Run ``argv`` in ``env`` as a child and return its exit code (128 + N when signal N ended it).

    The child stays in this process group, so Ctrl-C in a terminal reaches it directly, as it would without
    gputopo. When gputopo itself is stopped (``KeyboardInterrupt`` or ``errors.Interrupted`` carrying the
    signal), the signal is passed on to the command, which gets ``grace_s`` to end; then every process of
    the launch still running (its descendants, and anything carrying ``RUN_MARKER_ENV``) is stopped, and
    the interrupt goes on up. ``on_ranks`` is called with the ranks' PIDs whenever they change (found
    from the launch's processes, ``find_ranks``); ``on_stop(signum, ranks)`` is called when gputopo is
    stopped, before the signal is passed on (to take the ranks' stacks while they still hang; it must
    bound its own time). Raises ``UsageError`` when the program is not found, ``UnavailableError`` when
    it cannot be run.
    """
    if not argv:
        raise UsageError(
            "no command given", "put the command after --, e.g. gputopo run --n 2 -- python train.py"
        )
    program = argv[0]
    if shutil.which(program, path=env.get("PATH")) is None:
        raise UsageError(f"command not found: {program}", "check the name and PATH, or give the full path")
    marker = uuid.uuid4().hex
    sys.stdout.flush()
    sys.stderr.flush()
    proc: subprocess.Popen[bytes] | None = None
    watcher = None
    try:
        # A stop signal while the child starts is raised after this block, where the except below can
        # stop the child: raised inside Popen, it would leave the command running without gputopo.
        with stop_held():
            try:
                proc = subprocess.Popen(list(argv), env={**env, RUN_MARKER_ENV: marker})
            except OSError as exc:
                raise UnavailableError(
                    f"{program}: cannot run ({exc.strerror})", "check that it is executable"
                ) from None
            if on_ranks is not None or on_stop is not None:
                watcher = RankWatcher(proc.pid, marker, on_ranks or (lambda ranks: None))
                watcher.start()
        code = proc.wait()
    except KeyboardInterrupt as exc:
        if proc is None:
            raise
        signum = int(getattr(exc, "signum", signal.SIGINT))
        if watcher is not None:
            watcher.stopped.set()
        if on_stop is not None:
            ranks = watcher.latest if watcher is not None and watcher.latest else find_ranks(proc.pid, marker)
            with contextlib.suppress(Exception):
                on_stop(signum, ranks)
        stop_launch(proc, marker, signum, grace_s)
        raise
    finally:
        if watcher is not None:
            watcher.stopped.set()
    return 128 - code if code < 0 else code


def stop_launch(proc: subprocess.Popen[Any], marker: str, signum: int, grace_s: float) -> None:
    """Pass ``signum`` on to the command, give it ``grace_s`` to end, then stop every process of the launch
    (SIGTERM, a short grace, SIGKILL; psutil re-checks each pid's start time, so a reused pid is spared)."""
    import psutil

    seen = _descendants(proc.pid)
    if not (signum == signal.SIGINT and _terminal_sent_it()):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(_descendants(proc.pid))
        time.sleep(0.05)
    alive: list[psutil.Process] = []
    for p in {**seen, **_marked(marker)}.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.terminate()
                alive.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    if proc.poll() is None:
        proc.terminate()
    _, stubborn = psutil.wait_procs(alive, timeout=KILL_GRACE_S)
    for p in stubborn:
        try:
            p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        # Never an endless wait on the way out: SIGKILL cannot be refused, and a wait that an earlier
        # interrupt left unable to reap (Popen's waitpid lock) must not hang gputopo.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_GRACE_S)


def _terminal_sent_it() -> bool:
    """True when Ctrl-C in our terminal sent SIGINT to the whole foreground group (the command got it too)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def _descendants(pid: int) -> dict[int, Any]:
    import psutil

    try:
        return {p.pid: p for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return {}


def _marked(marker: str) -> dict[int, Any]:
    """Processes whose environment carries this launch's marker (only our own users' can be read)."""
    import psutil

    found = {}
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(RUN_MARKER_ENV) == marker:
                found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found
