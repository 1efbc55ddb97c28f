"""``gputopo slow`` as one call: a path in, a ``SlowReport`` out. Reads the files it is pointed at: a
run folder (``gputopo run``'s: its run records place the ranks, its ``inspector/`` folder holds NCCL
Inspector logs, its Flight Recorder dumps their creation times), an Inspector dump folder, Flight
Recorder dumps, or an nccl-tests ``-J`` file."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gputopo.errors import InputError
from gputopo.findings import NOTE, PROBLEM, Finding
from gputopo.hang import record as rec
from gputopo.hang.load import NothingToAnalyse, find_dump_files, load_dumps
from gputopo.slow import judge as J
from gputopo.slow import readers as R

SCHEMA = "gputopo/slow/v1"
INSPECTOR_DIR = "inspector"
_HINT = R._HINT


@dataclass(frozen=True)
class RankPlace:
    rank: int
    host: str | None
    gpu: int | None
    pid: int | None = None


@dataclass(frozen=True)
class SlowReport:
    source: str  # "inspector" | "flight-recorder" | "nccl-tests"
    path: str
    judgement: J.Judgement
    places: dict[int, RankPlace]
    clock: str
    notes: tuple[str, ...] = ()
    unit: str = "rank"  # "process" for nccl-tests
    findings: tuple[Finding, ...] = field(default=())

    @property
    def exit_code(self) -> int:
        return 1 if self.judgement.stragglers else 0

    def place(self, rank: int) -> RankPlace:
        return self.places.get(rank) or RankPlace(rank, None, None)

    def sentence(self) -> str:
        j = self.judgement
        if j.stragglers:
            return "; ".join(self.about(s) for s in j.stragglers)
        if j.undecided:
            return f"undecided: {j.undecided}"
        spread = f"; spread {j.spread_pct:.0f}%" if j.spread_pct is not None else ""
        return f"no {self.unit} is consistently late{spread}"

    def about(self, s: J.Straggler) -> str:
        p = self.place(s.rank)
        where = []
        if p.host:
            where.append(f"on {p.host}")
        if p.gpu is not None:
            where.append(f"GPU {p.gpu}")
        at = (" " + ", ".join(where)) if where else ""
        return (
            f"{self.unit} {s.rank}{at} arrives {s.lateness_ms:.3g} ms late (median) and last in "
            f"{s.late_share:.0%} of its operations; the job loses {s.waiting_share:.0%} of its collective "
            f"time waiting for it"
        )

    def document(self) -> dict[str, Any]:
        j = self.judgement
        return {
            "schema": SCHEMA,
            "source": self.source,
            "path": self.path,
            "verdict": "straggler" if j.stragglers else ("undecided" if j.undecided else "none"),
            "sentence": self.sentence(),
            "stragglers": [
                {
                    "rank": s.rank,
                    "host": self.place(s.rank).host,
                    "gpu": self.place(s.rank).gpu,
                    "lateness_ms": round(s.lateness_ms, 4),
                    "waiting_share": round(s.waiting_share, 4),
                    "late_share": round(s.late_share, 4),
                    "windows_flagged": s.windows_flagged,
                    "windows": s.windows,
                    "communicators": list(s.communicators),
                    "operations": list(s.operations),
                }
                for s in j.stragglers
            ],
            "waited": [
                {
                    "rank": w.rank,
                    "host": self.place(w.rank).host,
                    "gpu": self.place(w.rank).gpu,
                    "waited_for": list(w.waited_for),
                    "communicators": list(w.communicators),
                }
                for w in j.waited
            ],
            "ranks": [
                {
                    "rank": r,
                    "host": self.place(r).host,
                    "gpu": self.place(r).gpu,
                    "median_lateness_ms": round(v, 4),
                }
                for r, v in j.ranks.items()
            ],
            "operations": j.operations,
            "windows": j.windows,
            "spread_pct": None if j.spread_pct is None else round(j.spread_pct, 2),
            "undecided": j.undecided,
            "clock": self.clock,
            "rule": j.params,
            "findings": [f.to_json() for f in self.findings],
            "notes": list(self.notes),
        }


LIVE_HINT = (
    "start the job with `gputopo run` on a Python script (it runs it inside torch's control plane), or "
    "wrap its main in torch.distributed.elastic.control_plane.worker_main() (docs/hang.md)"
)


def analyse(path: Path, run_records: list[Path] | None = None, live: bool = False) -> SlowReport:
    if not path.exists():
        raise InputError(f"{path}: no such file or folder", _HINT)
    if path.is_file():
        if R.looks_like_inspector(path):
            return _inspector([path], path, _records(path.parent, run_records))
        return _nccl_tests(path)
    records = _records(path, run_records)
    files = R.inspector_files(path / INSPECTOR_DIR) or R.inspector_files(path)
    if files:
        return _inspector(files, path, records)
    dumps = _dump_specs(path)
    if dumps:
        return _flight_recorder(dumps, path, records)
    if live:
        raise InputError(
            f"--live {path}: the ranks' stacks were taken but no rank served its Flight Recorder (their main "
            "does not run inside torch's control plane)",
            LIVE_HINT,
        )
    raise InputError(f"{path}: no NCCL Inspector logs, Flight Recorder dumps or nccl-tests file in it", _HINT)


def _records(folder: Path, given: list[Path] | None) -> list[rec.RunRecord]:
    paths = list(given or []) or rec.find_records([folder])
    return [rec.read_record(p) for p in paths]


def _places(records: list[rec.RunRecord]) -> dict[int, RankPlace]:
    if not records:
        return {}
    placed, _assumed = rec.place_ranks(records)
    return {r: RankPlace(r, p.host, p.gpu_index, p.pid) for r, p in placed.items()}


def _dump_specs(folder: Path) -> list[Path]:
    from gputopo.hang.live import LIVE_DUMPS

    for spec in (folder, folder / LIVE_DUMPS):  # a run folder's own dumps, else those taken live
        try:
            if spec.is_dir() and find_dump_files(spec):
                return [spec]
        except InputError:
            continue
    return []


def _short(host: str) -> str:
    return host.split(".", 1)[0]


def _inspector(files: list[Path], path: Path, records: list[rec.RunRecord]) -> SlowReport:
    read = R.read_inspector(files)
    if not read.operations:
        raise InputError(f"{path}: its Inspector logs hold no collective record", _HINT)
    places = _places(records)
    rank_of: dict[tuple[str, int], int] = {}
    for p in places.values():
        if p.host and p.pid is not None:
            rank_of[(p.host, p.pid)] = p.rank
            rank_of[(_short(p.host), p.pid)] = p.rank
    notes = [f"{len(read.files)} Inspector log(s), format {', '.join(read.versions)}"]
    fixed: dict[tuple[str, int], int] = {}
    unmapped = []
    for f in read.files:
        key = (f.host, f.pid)
        r = rank_of.get(key, rank_of.get((_short(f.host), f.pid)))
        if r is not None:
            fixed[key] = r
        else:
            unmapped.append(key)
    if unmapped:
        world, whole = R.inspector_world_ranks(read)
        for key in unmapped:
            if key in world and world[key] not in places:
                fixed[key] = world[key]
                places[world[key]] = RankPlace(world[key], key[0], None, key[1])
        how = (
            "their rank in the communicator of every process"
            if whole
            else "their place in (host, PID) order: no communicator holds every process, give --run-record"
        )
        notes.append(
            f"ranks named by {how} (no run record places {len(unmapped)} of the processes by host and PID)"
        )
    if read.truncated:
        notes.append(f"{read.truncated} truncated last line(s) skipped (a job killed while writing)")
    if read.bad:
        notes.append(f"{read.bad} line(s) that are not Inspector collective records skipped")
    if read.p2p:
        notes.append(f"{read.p2p} point-to-point record(s) not judged")
    joined = R.inspector_series(read, fixed)
    if joined.incomplete:
        notes.append(
            f"{joined.incomplete} operation(s) not recorded by every member of their communicator not judged"
        )
    j = J.judge(joined.series)
    return _report(
        "inspector",
        path,
        j,
        places,
        f"kernel execution times, {joined.communicators} communicator(s) joined by id (no clock is compared)",
        notes,
    )


def _flight_recorder(specs: list[Path], path: Path, records: list[rec.RunRecord]) -> SlowReport:
    try:
        loaded = load_dumps(specs)
    except NothingToAnalyse as e:
        raise InputError(f"{path}: {e}", _HINT) from None
    if not loaded.dumps:
        raise InputError(f"{path}: no Flight Recorder dump could be read", _HINT)
    places = _places(records)
    host_of = {d.rank: (places[d.rank].host if d.rank in places else d.host) for d in loaded.dumps}
    hosts = sorted({h or "?" for h in host_of.values()})
    series = R.fr_series({d.rank: d.entries for d in loaded.dumps}, host_of)
    if len(hosts) > 1:
        clock = (
            f"creation times compared within each host ({len(hosts)} hosts): hosts' clocks are not "
            "aligned, so a rank is judged against the ranks of its own host"
        )
    else:
        clock = "creation times on one host (one clock)"
    notes = list(loaded.notes) + [f"{len(loaded.dumps)} Flight Recorder dump(s)"]
    for s in loaded.skipped:
        notes.append(f"{s.path}: {s.why}")
    j = J.judge(series)
    return _report("flight-recorder", path, j, places, clock, notes)


def _nccl_tests(path: Path) -> SlowReport:
    sizes, _doc = R.read_nccl_tests(path)
    if not sizes:
        raise InputError(
            f"{path}: no per-process times in it (run nccl-tests with -J FILE and more than one process)",
            _HINT,
        )
    series = []
    places: dict[int, RankPlace] = {}
    for s in sizes:
        for p in s.processes:
            places.setdefault(p.index, RankPlace(p.index, p.host, p.device, p.pid))
        series.append(
            J.Series(
                comm="world",
                label="world",
                name=f"size {s.size}",
                bucket=J.size_bucket(s.size),
                ranks=tuple(p.index for p in s.processes),
                rows=[[p.lateness_us / 1000.0 for p in s.processes]],
                optime_ms=[s.median_us / 1000.0],
                busy_ms=[sum(p.avg_us for p in s.processes) / 1000.0],
            )
        )
    j = J.judge(series, window=1)
    return _report(
        "nccl-tests",
        path,
        j,
        places,
        "per-process times as nccl-tests measured them: each process's row minus the iteration's median",
        [f"{len(sizes)} message size(s) with per-process times"],
        unit="process",
    )


def _report(
    source: str,
    path: Path,
    j: J.Judgement,
    places: dict[int, RankPlace],
    clock: str,
    notes: list[str],
    unit: str = "rank",
) -> SlowReport:
    report = SlowReport(source, str(path), j, places, clock, tuple(notes), unit)
    findings = []
    for s in j.stragglers:
        p = report.place(s.rank)
        findings.append(
            Finding(
                where=f"{unit} {s.rank}"
                + (f" ({p.host} GPU {p.gpu})" if p.host and p.gpu is not None else ""),
                what=report.about(s) + f" (outlier in {s.windows_flagged} of {s.windows} windows)",
                remedy="look at what that rank does between collectives: its GPU clocks and health "
                "(gputopo check on its node), its data loader and host load, its NIC",
                severity=PROBLEM,
                gpu=p.gpu,
                category="compute",
                action="monitor",
            )
        )
    if not j.stragglers and j.undecided:
        findings.append(
            Finding(
                where="job",
                what=j.undecided,
                remedy="record more operations",
                severity=NOTE,
                category="process",
            )
        )
    return replace(report, findings=tuple(findings))
