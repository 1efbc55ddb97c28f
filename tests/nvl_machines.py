"""Fake machines with the values of NVIDIA's real ``nvidia-smi -q -x`` captures: a GB300 and a GB200 NVL72
compute tray, an HGX B200 and an HGX H100 board (NVIDIA/k8s-test-infra
tests/e2e/go/assertions/nvidiasmi/testdata/hardware/qx-gb300.xml, qx-gb200.xml, qx-b200.xml, qx-h100.xml,
commit 3b2b865d). The values are copied, not the files: driver, product names, bus ids, module ids, the
fabric's state, status, clique, cluster UUID and health fields, the platform's chassis serial, slot, tray
and host, the C2C mode.

The captures' health fields give the masks gputopo must not call faults: GB300 (bandwidth Full, recovery,
route unhealthy and access timeout False, incorrect configuration None) = 0x1aa; GB200 (incorrect
configuration N/A) = 0xaa; B200 (only access timeout answered) = 0x80; H100 (all N/A, summary N/A) = 0.

``tray(kind, rack=, tray=)`` moves a GB200/GB300 tray to another rack and tray: rack R has the cluster UUID
``0000000R-0000-0000-0000-00000000000R`` (rack 1 is the captures') and the chassis serial ``18200000RRRRR``.
``machine_file(kind, rack, tray)`` writes the same machine in the fake driver's text format
(tests/fakedriver/fake_nvml.c), for tests that run the real nvidia-ml-py (``gputopo nodes`` over 2 racks x 18
trays, say).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fake_nvml import NVSWITCH, FakeGpu, FakeHealth, FakeLink, FakeNvml

COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
HEALTHY, UNHEALTHY, LIMITED = 1, 2, 3  # NVML_GPU_FABRIC_HEALTH_SUMMARY_*
# nvidia-smi prints "Switch Connected"; nvml.h names no values of peerType, so the fake uses 1.
SWITCH_CONNECTED = 1
ZERO_UUID = "00000000-0000-0000-0000-000000000000"


def cluster_uuid(rack: int) -> str:
    return f"{rack:08x}-0000-0000-0000-{rack:012x}"


def chassis_serial(rack: int) -> str:
    return f"18200000{rack:05d}"


# kind -> (product, driver, CUDA, bus ids, module ids, clique, health mask, slot, tray, c2c)
_TRAYS: dict[str, tuple[Any, ...]] = {
    "gb300": (
        "NVIDIA GB300", "580.173.02", 13000,
        ("00000008:06:00.0", "00000009:06:00.0", "00000018:06:00.0", "00000019:06:00.0"),
        (2, 1, 4, 3), 32766, 0x1AA, 25, 15,
    ),
    "gb200": (
        "NVIDIA GB200", "580.173.02", 13000,
        ("00000000:29:00.0", "00000000:3F:00.0", "00000000:9C:00.0", "00000000:B2:00.0"),
        (2, 1, 4, 3), 2, 0xAA, 14, 4,
    ),
}  # fmt: skip

_BOARDS: dict[str, tuple[Any, ...]] = {
    # kind -> (product, driver, bus numbers, module ids, health mask, summary, platform answered)
    "b200": (
        "NVIDIA B200", "580.105.08", (0x8F, 0x90, 0x96, 0x97, 0xC4, 0xC5, 0xCB, 0xCC),
        (6, 8, 7, 5, 2, 4, 3, 1), 0x80, HEALTHY, True,
    ),
    "h100": (
        "NVIDIA H100 80GB HBM3", "580.105.08", (0x53, 0x64, 0x75, 0x86, 0x97, 0xA8, 0xB9, 0xCA),
        (7, 5, 6, 8, 1, 3, 4, 2), 0x0, 0, False,
    ),
}  # fmt: skip


def _links() -> tuple[FakeLink, ...]:
    return tuple(FakeLink(NVSWITCH) for _ in range(18))


def tray(kind: str = "gb300", rack: int = 1, tray: int | None = None, **options: Any) -> FakeNvml:
    """A GB300 (``gb300``) or GB200 (``gb200``) compute tray: 4 GPUs, each with 18 NVLinks to the switch
    trays, registered in rack ``rack``'s domain; ``tray`` moves it to another tray (slot = tray + 10, as
    the captures' GB300 tray 15 sits in slot 25 and GB200 tray 4 in slot 14)."""
    product, driver, cuda, buses, modules, clique, mask, slot, index = _TRAYS[kind]
    if tray is not None:
        slot, index = tray + 10, tray
    gpus = []
    for i, (bus, module) in enumerate(zip(buses, modules, strict=True)):
        health = FakeHealth(
            fabric=(COMPLETED, 0, clique, mask),
            fabric_uuid=cluster_uuid(rack),
            fabric_summary=HEALTHY,
            platform=(chassis_serial(rack), slot, index, 1, SWITCH_CONNECTED, module),
            c2c=True,
        )
        gpus.append(
            FakeGpu(
                name=product,
                bus_id=bus,
                uuid=f"GPU-{rack:04x}{index:04x}-0000-0000-0000-{i:012x}",
                minor=i,
                pcie_path=(i // 2, i, 0, 0),
                pcie=(5, 5, 16, 16),
                memory_total_mib=189471 if kind == "gb200" else 284208,
                links=_links(),
                health=health,
            )
        )
    options.setdefault("health", True)
    return FakeNvml(gpus, driver_version=driver, cuda_driver_version=cuda, **options)


def board(kind: str = "b200", **options: Any) -> FakeNvml:
    """An HGX B200 (``b200``) or HGX H100 (``h100``) board: 8 GPUs behind the board's own NVSwitches,
    fabric registration completed with clique 0 and a zero cluster UUID (not multi-node NVLink). The B200
    answers platform info with no chassis serial (nvidia-smi: slot and tray N/A); the H100 has none."""
    product, driver, buses, modules, mask, summary, has_platform = _BOARDS[kind]
    gpus = []
    for i, (bus, module) in enumerate(zip(buses, modules, strict=True)):
        health = FakeHealth(
            fabric=(COMPLETED, 0, 0, mask),
            fabric_uuid=ZERO_UUID,
            fabric_summary=summary,
            platform=("", 0, 0, 1, SWITCH_CONNECTED, module) if has_platform else None,
            c2c=False,
        )
        gpus.append(
            FakeGpu(
                name=product,
                bus_id=f"00000000:{bus:02X}:00.0",
                uuid=f"GPU-{i:08x}-0000-0000-0000-{i:012x}",
                minor=i,
                pcie_path=(i // 4, i, 0, 0),
                pcie=(5, 5, 16, 16),
                memory_total_mib=183359 if kind == "b200" else 81559,
                links=_links(),
                health=health,
            )
        )
    options.setdefault("health", True)
    return FakeNvml(gpus, driver_version=driver, cuda_driver_version=13000, **options)


def machine(kind: str, **options: Any) -> FakeNvml:
    """Any of the four by name: ``gb300``, ``gb200`` (trays), ``b200``, ``h100`` (boards)."""
    return tray(kind, **options) if kind in _TRAYS else board(kind, **options)


def set_fabric(fake: FakeNvml, gpu: int, **changes: Any) -> None:
    """Change one GPU's ``FakeHealth`` (``fabric=(state, status, clique, mask)``, ``fabric_uuid=``...)."""
    fake.gpus[gpu].health = replace(fake.gpus[gpu].health, **changes)


def machine_lines(kind: str = "gb300", rack: int = 1, tray_index: int | None = None) -> list[str]:
    """``machine(kind)`` in the fake driver's text format (fake_nvml.c); a tray in rack ``rack``, tray
    ``tray_index``."""
    fake = tray(kind, rack=rack, tray=tray_index) if kind in _TRAYS else board(kind)
    lines = [f"driver {fake.driver_version}", f"cuda {fake.cuda_driver_version}"]
    for i, g in enumerate(fake.gpus):
        h = g.health
        assert h.fabric is not None
        state, status, clique, mask = h.fabric
        if h.platform is not None:
            serial, slot, index, host, peer, module = h.platform
            lines.append(f"platform {i} {serial or '-'} {slot} {index} {host} {peer} {module}")
        lines += [
            f"gpu {i} {g.bus_id} {g.uuid} {g.minor} {g.name}",
            f"pcie {i} {' '.join(str(v) for v in g.pcie)}",
            f"mem {i} {g.memory_total_mib} 0 512",
            *(f"link {i} {k} 1 - 2" for k in range(len(g.links))),  # 2: NVML_NVLINK_DEVICE_TYPE_SWITCH
            f"fabric {i} {state} {status} {clique} {mask:x}",
            f"fabricv3 {i} {h.fabric_uuid} {h.fabric_summary or 0}",
            f"c2c {i} {int(bool(h.c2c))}",
        ]
    return lines


def machine_file(path: Any, kind: str = "gb300", rack: int = 1, tray_index: int | None = None) -> Any:
    """Write ``machine_lines(kind, rack, tray_index)`` to ``path`` (a ``pathlib.Path``) and return it: the
    machine file ``FAKE_NVML_CONFIG`` names for rack ``rack``, tray ``tray_index``."""
    path.write_text("\n".join(machine_lines(kind, rack, tray_index)) + "\n")
    return path
