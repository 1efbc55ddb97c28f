"""CLI: ``gputopo probe``: data-checked DP/DDP training, P2P copies and an all-reduce sweep on GPU sets.

typer only: the options -> ``services.probe.Options`` -> ``services.probe.run`` -> the report files
(``cli.finish``) -> the document or ``ui.probe_view``'s text. torch is imported only by the ranks, inside
the run, so ``gputopo --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

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
)
from gputopo.cli.finish import Views, attach_files
from gputopo.services import probe
from gputopo.services.across_nodes import check_rendezvous, node_options
from gputopo.services.probe import Device, Fault, Mode, ModelName, Precision
from gputopo.ui.output import Output


@app.command(
    "probe",
    epilog=examples(
        "gputopo probe --gpus 5,6 --gpus 6,7            # two sets, every check",
        "gputopo probe --each-pair --mode p2p           # the P2P health matrix of the whole box",
        "gputopo probe --device cpu --gpus 0,1 --model tiny --steps 5 --inject corrupt",
        "gputopo probe --mode gpu                       # every GPU on its own: speed, host copies, bits",
        "gputopo probe --mode gpu --device cpu --gpus 0-3 --inject sdc --inject-gpus 2",
        "srun --nodes 4 --ntasks-per-node 1 gputopo probe   # across nodes: which node, GPU or link is bad",
        "gputopo probe --nnodes 2 --node-rank 0 --rdzv-endpoint node01:29400  # and --node-rank 1 on node02",
    ),
)
@guarded
def probe_command(
    gpus: Annotated[
        list[str] | None,
        typer.Option(
            "--gpus", "-g", help="A GPU set by nvidia-smi index, e.g. 5,6; repeat for more. Default: all."
        ),
    ] = None,
    each_pair: Annotated[
        bool,
        typer.Option("--each-pair", help="Probe every pair (the health matrix); disjoint pairs at once."),
    ] = False,
    mode: Annotated[Mode, typer.Option("--mode", "-m", help="Which check to run, or all.")] = Mode.ALL,
    device: Annotated[
        Device | None,
        typer.Option(help="cuda (default when torch sees a GPU) or cpu (CPU ranks stand in for GPUs, gloo)."),
    ] = None,
    model: Annotated[ModelName, typer.Option(help="The ResNet to train.")] = probe.DEFAULTS.model,
    batch_size: Annotated[int, typer.Option(help="Images per GPU per step.")] = probe.DEFAULTS.batch_size,
    steps: Annotated[
        int, typer.Option(help="Training steps of the dp and ddp checks.")
    ] = probe.DEFAULTS.steps,
    lr: Annotated[float, typer.Option(help="SGD learning rate (momentum 0.9).")] = probe.DEFAULTS.lr,
    seed: Annotated[
        int, typer.Option(help="Seed of the weights and the synthetic data.")
    ] = probe.DEFAULTS.seed,
    timeout: Annotated[
        float, typer.Option(help="Seconds a set may go without progress before it is hung.")
    ] = probe.DEFAULTS.timeout_s,
    precision: Annotated[
        list[Precision] | None,
        typer.Option(
            "--precision",
            "-p",
            help="Precision of the dp and ddp checks: fp32, tf32, fp16 (autocast + GradScaler), bf16; "
            "repeat for several. Default: fp32.",
        ),
    ] = None,
    tolerance: Annotated[
        float | None,
        typer.Option(
            help="Per-GPU check (--mode gpu): percent below its peers' median at which a GPU is slow. "
            "Default: 10 on GPUs, 25 on CPU stand-ins.",
        ),
    ] = None,
    inject: Annotated[
        Fault | None,
        typer.Option(
            help="Plant a fault in one rank to see its detector fire (sdc, slow: the per-GPU check)."
        ),
    ] = None,
    inject_rank: Annotated[
        int | None,
        typer.Option(help="Rank (within a set) that gets the fault. Default: the last."),
    ] = None,
    inject_gpus: Annotated[
        str | None,
        typer.Option(
            "--inject-gpus",
            help="Plant the fault in every set holding these GPUs, e.g. 5,6 (p2p: the copies between them).",
        ),
    ] = None,
    report_dir: Annotated[
        Path, typer.Option(metavar="PATH", help="Where the JSON, Markdown and HTML reports go.")
    ] = probe.DEFAULTS.report_dir,
    input: Annotated[
        str | None,
        typer.Option(
            "--input", "-i", metavar=INPUT_METAVAR, help=INPUT_HELP + " Used for the bandwidth estimate."
        ),
    ] = None,
    min_bytes: Annotated[
        str | None,
        typer.Option("--min-bytes", "-b", help="Smallest all-reduce size, as nccl-tests: 8, 1K, 256M."),
    ] = None,
    max_bytes: Annotated[
        str | None,
        typer.Option("--max-bytes", "-e", help="Largest all-reduce size (nccl-tests' -e)."),
    ] = None,
    step_factor: Annotated[
        int,
        typer.Option("--step-factor", "-f", help="Multiply the size by this between steps (nccl-tests' -f)."),
    ] = probe.DEFAULTS.step_factor,
    iters: Annotated[
        int | None,
        typer.Option(
            "--iters", "-n", help="Timed all-reduce iterations per size. Default: 20 on GPU, 5 on CPU."
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the plan (launches, GPUs, checks, each rank's CUDA/NCCL environment); start nothing.",
        ),
    ] = False,
    nnodes: int | None = NNODES_OPTION,
    node_rank: int | None = NODE_RANK_OPTION,
    rdzv_endpoint: str | None = RDZV_ENDPOINT_OPTION,
    rdzv_id: str | None = RDZV_ID_OPTION,
    rdzv_timeout: float | None = RDZV_TIMEOUT_OPTION,
    inject_node: int | None = INJECT_NODE_OPTION,
    nvml_timeout: float = NVML_TIMEOUT_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Check GPU sets for real: each GPU on its own, P2P copies, DataParallel and DDP against one GPU,
    all-reduce bandwidth."""
    node = node_options(nnodes, node_rank, rdzv_endpoint, rdzv_id, rdzv_timeout, inject, inject_node)
    options = options_from(  # the node's options first: their errors come first, as they always did
        probe.Options,
        locals(),
        gpus=probe.gpu_sets(gpus),
        timeout_s=timeout,
        precisions=tuple(precision or ()),
        tolerance_pct=tolerance,
        topology_input=input,
        min_bytes=probe.byte_size("--min-bytes", min_bytes),
        max_bytes=probe.byte_size("--max-bytes", max_bytes),
        nvml_timeout_s=nvml_timeout,
    )
    _run(options, json_out)


