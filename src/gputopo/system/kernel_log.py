"""The kernel log, for Xid lines: ``dmesg``, else ``journalctl -k``, else the reason neither would answer.

``dmesg`` prints seconds since boot (aged with ``/proc/uptime``); ``journalctl -k -o short-iso`` prints
wall-clock times. Where ``kernel.dmesg_restrict`` is set, an unprivileged ``dmesg`` answers "Operation not
permitted" and ``journalctl`` without the ``adm``/``systemd-journal`` group shows nothing but a hint: both
are refusals, said once (``KernelLog.refused``), never read as a clean log. Output is cut to its newest
``health.xid.MAX_LOG_BYTES``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gputopo.errors import InputError
from gputopo.health.xid import MAX_LOG_BYTES, decode_log

TIMEOUT_S = 5.0


@dataclass(frozen=True)
class KernelLog:
    """The log's text (``None`` when it could not be read), where it came from, why not (one line), and
    the machine's uptime for ageing boot-relative stamps."""

    text: str | None
    source: str
    refused: str | None = None
    uptime_s: float | None = None


def uptime_s(path: Path = Path("/proc/uptime")) -> float | None:
    """Seconds since boot (the first number of ``/proc/uptime``); ``None`` where it cannot be read."""
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _tool(name: str) -> str | None:
    # A scheduler's health check may run with no PATH at all (slurmd's HealthCheckProgram).
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def _run(cmd: list[str], timeout_s: float) -> tuple[str | None, str | None]:
    """(stdout, None) or (None, the one-line reason)."""
    name = Path(cmd[0]).name
    tool = _tool(cmd[0])
    if tool is None:
        return None, f"{name}: not installed"
    env = {**os.environ, "LC_ALL": "C", "TZ": os.environ.get("TZ", "")}
    if not env["TZ"]:
        env.pop("TZ")
    try:
        done = subprocess.run(
            [tool, *cmd[1:]], capture_output=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return None, f"{name}: no answer within {timeout_s:g} s"
    except OSError as exc:
        return None, f"{name}: {exc.strerror or exc}"
    out = done.stdout[-MAX_LOG_BYTES:]
    err = done.stderr.decode(errors="replace").strip()
    first_err = err.splitlines()[0] if err else ""
    if done.returncode != 0:
        return None, f"{name}: {_short(first_err) or f'exit status {done.returncode}'}"
    if not out.strip() and first_err:  # journalctl without permission: no lines, only a hint
        return None, f"{name}: {_short(first_err)}"
    return out.decode("utf-8", errors="replace"), None


def _short(message: str) -> str:
    """``dmesg: read kernel buffer failed: Operation not permitted`` -> ``Operation not permitted``."""
    return message.rsplit(": ", 1)[-1].strip()[:200]


def read_kernel_log(since_s: float | None = None, timeout_s: float = TIMEOUT_S) -> KernelLog:
    """This machine's kernel log: ``dmesg``, else ``journalctl -k`` (from ``since_s`` seconds ago)."""
    up = uptime_s()
    text, dmesg_why = _run(["dmesg"], timeout_s)
    if text is not None:
        return KernelLog(text, "dmesg", None, up)
    cmd = ["journalctl", "-k", "-o", "short-iso", "--no-pager", "-q"]
    if since_s is not None:
        cmd.append(f"--since=-{int(since_s) + 1}s")
    text, journal_why = _run(cmd, timeout_s)
    if text is not None:
        return KernelLog(text, "journalctl -k", None, up)
    return KernelLog(None, "dmesg", f"{dmesg_why}; {journal_why}", up)


def read_log_file(name: str) -> KernelLog:
    """A saved kernel log (``--kernel-log FILE``, ``-`` for stdin); ``InputError`` (exit 2) for one that
    cannot be read, is too large or is not text. Boot-relative stamps in a saved log are aged with this
    machine's uptime only when the log is read from stdin or a file written since boot."""
    try:
        if name == "-":
            data = sys.stdin.buffer.read(MAX_LOG_BYTES + 1)
        else:
            with open(name, "rb") as f:
                data = f.read(MAX_LOG_BYTES + 1)
    except OSError as exc:
        raise InputError(
            f"--kernel-log {name}: cannot read it ({exc.strerror or exc})",
            "pass a saved `dmesg` or `journalctl -k -o short-iso` output, or - for stdin",
        ) from None
    up = uptime_s()
    if name != "-" and up is not None:
        try:
            written_this_boot = os.stat(name).st_mtime >= time.time() - up
        except OSError:
            written_this_boot = False
        if not written_this_boot:
            up = None  # another boot's seconds: their age is unknown
    return KernelLog(decode_log(data, name), name, None, up)
