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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gputopo.errors import UsageError
from gputopo.outputs import atomic_write, exclusive_write

_KIND_RE = re.compile(r"[a-z][a-z0-9-]*")


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
