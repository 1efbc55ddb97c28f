"""How a rank computes and talks, recorded for the judge: pinned numerics (deterministic kernels, no
TF32) and the NCCL transport of each connection, read from the ranks' NCCL INIT logs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gputopo.probe.ranks.context import RankContext


def pin_numerics(torch_module: Any = torch) -> dict[str, Any]:
    """Make every rank and the reference compute the same way, and say how: the judge compares their
    curves, so kernel-choice noise must not read as ``diverged``.

    Deterministic algorithms (``warn_only``: some ResNet backward kernels, e.g. CUDA adaptive average
    pooling, have no deterministic version and would otherwise raise; see the list under
    ``torch.use_deterministic_algorithms``), deterministic cuDNN without benchmark autotuning, and no TF32.
    torch 2.9 and later take TF32 through ``fp32_precision``; mixing that with the older ``allow_tf32``
    flags is an error when read back, so the older flags are used only where the new API is missing.
    """
    global _TORCH_DEFAULTS
    if _TORCH_DEFAULTS is None and torch_module is torch:  # the process's first pinning: torch's defaults
        _TORCH_DEFAULTS = numerics_state(torch_module)
    torch_module.use_deterministic_algorithms(True, warn_only=True)
    backends = torch_module.backends
    backends.cudnn.deterministic = True
    backends.cudnn.benchmark = False
    tf32: dict[str, Any]
    if hasattr(backends, "fp32_precision"):
        backends.fp32_precision = "ieee"
        backends.cuda.matmul.fp32_precision = "ieee"
        backends.cudnn.conv.fp32_precision = "ieee"
        backends.cudnn.rnn.fp32_precision = "ieee"
        tf32 = {
            "api": "fp32_precision",
            "matmul": backends.cuda.matmul.fp32_precision,
            "cudnn_conv": backends.cudnn.conv.fp32_precision,
            "cudnn_rnn": backends.cudnn.rnn.fp32_precision,
        }
    else:
        backends.cuda.matmul.allow_tf32 = False
        backends.cudnn.allow_tf32 = False
        tf32 = {
            "api": "allow_tf32",
            "matmul_allow_tf32": backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": backends.cudnn.allow_tf32,
        }
    return {
        "deterministic_algorithms": bool(torch_module.are_deterministic_algorithms_enabled()),
        "deterministic_warn_only": bool(torch_module.is_deterministic_algorithms_warn_only_enabled()),
        "cudnn_deterministic": bool(backends.cudnn.deterministic),
        "cudnn_benchmark": bool(backends.cudnn.benchmark),
        "tf32": tf32,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


# The rank's numerics before the probe pinned them: torch's defaults as this torch sets them in a fresh
# process (TF32 allowed for cuDNN convolutions and not for matmuls in torch 2.x, no deterministic
# algorithms, no cuDNN autotuning), or what the user's environment changed of them.
_TORCH_DEFAULTS: dict[str, Any] | None = None

# How the speed table is timed: as users' training runs, not under the correctness checks' pinning.
SPEED_NUMERICS = (
    "torch defaults with cudnn.benchmark on (TF32 as torch allows it, no deterministic algorithms)"
)


def numerics_state(torch_module: Any = torch) -> dict[str, Any]:
    """Every numerics flag the probe changes, as a plain dict ``apply_numerics`` can set back.

    TF32 is read through ``fp32_precision`` where this torch has it: reading the older ``allow_tf32``
    flags after the new API was used raises (torch/backends/cuda/__init__.py, "mix of the legacy and new
    APIs"), as ``pin_numerics`` explains.
    """
    backends = torch_module.backends
    state: dict[str, Any] = {
        "deterministic_algorithms": bool(torch_module.are_deterministic_algorithms_enabled()),
        "deterministic_warn_only": bool(torch_module.is_deterministic_algorithms_warn_only_enabled()),
        "cudnn_deterministic": bool(backends.cudnn.deterministic),
        "cudnn_benchmark": bool(backends.cudnn.benchmark),
    }
    if hasattr(backends, "fp32_precision"):
        state["fp32_precision"] = {
            "all": backends.fp32_precision,
            "matmul": backends.cuda.matmul.fp32_precision,
            "cudnn_conv": backends.cudnn.conv.fp32_precision,
            "cudnn_rnn": backends.cudnn.rnn.fp32_precision,
        }
    else:
        state["allow_tf32"] = {
            "matmul": bool(backends.cuda.matmul.allow_tf32),
            "cudnn": bool(backends.cudnn.allow_tf32),
        }
    return state


def apply_numerics(state: dict[str, Any], torch_module: Any = torch) -> None:
    """Set the flags ``numerics_state`` read."""
    torch_module.use_deterministic_algorithms(
        state["deterministic_algorithms"], warn_only=state["deterministic_warn_only"]
    )
    backends = torch_module.backends
    backends.cudnn.deterministic = state["cudnn_deterministic"]
    backends.cudnn.benchmark = state["cudnn_benchmark"]
    if "fp32_precision" in state:
        tf32 = state["fp32_precision"]
        backends.fp32_precision = tf32["all"]
        backends.cuda.matmul.fp32_precision = tf32["matmul"]
        backends.cudnn.conv.fp32_precision = tf32["cudnn_conv"]
        backends.cudnn.rnn.fp32_precision = tf32["cudnn_rnn"]
    else:
        backends.cuda.matmul.allow_tf32 = state["allow_tf32"]["matmul"]
        backends.cudnn.allow_tf32 = state["allow_tf32"]["cudnn"]


@contextmanager
def speed_numerics(torch_module: Any = torch) -> Iterator[dict[str, Any]]:
    """Inside the block, torch's defaults (as the process had them before ``pin_numerics``) with cuDNN
    autotuning on, as training scripts usually set it; after it, the pinned numerics again. Yields the
    flags the block ran under, for the speed table's label.

    The correctness checks keep the pinned numerics: they compare curves and need the noise floor low;
    the speed table times what a user's training would run, so TF32 and autotuned kernels count.
    """
    pinned = numerics_state(torch_module)
    defaults = dict(_TORCH_DEFAULTS if _TORCH_DEFAULTS is not None else numerics_state(torch_module))
    defaults["cudnn_benchmark"] = True
    apply_numerics(defaults, torch_module)
    try:
        yield numerics_state(torch_module)
    finally:
        apply_numerics(pinned, torch_module)


def nccl_transports(ctx: RankContext) -> list[dict[str, Any]]:
    """Which transport each connection of the set's NCCL communicator used, from the set's ranks' logs
    (rank 0 reads every rank's file; they share the pool's folder, named by pool rank). Only the set's
    communicator counts: the logs also hold the world group's, earlier sets' and DataParallel's
    (``judge.environment.set_connections``). Empty on gloo, and where NCCL logged no INIT lines (a
    user's ``NCCL_DEBUG`` below INFO, which the probe keeps)."""
    from gputopo.probe.judge.environment import parse_nccl_log, set_connections, summarize_transports

    connections = []
    log_dir = ctx.log_dir or ctx.out_dir
    ranks = ctx.spec.get("ranks") or list(range(ctx.world))
    for place, pool_rank in enumerate(ranks):
        path = log_dir / f"nccl-rank{pool_rank}.log"
        if path.exists():
            log = parse_nccl_log(path.read_text(errors="replace").splitlines())
            connections += set_connections(log, place, len(ranks))
    return summarize_transports(connections)
