"""Judging what the ranks measured: pure functions from metrics to a verdict, a kind and a remedy.

Kinds, most specific first: ``corrupt`` (a transfer returned wrong data: a P2P copy, a DataParallel
replica after broadcast, an all-reduce element), ``desync`` (DDP ranks' parameters stopped being
bitwise equal), ``nan`` (a loss or gradient went non-finite while the reference stayed finite),
``diverged`` (the loss left the reference curve by more than the noise floor allows), ``hung`` (no end
within ``--timeout``), ``crashed`` (a rank exited non-zero), ``slow`` (all-reduce bus bandwidth far below
the bandwidth model's estimate), ``overflow`` (an fp16 run's GradScaler kept skipping steps; judged in
``gputopo.probe.judge.precision``). A check reports its most specific finding as its kind and mentions the
rest in its detail.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
KINDS = ("nan", "diverged", "desync", "corrupt", "hung", "crashed", "slow", "overflow")

# Loss-curve tolerance. The noise floor is the largest gap between the two reference runs (two valid
# float orders of the same training); 10x leaves room for a third order (the probe's own) drifting a
# little further, and the absolute/relative floor covers runs where both references agree to the bit.
NOISE_FACTOR = 10.0
ABS_TOL = 1e-4
REL_TOL = 1e-3
# NCCL reaches 0.94-0.99 of the ring model on NVLink and somewhat less over PCIe; below half of the
# model, something is wrong with the path (a degraded link, P2P off, traffic from another job).
SLOW_FRACTION = 0.5

CORRUPT_REMEDY = (
    "Data sent between these GPUs arrives changed. On PCIe paths the usual cause is the IOMMU or PCIe ACS "
    "being on, which breaks peer-to-peer copies while `nvidia-smi topo -p2p` still says OK. Check: "
    "`cat /proc/cmdline` (intel_iommu=on / amd_iommu=on), `dmesg | grep -i -e DMAR -e IOMMU`, and "
    "`sudo lspci -vvv | grep -i ACSCtl` (SrcValid+ on a bridge means ACS redirects P2P). Fix: boot with "
    "`iommu=pt` (or intel_iommu=off / amd_iommu=off) and turn ACS off on the PCIe switches (BIOS, or "
    "setpci at boot), then run this probe again. Meanwhile: `export NCCL_P2P_DISABLE=1`, and do not use "
    "nn.DataParallel on this set (use DDP, or a healthy set)."
)
_DESYNC_REMEDY = (
    "DDP ranks hold different weights: an all-reduce delivered different data to different ranks. Treat it "
    "as data corruption on the communication path: run `gputopo probe --mode p2p` and `--mode allreduce` "
    "on this set, "
    "try `NCCL_P2P_DISABLE=1`, check the IOMMU/ACS settings (`cat /proc/cmdline`, `sudo lspci -vvv | grep "
    "-i ACSCtl`) and `dmesg` for Xid errors; until it passes, train on a healthy set."
)
_NAN_DP_REMEDY = (
    "DataParallel went NaN where the single-device reference stayed finite, so the replicas' data path is "
    "corrupting values: the classic sign of broken P2P over PCIe (IOMMU/ACS on). Run `gputopo probe "
    "--mode p2p` on this set, check `cat /proc/cmdline` and `sudo lspci -vvv | grep -i ACSCtl`; meanwhile "
    "avoid nn.DataParallel on this set and use DDP with `NCCL_P2P_DISABLE=1`, or a healthy set."
)
_NAN_DDP_REMEDY = (
    "DDP went NaN where the single-device reference stayed finite, so a rank received or computed bad "
    "values. Check the communication path (`NCCL_P2P_DISABLE=1`, IOMMU/ACS settings) and the GPUs "
    "themselves (`dmesg` for Xid errors, `nvidia-smi -q -d ECC`); train on a healthy set until it passes."
)
_NAN_REFERENCE_REMEDY = (
    "The single-device reference went non-finite too, so this is the training setup rather than the "
    "GPUs: run the probe again with a smaller --lr."
)
_DIVERGED_REMEDY = (
    "The loss curve left the single-device reference by more than float reordering explains, so the "
    "computation is not the same one. Look for data corruption first (`gputopo probe --mode p2p` and "
    "`--mode allreduce` on this set, IOMMU/ACS settings, `NCCL_P2P_DISABLE=1`), then for a GPU that "
    "computes wrongly (`dmesg` for Xid errors)."
)
_HUNG_REMEDY = (
    "A hang between GPUs is typical of peer-to-peer traffic over PCIe with the IOMMU or ACS on, or of a GPU "
    "in a bad state. Run again with `NCCL_DEBUG=INFO` to see the transport; try `NCCL_P2P_DISABLE=1`; check "
    "`nvidia-smi` for a GPU at 100% with nothing running and `dmesg` for Xid errors; `gputopo kill-stale` "
    "clears processes left holding the GPUs."
)
_CRASHED_REMEDY = (
    "A rank exited with an error: read its stderr tail above. CUDA or NCCL errors point at the GPU or the "
    "path (`dmesg` for Xid errors; rerun with `NCCL_DEBUG=INFO`); out-of-memory means the GPU is shared "
    "(`gputopo kill-stale`) or --batch-size is too large."
)
_SLOW_REMEDY = (
    "All-reduce runs far below what this set's links should give. Check the links (`gputopo topo`: PCIe "
    "gen/width now vs max, NVLink links up), whether P2P is off for NCCL (NCCL_P2P_DISABLE, NCCL_P2P_LEVEL "
    "in the environment), and other jobs on these GPUs (`nvidia-smi`, `gputopo kill-stale`)."
)


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict on one set: ``pass``, ``fail`` (with a kind and a remedy) or ``skipped``."""

    name: str
    verdict: str
    kind: str | None = None
    detail: str = ""
    remedy: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of gputopo/probe/v1."""
        return {
            "name": self.name,
            "verdict": self.verdict,
            "kind": self.kind,
            "detail": self.detail,
            "remedy": self.remedy,
            "metrics": self.metrics,
        }


@dataclass(frozen=True)
class SetResult:
    """All checks of one GPU set; it fails when any check fails."""

    gpus: tuple[int, ...]
    checks: tuple[CheckResult, ...]

    @property
    def verdict(self) -> str:
        """``fail`` if a check failed, ``pass`` if any passed, else ``skipped``."""
        verdicts = {c.verdict for c in self.checks}
        if FAIL in verdicts:
            return FAIL
        return PASS if PASS in verdicts else SKIPPED

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of gputopo/probe/v1."""
        return {
            "gpus": list(self.gpus),
            "verdict": self.verdict,
            "checks": [c.to_dict() for c in self.checks],
        }


