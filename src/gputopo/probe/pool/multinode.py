"""A probe across nodes, as one node's ``gputopo`` runs it: its own checks, then one launch over every node.

Every node runs the same command (``srun gputopo probe ...`` under Slurm, or by hand with torchrun's
flags). Each node first runs its own checks, as on one machine (``runner.run_probe``; a node with one
GPU has no link inside it to check). Then each starts torch's elastic agent (``launch.agent_main``, the
API under ``torchrun``) with ``--nnodes``, a c10d rendezvous at ``--rdzv-endpoint`` and ``--rdzv-id``:
the agents meet there, every GPU of every node gets a rank, and the ranks test groups of nodes
(``crossnode``, planned by ``nodes``). No launcher of ours spans machines: torch's does.

This process watches its node's launch. It ends when its node's first rank has written the record of
every test, when the rendezvous gives up (a node that never came, after ``--rdzv-timeout``), when no
rank of its node has moved for ``--timeout`` (a hang: node rank 0 then reads how far every rank of every
node got from the rendezvous store and names the node behind), or when a rank dies. Whatever ends it,
the agent and every rank on this node are stopped, as a single-node pool is.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from gputopo.probe.plan.config import ProbeConfig
from gputopo.probe.plan.nodes import NodeOptions
from gputopo.probe.plan.schedule import Job
from gputopo.probe.plan.spec import rank_environment
from gputopo.probe.pool.launch import (
    DESCENDANTS_EVERY_S,
    LAUNCH_RESULT,
    POLL_S,
    STARTUP_FLOOR_S,
    Launch,
    _read_json,
)
from gputopo.probe.shared import tail

# After the record is written, the agent gets this long to leave by itself before it is stopped.
EXIT_GRACE_S = 10.0
# On a hang, how long a node waits before stopping its agent (node rank 0 twice as long, see ``wait``).
HANG_READ_GRACE_S = 2.0


@dataclass
class CrossOutcome:
    """How this node's launch ended: ``ok`` with the record, ``rendezvous`` (not every node came),
    ``hung`` (with what the store said), ``failed`` (a rank died), ``launcher-error``."""

    status: str
    record: dict[str, Any] | None = None
    joined: dict[str, str] = field(default_factory=dict)
    progress: dict[int, dict[str, Any]] = field(default_factory=dict)
    message: str = ""
    wall_s: float = 0.0
    leftovers_stopped: int = 0
    # This node's NCCL log lines about the network (judge.network reads them on node rank 0).
    nccl_lines: list[str] = field(default_factory=list)


class CrossLaunch(Launch):
    """This node's part of the multi-node launch, from start to a ``CrossOutcome``."""

    def __init__(
        self, config: ProbeConfig, node: NodeOptions, local: dict[str, Any] | None, nics: dict[str, str]
    ):
        super().__init__("gputopo-nodes-")
        self.config = config
        self.node = node
        self.local = local
        self.nics = nics
        self.gpus = config.sets[0]
        self.started = 0.0
        self.last_progress = 0.0
        self.ready: set[int] = set()
        self.beat: int | None = None

    def spec(self) -> dict[str, Any]:
        """What every rank of this node reads."""
        c = self.config
        return {
            "device": c.device,
            "gpus": list(self.gpus),
            "bus_ids": [c.inventory.bus_id(g) for g in self.gpus],
            "timeout_s": c.timeout_s,
            "out_dir": str(self.dir),
            "sweep_bytes": list(c.sweep_bytes),
            "iters": c.iters,
            "cross": {
                "run_id": self.node.rdzv_id,
                "nnodes": self.node.nnodes,
                "node_rank": self.node.node_rank,
                "host": self.node.hostname,
                "store_host": self.node.host,
                "store_port": self.node.port,
                "inject": c.inject.value if c.inject is not None and self.node.injected_here() else None,
                "local": self.local,
                "nics": self.nics,
            },
        }

    def start(self) -> None:
        """Start torch's elastic agent for this node, in a session of its own."""
        self.start_launcher(
            self.spec(),
            len(self.gpus),
            self.node.rdzv_id,
            rank_environment(self.config, Job(self.gpus, ()), self.marker),
            nnodes=self.node.nnodes,
            node_rank=self.node.node_rank,
            hostname=self.node.hostname,
            rdzv_endpoint=self.node.endpoint,
            rdzv_timeout_s=max(1, round(self.node.rdzv_timeout_s)),
            store_is_host=self.node.store_is_host,
        )
        self.started = self.last_progress = time.monotonic()

    def _read_progress(self) -> list[dict[str, Any]]:
        rows = self.new_rows()
        for row in rows:
            if row.get("stage") == "ready":
                self.ready.add(int(row["pool_rank"]))
        if rows:
            self.last_progress = time.monotonic()
        return rows

    def wait(self, on_row: Any = None) -> CrossOutcome:
        """Watch until the launch ends one way or another; leave nothing running."""
        assert self.proc is not None
        status = None
        record_at = None
        while status is None:
            if time.monotonic() - self._descendants_at >= DESCENDANTS_EVERY_S:
                self._remember_descendants()
            for row in self._read_progress():
                if on_row is not None:
                    on_row(row)
            beat = (_read_json(self.dir / "joined.json") or {}).get("beat")
            if beat != self.beat:
                self.beat, self.last_progress = beat, time.monotonic()
            now = time.monotonic()
            record = _read_json(self.dir / "cross.json")
            if self.proc.poll() is not None:
                status = "ended"
            elif record is not None:
                record_at = record_at or now
                if now - record_at > EXIT_GRACE_S:
                    status = "ended"
            elif len(self.ready) < len(self.gpus):
                # Joining: the agent's rendezvous gives up after --rdzv-timeout; this is a backstop.
                if now - self.started > self.node.rdzv_timeout_s + max(
                    self.config.timeout_s, STARTUP_FLOOR_S
                ):
                    status = "hung"
            elif now - self.last_progress > self.config.timeout_s:
                status = "hung"
            if status is None:
                time.sleep(POLL_S)
        if status == "hung":
            # Every node sees the hang within about a second of the others (the beat is read once a
            # second). Node rank 0 stops last, so its agent (the store's host on a loopback endpoint)
            # does not turn the others' hang into a crash before they have seen it.
            time.sleep(HANG_READ_GRACE_S * (2 if self.node.node_rank == 0 else 1))
        stopped = self.stop()
        return self._outcome(status, stopped)

    def store_progress(self) -> dict[int, dict[str, Any]]:
        """Every rank's last progress as node rank 0's agent last saw it in the store (else what this
        node's ranks read when they lost a peer)."""
        rows = _read_json(self.dir / "store-progress.json")
        if not rows:
            lost = [_read_json(f) for f in sorted(self.dir.glob("lost-rank*.json"))]
            rows = next((x["progress"] for x in lost if x and x.get("progress")), {})
        return {int(k): v for k, v in rows.items()}

    def _outcome(self, status: str, stopped: int) -> CrossOutcome:
        wall = time.monotonic() - self.started
        joined = (_read_json(self.dir / "joined.json") or {}).get("joined", {})
        record = _read_json(self.dir / "cross.json")
        if record is not None:
            return CrossOutcome("ok", record, joined, wall_s=wall, leftovers_stopped=stopped)
        progress = self.store_progress()
        if status == "hung":
            return CrossOutcome("hung", None, joined, progress, wall_s=wall, leftovers_stopped=stopped)
        result = _read_json(self.dir / LAUNCH_RESULT)
        if result is None:
            return CrossOutcome(
                "launcher-error",
                None,
                joined,
                message=tail(self.dir / "launcher.log"),
                wall_s=wall,
                leftovers_stopped=stopped,
            )
        if result["status"] == "rendezvous" and self.ready:
            # Every rank had joined: the store went away mid-run with the agent hosting it.
            return CrossOutcome(
                "failed",
                None,
                joined,
                message=f"the rendezvous store at {self.node.endpoint} went away during the tests (the node "
                f"hosting it ended): {result.get('message', '')}",
                wall_s=wall,
                leftovers_stopped=stopped,
            )
        if result["status"] == "rendezvous":
            return CrossOutcome(
                "rendezvous",
                None,
                joined,
                message=result.get("message", ""),
                wall_s=wall,
                leftovers_stopped=stopped,
            )
        failures = result.get("failures") or []
        message = ""
        if failures:
            first = failures[0]
            message = first.get("message") or first.get("stderr_tail") or f"exit code {first.get('exitcode')}"
        return CrossOutcome(
            "failed", None, joined, progress, message=message, wall_s=wall, leftovers_stopped=stopped
        )


