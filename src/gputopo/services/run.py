"""``gputopo run``'s service: choose the best free set (as ``recommend`` does: ``services.recommend.choose``,
through the one machine step) and run the command on it, passing its exit code through.

Two calls, so the caller can show the plan between them: ``plan`` checks the command, chooses the set and
builds the launch line (a ``RunReport``: with ``--dry-run --json`` its ``document()`` is the whole
``gputopo/launch/v1`` JSON); ``launch`` arms the run (the run folder and this node's run record, PyTorch's
Flight Recorder, NCCL's diagnostics and Inspector) and runs the line supervised (stop signals forwarded,
the ranks' stacks taken before a stopped job ends), returning the command's exit code.

Nothing here imports typer, rich or the views: lines for stderr go to ``Hooks``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputopo.errors import UnavailableError, UsageError
from gputopo.services.hooks import Warn, ignore
from gputopo.services.recommend import Choice

if TYPE_CHECKING:
    from gputopo.findings import Finding
    from gputopo.launch.control_plane import Wrapped
    from gputopo.launch.line import LaunchPlan
    from gputopo.launch.record import RecorderEnv
    from gputopo.model import LaunchTools, Topology
    from gputopo.recommend import Recommendation
    from gputopo.system.launcher import RankProcess


@dataclass(frozen=True)
class Hooks(Warn):
    """What the service tells its caller while it runs: ``warn`` (a warning line), ``hint`` (a hint
    line) and ``say`` (one plain ``gputopo run: ...`` line), all for stderr: stdout is the command's."""

    hint: Callable[[str], None] = ignore
    say: Callable[[str], None] = ignore


@dataclass(frozen=True, kw_only=True)
class Options:
    """What ``gputopo run`` was asked, keyword only, validated when built (``UsageError``, exit 2)."""

    n: int  # GPUs to give the command
    command: tuple[str, ...] = ()  # CMD ..., as given after --
    choice: Choice = field(default_factory=Choice)  # how the set is chosen (as recommend chooses)
    ignore_visible: bool = False  # choose among every GPU, not only a preset CUDA_VISIBLE_DEVICES's
    torchrun: bool = False  # run CMD under torchrun --nproc-per-node n
    dry_run: bool = False  # print the line instead of running it
    json_out: bool = False  # with dry_run: the launch as one JSON document
    # What the run is armed with: PyTorch's Flight Recorder, NCCL's diagnostics, NCCL's Inspector
    flight_recorder: bool = True
    nccl_diagnostics: bool = False
    inspector: bool = False
    inspector_plugin: Path | None = None  # the Inspector plugin to load (implies inspector)
    control_plane: bool = True  # a Python script runs inside torch's control plane (worker_main)
    run_dir: Path | None = None  # the run folder (None: reports/run-<UTC time>)

    def __post_init__(self) -> None:
        if self.json_out and not self.dry_run:
            raise UsageError(
                "--json goes with --dry-run", "the command's own output goes to stdout when it runs"
            )
        if not self.command:
            raise UsageError("no command given", "put it after --, e.g. gputopo run --n 2 -- python train.py")
        if self.inspector_plugin is not None and not self.inspector_plugin.is_file():
            raise UsageError(
                f"--inspector-plugin {self.inspector_plugin}: no such file",
                "build it with `make` in NCCL's plugins/profiler/inspector, or drop --inspector-plugin",
            )

    @property
    def armed_inspector(self) -> bool:
        """``--inspector``, or ``--inspector-plugin`` (which implies it)."""
        return self.inspector or self.inspector_plugin is not None


