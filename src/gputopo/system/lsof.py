"""Reading which processes hold GPU device files, and the facts about them (touches the machine).

Holders come from ``lsof -F`` on the device files; when lsof is missing or fails, from ``/proc/PID/fd``.
The fallback reads the fd links itself rather than psutil's ``Process.open_files()``, which on Linux
lists regular files only and so never shows a character device such as ``/dev/nvidia0``. Process
facts (start time, parent, session, owner, state) come from psutil and ``getsid``; the pid in every PID
namespace and the launcher variables of the environment from ``system.procfs``. Everything returned is
plain data (``gputopo.process_facts``) for the pure code to judge.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import psutil

from gputopo.errors import UnavailableError
from gputopo.process_facts import HolderScan, OpenDevices, ProcessInfo, parse_lsof_fields
from gputopo.system.procfs import read_launch_env, read_nspid, read_threads, zombie_leader_files

T = TypeVar("T")

DEFAULT_DEVICE_GLOB = "/dev/nvidia*"
PROC_ROOT = Path("/proc")
LSOF_TIMEOUT_S = 60.0

# lsof exits 1 when a named file is open nowhere; these stderr lines are expected then, not failures.
_LSOF_BENIGN_STDERR = ("status error on",)


def expand_device_glob(pattern: str) -> tuple[str, ...]:
    """The files ``pattern`` matches, sorted; folders (``/dev/nvidia-caps``) are left out."""
    return tuple(sorted(p for p in glob.glob(pattern) if not os.path.isdir(p)))


def find_open_devices(device_files: Sequence[str]) -> tuple[list[OpenDevices], str, list[str]]:
    """Processes with any of ``device_files`` open: (records, source, warnings).

    ``source`` is ``"lsof"``, or ``"/proc"`` when lsof is missing or failed (the warnings say which).
    Raises ``UnavailableError`` (exit 3) when neither lsof nor ``/proc`` can be read.
    """
    if not device_files:
        return [], "none", []
    records, source, warnings = _find_open_devices(device_files)
    # Neither lsof nor /proc/PID/fd shows what the live threads of an exited main thread hold.
    known = {r.pid for r in records}
    wanted = {os.path.realpath(f): f for f in device_files}
    for pid, held in zombie_leader_files(wanted).items():
        if pid not in known:
            records.append(OpenDevices(pid, held))
    return records, source, warnings


def _find_open_devices(device_files: Sequence[str]) -> tuple[list[OpenDevices], str, list[str]]:
    warnings: list[str] = []
    lsof = shutil.which("lsof")
    if lsof is None:
        warnings.append(
            "lsof not found: reading /proc/*/fd instead (install lsof for memory-mapped files too)"
        )
    else:
        try:
            return _run_lsof(lsof, device_files), "lsof", warnings
        except _LsofFailed as exc:
            warnings.append(f"lsof failed ({exc}): reading /proc/*/fd instead")
    records, unreadable = _scan_proc(device_files)
    if unreadable:
        warnings.append(
            f"{unreadable} processes' open files could not be read (not root?): "
            "holders among them are not shown"
        )
    return records, "/proc", warnings


class _LsofFailed(Exception):
    """lsof ran but did not give a usable answer."""


def _run_lsof(lsof: str, device_files: Sequence[str]) -> list[OpenDevices]:
    # -w: no warnings about other file systems; +c 0: the whole command name; -F: fields, not columns.
    argv = [lsof, "-w", "+c", "0", "-F", "pcufn", "--", *device_files]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=LSOF_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise _LsofFailed(f"no answer in {LSOF_TIMEOUT_S:.0f} s") from None
    except OSError as exc:
        raise _LsofFailed(exc.strerror or str(exc)) from None
    unexpected = [
        line
        for line in done.stderr.splitlines()
        if line.strip() and not any(b in line for b in _LSOF_BENIGN_STDERR)
    ]
    if done.returncode not in (0, 1) or (done.returncode == 1 and unexpected):
        raise _LsofFailed(f"exit {done.returncode}: {unexpected[0] if unexpected else 'no message'}")
    return _to_requested_names(parse_lsof_fields(done.stdout), device_files)


def _to_requested_names(records: Iterable[OpenDevices], device_files: Sequence[str]) -> list[OpenDevices]:
    """Name each open file as the user's glob named it, and drop names that are not device files."""
    requested = {os.path.realpath(f): f for f in device_files}
    requested.update({f: f for f in device_files})
    out: list[OpenDevices] = []
    for record in records:
        names = tuple(dict.fromkeys(n for n in (_requested(p, requested) for p in record.paths) if n))
        if names:
            out.append(OpenDevices(record.pid, names, record.command, record.uid))
    return out


