"""The one safe writer of every file gputopo writes where a user pointed it (``report --html``, ``hang
--html``, ``check --save-baseline``, the reports under ``reports/``), beside ``inputs.py``, the one reader.

A reader never sees half a file: each is written under a unique temporary name in the same folder, flushed
to disk, then renamed into place. Only regular files are replaced: at a path that holds a folder, a device,
a fifo or a socket nothing is written (``NotRegularFile``, exit 2), and the path is never opened, so a fifo
nobody reads cannot block; a symbolic link is written through (its target gets the content, the link
stays). ``exclusive_write`` claims a new name without looking first (a hard link of the finished file).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from gputopo.errors import UsageError


class NotRegularFile(UsageError):
    """A path to write holds something other than a regular file (a device, a fifo, a folder): exit 2."""


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


def finished_temp(folder: Path, name: str, text: str, mode: int | None = None) -> Path:
    """``text`` in a new, uniquely named temporary file ``.<name>.*.tmp`` in ``folder``, flushed to disk,
    ready to be renamed or linked into place (by ``atomic_write``, ``exclusive_write``, the check state's
    writer); ``mode`` its permissions, where the umask must not decide them. ``OSError`` when it cannot be
    made; nothing is left behind then."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        if mode is not None:
            try:
                os.fchmod(fd, mode)
            except BaseException:
                os.close(fd)
                raise
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
    tmp = finished_temp(target.parent, target.name, text)
    try:
        if target.exists():
            with contextlib.suppress(OSError):
                os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def check_output(path: Path, option: str, example: str = "out.txt") -> None:
    """Refuse, before any work, a user-named output path that cannot take a file: a folder, a device, a
    fifo or a socket (never replaced by a file, and never opened, so a fifo nobody reads cannot block),
    or a folder that does not exist. One line each (``UsageError``, exit 2); a symbolic link is written
    through. ``option`` names the flag in the message (``--html``, ``--save-baseline``)."""
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a folder", f"name the file to write, e.g. {option} {example}")
    try:
        write_target(path)
    except NotRegularFile as exc:
        raise NotRegularFile(f"{option} {exc.message}", exc.hint) from None
    except UsageError as exc:
        raise UsageError(f"{option} {exc.message}", exc.hint) from None
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(
            f"{option} {path}: cannot write: the folder {parent} does not exist",
            "create it, or pick another path",
        )


def write_output(path: Path, text: str, option: str) -> None:
    """The one safe writer of every output file a user names (``report --html``, ``hang --html``,
    ``check --save-baseline``, ...): the checks of ``check_output``, then ``atomic_write`` (a regular file
    is replaced whole, a link written through); a write that fails (no space, no permission) is one line,
    exit 2."""
    check_output(path, option)
    try:
        atomic_write(path, text)
    except NotRegularFile as exc:  # the path changed under us since the check
        raise NotRegularFile(f"{option} {exc.message}", exc.hint) from None
    except OSError as exc:
        raise UsageError(
            f"{option} {path}: cannot write ({exc.strerror or exc})", "choose a writable file"
        ) from None


def exclusive_write(path: Path, text: str) -> bool:
    """Write ``text`` to the new file ``path`` whole, or return ``False`` when the name is taken (by
    anything: a file, a link, a device). Exclusive and atomic: the finished temporary file is hard-linked
    to ``path``; where the file system has no hard links, ``path`` is created with ``O_EXCL``."""
    tmp = finished_temp(path.parent, path.name, text)
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
