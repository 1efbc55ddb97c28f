"""CLI: ``gputopo run --n K [--torchrun] -- CMD ...``: choose the best free set and run CMD on it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import typer

from gputopo.cli import app
from gputopo.cli.common import INPUT_OPTION, examples, guarded
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
from gputopo.errors import UnavailableError, UsageError
from gputopo.launch.line import LaunchPlan, LaunchTools
from gputopo.model import Topology
from gputopo.ui.output import Output


@app.command(
    "run",
    context_settings={"allow_extra_args": False, "ignore_unknown_options": False},
    epilog=examples(
        "gputopo run --n 2 -- python train.py",
        "gputopo run --n 4 --torchrun -- train.py --epochs 10",
        "gputopo run --n 2 --exclude 0,1 --dry-run -- python train.py",
        "gputopo run --n 8 --torchrun --run-dir /shared/run-42 -- train.py   # dumps + run record there",
        "gputopo run --n 8 --torchrun --nccl-diagnostics -- train.py 2>&1 | tee job.log",
    ),
)
@guarded
def run_command(
    command: list[str] = typer.Argument(None, metavar="-- CMD ...", help="The command to run, after --."),
    n: int = typer.Option(..., "--n", "-n", help="GPUs to give the command."),
    torchrun: bool = typer.Option(
        False,
        "--torchrun",
        help="Run CMD under torchrun --nproc-per-node K (with --numa-binding node where possible).",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the line instead of running it."),
    input: str | None = INPUT_OPTION,
    exclude: str | None = EXCLUDE_OPTION,
    allow_busy: bool = ALLOW_BUSY_OPTION,
    allow_unhealthy: bool = ALLOW_UNHEALTHY_OPTION,
    max_used_mib: int = MAX_USED_OPTION,
    from_report: Path | None = REPORT_OPTION,
    force_report: bool = FORCE_REPORT_OPTION,
    ignore_visible: bool = IGNORE_VISIBLE_OPTION,
    json_out: bool = typer.Option(
        False, "--json", help="With --dry-run: print the launch as one JSON document."
    ),
    flight_recorder: bool = typer.Option(
        True,
        "--flight-recorder/--no-flight-recorder",
        help="Arm PyTorch's Flight Recorder (TORCH_FR_BUFFER_SIZE=2000, TORCH_NCCL_DUMP_ON_TIMEOUT=1, dumps "
        "in the run folder) so `gputopo hang RUN_FOLDER` can name a hung rank. Values you set are kept.",
    ),
    nccl_diagnostics: bool = typer.Option(
        False,
        "--nccl-diagnostics",
        help="Set NCCL_RUN_DIAGNOSTICS=1 (NCCL >= 2.31): NCCL checks GPU peer paths at each communicator "
        "init and prints `NCCL DIAG` lines on rank 0's stdout (read them with gputopo hang --nccl-log).",
    ),
    inspector: bool = typer.Option(
        False,
        "--inspector",
        help="Arm NCCL's Inspector profiler plugin (NCCL >= 2.28): one JSON line per collective per rank "
        "in RUN_FOLDER/inspector/, kernel-timed, for `gputopo slow RUN_FOLDER`. Without the plugin the "
        "job runs anyway and gputopo says how to get it.",
    ),
    inspector_plugin: Path | None = typer.Option(
        None,
        "--inspector-plugin",
        metavar="SO",
        help="The Inspector plugin to load (libnccl-profiler-inspector.so); implies --inspector. "
        "Default: found on LD_LIBRARY_PATH, the library folders or beside NCCL.",
    ),
    control_plane: bool = typer.Option(
        True,
        "--control-plane/--no-control-plane",
        help="Run a Python script inside torch's control plane (worker_main(), one socket per rank), "
        "unchanged, so `gputopo slow --live` and `gputopo hang --live` read each rank's Flight Recorder "
        "while the job runs.",
    ),
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        metavar="DIR",
        help="The run folder for the dumps and the run record (default reports/run-<UTC time>); give "
        "every node of a job the same shared folder to analyse them together.",
    ),
) -> None:
    """Choose the best free GPU set (as recommend does) and run CMD on it, passing its exit code through."""
    from gputopo.launch.line import SCHEMA, build_launch
    from gputopo.machine import load_topology
    from gputopo.recommend import recommend

    out = Output(json_mode=json_out)
    if json_out and not dry_run:
        raise UsageError("--json goes with --dry-run", "the command's own output goes to stdout when it runs")
    if not command:
        raise UsageError("no command given", "put it after --, e.g. gputopo run --n 2 -- python train.py")
    if inspector_plugin is not None and not inspector_plugin.is_file():
        raise UsageError(
            f"--inspector-plugin {inspector_plugin}: no such file",
            "build it with `make` in NCCL's plugins/profiler/inspector, or drop --inspector-plugin",
        )
    if not dry_run:
        from gputopo.launch.command import check_command

        check_command(command, torchrun)
    constraints = set_constraints(
        n=n,
        exclude=exclude,
        allow_busy=allow_busy,
        max_used_mib=max_used_mib,
        from_report=from_report,
        allow_unhealthy=allow_unhealthy,
        top=1,
    )
    topo = load_topology(input)
    check_report_machine(constraints, topo, input is None, force_report, out.warn)
    constraints = within_preset(constraints, topo, ignore_visible, input is not None, out.warn)
    constraints, health = with_health(constraints, input)  # live: one health sample
    rec = recommend(topo, constraints)
    out.warnings(rec.warnings)  # the topology's warnings too
    if not json_out:
        for e in rec.excluded:
            if "health: " in e.why:
                out.warn(f"left out GPU{e.gpu}: {e.why} (--allow-unhealthy counts it in)")
    tools = LaunchTools(torchrun=None)
    if torchrun:
        from gputopo.system.launcher import detect_tools

        tools = detect_tools()
        if tools.torchrun is None and not dry_run:
            raise UnavailableError(
                "--torchrun: torch is not installed here", "pip install torch, or drop --torchrun"
            )
    from gputopo.launch.command import warn_nccl_env

    findings = warn_nccl_env(out.warn, [nic.name or nic.label for nic in topo.nics])
    served = None
    if control_plane and not dry_run:
        from gputopo.launch.command import served_command

        served = served_command(command, torchrun)
        command = list(served.command)
    plan = build_launch(topo, rec.best.gpus, command, torchrun=torchrun, tools=tools, prefer_uuid=True)
    if dry_run:
        if json_out:
            doc = {"schema": SCHEMA, "source": topo.source, "launch": plan.to_dict()}
            doc["findings"] = [asdict(f) for f in findings]
            doc["excluded"] = [{"gpu": e.gpu, "why": e.why} for e in rec.excluded]
            doc["health"] = health
            doc["warnings"] = list(rec.warnings)
            out.document(doc)
            return
        for note in plan.notes:
            out.hint(note)
        out.line(plan.command)
        return
    for note in plan.notes:
        out.hint(note)
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None and inherited != plan.env["CUDA_VISIBLE_DEVICES"]:
        # The set was chosen inside it (within_preset), unless --ignore-visible-devices or --input.
        out.hint(f"CUDA_VISIBLE_DEVICES={inherited} was set; the command gets the chosen set's UUIDs")
    if input is not None:
        out.warn(f"the set was chosen from {topo.source}, not read from this machine")
    gpus = ",".join(str(g) for g in plan.gpus)
    out.err.print(f"gputopo run: GPUs {gpus}: {plan.command}", markup=False, highlight=False, soft_wrap=True)
    from gputopo.launch.line import merged_env
    from gputopo.system.launcher import run_supervised

    env = merged_env(os.environ, plan)
    armed = _arm(out, topo, plan, env, flight_recorder, nccl_diagnostics, run_dir)
    if inspector or inspector_plugin is not None:
        _arm_inspector(out, armed, env, str(inspector_plugin) if inspector_plugin else None)
    env.update(armed.env)
    env["GPUTOPO_RUN_DIR"] = str(armed.folder.resolve())
    if served is not None:
        line = (
            "torch's control plane armed (each rank serves its Flight Recorder for `gputopo slow --live` "
            "and `gputopo hang --live`)"
            if served.armed
            else f"torch's control plane not armed ({served.why_not}): --live reads the ranks' stacks only; "
            "run a Python script (python train.py, or train.py with --torchrun) or wrap main in "
            "worker_main() (docs/hang.md)"
        )
        out.err.print(f"gputopo run: {line}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(run_supervised(plan.argv, env, on_ranks=armed.record_ranks, on_stop=armed.take_evidence))


def _arm_inspector(out: Output, armed: _Armed, env: dict[str, str], named: str | None) -> None:
    """NCCL's Inspector for the job, said in the run record; without a plugin, how to get one."""
    from gputopo.launch.record import INSPECTOR_DIR_NAME, inspector_env
    from gputopo.report import atomic_write
    from gputopo.system import run_facts

    plugin = named or run_facts.inspector_plugin(env)
    folder = armed.folder.resolve() / INSPECTOR_DIR_NAME
    extra, kept = inspector_env(env, plugin, str(folder))
    if not extra and not kept:
        out.warn(
            f"--inspector: NCCL's Inspector plugin ({run_facts.INSPECTOR_PLUGIN}) was not found; the job "
            "runs without it (build it with `make` in NCCL's plugins/profiler/inspector and give "
            "--inspector-plugin PATH, or put it on LD_LIBRARY_PATH)"
        )
        armed.record["inspector"] = {"armed": False, "plugin": None, "dump_dir": None}
    else:
        folder.mkdir(parents=True, exist_ok=True)
        armed.env.update(extra)
        final = {**env, **extra}
        armed.record["inspector"] = {
            "armed": True,
            "plugin": final.get("NCCL_PROFILER_PLUGIN"),
            "dump_dir": final.get("NCCL_INSPECTOR_DUMP_DIR"),
            "kept": kept,
        }
        out.err.print(
            f"gputopo run: NCCL Inspector armed ({final.get('NCCL_PROFILER_PLUGIN')}), logs in "
            f"{final.get('NCCL_INSPECTOR_DUMP_DIR')}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    atomic_write(armed.path, json.dumps(armed.record, indent=2) + "\n")


class _Armed:
    """The run folder and this node's run record, kept up to date with the ranks' PIDs, and the
    evidence taken when the run is stopped."""

    def __init__(self, out: Output, folder: Path, path: Path, record: dict, env: dict[str, str]) -> None:
        self.out, self.folder, self.path, self.record, self.env = out, folder, path, record, env

    def record_ranks(self, ranks: list) -> None:
        from gputopo.launch.record import with_ranks
        from gputopo.report import atomic_write

        found = [
            {"rank": r.rank, "local_rank": r.local_rank, "pid": r.pid, "started": round(r.started, 3)}
            for r in ranks
        ]
        self.record = with_ranks(self.record, found)
        atomic_write(self.path, json.dumps(self.record, indent=2) + "\n")

    def take_evidence(self, signum: int, ranks: list) -> None:
        """Stopped (scancel, Ctrl-C, kill): the ranks' stacks (and live dumps) into the run folder before
        the job is stopped, so `gputopo hang RUN_DIR` can name the stuck rank afterwards."""
        import signal as _signal

        from gputopo.hang.live import Target, take
        from gputopo.system import run_facts

        gpus = {g.get("local_rank"): g.get("index") for g in self.record.get("gpus") or []}
        targets = [Target(r.rank, r.pid, r.local_rank, gpus.get(r.local_rank), r.started) for r in ranks]
        if not targets:
            return
        name = _signal.Signals(signum).name
        self.out.err.print(
            f"gputopo run: {name}: taking the ranks' stacks before stopping the job",
            markup=False,
            highlight=False,
        )
        ev = take(self.folder, targets, run_facts.hostname(), f"stopped by {name}")
        from gputopo.hang.live import summary

        line = f"gputopo run: {summary(ev)}; after it stops: gputopo hang {self.folder}"
        self.out.err.print(line, markup=False, highlight=False, soft_wrap=True)
        if ev.hint:
            self.out.hint(ev.hint)


def _arm(
    out: Output,
    topo: Topology,
    plan: LaunchPlan,
    env: dict[str, str],
    flight_recorder: bool,
    diagnostics: bool,
    run_dir: Path | None,
) -> _Armed:
    """The run folder with this node's run record in it, and the variables that arm the Flight Recorder
    (and NCCL's diagnostics); returns what to add to the child's environment."""
    from gputopo.launch.line import is_torchrun
    from gputopo.launch.record import (
        DUMP_PREFIX_NAME,
        TorchrunLayout,
        diagnostics_unsupported,
        recorder_env,
        run_record,
        torchrun_layout,
    )
    from gputopo.report import atomic_write, ensure_report_dir
    from gputopo.system import run_facts

    now = datetime.now(timezone.utc)
    folder = run_dir or _new_run_dir(Path("reports"), now)
    ensure_report_dir(folder)
    prefix = str(folder.resolve() / DUMP_PREFIX_NAME)
    recorder = recorder_env(env, prefix, flight_recorder, diagnostics)
    full = {**env, **recorder.env}
    argv = list(plan.argv)
    layout = torchrun_layout(argv) if is_torchrun(argv) else TorchrunLayout()
    chosen = [topo.gpu(g) for g in plan.gpus]
    facts = run_facts.config_facts(topo, plan.gpus, full)
    host = run_facts.hostname()
    record = run_record(
        host=host,
        layout=layout,
        gpus=[{"index": g.index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id} for g in chosen],
        versions={k: facts.get(k) for k in ("nccl", "torch", "driver", "cuda")},
        env=run_facts.nccl_env(full),
        recorder=recorder if flight_recorder else None,
        facts=facts,
        created=now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        command=argv,
    )
    node = f"-node{record['node_rank']}" if record["node_rank"] is not None else ""
    path = folder / f"run-record-{host}{node}.json"
    try:
        atomic_write(path, json.dumps(record, indent=2) + "\n")
    except OSError as exc:
        from gputopo.errors import UsageError

        raise UsageError(
            f"cannot write the run record {path}: {exc.strerror or exc}", "give a writable --run-dir"
        ) from None
    kept = recorder.kept_line()
    if kept:
        out.err.print(f"gputopo run: {kept}", markup=False, highlight=False, soft_wrap=True)
    if diagnostics:
        why = diagnostics_unsupported(facts.get("nccl"))
        if why:
            out.warn(why)
    armed = f"Flight Recorder dumps to {recorder.dump_prefix}<rank>; " if flight_recorder else ""
    out.err.print(
        f"gputopo run: {armed}run record {path} (after a hang: gputopo hang {folder})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return _Armed(out, folder, path, record, recorder.env)


def _new_run_dir(base: Path, now: datetime) -> Path:
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    n = 1
    while True:
        folder = base / (f"run-{stamp}" if n == 1 else f"run-{stamp}-{n}")
        if not folder.exists():
            return folder
        n += 1
