"""CLI: ``gputopo topo``: the link map of this machine, a saved output, a snapshot or a sample."""

from __future__ import annotations

import typer

from gputopo.cli import app
from gputopo.cli.common import (
    INPUT_OPTION,
    JSON_OPTION,
    NVML_TIMEOUT_OPTION,
    examples,
    guarded,
    options_from,
)
from gputopo.services import topo as service
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
    input: str | None = INPUT_OPTION,
    json_out: bool = JSON_OPTION,
    list_samples: bool = typer.Option(False, "--list-samples", help="Name the built-in sample machines."),
    nvml_timeout: float = NVML_TIMEOUT_OPTION,
    no_health: bool = typer.Option(
        False, "--no-health", help="Skip the health read of the live machine (one NVML sample per GPU)."
    ),
) -> None:
    """Show how the GPUs and NICs are wired: link matrix, legend, CPU/NUMA affinity, live NVML details."""
    out = Output(json_mode=json_out)
    if list_samples:
        listed = service.samples()
        if json_out:
            _document(out, listed)
        for line in listed.lines():
            out.show(line)
        return
    options = options_from(service.Options, locals(), nvml_timeout_s=nvml_timeout)
    report = service.run(options, service.Hooks(warn=out.warn))
    if json_out:
        _document(out, report)
    from gputopo.ui.fabric_view import fabric_blocks
    from gputopo.ui.topo_view import render_topology

    out.show(render_topology(report.topology, report.health))
    if report.fabric is not None:
        node = report.fabric
        for block in fabric_blocks(node.to_json(), [f.to_json() for f in node.findings]):
            out.show(block)


def _document(out: Output, report: service.TopoReport | service.SamplesReport) -> None:
    """The document on stdout, and exit (cli.finish loaded only here: text loads no other part of cli/)."""
    from gputopo.cli.finish import Views, finish

    finish(out, report, Views(), kind="topo", json_out=True)
