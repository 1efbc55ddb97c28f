"""The launcher process of one job: ``python -m gputopo.probe.ranks.agent JOB.json``.

It calls ``torch.distributed.launcher.api.elastic_launch``, the API under ``torchrun``, to run the
job's ranks (``ranks.worker``), and writes each rank's failure (exit code, signal, stderr tail) with the
first one marked as the root cause, as torchrun reports it. Across nodes it also keeps the rendezvous
store's news on disk for the parent (``JoinWatch``). It runs in torch's process tree, so it lives with
the ranks: the parent (``pool``) only starts it by module name and reads what it wrote."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from gputopo.probe.judge.failures import root_cause_order
from gputopo.probe.plan.nodes import parse_endpoint
from gputopo.probe.shared import tail

# The elastic agent's own wait between SIGTERM and SIGKILL of its workers; torch's default is 30 s.
AGENT_SHUTDOWN_S = 2


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
    # LaunchConfig.shutdown_timeout (torch/distributed/launcher/api.py) is newer than some torch builds
    # that vendors ship with their GPU images (2.11 on the H100 this was first run on lacks it, and the
    # probe then failed as "crashed" before any rank started): pass it only where torch has it.
    agent_options: dict[str, Any] = {}
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        agent_options["shutdown_timeout"] = AGENT_SHUTDOWN_S
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
        **agent_options,
    )
    result: dict[str, Any]
    try:
        elastic_launch(config, sys.executable)("-m", "gputopo.probe.ranks.worker", job["spec"])
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
                "stderr_tail": tail(_stderr_log(log_dir, failure.local_rank)),
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


def node_key(run_id: str, node: int) -> str:
    """Where each node's agent says it came, in the rendezvous store."""
    return f"gputopo/{run_id}/node/{node}"


class JoinWatch(threading.Thread):
    """In the agent, once a second: say in the rendezvous store that this node came and keep
    ``joined.json`` up to date with which nodes did (so a rendezvous that gives up can say how many
    joined) and with the run's beat counter (so this node's parent sees the run alive while its own
    ranks sit a step out). On node rank 0 it also mirrors every rank's last progress into
    ``store-progress.json``: the store goes away with the agent that hosts it, and a hang or a crash is
    judged from what it last said."""

    def __init__(self, job: dict[str, Any], folder: Path) -> None:
        super().__init__(daemon=True)
        self.job = job
        self.folder = folder
        self._done = threading.Event()

    def stop(self) -> None:
        """End the watch (the launch is over)."""
        self._done.set()

    def run(self) -> None:
        from torch.distributed import TCPStore

        from gputopo.probe.ranks.crossnode import beat_key, store_key, world_key

        host, port = parse_endpoint(self.job["rdzv_endpoint"])
        run_id, nnodes = self.job["run_id"], int(self.job["nnodes"])
        store = None
        while not self._done.is_set():
            try:
                if store is None:
                    store = TCPStore(
                        host, port, is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False
                    )
                    store.set(node_key(run_id, int(self.job["node_rank"])), self.job["hostname"])
                joined = {}
                for n in range(nnodes):
                    if store.check([node_key(run_id, n)]):
                        joined[str(n)] = store.get(node_key(run_id, n)).decode()
                beat = store.add(beat_key(run_id), 0)
                _write(self.folder / "joined.json", {"joined": joined, "beat": beat, "t": time.time()})
                if int(self.job["node_rank"]) == 0 and store.check([world_key(run_id)]):
                    rows = {}
                    for r in range(int(store.get(world_key(run_id)))):
                        if store.check([store_key(run_id, r)]):
                            rows[str(r)] = json.loads(store.get(store_key(run_id, r)))
                    _write(self.folder / "store-progress.json", rows)
            except Exception:  # noqa: BLE001 - no store yet, or its host is gone: try again
                store = None
            self._done.wait(1.0)


def _write(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


if __name__ == "__main__":
    code = agent_main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the result is written; torch's interpreter teardown would only delay the verdict
