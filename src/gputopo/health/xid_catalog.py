"""NVIDIA's Xid catalogue as data (pure): every code 1-172, and the NVLink5 Xids 144-150 decoded from their
registers.

The facts are in ``xid_catalog.json`` beside this module, transcribed from NVIDIA's "Analyzing Xid Errors with
the Xid Catalog" (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, read 2026-11-28): for each
code its mnemonic, description and the two resolution buckets ("immediate": what recovers the machine;
"investigatory": what finds the cause), and the "XID 144-150 Decode" sheet. gputopo's own severity and
action for each code live in ``health.xid.XID_TABLE``; the file repeats them and a test keeps both equal.

An NVLink5 Xid line reads ``149, NETIR_LINK_EVT Fatal XC0 i0 Link 09 (0x025525c6 0x00000000 ...)``: the
first register (IntrInfo) names the unit, the second (errorStatus) the error. The unit's field moved at
driver R575 (the sheet's V1 and V2): before, IntrInfo[9:0] (subcode [9:5] and the Xid's family [4:0]);
from R575, IntrInfo[6:0]. IntrInfo[25:20] is NETIR_LINK_EVT's link-down reason, the field that tells a
peer's fault (``INVESTIGATE_PEER_DEVICE``) from this GPU's own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
NVLINK5_XIDS = range(144, 151)
R575 = 575
V1, V2 = "before R575", "R575 or later"
# The sheet's immediate buckets of an NVLink5 line, most urgent first: a line whose errorStatus sets
# several bits takes the most urgent of their rows.
_URGENCY = ("RESET_GPU", "XID_154_EVAL", "IGNORE")


@dataclass(frozen=True)
class CatalogEntry:
    """One code of the catalogue: ``immediate`` and ``investigatory`` are ``None`` where the catalogue
    gives no bucket (``note`` says so); ``text`` is gputopo's summary of the catalogue's words for it."""

    xid: int
    mnemonic: str
    description: str
    immediate: str | None
    investigatory: str | None
    since: str = ""
    note: str = ""
    text: str = ""

    @property
    def unused(self) -> bool:
        """The catalogue lists the code as unused on Ampere and newer (Volta or older, or retired)."""
        return self.description.startswith("Unused")


@cache
def _doc() -> dict[str, Any]:
    data = resources.files("gputopo.health").joinpath("xid_catalog.json").read_text(encoding="utf-8")
    doc: dict[str, Any] = json.loads(data)
    return doc


@cache
def catalog() -> dict[int, CatalogEntry]:
    """Every code of the catalogue, 1 to 172."""
    return {
        e["xid"]: CatalogEntry(
            e["xid"],
            e["mnemonic"],
            e["description"],
            e["immediate"],
            e["investigatory"],
            e.get("since", ""),
            e.get("note", ""),
            e.get("catalogue_text", ""),
        )
        for e in _doc()["xids"]
    }


def bucket_words(bucket: str | None) -> str:
    """What a resolution bucket asks for, in gputopo's words (the catalogue's "Fault Resolution Buckets")."""
    if bucket is None:
        return "the catalogue gives no resolution"
    words: str = _doc()["buckets"].get(bucket, "see the catalogue")
    return words


def gputopo_rows() -> dict[int, dict[str, str]]:
    """gputopo's severity, action and kind for each code as the data file records them."""
    return {e["xid"]: e["gputopo"] for e in _doc()["xids"] if "gputopo" in e}


@dataclass(frozen=True)
class Nvl5Decode:
    """An NVLink5 Xid line (144-150) read with the decode sheet. ``decoded`` False: the registers match no
    row of the sheet (``why`` says how), and only ``raw`` is kept. Otherwise ``unit`` (the sheet's subcode
    name), ``subcode`` (the unit field's value), ``reason`` (IntrInfo[25:20], for the NETIR rows keyed on
    it), ``version`` (the sheet's V1 or V2 layout used), ``severity`` (the sheet's: Fatal, Link Fatal,
    Non-fatal), ``immediate`` and ``investigatory`` (its buckets), ``link`` and ``logged`` (the line's own
    link number and Fatal/Nonfatal word)."""

    xid: int
    raw: str
    decoded: bool
    why: str = ""
    unit: str = ""
    subcode: int | None = None
    reason: str = ""
    version: str = ""
    severity: str = ""
    immediate: str = ""
    investigatory: str = ""
    origin: str = ""
    link: int | None = None
    logged: str = ""
    intr_info: int | None = None
    error_status: int | None = None

    def words(self) -> str:
        """One line: what the sheet says of it, or "not decoded" and why."""
        if not self.decoded:
            return f"not decoded ({self.why})"
        link = f" on link {self.link}" if self.link is not None else ""
        reason = f", link-down reason {self.reason}" if self.reason else ""
        return (
            f"{self.unit}{link}, {self.severity} ({self.origin}), subcode {self.subcode}{reason} "
            f"(driver {self.version}): {self.immediate}; investigate: {self.investigatory}"
        )