def fail(name: str, kind: str, detail: str, remedy: str, metrics: dict[str, Any]) -> CheckResult:
    """A failed check; ``kind`` must be one of ``KINDS``."""
    assert kind in KINDS, kind
    return CheckResult(name, FAIL, kind, detail, remedy, metrics)


def skipped(name: str, why: str, metrics: dict[str, Any] | None = None) -> CheckResult:
    """A check that did not run, and why."""
    return CheckResult(name, SKIPPED, None, why, None, metrics or {})


# --- loss curves --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CurveJudgement:
    """How a loss curve compares with the reference: the worst gap, what was allowed, where it broke."""

    max_gap: float
    noise_floor: float
    first_bad_step: int | None
    allowed_at_worst: float

    @property
    def ok(self) -> bool:
        """True when every step stayed within tolerance."""
        return self.first_bad_step is None


def allowed_gap(ref_loss: float, noise_floor: float, rel_tol: float = REL_TOL) -> float:
    """The largest loss gap a healthy run may show at a step whose reference loss is ``ref_loss``.

    ``rel_tol`` is the relative floor: ``REL_TOL`` for fp32, wider for narrower precisions
    (``gputopo.probe.judge.precision.rel_tol``)."""
    return max(NOISE_FACTOR * noise_floor, ABS_TOL + rel_tol * abs(ref_loss))


