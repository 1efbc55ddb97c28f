"""Judging every GPU on its own (pure): throughput against its peers and the datasheet, results bit for bit.

The ranks (``gputopo.probe.ranks.pergpu``) measure each GPU's matmul throughput, device memory bandwidth
and host copies both ways, and hash the same seeded product twice. Here each GPU gets a verdict:

- ``corrupt``: its result's bits differ from the majority of the GPUs of its model (three or more), or
  its own two runs of the same product differ. With two GPUs of a model, or no majority, a GPU whose two
  runs agree but whose result differs from a peer's is ``undecided``: one of them computes wrong bits and
  this run cannot tell which (both fail the check).
- ``slow``: one of its four numbers is more than ``--tolerance`` (default 10%, DCGM's
  ``gflops_tolerance_pcnt`` against the mean) below the median of the other GPUs of its model, and the
  difference outlasts this machine's noise (``speed_evidence``): the gap is at least ``NOISE_MARGIN``
  times the noise measured in the same run, and every one of its runs lies below every one of its peers'
  runs, which chance alone would do with odds of at most ``MAX_CHANCE``. Or its matmul or memory figure
  is below its model's floor (which catches every GPU of a machine held down alike, where peers agree,
  and is the only speed verdict a lone GPU gets): ``MEASURED_FRACTION`` of a figure measured on a
  healthy GPU of the model where ``PEAKS`` has one (as DCGM sets its floors), else its best run below
  ``EXPECTED_FRACTION`` of the datasheet peak.
- ``undecided`` about its speed: more than ``--tolerance`` below its peers, but the noise on this
  machine, the overlap of its runs with theirs or too few runs leave it open. Not a failure: the check
  passes and says so (run it again on a quieter machine).
- ``pass`` otherwise. A hang or crash of the check is the check's (``verdict.hung``/``crashed``);
  ``unfinished_rows`` names each GPU's part in it.

GPUs are compared only with GPUs of the same name: cuBLAS promises the same bits only on GPUs of the same
architecture and SM count (cuBLAS documentation, "Results reproducibility"), and their speeds differ.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gputopo.probe.judge.peaks import EXPECTED_FRACTION, MEASURED_FRACTION, Peak, model_peak
from gputopo.probe.judge.verdict import PASS, CheckResult, fail

# A speed verdict needs evidence that outlasts noise (docs/probe.md, "Speed verdicts and noise").
# The machine's noise for one number: the largest spread of any GPU's own runs ((best - worst) / best)
# among the GPUs of its model. The gap to the peers' median must be at least this many times it.
NOISE_MARGIN = 2.0
# The most a "slow" may owe to chance: the odds of a GPU's runs all falling below all of its peers' runs
# when it is no different from them (every order of the runs equally likely: 1 / C(all runs, its runs)).
MAX_CHANCE = 0.05

CHECK = "gpu"
METRICS = ("matmul_tflops", "memory_gbps", "h2d_gbps", "d2h_gbps")
METRIC_WORDS = {
    "matmul_tflops": ("matmul", "TFLOP/s"),
    "memory_gbps": ("memory", "GB/s"),
    "h2d_gbps": ("host-to-device", "GB/s"),
    "d2h_gbps": ("device-to-host", "GB/s"),
}
# Per-GPU verdicts (the check's own verdict is pass or fail, kind corrupt or slow). An ``undecided`` row
# says what about (``undecided_about``): its bits (a failure: one of two GPUs computes wrong bits) or its
# speed (not a failure: the difference did not outlast the noise).
GPU_PASS, GPU_SLOW, GPU_CORRUPT, GPU_UNDECIDED = "pass", "slow", "corrupt", "undecided"
# What ``recommend --from-report`` leaves out (an undecided GPU may be the healthy one of two), with the
# GPU whose rank crashed in the check (``recommend.evidence`` mirrors it: recommend reads only reports).
LEAVE_OUT = frozenset({GPU_SLOW, GPU_CORRUPT, "crashed"})

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


def runs_of(row: Mapping[str, Any], metric: str) -> list[float]:
    """A row's runs of one number (``runs``, from the ranks), or its figure alone for a row without."""
    runs = (row.get("runs") or {}).get(metric)
    if isinstance(runs, list) and runs and all(isinstance(v, (int, float)) for v in runs):
        return [float(v) for v in runs]
    value = row.get(metric)
    return [float(value)] if isinstance(value, (int, float)) else []


def spread(values: Sequence[float]) -> float:
    """How far apart ``values`` lie, as a fraction of the largest: (max - min) / max (0 for fewer than 2)."""
    top = max(values, default=0.0)
    return (top - min(values)) / top if len(values) > 1 and top > 0 else 0.0


