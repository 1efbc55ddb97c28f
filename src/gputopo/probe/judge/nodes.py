"""Across nodes, in plain data: which groups of nodes to test next, and what the results point at (pure).

A multi-node probe (``gputopo.probe.pool.multinode``) runs one torch.distributed.run launch over every node;
its ranks (``gputopo.probe.ranks.crossnode``) test groups of nodes with an exactly checked all-reduce and a
timed sweep, step by step. Every rank holds every result so far and asks ``next_step`` what comes next,
so all of them create the same process groups in the same order without anyone broadcasting a plan:

1. every node at once;
2. node pairs in the "each node once" pattern: disjoint pairs, all at the same time (n/2 runs; with an odd
   count the last node runs again with node 0);
3. bisection of whatever failed (wrong sums) or was slow, until the culprit is one node, one pair of
   nodes (the link between them), or a group that fails only as a whole: a group of four or more is
   split in halves (both passing: the pairs across them), a group of three tried pair by pair, and a
   pair resolved by testing each of its nodes with a node already seen healthy between nodes;
4. per rail, when every node has the same number of GPUs: GPU k of every node, for each k.

Stragglers are judged across nodes by median and MAD, not fixed thresholds. A node is late in a test
when the other ranks waited for it inside the collectives: each rank times how long it spends inside
each all-reduce, and the rank that arrived last waited least (``lateness`` = the most any rank of the
test waited minus what this node's ranks waited). A node whose median lateness stands out from the
other nodes' by more than ``MAD_K`` scaled MADs is a straggler. Slow node pairs are found the same way
on their bus bandwidth, when there are at least three pairs to compare. The transport NCCL used and the
bandwidth against the NICs' line rate, on any number of nodes, are judged in ``judge.network``.

Every finding names nodes by node rank and host, and the GPU and NIC where one rank is to blame.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

# How far outside the nodes' spread a value must lie: MAD is scaled by 1.4826 to estimate a normal
# standard deviation (Rousseeuw and Croux), and 5 of those keeps scheduler noise from naming a node.
MAD_SCALE = 1.4826
MAD_K = 5.0
# The spread below which differences are noise whatever the MAD says (several equal lateness values give
# a MAD of 0): 2 ms of waiting per collective, or 10% of a pair's bandwidth.
LATENESS_FLOOR_MS = 2.0
BUSBW_FLOOR_FRACTION = 0.10
MIN_NODES_FOR_SPREAD = 3

Test = dict[str, Any]


@dataclass(frozen=True)
class Layout:
    """Who is where after the rendezvous: each global rank's node, host, local rank, GPU and NIC."""

    ranks: tuple[dict[str, Any], ...]

    @classmethod
    def from_table(cls, table: Sequence[dict[str, Any]], nnodes: int) -> Layout:
        """Check the ranks' own account of where they run (``table[r]`` from global rank ``r``)."""
        seen: dict[int, str] = {}
        for row in table:
            node, host = int(row["node"]), str(row["host"])
            if not 0 <= node < nnodes:
                raise ValueError(
                    f"a node said --node-rank {node}, outside 0..{nnodes - 1} (--nnodes {nnodes})"
                )
            if seen.setdefault(node, host) != host:
                raise ValueError(
                    f"two nodes said --node-rank {node} ({seen[node]} and {host}): "
                    "give each node its own rank"
                )
        missing = sorted(set(range(nnodes)) - set(seen))
        if missing:
            raise ValueError(
                f"no node said --node-rank {', '.join(map(str, missing))}: give each node its own rank"
            )
        return cls(tuple(sorted((dict(r) for r in table), key=lambda r: int(r["rank"]))))

    @property
    def nodes(self) -> tuple[int, ...]:
        """Node ranks, ascending."""
        return tuple(sorted({int(r["node"]) for r in self.ranks}))

    def host(self, node: int) -> str:
        """The host name a node's ranks reported."""
        return next(str(r["host"]) for r in self.ranks if int(r["node"]) == node)

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks of ``node``, by local rank."""
        rows = sorted((r for r in self.ranks if int(r["node"]) == node), key=lambda r: int(r["local_rank"]))
        return [int(r["rank"]) for r in rows]

    @property
    def rails(self) -> int:
        """GPUs per node when every node has the same number (else 0: rails are not comparable)."""
        sizes = {len(self.node_ranks(n)) for n in self.nodes}
        return sizes.pop() if len(sizes) == 1 else 0

    def test_ranks(self, test: Test) -> list[int]:
        """The global ranks that run ``test``, in group order (node by node, then local rank)."""
        ranks = [r for n in test["nodes"] for r in self.node_ranks(n)]
        if test.get("rail") is not None:
            ranks = [self.node_ranks(n)[int(test["rail"])] for n in test["nodes"]]
        return ranks

    def where(self, rank: int) -> dict[str, Any]:
        """The row of one global rank."""
        return self.ranks[rank]


def _key(test: Test) -> tuple[frozenset[int], int | None]:
    return frozenset(int(n) for n in test["nodes"]), test.get("rail")


def _test(kind: str, nodes: Iterable[int], rail: int | None = None) -> Test:
    return {"kind": kind, "nodes": sorted(int(n) for n in nodes), "rail": rail}


def pair_steps(nodes: Sequence[int]) -> list[list[Test]]:
    """ "Each node once": disjoint pairs in one step; with an odd count, the last node with the first
    in a second step. Fewer than three nodes have no pairs beyond the all-nodes test."""
    if len(nodes) < 3:
        return []
    pairs = [_test("pair", nodes[i : i + 2]) for i in range(0, len(nodes) - 1, 2)]
    steps = [pairs]
    if len(nodes) % 2:
        steps.append([_test("pair", (nodes[0], nodes[-1]))])
    return steps


def failed(test: Test) -> bool:
    """A test whose sums came back wrong."""
    return int(test.get("wrong") or 0) > 0


def median_mad(values: Sequence[float]) -> tuple[float, float]:
    """The median and the scaled median absolute deviation of ``values``."""
    med = statistics.median(values)
    return med, MAD_SCALE * statistics.median(abs(v - med) for v in values)


def slow_pairs(results: Sequence[Test]) -> list[Test]:
    """Pair tests whose bus bandwidth lies more than ``MAD_K`` MADs below the pairs' median."""
    pairs = [t for t in results if len(t["nodes"]) == 2 and t.get("rail") is None and not failed(t)]
    pairs = [t for t in pairs if t.get("busbw_gbps")]
    if len(pairs) < MIN_NODES_FOR_SPREAD:
        return []
    med, mad = median_mad([float(t["busbw_gbps"]) for t in pairs])
    spread = max(MAD_K * mad, BUSBW_FLOOR_FRACTION * med)
    return [t for t in pairs if float(t["busbw_gbps"]) < med - spread]


