"""Start-up cost of `gputopo topo --input FILE` against the floor of importing typer and rich.

Both commands run as fresh processes, alternating, in the same run; the script prints the median of
each and their ratio. Target: at most 1.3x. Usage: python benchmarks/bench_topo.py [--runs 15] [FILE]
"""

from __future__ import annotations

import argparse
import os
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


def time_once(cmd: list[str]) -> float:
    """Wall time of one run of ``cmd``, in seconds; its output is discarded."""
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    return time.perf_counter() - start


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
    topo = [str(script), "topo", "--input", source]
    for cmd in (baseline, topo):  # warm the page cache and the bytecode cache
        time_once(cmd)
    base_s, topo_s = [], []
    for _ in range(args.runs):
        base_s.append(time_once(baseline))
        topo_s.append(time_once(topo))
    b, t = statistics.median(base_s), statistics.median(topo_s)
    ratio = t / b
    print(f"input: {source}")
    print(f"baseline  python -c 'import typer, rich.console'  median {b * 1000:.1f} ms over {args.runs} runs")
    print(f"gputopo topo --input ...                     median {t * 1000:.1f} ms over {args.runs} runs")
    print(f"ratio {ratio:.2f}x (target <= {TARGET_RATIO}x): {'PASS' if ratio <= TARGET_RATIO else 'FAIL'}")
    return 0 if ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
