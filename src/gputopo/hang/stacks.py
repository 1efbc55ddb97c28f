"""Ranks' Python stacks (pure): what ``py-spy dump --json`` says of each rank, grouped by where each rank
is, and the odd ones out named as suspects with their frame.

A stack file (``gputopo/stacks/v1``, ``stacks-<host>.json`` in the run folder) is written by
``gputopo hang --live`` and by ``gputopo run`` when the job is cancelled; every node writes its own into
the shared run folder, and ``gputopo hang RUN_DIR`` reads them all::

    {"schema": "gputopo/stacks/v1", "host": "node-a", "taken": "2026-11-28T04:00:00Z", "why": "live",
     "ranks": [{"rank": 2, "local_rank": 2, "pid": 4242, "gpu": 2, "error": null,
                "threads": [{"name": "MainThread", "id": 4242, "frames": [
                    {"name": "load_next_batch", "filename": "/job/train.py", "line": 6}, ...]}]}]}

py-spy's JSON (``py-spy dump --json``, py-spy 0.4) is a list of threads, each with ``thread_name``,
``os_thread_id`` and ``frames`` (innermost first: ``name``, ``filename``, ``line``); the main thread's
``os_thread_id`` is the process id. A rank is "in a collective" when its main thread's stack passes
through ``torch/distributed/distributed_c10d.py`` (the function there is the collective's name: every
blocking collective waits inside it); otherwise it is in its own code, at its innermost frame outside
torch, the launcher and the standard library's threading.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputopo.errors import InputError
from gputopo.inputs import read_capped

SCHEMA = "gputopo/stacks/v1"
STACK_GLOB = "stacks-*.json"
MAX_STACK_BYTES = 16 * 1024 * 1024
_C10D = re.compile(r"torch[/\\]distributed[/\\]distributed_c10d\.py$")
_NOT_USER = re.compile(
    r"([/\\](torch|multiprocessing|concurrent|asyncio)[/\\])|([/\\](threading|runpy|selectors)\.py$)"
)
IN_COLLECTIVE = "collective"
IN_OWN_CODE = "own_code"
UNREADABLE = "unreadable"
NOT_IN_COLLECTIVE = "not_in_collective"
OTHER_COLLECTIVE = "other_collective"


@dataclass(frozen=True)
class Frame:
    name: str
    filename: str
    line: int | None

    def __str__(self) -> str:
        return f"{self.name} ({Path(self.filename).name}:{self.line})"


@dataclass(frozen=True)
class RankStack:
    """One rank's threads as py-spy saw them, or why it could not look."""

    rank: int
    host: str | None
    local_rank: int | None
    pid: int | None
    gpu: int | None
    threads: tuple[tuple[str, tuple[Frame, ...]], ...] = ()  # (thread name, frames innermost first)
    error: str | None = None
    taken: str | None = None

    @property
    def main(self) -> tuple[Frame, ...]:
        """The main thread's frames (the one named MainThread, else the first)."""
        for name, frames in self.threads:
            if name == "MainThread":
                return frames
        return self.threads[0][1] if self.threads else ()

    def where(self) -> tuple[str, str, Frame | None]:
        """(kind, what, frame): ``collective`` and the collective's name with the user's frame that
        called it, or ``own_code`` and the innermost user frame, or ``unreadable``."""
        frames = self.main
        if self.error or not frames:
            return UNREADABLE, self.error or "no Python frames", None
        user = next((f for f in frames if not _NOT_USER.search(f.filename)), None)
        for f in frames:
            if _C10D.search(f.filename):
                return IN_COLLECTIVE, f.name, user
        return IN_OWN_CODE, (user.name if user else frames[0].name), user or frames[0]

    def as_dict(self) -> dict[str, Any]:
        kind, what, frame = self.where()
        return {
            "rank": self.rank,
            "host": self.host,
            "local_rank": self.local_rank,
            "pid": self.pid,
            "gpu": self.gpu,
            "taken": self.taken,
            "in": kind,
            "what": what,
            "frame": str(frame) if frame else None,
            "error": self.error,
            "threads": [
                {
                    "name": name,
                    "frames": [{"name": f.name, "filename": f.filename, "line": f.line} for f in frames],
                }
                for name, frames in self.threads
            ],
        }


@dataclass(frozen=True)
class StackSuspect:
    rank: int
    why: str  # NOT_IN_COLLECTIVE | OTHER_COLLECTIVE
    what: str
    frame: str | None


@dataclass(frozen=True)
class StackVerdict:
    """The ranks grouped by where they are, the odd ones out, and the sentence that says it."""

    groups: dict[str, tuple[int, ...]]  # "all_reduce" / "stall_in_data_loader (job.py:6)" -> ranks
    suspects: tuple[StackSuspect, ...]
    sentence: str
    unreadable: tuple[int, ...] = field(default=())
    waiting: str = ""  # "rank(s) 0, 1, 3 wait in all_reduce"


def from_pyspy(
    doc: Any, rank: int, host: str | None, local_rank: int | None, pid: int | None, gpu: int | None
) -> RankStack:
    """One rank's stack from ``py-spy dump --json`` output (already parsed)."""
    if not isinstance(doc, list):
        return RankStack(rank, host, local_rank, pid, gpu, error="py-spy gave no thread list")
    threads: list[tuple[str, tuple[Frame, ...]]] = []
    for t in doc:
        if not isinstance(t, dict):
            continue
        name = t.get("thread_name") or (
            "MainThread" if t.get("os_thread_id") == pid else str(t.get("thread_id"))
        )
        frames = tuple(
            Frame(
                str(f.get("name", "?")),
                str(f.get("filename", "?")),
                f.get("line") if isinstance(f.get("line"), int) else None,
            )
            for f in t.get("frames") or ()
            if isinstance(f, dict)
        )
        threads.append((str(name), frames))
    return RankStack(rank, host, local_rank, pid, gpu, tuple(threads))


