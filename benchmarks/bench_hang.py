"""``gputopo hang`` at job scale: 64 ranks x 2000 Flight Recorder entries, against a bare script that only
``pickle.load``s the same files.

The dumps are made from a real one: 3 gloo CPU ranks run the ``ok`` scenario of
``tests/helpers/fr_dumps.py``; rank 0's real entries (with their stacks) are repeated, renumbered, to
2000 per rank for 64 ranks, and rank 63 stops one collective short (it never entered the last one), so
the analysis has a hang to find. Written with ``pickle`` protocol 2, the dumps' own shape.

Measured: wall time of ``gputopo hang DIR --json`` (a child process: start-up, safe loading, matching,
the document) against ``python -c 'pickle.load each file'`` (a child process too), median of ``--runs``
(default 3), runs alternating. Target: at most 3x. Also printed: the same in-process (no start-up), and
``--torch-check`` (torch's analyzer as a second opinion), which is not held to the target.

    python benchmarks/bench_hang.py [--runs 3] [--ranks 64] [--entries 2000] [--torch-check]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 3.0
ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "tests" / "helpers" / "fr_dumps.py"
PREFIX = "rank_trace"
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
BARE = "import pickle, sys\nfor f in sys.argv[1:]:\n    with open(f, 'rb') as fh:\n        pickle.load(fh)\n"


def real_entries(work: Path) -> tuple[dict, list[dict]]:
    """A real dump (rank 0 of 3 gloo ranks) and its entries."""
    out = work / "real"
    subprocess.run([sys.executable, str(HELPER), "ok", str(out), "3"], env=ENV, check=True, timeout=300)
    dump = pickle.loads((out / f"{PREFIX}0").read_bytes())
    return dump, dump["entries"]


def make_job(work: Path, ranks: int, entries: int) -> Path:
    """``ranks`` dumps of ``entries`` entries each, from the real entries, renumbered."""
    dump, real = real_entries(work)
    job = work / "job"
    job.mkdir()
    for rank in range(ranks):
        n = entries - 1 if rank == ranks - 1 else entries
        rows = []
        for i in range(n):
            e = dict(real[i % len(real)])
            e["record_id"] = i
            e["collective_seq_id"] = i + 1
            e["op_id"] = i + 1
            e["profiling_name"] = "gloo:all_reduce" if i % 5 else "gloo:broadcast"
            e["input_sizes"] = e["output_sizes"] = [[8]]
            rows.append(e)
        doc = copy.copy(dump)
        doc["entries"] = rows
        doc["pg_config"] = {"": {"name": "", "desc": "", "ranks": str(list(range(ranks)))}}
        (job / f"{PREFIX}{rank}").write_bytes(pickle.dumps(doc, protocol=2))
    return job


def timed(cmd: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode not in ok:
        raise SystemExit(f"{cmd[:3]} failed ({done.returncode}): {done.stderr[-800:]}")
    return wall, done.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--torch-check", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-hang-") as tmp:
        job = make_job(Path(tmp), args.ranks, args.entries)
        files = sorted(str(p) for p in job.iterdir())
        size_mib = sum(os.path.getsize(f) for f in files) / 2**20
        print(f"# {args.ranks} ranks x {args.entries} entries: {size_mib:.1f} MiB of pickle from a real dump")
        gputopo = [sys.executable, "-m", "gputopo", "hang", str(job), "--json"]
        bare = [sys.executable, "-c", BARE, *files]
        ours_s, bare_s = [], []
        doc = None
        for _ in range(args.runs):
            w, out = timed(gputopo, ok=(1,))
            ours_s.append(w)
            doc = json.loads(out)
            bare_s.append(timed(bare)[0])
        assert doc is not None and doc["verdict"] == "hang", doc and doc["verdict"]
        suspect = doc["groups"][0]["suspects"][0]
        assert (suspect["rank"], suspect["why"]) == (args.ranks - 1, "never_entered")
        ours, base = statistics.median(ours_s), statistics.median(bare_s)
        print(f"bare pickle.load script : {base:7.2f} s  (runs {', '.join(f'{x:.2f}' for x in bare_s)})")
        print(f"gputopo hang --json     : {ours:7.2f} s  (runs {', '.join(f'{x:.2f}' for x in ours_s)})")
        ratio = ours / base
        print(f"ratio {ratio:.2f}x (target <= {TARGET:g}x): {'PASS' if ratio <= TARGET else 'FAIL'}")

        sys.path.insert(0, str(ROOT / "src"))
        from gputopo.hang.load import load_dumps
        from gputopo.hang.match import match_dumps
        from gputopo.hang.triage import triage

        inproc_ours, inproc_bare = [], []
        loaded = None
        for _ in range(args.runs):
            loaded = None  # each side starts from the same heap
            gc.collect()
            t = time.perf_counter()
            for f in files:
                with open(f, "rb") as fh:
                    pickle.load(fh)
            inproc_bare.append(time.perf_counter() - t)
            gc.collect()
            t = time.perf_counter()
            loaded = load_dumps([job])
            triage(loaded, match_dumps(loaded.dumps)).document()
            inproc_ours.append(time.perf_counter() - t)
        a, b = statistics.median(inproc_ours), statistics.median(inproc_bare)
        print(f"in process (gc on): load+match+document {a:.2f} s vs pickle.load {b:.2f} s = {a / b:.2f}x")
        if args.torch_check:
            w, _ = timed([*gputopo, "--torch-check"], ok=(1,))
            print(f"gputopo hang --json --torch-check (one run, not held to the target): {w:.2f} s")
        if ratio > TARGET:
            sys.exit(1)


if __name__ == "__main__":
    main()
