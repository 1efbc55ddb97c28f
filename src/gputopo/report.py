"""Writing reports under ``reports/``: a JSON document and its Markdown, each written atomically.

Generic, so every command that leaves a report (``probe``, ``doctor``) names its files the same way:
``<kind>-<UTC time>.json`` and ``.md``, e.g. ``probe-20261121T153000Z.json``. A reader never sees half a
file: each is written under a unique temporary name in the same folder, flushed to disk, then put in
place. Runs at the same moment never share a name: the JSON file is claimed by an exclusive create (a
hard link of the finished temporary file, which fails when the name exists; ``O_EXCL`` where the file
system has no hard links), never by looking first. Only regular files are replaced: at a path that holds
a device, a fifo or a folder nothing is written (``NotRegularFile``), and a symbolic link is written
through (its target gets the content), never replaced by a file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gputopo.errors import UsageError

_KIND_RE = re.compile(r"[a-z][a-z0-9-]*")


class NotRegularFile(UsageError):
    """A path to write holds something other than a regular file (a device, a fifo, a folder): exit 2."""


def ensure_report_dir(report_dir: Path) -> None:
    """Create ``report_dir`` now, before a long run, so an unwritable one fails in a second, not after."""
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(report_dir, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as exc:
        raise UsageError(
            f"cannot write the report to {report_dir}: {exc.strerror or exc}",
            "choose a writable folder with --report-dir",
        ) from None


def report_paths(
    kind: str, report_dir: Path, now: datetime | None = None, html: bool = False
) -> dict[str, str]:
    """The paths a report written now would get; a suffix ``-2``, ``-3``... keeps same-second runs apart.

    ``html`` adds an ``.html`` path beside the JSON and Markdown ones. A look, not a claim: ``write_report``
    claims its name exclusively.
    """
    now = now or datetime.now(timezone.utc)
    n = 1
    while True:
        paths = _candidate(kind, report_dir, now, n, html)
        if not any(Path(p).exists() for p in paths.values()):
            return paths
        n += 1


def _candidate(kind: str, report_dir: Path, now: datetime | None, n: int, html: bool) -> dict[str, str]:
    """The ``n``-th name for a report written at ``now``: ``kind-STAMP`` then ``kind-STAMP-n``."""
    if not _KIND_RE.fullmatch(kind):
        raise ValueError(f"report kind {kind!r}: lower-case letters, digits and dashes only")
    stamp = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    stem = f"{kind}-{stamp}" if n == 1 else f"{kind}-{stamp}-{n}"
    paths = {"json": report_dir / f"{stem}.json", "markdown": report_dir / f"{stem}.md"}
    if html:
        paths["html"] = report_dir / f"{stem}.html"
    return {k: str(p) for k, p in paths.items()}


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a fifo"),
    (stat.S_ISSOCK, "a socket"),
)


def write_target(path: Path) -> Path:
    """Where writing ``path`` puts the content: ``path`` itself, or the file its symbolic link(s) name.

    Raises ``NotRegularFile`` when that holds anything but a regular file (nothing is touched).
    """
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return target
    except OSError as exc:
        raise UsageError(
            f"{path}: cannot be written ({exc.strerror or exc})", "choose another file"
        ) from None
    for test, what in _KINDS:
        if test(mode):
            raise NotRegularFile(
                f"{path}: is {what}, not a regular file; nothing was written",
                "name a regular file (or a new one) to write",
            )
    return target


def _finished_temp(folder: Path, name: str, text: str) -> Path:
    """``text`` in a new, uniquely named temporary file in ``folder``, flushed to disk."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and a rename; a symbolic link
    is written through (its target replaced, the link kept); a non-regular file is refused
    (``NotRegularFile``) and left untouched."""
    target = write_target(path)
    tmp = _finished_temp(target.parent, target.name, text)
    try:
        if target.exists():
            with contextlib.suppress(OSError):
                os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def exclusive_write(path: Path, text: str) -> bool:
    """Write ``text`` to the new file ``path`` whole, or return ``False`` when the name is taken (by
    anything: a file, a link, a device). Exclusive and atomic: the finished temporary file is hard-linked
    to ``path``; where the file system has no hard links, ``path`` is created with ``O_EXCL``."""
    tmp = _finished_temp(path.parent, path.name, text)
    try:
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        return True
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_report(
    kind: str,
    data: dict[str, Any],
    markdown: str,
    report_dir: Path,
    now: datetime | None = None,
    html: str | None = None,
) -> dict[str, str]:
    """Write ``data`` as JSON and ``markdown`` (and ``html``, when given) beside it; return the paths
    (``{"json": path, "markdown": path}``, plus ``"html"``).

    The JSON file gets the same mapping under its ``"report"`` key, so the document names its own files.
    Its name is claimed exclusively (``exclusive_write``): a run writing at the same moment takes the
    next suffix. Raises ``UsageError`` (exit 2) when ``report_dir`` cannot be created or written; a
    failed write leaves none of this report's files behind.
    """
    ensure_report_dir(report_dir)
    now = now or datetime.now(timezone.utc)
    written: list[Path] = []
    try:
        for n in range(1, 10_000):
            paths = _candidate(kind, report_dir, now, n, html is not None)
            if any(Path(p).exists() for k, p in paths.items() if k != "json"):
                continue  # a leftover Markdown or HTML file of that name: never overwrite it
            if exclusive_write(Path(paths["json"]), json.dumps({**data, "report": paths}, indent=2) + "\n"):
                break
        else:
            raise OSError(errno.EEXIST, "no free report name")
        written.append(Path(paths["json"]))
        atomic_write(Path(paths["markdown"]), markdown)
        written.append(Path(paths["markdown"]))
        if html is not None:
            atomic_write(Path(paths["html"]), html)
    except OSError as exc:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()
        raise UsageError(
            f"cannot write the report to {report_dir}: {exc.strerror or exc}",
            "choose a writable folder with --report-dir",
        ) from None
    return paths
