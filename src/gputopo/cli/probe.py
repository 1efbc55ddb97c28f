"""CLI: ``gputopo probe``: data-checked DP/DDP training, P2P copies and an all-reduce sweep on GPU sets.

torch is imported only by the probe's service, inside the command, so ``gputopo --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from gputopo.cli import app
from gputopo.cli.common import INPUT_HELP, INPUT_METAVAR, JSON_OPTION, NVML_TIMEOUT_OPTION, examples, guarded
from gputopo.cli.nodes import (
    INJECT_NODE_OPTION,
    NNODES_OPTION,
    NODE_RANK_OPTION,
    RDZV_ENDPOINT_OPTION,
    RDZV_ID_OPTION,
    RDZV_TIMEOUT_OPTION,
    check_rendezvous,
    node_options,
    progress_printer,
    warn_internode,
)
from gputopo.errors import EXIT_PROBLEM, Interrupted, UsageError
from gputopo.probe.plan.options import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_LR,
    DEFAULT_MODEL,
    DEFAULT_REPORT_DIR,
    DEFAULT_SEED,
    DEFAULT_STEP_FACTOR,
    DEFAULT_STEPS,
    DEFAULT_TIMEOUT_S,
    Fault,
    Mode,
    Precision,
)
from gputopo.ui.output import Output

NODES_PANEL = "Across nodes (torchrun's rendezvous; defaults from Slurm under srun)"


class Device(str, Enum):
    """Where the ranks run."""

    CUDA = "cuda"
    CPU = "cpu"


class ModelName(str, Enum):
    """torchvision ResNets; ``tiny`` is the smallest, for CPU runs; ``micro`` a small residual CNN in torch
    alone (no torchvision), the quick simulated doctor's."""

    RESNET18 = "resnet18"
    RESNET50 = "resnet50"
    TINY = "tiny"
    MICRO = "micro"


