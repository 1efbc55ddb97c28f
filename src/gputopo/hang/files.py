"""The one way ``hang``'s readers open a file an option names (``--ras-json``, ``--nccl-log``, a run
record): its bytes, at most a cap, or an ``InputError`` that names the option and the file, with the
reader's hint."""

from __future__ import annotations

from pathlib import Path

from gputopo.errors import InputError
from gputopo.inputs import read_capped


def read_named(path: Path, label: str, cap: int, too_large: str, hint: str) -> bytes:
    """The bytes at ``path`` (``label`` starts every message, e.g. ``--ras-json FILE``): a missing,
    unreadable or larger than ``cap`` file is an ``InputError`` (``too_large``: the words after "over")."""
    try:
        # Refused before a byte is read: the cap's own words say what the file should have been.
        if path.stat().st_size > cap:
            raise InputError(f"{label}: over {too_large}", hint)
        return read_capped(path, label, cap, hint)
    except FileNotFoundError:
        raise InputError(f"{label}: no such file", hint) from None
    except OSError as exc:
        raise InputError(f"{label}: cannot read ({exc.strerror or exc})", hint) from None