def run_cross(
    config: ProbeConfig,
    node: NodeOptions,
    local: dict[str, Any] | None,
    nics: dict[str, str],
    on_row: Any = None,
) -> CrossOutcome:
    """This node's part of the inter-node tests; Ctrl-C stops everything it started, then re-raises."""
    launch = CrossLaunch(config, node, local, nics)
    if on_row is not None:
        on_row({"stage": "rendezvous"})
    try:
        launch.start()
        outcome = launch.wait(on_row)
        outcome.nccl_lines = nccl_net_lines(launch.dir)  # before cleanup removes the logs
        return outcome
    finally:
        try:
            launch.stop()
        finally:
            launch.cleanup()


# Lines of NCCL's INIT log that say which network carried what (judge.network); a log is read up to this.
NCCL_LOG_MAX_BYTES = 4 << 20
# and about the NVLink domain (judge.mnnvl: its MNNVL and NVLS lines, and the communicators' MNNVL flag).
_NET_MARKS = ("Using network", "NET/", "via NET", "MNNVL", "NVLS comm")


def nccl_net_lines(folder: Any) -> list[str]:
    """The network lines of every ``nccl-rank*.log`` this node's ranks wrote (``NCCL_DEBUG_FILE``)."""
    lines: list[str] = []
    for path in sorted(folder.glob("nccl-rank*.log")):
        try:
            with open(path, errors="replace") as f:
                text = f.read(NCCL_LOG_MAX_BYTES)
        except OSError:
            continue
        lines += [line for line in text.splitlines() if any(m in line for m in _NET_MARKS)]
    return lines


