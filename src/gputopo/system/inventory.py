"""This machine's GPUs: the live topology, the processes on the GPUs, and the ``/dev/nvidiaN`` numbers.

NVML first (``system.nvml``); when NVML cannot be loaded, the text of ``nvidia-smi topo -m``
(``system.smi``); when neither works, ``UnavailableError`` (exit 3). A GPU that fails while being read
becomes a ``Gpu`` with ``error`` set and unknown cells; the other GPUs are still read.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from gputopo.errors import InputError, UnavailableError
from gputopo.model import P2P_CAPABILITIES, Gpu, Matrix, NvlinkPeer, Topology
from gputopo.system import nvml, smi

NO_DRIVER_MESSAGE = "no NVIDIA driver or NVML found on this machine"
NO_DRIVER_HINT = (
    "read a saved output with --input FILE (from `nvidia-smi topo -m`) or try a built-in machine: "
    "--input sample:seed-8gpu-nv4 (gputopo topo --list-samples)"
)


@dataclass(frozen=True)
class GpuProcess:
    """A process with a context on a GPU, as NVML reports it (compute or graphics).

    ``pid`` is in the PID namespace NVML sees (see ``nvml_sees_pid_namespace``); ``gpu_index`` is
    nvidia-smi's; ``used_memory_mib`` is ``None`` where NVML does not tell (e.g. without permission).
    """

    pid: int
    gpu_index: int
    used_memory_mib: int | None


def format_id_ranges(ids: Iterable[int]) -> str:
    """CPU or NUMA ids as nvidia-smi writes them: ``[0..31, 64..95]`` -> ``0-31,64-95``."""
    parts: list[str] = []
    ordered = sorted(set(ids))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def read_live(smi_timeout_s: float = smi.DEFAULT_TIMEOUT_S) -> Topology:
    """This machine's topology: from NVML, else from ``nvidia-smi topo -m``, else ``UnavailableError``."""
    try:
        with nvml.session() as s:
            return _read_nvml(s)
    except nvml.NvmlUnavailable as exc:
        nvml_failure = exc
    try:
        text = smi.topo_matrix_text(timeout_s=smi_timeout_s)
    except smi.SmiUnavailable as exc:
        if nvml_failure.not_installed:
            raise UnavailableError(NO_DRIVER_MESSAGE, NO_DRIVER_HINT) from None
        # NVML is there but broken (e.g. a driver/library version mismatch): say what each one said.
        raise UnavailableError(f"{nvml_failure.message}; {exc.message}", NO_DRIVER_HINT) from None
    from gputopo.topology.parse_smi import parse_topo_text

    try:
        topo = parse_topo_text(text, source="nvidia-smi")
    except InputError as exc:
        # The text came from this machine, not from the user: not a usage error.
        raise UnavailableError(
            f"cannot read the output of `nvidia-smi topo -m` on this machine: {exc.message}", NO_DRIVER_HINT
        ) from None
    note = (
        f"{nvml_failure.message}; read `nvidia-smi topo -m` instead, so there are no PCIe, NVLink, "
        "P2P or process details"
    )
    return replace(topo, warnings=(note, *topo.warnings))