def judge_curve(
    losses: list[float], ref: list[float], ref2: list[float], rel_tol: float = REL_TOL
) -> CurveJudgement:
    """Compare a probe's losses with reference run 1, allowing for the gap between the two references.

    Only finite steps are compared here; non-finite values are ``nan``'s business.
    """
    pairs = [(a, b) for a, b in zip(ref, ref2, strict=False) if math.isfinite(a) and math.isfinite(b)]
    noise = max((abs(a - b) for a, b in pairs), default=0.0)
    max_gap, first_bad, allowed_at_worst = 0.0, None, allowed_gap(ref[0] if ref else 0.0, noise, rel_tol)
    for step, (loss, want) in enumerate(zip(losses, ref, strict=False)):
        if not (math.isfinite(loss) and math.isfinite(want)):
            continue
        gap = abs(loss - want)
        allowed = allowed_gap(want, noise, rel_tol)
        if gap > max_gap:
            max_gap, allowed_at_worst = gap, allowed
        if gap > allowed and first_bad is None:
            first_bad = step
    return CurveJudgement(max_gap, noise, first_bad, allowed_at_worst)


def _first_nonfinite(values: list[float]) -> int | None:
    return next((i for i, v in enumerate(values) if not math.isfinite(v)), None)


def _curve_text(losses: list[float], ref: list[float], step: int) -> str:
    lo = max(0, step - 1)
    shown = ", ".join(f"{v:.4g}" for v in losses[lo : step + 3])
    want = ", ".join(f"{v:.4g}" for v in ref[lo : step + 3])
    return f"loss from step {lo}: {shown} (reference {want})"