def noise(group: Sequence[Mapping[str, Any]], metric: str) -> float:
    """This machine's noise on one number, as this run measured it: the largest spread of any one GPU's
    own runs among the GPUs of a model (how far a busy machine moved the same measurement)."""
    return max((spread(runs_of(r, metric)) for r in group), default=0.0)


def chance_below(mine: Sequence[float], theirs: Sequence[float]) -> float | None:
    """The odds that every one of ``mine`` falls below every one of ``theirs`` by chance alone, when all
    the runs come from one distribution: 1 / C(len(mine) + len(theirs), len(mine)). ``None`` when they do
    not all fall below (the runs overlap)."""
    if not mine or not theirs or max(mine) >= min(theirs):
        return None
    return 1.0 / math.comb(len(mine) + len(theirs), len(mine))


@dataclass(frozen=True)
class SpeedEvidence:
    """One number of one GPU against its peers: the gap, this machine's noise, the odds, the verdict."""

    metric: str
    value: float
    median: float
    gap: float  # 1 - value / median
    noise: float
    chance: float | None
    runs: int
    peer_runs: int
    verdict: str  # GPU_PASS, GPU_SLOW or GPU_UNDECIDED

    def words(self) -> str:
        what, unit = METRIC_WORDS[self.metric]
        said = f"{what} {self.value:.3g} {unit}, {self.gap:.0%} below its peers' median {self.median:.3g}"
        if self.verdict == GPU_SLOW:
            assert self.chance is not None
            return (
                f"{said} (noise {self.noise:.0%}; its {self.runs} runs all below its peers' "
                f"{self.peer_runs}: 1 in {round(1 / self.chance)} by chance)"
            )
        return f"{said}, but {'; '.join(self.doubts())}"

    def doubts(self) -> list[str]:
        """Why the gap is not enough to call the GPU slow."""
        out = []
        if self.gap < NOISE_MARGIN * self.noise:
            out.append(
                f"this machine's noise is {self.noise:.0%} (the gap must be {NOISE_MARGIN:g} times it)"
            )
        if self.chance is None:
            out.append("its runs overlap its peers'")
        elif self.chance > MAX_CHANCE:
            out.append(
                f"{self.runs} run(s) against {self.peer_runs} could fall so by chance (1 in "
                f"{round(1 / self.chance)}; at most 1 in {round(1 / MAX_CHANCE)} may)"
            )
        return out


def speed_evidence(
    row: Mapping[str, Any], group: Sequence[Mapping[str, Any]], metric: str, median: float | None, tol: float
) -> SpeedEvidence | None:
    """The evidence on one number of a GPU below its peers' median by more than ``tol`` (``None`` when it
    is not, or when there is nothing to compare)."""
    value = row.get(metric)
    if not isinstance(value, (int, float)) or not median or value >= (1 - tol) * median:
        return None
    mine = runs_of(row, metric)
    theirs = [v for p in group if p is not row for v in runs_of(p, metric)]
    gap = 1 - value / median
    evidence = SpeedEvidence(
        metric, float(value), median, gap, noise(group, metric), chance_below(mine, theirs),
        len(mine), len(theirs), GPU_UNDECIDED,
    )  # fmt: skip
    if not evidence.doubts():
        evidence = replace(evidence, verdict=GPU_SLOW)
    return evidence


def _floor_words(row: Mapping[str, Any], peak: Peak | None) -> list[str]:
    """The matmul or memory figure below its model's floor (``Peak.floor``): against a measured figure
    the GPU's own figure (its median repetition) counts, as DCGM compares its measured value; against
    the datasheet, its best run (the looser test the weaker floor has always had)."""
    if peak is None:
        return []
    words = []
    precision = str(row.get("precision") or "fp32")
    for m in ("matmul_tflops", "memory_gbps"):
        floor = peak.floor(m, precision)
        figure = row.get(m)
        if floor is None or not isinstance(figure, (int, float)):
            continue
        limit, what_floor, measured = floor
        best = max(runs_of(row, m), default=float(figure))
        judged = float(figure) if measured else best
        what, unit = METRIC_WORDS[m]
        if judged < limit:
            said = f"{what} {figure:.3g} {unit}" + ("" if measured else f" (best run {best:.3g})")
            words.append(f"{said}, below its floor {limit:.3g}: {what_floor}")
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
        group = by_model[str(r.get("name"))]
        peers = [p for p in group if p is not r]
        medians = {
            m: _median([float(p[m]) for p in peers if isinstance(p.get(m), (int, float))]) for m in METRICS
        }
        peak = model_peak(r.get("name")) if r.get("timing") == "CUDA events" else None
        verdict, why = hashes[r["gpu"]]
        about = "bits" if verdict == GPU_UNDECIDED else None
        found = [e for m in METRICS if (e := speed_evidence(r, group, m, medians[m], tolerance))]
        slow = [e.words() for e in found if e.verdict == GPU_SLOW] + _floor_words(r, peak)
        open_ = [e.words() for e in found if e.verdict == GPU_UNDECIDED]
        speed = GPU_SLOW if slow else GPU_UNDECIDED if open_ else GPU_PASS
        if verdict == GPU_PASS and slow:
            verdict, why = GPU_SLOW, "; ".join(slow)
        elif verdict == GPU_PASS and open_:
            verdict, why, about = GPU_UNDECIDED, "speed undecided: " + "; ".join(open_), "speed"
        elif slow:
            why += "; also slow: " + "; ".join(slow)
        out.append(
            {
                **r,
                "verdict": verdict,
                "why": why,
                "undecided_about": about,
                "speed": speed,
                "noise": {m: noise(group, m) for m in METRICS},
                "peers": len(peers),
                "peers_median": medians,
                "peak": None if peak is None else _peak_section(peak, str(r.get("precision") or "fp32")),
            }
        )
    return out


