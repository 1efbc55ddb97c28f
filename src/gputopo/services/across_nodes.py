"""Where a run across nodes meets, for ``probe`` and ``doctor``: torchrun's node options resolved against
the Slurm job this runs in (``probe.plan.nodes.resolve_nodes``), the faults a run across nodes takes, and
the rendezvous host checked before the run (``system.net``)."""

from __future__ import annotations

import os
from dataclasses import replace

from gputopo.errors import UsageError
from gputopo.launch.slurm import SlurmJob
from gputopo.probe.plan.nodes import NodeOptions
from gputopo.probe.plan.options import Fault


def slurm_job() -> SlurmJob | None:
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
    inject: Fault | None,
    inject_node: int | None,
) -> NodeOptions | None:
    """This node's ``NodeOptions`` (``None`` for one machine), with ``--inject-node`` defaulting to the
    last node when a fault is planted."""
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


def _from_slurm(node: NodeOptions, job: SlurmJob, endpoint: str | None) -> NodeOptions:
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


def check_rendezvous(node: NodeOptions) -> None:
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
