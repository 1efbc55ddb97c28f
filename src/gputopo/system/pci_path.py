"""Each device's chain of PCIe bridges and their ACS control, read from sysfs through the re-rootable view
(touches the machine); ``topology.pcie_path`` parses and judges.

``/sys/bus/pci/devices/BDF`` is a link into ``/sys/devices/pciDDDD:BB/<root port>/<switch port>/.../BDF``
(Documentation/ABI/testing/sysfs-bus-pci): the folders on the way are the bridges, root port first. Each
bridge's ``config`` is its config space; the reader reads the whole file, so a non-root reader gets the
64 bytes the kernel allows it and the parser calls that "not checked".
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from gputopo.system.sysfs import FsView, read_bytes, read_int, read_text, resolve, view
from gputopo.topology.pcie_path import Bridge, PciPath, normal_bdf, parse_acs

BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
HOST = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")


def read_paths(bus_ids: Iterable[str], fs: FsView | None = None) -> dict[str, PciPath | str]:
    """Each device's path (keyed by sysfs bdf), or why it has none. A bridge shared by several devices is
    read once."""
    fs = fs or view()
    cache: dict[str, Bridge] = {}
    out: dict[str, PciPath | str] = {}
    for bus_id in bus_ids:
        bdf = normal_bdf(bus_id)
        out[bdf] = read_path(bdf, fs, cache)
    return out


def read_path(bdf: str, fs: FsView, cache: dict[str, Bridge] | None = None) -> PciPath | str:
    """One device's path, or why it has none (not in sysfs, or not below a host bridge)."""
    cache = {} if cache is None else cache
    link = fs.sys_path("bus", "pci", "devices", bdf)
    real = resolve(link)
    if real is None:
        return f"not found under {fs.sys_path('bus', 'pci', 'devices')}"
    parts = real.parts
    hosts = [i for i, p in enumerate(parts) if HOST.match(p)]
    if not hosts:
        return f"{real} is not below a PCI host bridge"
    start = hosts[-1]
    steps = [i for i in range(start + 1, len(parts)) if BDF.match(parts[i])]
    if not steps or parts[steps[-1]] != bdf:
        return f"{real} does not end in the device's folder"
    bridges: list[Bridge] = []
    for i in steps[:-1]:
        name = parts[i]
        if name not in cache:
            folder = type(real)(*parts[: i + 1])
            cache[name] = Bridge(name, parse_acs(read_bytes(folder / "config")))
        bridges.append(cache[name])
    return PciPath(bdf, parts[start], tuple(bridges), read_int(real / "numa_node"))


def device_of(folder_link: str, fs: FsView | None = None) -> str | None:
    """The PCI bdf a class device sits on (``class/infiniband/mlx5_0/device`` -> ``0000:1a:00.0``)."""
    fs = fs or view()
    real = resolve(fs.sys_path(folder_link))
    if real is None or not BDF.match(real.name):
        return None
    return real.name


def pci_ids(bdf: str, fs: FsView | None = None) -> str | None:
    """``vendor:device`` of a PCI function (``15b3:1021``), for telling NIC models apart."""
    fs = fs or view()
    folder = fs.sys_path("bus", "pci", "devices", bdf)
    vendor, device = read_text(folder / "vendor"), read_text(folder / "device")
    if vendor is None or device is None:
        return None
    return f"{vendor.removeprefix('0x')}:{device.removeprefix('0x')}"
