"""The rank pool on one machine: one launch for every set of a run, stepped through the schedule,
each step timed against ``--timeout``; a set that runs over is hung, a rank that dies makes its set
crashed, and either way the pool is stopped (nothing left behind) and its outcome says which sets were
judged."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputopo.probe.judge.environment import nccl_warnings
from gputopo.probe.judge.failures import root_cause_order
from gputopo.probe.plan.config import ProbeConfig
from gputopo.probe.plan.schedule import Job
from gputopo.probe.plan.spec import job_spec, rank_environment
from gputopo.probe.pool.launch import (
    DESCENDANTS_EVERY_S,
    LAUNCH_RESULT,
    POLL_S,
    STARTUP_FLOOR_S,
    Launch,
    LaunchOutcome,
    PoolOutcome,
    RankFailure,
    _read_json,
)
from gputopo.probe.shared import tail

Step = tuple[tuple[Job, tuple[str, ...]], ...]

# A step whose ranks keep reporting progress may run this many times --timeout before it is stopped: slow
# under load is not hung, but nothing runs for ever (each check writes a row per training step, pair or
# size, so a moving set is never silent for long).
LOAD_CAP = 10


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
    last_row: float | None = None  # when the parent last read a progress row of this job

    @property
    def done(self) -> bool:
        return len(self.done_ranks) == len(self.ranks)


class Pool(Launch):
    """One launch of the rank pool, running a schedule of steps, from start to a ``PoolOutcome``.

    The parent owns the clock: a job of the running step that reports no progress for ``--timeout`` (from
    the step's start or its last progress row) is hung, so a machine under load, whose ranks are slow but
    moving, does not turn them into hangs; a step still running after ``LOAD_CAP`` times ``--timeout`` is
    stopped all the same (the first step starts once every rank has joined; joining may take
    ``--timeout`` or ``STARTUP_FLOOR_S``, whichever is more). When a step runs over, its unfinished jobs
    are ``hung`` and the pool is stopped;
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
        # The jobs that went silent past --timeout when the pool was stopped (empty: the load cap, or the
        # start-up, stopped it). Only they are hung; a job of the same step that was still moving is left
        # unjudged, so a fresh pool runs it again.
        self.stalled: set[str] = set()
        self.leftovers_killed = 0
        self.joined: set[int] = set()
        self.step_seen: dict[int, int] = {}  # pool rank -> the step it last entered
        self.step_clock: dict[int, float] = {}
        self.pool_rows: dict[int, dict[str, Any]] = {}
        # Each rank's own CPU seconds as it joined, was ready and entered each step (``pool_row``'s
        # ``cpu_s``): the launch record splits them by step, so a profile needs no profiler.
        self.cpu_marks: dict[int, dict[tuple[str, int], float]] = {}

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
            # NVML's CPUs near each pool rank's GPU: the per-GPU check's host copies run there.
            "cpu_affinity": [self.config.inventory.cpu_affinity(g) for g in self.gpus],
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
        unfinished = self.unfinished(step)
        if not unfinished:
            return False
        began = self.step_clock[step]
        if now - began > LOAD_CAP * self.config.timeout_s:
            return True
        self.stalled = {
            j.id for j in unfinished if now - max(began, j.last_row or began) > self.config.timeout_s
        }
        return bool(self.stalled)

    def _read_progress(self) -> list[tuple[Job, dict[str, Any]]]:
        rows = []
        now = time.monotonic()
        for row in self.new_rows():
            pool_rank = int(row["pool_rank"])
            job = self._by_id.get(row.get("task") or "")
            if job is None:
                self.pool_rows[pool_rank] = row
                if "cpu_s" in row:
                    self.cpu_marks.setdefault(pool_rank, {})[(row["stage"], int(row["done"]))] = row["cpu_s"]
                if row["stage"] == "ready":
                    self.joined.add(pool_rank)
                elif row["stage"] == "step":
                    self.step_seen[pool_rank] = int(row["done"])
                    self.step_clock.setdefault(int(row["done"]), now)
                continue
            job.started = job.started or now
            job.last_row = now
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
            launcher_tail=tail(self.dir / "launcher.log") if status == "launcher-error" else "",
            nccl_warnings=set_nccl_warnings(self.dir, j.ranks) if status != "ok" else (),
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
                if self.stalled and j.id not in self.stalled:
                    continue  # still moving when another set of its step hung: a fresh pool reruns it
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
                        "cpu_s": self.step_cpu_s(k, j.ranks),
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
            "rank_cpu_s": self.rank_cpu_s(),
        }
        outcomes = tuple(judged[j.id] for j in self.jobs if j.id in judged)
        return PoolOutcome(outcomes, _read_json(self.dir / "env.json"), record)

    def _mark(self, rank: int, stage: str, step: int = 0) -> float | None:
        return self.cpu_marks.get(rank, {}).get((stage, step))

    def _step_end(self, rank: int, k: int) -> float | None:
        after = self._mark(rank, "step", k + 1)
        return after if after is not None else self._mark(rank, "end", len(self.steps))

    def step_cpu_s(self, k: int, ranks: Sequence[int]) -> float | None:
        """The CPU seconds ``ranks`` spent in step ``k``, summed (``None``: a rank's marks are missing)."""
        total = 0.0
        for rank in ranks:
            begin, end = self._mark(rank, "step", k), self._step_end(rank, k)
            if begin is None or end is None:
                return None
            total += end - begin
        return round(total, 2)

    def rank_cpu_s(self) -> dict[str, Any]:
        """Per pool rank, its CPU seconds: before joining (the interpreter, torch's import), joining the
        world group, in steps where it ran no job of its own (waiting at barriers), and in all."""
        ranks = range(len(self.gpus))
        busy = {(j.step, r) for j in self.jobs for r in j.ranks}
        idle = []
        for rank in ranks:
            # Steps it entered and left (a pool stopped mid-step leaves that step out).
            spans = [(self._mark(rank, "step", k), self._step_end(rank, k)) for k in range(len(self.steps))]
            spent = [
                end - begin
                for k, (begin, end) in enumerate(spans)
                if (k, rank) not in busy and begin is not None and end is not None
            ]
            idle.append(round(sum(spent), 2))
        join, ready = ([self._mark(r, stage) for r in ranks] for stage in ("join", "ready"))
        pairs = zip(join, ready, strict=True)
        return {
            "start": join,
            "join": [None if a is None or b is None else round(b - a, 2) for a, b in pairs],
            "idle": idle,
            "total": [self._mark(r, "end", len(self.steps)) for r in ranks],
        }


def set_nccl_warnings(folder: Path, pool_ranks: Sequence[int]) -> tuple[str, ...]:
    """NCCL's WARN lines in the logs of a set's ranks (``nccl-rank<pool rank>.log``), as ``rank r: text``
    with r the rank in the set; NCCL writes them there, not to the stderr the crash verdict quotes."""
    out: list[str] = []
    for local, pool_rank in enumerate(pool_ranks):
        path = folder / f"nccl-rank{pool_rank}.log"
        if path.exists():
            out += [
                f"rank {local}: {w}" for w in nccl_warnings(path.read_text(errors="replace").splitlines())
            ]
    return tuple(out)


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
        try:
            if pool.proc is not None:
                pool.stop()
        finally:
            pool.cleanup()
