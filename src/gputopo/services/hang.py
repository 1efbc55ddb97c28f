"""``gputopo hang``'s service: dumps, run records, RAS and (optionally) torch's analyzer in, a
``HangReport`` out (``hang.triage``: its ``document()`` is the whole ``gputopo/hang/v1`` JSON).

Reads the files it is pointed at; reaches the machine only through ``system.nccl_ras`` (``--ras``),
``machine.read_live_health`` (a suspect that ran here gets its GPU's health) and, with ``--live``, through
``hang.live`` (``system/pyspy``, torch's control plane): the running job's stacks and dumps are taken into
its run folder first (``take_live``, shared with ``gputopo slow --live``). The CLI builds ``Options``
(validated once, here), calls ``run`` and renders the report; ``Hooks`` carries the callbacks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from gputopo.errors import InputError, UnavailableError, UsageError
from gputopo.hang import record as rec
from gputopo.hang.load import Loaded, NothingToAnalyse, find_dump_files, load_dumps, paused_gc
from gputopo.hang.match import match_dumps
from gputopo.hang.ras import RasReport, parse_ras_json, ras_address, read_ras_file
from gputopo.hang.stacks import RankStack, read_stacks
from gputopo.hang.triage import HangReport, Health, triage

HealthReader = Callable[[set[str]], Health]
LIVE_EXAMPLE = "reports/run-20260101T120000Z"


def _ignore(_: str) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """What the service tells its caller while it runs: ``warn`` and ``hint``, each a line for stderr
    (``--live``: what was taken, and what could not be)."""

    warn: Callable[[str], None] = _ignore
    hint: Callable[[str], None] = _ignore


@dataclass(frozen=True, kw_only=True)
class Options:
    """What ``gputopo hang`` was asked, keyword only, validated when built (``UsageError``, exit 2)."""

    paths: tuple[Path, ...] = ()  # folders or file prefixes of dumps (with ``live``: the run folder)
    run_records: tuple[Path, ...] = ()
    ras: bool = False  # ask this node's NCCL RAS port
    ras_json: Path | None = None  # a saved ``ncclras -f json``
    nccl_log: Path | None = None  # a job's output with ``NCCL DIAG`` lines
    torch_check: bool = False  # torch's own analyzer as a second opinion
    live: bool = False  # take the running job's stacks (and dumps) into its run folder first
    html: Path | None = None  # the HTML report's file (written by the caller; refused here at once)

    def __post_init__(self) -> None:
        check_live(self.live, self.paths, "hang")
        if (
            not self.live
            and not self.paths
            and self.ras_json is None
            and not self.ras
            and self.nccl_log is None
        ):
            raise UsageError(
                "nothing to analyse: no dump folder, --ras, --ras-json or --nccl-log",
                "e.g. gputopo hang reports/run-*/fr",
            )


def run(options: Options, hooks: Hooks | None = None) -> HangReport:
    """Everything ``gputopo hang`` reports (``--live``: after taking the running job's evidence)."""
    hooks = hooks or Hooks()
    if options.html is not None:
        from gputopo.outputs import check_output

        check_output(options.html, "--html", "hang.html")  # before any work: a fifo or a folder is refused
    paths = list(options.paths)
    if options.live:
        paths = [take_live(paths, "hang", hooks)]
    with paused_gc(freeze=True):  # one process, one report: the dumps' dicts need no collecting
        return analyse(
            paths,
            run_records=options.run_records,
            ras_json=options.ras_json,
            health=local_health,
            ask_local_ras=options.ras,
            torch_check=options.torch_check,
            nccl_log=options.nccl_log,
        )


def check_live(live: bool, paths: Sequence[Path], command: str) -> None:
    """``--live`` takes one run folder (none: the newest under reports/)."""
    if live and len(paths) > 1:
        raise UsageError("--live takes one run folder", f"e.g. gputopo {command} --live {LIVE_EXAMPLE}")


def take_live(paths: Sequence[Path], command: str, hooks: Hooks) -> Path:
    """``--live``: this node's ranks' stacks (and live dumps) into the run folder; returns the folder.
    ``command`` (hang, slow) is named in the hints."""
    from gputopo.hang.live import newest_run_dir, summary, take, targets_here
    from gputopo.system import run_facts
    from gputopo.system.pyspy import MISSING_HINT, find_pyspy

    check_live(True, paths, command)
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
    hooks.hint(f"--live: {summary(ev)}")
    for problem in ev.problems:
        hooks.warn(problem)
    if ev.hint and all(s.error for s in ev.stacks):
        raise UnavailableError(f"--live: no rank's stack could be read ({ev.problems[0]})", ev.hint)
    if ev.hint:
        hooks.hint(ev.hint)
    return run_dir


def local_health(hosts: set[str]) -> Health:
    """Health findings of this machine's GPUs, when a suspect ran here, read through the one door into
    health every command uses (``machine.read_live_health``: one NVML sample, judged by the health rules);
    nothing when NVML is not there."""
    import socket

    from gputopo.system.machine import read_live_health

    here = socket.gethostname()
    if here not in hosts:
        return {}
    found: dict[tuple[str, int], list[dict[str, object]]] = {}
    for f in read_live_health().findings:
        if f.gpu is not None:
            found.setdefault((here, f.gpu), []).append({**f.to_json(), "where": f"{here} {f.where}"})
    return found


def analyse(
    paths: Sequence[Path],
    run_records: Sequence[Path] = (),
    ras_json: Path | None = None,
    ask_local_ras: bool = False,
    torch_check: bool = False,
    health: HealthReader | None = None,
    nccl_log: Path | None = None,
) -> HangReport:
    """Everything ``gputopo hang`` reports. ``health(hosts)`` returns health findings per (host, GPU
    index) for whichever of ``hosts`` it can read (this machine's, for now). What to read was checked
    when ``Options`` was built."""
    folders = {p if p.is_dir() else p.parent for p in paths}
    stacks = _stacks(sorted(folders))
    loaded: Loaded | None = None
    if paths:
        try:
            loaded = load_dumps(_with_live_dumps(paths))
        except NothingToAnalyse:
            if not stacks:
                raise
    record_paths = list(run_records) or rec.find_records(sorted(folders))
    records = [rec.read_record(p) for p in record_paths]
    placement, assumed = rec.place_ranks(records)
    ras: RasReport | None = None
    if ras_json is not None:
        ras = read_ras_file(ras_json)
    elif ask_local_ras:
        from gputopo.system.nccl_ras import ask_ras_text

        host, port = ras_address()
        ras = parse_ras_json(ask_ras_text(host, port), f"RAS at {host}:{port}")
    match = None
    notes: list[str] = list(loaded.notes) if loaded else []
    if record_paths:
        notes.append("run records: " + ", ".join(str(p) for p in record_paths))
    drift = [f.to_json() for f in rec.config_drift(records)]
    if nccl_log is not None:
        from gputopo.hang.nccl_diag import diag_findings, read_diag

        diag, diag_notes = diag_findings(read_diag(nccl_log), str(nccl_log))
        drift += diag
        notes.extend(diag_notes)
    if loaded is not None:
        if not loaded.dumps:
            raise NothingToAnalyse(
                "no dump could be read: " + "; ".join(f"{s.path}: {s.why}" for s in loaded.skipped),
                "the dumps are truncated or corrupt; a rank killed while dumping leaves a partial file",
            )
        match = match_dumps(
            loaded.dumps, rec.world_size(records), [s.rank for s in loaded.skipped if s.rank is not None]
        )
    opinion = None
    if torch_check and loaded is not None and match is not None:
        from gputopo.hang.torch_check import ask_torch, compare

        told = ask_torch(list(loaded.dumps), match)
        have = {d.rank for d in loaded.dumps}
        diffs = compare(told, match, {r for r in match.world if r not in have})
        opinion = {
            **told.as_dict(),
            "agrees": told.ran and not told.error and not diffs,
            "differences": diffs,
        }
    hosts = {p.host for p in placement.values() if p.host}
    found_health = health(hosts) if health is not None and hosts else None
    report = triage(
        loaded,
        match,
        placement,
        assumed,
        ras=ras,
        health=found_health,
        torch_analyzer=opinion,
        notes=notes,
        stacks=stacks,
    )
    if loaded is None and ras is None and not stacks:
        # Only a log: it can say what NCCL's diagnostics found, not whether the job hangs.
        report = replace(
            report,
            verdict="incomplete",
            reason="only an NCCL log: no Flight Recorder dumps or RAS output to say whether the job hangs",
        )
    if not drift:
        return report
    found = sorted([*report.findings, *drift], key=lambda f: f["severity"] != "problem")
    return replace(report, findings=tuple(found))


def _stacks(folders: list[Path]) -> list[RankStack]:
    """The ranks' stacks every node wrote into these folders (``gputopo hang --live``, a stopped
    ``gputopo run``), the latest per rank."""
    latest: dict[int, RankStack] = {}
    for folder in folders:
        for s in read_stacks(folder):
            old = latest.get(s.rank)
            if old is None or (s.taken or "") >= (old.taken or ""):
                latest[s.rank] = s
    return [latest[r] for r in sorted(latest)]


def _with_live_dumps(paths: Sequence[Path]) -> list[Path]:
    """A run folder with no dumps of its own stands for the dumps taken from the running job through
    torch's control plane (its ``live/`` folder), when there are any."""
    from gputopo.hang.live import LIVE_DUMPS

    out: list[Path] = []
    for p in paths:
        live = p / LIVE_DUMPS
        if p.is_dir() and live.is_dir() and not find_dump_files(p) and find_dump_files(live):
            out.append(live)
        else:
            out.append(p)
    return out
