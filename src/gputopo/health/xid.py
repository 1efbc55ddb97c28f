"""Xid events from the kernel log (pure): parse, age, map to a GPU, classify.

The NVIDIA driver logs each Xid as ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., <text>``; drivers before
about r450 wrote ``NVRM: Xid (0000:03:00): 14, ...`` (no ``PCI:``). The address is domain:bus:device,
with a 4-digit domain and lower case, where NVML says ``00000000:3B:00.0``: both are reduced to numbers
before they are compared.

Lines come with one of the timestamps people save or tools print: ``dmesg``'s seconds since boot
(``[  123.456789]``), ``dmesg -T``'s local time (``[Wed Nov 25 10:00:00 2026]``), ``journalctl -o
short-iso`` (``2026-11-25T10:00:00+0000 host kernel: ...``) or syslog's ``Nov 25 10:00:00 host kernel:``.
Seconds since boot are aged with the machine's uptime; a line whose age cannot be known is counted as
"since boot" and the finding says so.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from gputopo.errors import InputError, UsageError
from gputopo.findings import NOTE, PROBLEM, Finding
from gputopo.health.rules import DEFAULT_THRESHOLDS, DRAIN_ACTIONS, Rule, Thresholds, XidPolicy
from gputopo.health.xid_catalog import (
    NVLINK5_XIDS,
    CatalogEntry,
    Nvl5Decode,
    bucket_words,
    catalog,
    decode_nvlink5,
)

# Kernel logs larger than this are refused (a user's file) or cut to their newest part (the machine's own).
MAX_LOG_BYTES = 32 * 1024 * 1024
# A kernel log line is at most about 1 KiB (printk's LOG_LINE_MAX); longer "lines" are not log lines.
MAX_LINE_CHARS = 8192
DEFAULT_SINCE = "2h"


@dataclass(frozen=True)
class XidClass:
    """How an Xid is read: ``kind`` ``hardware`` (the GPU's) or ``application`` (a program's fault: a note),
    NVIDIA's short description, what to do (``action``, one of ``findings.ACTIONS``), the remedy, our
    ``severity`` (problem or note), DCGM's (``fail``, ``warn`` or ``none`` where DCGM does not map the
    code) and ``why`` ours differs, where it does."""

    kind: str
    description: str
    action: str
    remedy: str
    severity: str = PROBLEM
    dcgm: str = "none"
    why: str = ""


_RESET = "drain the GPU and reset it (`nvidia-smi -r -i {i}`) or reboot; if it returns, open an RMA"
_WHEN_CONVENIENT = (
    "the error was contained (the job on it was stopped); reset the GPU when convenient, when its jobs end "
    "(`nvidia-smi -r -i {i}`)"
)
_APP = "the program on the GPU faulted (bad memory access, killed job); check the application, not the GPU"
_WATCH = "DCGM warns on it: watch for it repeating; `nvidia-smi -q -i {i}` shows the GPU's state"
_NVL5 = "NVLink5 error (Blackwell)"
_NVL5_XIDS = NVLINK5_XIDS
_RESET_GROUP = "GPU error whose catalogue resolution is a GPU reset (Blackwell)"


def _hw(
    desc: str, action: str = "reset", remedy: str = _RESET, dcgm: str = "none", why: str = ""
) -> XidClass:
    return XidClass("hardware", desc, action, remedy, PROBLEM, dcgm, why)


def _warn(desc: str, action: str = "monitor", remedy: str = _WATCH) -> XidClass:
    return XidClass("hardware", desc, action, remedy, NOTE, "warn")


def _app(desc: str, dcgm: str = "none") -> XidClass:
    return XidClass("application", desc, "none", _APP, NOTE, dcgm)


# Descriptions follow the 2026 catalogue; where DCGM files a code under a subsystem the catalogue does not
# name (its warn list groups 38/39/42 as PCIe, 54/56/57/58/78 as power, 60/61/62 as thermal), ours says so.
# Classification after NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors, "Analyzing Xid Errors with
# the Xid Catalog": the resolution buckets RESTART_APP vs RESET_GPU / RESTART_BM / CONTACT_SUPPORT) and
# DCGM's BuildXidMappings (modules/health/DcgmHealthWatch.cpp at 72fa3fe: 48, 74, 79, 95, 119, 120, 140
# fail; 94 and the per-subsystem codes warn). Where ours differs from DCGM's, ``why`` says so.
# fmt: off
XID_TABLE: dict[int, XidClass] = {
    13: _app("graphics engine exception"),
    31: _app("GPU memory page fault (MMU error)", "warn"),
    43: _app("GPU stopped processing (channel reset)", "warn"),
    45: _app("preemptive cleanup after an earlier error (a killed context)"),
    68: _app("video decoder exception"),
    69: _app("graphics engine class error"),
    32: _warn("PBDMA error (invalid or corrupted push buffer stream)"),
    38: _warn("driver firmware error (DCGM warns on it as PCIe)"),
    39: _warn("copy engine exception (DCGM warns on it as PCIe)"),
    42: _warn("unused on Ampere and newer (DCGM warns on it as PCIe)"),
    54: _warn("auxiliary power is not connected to the GPU board (DCGM: power)"),
    56: _warn("unused on Ampere and newer (DCGM warns on it as power)"),
    57: _warn("unused on Ampere and newer (DCGM warns on it as power)"),
    58: _warn("unused on Ampere and newer (DCGM warns on it as power)"),
    60: _warn("video processor exception (DCGM warns on it as thermal)"),
    67: _warn("illegal access by driver (DCGM warns on it as NVLink)"),
    73: _warn("unused on Ampere and newer (DCGM warns on it as NVLink)"),
    78: _warn("vGPU start error (DCGM warns on it as power)"),
    93: XidClass("hardware", "InfoROM wear limit reached", "monitor",
                 "the catalogue asks for no action; if it repeats: contact support (`nvidia-smi -q -i {i}` "
                 "shows the InfoROM)", NOTE, "warn",
                 "DCGM warns on it (as a corrupt InfoROM) only on Volta: BuildXidMappings scopes it to "
                 "DCGM_CHIP_ARCH_VOLTA and ignores it on every later GPU"),
    121: _warn("C2C link corrected error"),
    137: _warn("NVLink FLA privilege error"),
    92: XidClass("hardware", "high single-bit ECC error rate", "monitor",
                 "the catalogue asks for no action; if it repeats: contact support (`nvidia-smi -q -d ECC -i "
                 "{i}` shows the counts)", NOTE, "none",
                 "DCGM maps no Xid 92 (BuildXidMappings); its ECC watch reads the counters instead"),
    48: _hw("double-bit ECC error", dcgm="fail"),
    61: _warn("PMU breakpoint, unused on Ampere and newer (DCGM warns on it as thermal)"),
    62: _hw("internal micro-controller halt", dcgm="warn",
            why="the catalogue's resolution is a GPU reset and the driver follows it with Xid 154 (reset "
                "required); DCGM files 62 as a thermal warning"),
    63: XidClass("hardware", "page retirement or row remapping recorded (reset to apply)", "reset",
                 "a row was marked for remapping (the driver keeps it unused meanwhile); reset the GPU when "
                 "convenient, when its jobs end (`nvidia-smi -r -i {i}`), to apply it", NOTE, "warn"),
    94: XidClass("hardware", "contained ECC error (the application was stopped)", "reset",
                 _WHEN_CONVENIENT, NOTE, "warn"),
    64: _hw("ECC page retirement or row remapping failure", "replace",
            "the GPU could not repair its memory: take it out of service and open an RMA", dcgm="fail"),
    74: _hw("NVLink error", dcgm="fail"),
    79: _hw("GPU has fallen off the bus", "drain",
            "drain the node; reboot it (a reset rarely brings the GPU back); if it returns, reseat "
            "the GPU and check power and the riser, then RMA", dcgm="fail"),
    95: _hw("uncontained ECC error", dcgm="fail"),
    109: _hw("context switch timeout", why="DCGM does not map it; the catalogue's resolution is a GPU reset"),
    110: _hw(_RESET_GROUP, why="DCGM does not map it; the catalogue's resolution is a GPU reset"),
    119: _hw("GSP RPC timeout", dcgm="fail"),
    120: _hw("GSP error", dcgm="fail"),
    136: _hw(_RESET_GROUP, why="DCGM does not map it; the catalogue's resolution is a GPU reset"),
    140: _hw("ECC unrecovered error", dcgm="fail"),
    143: _hw(_RESET_GROUP, why="DCGM does not map it; the catalogue's resolution is a GPU reset"),
    **{code: _hw(_NVL5, why="DCGM does not map it; NVLink errors need a reset") for code in _NVL5_XIDS},
    154: _hw(
        "GPU recovery action changed", "reset",
            "the driver asks for a recovery action; `nvidia-smi -q` shows it; follow it",
            why="judged by the action the line names: none and drain P2P are notes; reboot asks for one"),
    167: _hw("PCIe fatal timeout", why="DCGM does not map it and the catalogue gives no bucket; a fatal PCIe "
             "timeout cuts the GPU off its bus until a reset (gputopo's judgement)"),
    169: _hw("internal micro-controller halt (SEC2)",
             why="DCGM does not map it; the catalogue describes it as it describes 62 (internal "
                 "micro-controller halt), whose resolution is a GPU reset"),
    155: _hw(_RESET_GROUP, why="DCGM does not map it; the catalogue's resolution is a GPU reset"),
    156: _hw(_RESET_GROUP, why="DCGM does not map it; the catalogue's resolution is a GPU reset"),
    158: _hw(_RESET_GROUP, why="DCGM does not map it; the catalogue's resolution is a GPU reset"),
}
# fmt: on

_CATALOG_RESET = "DCGM does not map it; the catalogue's resolution is a GPU reset"


def _from_catalog(e: CatalogEntry) -> XidClass:
    """A code the table above does not name, read by its resolution bucket in NVIDIA's catalogue."""
    desc = f"{e.mnemonic}, unused on Ampere and newer" if e.unused else e.description
    imm = e.immediate
    if imm == "RESTART_APP":
        return _app(desc)
    if imm == "RESET_GPU":
        return _hw(desc, why=_CATALOG_RESET)
    if imm == "RESTART_VM":
        return _hw(
            desc,
            "reboot",
            bucket_words(imm),
            why="DCGM does not map it; the catalogue's resolution is restarting the VM that owns the GPU",
        )
    if imm == "IGNORE":
        return XidClass(
            "hardware",
            desc,
            "none",
            f"the catalogue asks for no action; if it repeats: {bucket_words(e.investigatory)}",
            NOTE,
        )
    if imm == "CHECK_UVM":
        return XidClass("hardware", desc, "monitor", bucket_words(imm), NOTE)
    if e.unused:
        return XidClass(
            "hardware",
            desc,
            "monitor",
            "the catalogue lists it as unused on Ampere and newer (Volta or older, or retired): "
            "look it up in its archive for older GPUs, or contact support",
            NOTE,
        )
    if imm == "CONTACT_SUPPORT":
        return XidClass("hardware", desc, "monitor", bucket_words(imm), NOTE)
    if imm is None:
        return XidClass(
            "hardware", desc, "monitor", e.text or "the catalogue gives no resolution for it", NOTE
        )
    raise ValueError(f"Xid {e.xid}: no reading for the catalogue's bucket {imm}")  # pragma: no cover


