"""The probe service: config in, judged results out. The CLI calls ``run_probe`` and renders what it returns.

It plans the steps, runs them in a pool of ranks (a fresh pool after a hang or crash, for the jobs not
yet judged), turns each job's outcome into check verdicts (a hang or crash becomes the verdict of the
check that was running, and the set's checks after it are reported as not reached), and adds what the
bandwidth model expects for each set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from gputopo.errors import GputopoError, Interrupted
from gputopo.probe.judge import verdict
from gputopo.probe.judge.p2p import judge_p2p
from gputopo.probe.judge.pergpu import judge_gpus, unfinished_rows
from gputopo.probe.judge.verdict import CheckResult, SetResult
from gputopo.probe.plan.config import ProbeConfig
from gputopo.probe.plan.options import check_rank
from gputopo.probe.plan.schedule import PER_GPU, Job, Plan, make_plan
from gputopo.probe.pool.launch import LaunchOutcome
from gputopo.probe.pool.pool import run_pool
from gputopo.probe.shared import ProbeRun, TopologyView

ProgressFn = Callable[[Job, dict[str, Any]], None]

CPU_SPEED_NOTE = "CPU stand-ins carry gloo traffic, not the GPU links the estimate describes"


def read_topology(config: ProbeConfig) -> TopologyView:
    """The topology for the bandwidth model: ``--input`` if given, live NVML on CUDA, none on CPU."""
    from gputopo.system.machine import load_topology

    if config.topology_input is not None:
        return TopologyView(load_topology(config.topology_input))
    if config.device == "cpu":
        return TopologyView(None, "CPU stand-ins have no GPU topology (give one with --input)")
    try:
        return TopologyView(load_topology(None))
    except GputopoError as exc:
        return TopologyView(None, f"no live topology: {exc.message}")


def runnable_checks(config: ProbeConfig, job: Job) -> tuple[tuple[str, ...], dict[str, CheckResult]]:
    """The checks the ranks of ``job`` run, and those skipped up front with the reason."""
    run: list[str] = []
    skip: dict[str, CheckResult] = {}
    for check in job.checks:
        if check == "p2p" and config.device == "cpu":
            skip[check] = verdict.skipped(
                check, "no peer-to-peer copies between CPU stand-ins; run it on GPUs"
            )
        elif check == "p2p" and len(job.gpus) < 2:
            skip[check] = verdict.skipped(check, "needs two GPUs")
        else:
            run.append(check)
    return tuple(run), skip


def judge_outcome(
    outcome: LaunchOutcome, checks: tuple[str, ...], view: TopologyView, config: ProbeConfig
) -> dict[str, CheckResult]:
    """Verdicts for every check of one launch, from what its ranks wrote and how it ended."""
    results: dict[str, CheckResult] = {}
    stopped_in: str | None = None
    for check in checks:
        metrics = outcome.metrics.get(check)
        if metrics is not None:
            results[check] = _judge(check, metrics, outcome.job.gpus, view, config)
        elif stopped_in is None:
            stopped_in = check
            results[check] = _unfinished(check, outcome)
        else:
            results[check] = verdict.skipped(check, f"not reached: the launch ended in {stopped_in}")
    if stopped_in is None and outcome.status != "ok" and checks:
        # Every check finished, then something failed on the way out: still a failure of this launch.
        results[checks[-1]] = _unfinished(checks[-1], outcome)
    per_gpu = results.get(PER_GPU)
    if per_gpu is not None and per_gpu.kind in ("hung", "crashed"):
        # Which GPU's rank died (or that every GPU hung), for the per-GPU table.
        rank = outcome.failures[0].rank if outcome.failures else None
        rows = unfinished_rows(outcome.job.gpus, per_gpu.kind, rank)
        results[PER_GPU] = replace(per_gpu, metrics={**per_gpu.metrics, "rows": rows})
    return results


def _judge(
    check: str, metrics: dict[str, Any], gpus: tuple[int, ...], view: TopologyView, config: ProbeConfig
) -> CheckResult:
    if check.partition("@")[0] in ("dp", "ddp"):
        from gputopo.probe.judge.precision import judge_precision

        return judge_precision(check, metrics)
    if check == PER_GPU:
        return judge_gpus(metrics, config.per_gpu_tolerance)
    if check == "speed":
        from gputopo.probe.judge.speed import judge_speed

        return judge_speed(metrics, config.device)
    if check == "p2p":
        # The model's one-way estimate per pair sits beside the measured matrix in the reports.
        return judge_p2p(metrics, view.nvml_p2p(), lambda a, b: view.expected_busbw_gbps((a, b))[0])
    expected, why = view.expected_busbw_gbps(gpus)
    if config.device == "cpu":
        return verdict.judge_allreduce(metrics, expected, judge_speed=False, speed_note=why or CPU_SPEED_NOTE)
    return verdict.judge_allreduce(metrics, expected, judge_speed=True, speed_note=why)


def _unfinished(check: str, outcome: LaunchOutcome) -> CheckResult:
    warnings = outcome.nccl_warnings
    if outcome.status == "timeout":
        return verdict.hung(check, outcome.timeout_s, outcome.last_progress, time.time(), warnings)
    if outcome.failures:
        first = outcome.failures[0]
        return verdict.crashed(
            check, first.rank, first.exitcode, first.signal, first.stderr_tail, first.message, warnings
        )
    if outcome.status == "launcher-error":
        return verdict.crashed(
            check, None, None, None, outcome.launcher_tail, "the torch elastic launcher failed"
        )
    return verdict.crashed(
        check, None, None, None, "", "the ranks exited without writing this check's result"
    )


def run_probe(
    config: ProbeConfig,
    on_progress: ProgressFn | None = None,
    plan: Plan | None = None,
    view: TopologyView | None = None,
    on_warning: Callable[[str], None] | None = None,
    listen_xid: bool | None = None,
    sick: Mapping[int, str] | None = None,
) -> ProbeRun:
    """Run the plan in a pool of ranks and judge it. Ctrl-C stops the ranks and propagates.

    One pool normally runs the whole plan. When a set hangs or a rank dies, that pool is stopped, the
    set's remaining checks are reported as not reached, and a fresh pool runs the jobs not yet judged.

    On GPUs read live, a GPU of a set with a health problem (one health sample) is warned about through
    ``on_warning`` (one line per GPU) and named in the run's caveats; and NVML's Xid events are listened
    for while the ranks run (``listen_xid``, default: on GPUs), so a crashed or hung check names the
    Xid of its GPU. ``sick`` is health the caller already read (doctor's window: GPU -> its first
    problem), handed down so the machine is not sampled again; ``view`` likewise the topology it read.
    """
    plan = plan or make_plan(config)
    live = config.device == "cuda" and config.topology_input is None
    gpus = sorted({g for s in plan.sets for g in s})
    # One health sample of the sets' GPUs (no counters' rise: that needs a window the probe does not
    # wait for); nothing when NVML cannot be read.
    if sick is not None:
        sick = {g: what for g, what in sick.items() if g in gpus}
    elif live:
        from gputopo.system.machine import read_live_health

        sick = read_live_health(gpus=gpus).unhealthy_gpus()
    else:
        sick = {}
    for gpu, what in sorted(sick.items()):
        if on_warning is not None:
            on_warning(f"GPU{gpu} has a health problem: {what}; its results may show the fault, not the set")
    if not (live if listen_xid is None else listen_xid):
        return _run_probe(config, on_progress, plan, view, sick, None)
    from gputopo.system.xid_events import XidWatch

    with XidWatch(gpus) as watch:
        return _run_probe(config, on_progress, plan, view, sick, watch)


def _with_xid(results: dict[str, CheckResult], outcome: LaunchOutcome, events: tuple[Any, ...]) -> None:
    """Add to a crashed or hung check the Xid events NVML reported on its set's GPUs (those on the GPU
    of the rank that died first): "Xid 79 on GPU5 at 12:03:07", not just "crashed"."""
    from gputopo.health.xid import xid_event_words

    gpus = outcome.job.gpus
    rank = outcome.failures[0].rank if outcome.failures else None
    first = gpus[rank] if rank is not None and 0 <= rank < len(gpus) else None
    words = xid_event_words([(e.gpu, e.xid, e.time_s) for e in events], gpus, first)
    if words is None:
        return
    for name, result in results.items():
        if result.kind in ("crashed", "hung"):
            metrics = {**(result.metrics or {}), "xid_events": words}
            results[name] = replace(result, detail=f"{result.detail}; NVML reported {words}", metrics=metrics)


def _run_probe(
    config: ProbeConfig,
    on_progress: ProgressFn | None,
    plan: Plan,
    view: TopologyView | None,
    sick: Mapping[int, str],
    watch: Any,
) -> ProbeRun:
    started_utc = datetime.now(timezone.utc)
    started = time.monotonic()
    view = view or read_topology(config)
    notes = [view.note] if view.note else []
    if config.inject is not None:
        where = (
            f"every set holding GPUs {','.join(map(str, config.inject_gpus))}"
            if config.inject_gpus
            else f"rank {config.inject_rank} of every set"
        )
        notes.append(f"fault injected: {config.inject.value} in {where} (--inject)")
    by_set: dict[tuple[int, ...], dict[str, CheckResult]] = {s: {} for s in plan.sets}
    pending: list[list[tuple[Job, tuple[str, ...]]]] = []
    for rnd in plan.rounds:
        step = []
        for job in rnd:
            run, skip = runnable_checks(config, job)
            by_set[job.gpus].update(skip)
            if run:
                step.append((job, run))
        if step:
            pending.append(step)
    environment: dict[str, Any] = {}
    launches = []
    runs = {job: run for step in pending for job, run in step}
    try:
        _run_pending(config, pending, runs, by_set, view, on_progress, environment, launches, watch)
    except Interrupted as exc:
        # A stop signal: the pool is already stopped (run_pool's finally); what was judged so far goes up
        # with the interrupt, every check not reached says why, so the CLI can write it as "interrupted".
        for step in pending:
            for job, run in step:
                for check in run:
                    by_set[job.gpus].setdefault(
                        check, verdict.skipped(check, f"not reached: interrupted by {exc.name}")
                    )
        notes.append(f"interrupted by {exc.name}: the checks not reached are marked so")
        exc.partial = _probe_run(
            config, plan, by_set, environment, view, notes, started_utc, started, launches, sick
        )
        raise
    return _probe_run(config, plan, by_set, environment, view, notes, started_utc, started, launches, sick)


def _run_pending(
    config: ProbeConfig,
    pending: list[list[tuple[Job, tuple[str, ...]]]],
    runs: dict[Job, tuple[str, ...]],
    by_set: dict[tuple[int, ...], dict[str, CheckResult]],
    view: TopologyView,
    on_progress: ProgressFn | None,
    environment: dict[str, Any],
    launches: list[dict[str, Any]],
    watch: Any,
) -> None:
    """Run pools until every job is judged (a fresh pool after a hang or crash); fills ``by_set``,
    ``environment`` and ``launches`` as it goes, so an interrupt leaves what was judged. ``pending``
    shrinks to what is still to run."""
    while pending:
        outcome = run_pool(config, [tuple(step) for step in pending], on_progress)
        if outcome.env and not environment:
            environment.update(outcome.env)
        launches.append(outcome.record)
        ended: dict[tuple[int, ...], str] = {}
        judged = set()
        for job_outcome in outcome.judged:
            job = job_outcome.job
            checks = runs[job]
            results = judge_outcome(job_outcome, checks, view, config)
            if watch is not None and job_outcome.status != "ok":
                _with_xid(results, job_outcome, watch.events())
            by_set[job.gpus].update(results)
            judged.add(job)
            if job_outcome.status != "ok":
                stopped = [c for c in checks if results[c].kind in ("hung", "crashed")]
                ended[job.gpus] = stopped[0] if stopped else checks[-1]
        if not judged:  # cannot happen (a pool always judges the job that stopped it); never loop forever
            raise RuntimeError("a probe pool ended without judging any job")
        remaining = []
        for step in pending:
            left = []
            for job, run in step:
                if job in judged:
                    continue
                if job.gpus in ended:
                    for check in run:
                        why = f"not reached: the set ended in {ended[job.gpus]}"
                        by_set[job.gpus][check] = verdict.skipped(check, why)
                    continue
                left.append((job, run))
            if left:
                remaining.append(left)
        pending[:] = remaining


def _probe_run(
    config: ProbeConfig,
    plan: Plan,
    by_set: dict[tuple[int, ...], dict[str, CheckResult]],
    environment: dict[str, Any],
    view: TopologyView,
    notes: list[str],
    started_utc: datetime,
    started: float,
    launches: list[dict[str, Any]],
    sick: Mapping[int, str],
) -> ProbeRun:
    sets = [
        SetResult(gpus, tuple(by_set[gpus][c] for c in sorted(by_set[gpus], key=check_rank)))
        for gpus in plan.sets
    ]
    environment.update(_parent_environment(config, view))
    if sick:
        caveats = list(environment.get("caveats") or [])
        caveats += [f"GPU{g} has a health problem: {what}" for g, what in sorted(sick.items())]
        environment["caveats"] = caveats
    return ProbeRun(
        config=config,
        sets=tuple(verdict.with_healthy_sets(sets)),
        environment=environment,
        notes=tuple(notes),
        started_utc=started_utc,
        wall_s=time.monotonic() - started,
        launches=tuple(launches),
        warnings=view.topology.warnings if view.topology is not None else (),
    )


def _parent_environment(config: ProbeConfig, view: TopologyView) -> dict[str, Any]:
    """What the parent knows that the ranks do not: the driver, and NVML's names and bus ids."""
    env: dict[str, Any] = {"device": config.device, "backend": config.backend}
    topo = view.topology
    if topo is not None:
        env["driver_version"] = topo.driver_version
        env["cuda_driver_version"] = topo.cuda_driver_version
        env["topology_source"] = topo.source
        env["gpus"] = [{"index": g.index, "name": g.name, "pci_bus_id": g.pci_bus_id} for g in topo.gpus]
    else:
        env["driver_version"] = None
    return env
