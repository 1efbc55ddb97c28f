"""Writing reports under ``reports/``: a JSON document and its Markdown, each written atomically.

Generic, so every command that leaves a report (``probe``, ``doctor``) names its files the same way:
``<kind>-<UTC time>.json`` and ``.md``, e.g. ``probe-20261121T153000Z.json``. A reader never sees half a
file: each is written under a temporary name in the same folder, flushed to disk, then renamed.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gputopo.errors import UsageError

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

    ``html`` adds an ``.html`` path beside the JSON and Markdown ones.
    """
    if not _KIND_RE.fullmatch(kind):
        raise ValueError(f"report kind {kind!r}: lower-case letters, digits and dashes only")
    stamp = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = f"{kind}-{stamp}"
    n = 1
    while True:
        stem = base if n == 1 else f"{base}-{n}"
        paths = {"json": report_dir / f"{stem}.json", "markdown": report_dir / f"{stem}.md"}
        if html:
            paths["html"] = report_dir / f"{stem}.html"
        if not any(p.exists() for p in paths.values()):
            return {k: str(p) for k, p in paths.items()}
        n += 1


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
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
    Raises ``UsageError`` (exit 2) when ``report_dir`` cannot be created or written.
    """
    ensure_report_dir(report_dir)
    try:
        paths = report_paths(kind, report_dir, now, html=html is not None)
        atomic_write(Path(paths["json"]), json.dumps({**data, "report": paths}, indent=2) + "\n")
        atomic_write(Path(paths["markdown"]), markdown)
        if html is not None:
            atomic_write(Path(paths["html"]), html)
    except OSError as exc:
        raise UsageError(
            f"cannot write the report to {report_dir}: {exc.strerror or exc}",
            "choose a writable folder with --report-dir",
        ) from None
    return paths