# Every other code of the catalogue (1-172) is read by its resolution bucket: no code it knows is unknown.
XID_TABLE.update({code: _from_catalog(e) for code, e in catalog().items() if code not in XID_TABLE})
XID_TABLE = dict(sorted(XID_TABLE.items()))


# Where DCGM maps each code: NVIDIA/DCGM modules/health/DcgmHealthWatch.cpp at 72fa3fe (DCGM 4.6),
# BuildXidMappings, the line of the code's entry.
DCGM_XID_LINES = {
    48: 3361, 74: 3362, 79: 3363, 94: 3364, 95: 3366, 119: 3371, 120: 3372, 140: 3373, 31: 3380, 32: 3381,
    43: 3382, 63: 3383, 64: 3388, 38: 3394, 39: 3395, 42: 3396, 60: 3401, 61: 3406, 62: 3408, 54: 3413,
    56: 3414, 57: 3415, 58: 3420, 78: 3421, 67: 3426, 73: 3427, 121: 3428, 137: 3429, 93: 3434,
}  # fmt: skip


def dcgm_xid_source(code: int) -> str:
    """Where DCGM maps ``code`` (its function and line), or that it does not."""
    line = DCGM_XID_LINES.get(code)
    if line is None:
        return "DCGM 4.6 BuildXidMappings maps no such code"
    return f"DCGM modules/health/DcgmHealthWatch.cpp BuildXidMappings, line {line} at 72fa3fe"


