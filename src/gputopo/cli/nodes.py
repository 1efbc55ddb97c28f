"""CLI: ``gputopo nodes``: many nodes' facts -> NVLink domains, fit trays, segments, a ``--nodelist``,
Slurm's block topology, and an audit of what Slurm believes (docs/nodes.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, examples, guarded, options_from
from gputopo.ui.output import Output

# Kept in step with services.nodes.DEFAULT_BUDGET_S (not imported: --help stays light).
DEFAULT_BUDGET_S = 60.0


@app.command(
    "nodes",
    epilog=examples(
        "gputopo nodes facts/                               # domains, members, fit and unfit (why)",
        "gputopo nodes facts/ --segment 8                   # whole 8-node segments per domain",
        "sbatch $(gputopo nodes facts/ --nodes 16 --segment 8) job.sh   # prints --nodelist=...",
        "gputopo nodes facts/ --slurm-topology > topology.conf          # topology/block",
        "gputopo nodes --slurm --segment 8                  # gather: srun gputopo topo --json per node",
        "gputopo nodes facts/ --audit scontrol --job 4242   # what Slurm believes, and a running job",
    ),
)
@guarded
def nodes_command(
    facts: list[Path] | None = typer.Argument(
        None, metavar="FACTS...", help="`gputopo topo --json` files of the nodes, or folders of them."
    ),
    slurm: bool = typer.Option(
        False,
        "--slurm",
        help="Gather the facts with srun: one `gputopo topo --json` per node of the allocation.",
    ),
    nodelist: str | None = typer.Option(
        None, "--nodelist", metavar="HOSTLIST", help="With --slurm: these nodes instead of the allocation's."
    ),
    budget: float = typer.Option(
        DEFAULT_BUDGET_S,
        "--budget",
        metavar="SECONDS",
        help="The most --slurm's gathering (and --audit's scontrol calls) may take.",
    ),
    segment: int | None = typer.Option(
        None,
        "--segment",
        metavar="S",
        help="Whole segments of S fit nodes per domain (Slurm's --segment); with --job, its segment size.",
    ),
    nodes: int | None = typer.Option(
        None,
        "--nodes",
        metavar="N",
        help="Pick N fit nodes as whole segments inside domains; print --nodelist.",
    ),
    slurm_topology: bool = typer.Option(
        False, "--slurm-topology", help="Print the block topology (topology.conf for topology/block)."
    ),
    audit: str | None = typer.Option(
        None,
        "--audit",
        metavar="FILE|scontrol",
        help="Audit Slurm's block topology (a topology.conf, saved `scontrol show topology`, or scontrol).",
    ),
    job: str | None = typer.Option(None, "--job", metavar="ID", help="Audit a running job's placement."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Which nodes to run on together: NVLink domains, fit trays, segments, Slurm's block topology."""
    from gputopo.services import nodes as service
    from gputopo.ui.nodes_view import show_nodes

    out = Output(json_mode=json_out)
    options = options_from(service.Options, locals(), budget_s=budget, facts=tuple(facts or ()))
    report = service.run(options, service.Hooks(warn=out.warn))
    failure = report.failure
    show_nodes(out, report.document(), options.size, failed=failure is not None)
    if failure is not None:
        raise failure
