"""``gputopo hang`` as one call: dumps, run records, RAS and (optionally) torch's analyzer in, a
``HangReport`` out. Reads the files it is pointed at; reaches the machine only through ``system.nccl_ras``
(``ask_local_ras=True``) and the ``health`` callback the caller passes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from gputopo.errors import UsageError
from gputopo.hang import record as rec
from gputopo.hang.load import Loaded, NothingToAnalyse, find_dump_files, load_dumps
from gputopo.hang.match import match_dumps
from gputopo.hang.ras import RasReport, parse_ras_json, ras_address, read_ras_file
from gputopo.hang.stacks import RankStack, read_stacks
from gputopo.hang.triage import HangReport, Health, triage

HealthReader = Callable[[set[str]], Health]


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
    index) for whichever of ``hosts`` it can read (this machine's, for now)."""
    if not paths and ras_json is None and not ask_local_ras and nccl_log is None:
        raise UsageError(
            "nothing to analyse: no dump folder, --ras, --ras-json or --nccl-log",
            "e.g. gputopo hang reports/run-*/fr",
        )
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
