"""Captured-shape sysfs and procfs trees, built in a test's folder, for ``GPUTOPO_SYSFS_ROOT`` /
``GPUTOPO_PROCFS_ROOT``.

The shapes follow a real node: ``devices/pciDDDD:BB/<root port>/<switch up>/<switch down>/<device>`` with
``bus/pci/devices/BDF`` as relative links into it, ``class/infiniband/DEV/device`` and
``class/net/IF/device`` as links to the PCI function. Config blobs are built to the PCIe layout (type 1
header for bridges, a PCI Express capability at 0x40, the ACS extended capability at a known offset after
an AER capability at 0x100) so the real ``lspci -A linux-sysfs -O sysfs.path=ROOT/bus/pci -vvv`` reads
the same tree and shows the same bits.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

ACS_OFFSET = 0x148
AER_OFFSET = 0x100
# ACS control bits as lspci names them.
SV, TB, RR, CR, UF = 0x01, 0x02, 0x04, 0x08, 0x10
REDIRECT = SV | RR | CR | UF  # what a BIOS that "enables ACS" typically leaves
CLEAN = 0


def config_blob(
    vendor: int,
    device: int,
    bridge: bool,
    acs_ctl: int | None = None,
    length: int = 4096,
    class_code: int | None = None,
    pcie_type: int | None = None,
) -> bytes:
    """A config space: ``acs_ctl`` ``None`` for no ACS capability; ``length`` 64 or 256 for what a non-root
    reader or a short kernel gives."""
    b = bytearray(4096)
    struct.pack_into("<HH", b, 0, vendor, device)
    struct.pack_into("<H", b, 0x06, 0x0010)  # status: capability list
    if class_code is None:
        class_code = 0x060400 if bridge else 0x030200
    b[0x09:0x0C] = class_code.to_bytes(3, "little")
    b[0x0E] = 0x01 if bridge else 0x00  # header type
    b[0x34] = 0x40  # capabilities pointer
    if pcie_type is None:
        pcie_type = 0x6 if bridge else 0x0  # downstream switch port / endpoint
    # PCI Express capability (ID 0x10), version 2, device/port type in bits 7:4.
    struct.pack_into("<BBH", b, 0x40, 0x10, 0x00, 0x0002 | (pcie_type << 4))
    # AER first (so ACS is not at the start of the list), then ACS.
    struct.pack_into(
        "<I", b, AER_OFFSET, 0x0001 | (1 << 16) | (ACS_OFFSET << 20 if acs_ctl is not None else 0)
    )
    if acs_ctl is not None:
        struct.pack_into("<I", b, ACS_OFFSET, 0x000D | (1 << 16))
        struct.pack_into("<HH", b, ACS_OFFSET + 4, 0x005F, acs_ctl)
    return bytes(b[:length])


@dataclass
class Tree:
    """A sysfs root at ``root/sys``, a procfs root at ``root/proc`` and an empty /etc at ``root/etc`` (no
    IMEX configuration: a test never reads this host's own)."""

    root: Path
    sys: Path = field(init=False)
    proc: Path = field(init=False)
    etc: Path = field(init=False)

    def __post_init__(self) -> None:
        self.sys = self.root / "sys"
        self.proc = self.root / "proc"
        self.etc = self.root / "etc"
        (self.sys / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
        self.proc.mkdir(parents=True, exist_ok=True)
        self.etc.mkdir(parents=True, exist_ok=True)

    @property
    def env(self) -> dict[str, str]:
        return {
            "GPUTOPO_SYSFS_ROOT": str(self.sys),
            "GPUTOPO_PROCFS_ROOT": str(self.proc),
            "GPUTOPO_ETC_ROOT": str(self.etc),
        }

    def device(
        self,
        host: str,
        chain: list[str],
        config: bytes,
        numa: int = -1,
        vendor: int = 0x10DE,
        device: int = 0x2331,
        class_code: int = 0x030200,
    ) -> Path:
        """The PCI function ``chain[-1]`` below ``host`` through the bridges ``chain[:-1]`` (which must
        already exist or are made plain here)."""
        folder = self.sys / "devices" / host
        for bdf in chain:
            folder = folder / bdf
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config").write_bytes(config)
        (folder / "numa_node").write_text(f"{numa}\n")
        (folder / "vendor").write_text(f"0x{vendor:04x}\n")
        (folder / "device").write_text(f"0x{device:04x}\n")
        (folder / "class").write_text(f"0x{class_code:06x}\n")
        # What lspci's sysfs access reads besides config (lib/sysfs.c): the IRQ and the BARs.
        (folder / "irq").write_text("0\n")
        (folder / "resource").write_text("0x0000000000000000 0x0000000000000000 0x0000000000000000\n" * 7)
        link = self.sys / "bus" / "pci" / "devices" / chain[-1]
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(folder, link.parent))
        return folder

    def bridge(
        self, host: str, chain: list[str], acs_ctl: int | None, numa: int = -1, length: int = 4096
    ) -> Path:
        cfg = config_blob(0x10B5, 0xC010, True, acs_ctl, length)
        return self.device(host, chain, cfg, numa, 0x10B5, 0xC010, 0x060400)

    def ib_port(
        self,
        dev: str,
        pci_folder: Path,
        port: int = 1,
        state: str = "4: ACTIVE",
        phys_state: str = "5: LinkUp",
        rate: str = "400 Gb/sec (4X NDR)",
        link_layer: str = "InfiniBand",
        counters: dict[str, int] | None = None,
        netdev: str | None = None,
    ) -> Path:
        base = self.sys / "class" / "infiniband" / dev
        base.mkdir(parents=True, exist_ok=True)
        if not (base / "device").is_symlink():
            (base / "device").symlink_to(os.path.relpath(pci_folder, base))
        if netdev:
            (pci_folder / "net" / netdev).mkdir(parents=True, exist_ok=True)
        folder = base / "ports" / str(port)
        (folder / "counters").mkdir(parents=True, exist_ok=True)
        (folder / "hw_counters").mkdir(parents=True, exist_ok=True)
        for name, text in (
            ("state", state),
            ("phys_state", phys_state),
            ("rate", rate),
            ("link_layer", link_layer),
        ):
            (folder / name).write_text(text + "\n")
        base_counters = {
            "symbol_error": 0,
            "link_downed": 0,
            "link_error_recovery": 0,
            "excessive_buffer_overrun_errors": 0,
            "local_link_integrity_errors": 0,
            "port_rcv_errors": 0,
        }
        for name, value in {**base_counters, **(counters or {})}.items():
            self.counter(dev, port, name, value)
        (folder / "hw_counters" / "rnr_nak_retry_err").write_text("0\n")
        return folder

    def counter(self, dev: str, port: int, name: str, value: int) -> None:
        path = self.sys / "class" / "infiniband" / dev / "ports" / str(port) / "counters" / name
        path.write_text(f"{value}\n")

    def netdev(
        self, name: str, pci_folder: Path | None, operstate: str = "up", speed: int = 100000, carrier: int = 1
    ) -> Path:
        folder = self.sys / "class" / "net" / name
        (folder / "statistics").mkdir(parents=True, exist_ok=True)
        if pci_folder is not None and not (folder / "device").is_symlink():
            (folder / "device").symlink_to(os.path.relpath(pci_folder, folder))
        (folder / "operstate").write_text(operstate + "\n")
        (folder / "speed").write_text(f"{speed}\n")
        (folder / "statistics" / "carrier_changes").write_text(f"{carrier}\n")
        return folder

    def proc_files(
        self,
        cmdline: str = "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro",
        modules: tuple[str, ...] = ("nvidia_peermem", "nvidia_uvm", "nvidia", "mlx5_ib"),
        driver_version: str = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15",
        osrelease: str = "6.8.0-45-generic",
    ) -> None:
        (self.proc / "cmdline").write_text(cmdline + "\n")
        (self.proc / "modules").write_text(
            "".join(f"{m} 16384 0 - Live 0x0000000000000000\n" for m in modules)
        )
        (self.proc / "driver" / "nvidia").mkdir(parents=True, exist_ok=True)
        (self.proc / "driver" / "nvidia" / "version").write_text(driver_version + "\n")
        (self.proc / "sys" / "kernel").mkdir(parents=True, exist_ok=True)
        (self.proc / "sys" / "kernel" / "osrelease").write_text(osrelease + "\n")


def gpu_bdf(i: int) -> str:
    """The fake driver's bus id for GPU i (tests/fake_driver.bus) in sysfs form."""
    return f"0000:{0x18 + 0x10 * i:02x}:00.0"


def nic_bdf(i: int) -> str:
    return f"0000:{0x1C + 0x10 * i:02x}:00.0"


def switch_bridges(s: int) -> tuple[str, str, str]:
    """Root port, switch upstream port, and the downstream ports' bus of switch ``s`` (buses ending in 0-2,
    so they never meet a GPU's (…8) or a NIC's (…c))."""
    return f"0000:{0x10 * s:02x}:01.0", f"0000:{0x10 * s + 1:02x}:00.0", f"{0x10 * s + 2:02x}"


def eight_gpu_node(
    root: Path,
    ngpus: int = 8,
    nics: int = 8,
    acs: dict[str, int] | None = None,
    config_length: int = 4096,
    port_overrides: dict[int, dict[str, object]] | None = None,
    proc: dict[str, object] | None = None,
) -> Tree:
    """A node shaped as tests/fake_driver's eight-GPU machine: switch ``s`` holds GPUs 2s, 2s+1 and NICs
    mlx5_2s, mlx5_2s+1; the first half of the switches sit on host bridge pci0000:00 (NUMA 0), the rest
    on pci0000:80 (NUMA 1). ``acs`` sets a bridge's ACS control by bdf (default: ACS present, clean);
    ``port_overrides`` changes ``ib_port``'s arguments per NIC."""
    tree = Tree(root)
    acs = acs or {}
    switches = max(4, (max(ngpus, nics) + 1) // 2)
    for s in range(switches):
        second = s >= switches // 2
        host, numa = ("pci0000:80", 1) if second else ("pci0000:00", 0)
        rp, usp, dsp_bus = switch_bridges(s)
        tree.bridge(host, [rp], acs.get(rp, CLEAN), numa, config_length)
        tree.bridge(host, [rp, usp], acs.get(usp), numa, config_length)
        for k, (kind, i) in enumerate(
            (("gpu", 2 * s), ("gpu", 2 * s + 1), ("nic", 2 * s), ("nic", 2 * s + 1))
        ):
            if i >= (ngpus if kind == "gpu" else nics):
                continue
            dsp = f"0000:{dsp_bus}:{k:02x}.0"
            tree.bridge(host, [rp, usp, dsp], acs.get(dsp, CLEAN), numa, config_length)
            if kind == "gpu":
                cfg = config_blob(0x10DE, 0x2331, False, None, config_length)
                tree.device(host, [rp, usp, dsp, gpu_bdf(i)], cfg, numa)
            else:
                cfg = config_blob(0x15B3, 0x1021, False, None, config_length, class_code=0x020700)
                folder = tree.device(host, [rp, usp, dsp, nic_bdf(i)], cfg, numa, 0x15B3, 0x1021, 0x020700)
                tree.ib_port(f"mlx5_{i}", folder, **(port_overrides or {}).get(i, {}))  # type: ignore[arg-type]
    tree.proc_files(**(proc or {}))  # type: ignore[arg-type]
    return tree


def clean_tree_for(machine_file: Path) -> Tree:
    """A clean tree (GPUs behind ACS-clean switches, no network ports, no IOMMU) for a fake-driver machine
    file, so a test never reads this host's own /sys and /proc; made once next to the file."""
    root = machine_file.parent / f"{machine_file.name}.tree"
    if not root.exists():
        text = machine_file.read_text(errors="replace") if machine_file.exists() else ""
        ngpus = sum(1 for line in text.splitlines() if line.startswith("gpu "))
        eight_gpu_node(root, ngpus=ngpus, nics=0)
    return Tree(root)


def every_bus_tree(root: Path) -> Tree:
    """A clean node with a PCI function at every ``0000:XX:00.0`` (so any fake GPU's bus id is found), all
    below one ACS-clean switch in domain 0001, no network ports and no procfs files: what in-process tests
    read instead of this host's /sys and /proc."""
    tree = Tree(root)
    host, rp, usp, dsp = "pci0001:00", "0001:00:01.0", "0001:01:00.0", "0001:02:00.0"
    tree.bridge(host, [rp], CLEAN)
    tree.bridge(host, [rp, usp], None)
    tree.bridge(host, [rp, usp, dsp], CLEAN)
    cfg = config_blob(0x10DE, 0x2331, False, None)
    for bus in range(256):
        tree.device(host, [rp, usp, dsp, f"0000:{bus:02x}:00.0"], cfg)
    return tree
