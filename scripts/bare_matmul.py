"""The bare baseline for the per-GPU probe's matmul figure: the probe's own matmul (probe/ranks/pergpu.py:
8192-square, 16 products a repetition at bf16, timed with CUDA events) without the probe. Both
``scripts/gpu_acceptance.py`` and ``benchmarks/bench_probe_gpu.py`` run this one file, so they compare the
probe against the same loop.

    python scripts/bare_matmul.py [SECONDS]                 # each GPU in turn, SECONDS each (default 3)
    python scripts/bare_matmul.py --sustain SECONDS         # every GPU at once, for SECONDS
    python scripts/bare_matmul.py --device cpu [...]        # a CPU stand-in (small float32 products)

Each GPU in turn prints one JSON document: ``{"dtype", "n", "matmuls_per_rep", "mode": "each",
"gpus": [{"cuda_index", "name", "pci_bus_id", "tflops" (the best repetition), "median_tflops", "reps"}]}``.

``--sustain`` loads every GPU at once for SECONDS, as DCGM's GEMM stress does (its diagnostic plugin runs
for minutes: a GPU that throttles on power or heat holds its clocks only for the first seconds), and
adds per GPU the median of each window of the run (``windows_tflops``), the first and last window's
medians and ``drop`` (1 - last / first: how far the rate fell under sustained load). Where
``nvidia-smi`` answers, its clocks, power, temperature and active clock event reasons are sampled once a
window (``smi``, each sample's ``t_s`` on the clock of ``load_started_s``).

CUDA numbers the GPUs in its own order unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; this script sets it (when
unset) so that ``cuda_index`` is nvidia-smi's index, and names each GPU's PCI bus id besides.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # before torch reads it

import torch  # noqa: E402, TID251 (a baseline without gputopo: it must not go through probe/ranks)

N, PER_REP, WARM_REPS = 8192, 16, 3
# The CPU stand-in's sizes: milliseconds a repetition on one core (a rehearsal, never a figure to judge).
CPU_N, CPU_PER_REP = 192, 4
WINDOWS = 12  # a sustained run is cut into this many windows (at least 1 s each)
SMI_QUERY = "index,pci.bus_id,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def _bus(props) -> str | None:
    # cudaDeviceProp.pciDomainID/pciBusID/pciDeviceID, torch's ints (as probe/ranks/cuda.py reads them)
    ids = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    return "{:04x}:{:02x}:{:02x}.0".format(*ids) if None not in ids else None


class Loop:
    """One device's operands and its timed repetition (16 products of N-square matrices)."""

    def __init__(self, device: str) -> None:
        self.cpu = device == "cpu"
        self.device = device
        self.n, self.per_rep = (CPU_N, CPU_PER_REP) if self.cpu else (N, PER_REP)
        dtype = torch.float32 if self.cpu else torch.bfloat16
        if not self.cpu:
            torch.cuda.set_device(device)
        # Random operands, never zeros: a product of zeros runs faster than real data.
        self.a = torch.randn(self.n, self.n, device=device, dtype=dtype)
        self.b = torch.randn(self.n, self.n, device=device, dtype=dtype)
        self.c = torch.empty(self.n, self.n, device=device, dtype=dtype)
        self.flop = 2 * self.n**3 * self.per_rep

    def rep(self) -> None:
        for _ in range(self.per_rep):
            torch.matmul(self.a, self.b, out=self.c)

    def warm(self) -> None:
        for _ in range(WARM_REPS):
            self.rep()
        if not self.cpu:
            torch.cuda.synchronize(self.device)

    def timed(self) -> float:
        """TFLOP/s of one repetition: CUDA events on a GPU, the wall clock on the CPU stand-in."""
        if self.cpu:
            began = time.perf_counter()
            self.rep()
            return self.flop / max(time.perf_counter() - began, 1e-9) / 1e12
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        self.rep()
        e.record()
        e.synchronize()
        return self.flop / (s.elapsed_time(e) / 1e3) / 1e12

    def describe(self) -> dict:
        if self.cpu:
            return {"cuda_index": None, "name": "CPU stand-in", "pci_bus_id": None}
        index = torch.device(self.device).index
        props = torch.cuda.get_device_properties(index)
        return {"cuda_index": index, "name": props.name, "pci_bus_id": _bus(props)}


