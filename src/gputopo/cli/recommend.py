"""CLI: ``gputopo recommend``: the best K-GPU sets for CUDA_VISIBLE_DEVICES, with estimates and reasons."""

from __future__ import annotations

from enum import Enum

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, NVML_TIMEOUT_OPTION, examples, guarded, options_from
from gputopo.cli.finish import Views, finish
from gputopo.cli.options import IGNORE_VISIBLE_OPTION, choice_options
from gputopo.services import recommend as service
from gputopo.services.recommend import DEFAULT_TOP, Choice
from gputopo.ui.output import Output


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
@choice_options
def recommend_command(
    n: int = typer.Option(..., "--n", "-n", help="GPUs per set."),
    sets: int | None = typer.Option(None, "--sets", metavar="M", help="Pack M disjoint sets of --n GPUs."),
    choice: Choice = None,  # type: ignore[assignment]  # the shared set-choice options (choice_options)
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
    options = options_from(service.Options, locals(), id_format=id_format.value, nvml_timeout_s=nvml_timeout)
    out = Output(json_mode=json_out)
    report = service.run(options, service.Hooks(warn=out.warn))
    if json_out:
        finish(out, report, Views(), kind="recommend", json_out=True)
    _show(out, report)


def _show(out: Output, report: service.RecommendReport) -> None:
    """The ranked table, then the export lines whole (Output.show wraps and crops at the terminal's
    width; a line meant for pasting must stay whole), then the launch line with its notes."""
    from gputopo.ui.recommend_view import export_lines, render_recommendation

    rec = report.recommendation
    out.show(render_recommendation(rec))
    out.show("")
    for line in export_lines(rec, report.id_format):
        out.line(line)
    if report.plan is not None:
        for note in report.plan.notes:
            out.hint(note)
        out.line(report.plan.command)