def _read_nvml(s: nvml.Session) -> Topology:
    """The topology as NVML sees it; a GPU that fails is marked and the rest is still read."""
    count = s.device_count()
    if count == 0:
        raise UnavailableError("NVML sees no GPUs on this machine", NO_DRIVER_HINT)
    warnings: list[str] = []
    gpus: list[Gpu] = []
    devices: dict[int, nvml.Device] = {}
    ends: dict[int, list[nvml.NvlinkEnd]] = {}
    for i in range(count):
        try:
            dev = s.device(i)
            gpu = _read_gpu(dev)
            ends[i] = dev.nvlink_ends()
            devices[i] = dev
        except nvml.DeviceFailed as exc:
            gpu = Gpu(index=i, error=exc.reason)
            warnings.append(f"GPU{i} did not answer NVML ({exc.reason}); its details and links are unknown")
        gpus.append(gpu)

    peers, link_warnings = _nvlink_peers(gpus, ends)
    warnings += link_warnings
    up = {(p.gpu, p.peer): p.links_up for p in peers}

    labels = tuple(g.label for g in gpus)
    cells: list[list[str | None]] = [[None] * count for _ in range(count)]
    for a in range(count):
        cells[a][a] = "X"
        for b in range(a + 1, count):
            code = _pair_code(s, devices, up, a, b, warnings)
            cells[a][b] = cells[b][a] = code

    p2p = {cap: _p2p_matrix(s, devices, count, cap, warnings) for cap in P2P_CAPABILITIES}
    return Topology(
        source="nvml",
        gpus=tuple(gpus),
        nics=(),  # NVML does not see network devices
        matrix=Matrix(labels, tuple(tuple(r) for r in cells)),
        warnings=tuple(warnings),
        nvlinks=tuple(peers),
        p2p=p2p,  # type: ignore[arg-type]  # cells are None where NVML could not tell
        driver_version=s.driver_version(),
        cuda_driver_version=s.cuda_driver_version(),
        live=True,
    )


def _read_gpu(dev: nvml.Device) -> Gpu:
    """Every per-GPU field NVML has; ``DeviceFailed`` propagates so the caller marks the whole GPU."""
    cpus = dev.cpu_ids()
    nodes = dev.numa_nodes()
    gpu_numa = dev.gpu_numa_id()
    total_mib, used_mib = dev.memory_mib()
    compute = dev.processes("compute")
    return Gpu(
        index=dev.index,
        name=dev.name(),
        pci_bus_id=dev.pci_bus_id(),
        uuid=dev.uuid(),
        cpu_affinity=format_id_ranges(cpus) if cpus else None,
        numa_affinity=format_id_ranges(nodes) if nodes else None,
        gpu_numa_id=str(gpu_numa) if gpu_numa is not None else None,
        minor_number=dev.minor_number(),
        pcie=dev.pcie_link(),
        memory_total_mib=total_mib,
        memory_used_mib=used_mib,
        compute_pids=tuple(sorted({pid for pid, _ in compute})) if compute is not None else None,
        utilization_pct=dev.utilization_pct(),
    )


def _nvlink_peers(
    gpus: list[Gpu], ends: dict[int, list[nvml.NvlinkEnd]]
) -> tuple[list[NvlinkPeer], list[str]]:
    """NVLinks per ordered GPU pair, up and down, from each GPU's own list of links.

    A link whose far end is another GPU counts for that pair. Links to an NVSwitch connect the GPU to
    every other GPU that also has NVSwitch links (all-to-all), so each such pair gets the GPU's whole
    switch link count, as nvidia-smi shows ``NV18`` for every pair of an HGX H100. Links to a device NVML
    does not name (a GPU outside this container, an NVSwitch on a driver without the remote-type query)
    are not guessed: they are reported in a warning.
    """
    by_bus = {g.pci_bus_id: g.index for g in gpus if g.pci_bus_id}
    direct: dict[tuple[int, int], list[int]] = {}
    switch: dict[int, list[int]] = {}
    warnings: list[str] = []
    for a, links in sorted(ends.items()):
        unnamed = 0
        down = sum(1 for end in links if not end.up)
        if down:
            warnings.append(f"GPU{a}: {down} of {len(links)} NVLinks are down")
        for end in links:
            peer = by_bus.get(end.remote_bus_id) if end.remote_bus_id else None
            if end.remote_kind == "switch":
                counts = switch.setdefault(a, [0, 0])
            elif peer is not None and peer != a and end.remote_kind in ("gpu", None):
                counts = direct.setdefault((a, peer), [0, 0])
            elif end.remote_kind == "cpu":
                continue  # CPU-GPU NVLink (IBM POWER): not a GPU-GPU path
            else:
                unnamed += end.up
                continue
            counts[0 if end.up else 1] += 1
        if unnamed:
            warnings.append(f"GPU{a}: {unnamed} NVLinks lead to a device NVML does not name; not counted")
    peers: list[NvlinkPeer] = []
    for a in sorted(ends):
        for b in sorted(ends):
            if a == b:
                continue
            links_up, links_down = direct.get((a, b), [0, 0])
            if a in switch and b in switch:
                links_up += switch[a][0]
                links_down += switch[a][1]
            if links_up or links_down:
                peers.append(NvlinkPeer(a, b, links_up, links_down))
    return peers, warnings


