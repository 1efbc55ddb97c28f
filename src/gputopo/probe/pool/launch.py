"""Starting the rank pool through torch's elastic launcher, watching it, and leaving nothing behind.

Two halves live here. ``agent_main`` runs in a launcher process (``python -m gputopo.probe.launch
JOB.json``): it calls ``torch.distributed.launcher.api.elastic_launch``, the API under ``torchrun``, and
writes each rank's failure (exit code, signal, stderr tail) with the first one marked as the root cause,
as torchrun reports it. ``Pool`` runs in the ``gputopo`` process: it starts that launcher in a session
of its own with one rank per GPU of the pool, reads the ranks' progress, times each step of the
schedule against ``--timeout``, and on timeout, crash or Ctrl-C stops the launcher and every rank:
SIGTERM, a short grace, then SIGKILL, with each process identified by (pid, create time) so a reused
pid is never hit. Ranks run in sessions of their own (the elastic agent starts them so), which is why
the parent tracks them by ancestry and by a marker variable in their environment rather than by
process group. What it finished, and which set stopped it, goes back to the runner as a ``PoolOutcome``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from gputopo.probe.config import ProbeConfig
from gputopo.probe.plan import Job

MARKER_ENV = "GPUTOPO_PROBE_RUN"
STOP_GRACE_S = 3.0
POLL_S = 0.1
# Listing descendants walks every process of the machine (psutil reads each one's parent); ranks live for
# the whole pool, so once a second finds them all, and stop() also finds them by their marker.
DESCENDANTS_EVERY_S = 1.0
STDERR_TAIL_LINES = 20
# The elastic agent's own wait between SIGTERM and SIGKILL of its workers; torch's default is 30 s.
AGENT_SHUTDOWN_S = 2
LAUNCH_RESULT = "launch.json"
# Joining the pool (spawning the ranks, importing torch, the rendezvous) is no set's time: it may take
# --timeout or this long, whichever is more. Many ranks importing torch at once on a few busy cores can
# take tens of seconds, which must not read as a hang of the sets in the first step.
STARTUP_FLOOR_S = 60.0

# Which checks a planted fault reaches. A hang or crash ends the launch, so it goes into the first
# distributed check only (see ``inject_checks``).
_FAULT_CHECKS = {
    "nan": ("dp", "ddp"),
    "overflow": ("dp", "ddp"),
    "corrupt": ("p2p", "dp", "ddp", "allreduce"),
}
_HALTING_SITES = ("dp", "ddp", "allreduce")


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


@dataclass(frozen=True)
class PoolOutcome:
    """What one pool left: the jobs it judged (finished, hung or crashed) and its record for the report.

    Jobs not in ``judged`` never finished, through no fault of their own (the pool was stopped for
    another set): the runner gives them to a fresh pool.
    """

    judged: tuple[LaunchOutcome, ...]
    env: dict[str, Any] | None
    record: dict[str, Any]


@dataclass(frozen=True)
class FaultSite:
    """Where a planted fault goes in one job: which checks, and which ranks of its set."""

    checks: tuple[str, ...] = ()
    rank: int | None = None
    ranks: tuple[int, ...] | None = None


def inject_checks(fault: str | None, checks: tuple[str, ...]) -> tuple[str, ...]:
    """The checks of a set that carry the planted fault ``fault``."""
    if fault is None:
        return ()
    if fault in _FAULT_CHECKS:
        # By base name: ``dp@fp16`` is the dp check at another precision (gputopo.probe.precision).
        return tuple(c for c in checks if c.partition("@")[0] in _FAULT_CHECKS[fault])
    first = next((c for c in checks if c.partition("@")[0] in _HALTING_SITES), None)
    return (first,) if first else ()


def fault_site(config: ProbeConfig, gpus: tuple[int, ...], set_checks: tuple[str, ...]) -> FaultSite:
    """Where ``--inject`` goes in the set ``gpus`` whose checks are ``set_checks``.

    Without ``--inject-gpus`` every set gets the fault in rank ``--inject-rank``. With it, only the sets
    holding every GPU named get it, in the rank of the last one named, and the p2p check corrupts only
    the copies between the named GPUs.
    """
    fault = config.inject.value if config.inject else None
    if fault is None:
        return FaultSite()
    named = config.inject_gpus
    if named:
        if not set(named) <= set(gpus):
            return FaultSite()
        ranks = tuple(gpus.index(g) for g in named)
        return FaultSite(inject_checks(fault, set_checks), ranks[-1], ranks)
    return FaultSite(inject_checks(fault, set_checks), config.inject_rank)


def job_spec(
    config: ProbeConfig,
    job: Job,
    checks: tuple[str, ...],
    out_dir: Path,
    set_checks: tuple[str, ...] | None = None,
    ranks: tuple[int, ...] | None = None,
    job_id: str = "job",
) -> dict[str, Any]:
    """What the ranks of ``job`` read: the run's options, the checks to run, and the fault's site.

    ``set_checks`` are every check of the job's set in this run (a set's checks may be split over
    several jobs; a hang goes into the set's first distributed check only); ``ranks`` the pool ranks
    that run it, in the set's order.
    """
    site = fault_site(config, job.gpus, set_checks if set_checks is not None else checks)
    return {
        "id": job_id,
        "device": config.device,
        "gpus": list(job.gpus),
        "ranks": list(ranks if ranks is not None else range(len(job.gpus))),
        "checks": list(checks),
        "model": config.model,
        "batch_size": config.batch_size,
        "steps": config.steps,
        "lr": config.lr,
        "seed": config.seed,
        "timeout_s": config.timeout_s,
        "sweep_bytes": list(config.sweep_bytes),
        "iters": config.iters,
        "inject": config.inject.value if site.checks else None,
        "inject_rank": site.rank,
        "inject_ranks": list(site.ranks) if site.ranks is not None else None,
        "inject_checks": [c for c in site.checks if c in checks],
        "out_dir": str(out_dir),
    }


def rank_environment(config: ProbeConfig, job: Job, marker: str) -> dict[str, str]:
    """The launcher's (and so every pool rank's) environment: device visibility, threads, the marker.

    ``job.gpus`` is the pool's union of GPUs: every rank sees all of them (pool rank ``r`` drives the
    ``r``-th), so the rank that runs DataParallel for a set can reach that set's devices.
    """
    env = dict(os.environ)
    env[MARKER_ENV] = marker
    env["PYTHONUNBUFFERED"] = "1"
    if config.device == "cuda":
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so CUDA numbers GPUs as nvidia-smi does
        visible = config.visible_devices(job.gpus)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks must not start CUDA on a GPU machine
        # One thread per rank: ranks already fill the cores, and oversubscription slows every step.
        env["OMP_NUM_THREADS"] = "1"
    return env


Step = tuple[tuple[Job, tuple[str, ...]], ...]


@dataclass
class _PoolJob:
    """The parent's view of one job while its pool runs."""

    id: str
    job: Job
    checks: tuple[str, ...]
    step: int
    ranks: tuple[int, ...]
    dir: Path
    done_ranks: set[int]
    progress: dict[int, dict[str, Any]]
    started: float | None = None
    ended: float | None = None

    @property
    def done(self) -> bool:
        return len(self.done_ranks) == len(self.ranks)