def xid_rows(policy: XidPolicy | None = None) -> list[dict[str, object]]:
    """Every code of the table with the catalogue's facts, as ``check --list-rules`` lists them: the
    mnemonic and description, NVIDIA's resolution buckets, and gputopo's kind, severity and action, as
    the admin's Xid ``policy`` sets them (``policy``: application or node where it names the code)."""
    cat = catalog()
    rows: list[dict[str, object]] = []
    for code, c in XID_TABLE.items():
        e = cat.get(code)
        said = policy.says(code) if policy is not None else None
        if said == "application":
            c = XidClass(c.kind, c.description, "none", c.remedy, NOTE, c.dcgm, c.why)
        elif said == "node":
            action = c.action if c.action in DRAIN_ACTIONS else "reset"
            c = XidClass(c.kind, c.description, action, c.remedy, PROBLEM, c.dcgm, c.why)
        rows.append(
            {
                "xid": code,
                "mnemonic": e.mnemonic if e else None,
                "description": e.description if e else c.description,
                "immediate": e.immediate if e else None,
                "investigatory": e.investigatory if e else None,
                "catalogue_note": "; ".join(w for w in (e.note, e.text) if w) if e else "not catalogued",
                "kind": c.kind,
                "severity": c.severity,
                "action": c.action,
                "per_line": code in _NVL5_XIDS or code == 154,
                "dcgm": c.dcgm,
                "dcgm_source": dcgm_xid_source(code),
                "why": c.why,
                "remedy": c.remedy.replace("{i}", "N"),
                "policy": said,
            }
        )
    return rows


