"""What a launch records about this node, read without importing torch: the host name, torch's and
NCCL's versions, the NCCL net plugin NCCL would load, each GPU's VBIOS, and the NCCL settings in the
environment. ``gputopo run`` writes them into its run record; the multi-node probe sends them to node
rank 0, which compares every node's (``gputopo.health.drift``).

- NCCL's version: ``ncclGetVersion`` (nccl.h: ``ncclResult_t ncclGetVersion(int*)``; the code is
  major*10000 + minor*100 + patch since 2.9, major*1000 + minor*100 + patch before) called through
  ctypes on the library torch's wheel loads (``site-packages/nvidia/nccl/lib/libnccl.so.2``, found
  without importing anything), else on the system's ``libnccl.so``; the call needs no GPU. Without
  either, the version of the ``nvidia-nccl-cu*`` package, else unknown (``None``).
- The net plugin (NCCL ``src/plugin/net.cc`` / ``plugin_open.cc``): with ``NCCL_NET_PLUGIN`` set, NCCL
  dlopens that name as given, then ``libnccl-net-<name>.so``; without it, ``libnccl-net.so``; none found
  means its internal IB and socket transports. The library is looked for (never loaded: loading runs its
  code) in ``LD_LIBRARY_PATH``, the loader cache (``ldconfig -p``) and the standard folders.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import socket
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gputopo.system.ports import network_summary

STANDARD_LIB_DIRS = (
    "/lib",
    "/usr/lib",
    "/lib64",
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/local/lib",
)
NCCL_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_")
LDCONFIG_TIMEOUT_S = 5.0


def hostname() -> str:
    return socket.gethostname()


def torch_version() -> str | None:
    """The installed torch's version, from its package metadata (no import)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def nccl_library() -> Path | None:
    """The libnccl torch's wheel would load (``nvidia/nccl/lib``), else the system's, else ``None``."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "nccl" / "lib" / "libnccl.so.2"
        if lib.is_file():
            return lib
    found = ctypes.util.find_library("nccl")
    return Path(found) if found else None


def version_from_code(code: int) -> str:
    """``ncclGetVersion``'s number as text: 23007 -> ``2.30.7``; 2804 -> ``2.8.4`` (before 2.9)."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def nccl_version() -> str | None:
    """NCCL's version as the library says it, else its package's; ``None`` when neither is there."""
    lib = nccl_library()
    if lib is not None:
        try:
            handle = ctypes.CDLL(str(lib))
            code = ctypes.c_int(0)
            if handle.ncclGetVersion(ctypes.byref(code)) == 0 and code.value > 0:
                return version_from_code(code.value)
        except (OSError, AttributeError):
            pass
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _ldconfig_libs() -> dict[str, str]:
    try:
        done = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, timeout=LDCONFIG_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[str, str] = {}
    for line in done.stdout.splitlines():
        name, sep, path = line.strip().partition(" => ")
        if sep:
            found.setdefault(name.split(" ", 1)[0], path.strip())
    return found


INSPECTOR_PLUGIN = "libnccl-profiler-inspector.so"  # NVIDIA/nccl plugins/profiler/inspector/README.md


def inspector_plugin(env: Mapping[str, str]) -> str | None:
    """The path of NCCL's Inspector profiler plugin (``libnccl-profiler-inspector.so``, what ``make`` in
    NCCL's ``plugins/profiler/inspector`` builds): on ``LD_LIBRARY_PATH``, the standard library folders,
    beside the libnccl torch would load, or in ldconfig's cache; ``None`` when none is found."""
    dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d] + list(STANDARD_LIB_DIRS)
    lib = nccl_library()
    if lib is not None:
        dirs.append(str(lib.parent))
    for d in dirs:
        p = Path(d) / INSPECTOR_PLUGIN
        if p.is_file():
            return str(p)
    return _ldconfig_libs().get(INSPECTOR_PLUGIN)


def net_plugin(env: Mapping[str, str]) -> str | None:
    """The path of the NCCL net plugin NCCL would load with ``env``, or ``None`` (its internal one)."""
    name = env.get("NCCL_NET_PLUGIN", "").strip()
    candidates = [name, f"libnccl-net-{name}.so"] if name else ["libnccl-net.so"]
    dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d] + list(STANDARD_LIB_DIRS)
    cache: dict[str, str] | None = None
    for cand in candidates:
        if "/" in cand:
            if Path(cand).is_file():
                return cand
            continue
        for d in dirs:
            p = Path(d) / cand
            if p.is_file():
                return str(p)
        if cache is None:
            cache = _ldconfig_libs()
        if cand in cache:
            return cache[cand]
    return None


