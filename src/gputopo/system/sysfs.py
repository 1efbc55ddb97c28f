"""One re-rootable view of sysfs, procfs and /etc (touches the machine).

``GPUTOPO_SYSFS_ROOT`` (default ``/sys``), ``GPUTOPO_PROCFS_ROOT`` (default ``/proc``) and
``GPUTOPO_ETC_ROOT`` (default ``/etc``: the IMEX configuration) move every read made through this view to
another tree, as node_exporter's ``--path.sysfs`` / ``--path.procfs`` do: tests build a captured-shape tree
and point gputopo at it, and a user can judge a tree copied off another node. Symbolic
links inside the tree (``/sys/bus/pci/devices/BDF`` -> ``../../../devices/pci0000:00/...``) are relative in a
real sysfs, so they resolve inside the re-rooted tree as well.

Every read here answers ``None`` (or an empty list) when the file is missing or refused: sysfs files vanish
with hot-unplug and answer ``EINVAL`` for a link that is down (``/sys/class/net/IF/speed``); the caller
says "not read", never a made-up value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SYSFS_ENV = "GPUTOPO_SYSFS_ROOT"
PROCFS_ENV = "GPUTOPO_PROCFS_ROOT"
ETC_ENV = "GPUTOPO_ETC_ROOT"
DEFAULT_SYSFS = Path("/sys")
DEFAULT_PROCFS = Path("/proc")
DEFAULT_ETC = Path("/etc")
# Larger than any sysfs attribute this view reads (a PCI config space is 4096 bytes).
READ_LIMIT_BYTES = 65536


@dataclass(frozen=True)
class FsView:
    """Where sysfs, procfs and /etc are: ``sys``, ``proc`` and ``etc`` roots."""

    sys: Path = DEFAULT_SYSFS
    proc: Path = DEFAULT_PROCFS
    etc: Path = DEFAULT_ETC

    def sys_path(self, *parts: str) -> Path:
        """``parts`` under the sysfs root (``sys_path("class", "net")``)."""
        return self.sys.joinpath(*parts)

    def proc_path(self, *parts: str) -> Path:
        """``parts`` under the procfs root."""
        return self.proc.joinpath(*parts)

    def etc_path(self, name: str) -> Path:
        """A configuration file under the /etc root: ``etc_path("nvidia-imex/config.cfg")``; an absolute
        path inside ``/etc`` (as a configuration file names another) is moved under the root too, any
        other absolute path is kept as it is."""
        path = Path(name)
        if not path.is_absolute():
            return self.etc / path
        try:
            return self.etc / path.relative_to(DEFAULT_ETC)
        except ValueError:
            return path

    @property
    def rerooted(self) -> bool:
        """Whether the sysfs or procfs root is not the machine's own."""
        return self.sys != DEFAULT_SYSFS or self.proc != DEFAULT_PROCFS


def view(environ: Mapping[str, str] | None = None) -> FsView:
    """The view the environment asks for (an unset or empty variable keeps the default root)."""
    env = os.environ if environ is None else environ
    return FsView(
        Path(env.get(SYSFS_ENV) or DEFAULT_SYSFS),
        Path(env.get(PROCFS_ENV) or DEFAULT_PROCFS),
        Path(env.get(ETC_ENV) or DEFAULT_ETC),
    )


def read_text(path: Path) -> str | None:
    """The file's text, stripped; ``None`` when it cannot be read (missing, refused, EINVAL)."""
    data = read_bytes(path)
    if data is None:
        return None
    return data.decode("utf-8", "replace").strip()


def read_bytes(path: Path, limit: int = READ_LIMIT_BYTES) -> bytes | None:
    """Up to ``limit`` bytes of the file; ``None`` when it cannot be read. A sysfs attribute answers
    with what its reader may see: a PCI ``config`` read by a non-root user is 64 bytes long."""
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def read_int(path: Path) -> int | None:
    """The file as one integer (decimal, or hex with ``0x``); ``None`` when missing or not a number."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def names(folder: Path) -> list[str]:
    """The entries of ``folder``, sorted; ``[]`` when it cannot be listed."""
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def resolve(path: Path) -> Path | None:
    """The real path behind ``path`` (its symbolic links followed); ``None`` when it does not exist."""
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    return real
