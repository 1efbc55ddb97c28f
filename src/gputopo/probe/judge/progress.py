"""Where each rank of a run across nodes got, from its last progress row: who was left behind when it
hung or crashed, as findings (pure)."""

from __future__ import annotations

from typing import Any

# Where a rank is within a step, from the stage of its last progress row: 0 entered a test but not its
# collective yet, 1 inside the test's collectives, 2 done with the step (waiting for the others to be).
_PHASE = {"enter": 0, "injected-hang": 0, "injected-crash": 0, "collective": 1, "size": 1}


FINISHED_STEP = 1 << 30


def position(row: dict[str, Any]) -> tuple[int, int]:
    """How far a rank got: (step of the plan, phase within it). A rank that sits a step out is done with
    it at once, so ranks are compared by where they are in the plan, not by how many rows they wrote."""
    return int(row.get("step", -1)), _PHASE.get(str(row.get("stage")), 2)


def _behind(progress: dict[int, dict[str, Any]]) -> tuple[tuple[int, int], list[dict[str, Any]]]:
    low = min(position(p) for p in progress.values())
    return low, [p for p in progress.values() if position(p) == low]


def _where(row: dict[str, Any]) -> str:
    return f"{row.get('test') or 'step ' + str(row.get('step'))} ({row.get('stage')})"


def _left_behind(progress: dict[int, dict[str, Any]]) -> list[tuple[int, str, str, str]] | None:
    """The ranks that stopped before their test's collective while other ranks went on (into it or past
    it), as (node, host, its GPUs, where) per node; ``None`` when the ranks furthest behind are not such
    ranks (they are inside a collective, or every rank stopped at the same place)."""
    low, behind = _behind(progress)
    if low[1] != 0 or len(behind) == len(progress):
        return None
    out = []
    for n in sorted({int(p["node"]) for p in behind}):
        rows = [p for p in behind if int(p["node"]) == n]
        out.append((n, str(rows[0].get("host")), ",".join(str(p.get("gpu")) for p in rows), _where(rows[0])))
    return out


def crash_findings(progress: dict[int, dict[str, Any]], message: str) -> list[dict[str, Any]]:
    """Name the node(s) a rank died on, from the last progress every rank left in the store: ranks that
    stopped before their test's collective while the others were in it or past it are the ones that
    left. Ranks all at the same place say nothing (a crash inside the collective looks the same)."""
    left = _left_behind(progress) if progress else None
    return [
        {
            "kind": "crashed",
            "nodes": [n],
            "detail": f"node {n} ({host}), GPU {gpus}: its ranks stopped at {at} before their all-reduce "
            f"while the others went on, and the others lost their connection to it ({message})",
            "remedy": "read that node's output for the first error (its rank's exit code and stderr)",
        }
        for n, host, gpus, at in left or ()
    ]


def hang_findings(progress: dict[int, dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
    """Name the node(s) behind from the last progress each rank left in the rendezvous store.

    Ranks are compared by ``position``: the ones furthest behind in the plan are where it stopped. Behind
    before their test's collective, they hung by themselves (the others waited in the collective for
    them); all inside the same test's collective, the collective between those nodes hangs.
    """
    if not progress:
        return [
            {
                "kind": "hung",
                "nodes": [],
                "detail": f"no rank progressed for {timeout_s:g} s and none left progress in the store",
                "remedy": "rerun with NCCL_DEBUG=INFO and look at each node's output",
            }
        ]
    left = _left_behind(progress)
    if left is None:
        low, behind = _behind(progress)
        nodes = sorted({int(p["node"]) for p in behind})
        at = f"{_where(behind[0])}, {'inside its all-reduce' if low[1] == 1 else 'between steps'}"
        return [
            {
                "kind": "hung",
                "nodes": nodes,
                "detail": f"the ranks of node {', '.join(map(str, nodes))} all stopped at {at}, for over "
                f"{timeout_s:g} s: the collective between these nodes hangs",
                "remedy": "check the network between these nodes; rerun with NCCL_DEBUG=INFO",
            }
        ]
    return [
        {
            "kind": "hung",
            "nodes": [n],
            "detail": f"node {n} ({host}), GPU {gpus}: stopped at {at}, before its all-reduce, for over "
            f"{timeout_s:g} s while the other ranks went on and waited for it",
            "remedy": "look at this node: py-spy dump or gdb on its ranks, dmesg for Xid errors",
        }
        for n, host, gpus, at in left
    ]