# Xid 154's text names the new recovery action: "GPU recovery action changed from 0x0 (None) to 0x1 (GPU
# Reset Required)". The code after "to" is NVML's nvmlDeviceGpuRecoveryAction_t.
_XID154_TO = re.compile(r"\bto 0x([0-9a-fA-F]+)")
# recovery action -> (severity, action, words); DCGM MonitorGpuRecoveryAction: drain P2P warns.
XID154_ACTIONS: dict[int, tuple[str, str, str]] = {
    0: (NOTE, "none", "no action needed any more"),
    1: (PROBLEM, "reset", "GPU reset required"),
    2: (PROBLEM, "reboot", "node reboot required"),
    3: (NOTE, "monitor", "drain peer-to-peer work (not a node drain)"),
    4: (PROBLEM, "drain", "drain and reset"),
}


def xid154_action(text: str) -> tuple[str, str, str] | None:
    """(severity, action, words) for the recovery action an Xid 154 line names; ``None`` when it names none
    gputopo knows."""
    m = _XID154_TO.search(text)
    if m is None:
        return None
    return XID154_ACTIONS.get(int(m.group(1), 16))


_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<addr>[0-9a-fA-F]{1,8}:[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}(?:\.[0-7])?"
    r"|[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}(?:\.[0-7])?)\): (?P<xid>\d{1,5})\b,?\s*(?P<rest>.*)$"
)
_PID_RE = re.compile(r"\bpid=(\d+)")
_BOOT_STAMP = re.compile(r"\[\s*(\d+\.\d+)\]")
_CTIME_STAMP = re.compile(r"^\[(\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4})\]")
_ISO_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)\s")
_SYSLOG_STAMP = re.compile(r"^(\w{3} [ \d]\d \d\d:\d\d:\d\d)\s")


@dataclass(frozen=True)
class XidEvent:
    """One Xid line: the code, the PCI address as logged and its numeric key (domain, bus, device), the
    pid when logged, the age in seconds (``None``: unknown, counted as since boot), and the line's text
    after the code."""

    xid: int
    address: str
    bus_key: tuple[int, int, int]
    pid: int | None
    age_s: float | None
    when: str | None
    text: str
    at: float | None = None

    @property
    def key(self) -> str:
        """What names this one log line across runs (the state file's acknowledgements): the code, the
        address and the stamp as written (or the text, for a line without one)."""
        return f"{self.xid}|{self.address.lower()}|{self.when or self.text[:80]}"

    @property
    def wall(self) -> str | None:
        """When it happened as a wall-clock time (``2026-11-28 03:10:07 UTC``), never "seconds after boot";
        ``None`` when its age is unknown."""
        return wall_time(self.at) if self.at is not None else None


