"""Time-to-verdict of ``gputopo probe --mode ddp`` on CPU ranks against a minimal torchrun DDP script.

Both runs launch two gloo ranks through torch.distributed.run's machinery, build the same tiny
torchvision ResNet on the same synthetic CIFAR-sized batches, and train the same number of steps; the
probe also runs its single-device reference twice and checks parameters across ranks after every step.
Runs alternate (probe, baseline, probe, ...) so drift on a busy machine hits both alike; the medians
and their ratio are printed. The issue's target is a ratio of at most 1.25.

    python benchmarks/bench_probe_ddp.py [--steps 20] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_RATIO = 1.25

# The hand-written baseline: what someone would write to train DDP for N steps, nothing more.
BASELINE = """
import os, sys
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torchvision.models.resnet import BasicBlock, ResNet

steps, per_rank = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(steps):
    gen = torch.Generator().manual_seed(step)
    images = torch.randn((per_rank * world, 3, 32, 32), generator=gen).chunk(world)[rank]
    labels = torch.randint(0, 10, (per_rank * world,), generator=gen).chunk(world)[rank]
    opt.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    opt.step()
dist.destroy_process_group()
"""


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s of the command and every process it started) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    """Alternate probe and baseline runs and print both medians and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank, as the probe's --batch-size")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gputopo-bench-"))
    script = work / "ddp_baseline.py"
    script.write_text(BASELINE)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    gputopo = [sys.executable, "-m", "gputopo"]
    probe = [*gputopo, "probe", "--device", "cpu", "--gpus", "0,1", "--mode", "ddp", "--model", "tiny"]
    probe += [
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--report-dir",
        str(work / "reports"),
    ]
    probe += ["--json"]
    baseline = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    baseline += [str(script), str(args.steps), str(args.batch_size)]

    probe_s, baseline_s, probe_cpu, baseline_cpu = [], [], [], []
    try:
        _timed(baseline, env)  # warm the file cache for both: the first import of torch is slow
        for i in range(args.runs):
            wall, cpu = _timed(probe, env)
            probe_s.append(wall)
            probe_cpu.append(cpu)
            wall, cpu = _timed(baseline, env)
            baseline_s.append(wall)
            baseline_cpu.append(cpu)
            print(
                f"run {i + 1}: probe {probe_s[-1]:.2f} s ({probe_cpu[-1]:.1f} s CPU), baseline "
                f"{baseline_s[-1]:.2f} s ({baseline_cpu[-1]:.1f} s CPU)",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    p, b = statistics.median(probe_s), statistics.median(baseline_s)
    ratio = p / b
    print(f"# steps {args.steps}, batch {args.batch_size} per rank, 2 gloo ranks, {args.runs} runs each")
    print(f"median probe {p:.2f} s, median baseline {b:.2f} s, ratio {ratio:.2f} (target <= {TARGET_RATIO})")
    cpu_ratio = statistics.median(probe_cpu) / statistics.median(baseline_cpu)
    print(f"CPU-time ratio {cpu_ratio:.2f} (the command and every process it started; swings less)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print("PASS" if ratio <= TARGET_RATIO else "FAIL")


if __name__ == "__main__":
    main()
