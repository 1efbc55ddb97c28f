"""recommend's JSON document (``gputopo/recommendation/v1``): candidates with their estimate, bottleneck,
reasons and the export environment."""

from __future__ import annotations

from typing import Any

from gputopo.recommend.reasons import Candidate, Recommendation

SCHEMA = "gputopo/recommendation/v1"


def candidate_dict(c: Candidate, id_format: str = "index") -> dict[str, Any]:
    """One candidate: the keys docs/output.md names (gpus, est_busbw_gbps, bottleneck, reasons) and more."""
    b = c.bottleneck
    return {
        "gpus": list(c.gpus),
        "est_busbw_gbps": round(c.est_busbw_gbps, 3) if c.est_busbw_gbps is not None else None,
        "est_is_lower_bound": c.lower_bound,
        "bottleneck": b.code if b else None,
        "bottleneck_gpus": [b.a, b.b] if b else None,
        "bottleneck_gbps": round(b.gbps, 3) if b else None,
        "bottleneck_measured": b.measured if b else False,
        "ring": list(c.ring) if c.ring else None,
        "pair_sum_gbps": c.pair_sum_gbps,
        "numa_nodes": [label.removeprefix("NUMA ") for label in c.numa_nodes if label.startswith("NUMA ")],
        "locality": list(c.numa_nodes),
        "reasons": list(c.reasons),
        "env": c.env(id_format),
        "equivalent_sets": c.equivalent_sets,
    }


def to_dict(rec: Recommendation, id_format: str = "index") -> dict[str, Any]:
    """The ``gputopo/recommendation/v1`` document."""
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "source": rec.source,
        "n": rec.n,
        "best": candidate_dict(rec.best, id_format),
        "candidates": [candidate_dict(c, id_format) for c in rec.candidates],
        "excluded": [{"gpu": e.gpu, "why": e.why} for e in rec.excluded],
        "kept_apart": [{"gpus": list(f.gpus), "why": f.why} for f in rec.kept_apart],
        "env": rec.best.env(id_format),
        "assumptions": [str(note) for note in rec.notes],
        "warnings": list(rec.warnings),
        "merged_note": rec.merged_note,
    }
    if rec.sets is not None:
        doc["sets"] = [candidate_dict(c, id_format) for c in rec.sets]
    return doc