def wall_time(epoch_s: float) -> str:
    """Seconds since the epoch as a wall-clock time in the machine's zone: ``2026-11-28 03:10:07 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(epoch_s))


@dataclass(frozen=True)
class XidScan:
    """The Xid events within the window, how many older ones were left out, and how many lines were read."""

    events: tuple[XidEvent, ...]
    older: int
    lines: int
    since_s: float | None


def parse_since(text: str) -> float:
    """``--since`` as seconds: ``90s``, ``30m``, ``2h``, ``1d`` (a positive number and a unit). Anything else
    is a ``UsageError`` (exit 2)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text or "")
    value = float(m.group(1)) if m else 0.0
    if not m or value <= 0:
        raise UsageError(
            f"--since {text}: not a duration", "a positive number and a unit: 90s, 30m, 2h or 1d (default 2h)"
        )
    return value * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def bus_key(address: str) -> tuple[int, int, int] | None:
    """A PCI address (``PCI:0000:3b:00``, ``0000:03:00``, ``00000000:3B:00.0``, ``3b:00``) as (domain, bus,
    device) numbers; ``None`` if it is not one. The function number is dropped: the driver logs none."""
    addr = address.strip()
    if addr.upper().startswith("PCI:"):
        addr = addr[4:]
    addr = addr.split(".", 1)[0]
    parts = addr.split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3:
        return None
    try:
        domain, bus, device = (int(p, 16) for p in parts)
    except ValueError:
        return None
    return domain, bus, device


def decode_log(data: bytes, source: str) -> str:
    """A user's kernel log file as text; ``InputError`` (exit 2) for one too large or not text."""
    if len(data) > MAX_LOG_BYTES:
        raise InputError(
            f"--kernel-log {source}: {len(data)} bytes is more than a kernel log "
            f"({MAX_LOG_BYTES} bytes at most)",
            "save just the recent part: `dmesg | tail -n 100000 > FILE` or `journalctl -k --since -2h`",
        )
    if b"\x00" in data[:65536]:
        raise InputError(
            f"--kernel-log {source}: binary data, not a kernel log",
            "pass the text of `dmesg`, `dmesg -T` or `journalctl -k -o short-iso`",
        )
    return data.decode("utf-8", errors="replace")


def scan(
    text: str,
    since_s: float | None,
    uptime_s: float | None = None,
    now: datetime | None = None,
) -> XidScan:
    """The Xid events in ``text`` no older than ``since_s`` seconds (``None``: all of them).

    ``uptime_s`` ages boot-relative stamps; ``now`` (aware, default the current time) ages wall-clock
    stamps, read as local time when they carry no zone. Lines too long to be log lines are skipped.
    """
    now = now or datetime.now(timezone.utc).astimezone()
    events: list[XidEvent] = []
    older = lines = 0
    for line in text.splitlines():
        lines += 1
        if len(line) > MAX_LINE_CHARS or "Xid" not in line:
            continue
        m = _XID_RE.search(line)
        if m is None:
            continue
        key = bus_key(m.group("addr"))
        if key is None:
            continue
        age, when = _age(line[: m.start()], uptime_s, now)
        if since_s is not None and age is not None and age > since_s:
            older += 1
            continue
        pid = _PID_RE.search(m.group("rest"))
        events.append(
            XidEvent(
                xid=int(m.group("xid")),
                address=m.group("addr"),
                bus_key=key,
                pid=int(pid.group(1)) if pid else None,
                age_s=age,
                when=when,
                text=m.group("rest").strip()[:300],
                at=now.timestamp() - age if age is not None else None,
            )
        )
    return XidScan(tuple(events), older, lines, since_s)


