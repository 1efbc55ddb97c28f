"""CLI: ``gputopo slow``: which rank makes a job slow, from NCCL Inspector logs, Flight Recorder creation
times or an nccl-tests ``-J`` file."""

from __future__ import annotations

from pathlib import Path

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, RUN_RECORD_OPTION, examples, guarded
from gputopo.cli.finish import finish_page
from gputopo.ui.output import Output


@app.command(
    "slow",
    epilog=examples(
        "gputopo slow reports/run-20260101T120000Z          # the run folder `gputopo run` printed",
        "gputopo slow nccl-inspector-1234/                  # an NCCL Inspector dump folder",
        "gputopo slow dumps/ --run-record node0.json        # Flight Recorder dumps, ranks placed",
        "gputopo slow all_reduce.json                       # an nccl-tests -J file",
        "gputopo slow --live reports/run-20260101T120000Z   # the running job: its dumps taken now",
        "gputopo slow RUN_DIR --html slow.html              # with a per-rank lateness chart",
    ),
)
@guarded
def slow_command(
    path: Path | None = typer.Argument(
        None,
        metavar="PATH",
        help="A run folder, an Inspector dump folder, Flight Recorder dumps, or an nccl-tests -J file.",
    ),
    json_out: bool = JSON_OPTION,
    run_record: list[Path] | None = RUN_RECORD_OPTION,
    html: Path | None = typer.Option(
        None, "--html", metavar="FILE", help="Also write a per-rank lateness chart."
    ),
    live: bool = typer.Option(
        False,
        "--live",
        help="The job started by `gputopo run` still runs on this node: ask its ranks for their Flight "
        "Recorder dumps (as `gputopo hang --live` does) and judge them. PATH is the run folder "
        "(default: the newest reports/run-*).",
    ),
) -> None:
    """Name the rank the others wait for: the one that arrives late at the job's collectives, where it
    ran, how late, and what share of the job's time the others lose waiting for it. Exit 0 no straggler
    (or undecided), 1 a straggler, 2 bad input."""
    from gputopo.services import slow as service
    from gputopo.ui.slow_view import SlowFormat, render

    out = Output(json_mode=json_out)
    options = service.Options(path=path, run_records=tuple(run_record or ()), live=live, html=html)
    report = service.run(options, service.Hooks(warn=out.warn, hint=out.hint))
    finish_page(out, report, lambda page: render(report, SlowFormat.HTML if page else SlowFormat.TEXT), html)
