"""CLI: ``gputopo recommend``: the best K-GPU sets for CUDA_VISIBLE_DEVICES, with estimates and reasons."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from gputopo.cli import app
from gputopo.cli.common import INPUT_OPTION, JSON_OPTION, NVML_TIMEOUT_OPTION, examples, guarded
from gputopo.cli.options import (
    ALLOW_BUSY_OPTION,
    ALLOW_UNHEALTHY_OPTION,
    EXCLUDE_OPTION,
    FORCE_REPORT_OPTION,
    IGNORE_VISIBLE_OPTION,
    MAX_USED_OPTION,
    REPORT_OPTION,
    check_report_machine,
    set_constraints,
    with_health,
    within_preset,
)
from gputopo.errors import UsageError
from gputopo.ui.output import Output

if TYPE_CHECKING:
    pass

DEFAULT_TOP = 5


class IdFormat(str, Enum):
    """How the export line names GPUs."""

    index = "index"
    uuid = "uuid"


FORMAT_OPTION = typer.Option(
    IdFormat.index, "--format", help="Name GPUs in the export line by index or UUID."
)


@app.command(
    "recommend",
    epilog=examples(
        "gputopo recommend --n 2                        # the best pair on this machine",
        "gputopo recommend --n 4 --exclude 3 --top 3",
        "gputopo recommend --n 2 --sets 4 --input sample:seed-8gpu-nv4",
        "gputopo recommend --n 2 --from-report reports/probe-20261121T153000Z.json",
        'eval "$(gputopo recommend --n 4 | tail -1)"    # the last line is the export line',
    ),
)
@guarded
def recommend_command(
    n: int = typer.Option(..., "--n", "-n", help="GPUs per set."),
    sets: int | None = typer.Option(None, "--sets", metavar="M", help="Pack M disjoint sets of --n GPUs."),
    input: str | None = INPUT_OPTION,
    exclude: str | None = EXCLUDE_OPTION,
    allow_busy: bool = ALLOW_BUSY_OPTION,
    allow_unhealthy: bool = ALLOW_UNHEALTHY_OPTION,
    max_used_mib: int = MAX_USED_OPTION,
    from_report: Path | None = REPORT_OPTION,
    force_report: bool = FORCE_REPORT_OPTION,
    nvlink_gbps: float | None = typer.Option(
        None, "--nvlink-gbps", help="NVLink GB/s per link per direction (default: by GPU model, else 20)."
    ),
    pcie_gen: int | None = typer.Option(
        None, "--pcie-gen", help="PCIe generation of the GPU links (default: from NVML, else Gen3)."
    ),
    socket_gbps: float | None = typer.Option(
        None, "--socket-gbps", help="CPU socket interconnect GB/s for SYS paths (default 10)."
    ),
    top: int = typer.Option(
        DEFAULT_TOP,
        "--top",
        help="How many ranked candidates to show; equivalent sets share one row, so there may be fewer.",
    ),
    id_format: IdFormat = FORMAT_OPTION,
    launch: str | None = typer.Option(
        None,
        "--launch",
        metavar="CMD",
        help='Also print the torchrun line that runs "CMD ..." on the best set.',
    ),
    nnodes: int | None = typer.Option(
        None,
        "--nnodes",
        metavar="N",
        help="With --launch: machines in the job (sets NCCL_IB_HCA when above 1).",
    ),
    nvml_timeout: float = NVML_TIMEOUT_OPTION,
    ignore_visible: bool = IGNORE_VISIBLE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """The best GPU sets for CUDA_VISIBLE_DEVICES: ranked by estimated all-reduce bandwidth, with reasons."""
    from gputopo.machine import load_topology
    from gputopo.recommend import recommend, to_dict
    from gputopo.topology.bandwidth import Assumptions

    out = Output(json_mode=json_out)
    assumptions = Assumptions(nvlink_gbps_per_link=nvlink_gbps, pcie_gen=pcie_gen, socket_gbps=socket_gbps)
    constraints = set_constraints(
        n,
        exclude,
        allow_busy,
        max_used_mib,
        from_report,
        allow_unhealthy,
        sets=sets,
        top=top,
        assumptions=assumptions,
    )
    # its warnings come back in rec.warnings, said once below
    topo = load_topology(input, nvml_timeout_s=nvml_timeout)
    check_report_machine(constraints, topo, input is None, force_report, out.warn)
    constraints = within_preset(constraints, topo, ignore_visible, input is not None, out.warn)
    constraints, health = with_health(constraints, input, nvml_timeout)  # live: one health sample
    if input is None and topo.live:  # live: ACS on each GPU pair's PCIe path (sysfs; docs/topo.md)
        from dataclasses import replace

        from gputopo import fabric

        gpus = fabric.gpu_bus_ids([(g.index, g.pci_bus_id) for g in topo.gpus])
        constraints = replace(constraints, redirected=fabric.redirected(gpus))
    rec = recommend(topo, constraints)
    doc = to_dict(rec, id_format.value)  # builds every env first: a --format uuid error comes before output
    doc["health"] = health
    plan = None
    if nnodes is not None and launch is None:
        raise UsageError("--nnodes goes with --launch", 'add --launch "CMD ...", e.g. --launch "train.py"')
    if launch is not None:
        from gputopo.launch.command import launch_plan_for

        prefer_uuid = id_format.value == "uuid"
        plan = launch_plan_for(topo, rec.best.gpus, launch, nnodes or 1, prefer_uuid, out.warn)
        doc["launch"] = plan.to_dict()
    out.warnings(rec.warnings)
    if json_out:
        out.document(doc)
        return
    from gputopo.ui.recommend_view import export_lines, render_recommendation

    out.show(render_recommendation(rec))
    out.show("")
    for line in export_lines(rec, id_format.value):
        # Output.show wraps and crops at the terminal width; a line meant for pasting must stay whole.
        out.line(line)
    if plan is not None:
        for note in plan.notes:
            out.hint(note)
        out.line(plan.command)
