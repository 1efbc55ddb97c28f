"""Starting a launch of torch's elastic agent, watching it, and leaving nothing behind.

``Launch`` runs in the ``gputopo`` process: it starts the agent (``python -m gputopo.probe.ranks.agent
JOB.json``, which runs the ranks) in a session of its own, reads the ranks' progress, and on timeout,
crash or Ctrl-C stops the agent and every rank: SIGTERM, a short grace, then SIGKILL, with each process
identified by (pid, create time) so a reused pid is never hit. Ranks run in sessions of their own (the
elastic agent starts them so), which is why the parent tracks them by ancestry and by a marker variable
in their environment rather than by process group. ``pool.Pool`` (one machine) and
``multinode.CrossLaunch`` (one node of a run across nodes) build on it; what a launch finished goes back
to the runner as outcomes defined here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from gputopo.errors import stop_held
from gputopo.probe.plan.schedule import Job
from gputopo.probe.plan.spec import MARKER_ENV

STOP_GRACE_S = 3.0
POLL_S = 0.1
# Listing descendants walks every process of the machine (psutil reads each one's parent); ranks live for
# the whole pool, so once a second finds them all, and stop() also finds them by their marker.
DESCENDANTS_EVERY_S = 1.0
LAUNCH_RESULT = "launch.json"
# Joining the pool (spawning the ranks, importing torch, the rendezvous) is no set's time: it may take
# --timeout or this long, whichever is more. Many ranks importing torch at once on a few busy cores can
# take tens of seconds, which must not read as a hang of the sets in the first step.
STARTUP_FLOOR_S = 60.0


@dataclass(frozen=True)
class RankFailure:
    """One rank that ended badly, as the elastic agent saw it."""

    rank: int
    exitcode: int | None
    signal: str | None
    pid: int | None
    message: str | None
    stderr_tail: str
    timestamp: float | None = None


@dataclass(frozen=True)
class LaunchOutcome:
    """What one job of the pool left: its measurements, how it ended, and where each of its ranks got to.

    ``status`` is ``ok`` (every rank of the job finished it), ``failed`` (a rank died; ``failures[0]`` is
    the root cause, its ``rank`` counted within the set), ``timeout`` (the job's step ran past
    ``--timeout``), or ``launcher-error`` (the launcher itself broke). ``last_progress`` is keyed by
    rank within the set.
    """

    job: Job
    status: str
    metrics: dict[str, dict[str, Any]]
    env: dict[str, Any] | None
    failures: tuple[RankFailure, ...]
    last_progress: dict[int, dict[str, Any]]
    wall_s: float
    timeout_s: float
    launcher_tail: str = ""
    leftovers_killed: int = 0
    nccl_warnings: tuple[str, ...] = ()  # NCCL's WARN lines from the set's ranks' logs, "rank r: text"


@dataclass(frozen=True)
class PoolOutcome:
    """What one pool left: the jobs it judged (finished, hung or crashed) and its record for the report.

    Jobs not in ``judged`` never finished, through no fault of their own (the pool was stopped for
    another set): the runner gives them to a fresh pool.
    """

    judged: tuple[LaunchOutcome, ...]
    env: dict[str, Any] | None
    record: dict[str, Any]


class Launch:
    """One start of torch's elastic agent (``python -m gputopo.probe.ranks.agent JOB.json``) in a session of
    its own, with what every launch needs: the ranks' progress lines as they come, and a stop that
    leaves no process behind. ``Pool`` (one machine) and ``multinode.CrossLaunch`` (one node of a run
    across nodes) build on it."""

    def __init__(self, prefix: str) -> None:
        self.marker = uuid.uuid4().hex
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.proc: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, psutil.Process] = {}
        self._descendants_at = float("-inf")
        self._offsets: dict[Path, int] = {}

    def start_launcher(
        self, spec: dict[str, Any], nproc: int, run_id: str, env: dict[str, str], **more: Any
    ) -> None:
        """Write what the ranks read (``spec.json``) and what the agent reads (``job.json``: ``nproc``
        ranks, the rendezvous id, ``more``), and start the agent; its output goes to ``launcher.log``.
        It runs in a session of its own, so it gets no terminal signals behind our back (Ctrl-C is
        forwarded as a clean stop)."""
        spec_path = self.dir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        job = {
            "nproc": nproc,
            "spec": str(spec_path),
            "log_dir": str(self.dir / "logs"),
            "result": str(self.dir / LAUNCH_RESULT),
            "run_id": run_id,
            **more,
        }
        job_path = self.dir / "job.json"
        job_path.write_text(json.dumps(job))
        log = open(self.dir / "launcher.log", "wb")  # noqa: SIM115 - closed once the child has it
        # A stop signal while the agent starts is raised once self.proc holds it, so stop() finds it:
        # the agent runs in a session of its own, and nothing else would stop it.
        try:
            with stop_held():
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "gputopo.probe.ranks.agent", str(job_path)],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        finally:
            log.close()

    def new_rows(self) -> list[dict[str, Any]]:
        """The progress lines the ranks have written since the last call."""
        rows = []
        for path in sorted(self.dir.glob("progress-rank*.jsonl")):
            with path.open("rb") as fh:
                fh.seek(self._offsets.get(path, 0))
                data = fh.read()
            complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            rows += [json.loads(line) for line in complete.splitlines()]
        return rows

    def _remember_descendants(self) -> None:
        assert self.proc is not None
        self._descendants_at = time.monotonic()
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self._seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def stop(self) -> int:
        """Stop the launcher and every rank; return how many processes still had to be stopped.

        A stop signal that arrives while stopping (``errors.Interrupted``, raised once per run) does not
        cut it short: the stop runs again to the end, then the interrupt goes on.
        """
        try:
            return self._stop()
        except KeyboardInterrupt:
            self._stop()
            raise

    def _stop(self) -> int:
        """Stop the launcher and every rank; return how many processes still had to be stopped.

        Safe to call more than once. Ranks are found three ways: children of the launcher now, every
        descendant seen while polling, and any process carrying this launch's marker (an orphaned rank
        is reparented and no longer a descendant).
        """
        targets: dict[int, psutil.Process] = dict(self._seen)
        if self.proc is not None and self.proc.poll() is None:
            try:
                launcher = psutil.Process(self.proc.pid)
                targets[launcher.pid] = launcher
            except psutil.NoSuchProcess:
                pass
        if self.proc is not None:
            self._remember_descendants()
        targets.update(self._seen)
        targets.update({p.pid: p for p in marked_processes(self.marker)})
        stopped = terminate_all(targets.values())
        if self.proc is not None:
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):  # never an endless wait on the way out
                    self.proc.wait(timeout=STOP_GRACE_S)
        return stopped

    def cleanup(self) -> None:
        """Remove the launch's scratch folder."""
        shutil.rmtree(self.dir, ignore_errors=True)


