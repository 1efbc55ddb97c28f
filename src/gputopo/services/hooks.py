"""The callbacks a service is handed (typed callbacks, never a console or a typer object):
``Warn`` is the least of them, a line for stderr; a service's own ``Hooks`` adds what else it says."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def ignore(*_: object) -> None:
    """A callback that says nothing (a service called without hooks, as in tests)."""
    return None


@dataclass(frozen=True)
class Warn:
    """``warn``: a warning line for stderr, said as it is found."""

    warn: Callable[[str], None] = ignore