class Launch:
    """One start of torch's elastic agent (``python -m gputopo.probe.launch JOB.json``) in a session of
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
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gputopo.probe.launch", str(job_path)],
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
                self.proc.wait()
        return stopped

    def cleanup(self) -> None:
        """Remove the launch's scratch folder."""
        shutil.rmtree(self.dir, ignore_errors=True)


class Pool(Launch):
    """One launch of the rank pool, running a schedule of steps, from start to a ``PoolOutcome``.

    The parent owns the clock: a step's jobs must finish within ``--timeout`` of the step's start (the
    first step starts once every rank has joined; joining may take ``--timeout`` or ``STARTUP_FLOOR_S``,
    whichever is more). When a step runs over, its unfinished jobs are ``hung`` and the pool is stopped;
    when a rank dies, the job it was running is ``crashed``.
    Either way the jobs that finished keep their results.
    """

    def __init__(self, config: ProbeConfig, steps: list[Step]) -> None:
        super().__init__("gputopo-probe-")
        self.config = config
        self.steps = steps
        self.gpus = tuple(sorted({g for step in steps for job, _ in step for g in job.gpus}))
        set_checks: dict[tuple[int, ...], tuple[str, ...]] = {}
        for step in steps:
            for job, checks in step:
                set_checks[job.gpus] = set_checks.get(job.gpus, ()) + checks
        self.set_checks = set_checks
        self.jobs: list[_PoolJob] = []
        for k, step in enumerate(steps):
            for job, checks in step:
                jid = f"j{len(self.jobs)}"
                ranks = tuple(self.gpus.index(g) for g in job.gpus)
                self.jobs.append(_PoolJob(jid, job, checks, k, ranks, self.dir / jid, set(), {}))
        self._by_id = {j.id: j for j in self.jobs}
        self.started = 0.0
        self.ended: float | None = None
        self.timed_out = False
        self.leftovers_killed = 0
        self.joined: set[int] = set()
        self.step_seen: dict[int, int] = {}  # pool rank -> the step it last entered
        self.step_clock: dict[int, float] = {}
        self.pool_rows: dict[int, dict[str, Any]] = {}

    def spec(self) -> dict[str, Any]:
        """What every rank reads: the shared options, the pool's GPUs and the schedule of job specs."""
        schedule = []
        for k in range(len(self.steps)):
            schedule.append(
                [
                    job_spec(self.config, j.job, j.checks, j.dir, self.set_checks[j.job.gpus], j.ranks, j.id)
                    for j in self.jobs
                    if j.step == k
                ]
            )
        return {
            "device": self.config.device,
            "gpus": list(self.gpus),
            # NVML's PCI bus id per pool rank: each checks CUDA gave it that GPU (identity.check_rank_device).
            "bus_ids": [self.config.inventory.bus_id(g) for g in self.gpus],
            "timeout_s": self.config.timeout_s,
            "out_dir": str(self.dir),
            "schedule": schedule,
        }

    def start(self) -> None:
        """Write the spec and start the launcher with one rank per GPU of the pool."""
        for j in self.jobs:
            j.dir.mkdir()
        env = rank_environment(self.config, Job(self.gpus, ()), self.marker)
        self.start_launcher(self.spec(), len(self.gpus), self.marker, env)
        self.started = time.monotonic()

    @property
    def running(self) -> bool:
        """True until the launcher has exited or been stopped."""
        return self.ended is None

    @property
    def current_step(self) -> int | None:
        """The step the ranks are in (ranks meet at a barrier between steps), ``None`` before the first."""
        return max(self.step_seen.values()) if self.step_seen else None

    def unfinished(self, step: int) -> list[_PoolJob]:
        """The jobs of ``step`` that have not finished."""
        return [j for j in self.jobs if j.step == step and not j.done]

    def poll(self) -> list[tuple[Job, dict[str, Any]]]:
        """Advance: new progress rows, exit or timeout. Returns the jobs' new progress rows."""
        assert self.proc is not None
        if time.monotonic() - self._descendants_at >= DESCENDANTS_EVERY_S:
            self._remember_descendants()
        rows = self._read_progress()
        if self.ended is None:
            if self.proc.poll() is not None:
                self.ended = time.monotonic()
                self.leftovers_killed = self.stop()
            elif self._overdue():
                self.timed_out = True
                self.stop()
                self.ended = time.monotonic()
                rows += self._read_progress()
        return rows

    def _overdue(self) -> bool:
        now = time.monotonic()
        step = self.current_step
        if step is None or len(self.joined) < len(self.gpus):
            return now - self.started > max(self.config.timeout_s, STARTUP_FLOOR_S)
        return bool(self.unfinished(step)) and now - self.step_clock[step] > self.config.timeout_s

    def _read_progress(self) -> list[tuple[Job, dict[str, Any]]]:
        rows = []
        now = time.monotonic()
        for row in self.new_rows():
            pool_rank = int(row["pool_rank"])
            job = self._by_id.get(row.get("task") or "")
            if job is None:
                self.pool_rows[pool_rank] = row
                if row["stage"] == "ready":
                    self.joined.add(pool_rank)
                elif row["stage"] == "step":
                    self.step_seen[pool_rank] = int(row["done"])
                    self.step_clock.setdefault(int(row["done"]), now)
                continue
            job.started = job.started or now
            if row["check"] == "task" and row["stage"] == "done":
                job.done_ranks.add(int(row["rank"]))
                job.ended = now if job.done else None
            else:
                job.progress[int(row["rank"])] = row
                rows.append((job.job, row))
        return rows

    def _job_outcome(self, j: _PoolJob, status: str, failures: tuple[RankFailure, ...] = ()) -> LaunchOutcome:
        metrics = {}
        for check in j.checks:
            data = _read_json(j.dir / f"check-{check}.json")
            if data is not None:
                metrics[check] = data
        progress = dict(j.progress)
        for local, pool_rank in enumerate(j.ranks):
            # A rank silent in this job (stuck before it) is shown where the pool last saw it.
            if local not in progress and pool_rank in self.pool_rows:
                progress[local] = dict(self.pool_rows[pool_rank], rank=local)
        end = j.ended or self.ended or time.monotonic()
        start = j.started or self.step_clock.get(j.step) or self.started
        return LaunchOutcome(
            job=j.job,
            status=status,
            metrics=metrics,
            env=None,
            failures=failures,
            last_progress=progress,
            wall_s=max(0.0, end - start),
            timeout_s=self.config.timeout_s,
            launcher_tail=_tail(self.dir / "launcher.log") if status == "launcher-error" else "",
        )

    def _in_set(self, j: _PoolJob, failure: RankFailure) -> RankFailure:
        """``failure`` with its pool rank turned into the rank within ``j``'s set."""
        local = j.ranks.index(failure.rank) if failure.rank in j.ranks else None
        message = failure.message
        if local is None:
            message = f"pool rank {failure.rank} (GPU {self.gpus[failure.rank]}): {message or 'died'}"
        return RankFailure(
            local,
            failure.exitcode,
            failure.signal,
            failure.pid,
            message,
            failure.stderr_tail,
            failure.timestamp,
        )

    def outcome(self) -> PoolOutcome:
        """Judge what can be judged from what the ranks and the launcher wrote. Call once it has ended."""
        judged = {j.id: self._job_outcome(j, "ok") for j in self.jobs if j.done}
        step = self.current_step if self.current_step is not None else 0
        result = _read_json(self.dir / LAUNCH_RESULT)
        status = "timeout" if self.timed_out else "launcher-error" if result is None else result["status"]
        ended_by: list[dict[str, Any]] = []
        if self.current_step is None and status != "ok":
            # The pool never started (an import error, a rendezvous or world-communicator hang): no set
            # is to blame and a fresh pool would fail alike, so every job carries it, in one launch.
            kind = "hung" if status == "timeout" else "crashed"
            failures = tuple(RankFailure(**f) for f in (result or {}).get("failures", []))
            for j in self.jobs:
                judged[j.id] = self._job_outcome(j, status, tuple(self._in_set(j, f) for f in failures))
                ended_by.append({"gpus": list(j.job.gpus), "kind": kind})
        elif status == "timeout":
            for j in self.unfinished(step):
                judged[j.id] = self._job_outcome(j, "timeout")
                ended_by.append({"gpus": list(j.job.gpus), "kind": "hung"})
        elif status == "failed":
            failures = tuple(RankFailure(**f) for f in result.get("failures", []))  # type: ignore[union-attr]
            culprits = [f for f in failures if f is failures[0] or _own_failure(f)]
            for failure in culprits:
                k = self.step_seen.get(failure.rank, step)
                for j in self.unfinished(k):
                    if failure.rank in j.ranks and j.id not in judged:
                        ordered = (failure, *(f for f in failures if f is not failure))
                        judged[j.id] = self._job_outcome(
                            j, "failed", tuple(self._in_set(j, f) for f in ordered)
                        )
                        ended_by.append({"gpus": list(j.job.gpus), "kind": "crashed"})
            if not ended_by:  # a rank died outside any job: the step's unfinished jobs carry it
                for j in self.unfinished(step):
                    judged[j.id] = self._job_outcome(j, "failed", tuple(self._in_set(j, f) for f in failures))
                    ended_by.append({"gpus": list(j.job.gpus), "kind": "crashed"})
        elif status == "launcher-error" or any(not j.done for j in self.jobs):
            # The ranks exited without finishing (or the launcher broke): the current step carries it.
            for j in self.unfinished(step):
                judged[j.id] = self._job_outcome(j, "launcher-error" if status != "ok" else "failed")
                ended_by.append({"gpus": list(j.job.gpus), "kind": "crashed"})
        record = {
            "gpus": list(self.gpus),
            "status": status,
            "wall_s": round((self.ended or time.monotonic()) - self.started, 3),
            "steps": [
                [
                    {
                        "gpus": list(j.job.gpus),
                        "checks": list(j.checks),
                        "wall_s": round(judged[j.id].wall_s, 3) if j.id in judged else None,
                    }
                    for j in self.jobs
                    if j.step == k
                ]
                for k in range(len(self.steps))
            ],
            "startup_s": round(self.step_clock[0] - self.started, 3) if 0 in self.step_clock else None,
            "steps_entered": (self.current_step + 1) if self.current_step is not None else 0,
            "judged": len(judged),
            "ended_by": ended_by,
            "leftovers_stopped": self.leftovers_killed,
        }
        outcomes = tuple(judged[j.id] for j in self.jobs if j.id in judged)
        return PoolOutcome(outcomes, _read_json(self.dir / "env.json"), record)