@dataclass(frozen=True)
class RunReport:
    """The set chosen and the line that runs the command on it; ``document()`` is ``--dry-run --json``'s
    whole ``gputopo/launch/v1`` JSON."""

    topology: Topology
    recommendation: Recommendation
    plan: LaunchPlan
    findings: tuple[Finding, ...]
    health: dict[str, Any]
    served: Wrapped | None = None
    exit_code: int = 0

    def with_files(self, paths: dict[str, str]) -> RunReport:
        return self  # run writes a run record, not report files

    def document(self) -> dict[str, Any]:
        """The launch document (docs/run.md), built here and nowhere else."""
        from gputopo.launch.line import SCHEMA

        rec = self.recommendation
        return {
            "schema": SCHEMA,
            "source": self.topology.source,
            "launch": self.plan.to_dict(),
            "findings": [asdict(f) for f in self.findings],
            "excluded": [{"gpu": e.gpu, "why": e.why} for e in rec.excluded],
            "health": self.health,
            "warnings": list(rec.warnings),
        }


def plan(options: Options, hooks: Hooks | None = None) -> RunReport:
    """The command checked (unless ``--dry-run``), the set chosen, the tools found, the line built."""
    from gputopo.launch.command import served_command, warn_nccl_env
    from gputopo.launch.line import build_launch
    from gputopo.recommend import Constraints
    from gputopo.services import recommend as choosing

    hooks = hooks or Hooks()
    command = list(options.command)
    if not options.dry_run:
        from gputopo.launch.command import check_command

        check_command(command, options.torchrun)
    chosen = choosing.choose(
        options.choice,
        Constraints(n=options.n, top=1),
        choosing.Hooks(warn=hooks.warn),
        ignore_visible=options.ignore_visible,
        pcie_paths=False,  # as before the machine step: run does not read the PCIe paths (recommend does)
    )
    rec, topo = chosen.recommendation, chosen.machine.topology
    _say_left_out(options, rec, hooks)
    tools = _tools(options)
    findings = warn_nccl_env(hooks.warn, [nic.name or nic.label for nic in topo.nics])
    served = None
    if options.control_plane and not options.dry_run:
        served = served_command(command, options.torchrun)
        command = list(served.command)
    line = build_launch(
        topo, rec.best.gpus, command, torchrun=options.torchrun, tools=tools, prefer_uuid=True
    )
    health = chosen.health_section(options.choice.allow_unhealthy)
    return RunReport(topo, rec, line, tuple(findings), health, served)


def _say_left_out(options: Options, rec: Recommendation, hooks: Hooks) -> None:
    """The set's warnings (the topology's too), once each; in text, every GPU left out for its health."""
    for line in dict.fromkeys(rec.warnings):
        hooks.warn(line)
    if options.json_out:
        return
    for e in rec.excluded:
        if "health: " in e.why:
            hooks.warn(f"left out GPU{e.gpu}: {e.why} (--allow-unhealthy counts it in)")


def _tools(options: Options) -> LaunchTools:
    """What the machine offers the launch (torchrun, its --numa-binding, numactl), with ``--torchrun``."""
    from gputopo.model import LaunchTools

    if not options.torchrun:
        return LaunchTools(torchrun=None)
    from gputopo.system.launcher import detect_tools

    tools = detect_tools()
    if tools.torchrun is None and not options.dry_run:
        raise UnavailableError(
            "--torchrun: torch is not installed here", "pip install torch, or drop --torchrun"
        )
    return tools


def launch(report: RunReport, options: Options, hooks: Hooks | None = None) -> int:
    """Arm the run and run the line supervised; the command's exit code."""
    from gputopo.launch.line import merged_env
    from gputopo.system.launcher import run_supervised

    hooks = hooks or Hooks()
    line = report.plan
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None and inherited != line.env["CUDA_VISIBLE_DEVICES"]:
        # Chosen inside it (the machine step's preset), unless --ignore-visible-devices or --input.
        hooks.hint(f"CUDA_VISIBLE_DEVICES={inherited} was set; the command gets the chosen set's UUIDs")
    if options.choice.input is not None:
        hooks.warn(f"the set was chosen from {report.topology.source}, not read from this machine")
    hooks.say(f"GPUs {','.join(str(g) for g in line.gpus)}: {line.command}")
    env = merged_env(os.environ, line)
    armed = _arm(hooks, report.topology, line, env, options)
    if options.armed_inspector:
        plugin = str(options.inspector_plugin) if options.inspector_plugin else None
        _arm_inspector(hooks, armed, env, plugin)
    env = {**env, **armed.env, "GPUTOPO_RUN_DIR": str(armed.folder.resolve())}
    if report.served is not None:
        hooks.say(_served_line(report.served))
    return run_supervised(line.argv, env, on_ranks=armed.record_ranks, on_stop=armed.take_evidence)


