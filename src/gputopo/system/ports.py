"""This node's network ports and GPUDirect RDMA facts, read from sysfs and procfs through the re-rootable
view (touches the machine); ``health.network`` judges them.

- RDMA ports: ``/sys/class/infiniband/DEV/ports/N/{state,phys_state,rate,link_layer}``, every number in
  ``counters/`` and ``hw_counters/`` (Documentation/ABI/stable/sysfs-class-infiniband); the PCI function
  behind the device through its ``device`` link, and its ``net/`` folder for the RoCE netdev.
- Ethernet: ``/sys/class/net/IF/{operstate,speed,statistics/carrier_changes}`` for interfaces backed by a
  device (a ``device`` link: no loopback, bridge or veth) that is not an RDMA device's (that one is judged
  as its RDMA port) (Documentation/ABI/testing/sysfs-class-net).
- GPUDirect RDMA: ``/proc/modules`` (``nvidia_peermem``), ``/sys/kernel/mm/memory_peers/nv_mem/version``
  (MLNX_OFED's nv_peer_mem), ``/proc/driver/nvidia/version`` ("Open Kernel Module"),
  ``/proc/sys/kernel/osrelease``; ``/proc/cmdline`` for the IOMMU.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from gputopo.health.network import (
    COUNTERS,
    ETH,
    HW_COUNTERS,
    IB,
    PortReading,
    PortSample,
    parse_rate_gbps,
    parse_speed_gbps,
)
from gputopo.system.pci_path import device_of, pci_ids
from gputopo.system.sysfs import FsView, names, read_int, read_text, view


def read_ports(fs: FsView | None = None) -> PortSample:
    """Every RDMA port and device-backed Ethernet interface, now."""
    fs = fs or view()
    ports: list[PortReading] = []
    rdma_functions: set[str] = set()
    ib_root = fs.sys_path("class", "infiniband")
    for dev in names(ib_root):
        bdf = device_of(f"class/infiniband/{dev}/device", fs)
        if bdf:
            rdma_functions.add(bdf)
        model = pci_ids(bdf, fs) if bdf else None
        numa = read_int(ib_root / dev / "device" / "numa_node")
        netdevs = names(ib_root / dev / "device" / "net")
        for port in names(ib_root / dev / "ports"):
            folder = ib_root / dev / "ports" / port
            counters = _numbers(folder / "counters", COUNTERS, "")
            counters.update(_numbers(folder / "hw_counters", HW_COUNTERS, "hw_"))
            ports.append(
                PortReading(
                    IB,
                    f"{dev}:{port}",
                    dev,
                    port,
                    read_text(folder / "state"),
                    read_text(folder / "phys_state"),
                    parse_rate_gbps(read_text(folder / "rate")),
                    read_text(folder / "link_layer"),
                    counters,
                    bdf,
                    model,
                    numa,
                    netdevs[0] if len(netdevs) == 1 else None,
                )
            )
    net_root = fs.sys_path("class", "net")
    for name in names(net_root):
        bdf = device_of(f"class/net/{name}/device", fs)
        if bdf is None or bdf in rdma_functions:
            continue
        folder = net_root / name
        carrier = read_int(folder / "statistics" / "carrier_changes")
        ports.append(
            PortReading(
                ETH,
                name,
                name,
                None,
                read_text(folder / "operstate"),
                None,
                parse_speed_gbps(read_text(folder / "speed")),
                "Ethernet",
                {"carrier_changes": carrier} if carrier is not None else {},
                bdf,
                pci_ids(bdf, fs),
                read_int(folder / "device" / "numa_node"),
            )
        )
    return PortSample(tuple(ports), time.monotonic())


def _numbers(folder: Path, wanted: tuple[str, ...], prefix: str) -> dict[str, int]:
    """The ``wanted`` counters of ``folder`` that exist. Only those the rules read: on an InfiniBand device
    every read of a ``counters/`` file is a PerfMgmt MAD to the adapter's firmware
    (drivers/infiniband/core/sysfs.c, ``get_perf_mad``), so reading all twenty of them on eight ports,
    twice, would cost the check time it does not need to spend."""
    out: dict[str, int] = {}
    for name in wanted:
        value = read_int(folder / name)
        if value is not None:
            out[prefix + name] = value
    return out


def gdr_inputs(fs: FsView | None = None) -> dict[str, object]:
    """What decides the GPUDirect RDMA mode: ``peermem`` (``nvidia_peermem`` loaded), ``nv_mem``
    (nv_peer_mem's sysfs file), ``open_module`` (the NVIDIA driver is the open kernel module; ``None``
    unknown), ``kernel`` ``(major, minor)``."""
    fs = fs or view()
    modules = read_text(fs.proc_path("modules")) or ""
    peermem = any(line.split(" ", 1)[0] == "nvidia_peermem" for line in modules.splitlines())
    nv_mem = read_text(fs.sys_path("kernel", "mm", "memory_peers", "nv_mem", "version")) is not None
    version = read_text(fs.proc_path("driver", "nvidia", "version"))
    open_module = None if version is None else "Open Kernel Module" in version
    release = read_text(fs.proc_path("sys", "kernel", "osrelease")) or ""
    m = re.match(r"(\d+)\.(\d+)", release)
    kernel = (int(m.group(1)), int(m.group(2))) if m else None
    return {"peermem": peermem, "nv_mem": nv_mem, "open_module": open_module, "kernel": kernel}


def read_gdr_mode(has_rdma: bool, fs: FsView | None = None) -> str | None:
    """This node's GPUDirect RDMA mode (``health.network.gdr_mode`` over ``gdr_inputs``)."""
    from gputopo.health.network import gdr_mode

    inputs = gdr_inputs(fs)
    return gdr_mode(
        has_rdma,
        bool(inputs["peermem"]),
        bool(inputs["nv_mem"]),
        inputs["open_module"],  # type: ignore[arg-type]
        inputs["kernel"],  # type: ignore[arg-type]
    )


def read_cmdline(fs: FsView | None = None) -> str | None:
    """The kernel command line (``/proc/cmdline``); ``None`` when it cannot be read."""
    return read_text((fs or view()).proc_path("cmdline"))


def network_summary(fs: FsView | None = None) -> dict[str, object]:
    """What a run record and the cross-node drift keep about this node's network: the GPUDirect RDMA mode
    (``None`` without RDMA ports), the RDMA port count, and their rates in Gb/s, fastest first."""
    fs = fs or view()
    rdma = [p for p in read_ports(fs).ports if p.kind == IB]
    mode = read_gdr_mode(bool(rdma), fs)
    rates = sorted((p.rate_gbps for p in rdma if p.rate_gbps is not None), reverse=True)
    return {
        "gdr": mode,
        "rdma_ports": len(rdma) if rdma else None,
        "nic_rates_gbps": [f"{r:g}" for r in rates],
    }
