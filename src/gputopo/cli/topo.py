"""CLI: ``gputopo topo``: the link map of this machine, a saved output, a snapshot or a sample."""

from __future__ import annotations

from typing import Optional

import typer

from gputopo.cli import app
from gputopo.cli.common import INPUT_HELP, INPUT_METAVAR, JSON_OPTION, examples, guarded, read_topology
from gputopo.ui.output import Output


@app.command(
    "topo",
    epilog=examples(
        "gputopo topo                          # this machine",
        "gputopo topo --input saved-topo.txt   # a saved `nvidia-smi topo -m`",
        "nvidia-smi topo -m | gputopo topo --input -",
        "gputopo topo --json > box.json        # a snapshot; --input box.json reads it back",
    ),
)
@guarded
def topo_command(
    input: Optional[str] = typer.Option(None, "--input", "-i", metavar=INPUT_METAVAR, help=INPUT_HELP),  # noqa: UP045 (typer)
    json_out: bool = JSON_OPTION,
    list_samples: bool = typer.Option(False, "--list-samples", help="Name the built-in sample machines."),
) -> None:
    """Show how the GPUs and NICs are wired: link matrix, legend, CPU/NUMA affinity, live NVML details."""
    out = Output(json_mode=json_out)
    if list_samples:
        from gputopo.topology import samples

        if json_out:
            out.document(
                {"samples": [{"name": s.name, "summary": s.summary} for s in samples.SAMPLES.values()]}
            )
        else:
            for s in samples.SAMPLES.values():
                out.show(f"sample:{s.name:<26} {s.summary}")
        return
    topo = read_topology(out, input)
    if json_out:
        from gputopo.topology import snapshot

        out.document(snapshot.to_dict(topo))
        return
    from gputopo.ui.topo_view import render_topology

    out.show(render_topology(topo))