def _training_findings(name: str, m: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(kind, detail, remedy) for each problem in a dp/ddp run, most specific first."""
    losses, ref, ref2 = m["losses"], m["ref_losses"], m["ref2_losses"]
    found: list[tuple[str, str, str]] = []
    if name == "dp" and m.get("replica_mismatches"):
        first = m["replica_mismatches"][0]
        found.append(
            (
                "corrupt",
                f"replica {first['replica']}'s parameters differed from the master's right after the "
                f"broadcast at step {first['step']} ({first['tensors']} tensors; "
                f"{len(m['replica_mismatches'])} replica-steps "
                "in all)",
                CORRUPT_REMEDY,
            )
        )
    if name == "ddp" and m.get("desync_steps"):
        first = m["desync_steps"][0]
        ranks = ",".join(str(r) for r in first["ranks"])
        found.append(
            (
                "desync",
                f"rank {ranks} parameters stopped being bitwise equal to rank 0's after step {first['step']} "
                f"({len(m['desync_steps'])} of {len(losses)} steps out of step)",
                _DESYNC_REMEDY,
            )
        )
    bad_ref = _first_nonfinite(ref)
    bad_loss = _first_nonfinite(losses)
    bad_grad = m.get("nonfinite_grad_steps") or []
    if bad_ref is not None:
        found.append(
            ("nan", f"the single-device reference went non-finite at step {bad_ref}", _NAN_REFERENCE_REMEDY)
        )
    elif bad_loss is not None or bad_grad:
        where = []
        if bad_grad:
            where.append(f"gradients non-finite from step {bad_grad[0]}")
        if bad_loss is not None:
            where.append(f"loss non-finite from step {bad_loss} ({_curve_text(losses, ref, bad_loss)})")
        found.append(
            (
                "nan",
                "; ".join(where) + "; the reference stayed finite",
                _NAN_DP_REMEDY if name == "dp" else _NAN_DDP_REMEDY,
            )
        )
    curve = judge_curve(losses, ref, ref2, m.get("rel_tol", REL_TOL))
    if not curve.ok and curve.first_bad_step is not None:
        found.append(
            (
                "diverged",
                f"off the reference from step {curve.first_bad_step} "
                f"({_curve_text(losses, ref, curve.first_bad_step)}); "
                f"gap {curve.max_gap:.3g} > allowed "
                f"{curve.allowed_at_worst:.3g} (noise floor {curve.noise_floor:.3g})",
                _DIVERGED_REMEDY,
            )
        )
    return found


def _judge_training(name: str, m: dict[str, Any]) -> CheckResult:
    curve = judge_curve(m["losses"], m["ref_losses"], m["ref2_losses"], m.get("rel_tol", REL_TOL))
    metrics = {**m, "max_loss_gap": curve.max_gap, "noise_floor": curve.noise_floor}
    found = _training_findings(name, m)
    if found:
        kind, detail, remedy = found[0]
        if len(found) > 1:
            detail += "; also " + "; ".join(f"{k}: {d}" for k, d, _ in found[1:])
        return fail(name, kind, detail, remedy, metrics)
    steps = len(m["losses"])
    if name == "dp":
        exact = (
            f"replicas equal to the master after every broadcast ({m['replicas']} replicas)"
            if m["replicas"] > 1
            else "one device, so nothing to broadcast"
        )
    else:
        exact = f"parameters bitwise equal across {m['ranks']} ranks after every step"
    floor = (
        f"noise floor {curve.noise_floor:.2g}" if m.get("ref2_run", True) else "within the fixed tolerance"
    )
    detail = f"{steps} steps within {curve.max_gap:.2g} of the reference ({floor}); {exact}"
    return CheckResult(name, PASS, None, detail, None, metrics)


def judge_dp(metrics: dict[str, Any]) -> CheckResult:
    """DataParallel: replicas after broadcast, NaN, and the loss curve against the reference."""
    return _judge_training("dp", metrics)


def judge_ddp(metrics: dict[str, Any]) -> CheckResult:
    """DDP: bitwise parameter equality across ranks, NaN, and the loss curve against the reference."""
    return _judge_training("ddp", metrics)


# --- all-reduce and p2p -------------------------------------------------------------------------------


def judge_allreduce(
    metrics: dict[str, Any],
    expected_busbw_gbps: float | None,
    judge_speed: bool,
    speed_note: str | None = None,
) -> CheckResult:
    """``#wrong`` must be 0 at every size; with ``judge_speed``, peak busbw must reach ``SLOW_FRACTION``
    of the model's estimate. Adds ``peak_busbw_gbps`` and ``expected_busbw_gbps`` to the metrics."""
    rows = metrics["rows"]
    peak = max((r["busbw_gbps"] for r in rows), default=None)
    # nccl-tests' "# Avg bus bandwidth" is the mean busbw over the sizes of the sweep.
    avg = sum(r["busbw_gbps"] for r in rows) / len(rows) if rows else None
    out = {
        **metrics,
        "peak_busbw_gbps": peak,
        "avg_busbw_gbps": avg,
        "expected_busbw_gbps": expected_busbw_gbps,
    }
    wrong = [r for r in rows if r["wrong"]]
    if wrong:
        sizes = ", ".join(f"{r['wrong']} at {r['bytes']} B" for r in wrong)
        return fail(
            "allreduce",
            "corrupt",
            f"all-reduce of known integers returned wrong elements: {sizes}",
            CORRUPT_REMEDY,
            out,
        )
    ranks = metrics.get("ranks", 0)
    peak_text = f"peak busbw {peak:.3g} GB/s" if peak is not None else "no sizes measured"
    if ranks < 2:
        return CheckResult(
            "allreduce",
            PASS,
            None,
            f"#wrong 0 at every size; one rank, so no bus traffic ({peak_text})",
            None,
            out,
        )
    if expected_busbw_gbps is None:
        note = speed_note or "no bandwidth estimate for this set"
        return CheckResult(
            "allreduce",
            PASS,
            None,
            f"#wrong 0 at every size; {peak_text}; speed not judged: {note}",
            None,
            out,
        )
    ratio_text = f"{peak_text} vs model {expected_busbw_gbps:.3g} GB/s"
    if not judge_speed:
        note = speed_note or "not asked to"
        return CheckResult(
            "allreduce",
            PASS,
            None,
            f"#wrong 0 at every size; {ratio_text}; speed not judged: {note}",
            None,
            out,
        )
    if peak is not None and peak < SLOW_FRACTION * expected_busbw_gbps:
        detail = f"{ratio_text}: below {SLOW_FRACTION:.0%} of the estimate"
        return fail("allreduce", "slow", detail, _SLOW_REMEDY, out)
    return CheckResult("allreduce", PASS, None, f"#wrong 0 at every size; {ratio_text}", None, out)


def nothing_tested(sets: list[SetResult] | tuple[SetResult, ...]) -> str | None:
    """Why nothing was tested, when every check of every set was skipped (a run that must not PASS)."""
    checks = [(s, c) for s in sets for c in s.checks]
    if checks and all(c.verdict == SKIPPED for _, c in checks):
        return "; ".join(f"set {','.join(map(str, s.gpus))} {c.name}: {c.detail}" for s, c in checks)
    if not checks:
        return "no check ran"
    return None


# --- launches that did not finish ---------------------------------------------------------------------


def _with_nccl_warnings(detail: str, warnings: Sequence[str]) -> str:
    """The detail with NCCL's last WARN line appended: NCCL states the root cause there (a peer that
    failed, a transport error), in the rank's NCCL log rather than its stderr."""
    return f"{detail}; NCCL WARN {warnings[-1]}" if warnings else detail


def hung(
    name: str,
    timeout_s: float,
    progress: dict[int, dict[str, Any]],
    now: float,
    nccl_warnings: Sequence[str] = (),
) -> CheckResult:
    """The check in progress when ``--timeout`` ran out; names where each rank last reported, and NCCL's
    WARN lines from the set's ranks' logs (``rank r: text``)."""
    where = []
    for rank in sorted(progress):
        row = progress[rank]
        step = f" {row['done']}/{row['total']}" if row.get("total") else ""
        where.append(
            f"rank {rank} last at {row['check']} {row['stage']}{step} ({now - row['t']:.1f} s before)"
        )
    silent = ", ".join(where) if where else "no rank reported any progress"
    metrics = {"timeout_s": timeout_s, "last_progress": progress, "nccl_warnings": list(nccl_warnings)}
    ages = [now - float(row["t"]) for row in progress.values() if isinstance(row.get("t"), (int, float))]
    if ages and min(ages) < timeout_s:
        # A rank reported progress within --timeout of the stop: the pool stopped a set that was still
        # moving (its cap on a step's time, pool.LOAD_CAP), a machine too loaded for the run, not a hang.
        detail = f"slow under load: still making progress when the run's time ran out; {silent}"
        return fail(
            name, "slow", _with_nccl_warnings(detail, nccl_warnings), _SLOW_UNDER_LOAD_REMEDY, metrics
        )
    detail = _with_nccl_warnings(f"no progress within --timeout {timeout_s:g} s; {silent}", nccl_warnings)
    return fail(name, "hung", detail, _HUNG_REMEDY, metrics)


_SLOW_UNDER_LOAD_REMEDY = (
    "The ranks were moving, only slowly: run the probe when the machine is less busy, with fewer sets at "
    "once, or with a larger --timeout."
)


def crashed(
    name: str,
    rank: int | None,
    exitcode: int | None,
    signal: str | None,
    stderr_tail: str,
    message: str | None,
    nccl_warnings: Sequence[str] = (),
) -> CheckResult:
    """The check in progress when a rank died; the root cause's rank, exit code and stderr tail, and
    NCCL's WARN lines from the set's ranks' logs (``rank r: text``)."""
    who = f"rank {rank}" if rank is not None else "the launcher"
    how = f"exit code {exitcode}" + (f" ({signal})" if signal else "")
    detail = f"{who} exited with {how}"
    if message:
        detail += f": {message.strip().splitlines()[-1]}"
    detail = _with_nccl_warnings(detail, nccl_warnings)
    metrics = {"rank": rank, "exitcode": exitcode, "signal": signal, "stderr_tail": stderr_tail}
    metrics["nccl_warnings"] = list(nccl_warnings)
    return fail(name, "crashed", detail, _CRASHED_REMEDY, metrics)


def with_healthy_sets(results: list[SetResult]) -> list[SetResult]:
    """Append to every failure's remedy which sets of this run passed (or that none did)."""
    healthy = [",".join(map(str, r.gpus)) for r in results if r.verdict == PASS]
    note = f" Healthy sets in this run: {'; '.join(healthy)}." if healthy else " No set passed in this run."
    out = []
    for r in results:
        checks = tuple(
            replace(c, remedy=c.remedy + note) if c.verdict == FAIL and c.remedy else c for c in r.checks
        )
        out.append(SetResult(r.gpus, checks))
    return out
