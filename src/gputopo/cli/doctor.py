"""CLI: ``gputopo doctor`` (the whole check, one report) and ``gputopo report`` (show a saved one)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

from gputopo.cli import app
from gputopo.cli.across_nodes import (
    INJECT_NODE_OPTION,
    NNODES_OPTION,
    NODE_RANK_OPTION,
    RDZV_ENDPOINT_OPTION,
    RDZV_ID_OPTION,
    RDZV_TIMEOUT_OPTION,
    progress_printer,
    warn_internode,
)
from gputopo.cli.common import (
    INPUT_HELP,
    INPUT_METAVAR,
    JSON_OPTION,
    NVML_TIMEOUT_OPTION,
    examples,
    guarded,
    options_from,
    read_json_file,
)
from gputopo.cli.finish import Views, attach_files, write_files
from gputopo.errors import InputError, Interrupted, UnavailableError
from gputopo.report import ensure_report_dir
from gputopo.services import doctor
from gputopo.services.across_nodes import check_rendezvous, node_options
from gputopo.services.doctor import DEFAULT_REPORT_DIR, DEFAULT_SAMPLE_S, DEFAULT_TIMEOUT_S, Fault
from gputopo.ui.output import Output

if TYPE_CHECKING:
    from gputopo.ui.probe_view import ProbeProgress


@app.command(
    "doctor",
    epilog=examples(
        "gputopo doctor                      # this machine: exit 0 healthy, 1 problems, 3 no driver",
        "gputopo doctor --skip-probe         # topology, links and processes only (about a second)",
        "gputopo doctor --simulate           # the simulated run on a sample machine, exit by its verdict",
        "gputopo doctor --simulate --full    # the full probe on CPU ranks, not the quick show",
        "gputopo doctor --input sample:dgx1-v100 --skip-probe",
        "gputopo doctor --skip-probe --nccl-log job.log   # with the NCCL DIAG lines of a job's output",
        "srun --nodes 4 --ntasks-per-node 1 gputopo doctor   # every node, then the inter-node tests",
    ),
)
@guarded
def doctor_command(
    input: str | None = typer.Option(
        None,
        "--input",
        "-i",
        metavar=INPUT_METAVAR,
        help=INPUT_HELP + " Probes then run simulated on CPU ranks.",
    ),
    simulate: bool = typer.Option(
        False,
        "--simulate",
        help="Run on the sample machine with CPU ranks and exit by its verdict (without it, a machine "
        "with no NVIDIA driver still shows the simulation but exits 3).",
    ),
    steps: int | None = typer.Option(
        None, help="Training steps of each probe's dp and ddp checks. Default: 5 (2 in the quick simulation)."
    ),
    full: bool = typer.Option(
        False,
        "--full",
        help="Without a GPU, run the full probe on CPU ranks (tiny ResNet, 5 steps, the speed table) "
        "instead of the quick show (a micro CNN, 2 steps).",
    ),
    timeout: float = typer.Option(
        DEFAULT_TIMEOUT_S, help="Seconds a probed set may go without progress before it counts as hung."
    ),
    skip_probe: bool = typer.Option(
        False,
        "--skip-probe",
        help="Only topology, links and processes (across nodes, the inter-node tests still run).",
    ),
    skip_speed: bool = typer.Option(
        False, "--skip-speed", help="No speed table (one GPU vs DataParallel vs DDP) on the recommended sets."
    ),
    model: str | None = typer.Option(
        None,
        help="Model for the probes (resnet18, resnet50, tiny, micro). Default: resnet18 on GPU, tiny on CPU "
        "ranks, micro in the quick simulation.",
    ),
    report_dir: Path = typer.Option(
        DEFAULT_REPORT_DIR, metavar="PATH", help="Where the JSON, Markdown and HTML reports go."
    ),
    html_out: bool | None = typer.Option(
        None,
        "--html/--no-html",
        help="Draw the HTML report with pictures (matplotlib, a few seconds). Default: with the probes, "
        "not with --skip-probe (gputopo report FILE --html draws it later).",
    ),
    inject: Fault | None = typer.Option(
        None, help="Drill: plant a fault in the probes (needs --inject-gpus) to see the doctor catch it."
    ),
    inject_gpus: str | None = typer.Option(
        None, "--inject-gpus", help="Drill: the GPUs whose sets get the fault, e.g. 5,6."
    ),
    nnodes: int | None = NNODES_OPTION,
    node_rank: int | None = NODE_RANK_OPTION,
    rdzv_endpoint: str | None = RDZV_ENDPOINT_OPTION,
    rdzv_id: str | None = RDZV_ID_OPTION,
    rdzv_timeout: float | None = RDZV_TIMEOUT_OPTION,
    inject_node: int | None = INJECT_NODE_OPTION,
    nvml_timeout: float = NVML_TIMEOUT_OPTION,
    sample_s: float = typer.Option(
        DEFAULT_SAMPLE_S,
        "--sample-s",
        metavar="SECONDS",
        help="The health check's window: error counters are read twice this far apart and judged by "
        "their rise (as `gputopo check --sample-s`).",
    ),
    nccl_log: Path | None = typer.Option(
        None,
        "--nccl-log",
        metavar="FILE",
        help="A job's output with NCCL's `NCCL DIAG` lines (NCCL_RUN_DIAGNOSTICS=1, NCCL >= 2.31; "
        "`gputopo run --nccl-diagnostics` sets it): failed checks join the findings.",
    ),
    dcgm_diag: Path | None = typer.Option(
        None,
        "--dcgm-diag",
        metavar="FILE",
        help="A saved `dcgmi diag -r LEVEL -j` output (DCGM 3.x or 4.x, --iterations too): its failures "
        "join the findings as problems on the GPU DCGM names, its warnings and skipped tests as notes.",
    ),
    health_validation: Path | None = typer.Option(
        None,
        "--health-validation",
        metavar="FILE",
        help="A saved NVIDIA Health Validation verdict (its JSON NodeVerdict): CRITICAL and UNKNOWN join "
        "the findings as problems, WARNING as notes.",
    ),
    json_out: bool = JSON_OPTION,
) -> None:
    """Check this machine end to end (health, topology, links, stale processes, probes), write a report.

    Across nodes (--nnodes, or under srun), every node checks itself, then all of them run the inter-node
    tests together; node rank 0 writes the one report and every node exits with the run's verdict.
    """
    out = Output(json_mode=json_out)
    node = node_options(nnodes, node_rank, rdzv_endpoint, rdzv_id, rdzv_timeout, inject, inject_node)
    options = options_from(
        doctor.Options, locals(), timeout_s=timeout, nvml_timeout_s=nvml_timeout, health_sample_s=sample_s
    )
    ensure_report_dir(report_dir)
    if node is not None:
        check_rendezvous(node)
    _finish(out, _run(out, options, json_out), options, html_out, json_out)


def _writes(options: doctor.Options) -> bool:
    """Whether this node writes the report files: across nodes, node rank 0 writes the one report."""
    return options.node is None or options.node.node_rank == 0


def _run(out: Output, options: doctor.Options, json_out: bool) -> doctor.DoctorReport:
    """Run the doctor with its progress on stderr; a run a signal stopped writes the report so far."""
    from gputopo.ui.doctor_markdown import to_markdown

    hooks = doctor.Hooks(
        on_start=None if json_out else partial(_say_start, out, options.skip_probe),
        probe_bars=None if json_out else partial(_probe_bars, out),
        on_row=progress_printer(out, options.node, json_out) if options.node is not None else None,
    )
    try:
        return doctor.run(options, hooks)
    except Interrupted as exc:
        if isinstance(exc.partial, doctor.DoctorReport) and _writes(options):
            views = Views(markdown=to_markdown)
            paths = write_files(out, "doctor", exc.partial.document(), views, options.report_dir)
            exc.note = f"the report so far, marked interrupted, is {paths['json']}"
        raise


def _finish(
    out: Output, report: doctor.DoctorReport, options: doctor.Options, html_out: bool | None, json_out: bool
) -> NoReturn:
    """The warnings, the report files (node rank 0), the document or the view, and the exit code."""
    from gputopo.ui.doctor_markdown import to_markdown
    from gputopo.ui.doctor_view import render_doctor
    from gputopo.ui.html_report import render_html

    doc = report.document()
    out.warnings(doc.get("warnings") or ())
    if doc["why_simulated"] and json_out:  # the human view prints it at the top itself
        out.warn(doc["why_simulated"])
    # Importing matplotlib costs seconds, most of a --skip-probe run; the quick look skips the pictures.
    pictures = html_out if html_out is not None else not options.skip_probe or options.node is not None
    views = Views(markdown=to_markdown, html=render_html if pictures else None)
    report = attach_files(out, "doctor", report, views, options.report_dir if _writes(options) else None)
    warn_internode(out, doc)
    if json_out:
        out.document(report.document())
    else:
        out.show(render_doctor(report.document()))
    unavailable = report.unavailable()
    if unavailable is not None:
        raise unavailable
    raise typer.Exit(report.exit_code)


def _probe_bars(out: Output, plan: doctor.Plan) -> ProbeProgress:
    """The probes' progress bars on stderr, after a line saying what is probed."""
    from gputopo.ui.probe_view import ProbeProgress

    sets, ranks = len(plan.sets), len(plan.gpus)
    out.err.print(
        f"gputopo doctor: probing {sets} GPU set(s) with one pool of {ranks} ranks "
        "(each imports torch first)",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return ProbeProgress(out.err, plan)


def _say_start(out: Output, skip_probe: bool, machine: doctor.Machine) -> None:
    """The first line, said once the machine is read and before the slow part (health reads, the ranks'
    torch start-up), so a first run is not silent on a terminal or a pipe (rich flushes each print)."""
    topo = machine.topology
    where = f"{topo.source}, {len(topo.gpus)} GPU(s)"
    where += ", simulated on CPU ranks" if machine.simulated else ""
    where += " (a quick show; --full runs the full probe)" if machine.quick else ""
    then = "health, links and processes" + ("" if skip_probe else ", then probes of its GPU sets")
    out.err.print(f"gputopo doctor: {where}: {then}", markup=False, highlight=False, soft_wrap=True)


@app.command(
    "report",
    epilog=examples(
        "gputopo report reports/doctor-20261121T161650Z.json",
        "gputopo report doctor-20261121T161650Z.json --html copy.html   # redraw on another machine",
        "gputopo report reports/probe-20261121T153000Z.json            # a probe's tables and verdict",
    ),
)
@guarded
def report_command(
    path: Path = typer.Argument(
        ..., metavar="PATH", help="A doctor or probe report (reports/doctor-*.json, probe-*.json)."
    ),
    html: Path | None = typer.Option(
        None, "--html", metavar="PATH", help="Also write the HTML report to this file."
    ),
    json_out: bool = JSON_OPTION,
) -> None:
    """Show a saved doctor or probe report in the terminal (and re-render its HTML)."""
    from gputopo.outputs import check_output, write_output

    out = Output(json_mode=json_out)
    doc, kind = read_report(path)
    if html is not None:  # a path that can't be written is refused before any work
        check_output(html, "--html", "report.html")
    try:
        if kind == "probe" and not isinstance(doc.get("sets"), list):
            raise KeyError("sets")
        rendered = _saved_html(doc, kind) if html is not None else None
        out.warnings(doc.get("warnings") or ())
        _show_saved(out, doc, kind, json_out)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError):
        raise InputError(
            f"{path}: an incomplete or damaged {kind} report (a section is missing or malformed)",
            f"was it edited by hand? rerun gputopo {kind}",
        ) from None
    if html is not None and rendered is not None:
        write_output(html, rendered, "--html")
        out.err.print(f"wrote {html}")


def _saved_html(doc: dict, kind: str) -> str:
    """The saved report's HTML page; matplotlib missing is said in one line (exit 3)."""
    from gputopo.ui.html_report import render_html, render_probe_html

    try:
        return render_probe_html(doc) if kind == "probe" else render_html(doc)
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        raise UnavailableError(
            "--html needs matplotlib to draw the pictures, and it is not installed",
            "pip install 'gputopo[probe]' (or leave out --html for the terminal view)",
        ) from None


def _show_saved(out: Output, doc: dict, kind: str, json_out: bool) -> None:
    """The saved report as it was written (``--json``), or its terminal view."""
    if json_out:
        out.document(doc)
    elif kind == "probe":
        from gputopo.ui.probe_view import render_nodes, render_probe

        out.show(render_nodes(doc) if doc.get("nodes") else render_probe(doc))
    else:
        from gputopo.ui.doctor_view import render_doctor

        out.show(render_doctor(doc))


def read_report(path: Path) -> tuple[dict, str]:
    """The report at ``path`` and the command that wrote it (``services.doctor.saved_report``)."""
    return doctor.saved_report(read_json_file(path, str(path), doctor.REPORT_HINT), str(path))