DEFAULT_MODEL_NAME = ModelName(DEFAULT_MODEL)


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
    model: Annotated[ModelName, typer.Option(help="The ResNet to train.")] = DEFAULT_MODEL_NAME,
    batch_size: Annotated[int, typer.Option(help="Images per GPU per step.")] = DEFAULT_BATCH_SIZE,
    steps: Annotated[int, typer.Option(help="Training steps of the dp and ddp checks.")] = DEFAULT_STEPS,
    lr: Annotated[float, typer.Option(help="SGD learning rate (momentum 0.9).")] = DEFAULT_LR,
    seed: Annotated[int, typer.Option(help="Seed of the weights and the synthetic data.")] = DEFAULT_SEED,
    timeout: Annotated[
        float, typer.Option(help="Seconds a set may go without progress before it is hung.")
    ] = DEFAULT_TIMEOUT_S,
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
    ] = Path(DEFAULT_REPORT_DIR),
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
    ] = DEFAULT_STEP_FACTOR,
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
    if node is not None:
        if each_pair or len(gpus or ()) > 1:
            raise UsageError(
                "across nodes each node probes one set of its GPUs",
                "give one --gpus list (the same on every node), or none for all; drop --each-pair",
            )
        if dry_run:
            raise UsageError(
                "--dry-run shows one machine's plan", "drop --nnodes to see this node's own plan"
            )
        if inject_gpus is not None or inject_rank is not None:
            raise UsageError(
                "across nodes --inject goes into every rank of --inject-node",
                "drop --inject-gpus and --inject-rank, and name the node with --inject-node",
            )
    from gputopo.probe.judge.verdict import nothing_tested
    from gputopo.probe.plan.config import build_config, check_sets_in_topology, parse_size
    from gputopo.probe.plan.schedule import make_plan
    from gputopo.probe.pool.devices import detect_devices, require_torch
    from gputopo.probe.pool.runner import run_probe
    from gputopo.probe.report.document import to_document, to_markdown
    from gputopo.report import ensure_report_dir, write_report

    out = Output(json_mode=json_out)
    from gputopo.launch.command import warn_nccl_env

    warn_nccl_env(out.warn)  # the ranks inherit these settings, and so do the measurements
    low = parse_size("--min-bytes", min_bytes) if min_bytes is not None else None
    high = parse_size("--max-bytes", max_bytes) if max_bytes is not None else None
    if not dry_run:
        require_torch()
    # --dry-run reads the GPUs from NVML only: torch and CUDA are never started.
    inventory = detect_devices(
        device.value if device else None, need_cuda=not dry_run, nvml_timeout_s=nvml_timeout
    )
    if inventory.device == "cuda" and input is None:
        gpus, inventory = keep_p2p_off_drained(inventory, gpus, nvml_timeout, out.warn)
    config = build_config(
        inventory,
        gpus,
        each_pair=each_pair,
        mode=mode,
        model=model.value,
        batch_size=batch_size,
        steps=steps,
        lr=lr,
        seed=seed,
        timeout_s=timeout,
        inject=inject,
        inject_rank=inject_rank,
        report_dir=report_dir,
        topology_input=input,
        min_bytes=low,
        max_bytes=high,
        step_factor=step_factor,
        iters=iters,
        inject_gpus=inject_gpus,
        precisions=[p.value for p in precision or ()],
        tolerance=None if tolerance is None else tolerance / 100,
        across_nodes=node is not None,
    )
    if input is not None:
        from gputopo.machine import load_topology

        topo = load_topology(input)
        check_sets_in_topology(config.sets, topo.gpu_indices, topo.source)
    if dry_run:
        from gputopo.probe.plan.dryrun import plan_document, plan_text

        doc = plan_document(config, make_plan(config))
        if json_out:
            out.document(doc)
        else:
            out.show(plan_text(doc))
        return
    ensure_report_dir(config.report_dir)
    if node is not None:
        run_across_nodes(config, node, out, json_out)
        return
    plan = make_plan(config)
    try:
        if json_out:
            run = run_probe(config, plan=plan, on_warning=out.warn)
        else:
            from gputopo.ui.probe_view import ProbeProgress

            with ProbeProgress(out.err, plan) as bars:
                run = run_probe(config, bars.update, plan=plan, on_warning=out.warn)
    except Interrupted as exc:
        if exc.partial is not None:  # what was judged before the signal, marked interrupted
            doc = {**to_document(exc.partial), "verdict": "interrupted", "interrupted": exc.name}
            paths = write_report("probe", doc, to_markdown(doc), config.report_dir)
            exc.note = f"the checks done so far are in {paths['json']}"
        raise
    out.warnings(run.warnings)
    doc = to_document(run)
    if doc.get("device") == "cuda" and wrong_data(doc):  # name an ACS-redirecting bridge on the pair's path
        doc["path_causes"] = path_causes(doc, live_redirected())
        for line in doc["path_causes"]:
            out.warn(line)
    why = nothing_tested(run.sets)
    if why is not None:
        doc["verdict"] = "skipped"
    paths = write_report("probe", doc, to_markdown(doc), config.report_dir, html=probe_html(doc, out))
    doc["report"] = paths
    if why is not None:
        # A run that tested nothing must not read as a PASS, to a person or to `gputopo probe && ...`.
        raise UsageError(
            f"nothing was tested: {why}",
            "choose checks that run here (e.g. --mode ddp on CPU stand-ins), or GPUs with a peer-to-peer "
            f"path; what was measured is in {paths['json']}",
        )
    if json_out:
        out.document(doc)
    else:
        from gputopo.ui.probe_view import render_probe

        out.show(render_probe(doc))
    if run.verdict == "fail":
        raise typer.Exit(EXIT_PROBLEM)


