"""``gputopo accept``'s verdict as the check state file keeps it, and whether it still holds (pure).

The verdict is kept under the state document's own top-level section ``accept`` (``health.state``'s
document; ``system.state_file.update_section`` writes it under the state's lock, and every other writer
carries it through untouched), with what it was given for: the driver version and each GPU's UUID, board
serial, VBIOS and model. A later GPU swap, a GPU gone or added, a VBIOS flash or a driver upgrade makes it
stale: ``check --json``, ``topo --json`` (the node's facts) and ``nodes`` then say "not accepted since
the driver changed".

GPUs are told apart by their NVML UUID (unique per GPU, and what every other gputopo record keys on) and
their board serial (``nvidia-smi -q``'s Serial Number, where NVML answers it).
"""

from __future__ import annotations

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


def from_section(value: Any) -> dict[str, Any] | None:
    """The record in the state's ``accept`` section as stored (``None``: absent, or not a record this
    gputopo knows: a newer or foreign shape is never judged)."""
    return value if isinstance(value, dict) and value.get("schema") == SCHEMA else None


def from_doc(doc: Any) -> dict[str, Any] | None:
    """The record in a state document (``health.state.StateDoc``, read by ``system.state_file.read_state``;
    ``None``: no document). A document written by a newer gputopo is not interpreted."""
    if doc is None or getattr(doc, "newer", False):
        return None
    return from_section(doc.section(KEY))


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