def _age(prefix: str, uptime_s: float | None, now: datetime) -> tuple[float | None, str | None]:
    """(age in seconds, the stamp as written) from the text before ``NVRM:``."""
    text = prefix.strip()
    m = _ISO_STAMP.match(text)
    if m:
        stamp = m.group(1).replace(",", ".")
        try:
            t = datetime.fromisoformat(_colon_zone(stamp))
        except ValueError:
            return None, stamp
        return _since(now, t), stamp
    m = _CTIME_STAMP.match(text)
    if m:
        try:
            t = datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y")
        except ValueError:
            return None, m.group(1)
        return _since(now, t), m.group(1)
    m = _SYSLOG_STAMP.match(text)
    if m:
        stamp = " ".join(m.group(1).split())
        try:
            t = datetime.strptime(f"{now.year} {stamp}", "%Y %b %d %H:%M:%S")
        except ValueError:
            return None, stamp
        if t.replace(tzinfo=now.tzinfo) > now + timedelta(days=1):  # syslog has no year: last year's line
            t = t.replace(year=now.year - 1)
        return _since(now, t), stamp
    m = _BOOT_STAMP.search(text)
    if m:
        boot_s = float(m.group(1))
        if uptime_s is None:
            return None, f"{boot_s:.0f} s after boot"
        return max(0.0, uptime_s - boot_s), f"{boot_s:.0f} s after boot"
    return None, None


def _colon_zone(stamp: str) -> str:
    """``+0000`` -> ``+00:00`` and ``Z`` -> ``+00:00``: what ``fromisoformat`` takes on Python 3.10."""
    if stamp.endswith("Z"):
        return stamp[:-1] + "+00:00"
    m = re.search(r"([+-]\d\d)(\d\d)$", stamp)
    if m:
        return stamp[: m.start()] + f"{m.group(1)}:{m.group(2)}"
    return stamp


def _since(now: datetime, t: datetime) -> float:
    if t.tzinfo is None:  # local time, as dmesg -T and syslog write it
        t = t.replace(tzinfo=now.tzinfo) if now.tzinfo is not None else t
    return max(0.0, (now - t).total_seconds())


def classify(xid: int) -> XidClass | None:
    """NVIDIA's reading of an Xid code, or ``None`` when gputopo's table does not have it."""
    return XID_TABLE.get(xid)


@dataclass(frozen=True)
class Acknowledged:
    """Xid lines a person has acknowledged by resuming the node gputopo drained for them (the state file):
    every line up to ``until`` (seconds since the epoch) and the lines named in ``keys`` (those whose time
    is unknown)."""

    until: float | None = None
    keys: frozenset[str] = frozenset()
    by: str = "a person's resume"

    def covers(self, e: XidEvent) -> bool:
        if e.key in self.keys:
            return True
        return self.until is not None and e.at is not None and e.at <= self.until