def keep_p2p_off_drained(
    inventory: Any, gpus: list[str] | None, nvml_timeout_s: float | None, warn: Callable[[str], None]
) -> tuple[list[str] | None, Any]:
    """The GPUs whose driver asks to drain P2P (NVML recovery action DRAIN_P2P, one health sample) are left
    out of the set the probe picks itself when it holds two or more GPUs, each said with the reason (and
    in the dry run's ``left_out``); a set the user names (``--gpus``) is kept, with a warning."""
    from dataclasses import replace

    from gputopo.machine import read_live_health
    from gputopo.probe.plan.config import parse_gpu_list

    drained = read_live_health(nvml_timeout_s, gpus=list(inventory.gpus)).p2p_drained_gpus()
    rest = [g for g in inventory.gpus if g not in drained]
    if gpus is not None or not rest:  # the user's sets (or nothing else to probe): kept, warned about
        sets = [parse_gpu_list(text) for text in gpus] if gpus is not None else [inventory.gpus]
        named = {g for s in sets if len(s) > 1 for g in s}
        for g in sorted(set(drained) & named):
            warn(f"GPU{g}: the driver asks to keep P2P work off it ({drained[g]}); probed in a set as asked")
        return gpus, inventory
    if len(inventory.gpus) < 2 or not drained:
        return gpus, inventory
    why = {g: f"the driver asks to keep P2P work off it, so no multi-GPU set: {drained[g]}" for g in drained}
    for g in sorted(why):
        warn(f"GPU{g} left out: {why[g]}")
    return [",".join(map(str, rest))], replace(inventory, why_not={**inventory.why_not, **why})


def run_across_nodes(config: Any, node: Any, out: Output, json_out: bool) -> None:
    """This node's part of a multi-node probe; node rank 0 writes the report; every node exits with the
    run's verdict."""
    from gputopo.probe.pool.multinode import run_nodes
    from gputopo.probe.report.document import to_markdown
    from gputopo.probe.report.nodes import nodes_markdown
    from gputopo.report import write_report

    check_rendezvous(node)
    on_row = progress_printer(out, node, json_out)
    doc = run_nodes(config, node, on_row=on_row)
    if node.node_rank == 0:
        markdown = to_markdown(doc).rstrip("\n") + "\n" + "\n".join(nodes_markdown(doc)) + "\n"
        doc["report"] = write_report("probe", doc, markdown, config.report_dir, html=probe_html(doc, out))
    warn_internode(out, doc)
    if json_out:
        out.document(doc)
    else:
        from gputopo.ui.probe_view import render_nodes

        out.show(render_nodes(doc))
    if doc["verdict"] == "fail":
        raise typer.Exit(EXIT_PROBLEM)


def probe_html(doc: dict[str, Any], out: Output) -> str | None:
    """The HTML report, or ``None`` with a warning when matplotlib is missing (the rest is still written)."""
    from gputopo.ui.html_report import render_probe_html

    try:
        return render_probe_html(doc)
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        out.warn("no HTML report: matplotlib is not installed (pip install 'gputopo[probe]')")
        return None


_WRONG_DATA = ("corrupt", "nan", "diverged")


def wrong_data(doc: dict[str, Any]) -> bool:
    """Whether a check of the probe found wrong data (corrupt, NaN, diverged) on a set."""
    return any(
        c.get("verdict") == "fail" and c.get("kind") in _WRONG_DATA
        for s in doc.get("sets") or []
        for c in s.get("checks") or []
    )


def live_redirected() -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """This machine's GPU pairs behind an ACS-redirecting bridge (sysfs; docs/topo.md)."""
    from gputopo.doctor import redirected_pairs
    from gputopo.machine import load_topology

    return redirected_pairs(load_topology(None))


def path_causes(doc: dict[str, Any], redirected: tuple[tuple[int, int, tuple[str, ...]], ...]) -> list[str]:
    """One line per failed wrong-data check on a set with a pair behind an ACS-redirecting bridge: the
    bridge is the likely cause."""
    from gputopo.doctor import probe_findings

    return [
        f"{f.where}: {f.what}" for f in probe_findings(doc, redirected) if "the likely cause: ACS" in f.what
    ]
