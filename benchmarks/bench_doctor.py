"""The doctor as a first run meets it, at machine scale, and its start-up.

Part 0, the first impression: ``gputopo doctor --simulate``, the default simulated doctor on the 4-GPU
sample as a newcomer without a GPU meets it: the quick show (every pair and the 4-GPU set on CPU ranks
with the micro CNN for 2 steps, no speed table, the HTML report), run as a person runs it with stderr on a
pipe. Targets: the whole run at most 20 s wall and 30 s of CPU (the command and every process it
starts) on 2 cores (medians), and its first line on stderr within 2 s. Printed beside it, from the same
runs: a bare 4-rank gloo ``torchrun`` (the least any 4-rank launch costs here), so a reader can tell the
doctor's cost from the machine's load, and the load average before and after.

Part 1: ``gputopo doctor --input sample:seed-8gpu-nv4 --steps 3 --model tiny`` (8 CPU ranks stand in
for the seed's 8 GPUs: every pair and the recommended larger sets, every check) against a bare
``torch.distributed.run --nproc-per-node 8`` gloo script that initialises, all-reduces 4 MiB once and
exits: the least any 8-rank launch costs here. Target: at most 5x, on the median wall time and on the
median CPU time (runs alternating so drift on a busy machine hits both alike). Printed with it, so a
number says what it measured on any machine: the CPU model and the load average before and after, per
run the load, both commands' CPU (and how much of it was system time), the doctor's launches (pools),
verdict, sets and the checks each ran (skipped ones named), and where the doctor's CPU went: by phase,
from the CPU time each pool rank stamps as it starts, joins, enters each step and ends (the launch
record), with a doctor rank's start-up beside the bare launch's CPU per rank (the machine's speed at
starting torch). ``--profile`` adds one doctor run with every pool rank under cProfile (CPU time).

Part 2: ``gputopo doctor --skip-probe`` against ``gputopo topo`` on the same input. Target: at most 3x
(median CPU time of the child, which on a shared machine swings far less than wall time).

    python benchmarks/bench_doctor.py [--runs 3] [--startup-runs 7] [--first-runs 3] [--skip-full]
                                      [--only-first-run] [--only-full] [--profile]
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
from collections import Counter
from pathlib import Path
from typing import Any

TARGET_FULL = 5.0
TARGET_STARTUP = 3.0
TARGET_FIRST_RUN_S = 20.0
TARGET_FIRST_RUN_CPU_S = 30.0
TARGET_FIRST_LINE_S = 2.0
SAMPLE = "sample:seed-8gpu-nv4"

BASELINE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
buf = torch.ones(1 << 20)  # 4 MiB of float32
dist.all_reduce(buf)
assert float(buf[0]) == dist.get_world_size()
dist.destroy_process_group()
"""

# Measure as installed: bytecode caches allowed (some CI machines forbid them through this variable).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


# System time of the last ``timed`` command and its descendants (the rest of its CPU is user time).
LAST_SYS_S = [0.0]


