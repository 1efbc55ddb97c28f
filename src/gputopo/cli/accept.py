"""CLI: ``gputopo accept``: may this node take jobs? Its steps against numbers, one verdict, a record."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from gputopo.cli import app
from gputopo.cli.common import JSON_OPTION, NVML_TIMEOUT_OPTION, examples, guarded, options_from
from gputopo.cli.finish import Views, finish
from gputopo.model import DEFAULT_ACCEPT_BUDGET_S
from gputopo.services.accept import DEFAULT_REPORT_DIR, DEFAULT_SAMPLE_S, DEFAULT_SINCE, Fault
from gputopo.ui.output import Output


@app.command(
    "accept",
    epilog=examples(
        "gputopo accept --expect-gpus 8 --expect-model H100   # exit 0 accepted, 1 rejected, 3 not checked",
        "gputopo accept --json                                 # gputopo/accept/v1 document",
        "gputopo accept --gate --state /var/lib/gputopo/check-state.json   # drain, test, resume if accepted",
        "gputopo accept --dcgm-level 3 --budget 3600           # DCGM's long diagnostic folded in",
        "gputopo accept --floors my-floors.json                # your own floors (see --list-floors --json)",
        "gputopo accept --device cpu                           # the same steps on CPU stand-ins",
    ),
)
@guarded
def accept_command(
    expect_gpus: int | None = typer.Option(None, "--expect-gpus", metavar="N", help="N GPUs must be here."),
    expect_model: str | None = typer.Option(
        None, "--expect-model", metavar="TEXT", help="Every GPU's name must contain TEXT (e.g. H100)."
    ),
    expect_imex: bool = typer.Option(
        False, "--expect-imex", help="An IMEX daemon must run here (as check's)."
    ),
    budget: float = typer.Option(
        DEFAULT_ACCEPT_BUDGET_S,
        "--budget",
        metavar="SECONDS",
        help="End within this time; what did not run is 'not checked'.",
    ),
    keep_going: bool = typer.Option(False, "--keep-going", help="Run every step, even after one failed."),
    floors: Path | None = typer.Option(
        None, "--floors", metavar="FILE", help="Floors per GPU model (JSON) instead of gputopo's own."
    ),
    list_floors: bool = typer.Option(
        False, "--list-floors", help="Print the floors table (--json too) and exit."
    ),
    dcgm_level: int | None = typer.Option(
        None, "--dcgm-level", metavar="1-4", help="Run `dcgmi diag -r LEVEL -j` within the budget."
    ),
    dcgm_diag: Path | None = typer.Option(
        None, "--dcgm-diag", metavar="FILE", help="Read a saved `dcgmi diag -j` result instead."
    ),
    device: str | None = typer.Option(
        None,
        "--device",
        metavar="cuda|cpu",
        help="cpu: CPU ranks stand in for the GPUs (floors not applicable).",
    ),
    gate: bool = typer.Option(
        False, "--gate", help="Drain this Slurm node while testing; resume it only when accepted."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="With --gate: print the scontrol commands only."),
    state_file: Path | None = typer.Option(
        None,
        "--state",
        metavar="FILE",
        help="Keep the verdict in check's state file (root's default with --gate: "
        "/var/lib/gputopo/check-state.json).",
    ),
    report_dir: Path = typer.Option(
        Path(DEFAULT_REPORT_DIR), "--report-dir", metavar="PATH", help="Where the JSON, Markdown and HTML go."
    ),
    sample_s: float = typer.Option(DEFAULT_SAMPLE_S, "--sample-s", metavar="SECONDS", help="Health window."),
    since: str = typer.Option(DEFAULT_SINCE, "--since", metavar="DURATION", help="Xid window: 30m, 2h, 1d."),
    kernel_log: str | None = typer.Option(
        None, "--kernel-log", metavar="FILE|-", help="Read Xid lines from a saved kernel log, not dmesg."
    ),
    thresholds: Path | None = typer.Option(
        None, "--thresholds", metavar="FILE", help="check's rule overrides."
    ),
    inject: Fault | None = typer.Option(
        None, "--inject", metavar="sdc|slow", help="A drill: plant it in the per-GPU step."
    ),
    inject_gpus: str | None = typer.Option(None, "--inject-gpus", metavar="N", help="Where the drill goes."),
    nvml_timeout: float = NVML_TIMEOUT_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Decide whether this node may take jobs: inventory, health, DCGM's diagnostics (when asked), each
    GPU alone and the wiring, against floors per GPU model. Exit 0 accepted, 1 rejected, 3 not checked."""
    from gputopo.services import accept

    table = accept.load_floors(floors)
    _list_floors(accept.floors_json(table) if list_floors else None, json_out)
    options = options_from(
        accept.Options,
        locals(),
        budget_s=budget,
        floors=table,
        dcgm_saved=accept.read_dcgm_file(dcgm_diag) if dcgm_diag is not None else None,
        thresholds=accept.load_rules(thresholds),
        since_s=accept.since_seconds(since),
        kernel_log=accept.read_kernel_log(kernel_log) if kernel_log is not None else None,
        nvml_timeout_s=nvml_timeout,
        state_path=accept.state_file(state_file, gate),
    )
    _run(options, report_dir, json_out)


def _list_floors(doc: dict[str, Any] | None, json_out: bool) -> None:
    """``--list-floors``: print the table and exit 0 (``doc`` ``None``: not asked)."""
    if doc is not None:
        _print_floors(doc, json_out)
        raise typer.Exit(0)


def _run(options: Any, report_dir: Path, json_out: bool) -> None:
    from gputopo.services import accept
    from gputopo.ui.accept_view import render_html, render_markdown, render_text

    accept.check_report_dir(report_dir)
    out = Output(json_mode=json_out)
    report = accept.run(options, accept.Hooks(warn=out.warn, progress=_progress))
    views = Views(text=render_text, markdown=render_markdown, html=render_html)
    finish(out, report, views, kind="accept", json_out=json_out, report_dir=report_dir)


def _progress(step: str, words: str) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"accept: {step}: {words}\n")
        sys.stderr.flush()


def _print_floors(doc: dict[str, Any], as_json: bool) -> None:
    import json

    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    lines = [f"floors: {doc['source']}"]
    for rule, words in doc["rules"].items():
        lines.append(f"  {rule}: {words}")
    for m in doc["models"]:
        lines.append(f"{m['model']}  (device name matches /{m['pattern']}/)")
        for metric, entry in m.items():
            if metric in ("model", "pattern"):
                continue
            entries = {"": entry} if "floor" in entry else entry
            for key, f in entries.items():
                label = f"{metric}[{key}]" if key else metric
                lines.append(f"  {label:30} {f['floor']:>9g}  ({f['derived']}: {f['source']})")
    sys.stdout.write("\n".join(lines) + "\n")