# The line's unit, Fatal/Nonfatal word, link and registers; a line cut before its closing parenthesis (as
# pasted in NVIDIA/NVSentinel #1357) still reads.
_LINE = re.compile(
    r"^(?P<unit>[A-Za-z0-9_/ ]+?)\s+(?P<logged>Fatal|Nonfatal|Non-fatal)\b.*?"
    r"(?:Link\s+(?P<link>-?\d+))?\s*\((?P<regs>0x[0-9a-fA-F]+(?:[\s,]+0x[0-9a-fA-F]+)*)\s*\)?"
)


def driver_major(version: str | None) -> int | None:
    """``575.57.08`` -> 575; ``None`` for a version that is not one."""
    m = re.match(r"\s*(\d+)", version or "")
    return int(m.group(1)) if m else None


def _rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = _doc()["decode"]["rows"]
    return rows


def _match(xid: int, intr: int, status: int, version: str) -> tuple[list[dict[str, Any]], bool, str]:
    """The sheet's rows a line matches in one layout: (rows, promoted, why none)."""
    key, width, promote_bit = ("v1", 10, 10) if version == V1 else ("v2", 7, 7)
    unit = intr & ((1 << width) - 1)
    reason = (intr >> 20) & 0x3F
    units = [r for r in _rows() if int(r[key], 2) == unit and int(r["reason"], 2) in (reason, 0)]
    units = [r for r in units if r["xid"] == xid]
    if not units:
        return [], False, f"IntrInfo unit field {unit:#x} is no Xid {xid} unit of the sheet"
    if any("status_bit" not in r and "status_value" not in r for r in units):
        hit = [r for r in units if int(r["reason"], 2) == reason]
        if not hit:
            return [], False, f"link-down reason {reason:06b} is not in the sheet"
        return hit, False, ""
    if reason:
        return [], False, f"IntrInfo[25:20] is {reason:06b}, not 000000 for {units[0]['unit']}"
    promoted = bool(intr >> promote_bit & 1)
    exact = [r for r in units if "status_value" in r and int(r["status_value"], 16) == status]
    if exact:
        return exact, promoted, ""
    bits = [r for r in units if "status_bit" in r]
    if not bits:
        return [], False, f"errorStatus {status:#010x} is not a value the sheet lists for {units[0]['unit']}"
    hit = [r for r in bits if status & int(r["status_bit"], 16)]
    known = 0
    for r in bits:
        known |= int(r["status_bit"], 16)
    if status == 0 or status & ~known:
        return (
            [],
            False,
            f"errorStatus {status:#010x} sets bits the sheet has no row for in {bits[0]['unit']}",
        )
    return hit, promoted, ""


def decode_nvlink5(xid: int, text: str, driver: str | None = None) -> Nvl5Decode:
    """Decode an Xid 144-150 line's text (what follows ``<xid>,``) with the sheet, in the layout of
    ``driver`` (a version such as ``575.57.08``). With no driver version, the one layout whose unit
    field names a unit of this Xid is used; none or both: not decoded."""
    raw = text.strip()
    m = _LINE.search(raw)
    if m is None:
        return Nvl5Decode(xid, raw, False, "no registers in the line")
    regs = [int(r, 16) for r in re.findall(r"0x[0-9a-fA-F]+", m.group("regs"))]
    if len(regs) < 2:
        return Nvl5Decode(xid, raw, False, "fewer than two registers (IntrInfo, errorStatus)")
    intr, status = regs[0], regs[1]
    major = driver_major(driver)
    versions = [V2 if major >= R575 else V1] if major is not None else [V1, V2]
    found = [(v, *_match(xid, intr, status, v)) for v in versions]
    good = [f for f in found if f[1]]
    if len(good) != 1:
        if len(found) == 1:
            other = V1 if versions[0] == V2 else V2
            hint = (
                f"; the {other} layout reads it: logged under another driver?"
                if _match(xid, intr, status, other)[0]
                else ""
            )
            why = f"{found[0][3]} (driver {driver}, layout {versions[0]}{hint})"
        else:
            why = (
                "both layouts match; the driver version would tell"
                if good
                else "; ".join(f[3] for f in found)
            )
        return Nvl5Decode(xid, raw, False, why, intr_info=intr, error_status=status)
    version, rows, promoted, _ = good[0]
    rows = sorted(rows, key=lambda r: _URGENCY.index(r["immediate"]) if r["immediate"] in _URGENCY else 9)
    row = rows[0]
    immediate = row.get("promoted", row["immediate"]) if promoted else row["immediate"]
    subcode = (intr & 0x3FF) >> 5 if version == V1 else intr & 0x7F
    keyed = "status_bit" not in row and "status_value" not in row  # NETIR: the link-down reason tells
    names = sorted({r["unit"] for r in rows})
    link = m.group("link")
    return Nvl5Decode(
        xid,
        raw,
        True,
        unit=" or ".join(names),
        subcode=subcode,
        reason=f"{(intr >> 20) & 0x3F:06b}" if keyed else "",
        version=version,
        severity=row["severity"] + (" (promoted)" if promoted and "promoted" in row else ""),
        immediate=immediate,
        investigatory=row["investigatory"],
        origin=row["origin"],
        link=int(link) if link is not None else None,
        logged=m.group("logged"),
        intr_info=intr,
        error_status=status,
    )
