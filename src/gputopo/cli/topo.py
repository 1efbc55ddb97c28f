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
    read_topology,
)
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
        from gputopo.topology import samples

        if json_out:
            out.document(
                {"samples": [{"name": s.name, "summary": s.summary} for s in samples.SAMPLES.values()]}
            )
        else:
            for s in samples.SAMPLES.values():
                out.show(f"sample:{s.name:<26} {s.summary}")
        return
    topo = read_topology(out, input, nvml_timeout_s=nvml_timeout)
    health = None
    # The JSON snapshot stays the topology alone, so it reads back equal (`gputopo check --json` has the
    # health document).
    if input is None and topo.live and not no_health and not json_out:
        # Health only where it is this machine's: never for --input files or samples.
        from gputopo.cli.options import TOPO_HEALTH_SOURCE, health_doc
        from gputopo.machine import read_live_health

        health = health_doc(read_live_health(nvml_timeout), TOPO_HEALTH_SOURCE)
    if json_out:
        from gputopo.topology import snapshot

        if input is None and topo.live:
            # The node's name and last fresh check: the snapshot is then the node's facts (gputopo nodes).
            from dataclasses import replace

            from gputopo.machine import node_facts

            facts = node_facts(topo, topo.warnings)
            out.warnings(
                facts.get("warnings", ())[len(topo.warnings) :]
            )  # a state file that could not be used
            topo = replace(topo, **facts)
        out.document(snapshot.to_dict(topo))
        return
    from gputopo.ui.topo_view import render_topology

    out.show(render_topology(topo, health))
    if input is None and topo.live and not no_health:
        # The network ports and each GPU pair's PCIe path (ACS), from sysfs (docs/topo.md).
        from gputopo import fabric
        from gputopo.ui.fabric_view import fabric_blocks

        gpus = fabric.gpu_bus_ids([(g.index, g.pci_bus_id) for g in topo.gpus])
        node = fabric.snapshot(gpus)
        for block in fabric_blocks(node.to_json(), [f.to_json() for f in node.findings]):
            out.show(block)
