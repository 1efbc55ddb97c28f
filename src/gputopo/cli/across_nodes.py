"""The options of a run across nodes, shared by ``probe`` and ``doctor``: torchrun's own flags, with the
Slurm job's values as defaults under ``srun``."""

from __future__ import annotations

from typing import Any

import typer

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