def judge(stacks: list[RankStack]) -> StackVerdict | None:
    """Group the ranks by where they are; the ranks outside the largest group (ties go to a group in a
    collective: ranks in a collective wait for the others) are the suspects. ``None`` without stacks."""
    readable = [s for s in stacks if s.where()[0] != UNREADABLE]
    unreadable = tuple(sorted(s.rank for s in stacks if s.where()[0] == UNREADABLE))
    if not readable:
        return None if not stacks else StackVerdict({}, (), "no rank's stack could be read", unreadable)
    places: dict[str, list[int]] = {}
    kinds: dict[str, str] = {}
    frames: dict[int, str | None] = {}
    for s in sorted(readable, key=lambda s: s.rank):
        kind, what, frame = s.where()
        label = what if kind == IN_COLLECTIVE else str(frame)
        places.setdefault(label, []).append(s.rank)
        kinds[label] = kind
        frames[s.rank] = str(frame) if frame else None
    sizes = Counter({k: len(v) for k, v in places.items()})
    top = max(places, key=lambda k: (sizes[k], kinds[k] == IN_COLLECTIVE, -min(places[k])))
    groups = {k: tuple(v) for k, v in sorted(places.items(), key=lambda kv: min(kv[1]))}
    waiting = places[top]
    in_coll = kinds[top] == IN_COLLECTIVE
    if len(places) == 1:
        where = f"wait in {top}" if in_coll else f"are in {top}, not in a collective"
        return StackVerdict(
            groups, (), f"every rank ({_ranks(waiting)}) {where}: no rank stands out in its stack", unreadable
        )
    suspects: list[StackSuspect] = []
    said: list[str] = []
    for label, ranks in groups.items():
        if label == top:
            continue
        for r in ranks:
            if kinds[label] == IN_COLLECTIVE:
                what = (
                    f"rank {r} is in {label}"
                    + (f" (from {frames[r]})" if frames[r] else "")
                    + (f", not in {top}" if in_coll else "")
                )
                suspects.append(StackSuspect(r, OTHER_COLLECTIVE, what, frames[r]))
            else:
                what = f"rank {r} is in {label}, not in a collective"
                suspects.append(StackSuspect(r, NOT_IN_COLLECTIVE, what, frames[r]))
            said.append(what)
    tail = f"rank(s) {_ranks(waiting)} " + (f"wait in {top}" if in_coll else f"are in {top}")
    return StackVerdict(groups, tuple(suspects), "; ".join(said) + "; " + tail, unreadable, tail)


def write_stacks(stacks: list[RankStack], host: str, taken: str, why: str) -> str:
    """The ``gputopo/stacks/v1`` document as text."""
    doc = {"schema": SCHEMA, "host": host, "taken": taken, "why": why, "ranks": [s.as_dict() for s in stacks]}
    return json.dumps(doc, indent=1) + "\n"


def read_stacks(folder: Path) -> list[RankStack]:
    """Every node's stack file in ``folder``; the latest stack of each rank."""
    latest: dict[int, RankStack] = {}
    for path in sorted(folder.glob(STACK_GLOB)):
        label = f"stack file {path}"
        hint = "a stack file is what `gputopo hang --live` or a cancelled `gputopo run` writes"
        try:
            doc = json.loads(read_capped(path, label, MAX_STACK_BYTES, hint).decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            raise InputError(f"{label}: not JSON", hint) from None
        except OSError as exc:
            raise InputError(f"{label}: cannot read ({exc.strerror or exc})", hint) from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("ranks"), list):
            raise InputError(f"{label}: not a {SCHEMA} document", hint)
        for r in doc["ranks"]:
            s = _stack_from_doc(r, doc)
            if s is None:
                raise InputError(f"{label}: a rank without a rank number", hint)
            old = latest.get(s.rank)
            if old is None or (s.taken or "") >= (old.taken or ""):
                latest[s.rank] = s
    return [latest[r] for r in sorted(latest)]


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _stack_from_doc(r: Any, doc: dict[str, Any]) -> RankStack | None:
    if not isinstance(r, dict) or _int(r.get("rank")) is None:
        return None
    threads = []
    for t in r.get("threads") or ():
        if not isinstance(t, dict):
            continue
        frames = tuple(
            Frame(str(f.get("name")), str(f.get("filename")), _int(f.get("line")))
            for f in t.get("frames") or ()
            if isinstance(f, dict)
        )
        threads.append((str(t.get("name")), frames))
    host = r.get("host") if isinstance(r.get("host"), str) else doc.get("host")
    return RankStack(
        rank=r["rank"],
        host=host if isinstance(host, str) else None,
        local_rank=_int(r.get("local_rank")),
        pid=_int(r.get("pid")),
        gpu=_int(r.get("gpu")),
        threads=tuple(threads),
        error=r.get("error") if isinstance(r.get("error"), str) else None,
        taken=doc.get("taken") if isinstance(doc.get("taken"), str) else None,
    )


def _ranks(ranks: Any) -> str:
    return ", ".join(str(r) for r in ranks)
