"""The fake NVIDIA driver (tests/fakedriver/fake_nvml.c) under the real nvidia-ml-py: build and machines.

``build(dir, old=...)`` puts the C file, compiled once per test run with the system C compiler, at
``dir/libnvidia-ml.so.1``
(``old``: a driver that lacks memory v2, MIG, the NUMA node id, the remote NVLink type, the v3 process
lists, the clocks event reasons name, remapped rows and the fabric info). ``run(...)`` starts
``python -m gputopo ...`` with ``LD_LIBRARY_PATH`` pointing there and
``FAKE_NVML_CONFIG`` naming a machine file, so the real pynvml loads the fake library as it would load the
driver's. The machine text format is described at the top of the C file.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import sysfs_tree


def bindings_read_fabric_health() -> bool:
    """Whether the installed nvidia-ml-py has the versioned fabric and platform calls (health mask and
    summary, rack and tray). The oldest allowed (12.535.77, .ci/run's second run) has only the v1 fabric
    call: there `check` rightly says "fabric health" is not checked, and no rack is known."""
    import pynvml

    return hasattr(pynvml, "nvmlDeviceGetGpuFabricInfoV") and hasattr(pynvml, "nvmlDeviceGetPlatformInfo")


# Tests that spell out every line of a healthy check, or read a tray's rack, on bindings that can read it.
NEEDS_FABRIC_BINDINGS = pytest.mark.skipif(
    not bindings_read_fabric_health(),
    reason="these nvidia-ml-py bindings have no fabric v2/v3 or platform call: fabric health is not checked",
)

SOURCE = Path(__file__).parent / "fakedriver" / "fake_nvml.c"
SRC = Path(__file__).resolve().parents[1] / "src"

# NVML codes, as nvml.h numbers them.
NO_PERMISSION = 4
GPU_IS_LOST = 15
UNKNOWN = 999

_H100 = "NVIDIA H100 PCIe"
_LEVEL = {"PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}


def bus(i: int) -> str:
    return f"00000000:{0x18 + 0x10 * i:02X}:00.0"


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-{i:012x}"


# The done-when machine: 8 H100 PCIe cards over two sockets (GPU0-3 on socket 0, 4-7 on socket 1).
# GPU0-GPU1: an NVLink bridge (NV4). GPU2: NVLink-capable, no bridge. GPU3: fell off the bus.
# GPU4: hidden from this job (NoPermission on its handle). GPU5: MIG on, two MIG devices.
# GPU6: every query about its UUID hangs. GPU7: busy at Gen3 of Gen5 (downclocked while busy).
# GPU1: narrowed to x8 of x16 (idle). GPU0: its utilisation query answers Unknown Error.
EIGHT_GPU_LINES = [
    "driver 550.54.15",
    "cuda 12040",
    *(f"gpu {i} {bus(i)} {uuid(i)} {i} {_H100}" for i in range(8)),
    *(f"pcie {i} 5 5 16 16" for i in (0, 2, 5, 6)),
    "pcie 1 5 5 8 16",
    "pcie 7 3 5 16 16",
    *(f"mem {i} 81559 0 512" for i in range(8) if i != 7),
    "mem 7 81559 40000 512",
    "util 7 95",
    "proc 7 4242 40000",
    *(f"cpus {i} {'ffffffff' if i < 4 else 'ffffffff00000000'}" for i in range(8)),
    *(f"nodes {i} {'1' if i < 4 else '2'}" for i in range(8)),
    *(f"link 0 {k} 1 {bus(1)} 0" for k in range(4)),
    *(f"link 1 {k} 1 {bus(0)} 0" for k in range(4)),
    *(f"link 2 {k} 0 - 0" for k in range(4)),
    "handle 3 15",
    "handle 4 4",
    "mig 5 1 1",
    "migdev 5 0 MIG-aaaaaaaa-0000-0000-0000-000000000001",
    "migdev 5 1 MIG-aaaaaaaa-0000-0000-0000-000000000002",
    "hang 6 nvmlDeviceGetUUID",
    "err 0 nvmlDeviceGetUtilizationRates 999",
    *(f"mig {i} 0 0" for i in (0, 1, 2, 6, 7)),
]


def paths(level_of: dict[tuple[int, int], str]) -> list[str]:
    return [f"path {a} {b} {_LEVEL[code]}" for (a, b), code in level_of.items()]


# PCIe paths: GPU0/1 share a switch (PIX), 2/3 another; the two switches meet under the host bridge (PHB);
# 4-7 likewise on socket 1; across sockets SYS (the default).
EIGHT_GPU_PATHS = paths(
    {
        (0, 1): "PIX",
        (2, 3): "PIX",
        (0, 2): "PHB",
        (0, 3): "PHB",
        (1, 2): "PHB",
        (1, 3): "PHB",
        (4, 5): "PIX",
        (6, 7): "PIX",
        (4, 6): "PHB",
        (4, 7): "PHB",
        (5, 6): "PHB",
        (5, 7): "PHB",
    }
)


def eight_gpu_machine(*extra: str) -> str:
    return "\n".join([*EIGHT_GPU_LINES, *EIGHT_GPU_PATHS, *extra]) + "\n"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def build(directory: Path, old: bool = False) -> Path:
    """Put the fake driver at ``directory/libnvidia-ml.so.1``; returns ``directory``.

    The C file is compiled once per test run for each (source hash, ``old``) and copied from there: 17
    fixtures ask for a driver, and each compile costs a second of the machine's two cores."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy2(_compiled(old), directory / "libnvidia-ml.so.1")
    return directory


_COMPILED: dict[tuple[str, bool], Path] = {}


def _compiled(old: bool) -> Path:
    """The library compiled from the C file as it is now (its hash is the key, so an edited source is
    compiled again), in a folder of this run's own that is removed when the run ends."""
    key = (hashlib.sha256(SOURCE.read_bytes()).hexdigest(), old)
    if key not in _COMPILED:
        cc = compiler()
        assert cc is not None
        folder = Path(tempfile.mkdtemp(prefix="gputopo-fake-driver-"))
        atexit.register(shutil.rmtree, folder, True)
        lib = folder / "libnvidia-ml.so.1"
        cmd = [cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(SOURCE)]
        if old:
            cmd.insert(1, "-DOLD_DRIVER")
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        _COMPILED[key] = lib
    return _COMPILED[key]


def run_python(
    lib_dir: Path, machine_file: Path, code: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -c CODE`` on the fake machine: for calling gputopo's API (not a command) over the real
    pynvml and the fake driver, which only a fresh process can load."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env_for(lib_dir, machine_file),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def env_for(lib_dir: Path, machine_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "GPUTOPO_DEBUG")}
    env["LD_LIBRARY_PATH"] = str(lib_dir) + (
        os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else ""
    )
    env["FAKE_NVML_CONFIG"] = str(machine_file)
    env["PYTHONPATH"] = str(SRC) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({"NO_COLOR": "1", "COLUMNS": "160", "TERM": "dumb"})
    # sysfs and procfs as a clean captured-shape tree (tests/sysfs_tree.py), never this host's own: a test
    # that wants ports or ACS sets GPUTOPO_SYSFS_ROOT / GPUTOPO_PROCFS_ROOT itself (extra_env).
    env.update(sysfs_tree.clean_tree_for(machine_file).env)
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()
    )
    return env


def run(
    lib_dir: Path,
    machine_file: Path,
    *args: str,
    timeout: float = 120,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m gputopo ARGS`` on the fake machine; a hang past ``timeout`` fails the test."""
    env = {**env_for(lib_dir, machine_file), **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-m", "gputopo", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