def _pair_code(
    s: nvml.Session,
    devices: dict[int, nvml.Device],
    up: dict[tuple[int, int], int],
    a: int,
    b: int,
    warnings: list[str],
) -> str | None:
    """The ``topo -m`` code of a GPU pair: ``NV#`` when NVLinks are up, else the PCIe path code."""
    if a not in devices or b not in devices:
        return None
    # The fewer of the two sides' counts: a pair runs at the links both ends see up.
    nvlinks = min(up.get((a, b), 0), up.get((b, a), 0))
    if nvlinks:
        return f"NV{nvlinks}"
    try:
        return s.path_code(devices[a], devices[b])
    except nvml.DeviceFailed as exc:
        warnings.append(f"GPU{a}-GPU{b}: NVML could not tell the path ({exc.reason})")
        return None


def _p2p_matrix(
    s: nvml.Session, devices: dict[int, nvml.Device], count: int, capability: str, warnings: list[str]
) -> tuple[tuple[str | None, ...], ...]:
    """One P2P status matrix (``X`` on the diagonal, ``None`` where NVML could not answer)."""
    rows: list[tuple[str | None, ...]] = []
    for a in range(count):
        row: list[str | None] = []
        for b in range(count):
            if a == b:
                row.append("X")
            elif a in devices and b in devices:
                try:
                    row.append(s.p2p_status(devices[a], devices[b], capability))
                except nvml.DeviceFailed as exc:
                    warnings.append(f"GPU{a}-GPU{b}: NVML could not tell P2P {capability} ({exc.reason})")
                    row.append(None)
            else:
                row.append(None)
        rows.append(tuple(row))
    return tuple(rows)


def gpu_processes() -> list[GpuProcess] | None:
    """Compute and graphics processes on every GPU; ``None`` when NVML is unavailable.

    A process on two GPUs appears once per GPU. GPUs that fail or do not list processes are skipped.
    """
    try:
        with nvml.session() as s:
            found: dict[tuple[int, int], int | None] = {}
            for i in range(s.device_count()):
                try:
                    dev = s.device(i)
                    lists = [dev.processes("compute"), dev.processes("graphics")]
                except nvml.DeviceFailed:
                    continue
                for procs in lists:
                    for pid, used_mib in procs or ():
                        # A process with both kinds of context (type C+G) is listed twice: keep one.
                        known = found.get((pid, i))
                        found[(pid, i)] = used_mib if known is None else max(known, used_mib or 0)
    except nvml.NvmlUnavailable:
        return None
    return [
        GpuProcess(pid, gpu, used) for (pid, gpu), used in sorted(found.items(), key=lambda kv: kv[0][::-1])
    ]


def minor_numbers() -> dict[int, int] | None:
    """nvidia-smi GPU index -> minor number N of ``/dev/nvidiaN``; ``None`` when NVML is unavailable.

    GPUs that fail or do not report a minor number are left out.
    """
    try:
        with nvml.session() as s:
            out: dict[int, int] = {}
            for i in range(s.device_count()):
                try:
                    minor = s.device(i).minor_number()
                except nvml.DeviceFailed:
                    continue
                if minor is not None:
                    out[i] = minor
            return out
    except nvml.NvmlUnavailable:
        return None