def _run(options: probe.Options, json_out: bool) -> None:
    """Run the probe; write its report files (through ``finish``), show it, exit with its code."""
    from gputopo.ui.html_report import render_probe_html
    from gputopo.ui.probe_view import render_markdown

    out = Output(json_mode=json_out)
    report = probe.run(options, _hooks(out, options.node, json_out))
    views = Views(markdown=render_markdown, html=render_probe_html)
    report = attach_files(out, "probe", report, views, report.report_dir)
    probe.refuse_untested(report)
    doc = report.document()
    warn_internode(out, doc)
    _show(out, doc, json_out)
    raise typer.Exit(report.exit_code)


def _hooks(out: Output, node: Any, json_out: bool) -> probe.Hooks:
    """The service's callbacks: warnings on stderr; progress bars (not with ``--json``); across nodes a
    line per rendezvous and inter-node test, and the rendezvous host refused when it does not resolve."""
    from functools import partial

    from gputopo.ui.probe_view import ProbeProgress

    return probe.Hooks(
        warn=out.warn,
        progress=None if json_out else partial(ProbeProgress, out.err),
        before_nodes=check_rendezvous,
        on_row=progress_printer(out, node, json_out) if node is not None else None,
    )


def _show(out: Output, doc: dict[str, Any], json_out: bool) -> None:
    """The document (``--json``) or its rich text on stdout."""
    if json_out:
        out.document(doc)
        return
    from gputopo.ui.probe_view import render_text

    out.show(render_text(doc))
