"""CLI: ``gputopo doctor`` (the whole check, one report) and ``gputopo report`` (show a saved one)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gputopo.cli import app
from gputopo.cli.common import INPUT_HELP, JSON_OPTION, guarded
from gputopo.errors import EXIT_PROBLEM, InputError
from gputopo.ui.output import Output


@app.command("doctor")
@guarded
def doctor_command(
    input: Optional[str] = typer.Option(  # noqa: UP045 (typer)
        None, "--input", "-i", help=INPUT_HELP + " Probes then run simulated on CPU ranks."
    ),
    steps: int = typer.Option(5, help="Training steps of each probe's dp and ddp checks."),
    timeout: float = typer.Option(120.0, help="Seconds each probed set may take before it counts as hung."),
    skip_probe: bool = typer.Option(False, "--skip-probe", help="Only topology, links and processes."),
    skip_speed: bool = typer.Option(
        False, "--skip-speed", help="No speed table (one GPU vs DataParallel vs DDP) on the recommended sets."
    ),
    model: Optional[str] = typer.Option(  # noqa: UP045 (typer)
        None, help="ResNet for the probes (resnet18, resnet50, tiny). Default: resnet18 on GPU, tiny on CPU."
    ),
    report_dir: Path = typer.Option(Path("reports"), help="Where the JSON, Markdown and HTML reports go."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Check this machine end to end (topology, links, stale processes, probes) and write a report."""
    from gputopo.doctor import DoctorOptions, run_doctor, to_markdown
    from gputopo.report import ensure_report_dir, write_report
    from gputopo.ui.html_report import render_html

    out = Output(json_mode=json_out)
    ensure_report_dir(report_dir)
    options = DoctorOptions(input, steps, timeout, skip_probe, model, report_dir, skip_speed=skip_speed)

    def progress(plan):
        from gputopo.ui.probe_view import ProbeProgress

        return ProbeProgress(out.err, plan)

    doc = run_doctor(options, probe_hook=None if json_out else progress)
    if doc["why_simulated"] and json_out:  # the human view prints it at the top itself
        out.warn(doc["why_simulated"])
    try:
        html = render_html(doc)
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        html = None
        out.warn("no HTML report: matplotlib is not installed (pip install 'gputopo[probe]')")
    paths = write_report("doctor", doc, to_markdown(doc), report_dir, html=html)
    doc["report"] = paths
    if json_out:
        out.document(doc)
    else:
        from gputopo.ui.doctor_view import render_doctor

        out.show(render_doctor(doc))
    if doc["verdict"] != "healthy":
        raise typer.Exit(EXIT_PROBLEM)


@app.command("report")
@guarded
def report_command(
    path: Path = typer.Argument(..., help="A doctor report (reports/doctor-*.json)."),
    html: Optional[Path] = typer.Option(None, "--html", help="Also write the HTML report to this file."),  # noqa: UP045
    json_out: bool = JSON_OPTION,
) -> None:
    """Show a saved doctor report in the terminal (and re-render its HTML)."""
    import json

    from gputopo.report import atomic_write

    out = Output(json_mode=json_out)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such file", "give a reports/doctor-*.json file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(
            f"{path}: not a readable JSON report ({exc})", "give a reports/doctor-*.json file"
        ) from None
    if not isinstance(doc, dict) or doc.get("schema") != "gputopo/doctor/v1":
        schema = doc.get("schema") if isinstance(doc, dict) else None
        raise InputError(
            f"{path}: schema {schema!r} is not a doctor report",
            "probe reports are Markdown beside their JSON (reports/probe-*.md); this shows doctor-*.json",
        )
    try:
        if html is not None:
            from gputopo.ui.html_report import render_html

            atomic_write(html, render_html(doc))
            out.err.print(f"wrote {html}")
        if json_out:
            out.document(doc)
            return
        from gputopo.ui.doctor_view import render_doctor

        out.show(render_doctor(doc))
    except (KeyError, TypeError, AttributeError) as exc:
        raise InputError(
            f"{path}: incomplete doctor report ({type(exc).__name__}: {exc})",
            "was it edited by hand? rerun gputopo doctor",
        ) from None
