"""`gputopo check` on a fake 8-GPU H100 node (tests/fakedriver under the real nvidia-ml-py): its wall time
against the sampling window, and what it imports.

Target (issue 21): the median of 5 runs takes no more than the sampling window + 1 s, and the process
imports neither torch nor matplotlib. The fake driver answers at once, so this measures gputopo's own
cost: start-up, the NVML worker, two samples of every health value of 8 GPUs with 18 NVLinks each (the
fabric's v3 and v4 structs, platform info and C2C mode included), and
the state file (read, counters judged since the last run, written atomically) as a health check keeps it.
Second target: with every GPU hung in the driver, `--budget 6` still ends within the budget + 1 s (the
interpreter's start is outside the budget's clock), median of 3. Also reported (no target): the prolog
form, `--sample-s 0.5 --budget 10 --format npd`, median of 5.
Usage: python benchmarks/bench_check.py [--runs 5] [--sample-s 2]
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

import fake_driver  # noqa: E402
from test_health_reads import healthy  # noqa: E402

SLACK_S = 1.0
HUNG_BUDGET_S = 6.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sample-s", type=float, default=2.0)
    args = parser.parse_args()
    if fake_driver.compiler() is None:
        sys.exit("no C compiler to build the fake driver")
    with tempfile.TemporaryDirectory() as tmp:
        lib = fake_driver.build(Path(tmp) / "driver")
        machine = Path(tmp) / "h100x8.txt"
        lines = ["driver 570.86.15", "cuda 12080", *(line for i in range(8) for line in healthy(i, links=18))]
        # The rack reads of issue 34 answer too: fabric v3 and v4, platform info, C2C mode.
        lines += [
            line
            for i in range(8)
            for line in (
                f"fabricv3 {i} 00000001-0000-0000-0000-000000000001 1",
                f"cliques {i} 0:32766 1:32766",
                f"platform {i} 1820000000001 25 15 1 1 {i + 1}",
                f"c2c {i} 0",
            )
        ]
        machine.write_text("\n".join(lines) + "\n")
        env = fake_driver.env_for(lib, machine)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        cmd = [
            sys.executable,
            "-m",
            "gputopo",
            "check",
            "--sample-s",
            str(args.sample_s),
            "--kernel-log",
            os.devnull,
            "--state",
            str(Path(tmp) / "check-state.json"),
        ]
        subprocess.run(cmd, env=env, capture_output=True, check=False)  # warm the bytecode cache
        walls = []
        for _ in range(args.runs):
            start = time.perf_counter()
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            walls.append(time.perf_counter() - start)
            if done.returncode != 0:
                sys.exit(f"check failed ({done.returncode}): {done.stdout}{done.stderr}")
        prolog_cmd = [*cmd[:4], "--sample-s", "0.5", "--budget", "10", "--format", "npd", *cmd[6:]]
        prolog_walls = []
        for _ in range(args.runs):
            start = time.perf_counter()
            done = subprocess.run(prolog_cmd, env=env, capture_output=True, text=True, check=False)
            prolog_walls.append(time.perf_counter() - start)
            if done.returncode != 0:
                sys.exit(f"prolog check failed ({done.returncode}): {done.stdout}{done.stderr}")
        hung_machine = Path(tmp) / "h100x8-hung.txt"
        hung_machine.write_text("\n".join([*lines, "hang * nvmlDeviceGetTemperature"]) + "\n")
        hung_env = fake_driver.env_for(lib, hung_machine)
        hung_cmd = [*cmd, "--budget", str(HUNG_BUDGET_S)]
        hung_walls = []
        for _ in range(3):
            start = time.perf_counter()
            done = subprocess.run(hung_cmd, env=hung_env, capture_output=True, text=True, check=False)
            hung_walls.append(time.perf_counter() - start)
            if done.returncode != 1:
                sys.exit(f"hung check: exit {done.returncode}, expected 1: {done.stdout}{done.stderr}")
        probe = [sys.executable, "-X", "importtime", *cmd[1:]]
        imports = subprocess.run(probe, env=env, capture_output=True, text=True, check=False).stderr
    heavy = sorted(
        {
            m
            for m in ("torch", "matplotlib")
            if any(line.split("|")[-1].strip() == m for line in imports.splitlines())
        }
    )
    median = statistics.median(walls)
    limit = args.sample_s + SLACK_S
    print(f"# gputopo check, fake 8x H100, --sample-s {args.sample_s:g}, {args.runs} runs")
    print(f"median wall {median:.3f} s (min {min(walls):.3f}, max {max(walls):.3f}); limit {limit:.1f} s")
    hung = statistics.median(hung_walls)
    hung_limit = HUNG_BUDGET_S + SLACK_S
    print(f"every GPU hung, --budget {HUNG_BUDGET_S:g}: median wall {hung:.3f} s; limit {hung_limit:.1f} s")
    prolog = statistics.median(prolog_walls)
    print(f"prolog form (--sample-s 0.5 --budget 10 --format npd): median wall {prolog:.3f} s")
    print(f"heavy imports: {', '.join(heavy) or 'none'}")
    ok = median <= limit and not heavy and hung <= hung_limit
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
