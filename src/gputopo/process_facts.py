"""What ``system/`` reads about the processes that hold GPU device files (lsof, ``/proc``), as plain data.

``system.lsof`` and ``system.procfs`` fill these; ``procs.holders`` joins them with NVML into ``Holder``
records and ``procs.stale`` judges them. They live on the model floor, below both, so that ``system/``
hands its reads up without importing a room (``procs/``) whose services call ``system/``.

A process is named by ``(pid, create_time)`` (``ProcessRef``), never by a bare pid, so a pid that the
kernel reuses for a new process is never mistaken for the old one. ``parse_lsof_fields`` reads lsof's
machine-readable field output (``-F``), not its columns, whose widths and truncation change between
versions.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessRef:
    """A process identity: its pid and its start time (seconds since the epoch, as psutil gives it)."""

    pid: int
    create_time_s: float


@dataclass(frozen=True)
class OpenDevices:
    """One process and the device files it has open, as lsof or ``/proc/PID/fd`` showed them.

    ``command`` and ``uid`` are lsof's own fields, kept for processes that exit before they can be
    read again; ``None`` when the source did not give them.
    """

    pid: int
    paths: tuple[str, ...]
    command: str | None = None
    uid: int | None = None


@dataclass(frozen=True)
class ProcessInfo:
    """What the kernel says about one process at scan time.

    ``status`` is psutil's (``running``, ``sleeping``, ``disk-sleep``, ``zombie``, ...). ``sid`` is the
    session id. ``error`` says why the rest is unknown (``"access denied"``); then the identity
    (``create_time_s``) may be ``None`` and the process is never signalled. ``nspid`` is its pid in each
    PID namespace, outermost first (``/proc/PID/status`` NSpid). ``launch_env`` holds the launcher
    variables of its start-up environment (``TORCHELASTIC_RUN_ID``, ``LOCAL_RANK``, ...); ``None`` when the
    environment could not be read. ``threads`` is every thread of it as ``(tid, state letter)`` from
    ``/proc/PID/task/TID/stat`` (``R``, ``S``, ``D``, ``Z``...), read only for a zombie (``None``
    otherwise, or when unreadable): a "zombie" whose other threads live is an exited thread-group leader,
    not an exited process.
    """

    pid: int
    create_time_s: float | None
    ppid: int | None = None
    name: str | None = None
    cmdline: tuple[str, ...] | None = None
    uid: int | None = None
    user: str | None = None
    status: str | None = None
    sid: int | None = None
    error: str | None = None
    nspid: tuple[int, ...] | None = None
    launch_env: tuple[tuple[str, str], ...] | None = None
    threads: tuple[tuple[int, str], ...] | None = None

    @property
    def live_threads(self) -> tuple[tuple[int, str], ...]:
        """Its threads other than the main one that have not exited (state neither ``Z`` nor ``X``)."""
        return tuple(
            (tid, state) for tid, state in self.threads or () if tid != self.pid and state not in "ZX"
        )

    @property
    def env(self) -> dict[str, str]:
        """The launcher variables of its start-up environment (empty when none, or unreadable)."""
        return dict(self.launch_env or ())

    @property
    def ref(self) -> ProcessRef | None:
        """The ``(pid, create_time)`` identity, or ``None`` when the start time could not be read."""
        if self.create_time_s is None:
            return None
        return ProcessRef(self.pid, self.create_time_s)

    @property
    def command(self) -> str | None:
        """The command line as one string (the name when the command line is empty, as for kernel tasks)."""
        if self.cmdline:
            return " ".join(self.cmdline)
        return self.name

    @property
    def identities(self) -> tuple[str, ...]:
        """Names the process goes by: its name and the file name of ``argv[0]``."""
        names = [self.name] if self.name else []
        if self.cmdline:
            names.append(os.path.basename(self.cmdline[0]))
        return tuple(dict.fromkeys(n for n in names if n))


@dataclass(frozen=True)
class HolderScan:
    """Everything read from the machine in one scan, for the pure code to judge.

    ``processes`` holds the holders and their parents; ``lineage`` is this gputopo process followed by its
    ancestors up to PID 1; ``my_uid`` is the effective uid the tool runs as. ``source`` is ``"lsof"`` or
    ``"/proc"``. ``scan_time_s`` is the wall clock at the scan, for ages.
    """

    source: str
    device_files: tuple[str, ...]
    open_devices: tuple[OpenDevices, ...]
    processes: Mapping[int, ProcessInfo]
    lineage: tuple[int, ...]
    my_uid: int
    scan_time_s: float
    warnings: tuple[str, ...] = ()


def parse_lsof_fields(text: str) -> list[OpenDevices]:
    """Parse ``lsof -F`` field output into one record per process.

    Each line is a field: its first character names it, the rest is the value. A ``p`` line starts a
    process set (``c`` command, ``u`` uid, other process fields ignored), an ``f`` line starts a file
    set within it, and ``n`` is the file's name. Lines that are not fields (blank, unknown ids) are
    skipped; a process listed twice is merged. Names keep their order, without duplicates (a device both
    opened and memory-mapped is listed once).
    """
    order: list[int] = []
    paths: dict[int, list[str]] = {}
    commands: dict[int, str] = {}
    uids: dict[int, int] = {}
    pid: int | None = None
    for raw in text.splitlines():
        if not raw:
            continue
        field, value = raw[0], raw[1:]
        if field == "p":
            pid = int(value) if value.isdigit() else None
            if pid is not None and pid not in paths:
                order.append(pid)
                paths[pid] = []
        elif pid is None:
            continue
        elif field == "c":
            commands[pid] = value
        elif field == "u" and value.isdigit():
            uids[pid] = int(value)
        elif field == "n" and value and value not in paths[pid]:
            paths[pid].append(value)
    return [
        OpenDevices(pid=p, paths=tuple(paths[p]), command=commands.get(p), uid=uids.get(p))
        for p in order
        if paths[p]
    ]