def _bad(test: Test | None, slow: list[Test]) -> bool | None:
    if test is None:
        return None
    return failed(test) or any(_key(test) == _key(s) for s in slow)


@dataclass(frozen=True)
class Culprit:
    """What a bisection ended at: ``node`` (one node), ``pair`` (the link between two), ``group``."""

    kind: str
    nodes: tuple[int, ...]
    why: str  # "wrong" (sums came back wrong) or "slow"
    unresolved: str | None = None


def _resolve(
    group: tuple[int, ...],
    by_key: dict[tuple[frozenset[int], int | None], Test],
    good: list[int],
    slow: list[Test],
    why: str,
) -> tuple[list[Culprit], list[Test]]:
    """Bisect ``group`` (known bad): the culprits found so far, and the tests still needed."""

    def result(nodes: Iterable[int]) -> Test | None:
        return by_key.get((frozenset(nodes), None))

    if len(group) == 1:
        return [Culprit("node", group, why)], []
    if len(group) == 2:
        a, b = group
        refs = [g for g in good if g not in group]
        if not refs:
            return [Culprit("pair", group, why, "no node seen healthy to test each against")], []
        ra, rb = refs[0], refs[1] if len(refs) > 1 else refs[0]
        ta, tb = result((a, ra)), result((b, rb))
        needed = [_test("bisect", p) for p, t in (((a, ra), ta), ((b, rb), tb)) if t is None]
        if needed:
            return [], needed
        bad_a, bad_b = _bad(ta, slow), _bad(tb, slow)
        if bad_a and bad_b:
            return [Culprit("node", (a,), why), Culprit("node", (b,), why)], []
        if bad_a or bad_b:
            return [Culprit("node", (a,) if bad_a else (b,), why)], []
        return [Culprit("pair", group, why)], []
    culprits: list[Culprit] = []
    more: list[Test] = []

    def resolve_pairs(pairs: list[tuple[int, ...]]) -> bool:
        """Test ``pairs``; bisect the bad ones. False while some are still to be run."""
        tests = [result(p) for p in pairs]
        missing = [_test("bisect", p) for p, t in zip(pairs, tests, strict=True) if t is None]
        if missing:
            more.extend(missing)
            return False
        for p, t in zip(pairs, tests, strict=True):
            if _bad(t, slow):
                c, m = _resolve(p, by_key, good, slow, why)
                culprits.extend(x for x in c if x not in culprits)
                more.extend(m)
        return True

    if len(group) == 3:
        # Halves of three leave one node alone, where no inter-node link is used: test its pairs instead.
        if not resolve_pairs(list(combinations(group, 2))):
            return [], more
    else:
        half = (len(group) + 1) // 2
        halves = (group[:half], group[half:])
        tests = [result(h) for h in halves]
        needed = [_test("bisect", h) for h, t in zip(halves, tests, strict=True) if t is None]
        if needed:
            return [], needed
        for h, t in zip(halves, tests, strict=True):
            if _bad(t, slow):
                c, m = _resolve(h, by_key, good, slow, why)
                culprits.extend(x for x in c if x not in culprits)
                more.extend(m)
        # Both halves pass: what fails runs between them, a link from one half to the other.
        cross = [(x, y) for x in halves[0] for y in halves[1]]
        if not culprits and not more and not resolve_pairs(cross):
            return [], more
    if not culprits and not more:
        culprits.append(Culprit("group", group, why, "every part of it passes alone; it fails only whole"))
    return culprits, more


