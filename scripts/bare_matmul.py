"""The bare baseline for the per-GPU probe's matmul figure: the probe's own matmul (probe/ranks/pergpu.py:
8192-square, 16 products a repetition at bf16, timed with CUDA events) without the probe, on each GPU in
turn, for SECONDS after a warm-up of 3 repetitions. Both ``scripts/gpu_acceptance.py`` and
``benchmarks/bench_probe_gpu.py`` run this one file, so they compare the probe against the same loop.

    python scripts/bare_matmul.py [SECONDS]      # default 3

Prints one JSON document: ``{"dtype", "n", "matmuls_per_rep", "gpus": [{"cuda_index", "name",
"pci_bus_id", "tflops" (the best repetition), "median_tflops", "reps"}]}``.
"""

import json
import statistics
import sys
import time

import torch  # noqa: TID251 (a baseline without gputopo: it must not go through probe/ranks)

N, PER_REP, WARM_REPS = 8192, 16, 3


def one_gpu(d: int, seconds: float) -> dict:
    torch.cuda.set_device(d)
    a = torch.randn(N, N, device=d, dtype=torch.bfloat16)
    b = torch.randn(N, N, device=d, dtype=torch.bfloat16)
    c = torch.empty(N, N, device=d, dtype=torch.bfloat16)

    def rep() -> None:
        for _ in range(PER_REP):
            torch.matmul(a, b, out=c)

    for _ in range(WARM_REPS):
        rep()
    torch.cuda.synchronize(d)
    flop = 2 * N**3 * PER_REP
    rates = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or not rates:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        rep()
        e.record()
        torch.cuda.synchronize(d)
        rates.append(flop / (s.elapsed_time(e) / 1e3) / 1e12)
    p = torch.cuda.get_device_properties(d)
    # cudaDeviceProp.pciDomainID/pciBusID/pciDeviceID, torch's ints (as probe/ranks/cuda.py reads them)
    ids = [getattr(p, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    bus = "{:04x}:{:02x}:{:02x}.0".format(*ids) if None not in ids else None
    return {
        "cuda_index": d,
        "name": p.name,
        "pci_bus_id": bus,
        "tflops": max(rates),
        "median_tflops": statistics.median(rates),
        "reps": len(rates),
    }


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    gpus = []
    for d in range(torch.cuda.device_count()):
        gpus.append(one_gpu(d, seconds))
        torch.cuda.empty_cache()  # the last GPU's operands are freed when one_gpu returns
    print(json.dumps({"dtype": "bfloat16", "n": N, "matmuls_per_rep": PER_REP, "gpus": gpus}))


if __name__ == "__main__":
    main()