def vbios_versions(indices: Iterable[int]) -> dict[int, str | None]:
    """Each GPU's VBIOS version through NVML; empty when NVML is not there."""
    from gputopo.system import nvml

    out: dict[int, str | None] = {}
    try:
        with nvml.session() as s:
            for i in indices:
                try:
                    out[i] = s.device(i).vbios().value
                except nvml.DeviceFailed:
                    out[i] = None
    except Exception:  # noqa: BLE001 - no NVML (CPU machines, tests): the VBIOS is simply unknown
        return {}
    return out


def nccl_env(env: Mapping[str, str]) -> dict[str, str]:
    """The ``NCCL_*``, ``TORCH_NCCL_*`` and ``TORCH_FR_*`` variables of ``env``, sorted."""
    return {k: env[k] for k in sorted(env) if k.startswith(NCCL_ENV_PREFIXES)}


# Where the IMEX channels NCCL's MNNVL needs appear (NCCL src/mnnvl.cc names it in its warning).
IMEX_CHANNELS_DIR = "/dev/nvidia-caps-imex-channels"
IMEX_READ_S = 2.0  # nvidia-imex-ctl -q runs only where a node configuration lists members


def imex_state(channels_dir: str = IMEX_CHANNELS_DIR, fs: Any = None) -> str | None:
    """This node's IMEX in a few words for drift (``daemon READY, 1 channel``); ``None`` on a machine with
    neither an IMEX node configuration nor the channels folder (nothing to compare)."""
    import time

    from gputopo.health.imex import daemon_state
    from gputopo.system.imex import read_imex

    try:
        channels: int | None = sum(1 for name in os.listdir(channels_dir) if name.startswith("channel"))
    except OSError:
        channels = None
    reading = read_imex(False, time.monotonic() + IMEX_READ_S, fs)
    if not reading.configured and channels is None:
        return None
    if not reading.configured:
        daemon = "not configured"
    elif reading.daemon is None or reading.daemon.stdout is None:
        missing = reading.daemon is not None and "not found" in (reading.daemon.error or "")
        daemon = "nvidia-imex-ctl missing" if missing else "daemon not answering"
    else:
        daemon = f"daemon {daemon_state(reading.daemon.stdout) or 'unreadable'}"
    count = "no channel" if not channels else f"{channels} channel{'s' if channels != 1 else ''}"
    return f"{daemon}, {count}"


def nvlink_facts(topology: Any) -> dict[str, Any]:
    """The node's NVLink domain (``topo --json``'s ``nvlink_domain``) and rack (its chassis serial)."""
    from gputopo.topology.nvlink_domain import node_domain

    domain = node_domain([g.fabric for g in topology.gpus]) if topology is not None else None
    if domain is None:
        return {"nvlink_domain": None, "rack": None}
    return {"nvlink_domain": domain.to_json(), "rack": domain.chassis_serial}


def config_facts(topology: Any, gpus: Iterable[int], env: Mapping[str, str]) -> dict[str, Any]:
    """This node's facts for drift (keys of ``gputopo.health.drift.FACT_KEYS`` and ``env``). ``topology``
    (a ``model.Topology`` or ``None``) gives the driver, CUDA, GPU model and count when it was read live."""
    gpus = list(gpus)
    models: list[str] = []
    driver = cuda = None
    count: int | None = None
    if topology is not None:
        driver, cuda = topology.driver_version, topology.cuda_driver_version
        by_index = {g.index: g for g in topology.gpus}
        models = sorted({str(by_index[i].name) for i in gpus if i in by_index and by_index[i].name})
        count = len(topology.gpus) if getattr(topology, "live", False) else None
    vbios = (
        sorted({v for v in vbios_versions(gpus).values() if v})
        if topology is not None and getattr(topology, "live", False)
        else []
    )
    return {
        "gpu_count": count,
        "gpu_model": models or None,
        "nccl": nccl_version(),
        "net_plugin": net_plugin(env),
        "driver": driver,
        "cuda": cuda,
        "torch": torch_version(),
        "vbios": vbios or None,
        # GPUDirect RDMA mode, RDMA port count and rates (sysfs/procfs): one node without nvidia-peermem
        # or with a port trained down shows as drift.
        **network_summary(),
        # The NVLink domain and rack (judge.mnnvl reads whether nodes share one) and IMEX.
        **nvlink_facts(topology),
        "imex": imex_state(),
        "env": {k: v for k, v in nccl_env(env).items() if not k.startswith("TORCH_FR_")},
    }
