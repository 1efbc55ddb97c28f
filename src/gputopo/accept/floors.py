"""The floors ``gputopo accept`` holds a GPU to, per GPU model, as data (pure).

The table is ``floors.json`` in this package: per model a name pattern (a regular expression on the
CUDA/NVML device name) and, for each number accept measures, the floor with the figure it comes from, its
source (a datasheet, a measured run) and how the floor is derived (``rules``: three quarters of a measured
figure, as DCGM sets its SKU floors; half of a datasheet figure; half of a link's one-way rate).
``--floors FILE`` replaces it (same shape). A model with no row, or a number with no floor, is judged on
relative terms only (against the node's other GPUs of its model), and the report says so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from gputopo.errors import InputError

SCHEMA = "gputopo/accept-floors/v1"
# The numbers a model's row may hold (matmul by precision, all-reduce by GPU count or "*").
PER_GPU_METRICS = ("matmul_tflops", "memory_gbps", "h2d_gbps", "d2h_gbps")
METRICS = (*PER_GPU_METRICS, "nvlink_pair_gbps", "allreduce_busbw_gbps")


@dataclass(frozen=True)
class Floor:
    """One floor: the least a healthy GPU measures (``floor``, in the metric's unit), the figure it is
    derived from (``basis``), its ``source`` and the rule that derived it (``derived``)."""

    floor: float
    basis: float | None
    source: str
    derived: str

    def to_json(self) -> dict[str, Any]:
        return {"floor": self.floor, "basis": self.basis, "source": self.source, "derived": self.derived}


@dataclass(frozen=True)
class ModelFloors:
    """One model's row: its name, the pattern on device names, and its floors by metric (matmul by
    precision, all-reduce by GPU count; other metrics under the key ``""``)."""

    model: str
    pattern: str
    floors: Mapping[str, Mapping[str, Floor]]

    def floor(self, metric: str, key: str = "") -> Floor | None:
        """The floor of ``metric`` (``key``: the precision of a matmul, the GPU count of an all-reduce,
        which falls back on ``*``); ``None`` when the row has none."""
        by_key = self.floors.get(metric) or {}
        return by_key.get(key) or by_key.get("*")


@dataclass(frozen=True)
class FloorTable:
    """The rows, where they came from (``source``: the package's file or ``--floors FILE``) and the
    derivation rules in words."""

    models: tuple[ModelFloors, ...]
    source: str
    rules: Mapping[str, str]

    def for_name(self, name: str | None) -> ModelFloors | None:
        """The row whose pattern matches the device ``name`` (first match), or ``None``."""
        if not name:
            return None
        return next((m for m in self.models if re.search(m.pattern, name, re.IGNORECASE)), None)


def _floor(doc: Any, where: str) -> Floor:
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where}: not an object with a floor")
    value = doc.get("floor")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{where}.floor: a positive number is needed, not {value!r}")
    basis = doc.get("basis")
    if basis is not None and (isinstance(basis, bool) or not isinstance(basis, (int, float))):
        raise ValueError(f"{where}.basis: a number or null, not {basis!r}")
    source, derived = doc.get("source"), doc.get("derived")
    if not isinstance(source, str) or not source:
        raise ValueError(f"{where}.source: every floor names its source")
    return Floor(float(value), None if basis is None else float(basis), source, str(derived or ""))


def parse(doc: Any, source: str) -> FloorTable:
    """The table in the parsed JSON ``doc``; ``ValueError`` naming the first bad entry."""
    if not isinstance(doc, Mapping) or doc.get("schema") != SCHEMA:
        raise ValueError(f"not a floors table (its schema must be {SCHEMA!r})")
    rows = doc.get("models")
    if not isinstance(rows, list):
        raise ValueError("'models' must be a list")
    models = []
    for i, row in enumerate(rows):
        where = f"models[{i}]"
        if not isinstance(row, Mapping) or not isinstance(row.get("model"), str):
            raise ValueError(f"{where}: an object with a 'model' name is needed")
        pattern = row.get("pattern")
        try:
            re.compile(str(pattern))
        except re.error as exc:
            raise ValueError(f"{where}.pattern: not a regular expression ({exc})") from None
        floors: dict[str, dict[str, Floor]] = {}
        for metric in METRICS:
            entry = row.get(metric)
            if entry is None:
                continue
            if metric in ("matmul_tflops", "allreduce_busbw_gbps"):
                if not isinstance(entry, Mapping):
                    raise ValueError(f"{where}.{metric}: an object by precision or GPU count")
                floors[metric] = {str(k): _floor(v, f"{where}.{metric}.{k}") for k, v in entry.items()}
            else:
                floors[metric] = {"": _floor(entry, f"{where}.{metric}")}
        unknown = sorted(set(row) - {*METRICS, "model", "pattern", "notes"})
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(METRICS)})")
        models.append(ModelFloors(row["model"], str(pattern), floors))
    rules = doc.get("rules") if isinstance(doc.get("rules"), Mapping) else {}
    return FloorTable(tuple(models), source, {str(k): str(v) for k, v in rules.items()})


def packaged() -> FloorTable:
    """The table shipped in the package (``floors.json``)."""
    text = resources.files("gputopo.accept").joinpath("floors.json").read_text(encoding="utf-8")
    return parse(json.loads(text), "gputopo's floors table (gputopo/accept/floors.json)")


def load(path: Path) -> FloorTable:
    """``--floors FILE``: the table in ``path``; ``InputError`` (exit 2, one line) when it cannot be read
    or is not one."""
    from gputopo.inputs import read_capped

    label = f"--floors {path}"
    hint = "give a file shaped like gputopo's own: gputopo accept --list-floors --json"
    text = read_capped(path, label, hint=hint)
    try:
        return parse(json.loads(text), str(path))
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        first = str(exc).splitlines()[0][:160]
        raise InputError(f"{label}: {first}", hint) from None


def table_json(table: FloorTable) -> dict[str, Any]:
    """The table as ``--list-floors --json`` prints it (the shape ``--floors`` reads)."""
    models = []
    for m in table.models:
        row: dict[str, Any] = {"model": m.model, "pattern": m.pattern}
        for metric, by_key in m.floors.items():
            if "" in by_key:
                row[metric] = by_key[""].to_json()
            else:
                row[metric] = {k: f.to_json() for k, f in by_key.items()}
        models.append(row)
    return {"schema": SCHEMA, "source": table.source, "rules": dict(table.rules), "models": models}
