"""The probe's choices as the command line names them: which checks, which faults.

Kept apart from ``config`` so the CLI (through ``services.probe``) can declare its options without loading
the probe's machinery.
"""

from __future__ import annotations

from enum import Enum

# The probe's defaults, written once: ``services.probe.Options`` takes them (the CLI declares its options
# with ``services.probe.DEFAULTS``), and ``config.build_config`` and ``config.ProbeConfig`` fall back on them.
DEFAULT_MODEL = "resnet18"
DEFAULT_BATCH_SIZE = 16  # images per GPU per step
DEFAULT_STEPS = 20
DEFAULT_LR = 0.05
DEFAULT_SEED = 0
DEFAULT_TIMEOUT_S = 300.0  # a set may go this long without progress before it is hung
DEFAULT_STEP_FACTOR = 2  # nccl-tests' -f
DEFAULT_REPORT_DIR = "reports"

# Checks in the order one launch runs them: every GPU on its own first (a slow or corrupt GPU is named
# before the sets it belongs to fail in its wake), then the exact copy check, so a broken path is named
# before the training checks fail in its wake.
CHECK_ORDER = ("gpu", "p2p", "dp", "ddp", "allreduce", "speed")


class Mode(str, Enum):
    """What to probe: one check, or all of them."""

    DP = "dp"
    DDP = "ddp"
    ALLREDUCE = "allreduce"
    P2P = "p2p"
    GPU = "gpu"
    SPEED = "speed"
    ALL = "all"

    @property
    def checks(self) -> tuple[str, ...]:
        """The checks this mode runs, in launch order (``all`` is every check but the speed table)."""
        return tuple(c for c in CHECK_ORDER if c != "speed") if self is Mode.ALL else (self.value,)


class Fault(str, Enum):
    """A fault planted in one rank to show that a detector fires."""

    NAN = "nan"
    CORRUPT = "corrupt"
    HANG = "hang"
    CRASH = "crash"
    OVERFLOW = "overflow"
    # On one machine: the per-GPU check does its timed work twice on the GPUs named (half the speed);
    # across nodes: a delay before each of one node's collectives (a straggler).
    SLOW = "slow"
    SDC = "sdc"  # silent data corruption: one bit of the per-GPU check's result flipped on the GPUs named
    # Across nodes only, on CPU ranks (which have no NCCL): the ranks of --inject-node write NCCL's log of
    # an NVLink domain that is there but unusable (no IMEX channel) and stop as NCCL does (judge.mnnvl).
    MNNVL = "mnnvl"


# What the inter-node tests can plant (``gputopo.probe.ranks.crossnode``): no training runs there.
ACROSS_NODE_FAULTS = (Fault.SLOW, Fault.CORRUPT, Fault.HANG, Fault.CRASH, Fault.MNNVL)
# What only the per-GPU check (``gputopo.probe.ranks.pergpu``) can plant on one machine.
PER_GPU_FAULTS = (Fault.SLOW, Fault.SDC)


class Precision(str, Enum):
    """The numeric precision of the dp and ddp checks (``gputopo.probe.judge.precision``)."""

    FP32 = "fp32"
    TF32 = "tf32"
    FP16 = "fp16"
    BF16 = "bf16"


def check_rank(check: str) -> int:
    """Where a check id (``dp``, ``dp@fp16``, ``speed``...) sorts in launch order: by its base name."""
    return CHECK_ORDER.index(check.partition("@")[0])