def _served_line(served: Wrapped) -> str:
    if served.armed:
        return (
            "torch's control plane armed (each rank serves its Flight Recorder for `gputopo slow --live` "
            "and `gputopo hang --live`)"
        )
    return (
        f"torch's control plane not armed ({served.why_not}): --live reads the ranks' stacks only; "
        "run a Python script (python train.py, or train.py with --torchrun) or wrap main in "
        "worker_main() (docs/hang.md)"
    )


def _write_record(path: Path, record: dict[str, Any]) -> None:
    from gputopo.report import atomic_write

    atomic_write(path, json.dumps(record, indent=2) + "\n")


class _Armed:
    """The run folder and this node's run record, kept up to date with the ranks' PIDs, and the
    evidence taken when the run is stopped."""

    def __init__(self, hooks: Hooks, folder: Path, path: Path, record: dict, env: dict[str, str]) -> None:
        self.hooks, self.folder, self.path, self.record, self.env = hooks, folder, path, record, env

    def with_inspector(self, inspector: dict[str, Any], env: dict[str, str]) -> None:
        """NCCL's Inspector as armed (or not), said in the run record; ``env``: what it adds."""
        self.env = {**self.env, **env}
        self.record = {**self.record, "inspector": inspector}
        _write_record(self.path, self.record)

    def record_ranks(self, ranks: list[RankProcess]) -> None:
        from gputopo.launch.record import with_ranks

        found = [
            {"rank": r.rank, "local_rank": r.local_rank, "pid": r.pid, "started": round(r.started, 3)}
            for r in ranks
        ]
        self.record = with_ranks(self.record, found)
        _write_record(self.path, self.record)

    def take_evidence(self, signum: int, ranks: list[RankProcess]) -> None:
        """Stopped (scancel, Ctrl-C, kill): the ranks' stacks (and live dumps) into the run folder before
        the job is stopped, so `gputopo hang RUN_DIR` can name the stuck rank afterwards."""
        import signal as _signal

        from gputopo.hang.live import Target, summary, take
        from gputopo.system import run_facts

        gpus = {g.get("local_rank"): g.get("index") for g in self.record.get("gpus") or []}
        targets = [Target(r.rank, r.pid, r.local_rank, gpus.get(r.local_rank), r.started) for r in ranks]
        if not targets:
            return
        name = _signal.Signals(signum).name
        self.hooks.say(f"{name}: taking the ranks' stacks before stopping the job")
        ev = take(self.folder, targets, run_facts.hostname(), f"stopped by {name}")
        self.hooks.say(f"{summary(ev)}; after it stops: gputopo hang {self.folder}")
        if ev.hint:
            self.hooks.hint(ev.hint)