def _peak_section(peak: Peak, precision: str) -> dict[str, Any]:
    """A row's ``peak``: the datasheet figures, the measured ones and the floor each number is held to."""
    floors = {m: peak.floor(m, precision) for m in ("matmul_tflops", "memory_gbps")}
    return {
        "model": peak.model,
        "matmul_tflops": peak.matmul_tflops.get(precision),
        "memory_gbps": peak.memory_gbps,
        "source": peak.source,
        "measured_matmul_tflops": peak.measured_tflops.get(precision),
        "measured_memory_gbps": peak.measured_memory_gbps,
        "measured_source": peak.measured_source,
        "floor": {
            m: None
            if f is None
            else {"value": f[0], "from": "measured" if f[2] else "datasheet", "what": f[1]}
            for m, f in floors.items()
        },
    }


def judge_gpus(metrics: dict[str, Any], tolerance: float) -> CheckResult:
    """The per-GPU check's verdict: fail (``corrupt`` before ``slow``) when any GPU is not ``pass``."""
    rows = judge_rows(metrics.get("rows") or [], tolerance)
    out = {
        **metrics,
        "rows": rows,
        "tolerance": tolerance,
        "expected_fraction": EXPECTED_FRACTION,
        "measured_fraction": MEASURED_FRACTION,
        "noise_margin": NOISE_MARGIN,
        "max_chance": MAX_CHANCE,
    }
    bad = [r for r in rows if r["verdict"] != GPU_PASS]
    open_ = [r for r in bad if r.get("undecided_about") == "speed"]
    stand_in = metrics.get("device") == "cpu"
    what = "CPU stand-in" if stand_in else "GPU"
    if len(open_) == len(bad):
        models = Counter(str(r.get("name")) for r in rows)
        hashes = {r.get("result_hash") for r in rows}
        bits = (
            f"results bit-identical (hash {next(iter(hashes))})"
            if len(hashes) == 1
            else f"results bit-identical within each of {len(models)} models"
        )
        within = f"{len(rows)} {what}(s) each" if not open_ else f"{len(rows) - len(open_)} of {len(rows)}"
        detail = (
            f"{within} within {tolerance:.0%} of their peers' median "
            f"(matmul, memory, host copies both ways); {bits}"
        )
        if open_:
            detail += "; " + "; ".join(f"GPU{r['gpu']} {r['why']}" for r in open_)
            detail += " (not a failure: run the probe again on a quieter machine to decide)"
        return CheckResult(CHECK, PASS, None, detail, None, out)
    corrupt = [r for r in bad if r["verdict"] == GPU_CORRUPT or r.get("undecided_about") == "bits"]
    detail = "; ".join(f"GPU{r['gpu']} {r['verdict']}: {r['why']}" for r in bad)
    if corrupt:
        undecided_only = all(r["verdict"] == GPU_UNDECIDED for r in corrupt)  # about bits
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
        "undecided_about",
        *METRICS,
        "runs",
        "noise",
        "result_hash",
        "result_hash_rerun",
        "peers_median",
        "peak",
    )
    return {
        "verdict": check.get("verdict"),
        "kind": check.get("kind"),
        "tolerance": metrics.get("tolerance"),
        "noise_margin": metrics.get("noise_margin"),
        "max_chance": metrics.get("max_chance"),
        "precision": metrics.get("precision"),
        "simulated": metrics.get("device") == "cpu",
        "gpus": [{k: row.get(k) for k in keep if k in row} for row in metrics.get("rows") or []],
    }
