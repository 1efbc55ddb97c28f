"""Matching NVML's pids to this PID namespace's (pure).

NVML does not always report the pids a process here has: older drivers report host pids even inside a
container (NVIDIA/nvidia-docker#1483: "the nvidia-driver itself does not support pid-namespaces"), while
newer ones translate them into the caller's namespace (``_gpuConvertPid`` in NVIDIA's open kernel
modules). And this tool's ``/proc`` may be mounted from another namespace than the one NVML translates to.
So nothing is assumed; the evidence decides:

- a process here has its pid in every namespace it belongs to, outermost first (``NSpid`` in
  ``/proc/PID/status``); level 0 is the pid this tool uses;
- at one level, a pid NVML lists *matches* when exactly one process here has that pid at that level, it
  holds a GPU device file (every process with a GPU context does), and its name agrees with NVML's
  (``nvmlSystemGetProcessName`` against its name and ``argv[0]``);
- NVML's pids are usable at a level only when **most** of the pids it lists match there, never from one
  match: in a container, one host pid that happens to equal a local one must not switch the rule on.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gputopo.procs.holders import ProcessInfo

_KERNEL_NAME_LEN = 15


@dataclass(frozen=True)
class PidMapping:
    """The verdict: ``mapping`` (NVML pid -> local pid) when NVML's pids are usable, else ``None``.

    ``level`` is the ``NSpid`` level NVML's pids were found at (0: this namespace's own pids).
    ``sees_pid_namespace`` is True at level 0, False when they were judged and found foreign, ``None`` when
    it could not be judged. ``note`` says how it was decided.
    """

    mapping: dict[int, int] | None
    level: int | None
    sees_pid_namespace: bool | None
    note: str


def names_agree(nvml_name: str | None, info: ProcessInfo) -> bool:
    """True when NVML's name for a pid is the process's name or ``argv[0]`` (compared by file name; the
    kernel cuts a name to 15 characters)."""
    if not nvml_name:
        return False
    wanted = os.path.basename(nvml_name.split()[0]) if nvml_name.split() else ""
    for own in info.identities:
        if own == wanted or (len(own) == _KERNEL_NAME_LEN and wanted[:_KERNEL_NAME_LEN] == own):
            return True
    return False


def match_pids(
    nvml_pids: Iterable[int],
    names: Mapping[int, str | None],
    local: Mapping[int, ProcessInfo],
    gpu_holders: frozenset[int],
) -> PidMapping:
    """Decide whether, and at which ``NSpid`` level, NVML's pids name processes here.

    ``local`` are the processes read here (at least the device holders and any local process at a pid NVML
    lists), keyed by local pid; ``gpu_holders`` the local pids known to hold a GPU device file.
    """
    pids = sorted(set(nvml_pids))
    if not pids:
        return PidMapping(None, None, None, "NVML lists no process, so its pids cannot be matched")
    levels = max((len(p.nspid) for p in local.values() if p.nspid), default=1)
    best: tuple[int, dict[int, int]] = (-1, {})
    for level in range(levels):
        index: dict[int, list[int]] = {}
        for pid, info in local.items():
            at = (
                pid if level == 0 else (info.nspid[level] if info.nspid and len(info.nspid) > level else None)
            )
            if at is not None:
                index.setdefault(at, []).append(pid)
        mapping: dict[int, int] = {}
        for p in pids:
            candidates = index.get(p, [])
            if len(candidates) != 1:
                continue
            here = candidates[0]
            if here in gpu_holders and names_agree(names.get(p), local[here]):
                mapping[p] = here
        if 2 * len(mapping) > len(pids):
            if level == 0:
                note = (
                    f"{len(mapping)} of the {len(pids)} pids NVML lists are GPU holders here with its names"
                )
            else:
                note = (
                    f"{len(mapping)} of the {len(pids)} pids NVML lists match GPU holders here through "
                    f"NSpid level {level} (NVML reports another PID namespace's pids)"
                )
            return PidMapping(mapping, level, level == 0, note)
        if len(mapping) > len(best[1]):
            best = (level, mapping)
    matched = len(best[1])
    if not any(names.get(p) for p in pids) and not matched:
        return PidMapping(
            None, None, None, "NVML gives no names for the pids it lists, so they cannot be matched here"
        )
    return PidMapping(
        None,
        None,
        False,
        f"only {matched} of the {len(pids)} pids NVML lists match a GPU holder here with its name: NVML "
        "reports another PID namespace's pids (a container?)",
    )


def _at_level(info: ProcessInfo, level: int) -> int | None:
    if info.nspid is None or len(info.nspid) <= level:
        return None
    return info.nspid[level]