def _own_failure(failure: RankFailure) -> bool:
    """True for a rank that failed by itself: not stopped by the agent, not merely left by a peer."""
    if failure.signal == "SIGKILL":  # the agent's SIGKILL after its shutdown grace
        return False
    return not root_cause_order(
        {
            "rank": failure.rank,
            "signal": failure.signal,
            "message": failure.message,
            "stderr_tail": failure.stderr_tail,
        }
    )[0]


def run_pool(
    config: ProbeConfig,
    steps: list[Step],
    on_progress: Callable[[Job, dict[str, Any]], None] | None = None,
) -> PoolOutcome:
    """Run one pool until it ends, runs over or a rank dies; Ctrl-C stops it, then re-raises."""
    pool = Pool(config, steps)
    try:
        pool.start()
        while pool.running:
            for job, row in pool.poll():
                if on_progress is not None:
                    on_progress(job, row)
            time.sleep(POLL_S)
        return pool.outcome()
    finally:
        if pool.proc is not None:
            pool.stop()
        pool.cleanup()


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


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


# --- the launcher process -----------------------------------------------------------------------------


def agent_main(job_path: str) -> int:
    """Run one job's ranks under torch's elastic agent and write ``launch.json``; exit 0 either way."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    job = json.loads(Path(job_path).read_text())
    log_dir = Path(job["log_dir"])
    nnodes = int(job.get("nnodes") or 1)
    joined = None
    rdzv_configs: dict[str, Any] = {}
    if nnodes > 1:
        from gputopo.probe.multinode import JoinWatch

        # A node that never comes ends the rendezvous after --rdzv-timeout (torch's join_timeout,
        # DynamicRendezvousHandler's "join_timeout": 600 s by default) with RendezvousTimeoutError.
        rdzv_configs["join_timeout"] = int(job["rdzv_timeout_s"])
        # A node whose own checks end later connects to the store later; the store client gives up after
        # "read_timeout" (c10d_rendezvous_backend._create_tcp_store: 60 s by default), not join_timeout,
        # so a late node would read as a missing one: it gets as long as the rendezvous.
        rdzv_configs["read_timeout"] = int(job["rdzv_timeout_s"])
        if job.get("store_is_host") is not None:
            # c10d_rendezvous_backend._create_tcp_store honours "is_host" over its hostname guess.
            rdzv_configs["is_host"] = bool(job["store_is_host"])
        joined = JoinWatch(job, Path(job["result"]).parent)
        joined.start()
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=int(job["nproc"]),
        run_id=job["run_id"],
        # One node: torchrun --standalone, a c10d rendezvous on a free local port, so concurrent launches
        # never clash. Several: torchrun's --rdzv-backend c10d --rdzv-endpoint HOST:PORT.
        rdzv_backend="c10d",
        rdzv_endpoint=job.get("rdzv_endpoint") or "localhost:0",
        rdzv_configs=rdzv_configs,
        max_restarts=0,  # a probe reports the first failure; restarting would hide it
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
        shutdown_timeout=AGENT_SHUTDOWN_S,
    )
    result: dict[str, Any]
    try:
        elastic_launch(config, sys.executable)("-m", "gputopo.probe.worker", job["spec"])
        result = {"status": "ok", "failures": []}
    except ChildFailedError as exc:
        failures = [
            {
                "rank": rank,
                "exitcode": failure.exitcode,
                "signal": failure.signal_name()
                if failure.exitcode is not None and failure.exitcode < 0
                else None,
                "pid": failure.pid,
                "message": _failure_message(failure),
                "stderr_tail": _tail(_stderr_log(log_dir, failure.local_rank)),
                "timestamp": failure.timestamp,
            }
            for rank, failure in exc.failures.items()
        ]
        result = {"status": "failed", "failures": sorted(failures, key=root_cause_order)}
    except RendezvousError as exc:
        # Not every node came (RendezvousTimeoutError), or the store's host went away with them.
        result = {"status": "rendezvous", "failures": [], "message": f"{type(exc).__name__}: {exc}"}
    finally:
        if joined is not None:
            joined.stop()
    tmp = Path(job["result"] + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, job["result"])
    return 0


# What a rank prints when it fails only because a peer went away first: a consequence, not the cause.
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
    "Socket Timeout",
)


def root_cause_order(failure: dict[str, Any]) -> tuple[bool, float, int]:
    """Sort key putting the root cause first: ranks that did not merely lose a peer or get stopped by
    the agent (SIGTERM, which it sends to every other rank once one has failed), then the earliest
    (torch's timestamps have one-second resolution, so a rank that crashed and the peer that lost it
    often tie), then the lowest rank."""
    text = f"{failure.get('message') or ''}\n{failure.get('stderr_tail') or ''}"
    lost_peer = any(p in text for p in _PEER_LOST) or failure.get("signal") == "SIGTERM"
    stamp = failure.get("timestamp")
    return (lost_peer, float(stamp) if stamp is not None else float("inf"), int(failure["rank"]))


def _failure_message(failure: Any) -> str | None:
    # ``record`` leaves the exception's message in the error file; a hard exit leaves only a placeholder.
    data = failure.error_file_data or {}
    message = data.get("message")
    if isinstance(message, dict):
        message = message.get("message")
    text = str(message or "").strip()
    return text if text and text != "<NONE>" else None


def _stderr_log(log_dir: Path, local_rank: int) -> Path:
    found = sorted(log_dir.glob(f"*/attempt_*/{local_rank}/stderr.log"))
    return found[-1] if found else log_dir / "missing"


if __name__ == "__main__":
    code = agent_main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the result is written; torch's interpreter teardown would only delay the verdict
