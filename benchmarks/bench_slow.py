"""``gputopo slow`` at job scale: 64 ranks x 10,000 NCCL Inspector lines (640,000 lines), against a bare
script that only ``json.loads`` every line of the same files.

The logs are written as the plugin writes them (``tests/inspector_logs.py``, after NVIDIA/nccl
``plugins/profiler/inspector/inspector_json.cc``), one rank 10% late, 1% noise. Measured: wall time of
``gputopo slow DIR --json`` (a child process: start-up, reading, joining, judging, the document) against
``python -c 'json.loads each line'`` (a child process too), median of ``--runs`` (default 3), runs
alternating. Targets: under 2 s, and printed as a ratio to the bare parse in the same run.

    python benchmarks/bench_slow.py [--runs 3] [--ranks 64] [--ops 10000]
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
TARGET_S = 2.0
BARE = (
    "import json, sys\nfor f in sys.argv[1:]:\n    with open(f) as fh:\n"
    "        for line in fh:\n            json.loads(line)\n"
)


def timed(cmd: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    return time.perf_counter() - t0, run.returncode


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--ops", type=int, default=10_000)
    args = ap.parse_args()
    from inspector_logs import job_lines, write_job

    with tempfile.TemporaryDirectory() as tmp:
        lines = job_lines(args.ranks, args.ops, late_rank=7, late_frac=0.1)
        folder = write_job(Path(tmp) / "inspector", lines)
        files = sorted(str(p) for p in folder.iterdir())
        size = sum(os.path.getsize(f) for f in files)
        print(f"{args.ranks} ranks x {args.ops} lines: {size / 1e6:.0f} MB in {len(files)} files")
        ours, bare = [], []
        for _ in range(args.runs):
            t, code = timed([sys.executable, "-m", "gputopo", "slow", str(folder), "--json"])
            assert code == 1, f"gputopo slow exited {code} (the late rank should be named)"
            ours.append(t)
            bare.append(timed([sys.executable, "-c", BARE, *files])[0])
    o, b = statistics.median(ours), statistics.median(bare)
    print(f"load: {os.getloadavg()[0]:.1f}")
    print(f"gputopo slow --json: {o:.2f} s (median of {args.runs}); bare json.loads per line: {b:.2f} s")
    verdict = "PASS" if o < TARGET_S else "FAIL"
    print(f"ratio: {o / b:.2f}x the bare parse; {verdict} (target under {TARGET_S} s)")
    return 0 if o < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