def timed(cmd: list[str], env: dict[str, str], ok: tuple[int, ...] = (0,)) -> tuple[float, float, str]:
    """(wall s, CPU s of the child and its descendants, stdout) of one run of ``cmd``.

    The CPU time is what the kernel charged to every process the command started and waited for (user
    and system time, ``RUSAGE_CHILDREN``), so it holds whatever other work shares the machine.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in ok:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    LAST_SYS_S[0] = after.ru_stime - before.ru_stime
    cpu = (after.ru_utime - before.ru_utime) + LAST_SYS_S[0]
    return wall, cpu, done.stdout


def loads() -> str:
    """The 1-, 5- and 15-minute load averages, as uptime prints them."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_model() -> str:
    """The CPU's model name (Linux), for reading CPU seconds measured on another machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def phase(job: dict[str, Any]) -> str:
    """Which phase of the doctor a job of the launch record is."""
    checks, n = job["checks"], len(job["gpus"])
    if checks == ["gpu"]:
        return "per-GPU step"
    if checks == ["allreduce"]:
        return "all-reduce sweeps"
    if checks == ["p2p"]:
        return "P2P copy checks"
    if checks == ["speed"]:
        return "speed table"
    return "pair dp/ddp" if n == 2 else f"{n}-GPU set dp/ddp"


START_UP = "rank start-up (interpreter, imports)"


def ranks_cpu(probe: dict[str, Any]) -> dict[str, float]:
    """The pool ranks' CPU seconds by phase, from the launch records (each rank stamps its own CPU time
    as it joins, becomes ready, enters each step and ends; ``pool.Pool.step_cpu_s``)."""
    out: Counter[str] = Counter()
    for launch in probe["launches"]:
        cpu = launch.get("rank_cpu_s") or {}
        out[START_UP] += sum(x or 0.0 for x in cpu.get("start", []))
        out["joining the pool"] += sum(x or 0.0 for x in cpu.get("join", []))
        for step in launch["steps"]:
            for job in step:
                out[phase(job)] += job.get("cpu_s") or 0.0
        out["waiting in others' steps"] += sum(cpu.get("idle", []))
        out["ranks in all"] += sum(x or 0.0 for x in cpu.get("total", []))
    return dict(out)


def counted(probe: dict[str, Any]) -> str:
    """Pairs, sets and the checks each ran (skipped ones named apart), so a run that checked less shows."""
    sizes = Counter(len(s["gpus"]) for s in probe["sets"])
    ran: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    for s in probe["sets"]:
        for c in s["checks"]:
            (skipped if c["verdict"] == "skipped" else ran)[c["name"]] += 1
    words = ", ".join(f"{n} x {k}-GPU" for k, n in sorted(sizes.items()))
    done = ", ".join(f"{name} {n}" for name, n in ran.items())
    left = ", ".join(f"{name} {n}" for name, n in skipped.items()) or "none"
    return f"{len(probe['sets'])} sets ({words}); checks run: {done}; skipped: {left}"


def full(work: Path, runs: int, profile: bool = False) -> bool:
    """Part 1; True when both ratios hold."""
    script = work / "bare.py"
    script.write_text(BASELINE)
    env = dict(ENV, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    bare = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8"]
    bare += [str(script)]
    doctor = [sys.executable, "-m", "gputopo", "doctor", "--input", SAMPLE, "--steps", "3", "--model", "tiny"]
    doctor += ["--json", "--report-dir", str(work / "reports")]
    print(f"# {os.cpu_count()} CPUs ({cpu_model()}); load average {loads()} before", flush=True)
    timed(bare, env)  # warm the page cache: the first import of torch is slow
    d_wall, d_cpu, b_wall, b_cpu = [], [], [], []
    phases: list[dict[str, float]] = []
    for i in range(runs):
        load = os.getloadavg()[0]
        wall, cpu, out = timed(doctor, env, ok=(0, 1))
        d_wall.append(wall)
        d_cpu.append(cpu)
        d_sys = LAST_SYS_S[0]
        doc = json.loads(out)
        probe = doc["probe"]
        phases.append(ranks_cpu(probe))
        wall, cpu, _ = timed(bare, env)
        b_wall.append(wall)
        b_cpu.append(cpu)
        print(
            f"run {i + 1} (load {load:.1f} before): doctor {d_wall[-1]:.1f} s ({d_cpu[-1]:.1f} s CPU, "
            f"{d_sys:.1f} s of it system; {len(probe['launches'])} launch(es), verdict {doc['verdict']}), "
            f"bare 8-rank torchrun {b_wall[-1]:.1f} s ({b_cpu[-1]:.1f} s CPU, {LAST_SYS_S[0]:.1f} s system)",
            flush=True,
        )
        print(f"  {counted(probe)}", flush=True)
    d, b = statistics.median(d_wall), statistics.median(b_wall)
    ratio = d / b
    cpu_ratio = statistics.median(d_cpu) / statistics.median(b_cpu)
    print(f"# doctor {SAMPLE} --steps 3 --model tiny vs bare 8-rank gloo torchrun, {runs} runs each")
    ranks = statistics.median(p["ranks in all"] for p in phases)
    if ranks > 0:
        print("where the doctor's CPU went (median s over the runs; the ranks stamp their own CPU time):")
        for name in phases[0]:
            print(f"  {name:40s} {statistics.median(p.get(name, 0.0) for p in phases):6.1f}")
        print(f"  {'parent, launcher and agent (the rest)':40s} {statistics.median(d_cpu) - ranks:6.1f}")
        start = statistics.median(p[START_UP] for p in phases) / 8
        print(
            f"  a doctor rank's start-up {start:.2f} s CPU against {statistics.median(b_cpu) / 8:.2f} s per "
            "rank for the whole bare launch: the machine's speed at starting torch, in both"
        )
    else:
        print("(this gputopo's launch record has no per-rank CPU: no split by phase)")
    print(f"median doctor {d:.1f} s, median bare {b:.1f} s, wall ratio {ratio:.2f} (target <= {TARGET_FULL})")
    d_c, b_c = statistics.median(d_cpu), statistics.median(b_cpu)
    print(
        f"median doctor {d_c:.1f} s CPU, median bare {b_c:.1f} s CPU, "
        f"CPU-time ratio {cpu_ratio:.2f} (target <= {TARGET_FULL})"
    )
    print(f"load average {loads()} at the end")
    if profile:
        profiled(work, doctor, env)
    return ratio <= TARGET_FULL and cpu_ratio <= TARGET_FULL


def profiled(work: Path, doctor: list[str], env: dict[str, str]) -> None:
    """One more doctor run with every pool rank under cProfile (CPU time); the functions that cost most,
    summed over the ranks. Profiling slows the ranks: read the shares, not the seconds."""
    import pstats

    folder = work / "profile"
    folder.mkdir()
    timed(doctor, dict(env, GPUTOPO_RANK_PROFILE_DIR=str(folder)), ok=(0, 1))
    files = sorted(str(f) for f in folder.glob("rank*.prof"))
    stats = pstats.Stats(*files, stream=sys.stdout)
    print(f"# cProfile of the {len(files)} pool ranks (CPU time, summed), by own time:")
    stats.sort_stats("tottime").print_stats(15)
    print("# ... and by cumulative time, the probe's own functions:")
    stats.sort_stats("cumulative").print_stats("gputopo", 15)


def first_run(work: Path, runs: int) -> bool:
    """Part 0; True when the targets hold."""
    cmd = [sys.executable, "-m", "gputopo", "doctor", "--simulate", "--report-dir", str(work / "r0")]
    script = work / "bare.py"
    script.write_text(BASELINE)
    bare_env = dict(ENV, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    bare = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(script),
    ]
    load_before = os.getloadavg()[0]
    timed(bare, bare_env)  # warm the page cache: the first import of torch is slow
    walls, cpus, firsts, b_walls, b_cpus = [], [], [], [], []
    for i in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, bufsize=1
        )
        assert proc.stderr is not None
        first = proc.stderr.readline()
        firsts.append(time.perf_counter() - started)
        rest = proc.stderr.read()
        code = proc.wait()
        walls.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
        if code not in (0, 1):
            sys.exit(f"failed ({code}): {' '.join(cmd)}\n{(first + rest)[-2000:]}")
        wall, cpu, _ = timed(bare, bare_env)
        b_walls.append(wall)
        b_cpus.append(cpu)
        said = first.strip()
        print(
            f"run {i + 1}: first line after {firsts[-1]:.2f} s ({said!r}), done in {walls[-1]:.1f} s "
            f"({cpus[-1]:.1f} s CPU); bare 4-rank torchrun {wall:.1f} s ({cpu:.1f} s CPU)",
            flush=True,
        )
    wall, cpu, first_s = statistics.median(walls), statistics.median(cpus), statistics.median(firsts)
    b_wall, b_cpu = statistics.median(b_walls), statistics.median(b_cpus)
    ok = wall <= TARGET_FIRST_RUN_S and cpu <= TARGET_FIRST_RUN_CPU_S and first_s <= TARGET_FIRST_LINE_S
    print(
        f"# doctor --simulate (the quick show: 4-GPU sample, CPU ranks), {runs} runs, {os.cpu_count()} CPUs"
    )
    print(
        f"median {wall:.1f} s wall (target <= {TARGET_FIRST_RUN_S:g} s), {cpu:.1f} s CPU "
        f"(target <= {TARGET_FIRST_RUN_CPU_S:g} s), first line {first_s:.2f} s "
        f"(target <= {TARGET_FIRST_LINE_S:g} s)"
    )
    print(
        f"baseline: bare 4-rank gloo torchrun median {b_wall:.1f} s wall, {b_cpu:.1f} s CPU "
        f"(doctor/bare: {wall / b_wall:.2f} wall, {cpu / b_cpu:.2f} CPU); "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    return ok


def startup(work: Path, runs: int) -> bool:
    """Part 2; True when the ratio holds."""
    script = Path(sys.executable).with_name("gputopo")  # the console script, as users run it
    topo = [str(script), "topo", "--input", SAMPLE]
    doctor = [str(script), "doctor", "--input", SAMPLE, "--skip-probe", "--report-dir", str(work / "r2")]
    for cmd in (topo, doctor):
        timed(cmd, ENV)
    t_cpu, d_cpu = [], []
    for _ in range(runs):
        t_cpu.append(timed(topo, ENV)[1])
        d_cpu.append(timed(doctor, ENV)[1])
    t, d = statistics.median(t_cpu), statistics.median(d_cpu)
    ratio = d / t
    print(f"# doctor --skip-probe vs topo on {SAMPLE}, {runs} runs each (CPU time of the child)")
    print(f"median doctor {d:.3f} s, median topo {t:.3f} s, ratio {ratio:.2f} (target <= {TARGET_STARTUP})")
    return ratio <= TARGET_STARTUP


def main() -> int:
    """Run both parts and print PASS or FAIL."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--startup-runs", type=int, default=7)
    parser.add_argument("--first-runs", type=int, default=3)
    parser.add_argument("--skip-full", action="store_true", help="leave out part 1 (the 8-GPU drill)")
    parser.add_argument("--only-first-run", action="store_true", help="only part 0")
    parser.add_argument("--only-full", action="store_true", help="only part 1 (the 8-GPU drill)")
    parser.add_argument(
        "--profile", action="store_true", help="after part 1, one more doctor with cProfile in every rank"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gputopo-bench-"))
    try:
        if args.only_full:
            ok = full(work, args.runs, args.profile)
            print("PASS" if ok else "FAIL")
            return 0 if ok else 1
        ok = first_run(work, args.first_runs)
        if args.only_first_run:
            print("PASS" if ok else "FAIL")
            return 0 if ok else 1
        ok = startup(work, args.startup_runs) and ok
        if not args.skip_full:
            ok = full(work, args.runs, args.profile) and ok
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
