"""`gputopo nodes --segment 16` on a large NVL72 site: 288 racks x 18 trays (5,184 nodes, 20,736 GPUs).

Each tray's facts are a full `gputopo topo --json` document of a 4-GPU machine (the sample
``quad-nv4-pairs-2socket``) with the tray's ``node``, ``nvlink_domain`` (every rack a GB300 reporting the
clique 32766, told apart by its cluster UUID) and a fresh ``check``; one tray in 50 has a fabric problem.
Two fresh processes alternate in the same run: the command, through the installed ``gputopo`` script,
and the baseline, a Python process that only reads and parses the same 5,184 files (``json.load`` each).
The script prints the medians of wall and CPU time and the ratio; target: the command under 2 s wall.
Usage: python benchmarks/bench_nodes.py [--runs 5] [--racks 288]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

TARGET_S = 2.0
TRAYS = 18
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
BASELINE = (
    "import json, pathlib, sys; "
    "[json.loads(p.read_bytes()) for p in pathlib.Path(sys.argv[1]).glob('*.json')]"
)


def write_facts(folder: Path, racks: int, script: Path) -> None:
    """One facts file per tray, from a real `topo --json` of a 4-GPU sample."""
    base = json.loads(
        subprocess.run(
            [str(script), "topo", "--input", "sample:quad-nv4-pairs-2socket", "--json"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    now = time.time()
    problem = {"where": "GPU1", "gpu": 1, "category": "nvlink", "what": "fabric health ROUTE_UNHEALTHY",
               "remedy": "drain", "severity": "problem", "action": "drain", "rule": None}  # fmt: skip
    n = 0
    for rack in range(racks):
        cluster = str(uuid.UUID(int=rack + 1))
        for tray in range(TRAYS):
            node = f"gpu-r{rack:03d}-t{tray + 1:02d}"
            doc = dict(base)
            doc["node"] = node
            sick = n % 50 == 7
            doc["check"] = {
                "verdict": "problems" if sick else "healthy",
                "at": now,
                "problems": [problem] if sick else [],
            }
            doc["nvlink_domain"] = {
                "id": f"{cluster}.32766",
                "cluster_uuid": cluster,
                "clique_id": 32766,
                "chassis_serial": f"SN{rack:05d}",
                "tray_index": tray,
                "slot": tray + 1,
            }
            (folder / f"{node}.json").write_text(json.dumps(doc))
            n += 1


def time_once(cmd: list[str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--racks", type=int, default=288)
    args = parser.parse_args()
    script = Path(sys.executable).with_name("gputopo")
    if not script.exists():
        found = shutil.which("gputopo")
        if found is None:
            sys.exit("no installed `gputopo` script: pip install -e . first")
        script = Path(found)
    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as tmp:
        folder = Path(tmp)
        write_facts(folder, args.racks, script)
        files = len(list(folder.glob("*.json")))
        size = sum(p.stat().st_size for p in folder.glob("*.json"))
        cmd = [str(script), "nodes", str(folder), "--segment", "16"]
        base = [sys.executable, "-c", BASELINE, str(folder)]
        for c in (base, cmd):  # warm the page cache and the bytecode cache
            time_once(c)
        ours, theirs = [], []
        for _ in range(args.runs):
            theirs.append(time_once(base))
            ours.append(time_once(cmd))
    wall = statistics.median(w for w, _ in ours)
    cpu = statistics.median(c for _, c in ours)
    bwall = statistics.median(w for w, _ in theirs)
    bcpu = statistics.median(c for _, c in theirs)
    load = os.getloadavg()[0]
    print(
        f"# {files} facts files ({size / 1e6:.1f} MB), {args.racks} racks x {TRAYS} trays, {files * 4} GPUs"
    )
    print(f"# medians of {args.runs} alternating runs, load average {load:.1f}")
    print(f"gputopo nodes --segment 16 : {wall:.3f} s wall, {cpu:.3f} s CPU")
    print(f"baseline (json.load each)  : {bwall:.3f} s wall, {bcpu:.3f} s CPU")
    print(f"ratio                      : {wall / bwall:.2f}x wall, {cpu / bcpu:.2f}x CPU")
    ok = wall < TARGET_S
    print(f"{'PASS' if ok else 'FAIL'}: {wall:.3f} s against the {TARGET_S:.0f} s target")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
