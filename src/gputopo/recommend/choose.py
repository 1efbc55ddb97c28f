"""``recommend``: Topology + constraints -> ranked candidates with reasons, top to bottom: exclusions,
the bandwidth model, the exact search over set shapes, candidates and their reasons, disjoint packing."""

from __future__ import annotations

from dataclasses import replace

from gputopo.errors import UsageError
from gputopo.model import Topology
from gputopo.recommend.constraints import Constraints, exclusions
from gputopo.recommend.evidence import FailedGroup
from gputopo.recommend.reasons import Recommendation, fewer_hint, input_warnings, make_candidate
from gputopo.recommend.search import count_equivalent_sets, make_problem, pack_sets, rank_shapes, set_shapes
from gputopo.topology.bandwidth import build_model


def recommend(topo: Topology, constraints: Constraints) -> Recommendation:
    """Rank the ``constraints.n``-GPU sets of ``topo`` and, with ``constraints.sets``, pack disjoint ones.

    Raises ``UsageError`` (exit 2) for a request that cannot be met: ``n`` below 1, more GPUs than are
    available (the message says which are excluded and why), sets that do not fit, an unknown GPU in
    ``exclude``, or probe findings that rule out every set.
    """
    n, count = constraints.n, constraints.sets
    if n < 1:
        raise UsageError(f"--n {n}: a set needs at least one GPU", "ask for --n 1 or more")
    if count is not None and count < 1:
        raise UsageError(
            f"--sets {count}: need at least one set", "ask for --sets 1 or more, or leave it out"
        )
    if constraints.top < 1:
        raise UsageError(f"--top {constraints.top}: need at least one candidate", "ask for --top 1 or more")
    excluded = exclusions(topo, constraints)
    out = {e.gpu for e in excluded}
    available = [g for g in sorted(topo.gpu_indices) if g not in out]
    need = n * (count or 1)
    if need > len(available):
        asked = f"--n {n}" + (f" --sets {count} needs {need} GPUs" if count else "")
        why = "; ".join(f"GPU{e.gpu} {e.why}" for e in excluded)
        raise UsageError(
            f"{asked}: only {len(available)} of {len(topo.gpus)} GPUs available"
            + (f" ({why})" if why else ""),
            fewer_hint(excluded),
        )
    model = build_model(topo, constraints.assumptions)
    p = make_problem(topo, model, available, constraints.evidence, constraints.redirected)
    shapes = set_shapes(p, n)
    if not shapes:
        raise UsageError(
            f"--n {n}: every {n}-GPU set includes GPUs a probe report keeps apart",
            "ask for fewer GPUs, or re-probe the failing pairs after fixing them",
        )
    ranked = rank_shapes(p, shapes, constraints.top)
    candidates = tuple(
        replace(
            make_candidate(p, rank, shape.gpus, ranked[0] if rank > 1 else None),
            equivalent_sets=count_equivalent_sets(p, shape),
        )
        for rank, (_, shape) in enumerate(ranked, start=1)
    )
    packed = None
    if count is not None:
        sets = pack_sets(p, shapes, count)
        if sets is None:
            raise UsageError(
                f"--sets {count} --n {n}: no {count} disjoint sets avoid the GPUs a probe report keeps apart",
                "ask for fewer or smaller sets",
            )
        packed = tuple(make_candidate(p, i, gpus, None) for i, gpus in enumerate(sets, start=1))
    known = set(topo.gpu_indices)
    # One entry per group of GPUs, with every reason (a pair failing dp and ddp is one pair kept apart).
    reasons: dict[tuple[int, ...], list[str]] = {}
    for f in constraints.evidence.failed if constraints.evidence else ():
        if len(f.gpus) >= 2 and set(f.gpus) <= known and f.why not in reasons.get(f.gpus, []):
            reasons.setdefault(f.gpus, []).append(f.why)
    kept_apart = tuple(FailedGroup(gpus, "; ".join(whys)) for gpus, whys in reasons.items())
    return Recommendation(
        source=topo.source,
        n=n,
        best=candidates[0],
        candidates=candidates,
        excluded=excluded,
        kept_apart=kept_apart,
        notes=model.notes(available),
        warnings=topo.warnings + input_warnings(p, constraints),
        sets=packed,
        available=tuple(available),
        top=constraints.top,
    )
