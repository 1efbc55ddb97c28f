"""NVIDIA's Xid catalogue as data (pure): every code 1-172, and the NVLink5 Xids 144-150 decoded from their
registers.

The facts are in ``xid_catalog.json`` beside this module, transcribed from NVIDIA's "Analyzing Xid Errors with
the Xid Catalog" (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, read 2026-11-28): for each
code its mnemonic, description and the two resolution buckets ("immediate": what recovers the machine;
"investigatory": what finds the cause), and the "XID 144-150 Decode" sheet. gputopo's own severity and
action for each code live in ``health.xid.XID_TABLE``; the file repeats them and a test keeps both equal.

An NVLink5 Xid line reads ``149, NETIR_LINK_EVT Fatal XC0 i0 Link 09 (0x025525c6 0x00000000 ...)``: the
printed unit name and the first register (IntrInfo) name the unit, the second (errorStatus) the error. The
unit's field moved at driver R575 (the sheet's V1 and V2): before, IntrInfo[9:0]; from R575, IntrInfo[6:0].
A line carries the layout of the driver that wrote it, so both are tried against the printed name, and the
running driver only breaks a tie. IntrInfo[25:20] is NETIR_LINK_EVT's link-down reason, the field that
tells a peer's fault (``INVESTIGATE_PEER_DEVICE``) from this GPU's own; gpud and NVSentinel print it in
decimal after the code ("Xid 149.37", leptonai/gpud components/accelerator/nvidia/xid tests).
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
EITHER = "either layout"
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
    """An NVLink5 Xid line (144-150) read with the decode sheet. ``decoded`` False: the registers and the
    unit name match no row of the sheet in either layout (``why`` says what each layout tried), and only
    ``raw`` is kept; ``fallback`` is then the most urgent immediate bucket the sheet gives the unit named
    (or, for a name it does not know, the code), the bucket the line is judged by. Otherwise ``unit``
    (the sheet's unit name), ``unit_field`` (the IntrInfo unit field's value in the layout used),
    ``reason_code`` (IntrInfo[25:20]: NETIR_LINK_EVT's link-down reason, 0 in every other row; gpud and
    NVSentinel print it after the code, "Xid 149.37"), ``version`` (the sheet's layout used, or
    ``EITHER`` where both read the line alike), ``severity`` (the sheet's: Fatal, Link Fatal, Non-fatal),
    ``immediate`` and ``investigatory`` (its buckets), ``link`` and ``logged`` (the line's own link
    number and Fatal/Nonfatal word), and ``driver_layout`` (the layout of the driver running now, when it
    differs from the line's: the line was logged before an upgrade, or on another host)."""

    xid: int
    raw: str
    decoded: bool
    why: str = ""
    unit: str = ""
    unit_field: int | None = None
    reason_code: int | None = None
    version: str = ""
    severity: str = ""
    immediate: str = ""
    investigatory: str = ""
    origin: str = ""
    link: int | None = None
    logged: str = ""
    intr_info: int | None = None
    error_status: int | None = None
    fallback: str = ""
    driver_layout: str = ""

    @property
    def name(self) -> str:
        """The line as gpud and NVSentinel name it: ``Xid 149.37`` (the link-down reason in decimal after
        the code, ``.0`` for every unit that has none); ``Xid 149`` when not decoded."""
        if not self.decoded or self.reason_code is None:
            return f"Xid {self.xid}"
        return f"Xid {self.xid}.{self.reason_code}"

    def words(self) -> str:
        """One line: what the sheet says of it, or "not decoded" and why."""
        if not self.decoded:
            return f"not decoded ({self.why})"
        link = f" on link {self.link}" if self.link is not None else ""
        reason = (
            f"link-down reason {self.reason_code:06b}, "
            if self.reason_code is not None and self.unit.startswith("NETIR_LINK")
            else ""
        )
        layout = "either layout (both read it alike)" if self.version == EITHER else f"layout {self.version}"
        if self.driver_layout:
            layout += (
                f", not the layout of the driver running now ({self.driver_layout}): logged before a "
                "driver upgrade or on another host"
            )
        return (
            f"{reason}unit {self.unit}{link}, {self.severity} ({self.origin}), "
            f"{layout}: {self.immediate}; investigate: {self.investigatory}"
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


def _names(unit: str) -> set[str]:
    """The names a sheet unit goes by (``NETIR_LINK_EVT/NETIR_LINK_DOWN``: either), spaces as ``_`` and in
    capitals, as a line prints them (``MSE Degraded``)."""
    return {n.strip().replace(" ", "_").upper() for n in unit.split("/")}


def _printed(name: str) -> str:
    return "_".join(name.split()).upper()


def _urgent(buckets: list[str]) -> str:
    return min(buckets, key=lambda b: _URGENCY.index(b) if b in _URGENCY else len(_URGENCY))


def worst_bucket(xid: int, unit: str = "") -> str:
    """The most urgent immediate bucket the sheet gives the rows of ``unit`` (a printed unit name) under
    ``xid``, or of the whole code where the sheet knows no such unit: how a line the sheet cannot read is
    judged (a RESET_GPU anywhere under it: a problem; a code whose rows all say IGNORE, such as 147 and
    148: a note)."""
    rows = [r for r in _rows() if r["xid"] == xid]
    named = [r for r in rows if _printed(unit) in _names(r["unit"])] if unit else []
    pick = named or rows
    buckets = [r["immediate"] for r in pick] + [r["promoted"] for r in pick if "promoted" in r]
    return _urgent(buckets) if buckets else "RESET_GPU"


def _match(
    xid: int, unit_name: str, intr: int, status: int, version: str
) -> tuple[list[dict[str, Any]], bool, str]:
    """The sheet's rows a line matches in one layout: (rows, promoted, why none). A row must name the unit
    the line prints and carry its unit field in this layout."""
    key, width, promote_bit = ("v1", 10, 10) if version == V1 else ("v2", 7, 7)
    unit = intr & ((1 << width) - 1)
    reason = (intr >> 20) & 0x3F
    named = [r for r in _rows() if r["xid"] == xid and _printed(unit_name) in _names(r["unit"])]
    if not named:
        return [], False, f"{unit_name} is no Xid {xid} unit of the sheet"
    units = [r for r in named if int(r[key], 2) == unit and int(r["reason"], 2) in (reason, 0)]
    if not units:
        want = ", ".join(sorted({f"{int(r[key], 2):#x}" for r in named}))
        return [], False, f"unit field IntrInfo[{width - 1}:0] is {unit:#x}, not {want}"
    if any("status_bit" not in r and "status_value" not in r for r in units):
        hit = [r for r in units if int(r["reason"], 2) == reason]
        if not hit:
            return [], False, f"link-down reason {reason} ({reason:06b}) is not in the sheet"
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


def _verdict(rows: list[dict[str, Any]], promoted: bool) -> tuple[str, str, dict[str, Any]]:
    """(immediate, investigatory, the row) of the most urgent row a line matched."""
    rows = sorted(rows, key=lambda r: _URGENCY.index(r["immediate"]) if r["immediate"] in _URGENCY else 9)
    row = rows[0]
    immediate = row.get("promoted", row["immediate"]) if promoted else row["immediate"]
    return immediate, row["investigatory"], row


def decode_nvlink5(xid: int, text: str, driver: str | None = None) -> Nvl5Decode:
    """Decode an Xid 144-150 line's text (what follows ``<xid>,``) with the sheet, as NVIDIA's sheet reads
    it: the unit the line prints must be the row's unit, and the registers may follow either layout (the
    unit field moved at R575, but every public line, journals from before an upgrade and a
    ``--kernel-log`` from another host carry the layout of the driver that wrote them, not of the one
    running now). ``driver`` (a version such as ``575.57.08``) only breaks a tie: a line both layouts read
    differently (Xid 150's unit field is 0 in both). Both reading it alike: decoded, layout ``EITHER``."""
    raw = text.strip()
    m = _LINE.search(raw)
    if m is None:
        return Nvl5Decode(xid, raw, False, "no unit and registers in the line", fallback=worst_bucket(xid))
    unit_name = m.group("unit").strip()
    fallback = worst_bucket(xid, unit_name)
    regs = [int(r, 16) for r in re.findall(r"0x[0-9a-fA-F]+", m.group("regs"))]
    if len(regs) < 2:
        return Nvl5Decode(
            xid, raw, False, "fewer than two registers (IntrInfo, errorStatus)", fallback=fallback
        )
    intr, status = regs[0], regs[1]
    major = driver_major(driver)
    running = (V2 if major >= R575 else V1) if major is not None else ""
    found = {v: _match(xid, unit_name, intr, status, v) for v in (V1, V2)}
    good = [v for v, f in found.items() if f[0]]
    if not good:
        why = "; ".join(f"layout {v}: {f[2]}" for v, f in found.items())
        return Nvl5Decode(xid, raw, False, why, intr_info=intr, error_status=status, fallback=fallback)
    version = good[0]
    if len(good) == 2:
        same = _verdict(found[V1][0], found[V1][1])[:2] == _verdict(found[V2][0], found[V2][1])[:2]
        if running:
            version = running
        elif same:
            version = EITHER
        else:
            why = "both layouts read it, differently; the driver version that logged it would tell"
            return Nvl5Decode(xid, raw, False, why, intr_info=intr, error_status=status, fallback=fallback)
    rows, promoted, _ = found[V1 if version == EITHER else version]
    immediate, investigatory, row = _verdict(rows, promoted)
    width = 10 if version == V1 else 7
    link = m.group("link")
    return Nvl5Decode(
        xid,
        raw,
        True,
        unit=" or ".join(sorted({r["unit"] for r in rows})),
        unit_field=intr & ((1 << width) - 1),
        reason_code=(intr >> 20) & 0x3F,
        version=version,
        severity=row["severity"] + (" (promoted)" if promoted and "promoted" in row else ""),
        immediate=immediate,
        investigatory=investigatory,
        origin=row["origin"],
        link=int(link) if link is not None else None,
        logged=m.group("logged"),
        intr_info=intr,
        error_status=status,
        driver_layout=running if running and version not in (running, EITHER) else "",
    )