def nvml_sees_pid_namespace(
    proc_root: Path = Path("/proc"), device_pattern: str = "/dev/nvidia*"
) -> bool | None:
    """Whether the PIDs NVML reports now are PIDs of this PID namespace (see ``pid_namespace_verdict``)."""
    return pid_namespace_verdict(gpu_processes(), proc_root, device_pattern)


def pid_namespace_verdict(
    procs: Sequence[GpuProcess] | None, proc_root: Path = Path("/proc"), device_pattern: str = "/dev/nvidia*"
) -> bool | None:
    """Whether the PIDs in ``procs`` (NVML's process list, from ``gpu_processes``) are PIDs of this PID
    namespace. Takes the list so a caller that already has it does not ask NVML again.

    Comparing ``/proc/self/ns/pid`` with ``/proc/1/ns/pid`` does not answer it: whether the driver
    translates PIDs into a container's namespace depends on the driver and the container runtime. So the
    rule looks at the evidence: a PID NVML reports must, here, be a process with a GPU device file
    (``device_pattern``) open, since every process with a context on a GPU holds one.

    - ``True``: at least one reported PID is a local process with a device file open.
    - ``False``: none is, and every reported PID is either absent here or a local process whose open
      files (readable to us) include no device file, i.e. a different process under the same number.
    - ``None``: can't tell: NVML is unavailable, reports no processes, or some PIDs' files are unreadable.
    """
    if not procs:
        return None
    contradicted = inconclusive = 0
    for pid in sorted({p.pid for p in procs}):
        verdict = _holds_device(proc_root / str(pid), device_pattern)
        if verdict is True:
            return True
        if verdict is False:
            contradicted += 1
        else:
            inconclusive += 1
    return False if contradicted and not inconclusive else None


def _holds_device(proc_dir: Path, device_pattern: str) -> bool | None:
    """True if the process has a file matching ``device_pattern`` open, False if it does not (or does
    not exist), None if its descriptors cannot be read."""
    fd_dir = proc_dir / "fd"
    try:
        names = os.listdir(fd_dir)
    except FileNotFoundError:
        return False
    except (PermissionError, NotADirectoryError):
        return None if proc_dir.exists() else False
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:  # closed since listdir, or not readable
            continue
        if fnmatch.fnmatchcase(target, device_pattern):
            return True
    return False


# --- NVML's process lists for kill-stale (kept together; the reads above serve the topology) ----------


@dataclass(frozen=True)
class ProcessListing:
    """Every GPU's compute, graphics and MPS process lists, as NVML answered them, for kill-stale.

    ``entries`` are ``(pid, gpu_index, used_memory_mib, kind)`` with pids in NVML's PID namespace (the host's
    on older drivers even inside a container). ``refused`` maps a GPU index to why one of its lists is
    unknown (NVML refused it, or the GPU stopped answering): for that GPU, "not listed" proves nothing.
    ``names`` is NVML's process name per listed pid (``None`` where it gave none).
    """

    entries: tuple[tuple[int, int, int | None, str], ...]
    refused: dict[int, str]
    names: dict[int, str | None]


def process_listing() -> ProcessListing | None:
    """NVML's process lists on every GPU, with refused lists kept apart; ``None`` when NVML is unavailable."""
    try:
        with nvml.session() as s:
            entries: list[tuple[int, int, int | None, str]] = []
            refused: dict[int, str] = {}
            for i in range(s.device_count()):
                try:
                    dev = s.device(i)
                    lists = [nvml.process_list(dev, kind) for kind in ("compute", "graphics", "mps")]
                except nvml.DeviceFailed as exc:
                    refused[i] = exc.reason
                    continue
                for listed in lists:
                    if listed.entries is None:
                        refused.setdefault(i, f"{listed.kind} list: {listed.refused}")
                        continue
                    entries.extend((pid, i, used, listed.kind) for pid, used in listed.entries)
            names = {pid: nvml.process_name(s, pid) for pid in sorted({e[0] for e in entries})}
    except nvml.NvmlUnavailable:
        return None
    return ProcessListing(tuple(entries), refused, names)
