"""Starting ranks through torch's elastic launcher, watching them, and leaving nothing behind.

Two halves live here. ``agent_main`` runs in a launcher process (``python -m gputopo.probe.launch
JOB.json``): it calls ``torch.distributed.launcher.api.elastic_launch``, the API under ``torchrun``, and
writes each rank's failure (exit code, signal, stderr tail) with the first one marked as the root cause,
as torchrun reports it. ``Launch`` runs in the ``gputopo`` process: it starts that launcher in a session
of its own, reads the ranks' progress, enforces ``--timeout``, and on timeout, crash or Ctrl-C stops the
launcher and every rank: SIGTERM, a short grace, then SIGKILL, with each process identified by
(pid, create time) so a reused pid is never hit. Ranks run in sessions of their own (the elastic agent
starts them so), which is why the parent tracks them by ancestry and by a marker variable in their
environment rather than by process group.
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
STDERR_TAIL_LINES = 20
# The elastic agent's own wait between SIGTERM and SIGKILL of its workers; torch's default is 30 s.
AGENT_SHUTDOWN_S = 2
LAUNCH_RESULT = "launch.json"

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
    """What one launch left: the ranks' measurements, how it ended, and where each rank got to.

    ``status`` is ``ok`` (every rank exited 0), ``failed`` (a rank failed; ``failures[0]`` is the root
    cause), ``timeout`` (stopped at ``--timeout``), or ``launcher-error`` (the launcher itself broke).
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


def inject_checks(fault: str | None, checks: tuple[str, ...]) -> tuple[str, ...]:
    """The checks of a launch that carry the planted fault ``fault``."""
    if fault is None:
        return ()
    if fault in _FAULT_CHECKS:
        # By base name: ``dp@fp16`` is the dp check at another precision (gputopo.probe.precision).
        return tuple(c for c in checks if c.partition("@")[0] in _FAULT_CHECKS[fault])
    first = next((c for c in checks if c.partition("@")[0] in _HALTING_SITES), None)
    return (first,) if first else ()


def job_spec(config: ProbeConfig, job: Job, checks: tuple[str, ...], out_dir: Path) -> dict[str, Any]:
    """What the ranks of ``job`` read: the run's options and the checks they should run."""
    fault = config.inject.value if config.inject else None
    return {
        "device": config.device,
        "gpus": list(job.gpus),
        "checks": list(checks),
        "model": config.model,
        "batch_size": config.batch_size,
        "steps": config.steps,
        "lr": config.lr,
        "seed": config.seed,
        "timeout_s": config.timeout_s,
        "sweep_bytes": list(config.sweep_bytes),
        "iters": config.iters,
        "inject": fault,
        "inject_rank": config.inject_rank,
        "inject_checks": list(inject_checks(fault, checks)),
        "out_dir": str(out_dir),
    }


def rank_environment(config: ProbeConfig, job: Job, marker: str) -> dict[str, str]:
    """The launcher's (and so the ranks') environment: device visibility, threads, the marker."""
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