def xid_findings(
    found: XidScan,
    gpus: Iterable[tuple[int, str | None]],
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
    acknowledged: Acknowledged | None = None,
    driver: str | None = None,
) -> list[Finding]:
    """One finding per (GPU, Xid code). Hardware Xids are problems on that GPU, or notes where NVIDIA's
    catalogue and DCGM say reset when convenient (63, 94) or only warn; application ones notes. An Xid for
    a PCI address none of ``gpus`` (index, NVML bus id) has is judged the same, on that bus id (rule
    ``xid_unlisted_gpu``: a GPU NVML no longer lists is the commonest way an Xid 79 shows). Lines
    ``acknowledged`` by a person's resume make one note and never a problem. Whether each kind is reported
    at all, and the problem severity, come from the thresholds table. NVLink5 Xids (144-150) are decoded
    from their registers with the catalogue's decode sheet, in the layout of ``driver`` (the version NVML
    reports; the layout changed at R575), and judged by the sheet's bucket."""
    hardware, application, unknown, unlisted = (
        thresholds[n] for n in ("xid_hardware", "xid_application", "xid_unknown", "xid_unlisted_gpu")
    )
    by_bus: dict[tuple[int, int, int], int] = {}
    for index, bus_id in gpus:
        key = bus_key(bus_id) if bus_id else None
        if key is not None:
            by_bus[key] = index
    groups: dict[tuple[int | None, str, int], list[XidEvent]] = {}
    acked: list[XidEvent] = []
    for e in found.events:
        if acknowledged is not None and acknowledged.covers(e):
            acked.append(e)
            continue
        gpu = by_bus.get(e.bus_key)
        groups.setdefault((gpu, e.address if gpu is None else "", e.xid), []).append(e)
    window = _window_words(found.since_s)
    out: list[Finding] = []
    for (gpu, address, xid), events in sorted(groups.items(), key=lambda kv: (kv[0][0] is None, kv[0])):
        cls = classify(xid)
        times = len(events)
        last = events[-1]
        unaged = sum(1 for e in events if e.age_s is None)
        seen = f"{times} time{'s' if times != 1 else ''} {window}"
        if unaged:
            seen += f" ({unaged} of unknown age, counted as since boot)"
        stamp = f", last at {last.wall or last.when}" if (last.wall or last.when) else ""
        desc = f" ({cls.description})" if cls else ""
        where = f"GPU{gpu}" if gpu is not None else f"PCI:{address}"
        on = (
            f"on {where}"
            if gpu is not None
            else (f"for PCI {address}, a GPU NVML no longer lists (fallen off the bus, or hidden from here)")
        )
        what = f"Xid {xid}{desc} {on} {seen}{stamp}: {last.text}"
        i = gpu if gpu is not None else address
        hw = hardware if gpu is not None else unlisted
        if cls is None:
            verdict = _Verdict(
                unknown.severity,
                "monitor",
                "look the code up in NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors)",
                unknown,
            )
        elif cls.kind == "application":
            remedy = cls.remedy
            if xid == 45:
                remedy = _xid45_remedy(
                    sorted(c for g, a, c in groups if (g, a) == (gpu, address) and c != 45)
                )
            verdict = _Verdict(application.severity, "none", remedy, application)
        else:
            severity, action, remedy = (
                (hw.severity if cls.severity == PROBLEM else NOTE),
                cls.action,
                cls.remedy.format(i=i),
            )
            if xid in _NVL5_XIDS:
                dec = _worst_nvlink5(xid, events, driver)
                what = f"{dec.name}{desc} {on} {seen}{stamp}: {dec.words()}: {dec.raw}"
                severity, action, remedy = _nvlink5_verdict(dec, hw.severity, remedy, i)
            if xid == 154:
                named = xid154_action(last.text)
                if named is not None:
                    severity = hw.severity if named[0] == PROBLEM else NOTE
                    action = named[1]
                    remedy = f"the driver asks: {named[2]}; `nvidia-smi -q -i {i}` shows the recovery action"
            if gpu is None:
                remedy = (
                    f"{remedy}; compare `nvidia-smi -L` with `lspci -d 10de:` (the GPU at PCI {address} is "
                    "gone from NVML's list)"
                )
            verdict = _Verdict(severity, action, remedy, hw)
        policy = thresholds.xid_policy
        said = policy.says(xid) if policy is not None else None
        if policy is not None and said is not None:
            verdict, what = _by_policy(verdict, what, said, policy.source, application, hw)
        if verdict.rule.enabled:
            out.append(
                verdict.rule.finding(
                    where, what, verdict.remedy, gpu=gpu, severity=verdict.severity, action=verdict.action
                )
            )
    if acked:
        codes = sorted({e.xid for e in acked})
        until = acknowledged.until if acknowledged is not None else None
        when = f" at {wall_time(until)}" if until is not None else ""
        out.append(
            hardware.finding(
                "node",
                f"{len(acked)} Xid line{'s' if len(acked) != 1 else ''} (Xid {', '.join(map(str, codes))}) "
                f"acknowledged by {acknowledged.by if acknowledged else 'a resume'}{when}: not judged again",
                "nothing to do: a new Xid line is judged as usual",
                severity=NOTE,
                action="none",
            )
        )
    return out


@dataclass(frozen=True)
class _Verdict:
    severity: str
    action: str
    remedy: str
    rule: Rule


def _by_policy(
    v: _Verdict, what: str, said: str, source: str, application: Rule, hardware: Rule
) -> tuple[_Verdict, str]:
    """The verdict as the admin's Xid policy has it: ``application`` a note that never drains (rule
    xid_application), ``node`` a problem (rule xid_hardware, or xid_unlisted_gpu; an action that would
    not drain becomes a reset). Where the severity changes, the finding says so."""
    if said == "application":
        new = _Verdict(NOTE, "none", v.remedy, application)
        words = "the application's: a note, never a drain"
    else:
        action = v.action if v.action in DRAIN_ACTIONS else "reset"
        new = _Verdict(hardware.severity, action, v.remedy, hardware)
        words = f"the node's: a {hardware.severity}"
    if (new.severity, new.action) == (v.severity, v.action):
        return new, what
    return new, f"{what} (the Xid policy in {source} makes it {words})"


