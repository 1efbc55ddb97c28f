"""The probe's models: torchvision's ResNets, plus the smallest torchvision ResNet for CPU tests, plus a
micro residual CNN for the quick simulated doctor.

torchvision hard-codes the ResNet stage widths (64..512), so ``tiny`` shrinks depth, not width: one
BasicBlock per stage, about 4.9 M parameters, which keeps a CPU step in the tens of milliseconds while
staying the same code (convolutions, BatchNorm, residuals) that DataParallel users train. ``micro`` is the
same kinds of layers (a convolution stem, one residual block with BatchNorm, a strided convolution, a
linear head) at widths 16 and 32, about 12 k parameters, in torch alone: a rank that trains it never
imports torchvision, which is most of a CPU stand-in's start-up after torch itself.
"""

from __future__ import annotations

from typing import Any

NUM_CLASSES = 10  # CIFAR-sized synthetic data: 3x32x32 images, 10 classes
IMAGE_SHAPE = (3, 32, 32)


def build_model(name: str) -> Any:
    """A freshly initialised ``torch.nn.Module`` (weights from torch's global RNG: seed it first)."""
    if name == "micro":
        return _micro()
    from torchvision.models import resnet18, resnet50
    from torchvision.models.resnet import BasicBlock, ResNet

    if name == "tiny":
        return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=NUM_CLASSES)
    if name == "resnet18":
        return resnet18(weights=None, num_classes=NUM_CLASSES)
    if name == "resnet50":
        return resnet50(weights=None, num_classes=NUM_CLASSES)
    raise ValueError(f"unknown model {name!r}")


def _micro() -> Any:
    import torch
    from torch import nn

    def conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout))

    class Micro(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = conv_bn(IMAGE_SHAPE[0], 16)
            self.block = nn.Sequential(conv_bn(16, 16), nn.ReLU(), conv_bn(16, 16))
            self.down = conv_bn(16, 32, stride=2)
            self.head = nn.Linear(32, NUM_CLASSES)

        def forward(self, x: Any) -> Any:
            x = torch.relu(self.stem(x))
            x = torch.relu(x + self.block(x))  # the residual, as in a ResNet's BasicBlock
            x = torch.relu(self.down(x))
            return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    return Micro()


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
