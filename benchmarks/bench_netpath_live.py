"""The network and PCIe-path reads on this machine's own sysfs and procfs (no fake tree, no NVML): how long
``fabric.start()`` + ``fabric.finish()`` take (median of ``--runs``), what they found, and every bridge's
ACS control compared with what ``lspci -vvv`` prints for it (run as root to read the extended space).

Needs only the standard library and gputopo's source (no typer, rich or pynvml), so it runs on a bare GPU
node: ``python3 benchmarks/bench_netpath_live.py``. The GPUs are the NVIDIA display/3D functions in sysfs
(vendor 0x10de, class 0x03xxxx), numbered in PCI order as nvidia-smi numbers them.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gputopo.services import fabric  # noqa: E402
from gputopo.system.pci_path import read_paths  # noqa: E402
from gputopo.system.sysfs import names, read_text, view  # noqa: E402

TARGET_S = 0.2


def nvidia_gpus() -> dict[int, str]:
    root = view().sys_path("bus", "pci", "devices")
    found = [
        bdf
        for bdf in names(root)
        if read_text(root / bdf / "vendor") == "0x10de"
        and (read_text(root / bdf / "class") or "").startswith("0x03")
    ]
    return dict(enumerate(sorted(found)))


def lspci_acsctl() -> dict[str, str] | None:
    tool = shutil.which("lspci")
    if tool is None:
        return None
    out = subprocess.run([tool, "-D", "-vvv"], capture_output=True, text=True, timeout=120).stdout
    found: dict[str, str] = {}
    current = None
    for line in out.splitlines():
        m = re.match(r"^([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]) ", line)
        if m:
            current = m.group(1)
        elif "ACSCtl:" in line and current:
            found[current] = line.split("ACSCtl:", 1)[1].strip()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    gpus = nvidia_gpus()
    print(f"GPUs in sysfs: {len(gpus)} ({', '.join(gpus.values())})")
    times = []
    result = None
    for _ in range(args.runs):
        start = time.perf_counter()
        result = fabric.finish(fabric.start(), gpus)
        times.append(time.perf_counter() - start)
    assert result is not None
    median = statistics.median(times)
    ports = result.ports.ports if result.ports else ()
    print(
        f"reads (start + finish), median of {args.runs}: {median * 1000:.1f} ms "
        f"(max {max(times) * 1000:.1f} ms)"
    )
    print(f"ports: {len(ports)}; GPUDirect RDMA: {result.gdr}; IOMMU: {result.iommu}")
    for p in ports:
        print(
            f"  {p.name:<16} {p.kind:<4} {p.state or '-':<10} {p.phys_state or '-':<12} "
            f"{p.rate_gbps if p.rate_gbps is not None else '-'} Gb/s numa {p.numa_node} "
            f"pci {p.pci_bus_id} gpus {list(result.rails[p.name].gpus) if p.name in result.rails else []} "
            f"counters {len(p.counters)}"
        )
    print(f"pairs: {dict(Counter(p.status for p in result.pairs))}")
    for f in result.findings:
        print(f"  {f.severity.upper():<7} {f.where}: {f.what[:220]}")
    for what, why in result.not_checked:
        print(f"  not checked: {what}: {why}")
    seen = lspci_acsctl()
    paths = read_paths([*gpus.values(), *(p.pci_bus_id for p in ports if p.pci_bus_id)])
    for bdf, path in paths.items():
        chain = (
            path if isinstance(path, str) else " > ".join(f"{b.bdf} ({b.acs.state})" for b in path.bridges)
        )
        print(f"  path of {bdf}: {chain}")
    ours = {
        br.bdf: br.acs.lspci
        for path in paths.values()
        if not isinstance(path, str)
        for br in path.bridges
        if br.acs.lspci is not None
    }
    if seen is None:
        print("lspci: not installed")
    else:
        same = [b for b in ours if seen.get(b) == ours[b]]
        differ = [b for b in ours if b in seen and seen[b] != ours[b]]
        missing = [b for b in ours if b not in seen]
        print(
            f"ACSCtl vs lspci: {len(same)} bridges the same, {len(differ)} differ, {len(missing)} lspci lacks"
        )
        for b in differ[:5]:
            print(f"  {b}: ours {ours[b]!r} lspci {seen[b]!r}")
    ok = median < TARGET_S
    print(f"target: under {TARGET_S:g} s: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
