"""The check state file on disk: the one reader, the lock, and the one writer (``health.state`` is the
document; this is the file).

- **Read safely** (``read_state``): through ``inputs.read_regular_file`` (a regular file only, never through
  a symbolic link, at most ``MAX_STATE_BYTES``, JSON at most ``inputs.MAX_JSON_DEPTH`` deep), so a fifo, a
  device, deep or huge JSON is a one-line warning, never a hang or a crash. A main file that cannot be
  used falls back to its backup ``<state>.old`` (said).
- **Trust only what root could have written** (``unsafe``): a symbolic link at the path is refused (for
  everyone: ``O_NOFOLLOW``); as root, so are a file another user owns or that is group- or
  world-writable, and a folder another user owns or can write without the sticky bit (``/tmp`` has it).
  Each refusal says why and the fix. The refusal is the caller's to turn into an exit (2; 3 under
  ``--drain``).
- **One writer at a time** (``locked``): an exclusive ``flock`` on ``<state>.lock`` beside the file (never
  removed; removing a lock file lets two writers hold "the" lock at once), waited for at most the time
  given, polled, so a writer that cannot get it gives up in time (``LockNotGot``) instead of hanging.
  Like logrotate's ``--wait-for-state-lock`` and Slurm's ``lock_state_files``. Every writer re-reads
  the file under the lock and changes only its own sections.
- **Saved whole, with a backup** (``save``, under the lock): a temporary file in the same folder, flushed,
  mode 0644 whatever the umask (users' ``recommend`` and ``run`` read root's verdict), renamed into place
  (a rename replaces a link planted meanwhile, never writes through it); the file it replaces is kept as
  ``<state>.old`` (a hard link), and a main file that could not be read is moved aside to
  ``<state>.bad`` rather than replaced. A newer schema, a refused path or a fifo is never written.

``update_section`` is the read-modify-write another command (``accept``) uses for its own top-level
section, ``writer_path`` where it keeps it by default and ``reader_path`` where readers look; see
``health.state``'s docstring for the API.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputopo.errors import GputopoError, InputError
from gputopo.health.state import StateDoc, parse_doc
from gputopo.outputs import finished_temp

# A state file is a few KB (2,000 acknowledged keys at most, a finding per sick GPU): 4 MiB is far beyond.
MAX_STATE_BYTES = 4 * 1024 * 1024
# How often a writer tries the lock again while another holds it.
_POLL_S = 0.02


def writer_path(root_default: bool) -> Path | None:
    """The state a writer keeps when none is named: ``GPUTOPO_CHECK_STATE`` when set (empty: none); for
    root when ``root_default`` (``check --drain``, ``accept``), ``/var/lib/gputopo/check-state.json``;
    else none."""
    from gputopo.health.state import DEFAULT_ROOT_PATH, STATE_ENV

    if STATE_ENV in os.environ:
        value = os.environ[STATE_ENV]
        return Path(value) if value else None
    if root_default and os.geteuid() == 0:
        return Path(DEFAULT_ROOT_PATH)
    return None


def reader_path() -> Path | None:
    """The state a reader reads the last check from: ``GPUTOPO_CHECK_STATE`` (empty: none), else root's
    ``/var/lib/gputopo/check-state.json`` for every user (root saves it 0644 in a 0755 folder)."""
    from gputopo.health.state import DEFAULT_ROOT_PATH, STATE_ENV

    value = os.environ.get(STATE_ENV, DEFAULT_ROOT_PATH)
    return Path(value) if value else None


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def backup_path(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def bad_path(path: Path) -> Path:
    return path.with_name(path.name + ".bad")


class LockNotGot(GputopoError):
    """The state's lock was held by another writer past the time allowed (``busy``), or could not be
    taken at all (no permission to make it, a link or another user's file planted there)."""

    exit_code = 3

    def __init__(self, message: str, hint: str | None = None, busy: bool = False) -> None:
        super().__init__(message, hint)
        self.busy = busy


@dataclass(frozen=True)
class StateRead:
    """The state file as read: the document (``None``: none there, or none usable), the warnings to show,
    ``refused`` with ``hint`` when the path is not to be trusted (nothing read, nothing may be written),
    ``main_bad`` when the main file is there but unusable (the next save moves it aside),
    ``not_regular`` when the path holds a fifo, a device or a folder (never replaced), and
    ``from_backup`` when the document came from ``<state>.old``."""

    path: Path
    doc: StateDoc | None = None
    warnings: tuple[str, ...] = ()
    refused: str | None = None
    hint: str | None = None
    main_bad: bool = False
    not_regular: bool = False
    from_backup: bool = False
    unreadable: bool = False

    @property
    def read_only(self) -> str | None:
        """Why nothing may be saved over this file (``None``: it may)."""
        if self.refused is not None:
            return self.refused
        if self.not_regular:
            return f"{self.path} is not a regular file"
        if self.unreadable:
            return f"{self.path} could not be read, so it is not replaced"
        if self.doc is not None and self.doc.newer:
            return f"{self.path} was written by a newer gputopo (schema v{self.doc.version})"
        return None


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def unsafe(path: Path, label: str) -> tuple[str, str] | None:
    """Why the state at ``path`` is not to be trusted, and the fix; ``None`` when it is. A symbolic link
    always; as root, a file another user owns or that is group- or world-writable, and a folder another
    user owns or can write without the sticky bit."""
    try:
        info: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError:
        info = None  # the read says why
    if info is not None and stat.S_ISLNK(info.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return (
            f"{label}: is a symbolic link (to {target}); gputopo never reads or writes a state through one",
            f"name the real file, or remove the link (rm {path})",
        )
    if os.geteuid() != 0:
        return None
    folder = path.parent
    try:
        folder_info = os.stat(folder)
    except OSError:
        folder_info = None  # missing: created by root on the first save
    if folder_info is not None:
        mode = stat.S_IMODE(folder_info.st_mode)
        if folder_info.st_uid != 0:
            return (
                f"{label}: its folder {folder} belongs to {_owner(folder_info.st_uid)}, not root; root "
                "trusts only a state no other user could have written",
                f"keep the state in a folder only root writes (the default {folder.root}var/lib/gputopo), "
                f"or sudo chown root {folder}",
            )
        if mode & 0o022 and not mode & stat.S_ISVTX:
            return (
                f"{label}: its folder {folder} is writable by others (mode {mode:04o}) without the sticky "
                "bit; another user could replace the state",
                f"sudo chmod go-w {folder}, or keep the state in a folder only root writes",
            )
    if info is not None and stat.S_ISREG(info.st_mode):
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid != 0:
            return (
                f"{label}: owned by {_owner(info.st_uid)}, not root; root trusts only a state no other "
                "user could have written (an acknowledgement in it stops a drain)",
                f"look at what it says; then remove it (rm {path}) or make it root's: "
                f"sudo chown root:root {path} && sudo chmod 644 {path}",
            )
        if mode & 0o022:
            return (
                f"{label}: writable by {'everyone' if mode & 0o002 else 'its group'} (mode {mode:04o}); "
                "root trusts only a state no other user could have written",
                f"look at what it says; then sudo chmod 644 {path} (or remove it)",
            )
    return None


def _read_one(path: Path, label: str, node: str) -> tuple[str, StateDoc | None, str | None]:
    """One file: (kind, document, why) with kind ``ok`` (a document, maybe newer: ``why`` warns),
    ``missing``, ``not_regular``, ``unreadable`` (no permission, I/O) or ``bad`` (too large, too deep,
    not JSON, not a state, another node's)."""
    from gputopo.inputs import NotRegular, loads_bounded, read_regular_file

    try:
        data = read_regular_file(path, label, MAX_STATE_BYTES)
    except NotRegular as exc:
        return "not_regular", None, exc.message
    except InputError as exc:
        kind = "bad" if "larger than" in exc.message else "unreadable"
        return kind, None, exc.message
    if data is None:
        return "missing", None, None
    try:
        raw = loads_bounded(data, label)
    except InputError as exc:
        return "bad", None, exc.message
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        return "bad", None, f"{label}: corrupt ({first})"
    doc, why = parse_doc(raw, label, node)
    if doc is None:
        return "bad", None, why
    return "ok", doc, why


def read_state(path: Path, node: str, label: str | None = None, fresh: str = "starting afresh") -> StateRead:
    """The state at ``path`` for ``node``, never raising: see ``StateRead``. ``label`` starts every
    warning (default ``--state PATH``); ``fresh`` ends the warning of a file that could not be used."""
    label = label or f"--state {path}"
    refused = unsafe(path, label)
    if refused is not None:
        return StateRead(path, refused=refused[0], hint=refused[1])
    kind, doc, why = _read_one(path, label, node)
    if kind == "ok":
        return StateRead(path, doc, (why,) if why else ())
    if kind == "missing":
        return StateRead(path)
    if kind == "not_regular":
        return StateRead(path, warnings=(f"{why}; not read, and nothing is saved over it",), not_regular=True)
    old = backup_path(path)
    old_kind, old_doc, _ = ("missing", None, None)
    if unsafe(old, label) is None:
        old_kind, old_doc, _ = _read_one(old, f"{label} (its backup {old.name})", node)
    moved = " (moved aside to " + bad_path(path).name + " on the next save)" if kind == "bad" else ""
    if old_kind == "ok" and old_doc is not None and not old_doc.newer:
        when = _age(old)
        return StateRead(
            path,
            old_doc,
            (f"{why}{moved}; read its backup {old}{when} instead",),
            main_bad=kind == "bad",
            from_backup=True,
            unreadable=kind == "unreadable",
        )
    return StateRead(
        path, warnings=(f"{why}{moved}; {fresh}",), main_bad=kind == "bad", unreadable=kind == "unreadable"
    )


def _age(path: Path) -> str:
    try:
        age = time.time() - os.lstat(path).st_mtime
    except OSError:
        return ""
    return f" (saved {age / 60:.0f} min ago)" if age >= 60 else f" (saved {max(age, 0):.0f} s ago)"


@contextlib.contextmanager
def locked(path: Path, wait_s: float) -> Iterator[None]:
    """Hold the exclusive lock on ``<path>.lock`` (the folder made when missing), waiting at most
    ``wait_s`` seconds for it; ``LockNotGot`` (exit 3) when another writer holds it longer or it cannot
    be taken (a link or another user's file planted there, no permission)."""
    where = lock_path(path)
    _make_folder(path.parent)
    refused = unsafe(where, f"the lock {where}")
    if refused is not None:
        raise LockNotGot(refused[0], refused[1])
    try:
        fd = os.open(
            where, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o600
        )
    except OSError as exc:
        raise LockNotGot(
            f"the lock {where}: cannot open it ({exc.strerror or exc})",
            "run as the user that owns the state (root for the default), or name a state of your own",
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LockNotGot(f"the lock {where}: not a regular file", f"remove it (rm {where})")
        if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != 0o600:
            # Only its owner may open it: flock needs no write permission, so a lock file others can read
            # would let any user hold root's lock and stop every check (exit 3).
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o600)
        deadline = time.monotonic() + max(0.0, wait_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise LockNotGot(
                        f"the lock {where}: cannot take it ({exc.strerror or exc})",
                        "keep the state on a local file system",
                    ) from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockNotGot(
                    f"the lock {where} was held by another gputopo past the time allowed "
                    f"({max(0.0, wait_s):.1f} s of --budget)",
                    "another check or accept was writing the state; the next run tries again",
                    busy=True,
                )
            time.sleep(min(_POLL_S, left))
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _make_folder(folder: Path) -> None:
    if folder.is_dir():
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o755)  # the umask does not decide who may read root's verdict
    except OSError as exc:
        raise LockNotGot(
            f"the state's folder {folder}: cannot make it ({exc.strerror or exc})",
            "make it, or name a state in a folder you can write",
        ) from None


def save(read: StateRead, doc: StateDoc) -> str | None:
    """Write ``doc`` over the file ``read`` came from (call under ``locked``, with ``read`` re-read under
    it); ``None`` when saved, else why not (a warning). See the module docstring."""
    path = read.path
    why_not = read.read_only
    if why_not is not None:
        return f"{path}: not saved ({why_not})"
    from gputopo.health.state import dumps_doc

    try:
        tmp = finished_temp(path.parent, path.name, dumps_doc(doc), mode=0o644)
    except OSError as exc:
        return f"{path}: not saved ({exc.strerror or exc})"
    try:
        if read.main_bad:
            os.replace(path, bad_path(path))
        elif read.doc is not None and not read.from_backup:
            _keep_backup(path)
        os.replace(tmp, path)
        _sync_folder(path.parent)
    except OSError as exc:
        return f"{path}: not saved ({exc.strerror or exc})"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return None


def _keep_backup(path: Path) -> None:
    """``<state>.old`` becomes the file about to be replaced (a hard link: never a moment without it)."""
    link = path.with_name(f".{path.name}.old.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(link)
    try:
        os.link(path, link)
    except OSError:
        import shutil

        shutil.copyfile(path, link, follow_symlinks=False)
        os.chmod(link, 0o644)
    os.replace(link, backup_path(path))


def _sync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class Saved:
    """What ``update_section`` did: ``saved``, or ``why_not`` with ``hint``; ``warnings`` from the read
    (a corrupt main file read from its backup, ...); ``exit_code`` the exit a command should give when it
    could not keep its section (2 an unsafe path, 3 a lock not got in time or a newer schema)."""

    saved: bool
    why_not: str | None = None
    hint: str | None = None
    warnings: tuple[str, ...] = ()
    exit_code: int = 0


def update_section(path: Path, node: str, name: str, change: Callable[[Any], Any], wait_s: float) -> Saved:
    """Replace section ``name`` of the state at ``path`` (made when missing) with ``change(old)``, under the
    lock: wait at most ``wait_s`` for it, re-read the file, change only that section, save (the previous
    file kept as ``<state>.old``). ``change`` gets the section as stored (``None`` when absent) and
    returns the new value (``None`` removes it). Never raises for the file; see ``Saved``."""
    label = f"state {path}"
    refused = unsafe(path, label)
    if refused is not None:
        return Saved(False, refused[0], refused[1], exit_code=2)
    try:
        with locked(path, wait_s):
            read = read_state(path, node, label)
            if read.refused is not None:
                return Saved(False, read.refused, read.hint, read.warnings, 2)
            why_not = read.read_only
            if why_not is not None:
                return Saved(False, f"{label}: not saved ({why_not})", None, read.warnings, 3)
            doc = read.doc if read.doc is not None else StateDoc(node)
            failed = save(read, doc.with_section(name, change(doc.section(name))))
            if failed is not None:
                return Saved(False, failed, None, read.warnings, 3)
            return Saved(True, warnings=read.warnings)
    except LockNotGot as exc:
        return Saved(False, exc.message, exc.hint, exit_code=3)
