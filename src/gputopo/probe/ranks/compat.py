"""torch APIs that differ between the torch builds gputopo meets on GPU machines.

pyproject asks for torch>=2.14, but GPU images often carry the torch their vendor built (2.11 on the H100
these probes were first run on). Where a newer keyword only refines behaviour, the probe uses it when the
installed torch has it instead of failing every check as "crashed".
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from datetime import timedelta
from functools import cache
from typing import Any


@cache
def _new_group_takes_sort_ranks() -> bool:
    import torch.distributed as dist

    # inspect.signature follows c10d_logger's functools.wraps to the real new_group.
    return "sort_ranks" in inspect.signature(dist.new_group).parameters


def new_group_in_order(
    ranks: Sequence[int], timeout: timedelta | None = None, backend: str | None = None
) -> Any:
    """``dist.new_group(ranks)`` keeping ``ranks``' order as the group's rank order.

    ``sort_ranks=False`` (torch/distributed/distributed_c10d.py ``new_group``) is how torch keeps the
    order; a torch without it always sorts, which is the same group when ``ranks`` is already sorted.
    Any other order cannot be had there, and saying so beats a probe that silently measures another ring.
    """
    import torch.distributed as dist

    options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if backend is not None:
        options["backend"] = backend
    if _new_group_takes_sort_ranks():
        return dist.new_group(list(ranks), sort_ranks=False, **options)
    if list(ranks) != sorted(ranks):
        raise RuntimeError(
            f"this torch ({_torch_version()}) cannot keep a process group's rank order {list(ranks)}; "
            "gputopo's probes need torch>=2.14 for that"
        )
    return dist.new_group(list(ranks), **options)


def _torch_version() -> str:
    import torch

    return torch.__version__
