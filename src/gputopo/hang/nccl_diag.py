"""NCCL's active diagnostics (``NCCL_RUN_DIAGNOSTICS=1``, NCCL 2.31 and later) read from a job's log (pure
but for reading the file).

From NVIDIA/nccl's source (checked at master, commits 17e1e48 / 889806: ``src/diagnostics.cc``,
``src/diagnostics/p2p.cc``, ``src/include/diagnostics_log.h``): at each communicator's init the rank 0
process prints its report to stdout, every line through ``DIAG_PRINT``: ``<host>:<pid> NCCL DIAG <text>``,
where the text is a header (``=== NCCL Diagnostics ===``), a summary (``NCCL diagnostics completed in 12.3
ms across 8 ranks``) or a check's line tagged ``[OK]`` or ``[INFO]``: ``[OK] p2p: verified P2P access in
both directions between every GPU pair (56 peer accesses)``, ``[INFO] p2p: only 54/56 GPU-to-GPU peer
accesses passed verification``, and per failing pair ``[INFO] p2p: write mismatch srcRank=0 srcCudaDev=0
srcNvmlDev=0 dstRank=1 dstCudaDev=1 dstNvmlDev=1 path=NVL handle=CUMEM_POSIX_FD expected=... got=...;
<advice>``. Findings are informational in NCCL (they never abort init); here an ``[INFO]`` line that says
a check failed, mismatched or passed only partly is a problem, another ``[INFO]`` a note. The lines may
carry a launcher's prefix (``[default0]:``), so they are found anywhere in a line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputopo.hang.files import read_named

MAX_LOG_BYTES = 1024 * 1024 * 1024
_LINE = re.compile(
    r"(?:^|[\s\]:])(?:(?P<host>[^\s:\[\]]+):(?P<pid>\d+) )?"
    r"NCCL DIAG (?:\[(?P<level>[A-Z]+)\]\s*)?(?P<text>.*)$"
)
_FIELD = re.compile(r"\b(\w+)=(\S+)")
_FAILED = re.compile(r"\b(failed|mismatch|unavailable)\b|\bonly \d+/\d+\b", re.IGNORECASE)
_HINT = "give the job's output, where rank 0 printed `NCCL DIAG` lines (NCCL_RUN_DIAGNOSTICS=1)"


@dataclass(frozen=True)
class DiagLine:
    """One ``NCCL DIAG`` line: where it came from, its tag (``OK``, ``INFO`` or ``None``) and text."""

    line_no: int
    host: str | None
    pid: int | None
    level: str | None
    text: str

    @property
    def fields(self) -> dict[str, str]:
        return dict(_FIELD.findall(self.text.split(";", 1)[0]))

    @property
    def failed(self) -> bool:
        return self.level == "INFO" and bool(_FAILED.search(self.text.split(";", 1)[0]))


def parse_diag(text: str) -> list[DiagLine]:
    """Every ``NCCL DIAG`` line of a log, in order."""
    out: list[DiagLine] = []
    for n, line in enumerate(text.splitlines(), 1):
        if "NCCL DIAG" not in line:
            continue
        m = _LINE.search(line.rstrip())
        if m is None:
            continue
        out.append(DiagLine(n, m["host"], int(m["pid"]) if m["pid"] else None, m["level"], m["text"].strip()))
    return out


def read_diag(path: Path) -> list[DiagLine]:
    """``--nccl-log FILE``: its ``NCCL DIAG`` lines; an unreadable file is an ``InputError``."""
    # A job log may be large (its own cap, MAX_LOG_BYTES); a fifo or /dev/zero still ends there.
    label, over = f"--nccl-log {path}", f"{MAX_LOG_BYTES // 2**30} GiB"
    text = read_named(path, label, MAX_LOG_BYTES, over, _HINT).decode("utf-8", "replace")
    return parse_diag(text)


def _category(fields: dict[str, str], text: str) -> str:
    path = fields.get("path", "")
    if path in ("NVL", "NVB"):
        return "nvlink"
    if path in ("PIX", "PXB", "PHB", "SYS"):
        return "pcie"
    if text.startswith("net"):
        return "config"
    return "topology"


def _gpu(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def diag_findings(lines: list[DiagLine], source: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Findings (the shared finding shape) for the failed checks, and notes: how many lines and checks,
    every other ``[INFO]``."""
    if not lines:
        return [], [
            f"{source}: no `NCCL DIAG` lines (NCCL_RUN_DIAGNOSTICS=1 with NCCL >= 2.31 prints them on "
            "rank 0's stdout at each communicator init; `gputopo run --nccl-diagnostics` sets it)"
        ]
    found: list[dict[str, Any]] = []
    notes: list[str] = []
    ok = sum(1 for x in lines if x.level == "OK")
    for x in lines:
        where = f"{x.host}:{x.pid}" if x.host else source
        if x.failed:
            f = x.fields
            pair = ""
            if "srcRank" in f and "dstRank" in f:
                pair = (
                    f" (rank {f['srcRank']} GPU {f.get('srcNvmlDev', '?')} -> rank {f['dstRank']} GPU "
                    f"{f.get('dstNvmlDev', '?')}, path {f.get('path', '?')})"
                )
                where += f" GPU{f.get('srcNvmlDev', '?')}-GPU{f.get('dstNvmlDev', '?')}"
            what, _, advice = x.text.partition(";")
            found.append(
                {
                    "where": where,
                    "gpu": None,
                    "category": _category(f, x.text),
                    "what": f"NCCL DIAG (line {x.line_no}): {what.strip()}{pair}",
                    "remedy": advice.strip() or "read the NCCL DIAG lines around it and NCCL's WARN lines",
                    "severity": "problem",
                    "action": "none",
                }
            )
        elif x.level == "INFO":
            notes.append(f"NCCL DIAG (line {x.line_no}, {where}): {x.text}")
    notes.insert(
        0,
        f"{source}: {len(lines)} NCCL DIAG line(s): {ok} check(s) OK, {len(found)} failed",
    )
    return found, notes
