"""Reading what a user hands gputopo (``--input``, stdin, reports, baselines, thresholds) within bounds.

Every reader goes through here, so one size cap and one depth cap hold everywhere: a file larger than
``MAX_INPUT_BYTES`` is refused from its size (a regular file) or after reading one byte past the cap
(anything else: ``/dev/zero``, a fifo, stdin), so no input can hang or exhaust memory; a fifo with no
writer reads as empty instead of blocking. JSON is parsed by the standard library (whose C decoder
raises ``RecursionError`` on very deep nesting, caught here) and then refused when it nests deeper than
``MAX_JSON_DEPTH``. NCCL's topology XML has the same caps (``topology.nccl_xml``). Errors are
``InputError`` (exit 2) in one line that starts with the label the user would recognise (``--input X``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from gputopo.errors import InputError

# Real inputs are small: `topo -m` text and NCCL XML dumps are 1-100 KB, a doctor report of 16 GPUs with
# every probe's sweep well under 2 MB. The cap keeps a wrong file from costing minutes and gigabytes
# (parsing 48 MB of JSON took 75 s and 1.9 GB).
MAX_INPUT_BYTES = 16 * 1024 * 1024
# Reports nest about 8 deep (sets > checks > metrics > rows > row); NCCL XML about 10.
MAX_JSON_DEPTH = 64
_CHUNK = 1 << 20


def _too_large(label: str, cap: int) -> InputError:
    return InputError(
        f"{label}: larger than {_size(cap)}, the most gputopo reads",
        "give the saved output or report itself (real ones are far smaller)",
    )


def _size(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n >= 1024 * 1024 else f"{n} bytes"


def read_capped(path: Path, label: str, cap: int = MAX_INPUT_BYTES, hint: str | None = None) -> bytes:
    """The bytes at ``path``, at most ``cap`` of them (``InputError`` beyond); see the module docstring.

    ``label`` starts every message (e.g. ``--input topo.txt``); ``hint`` replaces the default hint for
    a missing file.
    """
    try:
        # O_NONBLOCK: opening a fifo nobody writes to returns at once (and reads as empty) instead of
        # waiting forever; it is cleared again below so a pipe with a writer is read as it comes.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise InputError(f"{label}: no such file", hint or "check the path") from None
    except IsADirectoryError:
        raise InputError(f"{label}: is a folder, not a file", "name the file itself") from None
    except OSError as exc:
        raise _cannot_read(label, exc, "check the path and its permissions") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise InputError(f"{label}: is a folder, not a file", "name the file itself")
        if stat.S_ISREG(info.st_mode) and info.st_size > cap:
            raise _too_large(label, cap)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return _read_fd(fd, label, cap)
    except OSError as exc:
        raise _cannot_read(label, exc) from None
    finally:
        os.close(fd)


class NotRegular(InputError):
    """A path that must hold a regular file holds a fifo, a device, a socket or a folder."""


_NOT_REGULAR = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a fifo"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str | None:
    return next((what for test, what in _NOT_REGULAR if test(mode)), None)


def _not_regular(label: str, what: str) -> NotRegular:
    return NotRegular(f"{label}: is {what}, not a regular file", "remove it, or name a regular file")


def _cannot_read(label: str, exc: OSError, hint: str = "check the path") -> InputError:
    return InputError(f"{label}: cannot read ({exc.strerror or exc})", hint)


def read_regular_file(path: Path, label: str, cap: int = MAX_INPUT_BYTES) -> bytes | None:
    """The bytes of the regular file at ``path``, or ``None`` when there is none: for files gputopo keeps
    itself (the check state), where anything else at the path is a mistake or a trap. Never through a
    symbolic link (``O_NOFOLLOW``), never opens a fifo, device or socket for reading (looked at first,
    and again on the open descriptor), at most ``cap`` bytes. ``NotRegular`` for a fifo, device, socket
    or folder; ``InputError`` for a link, a file over ``cap``, or one that cannot be read."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _cannot_read(label, exc) from None
    if stat.S_ISLNK(info.st_mode):
        raise InputError(f"{label}: is a symbolic link, not followed", "name the real file")
    what = _kind(info.st_mode)
    if what is not None:
        raise _not_regular(label, what)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _cannot_read(label, exc, "check the path and its permissions") from None
    try:
        info = os.fstat(fd)
        what = _kind(info.st_mode)
        if what is not None:  # replaced between the look and the open
            raise _not_regular(label, what)
        if info.st_size > cap:
            raise _too_large(label, cap)
        return _read_fd(fd, label, cap)
    except OSError as exc:
        raise _cannot_read(label, exc) from None
    finally:
        os.close(fd)


def _read_fd(fd: int, label: str, cap: int) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        chunk = os.read(fd, min(_CHUNK, cap + 1 - total))
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        total += len(chunk)
        if total > cap:
            raise _too_large(label, cap)


def read_stream_capped(stream: Any, label: str, cap: int = MAX_INPUT_BYTES) -> bytes:
    """At most ``cap`` bytes from a binary stream (stdin's buffer); ``InputError`` beyond."""
    parts: list[bytes] = []
    total = 0
    while True:
        chunk = stream.read(min(_CHUNK, cap + 1 - total))
        if not chunk:
            return b"".join(parts)
        if isinstance(chunk, str):
            chunk = chunk.encode("utf-8", errors="replace")
        parts.append(chunk)
        total += len(chunk)
        if total > cap:
            raise _too_large(label, cap)


def parse_json(text: str | bytes, label: str, hint: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``text`` parsed as JSON; ``InputError`` for text that is not JSON or nests deeper than
    ``max_depth``. ``json.JSONDecodeError`` is a ``ValueError``: callers that word it themselves catch it
    first by calling ``json.loads`` through ``loads_bounded``."""
    import json

    try:
        return loads_bounded(text, label, max_depth)
    except json.JSONDecodeError as exc:
        raise InputError(f"{label}: not JSON (line {exc.lineno}: {exc.msg})", hint) from None


def loads_bounded(text: str | bytes, label: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` with the size and depth caps: ``InputError`` when too large or too deep;
    ``json.JSONDecodeError`` (for the caller to word) when not JSON."""
    import json  # only JSON inputs need it; `topo --input FILE.txt` starts without it

    if len(text) > MAX_INPUT_BYTES:
        raise _too_large(label, MAX_INPUT_BYTES)
    try:
        doc = json.loads(text)
    except RecursionError:
        raise _too_deep(label, max_depth) from None
    if depth_exceeds(doc, max_depth):
        raise _too_deep(label, max_depth)
    return doc


def _too_deep(label: str, max_depth: int) -> InputError:
    return InputError(
        f"{label}: JSON nested deeper than {max_depth} levels, which no gputopo file is",
        "give the file gputopo wrote, not another document",
    )


def depth_exceeds(doc: Any, max_depth: int) -> bool:
    """True when lists and objects in ``doc`` nest deeper than ``max_depth`` (no recursion)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def read_json_file(path: Path, label: str, hint: str) -> object:
    """The JSON document at ``path``; every way it can be unreadable is an ``InputError`` in plain words
    that starts with ``label`` (the option and path as the user wrote them)."""
    import json  # only reports need it; kept out of start-up

    raw = read_capped(path, label, hint=hint)
    try:
        return loads_bounded(raw.decode("utf-8-sig"), label)
    except UnicodeDecodeError:
        raise InputError(f"{label}: binary data, not a JSON report", hint) from None
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{label}: not JSON (line {exc.lineno}: {exc.msg})",
            "give the .json report, not the Markdown or HTML one",
        ) from None
