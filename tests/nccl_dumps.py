"""Flight Recorder dumps in torch's NCCL format, for what gloo cannot record (point-to-point ops, real
start/completion states, ``split_group``'s groups that share a name, ``pg_status`` of a group whose
entries left the ring).

Built field by field after torch's writer, torch/csrc/distributed/c10d/FlightRecorderDetail.hpp (main,
the same keys as 2.14's):
- ``getCollectiveTrace``: every entry holds ``frames`` (when stacks are asked for), ``record_id``,
  ``pg_id``, ``process_group`` (name, desc), ``thread_name``, ``thread_id`` (text), ``collective_seq_id``,
  ``p2p_seq_id``, ``op_id``, ``profiling_name``, ``time_created_ns``, ``input_sizes``, ``input_dtypes``,
  ``output_sizes``, ``output_dtypes``, ``state`` (``completed`` when the end event was seen, ``started``
  when the start event was, else ``scheduled``), ``time_discovered_started_ns`` and
  ``time_discovered_completed_ns`` (null when not seen; 0 in JSON), ``retired``, ``timeout_ms``,
  ``is_p2p``;
- ``getPgConfig``: ``{name: {"name", "desc", "ranks": ranks_str(ranks)}}``, the ranks as text
  (``"[0, 1]"``), keyed by the group's name only (so a rank records its own group of a shared name);
- ``getPgStatus``: ``{str(pg_id): {"last_enqueued_collective", "last_started_collective",
  "last_completed_collective"}}`` (ints in the pickle, text in JSON: ``getPgStatusJson``);
- ``dump_dict``: ``version`` ("2.10"), ``pg_config``, ``comm_lib_version``, ``pg_status``, ``entries``;
  ``dump_json`` leaves ``entries`` out when there are none.
Point-to-point profiling names are ``nccl:send <src>-><dst>`` and ``nccl:recv <dst><-<src>`` in group
ranks, as torch's analyzer parses them (torch/distributed/flight_recorder/components/types.py, ``Op``).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

VERSION = "2.10"
T0 = 1_795_000_000_000_000_000


class Rank:
    """One rank's recorder: entries appended as torch records them."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.entries: list[dict[str, Any]] = []
        self.pg_config: dict[str, dict[str, str]] = {}
        self.pg_status: dict[str, dict[str, int]] = {}
        self.pg_ids: dict[tuple[str, tuple[int, ...]], int] = {}
        self.seq: dict[int, int] = {}
        self.p2p_seq: dict[int, int] = {}

    def group(self, name: str, desc: str, ranks: list[int]) -> int:
        """``record_pg_ranks``: the group's pg_config row; returns its pg id on this rank."""
        key = (name, tuple(ranks))
        if key not in self.pg_ids:
            self.pg_ids[key] = len(self.pg_ids)
        self.pg_config[name] = {"name": name, "desc": desc, "ranks": str(list(ranks))}
        return self.pg_ids[key]

    def _entry(
        self,
        pg_id: int,
        name: str,
        desc: str,
        profiling: str,
        ins: list[list[int]],
        outs: list[list[int]],
        state: str,
        is_p2p: bool,
        frames: list[dict[str, Any]] | None,
        dtype: str = "Float",
    ) -> dict[str, Any]:
        if is_p2p:
            self.p2p_seq[pg_id] = self.p2p_seq.get(pg_id, 0) + 1
        else:
            self.seq[pg_id] = self.seq.get(pg_id, 0) + 1
        now = T0 + len(self.entries) * 1000
        e = {
            "frames": frames or [{"name": "train_step", "filename": "/job/train.py", "line": 10}],
            "record_id": len(self.entries),
            "pg_id": pg_id,
            "process_group": (name, desc),
            "thread_name": "pt_main_thread",
            "thread_id": "140000000000000",
            "collective_seq_id": self.seq.get(pg_id, 0),
            "p2p_seq_id": self.p2p_seq.get(pg_id, 0),
            "op_id": len(self.entries) + 1,
            "profiling_name": profiling,
            "time_created_ns": now,
            "input_sizes": ins,
            "input_dtypes": [dtype] * len(ins),
            "output_sizes": outs,
            "output_dtypes": [dtype] * len(outs),
            "state": state,
            "time_discovered_started_ns": now + 10 if state in ("started", "completed") else None,
            "time_discovered_completed_ns": now + 20 if state == "completed" else None,
            "retired": state == "completed",
            "timeout_ms": 600000,
            "is_p2p": is_p2p,
        }
        self.entries.append(e)
        status = self.pg_status.setdefault(
            str(pg_id),
            {"last_enqueued_collective": -1, "last_started_collective": -1, "last_completed_collective": -1},
        )
        if not is_p2p:
            seq = self.seq[pg_id]
            status["last_enqueued_collective"] = seq
            if state in ("started", "completed"):
                status["last_started_collective"] = seq
            if state == "completed":
                status["last_completed_collective"] = seq
        return e

    def collective(
        self,
        name: str,
        desc: str,
        ranks: list[int],
        op: str,
        ins: list[list[int]],
        outs: list[list[int]] | None = None,
        state: str = "completed",
        frames: list[dict[str, Any]] | None = None,
        dtype: str = "Float",
    ) -> dict[str, Any]:
        pg = self.group(name, desc, ranks)
        return self._entry(
            pg, name, desc, f"nccl:{op}", ins, ins if outs is None else outs, state, False, frames, dtype
        )

    def send(
        self, name: str, desc: str, ranks: list[int], dst: int, size: list[int], state: str
    ) -> dict[str, Any]:
        """A send to group rank ``dst`` (this rank's group rank is its index in the sorted ranks)."""
        pg = self.group(name, desc, ranks)
        me = sorted(ranks).index(self.rank)
        return self._entry(pg, name, desc, f"nccl:send {me}->{dst}", [size], [size], state, True, None)

    def recv(
        self, name: str, desc: str, ranks: list[int], src: int, size: list[int], state: str
    ) -> dict[str, Any]:
        pg = self.group(name, desc, ranks)
        me = sorted(ranks).index(self.rank)
        return self._entry(pg, name, desc, f"nccl:recv {me}<-{src}", [size], [size], state, True, None)

    def dump(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "pg_config": self.pg_config,
            "comm_lib_version": "2.27.5",
            "pg_status": self.pg_status,
            "entries": self.entries,
        }


def write(ranks: list[Rank], folder: Path, fmt: str = "pickle", prefix: str = "nccl_trace_rank_") -> Path:
    """Each rank's dump as torch writes it: a pickle of plain containers, or JSON (``dump_json``: the
    pg_status numbers as text, no stacks, and no ``entries`` when there are none)."""
    folder.mkdir(parents=True, exist_ok=True)
    for r in ranks:
        doc = r.dump()
        if fmt == "pickle":
            (folder / f"{prefix}{r.rank}").write_bytes(pickle.dumps(doc))
            continue
        doc = json.loads(json.dumps(doc))
        doc["pg_status"] = {k: {n: str(v) for n, v in st.items()} for k, st in doc["pg_status"].items()}
        for e in doc["entries"]:
            e.pop("frames", None)
            for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
                e[k] = e[k] or 0
        if not doc["entries"]:
            del doc["entries"]
        (folder / f"{prefix}{r.rank}.json").write_text(json.dumps(doc))
    return folder
