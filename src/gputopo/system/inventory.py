"""This machine's GPUs: the live topology, the processes on the GPUs, and the ``/dev/nvidiaN`` numbers.

NVML first (``system.nvml``); when NVML cannot be loaded, the text of ``nvidia-smi topo -m``
(``system.smi``); when neither works, ``UnavailableError`` (exit 3). A GPU that fails while being read
becomes a ``Gpu`` with ``error`` set and unknown cells; the other GPUs are still read.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gputopo.errors import InputError, UnavailableError
from gputopo.gpulist import format_id_ranges  # noqa: F401 -- also this module's public name (tests)
from gputopo.model import (
    GPU_NOT_ACCESSIBLE,
    GPU_NOT_RESPONDING,
    P2P_CAPABILITIES,
    Gpu,
    GpuFabric,
    Matrix,
    NvlinkPeer,
    Topology,
)
from gputopo.system import nvml, nvml_worker, smi
from gputopo.topology.nvlink_domain import FABRIC_STATE_WORDS, SUMMARY_WORDS, gpu_domain

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


def read_live(
    smi_timeout_s: float = smi.DEFAULT_TIMEOUT_S, nvml_timeout_s: float = nvml_worker.DEFAULT_TIMEOUT_S
) -> Topology:
    """This machine's topology: from NVML, else from ``nvidia-smi topo -m``, else ``UnavailableError``.

    Each NVML read (start-up, one GPU, one GPU pair) has ``nvml_timeout_s``: a GPU that does not answer
    in time is marked "not responding" and the rest is still read (``nvml_worker``). With a test backend
    in place (``nvml.use_backend``), or no NVML library to load, the reads run in this process.
    """
    if nvml_timeout_s <= 0:
        raise InputError(f"--nvml-timeout {nvml_timeout_s:g}: must be positive", "e.g. --nvml-timeout 5")
    try:
        if nvml.backend_overridden() or not nvml.library_present():
            # A test backend lives in this process; without the library NVML fails at once, here.
            with nvml.session() as s:
                return _read_nvml(_LocalReader(s))
        return _read_nvml(_WorkerReader(nvml_timeout_s))
    except nvml.NvmlUnavailable as exc:
        nvml_failure = exc
    if nvml_failure.hung:
        # nvidia-smi asks the same driver: it would hang too.
        raise UnavailableError(nvml_failure.message, nvml_failure.hint)
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


@dataclass(frozen=True)
class GpuRead:
    """One GPU as NVML answered: the ``Gpu`` (``error``/``state`` set when it could not be read), its
    NVLinks, and the warnings its values left."""

    gpu: Gpu
    ends: tuple[nvml.NvlinkEnd, ...]
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class PairRead:
    """One GPU pair: the PCIe path code (``None`` if unknown or not asked), and the P2P status per
    ``(capability, from GPU, to GPU)``, both directions."""

    path: str | None
    p2p: dict[tuple[str, int, int], str | None]
    warnings: tuple[str, ...]


class Served:
    """The reads themselves, on one NVML session: run in the worker process, or in this one for tests."""

    def __init__(self, s: nvml.Session) -> None:
        self.s = s
        self.devices: dict[int, nvml.Device] = {}

    def answer(self, request: tuple[Any, ...]) -> Any:
        """Dispatch a request tuple: ``("header",)``, ``("gpu", i)`` or ``("pair", a, b, need_path)``."""
        if request[0] == "header":
            try:
                return ("ok", self.s.device_count(), self.s.driver_version(), self.s.cuda_driver_version())
            except nvml.NvmlUnavailable as exc:
                return ("unavailable", exc.message, exc.hint, exc.not_installed)
        if request[0] == "gpu":
            return self.gpu(int(request[1]))
        return self.pair(int(request[1]), int(request[2]), bool(request[3]))

    def gpu(self, index: int) -> GpuRead:
        s = self.s
        before = len(s.warnings)
        ends: tuple[nvml.NvlinkEnd, ...] = ()
        try:
            dev = s.device(index)
            gpu = _read_gpu(dev)
            ends = tuple(dev.nvlink_ends())
            self.devices[index] = dev
            extra: tuple[str, ...] = ()
        except nvml.DeviceFailed as exc:
            gpu = Gpu(index=index, error=exc.reason, state=exc.state)
            extra = (_unread_warning(gpu),)
        return GpuRead(gpu, ends, tuple(s.warnings[before:]) + extra)

    def pair(self, a: int, b: int, need_path: bool) -> PairRead:
        s = self.s
        before = len(s.warnings)
        notes: list[str] = []
        try:
            da = self.devices.get(a) or s.device(a)
            db = self.devices.get(b) or s.device(b)
        except nvml.DeviceFailed as exc:
            return PairRead(None, {}, (f"GPU{a}-GPU{b}: {exc.reason}",))
        self.devices[a], self.devices[b] = da, db
        path = None
        if need_path:
            try:
                path = s.path_code(da, db)
            except nvml.DeviceFailed as exc:
                notes.append(f"GPU{a}-GPU{b}: NVML could not tell the path ({exc.reason})")
        p2p: dict[tuple[str, int, int], str | None] = {}
        for cap in P2P_CAPABILITIES:
            for x, y, dx, dy in ((a, b, da, db), (b, a, db, da)):
                try:
                    p2p[(cap, x, y)] = s.p2p_status(dx, dy, cap)
                except nvml.DeviceFailed as exc:
                    notes.append(f"GPU{x}-GPU{y}: NVML could not tell P2P {cap} ({exc.reason})")
                    p2p[(cap, x, y)] = None
        return PairRead(path, p2p, tuple(s.warnings[before:]) + tuple(notes))


def _unread_warning(gpu: Gpu) -> str:
    if gpu.state == GPU_NOT_ACCESSIBLE:
        return (
            f"{gpu.label} is not accessible from here ({gpu.error}): NVML counts it but may not open it "
            "(a GPU outside this job's cgroup or container); it is left out"
        )
    if gpu.state == GPU_NOT_RESPONDING:
        return f"{gpu.label} is not responding: {gpu.error}; its details and links are unknown"
    return f"{gpu.label} did not answer NVML ({gpu.error}); its details and links are unknown"


class _LocalReader:
    """Reads in this process (test backends): no deadline."""

    def __init__(self, s: nvml.Session) -> None:
        self.served = Served(s)

    def header(self) -> tuple[Any, ...]:
        return self.served.answer(("header",))  # type: ignore[no-any-return]

    def gpu(self, index: int) -> GpuRead:
        return self.served.gpu(index)

    def pair(self, a: int, b: int, need_path: bool) -> PairRead:
        return self.served.pair(a, b, need_path)

    def close(self) -> None:
        pass


class _WorkerReader:
    """Reads in a worker process, each with a deadline (``nvml_worker``); ``NoAnswer`` when one passes."""

    def __init__(self, timeout_s: float) -> None:
        self.worker = nvml_worker.Worker(timeout_s)

    def header(self) -> tuple[Any, ...]:
        try:
            return self.worker.call(("header",), "the GPU count")  # type: ignore[no-any-return]
        except nvml_worker.NoAnswer as exc:
            started = self.worker.header
            if started is not None and started[0] == "unavailable":
                return started  # type: ignore[no-any-return]  # NVML said why it cannot start
            raise nvml.NvmlUnavailable(
                exc.what, "the driver may be hung; check `dmesg` for Xid errors", hung=True
            ) from None

    def gpu(self, index: int) -> GpuRead:
        return self.worker.call(("gpu", index), f"GPU{index}")  # type: ignore[no-any-return]

    def pair(self, a: int, b: int, need_path: bool) -> PairRead:
        return self.worker.call(("pair", a, b, need_path), f"GPU{a}-GPU{b}")  # type: ignore[no-any-return]

    def close(self) -> None:
        self.worker.close()


def _read_nvml(reader: _LocalReader | _WorkerReader) -> Topology:
    """The topology as NVML sees it; a GPU that fails, is refused or does not answer is marked and the
    rest is still read."""
    try:
        header = reader.header()
        if header[0] == "unavailable":
            _, message, hint, not_installed = header
            raise nvml.NvmlUnavailable(message, hint, not_installed=not_installed)
        _, count, driver, cuda = header
        if count == 0:
            raise UnavailableError("NVML sees no GPUs on this machine", NO_DRIVER_HINT)
        warnings: list[str] = []
        gpus: list[Gpu] = []
        ends: dict[int, list[nvml.NvlinkEnd]] = {}
        for i in range(count):
            try:
                read = reader.gpu(i)
            except nvml_worker.NoAnswer as exc:
                gpu = Gpu(index=i, error=exc.what, state=GPU_NOT_RESPONDING)
                read = GpuRead(gpu, (), (_unread_warning(gpu),))
            gpus.append(read.gpu)
            warnings += read.warnings
            if read.gpu.error is None:
                ends[i] = list(read.ends)
        peers, link_warnings, bridges = _nvlink_peers(gpus, ends)
        gpus = [replace(g, nvlink_bridge=bridges.get(g.index)) for g in gpus]
        warnings += link_warnings
        up = {(p.gpu, p.peer): p.links_up for p in peers}

        labels = tuple(g.label for g in gpus)
        cells: list[list[str | None]] = [[None] * count for _ in range(count)]
        p2p_cells = {
            cap: [["X" if a == b else None for b in range(count)] for a in range(count)]
            for cap in P2P_CAPABILITIES
        }
        for a in range(count):
            cells[a][a] = "X"
        for a in range(count):
            for b in range(a + 1, count):
                if a not in ends or b not in ends:
                    continue
                # The fewer of the two sides' counts: a pair runs at the links both ends see up.
                nvlinks = min(up.get((a, b), 0), up.get((b, a), 0))
                if nvlinks:
                    cells[a][b] = cells[b][a] = f"NV{nvlinks}"
                try:
                    pr = reader.pair(a, b, need_path=not nvlinks)
                except nvml_worker.NoAnswer as exc:
                    warnings.append(f"{exc.what}; its path and P2P status are unknown")
                    continue
                warnings += pr.warnings
                if not nvlinks:
                    cells[a][b] = cells[b][a] = pr.path
                for (cap, x, y), status in pr.p2p.items():
                    p2p_cells[cap][x][y] = status
    finally:
        reader.close()
    p2p = {cap: tuple(tuple(r) for r in m) for cap, m in p2p_cells.items()}
    return Topology(
        source="nvml",
        gpus=tuple(gpus),
        nics=(),  # NVML does not see network devices
        matrix=Matrix(labels, tuple(tuple(r) for r in cells)),
        warnings=tuple(warnings),
        nvlinks=tuple(peers),
        p2p=p2p,  # type: ignore[arg-type]  # cells are None where NVML could not tell
        driver_version=driver,
        cuda_driver_version=cuda,
        live=True,
    )


def _read_gpu(dev: nvml.Device) -> Gpu:
    """Every per-GPU field NVML has; ``DeviceFailed`` propagates so the caller marks the whole GPU."""
    cpus = dev.cpu_ids()
    nodes = dev.numa_nodes()
    gpu_numa = dev.gpu_numa_id()
    total_mib, used_mib = dev.memory_mib()
    compute = dev.processes("compute")
    mig = dev.mig_mode()
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
        mig_enabled=mig,
        mig_devices=dev.mig_device_uuids() if mig else (),
        fabric=read_fabric(dev),
    )


def read_fabric(dev: nvml.Device) -> GpuFabric | None:
    """The GPU's fabric registration, platform place and C2C mode (``None`` when the driver says none of
    them: a PCIe GPU, an older driver or bindings). A GPU that is gone raises ``DeviceFailed``."""
    info, platform, c2c = dev.fabric_info(), dev.platform_info(), dev.c2c_enabled()
    if not (info.ok or platform.ok or c2c.ok):
        return None
    out = GpuFabric(c2c=c2c.value if c2c.ok else None)
    if info.ok:
        f: nvml.FabricInfo = info.value
        out = replace(
            out,
            state=FABRIC_STATE_WORDS.get(f.state, f"state {f.state}"),
            status=f.status,
            cluster_uuid=f.cluster_uuid,
            clique_id=f.clique_id,
            health_mask=f.health_mask,
            health_summary=SUMMARY_WORDS.get(f.health_summary) if f.health_summary is not None else None,
            cliques=f.cliques,
        )
    if platform.ok:
        p: nvml.PlatformInfo = platform.value
        out = replace(
            out,
            chassis_serial=p.chassis_serial,
            # An HGX board answers with no chassis serial: its slot and tray are no place (nvidia-smi: N/A).
            slot=p.slot_number if p.chassis_serial else None,
            tray_index=p.tray_index if p.chassis_serial else None,
            host_id=p.host_id,
            peer_type=p.peer_type,
            module_id=p.module_id,
        )
    return replace(out, domain=gpu_domain(out))


def _nvlink_peers(
    gpus: list[Gpu], ends: dict[int, list[nvml.NvlinkEnd]]
) -> tuple[list[NvlinkPeer], list[str], dict[int, bool]]:
    """NVLinks per ordered GPU pair, up and down, from each GPU's own list of links; and per GPU with
    NVLinks whether any is active (``False``: no bridge).

    A link whose far end is another GPU counts for that pair. Links to an NVSwitch connect the GPU to
    every other GPU that also has NVSwitch links (all-to-all), so each such pair gets the GPU's whole
    switch link count, as nvidia-smi shows ``NV18`` for every pair of an HGX H100. Links to a device NVML
    does not name (a GPU outside this container, an NVSwitch on a driver without the remote-type query)
    are not guessed: they are reported in a warning. A GPU none of whose links is active and none of
    whose links names a far end is a PCIe card with NVLink but no bridge (A100/H100 PCIe, A40, RTX
    A6000): that is how it was built, not a fault, so it gets no "links down" warning. A link down beside
    active siblings, or all links down while they still name their far end (the bridged partner is
    lost), stays a problem.
    """
    by_bus = {g.pci_bus_id: g.index for g in gpus if g.pci_bus_id}
    direct: dict[tuple[int, int], list[int]] = {}
    switch: dict[int, list[int]] = {}
    warnings: list[str] = []
    bridges: dict[int, bool] = {}
    for a, links in sorted(ends.items()):
        if not links:
            continue
        unnamed = 0
        down = sum(1 for end in links if not end.up)
        # Connected: a link is up, or names its far end (a bridge whose partner is lost or down).
        bridges[a] = down < len(links) or any(end.remote_bus_id for end in links)
        if not bridges[a]:
            continue  # never connected: no bridge, so no pairs and no warning
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
            via = switch[a] if a in switch and b in switch else [0, 0]
            links_up += via[0]
            links_down += via[1]
            if links_up or links_down:
                peers.append(NvlinkPeer(a, b, links_up, links_down, via[0], via[1]))
    return peers, warnings, bridges


@nvml_worker.with_deadline(on_no_answer=None)
def gpu_processes() -> list[GpuProcess] | None:
    """Compute and graphics processes on every GPU; ``None`` when NVML is unavailable or does not answer
    within ``nvml_worker.LIST_TIMEOUT_S`` (it runs in the worker process).

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


@nvml_worker.with_deadline(on_no_answer=None)
def minor_numbers() -> dict[int, int] | None:
    """nvidia-smi GPU index -> minor number N of ``/dev/nvidiaN``; ``None`` when NVML is unavailable or
    does not answer within ``nvml_worker.LIST_TIMEOUT_S`` (it runs in the worker process).

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