def marked_processes(marker: str) -> list[psutil.Process]:
    """Processes whose environment carries ``GPUTOPO_PROBE_RUN=marker`` (only our own can be read)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(MARKER_ENV) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def terminate_all(procs: Iterable[psutil.Process]) -> int:
    """SIGTERM, wait ``STOP_GRACE_S``, SIGKILL the rest; return how many were still running.

    ``psutil.Process`` methods re-check (pid, create time) before signalling, so a pid reused since we
    first saw it is left alone.
    """
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                proc.terminate()
                alive.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    _, stubborn = psutil.wait_procs(alive, timeout=STOP_GRACE_S)
    for proc in stubborn:
        try:
            proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    psutil.wait_procs(stubborn, timeout=STOP_GRACE_S)
    return len(alive)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# Importing torch and initialising CUDA in the child: seconds, more on a loaded machine.
CUDA_ASK_TIMEOUT_S = 120.0


def ask_cuda_bus_ids(
    env: dict[str, str], timeout_s: float = CUDA_ASK_TIMEOUT_S
) -> tuple[tuple[str, ...] | None, str]:
    """CUDA's visible devices' PCI bus ids, by ordinal, from a short child (``python -m
    gputopo.probe.ranks.cuda``) run with ``env``; ``(None, why)`` when CUDA cannot answer."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gputopo.probe.ranks.cuda"],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"CUDA did not answer within {timeout_s:g} s"
    except OSError as exc:
        return None, exc.strerror or str(exc)
    lines = [line for line in done.stdout.splitlines() if line.strip().startswith("{")]
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if "bus_ids" in answer:
        return tuple(str(b) for b in answer["bus_ids"]), ""
    why = answer.get("error") or (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return None, str(why)[:200]
