"""What torch says about CUDA on this machine, asked from the parent before any rank starts.

The one question the parent process puts to torch; it lives here because ``ranks`` is the only room
that imports torch (lazily here, so importing this module costs nothing).
"""

from __future__ import annotations


def cuda_unavailable() -> str | None:
    """Why torch cannot drive CUDA here, or ``None`` when it can."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    return "no CUDA device is visible to torch"
