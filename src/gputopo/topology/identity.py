"""Which machine a report was written on, and whether it is the machine a command looks at now.

Every report (probe and doctor JSON) carries a ``machine`` record: the host name, what the checks ran
on (``device``: ``cuda`` or ``cpu`` stand-ins), where the GPUs came from (``source``: ``nvml`` for a
live machine, ``sample:NAME`` or the ``--input`` file for a simulated one) and each GPU's index and
UUID (NVML's, when known). ``--from-report`` reads that record back: GPU indices in a report mean
something only on the machine whose GPUs they numbered, so a report from another machine, or from CPU
stand-ins (whose timings and pairs say nothing about GPU links), is refused for a live machine.

Pure: the caller reads the host name (``platform.node()``) and the topology.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from gputopo.model import Topology

LIVE_SOURCE = "nvml"
SAMPLE_PREFIX = "sample:"


def machine_record(
    hostname: str | None,
    device: str | None,
    source: str | None,
    gpu_uuids: Mapping[int, str | None] | None = None,
) -> dict[str, Any]:
    """The ``machine`` record a report carries (``source`` ``None``: this machine, not read through NVML,
    as CPU stand-ins run without one)."""
    gpus = [{"index": i, "uuid": u} for i, u in sorted((gpu_uuids or {}).items())]
    return {"hostname": hostname, "device": device, "source": source, "gpus": gpus}


def topology_record(topo: Topology, hostname: str | None, device: str | None, live: bool) -> dict[str, Any]:
    """The record of a topology: live (read through NVML now: ``source`` ``nvml``, its GPUs' UUIDs) or
    simulated (its source: the sample or the file)."""
    source = LIVE_SOURCE if live else topo.source
    return machine_record(hostname, device, source, {g.index: g.uuid for g in topo.gpus})


def _name(source: str | None) -> str | None:
    """A simulated machine's name: ``sample:NAME`` as is, a file by its base name (paths differ)."""
    if not source or source == LIVE_SOURCE:
        return None
    return source if source.startswith(SAMPLE_PREFIX) else PurePath(source).name


def _uuids(record: Mapping[str, Any]) -> dict[int, str]:
    gpus = record.get("gpus")
    out: dict[int, str] = {}
    for g in gpus if isinstance(gpus, list) else []:
        if isinstance(g, Mapping) and isinstance(g.get("index"), int) and isinstance(g.get("uuid"), str):
            out[int(g["index"])] = str(g["uuid"])
    return out


def _where(record: Mapping[str, Any]) -> str:
    host = record.get("hostname")
    source = record.get("source")
    if source and source != LIVE_SOURCE:
        return f"{source}" + (f" on host {host}" if host else "")
    return f"host {host}" if host else "an unnamed host"


def report_mismatch(
    report: Mapping[str, Any] | None, report_device: str | None, here: Topology, live: bool
) -> str | None:
    """Why a report must not be applied to ``here`` (``None``: it may), in words for one line.

    ``live``: ``here`` is this machine, read through NVML now (not ``--input``: a saved snapshot keeps
    its ``live`` flag, but it is a file). On a live machine: the report must have run on its GPUs
    (``device`` ``cuda``, not CPU stand-ins) and, GPU by GPU, on the same UUIDs; a report that records
    no machine or no UUIDs is refused, since nothing says its indices mean these GPUs. On a simulated
    machine (a sample or a file) only a report that names another machine is refused: a sample's report
    under another sample's name, or a live machine's UUIDs that differ from those in the input.
    """
    record = report if isinstance(report, Mapping) else None
    device = (record or {}).get("device") or report_device
    if live:
        if device != "cuda":
            what = "CPU stand-ins" if device == "cpu" else f"device {device!r}"
            return f"it ran on {what}, not on this machine's GPUs"
        if record is None:
            return "it records no machine (written by an older gputopo), so its GPU numbers may not be these"
        if record.get("source") not in (None, LIVE_SOURCE):
            return f"it was written for {_where(record)}, not for this machine"
        theirs = _uuids(record)
        if not theirs:
            return f"it records no GPU UUIDs ({_where(record)}), so its GPU numbers may not be these"
        mine = {g.index: g.uuid for g in here.gpus}
        for index, uuid in sorted(theirs.items()):
            if mine.get(index) != uuid:
                now = mine.get(index) or "absent"
                return f"it was written on {_where(record)}: its GPU{index} is {uuid}, here it is {now}"
        return None
    if record is None:
        return None
    theirs_name, mine_name = _name(record.get("source")), _name(here.source)
    if theirs_name and mine_name and theirs_name != mine_name:
        return f"it was written for {theirs_name}, not for {here.source}"
    theirs = _uuids(record)
    mine = {g.index: g.uuid for g in here.gpus if g.uuid}
    clash = sorted(i for i in theirs.keys() & mine.keys() if theirs[i] != mine[i])
    if clash:
        i = clash[0]
        return f"it was written on {_where(record)}: its GPU{i} is {theirs[i]}, in {here.source} {mine[i]}"
    return None
