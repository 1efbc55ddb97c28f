"""``gputopo hang --live`` on 8 local ranks of a real hanging job, and what a stopped ``gputopo run`` costs.

The job: ``tests/helpers/hang_job.py`` on 8 gloo CPU ranks under ``gputopo run --n 8 --torchrun`` (GPUs
chosen from the seed sample; gloo needs none), with no dump timer: rank 5 sits in
``stall_in_data_loader`` while the 7 others wait in ``all_reduce``, until the run is stopped.

Measured, median of ``--runs`` (default 5): the wall time of ``gputopo hang --live RUN_DIR --json`` (a
child process: start-up, the run record, py-spy on every rank side by side, the stack file, the
judgement), against one bare ``py-spy dump --pid P --json`` of one rank (the tool itself, the baseline in
the same run). Target: under 5 s. Then the time from SIGTERM to ``gputopo run``'s exit, stacks taken
and every process stopped (not held to a target; torchrun's own stop is most of it).

    python benchmarks/bench_hang_live.py [--runs 5] [--ranks 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 5.0
ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "helpers" / "hang_job.py"


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_FR_", "TORCH_NCCL_"))}
    out.pop("CUDA_VISIBLE_DEVICES", None)
    out["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + out.get("PYTHONPATH", "")
    return {**out, **extra}


def timed(cmd: list[str], ok: tuple[int, ...]) -> tuple[float, str]:
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode not in ok:
        raise SystemExit(f"{cmd[:4]} failed ({done.returncode}): {done.stderr[-800:]}")
    return wall, done.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=8)
    args = ap.parse_args()
    stuck = args.ranks - 3
    with tempfile.TemporaryDirectory(prefix="bench-live-") as tmp:
        run = Path(tmp) / "run"
        job_env = env(HANG_JOB_DUMP_AFTER_S="never", HANG_JOB_TIMEOUT_S="600", HANG_JOB_STUCK_RANK=str(stuck))
        proc = subprocess.Popen(
            [sys.executable, "-m", "gputopo", "run", "--n", str(args.ranks), "--torchrun", "--input",
             "sample:seed-8gpu-nv4", "--run-dir", str(run), "--", str(JOB)],
            cwd=tmp, env=job_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        try:
            live = [sys.executable, "-m", "gputopo", "hang", "--live", str(run), "--json"]
            deadline = time.monotonic() + 300
            while True:  # until every rank has reached where it hangs
                if proc.poll() is not None:
                    raise SystemExit(f"the job ended: {proc.stderr.read()[-800:] if proc.stderr else ''}")
                if list(run.glob("run-record-*.json")):
                    record = json.loads(next(run.glob("run-record-*.json")).read_text())
                    if len(record.get("ranks") or []) == args.ranks:
                        _, out = timed(live, ok=(0, 1, 3))
                        doc = json.loads(out)
                        waiting = [s for s in doc["stacks"] if s["in"] == "collective"]
                        if len(waiting) == args.ranks - 1 and doc["suspects"]:
                            break
                if time.monotonic() > deadline:
                    raise SystemExit("the ranks never reached the hang")
                time.sleep(2)
            (suspect,) = doc["suspects"]
            assert suspect["rank"] == stuck, suspect
            assert suspect["frame"].startswith("stall_in_data_loader"), suspect
            print(f"# {args.ranks} local gloo ranks; rank {stuck} in {suspect['frame']}, the others wait")
            pid = record["ranks"][0]["pid"]
            from gputopo.system.pyspy import find_pyspy

            pyspy = find_pyspy()
            ours_s, base_s = [], []
            for _ in range(args.runs):
                ours_s.append(timed(live, ok=(1,))[0])
                base_s.append(timed([pyspy or "py-spy", "dump", "--pid", str(pid), "--json"], ok=(0,))[0])
            ours, base = statistics.median(ours_s), statistics.median(base_s)
            runs = ", ".join(f"{x:.2f}" for x in base_s)
            print(f"one bare py-spy dump --json  : {base:6.2f} s  (runs {runs})")
            runs = ", ".join(f"{x:.2f}" for x in ours_s)
            print(f"gputopo hang --live --json   : {ours:6.2f} s  (runs {runs})")
            verdict = "PASS" if ours < TARGET_S else "FAIL"
            print(f"{ours / base:.1f}x one py-spy; target under {TARGET_S:g} s: {verdict}")
            t = time.perf_counter()
            os.kill(proc.pid, signal.SIGTERM)
            _, err = proc.communicate(timeout=120)
            stop = time.perf_counter() - t
            stacks = json.loads(next(run.glob("stacks-*.json")).read_text())
            print(
                f"SIGTERM to exit of gputopo run: {stop:.2f} s (exit {proc.returncode}; stack file of "
                f"{len(stacks['ranks'])} ranks, why: {stacks['why']})"
            )
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if ours >= TARGET_S:
            sys.exit(1)


if __name__ == "__main__":
    main()
