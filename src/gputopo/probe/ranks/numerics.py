"""How a rank computes and talks, recorded for the judge: pinned numerics (deterministic kernels, no
TF32) and the NCCL transport of each connection, read from the ranks' NCCL INIT logs."""

from __future__ import annotations

import os
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


def nccl_transports(ctx: RankContext) -> list[dict[str, Any]]:
    """Which transport each NCCL connection of this launch used, from the ranks' INIT logs (rank 0 reads
    every rank's file; they share ``out_dir``). Empty on gloo."""
    from gputopo.probe.judge.environment import parse_transport_lines, summarize_transports

    connections = []
    log_dir = ctx.log_dir or ctx.out_dir
    ranks = ctx.spec.get("ranks")  # in the pool: only the set's ranks' logs (named by pool rank)
    for path in sorted(log_dir.glob("nccl-rank*.log")):
        if ranks is not None and int(path.stem.removeprefix("nccl-rank")) not in ranks:
            continue
        connections += parse_transport_lines(path.read_text(errors="replace").splitlines())
    return summarize_transports(connections)
