"""Start-up cost of `gputopo topo --input FILE` against the floor of importing typer and rich.

Both commands run as fresh processes, alternating, in the same run: the installed ``gputopo`` console
script, as users run it, and ``python -c "import typer, rich.console"``. The script prints the median
wall and CPU time of each and their ratios. Judged on wall time (what a user waits for), target at most
1.3x; the CPU ratio is printed beside it because on a shared machine the wall time of a 100 ms process
swings with other load far more than its CPU time does (compare the two before trusting a FAIL).
Usage: python benchmarks/bench_topo.py [--runs 15] [FILE]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_INPUT = ROOT.parent / "shared" / "fixtures" / "topo" / "14_h100x8-nv18-2numa.txt"
TARGET_RATIO = 1.3


# Measure as installed: pip byte-compiles typer and rich at install time, and Python caches our own
# modules' bytecode on first run, unless this variable (set on some CI machines) forbids it.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def time_once(cmd: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of ``cmd``; its output is discarded (a pipe-like /dev/null)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "input", nargs="?", default=None, help="topo -m text or snapshot (default: a fixture)"
    )
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    source = args.input or (str(DEFAULT_INPUT) if DEFAULT_INPUT.exists() else "sample:hgx-h100-nvswitch")
    baseline = [sys.executable, "-c", "import typer, rich.console"]
    script = Path(sys.executable).with_name("gputopo")  # the console script, as users run it
    if not script.exists():
        found = shutil.which("gputopo")
        if found is None:
            sys.exit("no installed `gputopo` script: pip install -e . first")
        script = Path(found)
    topo = [str(script), "topo", "--input", source]
    for cmd in (baseline, topo):  # warm the page cache and the bytecode cache
        time_once(cmd)
    runs: dict[str, list[tuple[float, float]]] = {"base": [], "topo": []}
    for _ in range(args.runs):
        runs["base"].append(time_once(baseline))
        runs["topo"].append(time_once(topo))
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()
    }
    ratio_wall = med["topo"][0] / med["base"][0]
    ratio_cpu = med["topo"][1] / med["base"][1]
    print(f"input: {source}; medians over {args.runs} alternating runs")
    print(
        f"baseline  python -c 'import typer, rich.console'  wall {med['base'][0] * 1e3:6.1f} ms  "
        f"cpu {med['base'][1] * 1e3:6.1f} ms"
    )
    print(
        f"gputopo topo --input ...                     wall {med['topo'][0] * 1e3:6.1f} ms  "
        f"cpu {med['topo'][1] * 1e3:6.1f} ms"
    )
    ok = ratio_wall <= TARGET_RATIO
    print(
        f"ratio: wall {ratio_wall:.2f}x, cpu {ratio_cpu:.2f}x (target <= {TARGET_RATIO}x, judged on wall): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    print(f"load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