def each(devices: list[str], seconds: float) -> list[dict]:
    """Every device in turn, ``seconds`` each after the warm-up."""
    out = []
    for device in devices:
        loop = Loop(device)
        loop.warm()
        rates = []
        start = time.perf_counter()
        while time.perf_counter() - start < seconds or not rates:
            rates.append(loop.timed())
        out.append(
            {
                **loop.describe(),
                "tflops": max(rates),
                "median_tflops": statistics.median(rates),
                "reps": len(rates),
            }
        )
        del loop
        if device != "cpu":
            torch.cuda.empty_cache()
    return out


def windows_of(samples: list[tuple[float, float]], seconds: float) -> list[float]:
    """The median rate of each of ``WINDOWS`` equal windows of the run (samples: (offset s, rate))."""
    count = max(1, min(WINDOWS, int(seconds)))
    width = max(seconds, 1e-9) / count
    bins: list[list[float]] = [[] for _ in range(count)]
    for at, rate in samples:
        bins[min(count - 1, int(at / width))].append(rate)
    return [statistics.median(b) for b in bins if b]


def smi_sampler(stop: threading.Event, every: float, rows: list) -> None:
    """nvidia-smi's clocks, power, temperature and clock event reasons once a window, while the load runs."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return
    query = SMI_QUERY
    while not stop.wait(every):
        try:
            done = subprocess.run(
                [smi, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            rows.append({"error": str(exc)})
            continue
        if done.returncode != 0 and "clocks_event_reasons" in query:
            query = query.replace("clocks_event_reasons", "clocks_throttle_reasons")  # drivers before 535
            continue
        rows.append({"t_s": round(time.perf_counter() - T0, 1), "csv": done.stdout.strip().splitlines()})


T0 = time.perf_counter()  # the smi samples' clock; the load starts at load_started_s on it
LOAD: dict = {}


def sustain(devices: list[str], seconds: float) -> list[dict]:
    """Every device at once for ``seconds`` (one thread each; the operands are built and warmed before
    the clock starts, so the run times the products alone)."""
    loops = [Loop(d) for d in devices]
    for loop in loops:
        loop.warm()
    samples: list[list[tuple[float, float]]] = [[] for _ in loops]
    start = time.perf_counter()
    LOAD["load_started_s"] = round(start - T0, 1)

    def run(i: int) -> None:
        if not loops[i].cpu:
            torch.cuda.set_device(loops[i].device)
        while (now := time.perf_counter() - start) < seconds or not samples[i]:
            samples[i].append((now, loops[i].timed()))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(loops))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = []
    for loop, mine in zip(loops, samples, strict=True):
        rates = [r for _, r in mine]
        wins = windows_of(mine, seconds)
        out.append(
            {
                **loop.describe(),
                "tflops": max(rates),
                "median_tflops": statistics.median(rates),
                "reps": len(rates),
                "windows_tflops": wins,
                "first_window_tflops": wins[0],
                "last_window_tflops": wins[-1],
                "drop": 1 - wins[-1] / wins[0] if wins[0] > 0 else None,
            }
        )
    return out


def main(argv: list[str]) -> None:
    device, mode, seconds = "cuda", "each", 3.0
    args = list(argv)
    while args:
        a = args.pop(0)
        if a == "--device":
            device = args.pop(0)
        elif a == "--sustain":
            mode, seconds = "sustain", float(args.pop(0))
        else:
            seconds = float(a)
    if device == "cpu":
        torch.set_num_threads(1)
        devices = ["cpu"]
    else:
        devices = [f"cuda:{d}" for d in range(torch.cuda.device_count())]
    doc = {
        "dtype": "float32" if device == "cpu" else "bfloat16",
        "n": CPU_N if device == "cpu" else N,
        "matmuls_per_rep": CPU_PER_REP if device == "cpu" else PER_REP,
        "mode": mode,
    }
    if mode == "each":
        doc["gpus"] = each(devices, seconds)
    else:
        stop, smi_rows = threading.Event(), []
        every = max(1.0, seconds / WINDOWS)
        sampler = threading.Thread(target=smi_sampler, args=(stop, every, smi_rows), daemon=True)
        if device != "cpu":
            sampler.start()
        doc["seconds"] = seconds
        doc["gpus"] = sustain(devices, seconds) if devices else []
        stop.set()
        doc["smi_fields"] = SMI_QUERY
        doc["smi"] = smi_rows
        doc.update(LOAD)
    print(json.dumps(doc))


if __name__ == "__main__":
    main(sys.argv[1:])
