"""CLI: ``gputopo hang``: a hung job's Flight Recorder dumps (and NCCL RAS) -> the stuck collective, the
ranks that never joined, their host, GPU and health."""

from __future__ import annotations

from pathlib import Path

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, RUN_RECORD_OPTION, examples, guarded
from gputopo.cli.finish import finish_page
from gputopo.ui.output import Output


@app.command(
    "hang",
    epilog=examples(
        "gputopo hang reports/run-20260101T120000Z          # the run folder `gputopo run` printed",
        "gputopo hang reports/run-20260101T120000Z/fr-dump- # its dumps by prefix (TORCH_FR_DUMP_TEMP_FILE)",
        "gputopo hang dumps/ --run-record node0.json --run-record node1.json",
        "gputopo hang dumps/ --ras                          # also ask this node's NCCL RAS",
        "gputopo hang --ras-json ras.json                   # a saved `ncclras -f json`",
        "gputopo hang dumps/ --html hang.html               # the ranks drawn per host and group",
        "gputopo hang reports/run-20260101T120000Z --nccl-log job.log   # with NCCL DIAG lines",
        "gputopo hang --live                                # the newest run, still running: its stacks",
        "gputopo hang --live reports/run-20260101T120000Z   # that run (on each node of a shared folder)",
    ),
)
@guarded
def hang_command(
    paths: list[Path] | None = typer.Argument(
        None,
        metavar="PATH...",
        help="Folders or file prefixes of Flight Recorder dumps (pickle or JSON), from one node or many.",
    ),
    json_out: bool = JSON_OPTION,
    ras: bool = typer.Option(
        False, "--ras", help="Ask this node's NCCL RAS port too (NCCL_RAS_ADDR, default localhost:28028)."
    ),
    ras_json: Path | None = typer.Option(
        None, "--ras-json", metavar="FILE", help="Read a saved `ncclras -f json` output."
    ),
    run_record: list[Path] | None = RUN_RECORD_OPTION,
    html: Path | None = typer.Option(
        None, "--html", metavar="FILE", help="Also write an HTML report: the ranks drawn per host and group."
    ),
    nccl_log: Path | None = typer.Option(
        None,
        "--nccl-log",
        metavar="FILE",
        help="A job's output with NCCL's `NCCL DIAG` lines (NCCL_RUN_DIAGNOSTICS=1, NCCL >= 2.31; "
        "`gputopo run --nccl-diagnostics` sets it): failed checks become findings.",
    ),
    torch_check: bool = typer.Option(
        False,
        "--torch-check",
        help="Also run torch's own analyzer (torch.distributed.flight_recorder) and say where it disagrees.",
    ),
    live: bool = typer.Option(
        False,
        "--live",
        help="The job started by `gputopo run` still runs on this node: take every local rank's Python "
        "stack with py-spy (and its Flight Recorder through torch's control plane, where the job serves "
        "it) into the run folder, without stopping the job, and judge them with what is there. PATH is "
        "the run folder (default: the newest reports/run-*).",
    ),
) -> None:
    """Name the collective a hung job is stuck in, the ranks that never joined or called it differently,
    and where they ran. Exit 0 no hang, 1 a hang or mismatch, 2 bad input, 3 nothing (conclusive) to
    analyse."""
    from gputopo.services import hang as service
    from gputopo.ui.hang_view import HangFormat, render

    out = Output(json_mode=json_out)
    options = service.Options(
        ras=ras,
        ras_json=ras_json,
        paths=tuple(paths or ()),
        nccl_log=nccl_log,
        torch_check=torch_check,
        run_records=tuple(run_record or ()),
        live=live,
        html=html,
    )
    report = service.run(options, service.Hooks(warn=out.warn, hint=out.hint))
    finish_page(out, report, lambda page: render(report, HangFormat.HTML if page else HangFormat.TEXT), html)
