"""Evidence from a job that still runs: every local rank's Python stack (py-spy) and, where the job runs
torch's control plane, its Flight Recorder dump, written into the run folder, so that ``gputopo hang``
(now, or after the job was stopped) can name the stuck rank. Used by ``gputopo hang --live`` and by
``gputopo run`` when it is stopped (SIGTERM, SIGINT).

The ranks are the run record's (``gputopo run`` writes every rank's PID, local rank and GPU into it as
the ranks start); only this host's ranks are looked at: across nodes each node's own ``gputopo hang
--live`` writes ``stacks-<host>.json`` into the shared run folder, and any node's ``gputopo hang
RUN_DIR`` reads them all.

The control plane (torch/distributed/elastic/control_plane.py): a rank whose main runs inside
``worker_main()`` with ``TORCH_WORKER_SERVER_SOCKET`` set serves ``fr_trace_json`` on that Unix socket.
gputopo looks for it where the rank's environment names it, else at ``WORKER_SOCKET`` (the rank's PID
in it), the path the docs tell a script to use (docs/hang.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from gputopo.hang import record as rec
from gputopo.hang.stacks import RankStack, from_pyspy, write_stacks

LIVE_DUMPS = "live"  # the run folder's subfolder for Flight Recorder dumps taken while the job ran
LIVE_PREFIX = "fr-live-"
WORKER_SOCKET = "gputopo-worker-{pid}.sock"  # in the temp folder
EVIDENCE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Target:
    """A rank to look at: where it runs."""

    rank: int
    pid: int
    local_rank: int | None
    gpu: int | None
    started: float | None = None  # the rank's start time as recorded, so a reused PID is never read


@dataclass(frozen=True)
class Evidence:
    """What was taken: the stacks, the stack file, any live dumps, and what could not be done (words)."""

    stacks: tuple[RankStack, ...]
    stack_file: Path | None
    dumps: tuple[Path, ...]
    problems: tuple[str, ...]
    hint: str | None
    seconds: float


def worker_socket(pid: int) -> Path:
    return Path(tempfile.gettempdir()) / WORKER_SOCKET.format(pid=pid)


def targets_here(run_dir: Path, host: str) -> list[Target]:
    """This host's ranks with a PID, from the run folder's records."""
    records = [rec.read_record(p) for p in rec.find_records([run_dir])]
    placement, _ = rec.place_ranks(records)
    return [
        Target(p.rank, p.pid, p.local_rank, p.gpu_index, p.started)
        for p in sorted(placement.values(), key=lambda p: p.rank)
        if p.host == host and p.pid is not None
    ]


def take(
    run_dir: Path,
    targets: list[Target],
    host: str,
    why: str,
    timeout_s: float = EVIDENCE_TIMEOUT_S,
) -> Evidence:
    """Every target's stack and (where served) live dump, written into ``run_dir``; bounded by
    ``timeout_s`` (each py-spy and each socket has it, and they run side by side)."""
    from gputopo.system import procfs, pyspy

    begun = time.monotonic()
    taken = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    stacks: list[RankStack] = []
    problems: list[str] = []
    hint = None
    # (pid, start time) checked first: py-spy on a PID the kernel has since given to another process
    # would put a stranger's stack in the rank's place.
    alive: list[Target] = []
    for t in targets:
        gone = procfs.not_the_same_process(t.pid, t.started)
        if gone is None:
            alive.append(t)
            continue
        stacks.append(RankStack(t.rank, host, t.local_rank, t.pid, t.gpu, error=gone, taken=taken))
        problems.append(f"rank {t.rank} (pid {t.pid}): {gone}")
    targets = alive
    reads = pyspy.dump_many([t.pid for t in targets], timeout_s)
    for t in targets:
        got = reads.get(t.pid)
        if got is None or got.error:
            why_not = got.error if got else "not read"
            stacks.append(RankStack(t.rank, host, t.local_rank, t.pid, t.gpu, error=why_not, taken=taken))
            problems.append(f"rank {t.rank} (pid {t.pid}): {why_not}")
            hint = hint or (got.hint if got else None)
            continue
        s = from_pyspy(got.threads, t.rank, host, t.local_rank, t.pid, t.gpu)
        stacks.append(RankStack(s.rank, s.host, s.local_rank, s.pid, s.gpu, s.threads, s.error, taken))
    stacks.sort(key=lambda s: s.rank)
    dumps = _live_dumps(run_dir, targets, timeout_s, problems)
    stack_file = run_dir / f"stacks-{host}.json"
    try:
        _atomic(stack_file, write_stacks(stacks, host, taken, why))
    except OSError as exc:
        problems.append(f"cannot write {stack_file}: {exc.strerror or exc}")
        stack_file = None
    return Evidence(tuple(stacks), stack_file, tuple(dumps), tuple(problems), hint, time.monotonic() - begun)


def _live_dumps(run_dir: Path, targets: list[Target], timeout_s: float, problems: list[str]) -> list[Path]:
    """``fr_trace_json`` from each rank that serves torch's control plane, as ``live/fr-live-<rank>.json``."""
    from concurrent.futures import ThreadPoolExecutor

    from gputopo.system.worker_server import ask

    served = [(t, sock) for t in targets if (sock := _socket_of(t.pid)) is not None]
    if not served:
        return []

    def one(item: tuple[Target, Path]) -> Path | None:
        t, sock = item
        try:
            body = ask(str(sock), "fr_trace_json", timeout_s)
        except Exception as exc:  # noqa: BLE001 -- a rank that does not answer is said, never fatal
            problems.append(f"rank {t.rank}: control plane at {sock}: {exc}")
            return None
        folder = run_dir / LIVE_DUMPS
        folder.mkdir(exist_ok=True)
        path = folder / f"{LIVE_PREFIX}{t.rank}.json"
        _atomic(path, body.decode("utf-8", "replace"))
        return path

    with ThreadPoolExecutor(max_workers=min(16, len(served))) as pool:
        return [p for p in pool.map(one, served) if p is not None]


def _socket_of(pid: int) -> Path | None:
    """The rank's control-plane socket: the one its environment names, else gputopo's convention."""
    from gputopo.system.procfs import environ_value

    value = environ_value(pid, "TORCH_WORKER_SERVER_SOCKET")
    named = Path(value) if value else None
    for candidate in (named, worker_socket(pid)):
        if candidate is not None and candidate.is_socket():
            return candidate
    return None


def _atomic(path: Path, text: str) -> None:
    """Write a run-folder file whole (a temporary file beside it, then a rename): a reader never sees
    half of it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def newest_run_dir(base: Path) -> Path | None:
    """The newest ``run-*`` folder under ``base`` (``gputopo run``'s default: reports/run-<UTC time>)."""
    runs = [p for p in base.glob("run-*") if p.is_dir()]
    return max(runs, key=lambda p: (p.stat().st_mtime, p.name)) if runs else None


def summary(ev: Evidence) -> str:
    """One line for stderr."""
    ok = sum(1 for s in ev.stacks if not s.error)
    said = f"stacks of {ok} of {len(ev.stacks)} rank(s)"
    if ev.dumps:
        said += f" and {len(ev.dumps)} live dump(s)"
    return (
        said
        + (f" in {ev.seconds:.1f} s" if ev.seconds else "")
        + (f" into {ev.stack_file.parent}" if ev.stack_file else "")
    )


def as_json(ev: Evidence) -> str:
    return json.dumps({"stacks": [s.as_dict() for s in ev.stacks], "problems": list(ev.problems)})
