"""What ``hang`` and ``slow`` share: ``--live`` (take a running job's evidence into its run folder) and the
tail every report takes (the HTML page, the JSON document or the text, the exit code)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from gputopo.ui.output import Output


def take_live(out: Output, paths: list[Path], command: str) -> Path:
    """--live: this node's ranks' stacks (and live dumps) into the run folder; returns the folder.
    ``command`` (hang, slow) is named in the hints."""
    from gputopo.errors import InputError, UnavailableError, UsageError
    from gputopo.hang.live import newest_run_dir, summary, take, targets_here
    from gputopo.system import run_facts
    from gputopo.system.pyspy import MISSING_HINT, find_pyspy

    if len(paths) > 1:
        raise UsageError(
            "--live takes one run folder", f"e.g. gputopo {command} --live reports/run-20260101T120000Z"
        )
    run_dir = paths[0] if paths else newest_run_dir(Path("reports"))
    if run_dir is None:
        raise InputError("--live: no run folder under reports/", "give the folder `gputopo run` printed")
    if not run_dir.is_dir():
        raise InputError(f"--live {run_dir}: no such folder", "give the folder `gputopo run` printed")
    if find_pyspy() is None:
        raise UnavailableError("--live: py-spy is not installed", MISSING_HINT)
    host = run_facts.hostname()
    targets = targets_here(run_dir, host)
    if not targets:
        raise InputError(
            f"--live {run_dir}: its run record names no rank with a PID on this host ({host})",
            "run it on a node of the job, in a folder `gputopo run` wrote (its record lists the ranks' PIDs)",
        )
    gone = [t.rank for t in targets if not os.path.exists(f"/proc/{t.pid}")]
    if len(gone) == len(targets):
        raise InputError(
            f"--live {run_dir}: none of this host's ranks is running any more",
            f"the job has ended: gputopo {command} {run_dir} reads what it left",
        )
    ev = take(run_dir, [t for t in targets if t.rank not in gone], host, "live")
    out.hint(f"--live: {summary(ev)}")
    for problem in ev.problems:
        out.warn(problem)
    if ev.hint and all(s.error for s in ev.stacks):
        raise UnavailableError(f"--live: no rank's stack could be read ({ev.problems[0]})", ev.hint)
    if ev.hint:
        out.hint(ev.hint)
    return run_dir


def finish(out: Output, report: Any, render: Callable[[bool], str], html: Path | None) -> None:
    """A report's tail: the HTML page to ``html`` (``render(True)``), the JSON document, or the text
    (``render(False)``); exits with the report's ``exit_code``."""
    if html is not None:
        from gputopo.outputs import write_output

        write_output(html, render(True), "--html")
        out.hint(f"HTML report: {html}")
    out.document(report.document())
    if not out.json_mode:
        out.line(render(False).rstrip("\n"))
    if report.exit_code:
        raise typer.Exit(report.exit_code)
