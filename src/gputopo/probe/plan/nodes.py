"""A node's place in a run across nodes, from the flags and the Slurm job: pure checks of the options,
one line and a hint for each mistake."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Any

from gputopo.errors import UsageError
from gputopo.launch.slurm import DEFAULT_RDZV_PORT

DEFAULT_RDZV_TIMEOUT_S = 600.0  # torch's own join_timeout default


LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class NodeOptions:
    """Where this node stands in a multi-node run, from torchrun-style flags or the Slurm job."""

    nnodes: int
    node_rank: int
    host: str  # the rendezvous endpoint's host
    port: int
    rdzv_id: str
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    inject_node: int | None = None
    # The node's name in output. Under Slurm it is Slurm's name for the node (``SlurmJob.this_host``,
    # from SLURMD_NODENAME); with torchrun's flags, the machine's. Only a label: nodes are told apart by
    # ``node_rank`` alone, since nodes may share a host name (several slurmd on one machine).
    hostname: str = field(default_factory=platform.node)
    source: str = "flags"  # or "slurm"
    # Whether the endpoint was derived from the Slurm job (node 0's NodeAddr and the job's port) rather
    # than given with --rdzv-endpoint.
    derived_endpoint: bool = False

    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` as torchrun's ``--rdzv-endpoint`` spells it."""
        return f"{self.host}:{self.port}"

    @property
    def store_is_host(self) -> bool | None:
        """Whether this node's agent hosts the rendezvous store.

        On a loopback endpoint (several "nodes" on one machine) and on an endpoint derived from the Slurm
        job (node 0's NodeAddr), node rank 0's does and no other: said outright, torch never guesses.
        torch's guess (torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py,
        ``_create_tcp_store``, torch 2.14) is "is the endpoint's host this machine"; when it guessed yes and
        hosting fails (the port is held), it retries as a *client*, so this run would silently join
        whatever store holds that port (another job's) and die when that job ends. With ``is_host`` given
        it raises ``RendezvousConnectionError`` instead ("if not is_server or cfg_is_host is not None:
        raise"). On a one-machine Slurm test cluster every node's address is 127.0.0.1, so torch's guess
        would say yes on every node.

        A user's own ``--rdzv-endpoint`` keeps ``None``: torch decides, as torchrun would.
        """
        if self.host in LOOPBACK or self.derived_endpoint:
            return self.node_rank == 0
        return None

    def injected_here(self) -> bool:
        """True when ``--inject`` goes into this node's ranks."""
        return self.inject_node is not None and self.inject_node == self.node_rank


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (IPv6 in brackets) into host and port; torchrun's default port when none is given."""
    text = text.strip()
    host, port = text, str(DEFAULT_RDZV_PORT)
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise UsageError(
                f"--rdzv-endpoint {text!r}: unclosed '['", "e.g. --rdzv-endpoint [fe80::1]:29400"
            )
        host, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise UsageError(f"--rdzv-endpoint {text!r}: expected ':PORT' after ']'", "e.g. [::1]:29400")
            port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host:
        raise UsageError(f"--rdzv-endpoint {text!r}: no host", "e.g. --rdzv-endpoint node01:29400")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(
            f"--rdzv-endpoint {text!r}: port must be 1-65535", "e.g. --rdzv-endpoint node01:29400"
        )
    return host, int(port)


def resolve_nodes(
    nnodes: int | None,
    node_rank: int | None,
    endpoint: str | None,
    rdzv_id: str | None,
    rdzv_timeout_s: float | None,
    inject_node: int | None,
    slurm: Any = None,
) -> NodeOptions | None:
    """The node's place in a multi-node run from the flags, with the Slurm job (``gputopo.launch.slurm``)
    filling what they leave out; ``None`` for a run on this machine alone."""
    if nnodes is None and slurm is not None and slurm.nnodes > 1:
        nnodes = slurm.nnodes
    multi = ("--node-rank", node_rank), ("--rdzv-endpoint", endpoint), ("--rdzv-id", rdzv_id)
    multi += (("--rdzv-timeout", rdzv_timeout_s), ("--inject-node", inject_node))
    if nnodes is None or nnodes == 1:
        given = [name for name, value in multi if value is not None]
        if given:
            raise UsageError(
                f"{given[0]} is for a run across nodes", "add --nnodes N (2 or more), or drop " + given[0]
            )
        return None
    if nnodes < 1:
        raise UsageError(f"--nnodes {nnodes}: must be 1 or more", "e.g. --nnodes 4")
    source = "flags"
    derived = False
    hostname: str | None = None
    if slurm is not None and slurm.nnodes == nnodes:
        if slurm.ntasks is not None and slurm.ntasks != slurm.nnodes:
            raise UsageError(
                f"this Slurm step runs {slurm.ntasks} tasks on {slurm.nnodes} nodes; gputopo wants one per "
                "node (it starts a rank per GPU itself)",
                "srun --ntasks-per-node 1 gputopo ...",
            )
        source = "slurm"
        node_rank = slurm.node_id if node_rank is None else node_rank
        # Node 0's NodeAddr on the job's own port (``SlurmJob.rendezvous_endpoint``), unless given.
        derived = endpoint is None
        endpoint = endpoint or slurm.rendezvous_endpoint
        rdzv_id = rdzv_id or f"gputopo-{slurm.job_id}"
        hostname = slurm.this_host
    if node_rank is None:
        raise UsageError(
            f"--nnodes {nnodes} needs --node-rank: which node this is (0..{nnodes - 1})",
            "run the same command on every node, each with its own --node-rank, or run it with srun",
        )
    if not 0 <= node_rank < nnodes:
        raise UsageError(
            f"--node-rank {node_rank}: must be 0..{nnodes - 1} for --nnodes {nnodes}",
            "number the nodes from 0; node rank 0 writes the report",
        )
    if endpoint is None:
        raise UsageError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT: where the nodes meet",
            "give every node the same endpoint, on a host they can all reach (usually node rank 0's)",
        )
    host, port = parse_endpoint(endpoint)
    timeout = DEFAULT_RDZV_TIMEOUT_S if rdzv_timeout_s is None else rdzv_timeout_s
    if timeout <= 0:
        raise UsageError(
            f"--rdzv-timeout {timeout:g}: must be more than 0 seconds", "e.g. --rdzv-timeout 600"
        )
    if inject_node is not None and not 0 <= inject_node < nnodes:
        raise UsageError(
            f"--inject-node {inject_node}: must be 0..{nnodes - 1}", "name the node rank that gets the fault"
        )
    named = {"hostname": hostname} if hostname is not None else {}
    return NodeOptions(
        nnodes=nnodes,
        node_rank=node_rank,
        host=host,
        port=port,
        rdzv_id=rdzv_id or "gputopo",
        rdzv_timeout_s=timeout,
        inject_node=inject_node,
        source=source,
        derived_endpoint=derived,
        **named,
    )