# --- options and the whole run ------------------------------------------------------------------------


def gpu_nics(topology: Any, gpus: tuple[int, ...]) -> dict[str, str]:
    """The NIC nearest each GPU (PIX, then PXB, then PHB), where the topology names one."""
    if topology is None or not topology.nics:
        return {}
    from gputopo.launch.line import nearest_nics

    out = {}
    for g in gpus:
        names, _ = nearest_nics(topology, [g])
        if names:
            out[str(g)] = names[0]
    return out


def node_record(node: NodeOptions, config: ProbeConfig, outcome: CrossOutcome) -> dict[str, Any]:
    """The run's options across nodes, as the ``internode`` section of the document records them."""
    return {
        "nnodes": node.nnodes,
        "node_rank": node.node_rank,
        "host": node.hostname,
        "endpoint": node.endpoint,
        "rdzv_id": node.rdzv_id,
        "rdzv_timeout_s": node.rdzv_timeout_s,
        "timeout_s": config.timeout_s,
        "source": node.source,
        "inject": config.inject.value if config.inject else None,
        "inject_node": node.inject_node if config.inject else None,
        "wall_s": round(outcome.wall_s, 3),
        "leftovers_stopped": outcome.leftovers_stopped,
    }


def judge_outcome(
    node: NodeOptions, config: ProbeConfig, outcome: CrossOutcome
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The ``nodes`` rows and the ``internode`` section for how this node's launch ended."""
    from gputopo.probe.report.nodes import internode_section

    return internode_section(
        node_record(node, config, outcome),
        outcome.status,
        outcome.record,
        outcome.joined,
        outcome.progress,
        outcome.message,
        {
            "device": config.device,
            "nccl_lines": outcome.nccl_lines,
            "nvlink_gbps": os.environ.get("GPUTOPO_NVLINK_DOMAIN_GBPS"),  # judge.mnnvl's override
        },
    )


def run_nodes(
    config: ProbeConfig, node: NodeOptions, on_progress: Any = None, on_row: Any = None
) -> dict[str, Any]:
    """This node's whole part: its own checks, then the inter-node tests; the document of the run.

    ``--inject`` goes into the inter-node tests of ``--inject-node``'s ranks only; a node's own checks
    run clean.
    """
    from dataclasses import replace
    from datetime import datetime, timezone

    from gputopo.probe.plan.schedule import make_plan
    from gputopo.probe.pool.runner import ProbeRun, read_topology, run_probe
    from gputopo.probe.report.document import to_document
    from gputopo.probe.report.drift import add_drift
    from gputopo.probe.report.nodes import add_nodes, local_summary
    from gputopo.system.run_facts import config_facts

    started_utc = datetime.now(timezone.utc)
    started = time.monotonic()
    gpus = config.sets[0]
    local_config = replace(config, inject=None, inject_rank=None, inject_gpus=())
    view = read_topology(config)
    if len(gpus) >= 2:
        local_run = run_probe(local_config, on_progress, plan=make_plan(local_config), view=view)
        local = local_summary(node.node_rank, to_document(local_run))
    else:
        notes = ("one GPU on this node: no link within it to check; only the inter-node tests ran",)
        local_run = ProbeRun(config, (), {"hostname": node.hostname}, notes, started_utc, 0.0)
        local = local_summary(node.node_rank, None, "one GPU: no link within the node to check")
    from gputopo.system.net import read_nics

    # Configuration drift: this node's versions, plugin, GPUs and NCCL variables travel with its summary,
    # and so do its NICs (judge.network compares the bandwidth with their line rate).
    local = {**local, "config": config_facts(view.topology, gpus, os.environ), "net": read_nics()}
    outcome = run_cross(config, node, local, gpu_nics(view.topology, gpus), on_row)
    doc = to_document(local_run)
    if node.source == "slurm":
        # The ranks wrote gethostname(); a node of a Slurm job goes by Slurm's name for it.
        doc["environment"] = {**(doc.get("environment") or {}), "hostname": node.hostname}
    doc["wall_s"] = round(time.monotonic() - started, 3)
    doc["config"]["inject"] = config.inject.value if config.inject else None
    return add_drift(add_nodes(doc, *judge_outcome(node, config, outcome)), outcome.record)
