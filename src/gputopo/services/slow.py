"""``gputopo slow``'s service: a path in, a ``SlowReport`` (``slow.report``) out. Reads the files it is
pointed at: a run folder (``gputopo run``'s: its run records place the ranks, its ``inspector/`` folder
holds NCCL Inspector logs, its Flight Recorder dumps their creation times), an Inspector dump folder,
Flight Recorder dumps, or an nccl-tests ``-J`` file; with ``--live`` the running job's evidence is taken
into its run folder first (``services.hang.take_live``). The CLI builds ``Options`` (validated once,
here), calls ``run`` and renders the report; ``Hooks`` carries the callbacks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gputopo.errors import InputError, UsageError
from gputopo.hang import record as rec
from gputopo.hang.load import NothingToAnalyse, find_dump_files, load_dumps
from gputopo.services.hang import Hooks, take_live
from gputopo.slow import judge as J
from gputopo.slow import readers as R
from gputopo.slow.report import RankPlace, SlowReport, make_report

INSPECTOR_DIR = "inspector"
_HINT = R._HINT
NO_PATH = ("nothing to read: give PATH", "e.g. gputopo slow reports/run-20260101T120000Z")


@dataclass(frozen=True, kw_only=True)
class Options:
    """What ``gputopo slow`` was asked, keyword only, validated when built (``UsageError``, exit 2)."""

    path: Path | None = None  # a run folder, Inspector dumps, Flight Recorder dumps, an nccl-tests file
    run_records: tuple[Path, ...] = ()
    live: bool = False  # take the running job's dumps into its run folder first (``path``: that folder)
    html: Path | None = None  # the HTML report's file (written by the caller; refused here at once)

    def __post_init__(self) -> None:
        if self.path is None and not self.live:
            raise UsageError(*NO_PATH)


def run(options: Options, hooks: Hooks | None = None) -> SlowReport:
    """The straggler (if any) in what ``options.path`` holds (``--live``: after taking the job's dumps)."""
    hooks = hooks or Hooks()
    if options.html is not None:
        from gputopo.outputs import check_output

        check_output(options.html, "--html", "slow.html")
    path = options.path
    if options.live:
        path = take_live([path] if path else [], "slow", hooks)
    if path is None:  # not reached: Options asks for PATH unless --live, which names the run folder
        raise UsageError(*NO_PATH)
    return analyse(path, list(options.run_records), live=options.live)


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
    return make_report(
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
    return make_report("flight-recorder", path, j, places, clock, notes)


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
    return make_report(
        "nccl-tests",
        path,
        j,
        places,
        "per-process times as nccl-tests measured them: each process's row minus the iteration's median",
        [f"{len(sizes)} message size(s) with per-process times"],
        unit="process",
    )
