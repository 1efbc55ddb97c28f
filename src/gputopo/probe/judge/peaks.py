"""Each GPU model's floors for the per-GPU check (pure data): datasheet peaks and figures measured on a
healthy GPU of the model, and which fraction of each a GPU must reach (``judge.pergpu`` judges with them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

# Below this fraction of the datasheet peak a GPU is slow whatever its peers measure, where no measured
# figure exists for its model and precision. Dense GEMMs in cuBLAS reach well above it on healthy H100s
# and A100s, and a device copy most of the HBM peak; half leaves room for the probe's sizes and a warm
# machine. It is weak (a GPU 35-40% below a healthy one passes it): a measured figure replaces it.
EXPECTED_FRACTION = 0.5
# Below this fraction of a figure measured on a healthy GPU of the same model (same size, dtype and
# method as the probe's) a GPU is slow. DCGM sets its per-SKU floors the same way, at 0.75 of what a
# healthy part measured (a review of its diagnostic plugins, e.g. the memory bandwidth plugin's per-SKU
# ``minimum_bandwidth``); it leaves a quarter for a warm card, another host and the probe's own
# overhead, and catches a GPU a third below its healthy speed, which the datasheet half lets through.
MEASURED_FRACTION = 0.75


@dataclass(frozen=True)
class Peak:
    """A GPU model's datasheet figures: dense matmul TFLOP/s per precision, HBM bandwidth, the source."""

    pattern: str  # a regular expression on the CUDA device name
    model: str
    matmul_tflops: Mapping[str, float]
    memory_gbps: float
    source: str
    # Figures measured on a healthy GPU of the model, the probe's way (8192-square matmuls per precision,
    # a device copy counting bytes read and written), and where they come from; empty/None where none.
    measured_tflops: Mapping[str, float] = field(default_factory=dict)
    measured_memory_gbps: float | None = None
    measured_source: str | None = None

    def floor(self, metric: str, precision: str) -> tuple[float, str, bool] | None:
        """(floor, what it is, whether measured) for ``matmul_tflops`` or ``memory_gbps``: the measured
        figure times ``MEASURED_FRACTION`` where there is one, else the datasheet's times
        ``EXPECTED_FRACTION``; None where neither is known."""
        if metric == "matmul_tflops":
            measured, sheet = self.measured_tflops.get(precision), self.matmul_tflops.get(precision)
        else:
            measured, sheet = self.measured_memory_gbps, self.memory_gbps
        if measured:
            what = f"{MEASURED_FRACTION:.0%} of the {measured:g} measured on a healthy {self.model}"
            return MEASURED_FRACTION * measured, f"{what} ({self.measured_source})", True
        if sheet:
            what = f"{EXPECTED_FRACTION:.0%} of the {self.model} datasheet's {sheet:g}"
            return EXPECTED_FRACTION * sheet, f"{what} ({self.source})", False
        return None


_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (sparsity figures halved: dense)"
_A100_SHEET = "NVIDIA A100 Tensor Core GPU datasheet (dense figures)"
# Measured on this project's lent machines (device notes, KINDS.md), torch 2.11, driver 580.159: an
# 8192-square bf16 torch.matmul on random data, and a device-to-device copy counting bytes read and
# written. The H200's matmul ranged 769-798 over runs: the lower end is the reference. To be replaced by
# the figures of a run of scripts/gpu-acceptance (docs/development.md).
_H100_MEASURED = "H100 80GB HBM3, driver 580.159.04, torch 2.11, 2026-11-13 (a lent machine; not yet ours)"
_H200_MEASURED = "H200, driver 580.159.04, torch 2.11, 2026-11-04 (a lent machine; not yet ours)"
# fp32 is plain FP32 (CUDA cores; the probe pins TF32 off), tf32/fp16/bf16 the dense tensor-core figures.
# Patterns are whole words: "H200" is not GH200 (a Grace Hopper superchip) nor H200 NVL (a PCIe card
# with its own, lower figures).
PEAKS = (
    Peak(
        r"\bH100\b.*(HBM3|SXM)",
        "H100 SXM",
        {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
        3350.0,
        _H100_SHEET,
        {"bf16": 798.0},
        3000.0,
        _H100_MEASURED,
    ),
    Peak(
        r"\bH100\b.*PCIe",
        "H100 PCIe",
        {"fp32": 51.0, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
        2000.0,
        _H100_SHEET,
    ),
    Peak(
        r"\bH200\b.*\bNVL\b",
        "H200 NVL",
        {"fp32": 60.0, "tf32": 417.5, "fp16": 835.5, "bf16": 835.5},
        4800.0,
        "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column (sparsity figures halved: dense)",
    ),
    Peak(
        r"\bH200\b(?!.*\bNVL\b)",
        "H200 SXM",
        {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
        4800.0,
        "NVIDIA H200 Tensor Core GPU datasheet (sparsity figures halved: dense)",
        {"bf16": 769.0},
        4300.0,
        _H200_MEASURED,
    ),
    Peak(
        r"A100.*SXM4.*80GB",
        "A100 SXM4 80GB",
        {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
        2039.0,
        _A100_SHEET,
    ),
    Peak(
        r"A100.*SXM4.*40GB",
        "A100 SXM4 40GB",
        {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
        1555.0,
        _A100_SHEET,
    ),
    Peak(
        r"A100.*80GB.*PCIe",
        "A100 PCIe 80GB",
        {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
        1935.0,
        _A100_SHEET,
    ),
)


def model_peak(name: str | None) -> Peak | None:
    """The datasheet figures for a CUDA device name, or ``None`` when ``PEAKS`` does not know it."""
    if not name:
        return None
    return next((p for p in PEAKS if re.search(p.pattern, name, re.IGNORECASE)), None)