def healthy_nodes(results: Sequence[Test], slow: list[Test]) -> list[int]:
    """Nodes that took part in a test between nodes that neither failed nor was slow (``slow``: the
    ``slow_pairs``). A rail test does not count: one GPU per node leaves out a fault inside a node (its
    other GPUs, its NVLinks)."""
    between = [t for t in results if len(t["nodes"]) > 1 and t.get("rail") is None]
    return sorted({n for t in between if not _bad(t, slow) for n in t["nodes"]})


def bisection(results: Sequence[Test]) -> tuple[list[Culprit], list[Test]]:
    """Culprits of every bad all-nodes or pair test, and the bisection tests still to run."""
    slow = slow_pairs(results)
    by_key = {_key(t): t for t in results}
    good = healthy_nodes(results, slow)
    culprits: list[Culprit] = []
    needed: list[Test] = []
    suspects = [t for t in results if t["kind"] in ("all", "pair") and _bad(t, slow)]
    # The all-nodes test is bisected only when no pair says more (with pairs, its halves are pairs).
    if any(t["kind"] == "pair" for t in results):
        suspects = [t for t in suspects if t["kind"] == "pair"] or suspects
    if suspects and not good:
        # Nothing has passed yet, so nothing can stand as a reference: try pairs not yet run together
        # until one passes (three nodes with a bad node 0 fail 0-1 and 0-2, and pass 1-2).
        everyone = sorted({n for t in results for n in t["nodes"]})
        for a, b in combinations(everyone, 2):
            if (frozenset((a, b)), None) not in by_key:
                return [], [_test("bisect", (a, b))]
    for t in suspects:
        c, m = _resolve(tuple(t["nodes"]), by_key, good, slow, "wrong" if failed(t) else "slow")
        culprits += [x for x in c if x not in culprits]
        needed += [x for x in m if _key(x) not in {_key(y) for y in needed}]
    return culprits, needed


def _disjoint(tests: list[Test]) -> list[Test]:
    """The first tests of ``tests`` that share no node: they run together, the rest next time."""
    step: list[Test] = []
    used: set[int] = set()
    for t in tests:
        if not used & set(t["nodes"]):
            step.append(t)
            used |= set(t["nodes"])
    return step


def next_step(layout: Layout, results: Sequence[Test]) -> list[Test] | None:
    """The tests to run next (node-disjoint, run at the same time), or ``None`` when the run is done."""
    done = {_key(t) for t in results}
    nodes = layout.nodes
    everyone = _test("all", nodes)
    if _key(everyone) not in done:
        return [everyone]
    for step in pair_steps(nodes):
        todo = [t for t in step if _key(t) not in done]
        if todo:
            return todo
    _, needed = bisection(results)
    if needed:
        return _disjoint(needed)
    if layout.rails > 1:
        for k in range(layout.rails):
            rail = _test("rail", nodes, k)
            if _key(rail) not in done:
                return [rail]
    return None


# --- judging ------------------------------------------------------------------------------------------


def stragglers(results: Sequence[Test], nodes: Sequence[int]) -> tuple[list[dict[str, Any]], str | None]:
    """Nodes the others waited for, by median and MAD of each node's median lateness across tests."""
    if len(nodes) < MIN_NODES_FOR_SPREAD:
        return [], f"stragglers are judged across at least {MIN_NODES_FOR_SPREAD} nodes"
    per_node: dict[int, float] = {}
    for n in nodes:
        values = [float(t["lateness_ms"][str(n)]) for t in results if str(n) in (t.get("lateness_ms") or {})]
        if values:
            per_node[n] = statistics.median(values)
    if len(per_node) < MIN_NODES_FOR_SPREAD:
        return [], "too few timed tests to judge stragglers"
    med, mad = median_mad(list(per_node.values()))
    spread = max(MAD_K * mad, LATENESS_FLOOR_MS)
    found = [
        {"node": n, "lateness_ms": round(v, 3), "median_ms": round(med, 3), "mad_ms": round(mad, 3)}
        for n, v in sorted(per_node.items())
        if v > med + spread
    ]
    return found, None


