"""Judging every GPU on its own (pure): throughput against its peers and the datasheet, results bit for bit.

The ranks (``gputopo.probe.ranks.pergpu``) measure each GPU's matmul throughput, device memory bandwidth
and host copies both ways, and hash the same seeded product twice. Here each GPU gets a verdict:

- ``corrupt``: its result's bits differ from the majority of the GPUs of its model (three or more), or
  its own two runs of the same product differ. With two GPUs of a model, or no majority, a GPU whose two
  runs agree but whose result differs from a peer's is ``undecided``: one of them computes wrong bits and
  this run cannot tell which (both fail the check).
- ``slow``: one of its four numbers is more than ``--tolerance`` (default 10%, DCGM's
  ``gflops_tolerance_pcnt`` against the mean) below the median of the other GPUs of its model; or its
  matmul or memory figure is below ``EXPECTED_FRACTION`` of the datasheet peak of its model where
  ``PEAKS`` knows it (which catches every GPU of a machine held down alike, where peers agree).
- ``pass`` otherwise. A hang or crash of the check is the check's (``verdict.hung``/``crashed``);
  ``unfinished_rows`` names each GPU's part in it.

GPUs are compared only with GPUs of the same name: cuBLAS promises the same bits only on GPUs of the same
architecture and SM count (cuBLAS documentation, "Results reproducibility"), and their speeds differ.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gputopo.probe.judge.verdict import PASS, CheckResult, fail

CHECK = "gpu"
METRICS = ("matmul_tflops", "memory_gbps", "h2d_gbps", "d2h_gbps")
METRIC_WORDS = {
    "matmul_tflops": ("matmul", "TFLOP/s"),
    "memory_gbps": ("memory", "GB/s"),
    "h2d_gbps": ("host-to-device", "GB/s"),
    "d2h_gbps": ("device-to-host", "GB/s"),
}
# Per-GPU verdicts (the check's own verdict is pass or fail, kind corrupt or slow).
GPU_PASS, GPU_SLOW, GPU_CORRUPT, GPU_UNDECIDED = "pass", "slow", "corrupt", "undecided"
# What ``recommend --from-report`` leaves out (an undecided GPU may be the healthy one of two), with the
# GPU whose rank crashed in the check (``recommend.evidence`` mirrors it: recommend reads only reports).
LEAVE_OUT = frozenset({GPU_SLOW, GPU_CORRUPT, "crashed"})

# Below this fraction of the datasheet peak a GPU is slow whatever its peers measure. Dense GEMMs in
# cuBLAS reach well above it on healthy H100s and A100s, and a device copy most of the HBM peak; half
# leaves room for the probe's sizes and a warm machine. Not measured here (no GPU was lent): a first
# H100 run should set it from measured figures (docs/probe.md).
EXPECTED_FRACTION = 0.5


@dataclass(frozen=True)
class Peak:
    """A GPU model's datasheet figures: dense matmul TFLOP/s per precision, HBM bandwidth, the source."""

    pattern: str  # a regular expression on the CUDA device name
    model: str
    matmul_tflops: Mapping[str, float]
    memory_gbps: float
    source: str


