"""CLI: ``gputopo nodes``: many nodes' facts -> NVLink domains, fit trays, segments, a ``--nodelist``,
Slurm's block topology, and an audit of what Slurm believes (docs/nodes.md)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, examples, guarded
from gputopo.errors import CheckFailed, UsageError
from gputopo.ui.output import Output

SCHEMA = "gputopo/nodes/v1"
# Kept in step with racks.DEFAULT_BUDGET_S (not imported: --help stays light).
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
    from gputopo import racks
    from gputopo.launch import slurm_blocks
    from gputopo.topology import domains as dom

    out = Output(json_mode=json_out)
    start = time.monotonic()
    _check_options(facts, slurm, nodelist, budget, segment, nodes)
    unanswered: dict[str, str] = {}
    if slurm:
        gathered = racks.gather_slurm(racks.slurm_nodes(nodelist), budget)
        out.warnings(gathered.warnings)
        read, unanswered = gathered.facts, gathered.unanswered
        if not read:
            first = next(iter(unanswered.values()), "no facts came back")
            raise CheckFailed(
                f"--slurm: no node answered ({len(unanswered)} asked: {first})",
                "try `srun -N1 python -m gputopo topo --json` by hand; a larger --budget for slow starts",
            )
    else:
        read = racks.read_facts(list(facts or []))
    plan = dom.plan(read)
    size = segment or nodes
    doc = {
        "schema": SCHEMA,
        **dom.to_json(plan, size),
        "unanswered": [{"node": n, "why": w} for n, w in unanswered.items()],
        # each node's stored `gputopo accept` verdict, and whether it still holds (null: none kept)
        "accept": {f.node: f.accept for f in read},
    }
    picked = None
    missing = None
    if nodes is not None:
        try:
            picked = dom.pick(plan, nodes, size or nodes)
            doc["nodelist"] = f"--nodelist={picked.nodelist}"
            doc["picked"] = [{"domain": d, "nodes": list(s)} for d, s in picked.segments]
        except dom.NotMet as exc:
            missing = str(exc)
            doc["nodelist"] = None
            doc["missing"] = missing
    findings = []
    if audit is not None or job is not None:
        end = start + budget
        blocks = None
        if audit is not None:
            text, where = racks.read_slurm_view(audit, end)
            blocks, _sizes = slurm_blocks.parse_blocks(text, where)
            findings += slurm_blocks.audit_blocks(plan, blocks)
        if job is not None:
            view = slurm_blocks.parse_show_job(racks.read_job(job, end), job)
            findings += slurm_blocks.audit_job(plan, blocks, view, segment)
        doc["findings"] = [f.to_json() for f in findings]
    if slurm_topology:
        doc["block_topology"] = dom.block_topology(plan)
        if not plan.domains:
            # Slurm stops on a block topology without blocks ("No blocks configured", block_record.c).
            out.warn("no node is in an NVLink domain: the block topology has no block, Slurm would refuse it")
    problems = [f for f in findings if f.severity == "problem"]
    if json_out:
        out.document(doc)
    elif missing is not None or problems:
        # A failure prints nothing on stdout: `sbatch $(gputopo nodes ... --nodes N) job.sh` and
        # `... --slurm-topology > topology.conf` must not take the table as their arguments or file. The
        # table and the reason go to stderr, for the person reading.
        from gputopo.ui.racks_view import render_nodes

        out.err.print(*render_nodes(doc, size))
    else:
        from gputopo.ui.racks_view import render_nodes

        if slurm_topology and nodes is None and not findings:
            out.line(doc["block_topology"].rstrip("\n"))
        elif picked is not None and not findings:
            from rich.markup import escape

            for d, s in picked.segments:
                out.hint(escape(f"segment in {d}: {dom.compress_hostlist(s)}"))
            out.line(doc["nodelist"])
        else:
            out.show(*render_nodes(doc, size))
    if missing is not None:
        raise CheckFailed(
            missing, "fewer or smaller segments, or bring unfit trays back (their why is listed)"
        )
    if problems:
        raise CheckFailed(
            f"Slurm's view disagrees with the NVLink domains: {len(problems)} problem(s)", problems[0].remedy
        )


def _check_options(
    facts: list[Path] | None,
    slurm: bool,
    nodelist: str | None,
    budget: float,
    segment: int | None,
    nodes: int | None,
) -> None:
    if slurm and facts:
        raise UsageError(
            "give facts files or --slurm, not both", "gputopo nodes facts/  or  gputopo nodes --slurm"
        )
    if not slurm and not facts:
        raise UsageError(
            "no facts given", "gputopo nodes FACTS... (files or folders), or --slurm to gather them"
        )
    if nodelist is not None and not slurm:
        raise UsageError("--nodelist gathers over Slurm", "add --slurm, or give facts files")
    if not budget > 0 or budget != budget:
        raise UsageError(f"--budget {budget} is not a positive number of seconds", "e.g. --budget 60")
    for name, v in (("--segment", segment), ("--nodes", nodes)):
        if v is not None and v < 1:
            raise UsageError(f"{name} {v} is not a positive number of nodes", f"e.g. {name} 8")
    if nodes is not None and segment is not None and nodes % segment:
        raise UsageError(
            f"--nodes {nodes} is not whole segments of --segment {segment}",
            f"--nodes {nodes - nodes % segment or segment} or {nodes + segment - nodes % segment}",
        )