def _arm_inspector(hooks: Hooks, armed: _Armed, env: dict[str, str], named: str | None) -> None:
    """NCCL's Inspector for the job, said in the run record; without a plugin, how to get one."""
    from gputopo.launch.record import INSPECTOR_DIR_NAME, inspector_env
    from gputopo.system import run_facts

    plugin = named or run_facts.inspector_plugin(env)
    folder = armed.folder.resolve() / INSPECTOR_DIR_NAME
    extra, kept = inspector_env(env, plugin, str(folder))
    if not extra and not kept:
        hooks.warn(
            f"--inspector: NCCL's Inspector plugin ({run_facts.INSPECTOR_PLUGIN}) was not found; the job "
            "runs without it (build it with `make` in NCCL's plugins/profiler/inspector and give "
            "--inspector-plugin PATH, or put it on LD_LIBRARY_PATH)"
        )
        armed.with_inspector({"armed": False, "plugin": None, "dump_dir": None}, {})
        return
    folder.mkdir(parents=True, exist_ok=True)
    final = {**env, **extra}
    plugin_so, dump_dir = final.get("NCCL_PROFILER_PLUGIN"), final.get("NCCL_INSPECTOR_DUMP_DIR")
    armed.with_inspector({"armed": True, "plugin": plugin_so, "dump_dir": dump_dir, "kept": kept}, extra)
    hooks.say(f"NCCL Inspector armed ({plugin_so}), logs in {dump_dir}")


def _arm(hooks: Hooks, topo: Topology, line: LaunchPlan, env: dict[str, str], options: Options) -> _Armed:
    """The run folder with this node's run record in it, and the variables that arm the Flight Recorder
    (and NCCL's diagnostics); the ``_Armed`` run knows what to add to the child's environment."""
    from gputopo.launch.record import DUMP_PREFIX_NAME, diagnostics_unsupported, recorder_env
    from gputopo.report import ensure_report_dir

    now = datetime.now(timezone.utc)
    folder = options.run_dir or _new_run_dir(Path("reports"), now)
    ensure_report_dir(folder)
    prefix = str(folder.resolve() / DUMP_PREFIX_NAME)
    recorder = recorder_env(env, prefix, options.flight_recorder, options.nccl_diagnostics)
    record, host, facts = _record(topo, line, {**env, **recorder.env}, recorder, options, now)
    node = f"-node{record['node_rank']}" if record["node_rank"] is not None else ""
    path = folder / f"run-record-{host}{node}.json"
    try:
        _write_record(path, record)
    except OSError as exc:
        raise UsageError(
            f"cannot write the run record {path}: {exc.strerror or exc}", "give a writable --run-dir"
        ) from None
    kept = recorder.kept_line()
    if kept:
        hooks.say(kept)
    if options.nccl_diagnostics:
        why = diagnostics_unsupported(facts.get("nccl"))
        if why:
            hooks.warn(why)
    armed = f"Flight Recorder dumps to {recorder.dump_prefix}<rank>; " if options.flight_recorder else ""
    hooks.say(f"{armed}run record {path} (after a hang: gputopo hang {folder})")
    return _Armed(hooks, folder, path, record, recorder.env)


def _record(
    topo: Topology,
    line: LaunchPlan,
    full: dict[str, str],
    recorder: RecorderEnv,
    options: Options,
    now: datetime,
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """This node's run record (``launch.record.run_record``), the host's name, and the facts read."""
    from gputopo.launch.line import is_torchrun
    from gputopo.launch.record import TorchrunLayout, run_record, torchrun_layout
    from gputopo.system import run_facts

    argv = list(line.argv)
    layout = torchrun_layout(argv) if is_torchrun(argv) else TorchrunLayout()
    chosen = [topo.gpu(g) for g in line.gpus]
    facts = run_facts.config_facts(topo, line.gpus, full)
    host = run_facts.hostname()
    record = run_record(
        host=host,
        layout=layout,
        gpus=[{"index": g.index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id} for g in chosen],
        versions={k: facts.get(k) for k in ("nccl", "torch", "driver", "cuda")},
        env=run_facts.nccl_env(full),
        recorder=recorder if options.flight_recorder else None,
        facts=facts,
        created=now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        command=argv,
    )
    return record, host, facts


def _new_run_dir(base: Path, now: datetime) -> Path:
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    n = 1
    while True:
        folder = base / (f"run-{stamp}" if n == 1 else f"run-{stamp}-{n}")
        if not folder.exists():
            return folder
        n += 1
