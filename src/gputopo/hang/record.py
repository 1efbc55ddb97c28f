"""The run record (``gputopo/run-record/v1``): what a launch knew about each node, so that a rank in a
Flight Recorder dump maps to a host, a local rank, a physical GPU and a PID.

``gputopo run`` writes one record per node into the run's folder, beside the dumps (a later change; the
shape is defined here). A record is a JSON object; keys marked * must be there, the rest may be null or
missing::

    {
      "schema": "gputopo/run-record/v1",                     *
      "host": "node-a",                                      *  socket.gethostname() on that node
      "node_rank": 0,                                           torchrun --node-rank (null: elastic, unknown)
      "nnodes": 2,
      "ranks_per_node": 4,                                      torchrun --nproc-per-node
      "world_size": 8,
      "rank_base": 0,                                           the node's first global rank, when known
      "cuda_visible_devices": ["GPU-8f6...", ...],              as UUIDs, in local-rank order
      "gpus": [{"local_rank": 0, "index": 5, "uuid": "GPU-8f6...", "pci_bus_id": "00000000:3B:00.0"}],
      "ranks": [{"rank": 0, "local_rank": 0, "pid": 4242}],    written when known (after the ranks start)
      "versions": {"nccl": "2.27.5", "torch": "2.14.1", "driver": "580.65.06", "cuda": "13.0"},
      "env": {"NCCL_DEBUG": "WARN", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"},  NCCL_*, TORCH_NCCL_*, TORCH_FR_*
      "flight_recorder": {"buffer_size": 2000, "dump_prefix": "reports/run-.../fr/rank_trace",
                          "dump_on_timeout": true, "set_by": "gputopo" | "user"},
      "created": "2026-11-25T18:00:00Z"
    }

A rank's global number comes from ``ranks`` when present; otherwise it is assumed to be
``rank_base + local_rank`` (``rank_base`` defaulting to ``node_rank * ranks_per_node``, torchrun's
assignment with a static rendezvous) and the assumption is said. Records are found beside the dumps
(``run-record*.json``, ``gputopo-run-record*.json``) or given with ``--run-record``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputopo.errors import InputError
from gputopo.findings import Finding
from gputopo.hang.files import read_named

SCHEMA = "gputopo/run-record/v1"
RECORD_GLOBS = ("run-record*.json", "gputopo-run-record*.json")
MAX_RECORD_BYTES = 16 * 1024 * 1024
_HINT = "a run record is the JSON `gputopo run` writes beside the dumps (schema gputopo/run-record/v1)"


@dataclass(frozen=True)
class Placement:
    """Where one global rank ran; ``None`` for what no record says."""

    rank: int
    host: str | None
    node_rank: int | None
    local_rank: int | None
    gpu_index: int | None
    gpu_uuid: str | None
    pid: int | None
    source: str  # "run-record" | "dump"
    started: float | None = None  # the rank process's start time (psutil's create_time), when recorded


@dataclass(frozen=True)
class RunRecord:
    """One node's record, checked."""

    path: Path
    host: str
    node_rank: int | None
    ranks_per_node: int | None
    world_size: int | None
    rank_base: int | None
    gpus: tuple[dict[str, Any], ...]
    ranks: tuple[dict[str, Any], ...]
    versions: dict[str, Any]
    env: dict[str, str]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The node as drift names it: its host (and node rank, when known)."""
        return self.host if self.node_rank is None else f"{self.host} (node {self.node_rank})"

    def facts(self) -> dict[str, Any]:
        """This node's facts for drift (``gputopo.health.drift``): the record's ``config`` as ``gputopo run``
        wrote it, else what its ``versions`` and ``env`` say."""
        if self.config:
            return dict(self.config)
        return {**{k: self.versions.get(k) for k in ("nccl", "torch", "driver", "cuda")}, "env": self.env}


def find_records(folders: Iterable[Path]) -> list[Path]:
    """The run records in ``folders`` (not searched recursively), in name order."""
    found: list[Path] = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for pattern in RECORD_GLOBS:
            for p in sorted(folder.glob(pattern)):
                if p.is_file() and p not in found:
                    found.append(p)
    return found


def read_record(path: Path) -> RunRecord:
    """One run record; anything unreadable or off-schema is an ``InputError`` naming the file."""
    label = f"run record {path}"
    raw = read_named(
        path, label, MAX_RECORD_BYTES, f"{MAX_RECORD_BYTES // 2**20} MiB, not a run record", _HINT
    )
    try:
        doc = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{label}: not JSON ({exc})", _HINT) from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise InputError(f"{label}: schema is {got!r}, expected {SCHEMA!r}", _HINT)
    host = doc.get("host")
    if not isinstance(host, str) or not host:
        raise InputError(f"{label}: no host", _HINT)
    gpus = doc.get("gpus") or []
    ranks = doc.get("ranks") or []
    if not isinstance(gpus, list) or not all(isinstance(g, dict) for g in gpus):
        raise InputError(f"{label}: 'gpus' is not a list of objects", _HINT)
    if not isinstance(ranks, list) or not all(
        isinstance(r, dict) and _int(r.get("rank")) is not None for r in ranks
    ):
        raise InputError(f"{label}: 'ranks' is not a list of objects with a 'rank'", _HINT)
    env = doc.get("env") or {}
    return RunRecord(
        path=path,
        host=host,
        node_rank=_int(doc.get("node_rank")),
        ranks_per_node=_int(doc.get("ranks_per_node")),
        world_size=_int(doc.get("world_size")),
        rank_base=_int(doc.get("rank_base")),
        gpus=tuple(gpus),
        ranks=tuple(ranks),
        versions=doc.get("versions") if isinstance(doc.get("versions"), dict) else {},
        env={str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
        config=doc.get("config") if isinstance(doc.get("config"), dict) else {},
    )


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def place_ranks(records: list[RunRecord]) -> tuple[dict[int, Placement], list[str]]:
    """Global rank -> placement from the records, and each assumption made (in words)."""
    placed: dict[int, Placement] = {}
    assumed: list[str] = []
    for rec in records:
        gpu_by_local = {_int(g.get("local_rank")): g for g in rec.gpus}
        rows: list[tuple[int, int | None, int | None, float | None]] = []  # (rank, local_rank, pid, started)
        if rec.ranks:
            rows = [
                (r["rank"], _int(r.get("local_rank")), _int(r.get("pid")), _float(r.get("started")))
                for r in rec.ranks
            ]
            # ranks `gputopo run` had not found yet (a job that ended within its first look): by layout
            n = rec.ranks_per_node or len(rec.gpus)
            base = rec.rank_base
            if base is not None and n:
                have = {lr for _, lr, _, _ in rows}
                rows += [(base + lr, lr, None, None) for lr in range(n) if lr not in have]
        else:
            n = rec.ranks_per_node or len(rec.gpus)
            base = rec.rank_base
            if base is None and rec.node_rank is not None and n:
                base = rec.node_rank * n
                assumed.append(
                    f"{rec.host}: global rank = node_rank {rec.node_rank} x {n} ranks per node + local rank "
                    "(torchrun's order with a static rendezvous)"
                )
            if base is None or not n:
                assumed.append(f"{rec.host}: the record says neither its ranks nor its node rank; not placed")
                continue
            rows = [(base + lr, lr, None, None) for lr in range(n)]
            assumed.append(f"{rec.host}: no PIDs in the record")
        for rank, local, pid, started in rows:
            gpu = gpu_by_local.get(local) if local is not None else None
            if rank in placed and placed[rank].host != rec.host:
                raise InputError(
                    f"run records {rec.path.name} and another both place rank {rank} "
                    f"({placed[rank].host} and {rec.host})",
                    "give the records of one job only",
                )
            placed[rank] = Placement(
                rank=rank,
                host=rec.host,
                node_rank=rec.node_rank,
                local_rank=local,
                gpu_index=_int(gpu.get("index")) if gpu else None,
                gpu_uuid=gpu.get("uuid") if gpu and isinstance(gpu.get("uuid"), str) else None,
                pid=pid,
                source="run-record",
                started=started,
            )
    return placed, assumed


def version_drift(records: list[RunRecord]) -> list[str]:
    """Versions that differ between the nodes' records, as "name: value on hosts; ..." lines (one
    node's other NCCL is a known cause of hangs, nccl#1634)."""
    out: list[str] = []
    names = sorted({k for r in records for k in r.versions})
    for name in names:
        by_value: dict[str, list[str]] = {}
        for r in records:
            by_value.setdefault(str(r.versions.get(name)), []).append(r.host)
        if len(by_value) > 1:
            out.append(
                f"{name} differs between nodes: "
                + "; ".join(f"{v} on {', '.join(h)}" for v, h in by_value.items())
            )
    return out


def config_drift(records: list[RunRecord]) -> list[Finding]:
    """What differs between the nodes' records (versions, net plugin, GPU model and count, VBIOS, NCCL
    variables), as findings: a different GPU count, NCCL version or net plugin is a problem (one node's
    other NCCL or plugin is a known cause of hangs, nccl#1634), the rest notes."""
    from gputopo.health.drift import compare, findings

    by_node: dict[str, dict[str, Any]] = {}
    for r in records:
        label = r.label if r.label not in by_node else f"{r.label} [{r.path.name}]"
        by_node[label] = r.facts()
    return findings(compare(by_node))


def world_size(records: list[RunRecord]) -> int | None:
    """The largest world size any record states."""
    sizes = [r.world_size for r in records if r.world_size]
    return max(sizes) if sizes else None