def _requested(path: str, requested: dict[str, str]) -> str | None:
    if path in requested:
        return requested[path]
    return requested.get(os.path.realpath(path))


def _scan_proc(device_files: Sequence[str]) -> tuple[list[OpenDevices], int]:
    """Read every ``/proc/PID/fd`` link: (records, count of processes whose fds could not be read)."""
    requested = {os.path.realpath(f): f for f in device_files}
    try:
        entries = [e.name for e in os.scandir(PROC_ROOT) if e.name.isdigit()]
    except OSError as exc:
        raise UnavailableError(
            f"cannot find GPU holders: lsof is not available and {PROC_ROOT} cannot be read "
            f"({exc.strerror or exc})",
            "install lsof (e.g. apt-get install lsof) or run where /proc is mounted",
        ) from None
    records: list[OpenDevices] = []
    unreadable = 0
    for name in sorted(entries, key=int):
        fd_dir = PROC_ROOT / name / "fd"
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            unreadable += 1
            continue
        except OSError:  # exited meanwhile
            continue
        held: list[str] = []
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target in requested and requested[target] not in held:
                held.append(requested[target])
        if held:
            records.append(OpenDevices(int(name), tuple(held)))
    return records, unreadable


def holds_device(pid: int, pattern: str = DEFAULT_DEVICE_GLOB) -> bool:
    """True when ``pid`` has one of the files ``pattern`` matches open (``False`` if unreadable or gone)."""
    wanted = {os.path.realpath(f) for f in expand_device_glob(pattern)}
    fd_dir = PROC_ROOT / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd_dir / fd) in wanted:
                return True
        except OSError:
            continue
    return False


def read_process(pid: int) -> ProcessInfo | None:
    """The facts about ``pid`` now; ``None`` when it no longer exists.

    A field the kernel refuses is left ``None``; when even the start time is refused, ``error`` says
    ``"access denied"`` and the process cannot be signalled safely.
    """
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            try:
                create_time_s: float | None = proc.create_time()
            except psutil.AccessDenied:
                return ProcessInfo(pid=pid, create_time_s=None, error="access denied")
            status = _field(proc.status)
            cmdline = _field(proc.cmdline)
            return ProcessInfo(
                pid=pid,
                create_time_s=create_time_s,
                ppid=_field(proc.ppid),
                name=_field(proc.name),
                cmdline=tuple(cmdline) if cmdline is not None else None,
                uid=_real_uid(proc),
                user=_field(proc.username),
                status=status,
                sid=_sid(pid),
                nspid=read_nspid(pid),
                launch_env=read_launch_env(proc),
                threads=read_threads(pid) if status == psutil.STATUS_ZOMBIE else None,
            )
    except psutil.ZombieProcess:
        return ProcessInfo(
            pid=pid,
            create_time_s=None,
            status=psutil.STATUS_ZOMBIE,
            error="zombie",
            threads=read_threads(pid),
        )
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:
        return ProcessInfo(pid=pid, create_time_s=None, error="access denied")


def _field(getter: Callable[[], T]) -> T | None:
    """One psutil field, ``None`` when refused; a zombie still has its name, state and parent."""
    try:
        return getter()
    except psutil.ZombieProcess:
        return None
    except psutil.AccessDenied:
        return None


def _real_uid(proc: psutil.Process) -> int | None:
    uids = _field(proc.uids)
    return uids.real if uids is not None else None


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def lineage() -> tuple[int, ...]:
    """This process's pid followed by its ancestors' pids, nearest first."""
    me = psutil.Process(os.getpid())
    return (me.pid, *(p.pid for p in me.parents()))


def scan_holders(pattern: str = DEFAULT_DEVICE_GLOB, extra_pids: Iterable[int] = ()) -> HolderScan:
    """One scan: the device files ``pattern`` matches, who holds them, and the facts about holders, their
    parents, PID 1, and ``extra_pids`` (the pids NVML lists, to match them here). Raises
    ``UnavailableError`` when neither lsof nor ``/proc`` can be read."""
    device_files = expand_device_glob(pattern)
    open_devices, source, warnings = find_open_devices(device_files)
    processes: dict[int, ProcessInfo] = {}
    wanted = [o.pid for o in open_devices]
    for pid in [*wanted, 1, *extra_pids]:
        if pid in processes:
            continue
        info = read_process(pid)
        if info is None:
            continue
        processes[pid] = info
        if pid in wanted and info.ppid and info.ppid not in processes:
            parent = read_process(info.ppid)
            if parent is not None:
                processes[info.ppid] = parent
    return HolderScan(
        source=source,
        device_files=device_files,
        open_devices=tuple(open_devices),
        processes=processes,
        lineage=lineage(),
        my_uid=os.geteuid(),
        scan_time_s=time.time(),
        warnings=tuple(warnings),
    )
