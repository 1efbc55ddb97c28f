"""The options of a run across nodes, shared by ``probe`` and ``doctor``: torchrun's own flags, with the
Slurm job's values as defaults under ``srun``."""

from __future__ import annotations

import os
from typing import Any

import typer

from gputopo.errors import UsageError

NODES_PANEL = "Across nodes (torchrun's rendezvous; defaults from Slurm under srun)"

NNODES_OPTION: Any = typer.Option(
    None,
    "--nnodes",
    help="Run across this many nodes (every node runs the same command; torchrun's flag). "
    "Default under Slurm: the step's nodes.",
    rich_help_panel=NODES_PANEL,
)
NODE_RANK_OPTION: Any = typer.Option(
    None, "--node-rank", help="This node's rank, 0..N-1 (Slurm: SLURM_NODEID).", rich_help_panel=NODES_PANEL
)
RDZV_ENDPOINT_OPTION: Any = typer.Option(
    None,
    "--rdzv-endpoint",
    metavar="HOST:PORT",
    help="Where the nodes meet (torchrun's c10d rendezvous; port 29400 if left out). "
    "Slurm: the first node's NodeAddr, on a port from the job id.",
    rich_help_panel=NODES_PANEL,
)
RDZV_ID_OPTION: Any = typer.Option(
    None,
    "--rdzv-id",
    help="The run's id, the same on every node (Slurm: gputopo-JOBID).",
    rich_help_panel=NODES_PANEL,
)
RDZV_TIMEOUT_OPTION: Any = typer.Option(
    None,
    "--rdzv-timeout",
    help="Seconds to wait for every node to join before giving up. Default: 600.",
    rich_help_panel=NODES_PANEL,
)
INJECT_NODE_OPTION: Any = typer.Option(
    None,
    "--inject-node",
    help="Node rank whose ranks get --inject in the inter-node tests. Default: the last node.",
    rich_help_panel=NODES_PANEL,
)


def slurm_job() -> Any:
    """The Slurm job this runs in (its defaults for --nnodes and the rendezvous), or ``None``."""
    from gputopo.launch.slurm import slurm_job as read_job
    from gputopo.system.scontrol import hostnames, node_addr

    if "SLURM_JOB_ID" not in os.environ and "SLURM_JOBID" not in os.environ:
        return None
    return read_job(os.environ, hostnames=hostnames, node_addr=node_addr)


def node_options(
    nnodes: int | None,
    node_rank: int | None,
    endpoint: str | None,
    rdzv_id: str | None,
    rdzv_timeout: float | None,
    inject: Any,
    inject_node: int | None,
) -> Any:
    """This node's ``NodeOptions`` (``None`` for one machine), with ``--inject-node`` defaulting to the
    last node when a fault is planted."""
    from dataclasses import replace

    from gputopo.probe.plan.nodes import resolve_nodes
    from gputopo.probe.plan.options import ACROSS_NODE_FAULTS

    job = slurm_job()
    node = resolve_nodes(nnodes, node_rank, endpoint, rdzv_id, rdzv_timeout, inject_node, job)
    if node is not None and node.source == "slurm":
        node = _from_slurm(node, job, endpoint)
    if node is None:
        if inject is not None and inject.value == "mnnvl":
            raise UsageError(
                "--inject mnnvl is a drill of the inter-node tests (NCCL between nodes of one NVLink domain)",
                "run it across nodes: --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT --device cpu",
            )
        # On one machine --inject slow slows GPUs in the per-GPU check (plan.config.check_per_gpu).
        return None
    if inject is not None and inject not in ACROSS_NODE_FAULTS:
        raise UsageError(
            f"--inject {inject.value} is a fault of the checks on one machine (training or per-GPU); "
            "across nodes the inter-node tests take slow, corrupt, hang, crash or mnnvl",
            "drop --nnodes to drill it on one machine, or pick one of those",
        )
    if inject is not None and inject_node is None:
        node = replace(node, inject_node=node.nnodes - 1)
    return node


def _from_slurm(node: Any, job: Any, endpoint: str | None) -> Any:
    """Under ``srun``, with the endpoint derived from the job (``resolve_nodes``: node 0's NodeAddr on the
    job's own port): node 0 hosts the store there, so a port that something already holds on it is an
    error now, not a silent join of another job's store."""
    from gputopo.system.net import port_taken

    if endpoint is not None:
        return node
    if node.node_rank == 0 and port_taken(node.port):
        raise UsageError(
            f"port {node.port}, Slurm job {job.job_id}'s rendezvous port, is already taken on this node "
            f"({job.this_host}): another job's rendezvous, or another service",
            f"pass --rdzv-endpoint {job.rendezvous_host}:PORT with a free port (the same on every node)",
        )
    return node


def check_rendezvous(node: Any) -> None:
    """Refuse, in one line, a rendezvous host that does not resolve: torch would wait for it for the
    whole ``--rdzv-timeout`` on every node. Called just before the run, after every other option check."""
    from gputopo.system.net import resolves

    if resolves(node.host):
        return
    if node.source == "slurm":
        hint = (
            "`scontrol show node` should give node 0's NodeAddr; or pass "
            f"--rdzv-endpoint ADDRESS:{node.port} with an address every node can reach"
        )
    else:
        hint = "give --rdzv-endpoint a host name or address every node can reach (usually node rank 0's)"
    raise UsageError(
        f"the rendezvous host {node.host!r} (--rdzv-endpoint {node.endpoint}) does not resolve", hint
    )


def progress_printer(out: Any, node: Any, json_out: bool) -> Any:
    """What prints a line when this node goes to the rendezvous, and one per inter-node test it enters."""
    seen: set[str] = set()

    def on_row(row: dict[str, Any]) -> None:
        if row.get("stage") == "rendezvous":
            out.hint(
                f"node {node.node_rank} of {node.nnodes} ({node.hostname}): rendezvous {node.endpoint}, "
                f"id {node.rdzv_id}, waiting up to {node.rdzv_timeout_s:g} s for every node"
            )
            return
        test = row.get("test")
        if json_out or row.get("stage") != "enter" or test in seen:
            return
        seen.add(test)
        nodes = ",".join(map(str, row.get("nodes") or []))
        out.hint(f"node {node.node_rank}: inter-node test {test} on nodes {nodes}")

    return on_row


def warn_internode(out: Any, doc: dict[str, Any]) -> None:
    """Say on stderr why the inter-node tests did not finish (a node missing, a hang, a crash)."""
    section = doc.get("internode") or {}
    if section.get("message") and section.get("status") != "ok":
        out.warn(section["message"])
