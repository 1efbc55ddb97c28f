"""The P2P data check's verdict: exact copies first (a wrong byte is ``corrupt``, whatever NVML says), then
bandwidth against the model, with NVML's own P2P status beside the measurement."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gputopo.probe.judge.verdict import CORRUPT_REMEDY, PASS, CheckResult, fail, skipped

NO_P2P_PATH = "no peer-to-peer path: copies staged through host memory"


def _pair_list(pairs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{p['src']}->{p['dst']}" for p in pairs)


def _nvml_text(pairs: list[dict[str, Any]]) -> str:
    statuses = sorted({str(p.get("nvml_p2p_read")) for p in pairs if p.get("nvml_p2p_read") is not None})
    return f"NVML P2P read status: {', '.join(statuses)}" if statuses else "NVML P2P status: not known"


def _wrong(p: dict[str, Any]) -> int:
    """Every wrong byte of a pair: the quiet copy there, the round trip, the bidirectional round (absent
    in reports from before it was checked)."""
    return sum(
        int(p.get(k) or 0) for k in ("wrong_bytes_there", "wrong_bytes_roundtrip", "wrong_bytes_bidir")
    )


def p2p_matrices(metrics: dict[str, Any]) -> dict[str, Any]:
    """The pair results as matrices over ``metrics['gpus']`` (row: source, column: destination; ``None``
    on the diagonal and where unmeasured), for the terminal, the JSON and the heat maps."""
    gpus = list(metrics.get("gpus") or sorted({p["src"] for p in metrics.get("pairs", [])}))
    at = {g: k for k, g in enumerate(gpus)}
    keys = ("unidir_gbps", "bidir_gbps", "latency_us", "expected_gbps", "path", "nvml_p2p_read")
    out: dict[str, Any] = {"gpus": gpus}
    for key in (*keys, "wrong_bytes"):
        out[key] = [[None] * len(gpus) for _ in gpus]
    for p in metrics.get("pairs", []):
        if p["src"] not in at or p["dst"] not in at:
            continue
        i, j = at[p["src"]], at[p["dst"]]
        for key in keys:
            out[key][i][j] = p.get(key)
        out["wrong_bytes"][i][j] = _wrong(p)
    return out


def judge_p2p(
    metrics: dict[str, Any],
    nvml_p2p: dict[tuple[int, int], str] | None,
    expected_gbps: Callable[[int, int], float | None] | None = None,
) -> CheckResult:
    """Every ordered pair's copies there and back must be exact, whatever NVML or CUDA claim; a PASS
    needs pairs that really went peer to peer.

    ``nvml_p2p`` maps (src, dst) GPU indices to NVML's read status (``OK``, ``CNS``...), shown beside the
    result, since the failure this catches is NVML saying OK while the data comes back wrong.
    ``expected_gbps(src, dst)`` is the bandwidth model's one-way estimate for the heat map. Pairs without
    peer access are copied through host memory by torch: exact or not, they test no P2P path, so a set
    where every pair is staged is ``skipped`` with that reason, never a PASS.
    """
    pairs = []
    for p in metrics["pairs"]:
        row = {**p, "nvml_p2p_read": (nvml_p2p or {}).get((p["src"], p["dst"]))}
        row.setdefault("path", "p2p" if p.get("can_access_peer", True) else "staged")
        if expected_gbps is not None:
            row["expected_gbps"] = expected_gbps(p["src"], p["dst"])
        pairs.append(row)
    out = {**metrics, "pairs": pairs}
    out["matrix"] = p2p_matrices(out)
    bad = [p for p in pairs if _wrong(p)]
    if bad:
        texts = []
        for p in bad:
            claims = f"can_device_access_peer={p['can_access_peer']}"
            if p["nvml_p2p_read"] is not None:
                claims += f", NVML P2P read {p['nvml_p2p_read']}"
            how = "peer to peer" if p["path"] == "p2p" else "staged through host memory"
            bidir = p.get("wrong_bytes_bidir")
            both = f", {bidir} after the bidirectional round" if bidir is not None else ""
            texts.append(
                f"{p['src']}->{p['dst']} ({how}): {p['wrong_bytes_there']} wrong bytes there, "
                f"{p['wrong_bytes_roundtrip']} after the round trip{both} ({claims})"
            )
        return fail("p2p", "corrupt", "; ".join(texts), CORRUPT_REMEDY, out)
    direct = [p for p in pairs if p["path"] == "p2p"]
    staged = [p for p in pairs if p["path"] != "p2p"]
    size = (
        f"{metrics['bytes'] >> 20} MiB" if metrics.get("bytes", 0) >= 1 << 20 else f"{metrics.get('bytes')} B"
    )
    if not direct:
        detail = f"{NO_P2P_PATH} ({_nvml_text(staged)}); the staged copies were exact"
        return skipped("p2p", detail, out)
    one_way = [p["unidir_gbps"] for p in direct if p.get("unidir_gbps") is not None]
    both = [p["bidir_gbps"] for p in direct if p.get("bidir_gbps") is not None]
    detail = (
        f"{len(direct)} ordered pairs copied exactly peer to peer ({size} each, sentinel-checked there, "
        f"back and both ways at once)"
    )
    if one_way:
        detail += f"; slowest {min(one_way):.3g} GB/s one way"
    if both:
        detail += f", {min(both):.3g} GB/s both ways"
    if staged:
        detail += f"; {NO_P2P_PATH} for {_pair_list(staged)} ({_nvml_text(staged)})"
    return CheckResult("p2p", PASS, None, detail, None, out)
