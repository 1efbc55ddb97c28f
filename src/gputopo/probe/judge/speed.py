"""The speed table, judged: is DataParallel or DDP worth it on this set? (pure: rows in, verdict out)

The ranks (``gputopo.probe.ranks.speed``) time one GPU, DataParallel, DDP and DDP with AMP at the same
global batch. Here each row gets its speedup over one GPU and its scaling efficiency (speedup divided by
the number of GPUs), and two things are flagged:

- DataParallel slower than one GPU: its single process scatters inputs, copies the whole model to every
  GPU each step and gathers outputs on GPU 0, so on small batches or slow links it loses to one GPU.
  The advice is DDP.
- DDP scaling efficiency below ``SCALING_FLOOR``. DDP overlaps its bucketed gradient all-reduce with the
  backward pass, so on a healthy set the added cost per step is the part of the all-reduce that does
  not overlap. Below 0.7, more than 30% of the set's GPU time goes to waiting on communication: two
  GPUs give less than 1.4x, four less than 2.8x. The seed's table (DDP needing four GPUs for 2x, an
  efficiency of 0.5) is well below it; sets whose links keep up stay above it unless the per-GPU batch
  is so small that the step is all communication, which the flag's advice names.

Flags are advice, not failures: a slow configuration trains correctly. CPU stand-ins are timed and
shown, never judged: gloo on shared CPU cores says nothing about a GPU set.
"""

from __future__ import annotations

from typing import Any

CONFIGS = ("1 GPU", "DataParallel", "DDP", "DDP+AMP")
SCALING_FLOOR = 0.7

_DP_ADVICE = (
    "DataParallel is slower than one GPU here: use DistributedDataParallel (torchrun, one process per GPU)."
)
_DDP_ADVICE = (
    "DDP scales below {floor:.0%} efficiency on this set: the GPUs wait on gradient all-reduce. Check the "
    "links (`gputopo topo`, `gputopo probe --mode allreduce` on this set), prefer a set on NVLink or one "
    "PCIe switch (`gputopo recommend`), and use a larger per-GPU batch so each step has more compute to "
    "overlap the all-reduce with."
)


def with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with ``speedup`` over the one-GPU row and ``efficiency`` (speedup per GPU)."""
    base = next((r["samples_per_s"] for r in rows if r["config"] == CONFIGS[0]), None)
    out = []
    for r in rows:
        speedup = r["samples_per_s"] / base if base else None
        devices = r.get("devices") or 1
        out.append(
            {**r, "speedup": speedup, "efficiency": speedup / devices if speedup is not None else None}
        )
    return out


def speed_flags(rows: list[dict[str, Any]], devices: int) -> list[str]:
    """The advice the table calls for (empty when DataParallel and DDP are both worth it)."""
    if devices < 2:
        return []
    by = {r["config"]: r for r in rows}
    flags = []
    dp = by.get(CONFIGS[1])
    if dp and dp["speedup"] is not None and dp["speedup"] < 1.0:
        flags.append(f"DataParallel {dp['speedup']:.2f}x of one GPU. {_DP_ADVICE}")
    ddp = by.get(CONFIGS[2])
    if ddp and ddp["efficiency"] is not None and ddp["efficiency"] < SCALING_FLOOR:
        flags.append(
            f"DDP {ddp['speedup']:.2f}x on {devices} GPUs (efficiency {ddp['efficiency']:.0%}). "
            + _DDP_ADVICE.format(floor=SCALING_FLOOR)
        )
    return flags


def judge_speed(metrics: dict[str, Any], device: str) -> Any:
    """The speed check's result: always ``pass`` once measured, with speedups, and flags on GPUs."""
    from gputopo.probe.judge.verdict import PASS, CheckResult

    rows = with_speedups(metrics.get("rows") or [])
    devices = int(metrics.get("ranks") or 1)
    summary = ", ".join(
        f"{r['config']} {r['samples_per_s']:.4g}/s"
        + (f" ({r['speedup']:.2f}x)" if r["config"] != CONFIGS[0] else "")
        for r in rows
    )
    if device != "cuda":
        flags: list[str] = []
        detail = (
            f"{summary}; CPU stand-ins: timings shown, not judged (gloo on shared CPU cores is no GPU set)"
        )
    elif devices < 2:
        flags = []
        detail = f"{summary}; one GPU, nothing to scale"
    else:
        flags = speed_flags(rows, devices)
        detail = summary + (
            "; " + " ".join(flags) if flags else "; DataParallel and DDP both faster than one GPU"
        )
    out = {
        **metrics,
        "rows": rows,
        "flags": flags,
        "scaling_floor": SCALING_FLOOR,
        "judged": device == "cuda",
    }
    return CheckResult("speed", PASS, None, detail, None, out)


def speed_table(gpus: tuple[int, ...], metrics: dict[str, Any], device: str) -> list[str]:
    """The seed's table on the user's set, with a text bar per row (``#`` header lines, as the others)."""
    rows = metrics.get("rows") or []
    if not rows:
        return []
    label = ",".join(str(g) for g in gpus)
    stand_in = " (CPU stand-ins: not judged)" if device != "cuda" else ""
    batch = rows[0].get("global_batch")
    lines = [
        f"# speed, set {label}: samples/s at global batch {batch}, "
        f"{rows[0].get('timed_steps')} timed steps{stand_in}",
        f"# numerics: {metrics.get('numerics') or 'the correctness checks pinned numerics (TF32 off)'}",
        f"# {'config':<13} {'GPUs':>4} {'samples/s':>10} {'speedup':>8} {'efficiency':>10}",
    ]
    top = max(r["samples_per_s"] for r in rows) or 1.0
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "n/a"
        eff = f"{r['efficiency']:.0%}" if r.get("efficiency") is not None else "n/a"
        bar = "#" * max(1, round(30 * r["samples_per_s"] / top))
        lines.append(
            f"  {r['config']:<13} {r.get('devices', 1):>4} {r['samples_per_s']:>10.1f} "
            f"{speedup:>8} {eff:>10}  {bar}"
        )
    for flag in metrics.get("flags") or []:
        lines.append(f"# FLAG: {flag}")
    return lines