def _xid45_remedy(others: Sequence[int]) -> str:
    """Xid 45 by the catalogue's WORKFLOW_XID_45 ("Solo: RESTART_FM; Not Solo: IGNORE (follow other
    Xid)"): alone on its GPU in the window, restart the fabric manager; with another Xid, that one
    decides."""
    if others:
        codes = ", ".join(f"Xid {c}" for c in others)
        return (
            f"it follows {codes} on this GPU in the window: follow {'that' if len(others) == 1 else 'their'} "
            "remedy; Xid 45 is the driver cleaning up the contexts it stopped (the catalogue's "
            "WORKFLOW_XID_45, not solo)"
        )
    return (
        "alone (no other Xid on this GPU in the window): restart the fabric manager "
        "(`systemctl restart nvidia-fabricmanager`, on NVSwitch systems), as the catalogue's WORKFLOW_XID_45 "
        "asks; a job that was killed also leaves one"
    )


# The decode sheet's immediate buckets, most urgent first: the group of lines one finding stands for is
# judged by its most urgent line (a line the sheet cannot read, by the worst bucket its unit or code has).
_NVL5_ORDER = ("RESET_GPU", "XID_154_EVAL", "IGNORE")


def _bucket(d: Nvl5Decode) -> str:
    return d.immediate if d.decoded else d.fallback


def _worst_nvlink5(xid: int, events: Sequence[XidEvent], driver: str | None) -> Nvl5Decode:
    decoded = [decode_nvlink5(xid, e.text, driver) for e in events]
    rank = {b: n for n, b in enumerate(_NVL5_ORDER)}
    return min(reversed(decoded), key=lambda d: (rank.get(_bucket(d), 0), not d.decoded))


def _nvlink5_verdict(dec: Nvl5Decode, problem: str, remedy: str, i: object) -> tuple[str, str, str]:
    """(severity, action, remedy) of an NVLink5 line by the sheet's buckets: RESET_GPU a problem; IGNORE
    and XID_154_EVAL (the 154 line, judged on its own, names any action) notes. A line the sheet cannot
    read is judged by the most urgent bucket the sheet gives its unit (or its code): unknown is not
    healthy where the sheet could ask for a reset, and no drain where every row says IGNORE."""
    if not dec.decoded:
        sheet = "its registers match no row of the catalogue's 'XID 144-150 Decode' sheet"
        if dec.fallback == "RESET_GPU":
            return problem, "reset", f"{remedy}; {sheet}, and the sheet's rows for it ask for a reset"
        return (
            NOTE,
            "none",
            f"{bucket_words(dec.fallback)}: {sheet}, and none of its rows asks for more ({dec.fallback})",
        )
    then = f"; if it repeats: {bucket_words(dec.investigatory)} ({dec.investigatory})"
    if dec.immediate == "RESET_GPU":
        return (
            problem,
            "reset",
            f"reset the GPU (`nvidia-smi -r -i {i}`); then: {bucket_words(dec.investigatory)}",
        )
    return NOTE, "none", f"{bucket_words(dec.immediate)}{then}"


def _window_words(since_s: float | None) -> str:
    if since_s is None:
        return "in the log"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if since_s >= size and since_s % size == 0:
            return f"in the last {since_s / size:g}{unit}"
    return f"in the last {since_s:g}s"


def xid_event_words(
    events: Sequence[tuple[int | None, int, float]], gpus: Sequence[int], first: int | None = None
) -> str | None:
    """The Xid events NVML reported on ``gpus`` while a job ran, as a crashed or hung check says them:
    ``Xid 79 on GPU5 at 12:03:07 (GPU has fallen off the bus)``. ``events`` are ``(gpu, xid, time_s)``
    (seconds since the epoch, shown in local time); those on ``first`` (the GPU of the rank that died)
    come first. ``None`` when none was on these GPUs."""
    mine = [e for e in events if e[0] is not None and e[0] in gpus]
    if not mine:
        return None
    mine.sort(key=lambda e: (e[0] != first, e[2]))
    words = []
    for gpu, xid, time_s in mine[:4]:
        known = classify(xid)
        what = f" ({known.description})" if known is not None else ""
        words.append(f"Xid {xid} on GPU{gpu} at {time.strftime('%H:%M:%S', time.localtime(time_s))}{what}")
    more = f" and {len(mine) - 4} more" if len(mine) > 4 else ""
    return "; ".join(words) + more
