"""Time-to-verdict of ``gputopo probe --mode gpu`` (every GPU on its own), and on GPUs its matmul figure
against ``torch.matmul`` alone.

On CPU ranks (``--device cpu``, the default without a GPU): ``probe --mode gpu`` on N stand-ins (4 by
default) against a bare ``torch.distributed.run`` launch of N gloo ranks that only join and leave (what
any per-rank check pays to start). Runs alternate so drift on a busy machine hits both alike; the
medians, their ratio and the per-GPU step's own time (from the report's launch record) are printed, with
the machine's load before and after. The issue's target: under 30 s for 4 stand-ins on 2 cores.

On GPUs (``--device cuda``): ``probe --mode gpu --precision bf16`` on the first GPU and on all of them
(how it scales with the number of GPUs; the target is under 60 s on 8), then in the same run a plain
``torch.matmul`` loop on each GPU at the probe's size, timed with CUDA events; the probe's matmul figure
(its median repetition) must reach at least 85% of the loop's median (the probe's own overhead). Each GPU's
two figures are paired by PCI bus id through nvidia-smi's list (the probe names GPUs by nvidia-smi's
index, CUDA by its own order), as ``scripts/gpu_acceptance.py`` pairs them. Every command has a timeout
(``--timeout``, default 600 s): a hung probe ends the benchmark with a message, never a stall.

    python benchmarks/bench_probe_gpu.py [--device cpu|cuda] [--stand-ins 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CPU_TARGET_S = 30.0
GPU_TARGET_S = 60.0
MATMUL_TARGET = 0.85

BARE_RANKS = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""

# The probe's matmul without the probe: the same size, dtype and warm-up, CUDA events; one file shared with
# scripts/gpu_acceptance.py.
BARE_MATMUL = Path(__file__).resolve().parents[1] / "scripts" / "bare_matmul.py"
ACCEPTANCE = Path(__file__).resolve().parents[1] / "scripts" / "gpu_acceptance.py"
TIMEOUT_S = 600.0


def _acceptance():
    """scripts/gpu_acceptance.py as a module (its pairing of probe and bare figures by PCI bus id)."""
    spec = importlib.util.spec_from_file_location("gpu_acceptance", ACCEPTANCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(cmd: list[str], env: dict[str, str], timeout: float = TIMEOUT_S) -> tuple[float, str]:
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"timed out after {timeout:g} s: {' '.join(cmd)}")
    elapsed = time.perf_counter() - started
    if done.returncode not in (0, 1):  # 1: the probe found a problem, which is still a timed verdict
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return elapsed, done.stdout


def _load() -> str:
    return os.popen("uptime").read().strip()


def _step_s(doc: dict) -> float | None:
    for launch in doc.get("launches") or []:
        for step in launch.get("steps") or []:
            for job in step:
                if job.get("checks") == ["gpu"]:
                    return job.get("wall_s")
    return None


def bench_cpu(args: argparse.Namespace, work: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    gpus = ",".join(str(i) for i in range(args.stand_ins))
    probe = [sys.executable, "-m", "gputopo", "probe", "--mode", "gpu", "--device", "cpu", "--gpus", gpus]
    probe += ["--report-dir", str(work / "reports"), "--json"]
    script = work / "bare.py"
    script.write_text(BARE_RANKS)
    bare = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    bare += [str(args.stand_ins), str(script)]
    print(f"load before: {_load()}", flush=True)
    _run(bare, env, args.timeout)  # warm the file cache: the first import of torch is slow
    probe_s, bare_s, step_s, verdicts = [], [], [], []
    for i in range(args.runs):
        elapsed, out = _run(probe, env, args.timeout)
        doc = json.loads(out)
        probe_s.append(elapsed)
        step_s.append(_step_s(doc) or 0.0)
        verdicts.append(doc["verdict"])
        bare_s.append(_run(bare, env, args.timeout)[0])
        print(
            f"run {i + 1}: probe {probe_s[-1]:.2f} s (per-GPU step {step_s[-1]:.2f} s, {verdicts[-1]}), "
            f"bare {args.stand_ins}-rank launch {bare_s[-1]:.2f} s",
            flush=True,
        )
    print(f"load after: {_load()}")
    p, b = statistics.median(probe_s), statistics.median(bare_s)
    print(f"# {args.stand_ins} CPU stand-ins, {os.cpu_count()} cores, {args.runs} runs each")
    print(
        f"median probe --mode gpu {p:.2f} s (per-GPU step {statistics.median(step_s):.2f} s), "
        f"median bare launch {b:.2f} s, ratio {p / b:.2f}; target under {CPU_TARGET_S:g} s"
    )
    print("PASS" if p < CPU_TARGET_S and set(verdicts) == {"pass"} else "FAIL")


def bench_cuda(args: argparse.Namespace, work: Path) -> None:
    env = dict(os.environ)
    probe = [sys.executable, "-m", "gputopo", "probe", "--mode", "gpu", "--precision", "bf16", "--json"]
    probe += ["--report-dir", str(work / "reports")]
    one_s, one = _run([*probe, "--gpus", "0"], env, args.timeout)
    all_s, out = _run(probe, env, args.timeout)
    doc = json.loads(out)
    rows = doc["per_gpu"]["gpus"]
    n = len(rows)
    ga = _acceptance()
    smi_fields = ["nvidia-smi", f"--query-gpu={ga.SMI_FIELDS}", "--format=csv,noheader"]
    smi = ga.parse_smi(_run(smi_fields, env, 30)[1])
    print(f"probe --mode gpu: 1 GPU {one_s:.1f} s, {n} GPUs {all_s:.1f} s (target under {GPU_TARGET_S:g} s)")
    step_one, step_all = _step_s(json.loads(one)) or 0.0, _step_s(doc) or 0.0
    print(f"per-GPU step: 1 GPU {step_one:.2f} s, {n} GPUs {step_all:.2f} s")
    bare = json.loads(_run([sys.executable, str(BARE_MATMUL), "1"], env, args.timeout)[1])
    shares = {s["gpu"]: s for s in ga.matmul_shares(doc, bare, smi)}
    worst = 1.0
    for r in rows:
        share = shares.get(r["gpu"], {})
        alone, ratio = share.get("bare_tflops"), share.get("share")
        if ratio is None:
            print(f"GPU{r['gpu']}: {share.get('why', 'not in nvidia-smi list')}")
            worst = 0.0
            continue
        worst = min(worst, ratio)
        peak = r.get("peak") or {}
        floor = ((peak.get("floor") or {}).get("matmul_tflops") or {}).get("value")
        print(
            f"GPU{r['gpu']} {r['name']}: probe {r['matmul_tflops']:.1f} TFLOP/s, "
            f"torch.matmul alone {alone:.1f} ({ratio:.0%}), datasheet {peak.get('matmul_tflops') or 'n/a'}, "
            f"floor {f'{floor:.0f}' if floor else 'n/a'}; "
            f"memory {r['memory_gbps']:.0f} GB/s, "
            f"H2D {r['h2d_gbps']:.1f}, D2H {r['d2h_gbps']:.1f} GB/s; {r['verdict']}"
        )
    ok = all_s < GPU_TARGET_S and worst >= MATMUL_TARGET
    print(f"worst probe/torch.matmul {worst:.0%} (target >= {MATMUL_TARGET:.0%})")
    print("PASS" if ok else "FAIL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--stand-ins", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds each command may take")
    args = parser.parse_args()
    device = args.device or ("cuda" if Path("/dev/nvidiactl").exists() else "cpu")
    work = Path(tempfile.mkdtemp(prefix="gputopo-bench-"))
    try:
        (bench_cuda if device == "cuda" else bench_cpu)(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