def _node_label(layout: Layout, node: int) -> str:
    return f"node {node} ({layout.host(node)})"


def _gpu_nic(layout: Layout, node: int, rank: int | None) -> str:
    if rank is None:
        return ""
    row = layout.where(rank)
    if int(row["node"]) != node:
        return ""
    nic = f", NIC {row['nic']}" if row.get("nic") else ""
    return f", GPU {row['gpu']}{nic}"


def findings(layout: Layout, results: Sequence[Test]) -> tuple[list[dict[str, Any]], list[str]]:
    """What the inter-node tests point at, each naming its nodes; and notes on what was not judged."""
    found: list[dict[str, Any]] = []
    notes: list[str] = []
    culprits, _ = bisection(results)
    for c in culprits:
        names = " and ".join(_node_label(layout, n) for n in c.nodes)
        what = "all-reduce sums came back wrong" if c.why == "wrong" else "all-reduce bandwidth is low"
        if c.kind == "node":
            detail = f"{names}: {what} in every group holding it, and in none without it"
            remedy = "take the node out of the job and check its GPUs and NICs (gputopo probe on it alone)"
        elif c.kind == "pair":
            detail = f"between {names}: {what} when they run together, not with other nodes"
            remedy = "check the network path between these two nodes (cables, switch ports, NIC firmware)"
            if c.unresolved:
                detail = f"{names}: {what} ({c.unresolved})"
        else:
            detail = f"{names}: {what} ({c.unresolved})"
            remedy = "run nccl-tests on the whole group and on halves of it to see what differs"
        found.append(
            {
                "kind": "corrupt" if c.why == "wrong" else "slow",
                "nodes": list(c.nodes),
                "detail": detail,
                "remedy": remedy,
            }
        )
    # A failed rail is news only when nothing else came back wrong: it then points at GPU k of some node.
    for t in results if not any(c.why == "wrong" for c in culprits) else ():
        if t.get("rail") is not None and failed(t):
            k = int(t["rail"])
            nics = sorted(
                {str(layout.where(r).get("nic")) for r in layout.test_ranks(t) if layout.where(r).get("nic")}
            )
            found.append(
                {
                    "kind": "corrupt",
                    "nodes": list(t["nodes"]),
                    "detail": f"rail {k} (GPU {k} of every node"
                    + (f", NICs {', '.join(nics)}" if nics else "")
                    + "): all-reduce sums came back wrong; one of these GPUs or NICs",
                    "remedy": "probe GPU k of each node in pairs of nodes (gputopo probe --gpus K across two "
                    "nodes at a time) to find which",
                }
            )
    late, why = stragglers(results, layout.nodes)
    if why:
        notes.append(why)
    for s in late:
        node = int(s["node"])
        late_rank = _latest_rank(results, node)
        found.append(
            {
                "kind": "straggler",
                "nodes": [node],
                "detail": f"{_node_label(layout, node)}{_gpu_nic(layout, node, late_rank)}: the other ranks "
                f"waited {s['lateness_ms']:.1f} ms for it per all-reduce (median over nodes "
                f"{s['median_ms']:.1f} ms, MAD {s['mad_ms']:.1f} ms)",
                "remedy": "look for what slows this node: throttled GPUs (nvidia-smi -q -d PERFORMANCE), "
                "a busy CPU, a degraded NIC link",
                "metrics": s,
            }
        )
    pairs = [t for t in results if t["kind"] == "pair"]
    if pairs and len(pairs) < MIN_NODES_FOR_SPREAD:
        notes.append(
            f"link speed of node pairs is judged across at least {MIN_NODES_FOR_SPREAD} pairs; "
            f"{len(pairs)} ran"
        )
    return found, notes


def _latest_rank(results: Sequence[Test], node: int) -> int | None:
    """The global rank of ``node`` that others waited for most often (its GPU and NIC name the culprit)."""
    ranks = [t.get("late_rank", {}).get(str(node)) for t in results]
    ranks = [int(r) for r in ranks if r is not None]
    return statistics.mode(ranks) if ranks else None


def node_verdicts(
    layout: Layout, found: Sequence[dict[str, Any]], local: dict[int, dict[str, Any] | None]
) -> list[dict[str, Any]]:
    """One row per node: ``pass`` only when no finding points at it and its own checks passed."""
    rows = []
    for n in layout.nodes:
        mine = [f for f in found if n in f["nodes"]]
        own = local.get(n)
        if own and own.get("verdict") == "fail":
            mine = [*mine, *own.get("findings", [])]
        rows.append(
            {
                "node_rank": n,
                "host": layout.host(n),
                "gpus": [layout.where(r)["gpu"] for r in layout.node_ranks(n)],
                "verdict": "fail" if mine else "pass",
                "findings": mine,
                "local": own,
            }
        )
    return rows
