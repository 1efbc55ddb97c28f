"""``gputopo accept``'s verdict as the check state file keeps it, and whether it still holds (pure).

The verdict is kept under the state document's own top-level key ``accept`` (``check``'s keys are not
touched), with what it was given for: the driver version and each GPU's UUID, board serial, VBIOS and
model. A later
GPU swap, a GPU gone or added, a VBIOS flash or a driver upgrade makes it stale: ``check --json``,
``topo --json`` (the node's facts) and ``nodes`` then say "not accepted since the driver changed".

GPUs are told apart by their NVML UUID (unique per GPU, and what every other gputopo record keys on) and
their board serial (``nvidia-smi -q``'s Serial Number, where NVML answers it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

KEY = "accept"  # the state document's top-level key
SCHEMA = "gputopo/accept-record/v1"


def utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make(
    *, at: float, verdict: str, reason: str, driver: str | None, gpus: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The record: when, the verdict and its reason, and the driver and GPUs (index, UUID, VBIOS, name)
    it was given for."""
    return {
        "schema": SCHEMA,
        "at": at,
        "at_utc": utc(at),
        "verdict": verdict,
        "reason": reason,
        "driver": driver,
        "gpus": [
            {
                "index": g.get("index"),
                "uuid": g.get("uuid"),
                "serial": g.get("serial"),
                "vbios": g.get("vbios"),
                "name": g.get("name"),
            }
            for g in gpus
        ],
    }


def from_state_text(text: str | None) -> dict[str, Any] | None:
    """The ``accept`` record in a state file's text, or ``None`` (no file, not JSON, no record)."""
    if not text:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    rec = doc.get(KEY) if isinstance(doc, dict) else None
    return rec if isinstance(rec, dict) and rec.get("schema") == SCHEMA else None


def with_record(text: str | None, record: Mapping[str, Any]) -> str:
    """The state file's text with ``record`` under ``accept`` (the rest kept as it is; a file that is not
    a JSON object becomes one holding the record alone)."""
    doc: Any = None
    if text:
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
    if not isinstance(doc, dict):
        doc = {}
    doc[KEY] = dict(record)
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def carried(old_text: str | None, new_text: str) -> str:
    """``new_text`` (a state written by ``check``) with the ``accept`` record of ``old_text`` carried over,
    so a check never drops accept's verdict."""
    rec = from_state_text(old_text)
    return new_text if rec is None else with_record(new_text, rec)


def changes(record: Mapping[str, Any], driver: str | None, gpus: Sequence[Mapping[str, Any]]) -> list[str]:
    """What changed since the record was made, in words (empty: nothing). ``gpus`` are the GPUs now
    (``index``, ``uuid``, ``vbios``); a value not read now (``None``) is not counted as a change."""
    out = []
    if driver is not None and record.get("driver") not in (None, driver):
        out.append(f"the driver changed ({record.get('driver')} -> {driver})")
    then = {g.get("uuid"): g for g in record.get("gpus") or [] if isinstance(g, dict) and g.get("uuid")}
    now = {g.get("uuid"): g for g in gpus if g.get("uuid")}
    if now:
        gone = sorted(set(then) - set(now))
        new = sorted(set(now) - set(then))
        if gone or new:
            idx = sorted({str(g.get("index")) for g in [*(then[u] for u in gone), *(now[u] for u in new)]})
            out.append(f"a GPU was swapped, removed or added (GPU{', GPU'.join(idx)})")
        flashed = [
            f"GPU{now[u].get('index')} ({then[u].get('vbios')} -> {now[u].get('vbios')})"
            for u in sorted(set(then) & set(now))
            if now[u].get("vbios") is not None and then[u].get("vbios") not in (None, now[u].get("vbios"))
        ]
        if flashed:
            out.append(f"the VBIOS changed on {', '.join(flashed)}")
        reserialed = [
            f"GPU{now[u].get('index')} (serial {then[u].get('serial')} -> {now[u].get('serial')})"
            for u in sorted(set(then) & set(now))
            if now[u].get("serial") is not None and then[u].get("serial") not in (None, now[u].get("serial"))
        ]
        if reserialed:
            out.append(f"a GPU was swapped ({', '.join(reserialed)})")
    return out


def status(
    record: Mapping[str, Any] | None, driver: str | None, gpus: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any] | None:
    """The ``accept`` object ``check --json``, ``topo --json`` and ``nodes`` carry: the stored verdict and
    whether it still holds for this node as read now (``gpus`` ``None``: not read, so not judged stale).
    ``None`` when no verdict was ever stored."""
    if record is None:
        return None
    verdict = str(record.get("verdict"))
    at = record.get("at_utc") or "?"
    changed = changes(record, driver, gpus or ()) if gpus is not None or driver is not None else []
    if changed:
        words = f"not {verdict} since {'; '.join(changed)} ({verdict} at {at})"
        if verdict == "accepted":
            words = f"not accepted since {'; '.join(changed)} (accepted at {at})"
        return {
            "verdict": verdict,
            "at": record.get("at"),
            "at_utc": at,
            "stale": True,
            "changes": changed,
            "words": words,
            "reason": record.get("reason"),
        }
    return {
        "verdict": verdict,
        "at": record.get("at"),
        "at_utc": at,
        "stale": False,
        "changes": [],
        "words": f"{verdict} at {at}",
        "reason": record.get("reason"),
    }
