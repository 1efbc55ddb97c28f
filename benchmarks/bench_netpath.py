"""What the network and PCIe-path reads add to `gputopo check` on a node with 8 GPUs and 8 RDMA ports.

Target (docs/benchmarks.md "check"): under 0.2 s added. Measured in one run, on the same machine:

1. the reads alone, in this process: ``fabric.start()`` + ``fabric.finish()`` (every port twice, the
   bridge chains and ACS of 8 GPUs and 8 NICs, 28 GPU pairs and 64 GPU-NIC pairs judged, GPUDirect and
   IOMMU) over a captured-shape tree (tests/sysfs_tree.py), median of ``--runs``;
2. `gputopo check --sample-s 0` on the fake 8x H100 (tests/fakedriver) pointed at that tree, against the
   same command pointed at an empty tree (nothing to read: the reads cost next to nothing), median of
   ``--runs`` each, interleaved; the difference is the added wall time, and its share of the whole.

The tree is files on this machine's disk: a real sysfs answers from the kernel, and on InfiniBand adapters
each counter file is a firmware query, which is why the reader reads only the counters the rules use
(6 per port plus 3 hw_counters).
Usage: python benchmarks/bench_netpath.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "src"))

import fake_driver  # noqa: E402
import sysfs_tree  # noqa: E402
from gputopo.services import fabric  # noqa: E402
from gputopo.system.sysfs import FsView  # noqa: E402
from test_health_reads import healthy  # noqa: E402

TARGET_S = 0.2
GPUS = {i: fake_driver.bus(i) for i in range(8)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    if fake_driver.compiler() is None:
        sys.exit("no C compiler to build the fake driver")
    with tempfile.TemporaryDirectory() as tmp:
        tree = sysfs_tree.eight_gpu_node(Path(tmp) / "tree")
        empty = sysfs_tree.Tree(Path(tmp) / "empty")
        fs = FsView(tree.sys, tree.proc)
        inproc = []
        for _ in range(max(args.runs, 20)):
            start = time.perf_counter()
            result = fabric.finish(fabric.start(fs), GPUS)
            inproc.append(time.perf_counter() - start)
        assert result.facts["rdma_ports"] == 8 and len(result.pairs) == 28 + 64, result.facts

        lib = fake_driver.build(Path(tmp) / "driver")
        machine = Path(tmp) / "h100x8.txt"
        lines = ["driver 570.86.15", "cuda 12080", *(line for i in range(8) for line in healthy(i, links=18))]
        machine.write_text("\n".join(lines) + "\n")
        cmd = [sys.executable, "-m", "gputopo", "check", "--sample-s", "0", "--kernel-log", os.devnull]
        envs = {}
        for name, t in (("with", tree), ("without", empty)):
            env = {**fake_driver.env_for(lib, machine), **t.env}
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            envs[name] = env
            subprocess.run(cmd, env=env, capture_output=True, check=False)  # warm the bytecode cache
        walls: dict[str, list[float]] = {"with": [], "without": []}
        for _ in range(args.runs):
            for name, env in envs.items():
                start = time.perf_counter()
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                walls[name].append(time.perf_counter() - start)
                if out.returncode not in (0, 1):
                    sys.exit(f"check failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    reads_s = statistics.median(inproc)
    with_s, without_s = statistics.median(walls["with"]), statistics.median(walls["without"])
    added_s = with_s - without_s
    print(f"reads alone (in process, median of {len(inproc)}): {reads_s * 1000:.1f} ms")
    print(
        f"gputopo check --sample-s 0, median of {args.runs}: {with_s:.3f} s with 8 GPUs + 8 ports to read, "
        f"{without_s:.3f} s with an empty tree: {added_s * 1000:+.0f} ms added ({added_s / without_s:+.1%})"
    )
    ok = reads_s < TARGET_S and added_s < TARGET_S
    print(f"target: under {TARGET_S:g} s added: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