class Launch:
    """One job's launcher process and ranks, from start to a ``LaunchOutcome``."""

    def __init__(self, config: ProbeConfig, job: Job, checks: tuple[str, ...]) -> None:
        self.config = config
        self.job = job
        self.checks = checks
        self.marker = uuid.uuid4().hex
        self.dir = Path(tempfile.mkdtemp(prefix="gputopo-probe-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.ended: float | None = None
        self.timed_out = False
        self.leftovers_killed = 0
        self._seen: dict[int, psutil.Process] = {}
        self._offsets: dict[Path, int] = {}
        self.last_progress: dict[int, dict[str, Any]] = {}

    def start(self) -> None:
        """Write the job files and start the launcher in its own session (so it gets no terminal signals
        behind our back; the parent forwards Ctrl-C as a clean stop)."""
        spec_path = self.dir / "spec.json"
        spec_path.write_text(json.dumps(job_spec(self.config, self.job, self.checks, self.dir)))
        job_path = self.dir / "job.json"
        job_path.write_text(
            json.dumps(
                {
                    "nproc": len(self.job.gpus),
                    "spec": str(spec_path),
                    "log_dir": str(self.dir / "logs"),
                    "result": str(self.dir / LAUNCH_RESULT),
                    "run_id": self.marker,
                }
            )
        )
        log = open(self.dir / "launcher.log", "wb")  # noqa: SIM115 - closed once the child has it
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gputopo.probe.launch", str(job_path)],
                env=rank_environment(self.config, self.job, self.marker),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self.started = time.monotonic()

    @property
    def running(self) -> bool:
        """True until the launcher has exited or been stopped."""
        return self.ended is None

    def poll(self) -> list[dict[str, Any]]:
        """Advance: new progress rows, exit or timeout. Returns the new progress rows."""
        assert self.proc is not None
        self._remember_descendants()
        rows = self._read_progress()
        if self.ended is None:
            if self.proc.poll() is not None:
                self.ended = time.monotonic()
                self.leftovers_killed = self.stop()
            elif time.monotonic() - self.started > self.config.timeout_s:
                self.timed_out = True
                self.stop()
                self.ended = time.monotonic()
                rows += self._read_progress()
        return rows

    def _remember_descendants(self) -> None:
        assert self.proc is not None
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self._seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def _read_progress(self) -> list[dict[str, Any]]:
        rows = []
        for path in sorted(self.dir.glob("progress-rank*.jsonl")):
            with path.open("rb") as fh:
                fh.seek(self._offsets.get(path, 0))
                data = fh.read()
            complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                row = json.loads(line)
                self.last_progress[int(row["rank"])] = row
                rows.append(row)
        return rows

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

    def outcome(self) -> LaunchOutcome:
        """Read what the ranks and the launcher wrote. Call once the launch has ended."""
        metrics = {}
        for check in self.checks:
            data = _read_json(self.dir / f"check-{check}.json")
            if data is not None:
                metrics[check] = data
        result = _read_json(self.dir / LAUNCH_RESULT)
        launcher_tail = _tail(self.dir / "launcher.log")
        failures: tuple[RankFailure, ...] = ()
        if self.timed_out:
            status = "timeout"
        elif result is None:
            status = "launcher-error"
        else:
            status = result["status"]
            failures = tuple(RankFailure(**f) for f in result.get("failures", []))
        wall_s = (self.ended or time.monotonic()) - self.started
        return LaunchOutcome(
            job=self.job,
            status=status,
            metrics=metrics,
            env=_read_json(self.dir / "env.json"),
            failures=failures,
            last_progress=dict(self.last_progress),
            wall_s=wall_s,
            timeout_s=self.config.timeout_s,
            launcher_tail=launcher_tail if status == "launcher-error" else "",
            leftovers_killed=self.leftovers_killed,
        )

    def cleanup(self) -> None:
        """Remove the launch's scratch folder."""
        shutil.rmtree(self.dir, ignore_errors=True)


def run_round(
    config: ProbeConfig,
    jobs: Iterable[tuple[Job, tuple[str, ...]]],
    on_progress: Callable[[Job, dict[str, Any]], None] | None = None,
) -> list[LaunchOutcome]:
    """Run launches concurrently until each ends or times out; Ctrl-C stops them all, then re-raises."""
    launches = [Launch(config, job, checks) for job, checks in jobs]
    try:
        for launch in launches:
            launch.start()
        while any(launch.running for launch in launches):
            for launch in launches:
                if launch.running:
                    for row in launch.poll():
                        if on_progress is not None:
                            on_progress(launch.job, row)
            time.sleep(POLL_S)
        return [launch.outcome() for launch in launches]
    finally:
        for launch in launches:
            if launch.proc is not None:
                launch.stop()
            launch.cleanup()


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
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    job = json.loads(Path(job_path).read_text())
    log_dir = Path(job["log_dir"])
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=int(job["nproc"]),
        run_id=job["run_id"],
        # torchrun --standalone: a c10d rendezvous on a free local port, so concurrent launches never clash.
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
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
    """Sort key putting the root cause first: ranks that did not merely lose a peer, then the earliest
    (torch's timestamps have one-second resolution, so a rank that crashed and the peer that lost it
    often tie), then the lowest rank."""
    text = f"{failure.get('message') or ''}\n{failure.get('stderr_tail') or ''}"
    lost_peer = any(p in text for p in _PEER_LOST)
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
