"""CLI: ``gputopo topo``: the link map of this machine, a saved output, a snapshot or a sample."""

from __future__ import annotations

from typing import Optional

import typer

from gputopo.cli import app
from gputopo.cli.common import INPUT_HELP, JSON_OPTION, guarded
from gputopo.ui.output import Output

# Shared by the commands that read the live machine (topo, recommend, doctor). The default mirrors
# gputopo.system.nvml_worker.DEFAULT_TIMEOUT_S, spelled here so --help does not import it.
NVML_TIMEOUT_OPTION = typer.Option(
    5.0,
    "--nvml-timeout",
    metavar="SECONDS",
    help="Seconds each live NVML read (start-up, one GPU, one GPU pair) may take; a GPU that does not "
    "answer in time is shown as not responding.",
)


@app.command("topo")
@guarded
def topo_command(
    input: Optional[str] = typer.Option(None, "--input", "-i", help=INPUT_HELP),  # noqa: UP045 (typer)
    json_out: bool = JSON_OPTION,
    list_samples: bool = typer.Option(False, "--list-samples", help="Name the built-in sample machines."),
    nvml_timeout: float = NVML_TIMEOUT_OPTION,
) -> None:
    """Show how the GPUs and NICs are wired: link matrix, legend, CPU/NUMA affinity, live NVML details."""
    from gputopo.topology import load_topology

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
    topo = load_topology(input, nvml_timeout_s=nvml_timeout)
    for w in topo.warnings:
        out.warn(w)
    if json_out:
        from gputopo.topology import snapshot

        out.document(snapshot.to_dict(topo))
        return
    from gputopo.ui.topo_view import render_topology

    out.show(render_topology(topo))