_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (sparsity figures halved: dense)"
_A100_SHEET = "NVIDIA A100 Tensor Core GPU datasheet (dense figures)"
# fp32 is plain FP32 (CUDA cores; the probe pins TF32 off), tf32/fp16/bf16 the dense tensor-core figures.
PEAKS = (
    Peak(
        r"H100.*(HBM3|SXM)",
        "H100 SXM",
        {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
        3350.0,
        _H100_SHEET,
    ),
    Peak(
        r"H100.*PCIe",
        "H100 PCIe",
        {"fp32": 51.0, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
        2000.0,
        _H100_SHEET,
    ),
    Peak(
        r"H200",
        "H200 SXM",
        {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
        4800.0,
        "NVIDIA H200 Tensor Core GPU datasheet (sparsity figures halved: dense)",
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

_SLOW_REMEDY = (
    "A GPU well below its peers drags every synchronous job to its speed. Look at why: "
    "`nvidia-smi -q -d PERFORMANCE -i N` (clock event reasons: HW slowdown, power brake, thermal), "
    "`nvidia-smi -q -d CLOCK,POWER,TEMPERATURE -i N`; a slow host copy points at the PCIe link "
    "(`nvidia-smi -q -d PCIE -i N`: current width and generation below max, or `gputopo check`) or at a "
    "process pinned to the other socket. Keep it out of jobs until fixed: "
    "`gputopo recommend --from-report REPORT.json` leaves it out."
)
_CORRUPT_REMEDY = (
    "This GPU computed different bits from its peers (or from itself) on the same seeded inputs: silent "
    "data corruption, which poisons training without an error. Take it out of service now "
    "(`gputopo recommend --from-report REPORT.json` leaves it out; `gputopo check --drain` under Slurm), "
    "run NVIDIA's diagnostic on it (`dcgmi diag -r 3`, or `-r 4`), look for ECC and remapping trouble "
    "(`nvidia-smi -q -d ECC,ROW_REMAPPER -i N`), and run this probe again; a GPU that repeats it is an "
    "RMA case."
)
_UNDECIDED_REMEDY = (
    "Two GPUs of the same model disagree bit for bit on the same seeded product and each repeats its own "
    "result, so one of them is wrong and this run cannot say which. Run the probe with a third GPU of the "
    "same model (`--gpus` with three or more), or NVIDIA's diagnostic (`dcgmi diag -r 3`) on both."
)


def model_peak(name: str | None) -> Peak | None:
    """The datasheet figures for a CUDA device name, or ``None`` when ``PEAKS`` does not know it."""
    if not name:
        return None
    return next((p for p in PEAKS if re.search(p.pattern, name, re.IGNORECASE)), None)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _hash_verdicts(group: list[dict[str, Any]]) -> dict[int, tuple[str, str]]:
    """(verdict, why) per GPU of one model from the two result hashes each computed."""
    out: dict[int, tuple[str, str]] = {}
    first = Counter(r.get("result_hash") for r in group)
    top, count = first.most_common(1)[0]
    majority = top if len(group) >= 3 and count * 2 > len(group) else None
    stable = {r["result_hash"] for r in group if r.get("result_hash") == r.get("result_hash_rerun")}
    for r in group:
        gpu, mine, again = r["gpu"], r.get("result_hash"), r.get("result_hash_rerun")
        if majority is not None:
            if mine != majority:
                out[gpu] = (
                    GPU_CORRUPT,
                    f"result hash {mine} differs from {count} of {len(group)} GPUs' {top}",
                )
            elif again != mine:
                out[gpu] = (GPU_CORRUPT, f"its second run of the same product hashed {again}, not {mine}")
            else:
                out[gpu] = (GPU_PASS, "")
        elif again != mine:
            out[gpu] = (GPU_CORRUPT, f"its two runs of the same product differ (hashes {mine}, {again})")
        elif len(stable) > 1:
            others = ", ".join(
                f"GPU{p['gpu']}" for p in group if p is not r and p.get("result_hash_rerun") != mine
            )
            out[gpu] = (
                GPU_UNDECIDED,
                f"result hash {mine} differs from {others}'s and both repeat their own: which one is wrong "
                "could not be decided (no majority of its model)",
            )
        else:
            out[gpu] = (GPU_PASS, "")
    return out


def _slow_words(
    row: dict[str, Any], medians: dict[str, float | None], peak: Peak | None, tol: float
) -> list[str]:
    words = []
    for m in METRICS:
        value, ref = row.get(m), medians.get(m)
        what, unit = METRIC_WORDS[m]
        if isinstance(value, (int, float)) and ref and value < (1 - tol) * ref:
            words.append(
                f"{what} {value:.3g} {unit}, {1 - value / ref:.0%} below its peers' median {ref:.3g}"
            )
    if peak is not None:
        expected = {
            "matmul_tflops": peak.matmul_tflops.get(str(row.get("precision") or "fp32")),
            "memory_gbps": peak.memory_gbps,
        }
        for m, sheet in expected.items():
            value = row.get(m)
            what, unit = METRIC_WORDS[m]
            if sheet and isinstance(value, (int, float)) and value < EXPECTED_FRACTION * sheet:
                words.append(
                    f"{what} {value:.3g} {unit}, below {EXPECTED_FRACTION:.0%} of the {peak.model} "
                    f"datasheet's {sheet:g} ({peak.source})"
                )
    return words


def judge_rows(rows: Sequence[dict[str, Any]], tolerance: float) -> list[dict[str, Any]]:
    """Every GPU's row with its verdict, why, its peers' medians and its model's datasheet peak."""
    rows = [dict(r) for r in rows if isinstance(r, Mapping)]
    by_model: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_model.setdefault(str(r.get("name")), []).append(r)
    hashes: dict[int, tuple[str, str]] = {}
    for group in by_model.values():
        hashes.update(_hash_verdicts(group))
    out = []
    for r in rows:
        peers = [p for p in by_model[str(r.get("name"))] if p is not r]
        medians = {
            m: _median([float(p[m]) for p in peers if isinstance(p.get(m), (int, float))]) for m in METRICS
        }
        peak = model_peak(r.get("name")) if r.get("timing") == "CUDA events" else None
        verdict, why = hashes[r["gpu"]]
        slow = _slow_words(r, medians, peak, tolerance)
        if verdict == GPU_PASS and slow:
            verdict, why = GPU_SLOW, "; ".join(slow)
        elif slow:
            why += "; also slow: " + "; ".join(slow)
        out.append(
            {
                **r,
                "verdict": verdict,
                "why": why,
                "peers": len(peers),
                "peers_median": medians,
                "peak": None
                if peak is None
                else {
                    "model": peak.model,
                    "matmul_tflops": peak.matmul_tflops.get(str(r.get("precision") or "fp32")),
                    "memory_gbps": peak.memory_gbps,
                    "source": peak.source,
                },
            }
        )
    return out


def judge_gpus(metrics: dict[str, Any], tolerance: float) -> CheckResult:
    """The per-GPU check's verdict: fail (``corrupt`` before ``slow``) when any GPU is not ``pass``."""
    rows = judge_rows(metrics.get("rows") or [], tolerance)
    out = {**metrics, "rows": rows, "tolerance": tolerance, "expected_fraction": EXPECTED_FRACTION}
    bad = [r for r in rows if r["verdict"] != GPU_PASS]
    stand_in = metrics.get("device") == "cpu"
    what = "CPU stand-in" if stand_in else "GPU"
    if not bad:
        models = Counter(str(r.get("name")) for r in rows)
        hashes = {r.get("result_hash") for r in rows}
        bits = (
            f"results bit-identical (hash {next(iter(hashes))})"
            if len(hashes) == 1
            else f"results bit-identical within each of {len(models)} models"
        )
        detail = (
            f"{len(rows)} {what}(s) each within {tolerance:.0%} of their peers' median "
            f"(matmul, memory, host copies both ways); {bits}"
        )
        return CheckResult(CHECK, PASS, None, detail, None, out)
    corrupt = [r for r in bad if r["verdict"] in (GPU_CORRUPT, GPU_UNDECIDED)]
    detail = "; ".join(f"GPU{r['gpu']} {r['verdict']}: {r['why']}" for r in bad)
    if corrupt:
        undecided_only = all(r["verdict"] == GPU_UNDECIDED for r in corrupt)
        remedy = _UNDECIDED_REMEDY if undecided_only else _CORRUPT_REMEDY
        if any(r["verdict"] == GPU_SLOW for r in bad):
            remedy += " For the slow GPU: " + _SLOW_REMEDY
        return fail(CHECK, "corrupt", detail, remedy, out)
    return fail(CHECK, "slow", detail, _SLOW_REMEDY, out)


def unfinished_rows(gpus: Sequence[int], kind: str, rank: int | None) -> list[dict[str, Any]]:
    """Per GPU of a per-GPU check that hung or crashed: the rank that died (or every GPU, for a hang) is
    ``crashed``/``hung``; the others were not judged."""
    out = []
    for i, gpu in enumerate(gpus):
        mine = kind == "hung" or rank is None or i == rank
        out.append(
            {
                "gpu": gpu,
                "verdict": kind if mine else "not judged",
                "why": f"the check {kind} here" if mine else f"the check {kind} on another GPU",
            }
        )
    return out


def per_gpu_section(check: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The report's top-level ``per_gpu`` section from the per-GPU check (``None`` without one): per GPU
    its verdict, the four numbers, the result hash and its peers' medians."""
    if check is None:
        return None
    metrics = check.get("metrics") or {}
    keep = (
        "gpu",
        "name",
        "verdict",
        "why",
        *METRICS,
        "result_hash",
        "result_hash_rerun",
        "peers_median",
        "peak",
    )
    return {
        "verdict": check.get("verdict"),
        "kind": check.get("kind"),
        "tolerance": metrics.get("tolerance"),
        "precision": metrics.get("precision"),
        "simulated": metrics.get("device") == "cpu",
        "gpus": [{k: row.get(k) for k in keep if k in row} for row in metrics.get("rows") or []],
    }
