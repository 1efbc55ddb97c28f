"""How long `recommend` takes on 16-GPU machines, for every K (CPU time, median of several runs).

    python benchmarks/bench_recommend.py [--runs 7] [--sets]

Machines: a DGX-2-like box (16 GPUs, NV6 all-to-all through NVSwitch, two sockets) and a 16-GPU PCIe
server (two sockets x two root switches x two leaf switches x two GPUs, NVLink bridges on half the
leaf pairs), plus a 16-GPU box with no two GPUs alike (random link codes): the worst case for the
symmetry the search relies on. ``--sets`` also times packing 16/K disjoint sets.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from gputopo.model import Gpu, Matrix, Topology
from gputopo.recommend import Constraints, recommend

GPUS = 16


def build(name: str, code, numa) -> Topology:
    """A 16-GPU Topology whose link between a and b is ``code(a, b)``."""
    gpus = tuple(Gpu(index=i, name="Tesla V100-SXM3-32GB", numa_affinity=numa(i)) for i in range(GPUS))
    cells = tuple(
        tuple("X" if a == b else code(min(a, b), max(a, b)) for b in range(GPUS)) for a in range(GPUS)
    )
    return Topology(name, gpus, (), Matrix(tuple(g.label for g in gpus), cells))


def dgx2() -> Topology:
    return build("dgx2-like NV6 all-to-all", lambda a, b: "NV6", lambda i: str(i // 8))


def pcie_tree() -> Topology:
    def code(a: int, b: int) -> str:
        if a // 8 != b // 8:
            return "SYS"
        if a // 4 != b // 4:
            return "NODE"
        if a // 2 != b // 2:
            return "PXB"
        return "NV4" if (a // 2) % 2 == 0 else "PIX"

    return build("16-GPU PCIe tree with NV4 bridges", code, lambda i: str(i // 8))


def irregular(seed: int = 7) -> Topology:
    rng = random.Random(seed)
    codes = {
        (a, b): rng.choice(["NV1", "NV2", "NV4", "PIX", "PXB", "NODE", "SYS"])
        for a in range(GPUS)
        for b in range(a + 1, GPUS)
    }
    return build("16 GPUs, no two alike (random codes)", lambda a, b: codes[(a, b)], lambda i: str(i % 2))


def cpu_time_s(topo: Topology, constraints: Constraints, runs: int) -> float:
    """Median CPU seconds of ``runs`` calls."""
    times = []
    for _ in range(runs):
        start = time.process_time()
        recommend(topo, constraints)
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs per K (the median is shown)")
    parser.add_argument("--sets", action="store_true", help="also time --sets 16/K for K = 2..8")
    args = parser.parse_args()
    machines = [dgx2(), pcie_tree(), irregular()]
    print(f"# recommend --n K on 16 GPUs: median CPU ms of {args.runs} runs")
    print(f"{'K':>3}" + "".join(f"  {m.source[:30]:>30}" for m in machines))
    worst = 0.0
    for k in range(2, GPUS + 1):
        row = [cpu_time_s(m, Constraints(n=k), args.runs) for m in machines]
        worst = max(worst, *row[:2])
        print(f"{k:>3}" + "".join(f"  {t * 1000:>30.1f}" for t in row))
    if args.sets:
        print(f"# recommend --n K --sets 16/K: median CPU ms of {args.runs} runs")
        for k in range(2, GPUS // 2 + 1):
            row = [cpu_time_s(m, Constraints(n=k, sets=GPUS // k), args.runs) for m in machines]
            print(f"{k:>3}" + "".join(f"  {t * 1000:>30.1f}" for t in row))
    print(f"# slowest K on the DGX-2-like and PCIe-tree machines: {worst * 1000:.1f} ms")


if __name__ == "__main__":
    main()
