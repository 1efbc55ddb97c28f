"""The probe's models: torchvision's ResNets, plus the smallest torchvision ResNet for CPU tests.

torchvision hard-codes the ResNet stage widths (64..512), so ``tiny`` shrinks depth, not width: one
BasicBlock per stage, about 4.9 M parameters, which keeps a CPU step in the tens of milliseconds while
staying the same code (convolutions, BatchNorm, residuals) that DataParallel users train.
"""

from __future__ import annotations

from typing import Any

NUM_CLASSES = 10  # CIFAR-sized synthetic data: 3x32x32 images, 10 classes
IMAGE_SHAPE = (3, 32, 32)


def build_model(name: str) -> Any:
    """A freshly initialised ``torch.nn.Module`` (weights from torch's global RNG: seed it first)."""
    from torchvision.models import resnet18, resnet50
    from torchvision.models.resnet import BasicBlock, ResNet

    if name == "tiny":
        return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=NUM_CLASSES)
    if name == "resnet18":
        return resnet18(weights=None, num_classes=NUM_CLASSES)
    if name == "resnet50":
        return resnet50(weights=None, num_classes=NUM_CLASSES)
    raise ValueError(f"unknown model {name!r}")


def synthetic_batch(seed: int, step: int, global_batch: int) -> tuple[Any, Any]:
    """The global batch of ``step``: seeded random images and labels on the CPU (no download).

    Every rank, replica and reference builds the same batch from ``(seed, step)`` and takes its chunks,
    so none of them depends on another's data path.
    """
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    images = torch.randn((global_batch, *IMAGE_SHAPE), generator=gen)
    labels = torch.randint(0, NUM_CLASSES, (global_batch,), generator=gen)
    return images, labels
