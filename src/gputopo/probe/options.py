"""The probe's choices as the command line names them: which checks, which faults.

Kept apart from ``config`` so the CLI can declare its options without loading the probe's machinery.
"""

from __future__ import annotations

from enum import Enum

# Checks in the order one launch runs them: the exact copy check first, so a broken path is named before
# the training checks fail in its wake.
CHECK_ORDER = ("p2p", "dp", "ddp", "allreduce")


class Mode(str, Enum):
    """What to probe: one check, or all of them."""

    DP = "dp"
    DDP = "ddp"
    ALLREDUCE = "allreduce"
    P2P = "p2p"
    ALL = "all"

    @property
    def checks(self) -> tuple[str, ...]:
        """The checks this mode runs, in launch order."""
        return CHECK_ORDER if self is Mode.ALL else (self.value,)


class Fault(str, Enum):
    """A fault planted in one rank to show that a detector fires."""

    NAN = "nan"
    CORRUPT = "corrupt"
    HANG = "hang"
    CRASH = "crash"
