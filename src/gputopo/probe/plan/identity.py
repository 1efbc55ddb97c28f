"""One rule for naming GPUs (pure): nvidia-smi/NVML indices everywhere, UUIDs for the ranks.

``--gpus``, ``--exclude``, reports and verdicts use the index nvidia-smi prints, which is NVML's. CUDA's
own numbering is not used anywhere: it differs from NVML's by default (``CUDA_DEVICE_ORDER`` defaults to
FASTEST_FIRST), drifts when CUDA skips a GPU (MIG on, no permission, too old), and is relative to any
``CUDA_VISIBLE_DEVICES`` already set. Ranks (and DataParallel's process) get ``CUDA_VISIBLE_DEVICES`` as
the GPUs' UUIDs, which mean the same GPU whatever the order or the preset; CUDA numbers the devices in
the order the list gives them, so local rank ``r`` drives the set's ``r``-th GPU, and checks it
(``check_rank_device``: the PCI bus id CUDA reports against the one NVML gave).

A ``CUDA_VISIBLE_DEVICES`` already set when gputopo starts (Slurm, containers) limits which GPUs may be
probed. Its entries may be UUIDs (``GPU-...``, or a unique prefix, as CUDA accepts), MIG device ids
(``MIG-...``, or the older ``MIG-GPU-<uuid>/<gi>/<ci>``: MIG devices, which NCCL cannot use, skipped),
or integers, which are CUDA indices.

Integers are resolved as CUDA resolves them: a short child process with the preset applied asks CUDA for
the PCI bus id of each device it numbers (``pool.launch.ask_cuda_bus_ids``, which runs
``ranks.cuda.visible_bus_ids``), and the entry at position ``p`` of the list is CUDA's device ``p``
(CUDA enumerates the visible devices in the list's order), matched to NVML's GPU by bus id. Only CUDA
knows its numbering: it skips GPUs it cannot drive (a display card older than the CUDA release supports,
listed by NVML all the same), orders by ``CUDA_DEVICE_ORDER``, and counts MIG devices its own way. When
CUDA cannot answer (no torch, no CUDA, a timeout), integers fall back to NVML's GPUs in PCI bus order,
CUDA's order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and also the default order on a machine of identical
GPUs, and the probe says so (``Allowed.note``). Where that fallback could be wrong in a way visible from
NVML (mixed GPU models under the default order, MIG-enabled GPUs, a GPU NVML cannot read), integers are
refused with a request for UUIDs rather than guessed.

Source: the CUDA Programming Guide, "CUDA Environment Variables" (CUDA_VISIBLE_DEVICES takes integer
indices, UUIDs as ``nvidia-smi -L`` prints them or a unique prefix, and ``MIG-...`` ids; the devices are
enumerated in the order of the list; an invalid entry hides every entry after it). Its newer editions
call the integers nvidia-smi's ordinals, while CUDA itself numbers by ``CUDA_DEVICE_ORDER``; the refusal
above keeps gputopo right under either reading.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gputopo.errors import UsageError

_LEGACY_MIG = re.compile(r"^MIG-GPU-[0-9A-Fa-f-]+/\d+/\d+$")


@dataclass(frozen=True)
class GpuIdentity:
    """One GPU as NVML names it: index, UUID, PCI bus id, and why it cannot be probed (``None``: it can)."""

    index: int
    uuid: str | None
    bus_id: str | None
    name: str | None = None
    unavailable: str | None = None
    mig_enabled: bool = False
    mig_devices: tuple[str, ...] = ()
    # NVML's CPUs near the GPU (``nvidia-smi topo -m``'s "CPU Affinity", e.g. ``0-31,64-95``): the per-GPU
    # check's host copies run there, so its pinned buffers sit on the GPU's own NUMA node.
    cpu_affinity: str | None = None


@dataclass(frozen=True)
class Allowed:
    """The GPUs a probe may use: ``indices`` (NVML, ascending), and ``why_not`` for every other GPU."""

    indices: tuple[int, ...]
    why_not: dict[int, str]
    preset: str | None
    # How integer entries were resolved, when it was not by CUDA's own answer.
    note: str | None = None


def parse_visible_devices(text: str | None) -> tuple[str, ...] | None:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value; ``None`` when it is not set.

    An empty value is an empty tuple (CUDA then sees no device). CUDA stops reading at the first invalid
    entry; so do we, at the first empty one (``"0,,1"`` is ``("0",)``).
    """
    if text is None:
        return None
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            break
        out.append(part)
    return tuple(out)


def allowed_gpus(
    gpus: Sequence[GpuIdentity],
    preset: str | None,
    device_order: str | None = None,
    cuda_bus_ids: Sequence[str] | None = None,
    cuda_why: str | None = None,
) -> Allowed:
    """Which GPUs may be probed under ``CUDA_VISIBLE_DEVICES=preset`` (``None``: not set).

    ``cuda_bus_ids`` is CUDA's answer under that preset: the PCI bus id of its device 0, 1, ...; ``None``
    when CUDA could not be asked (``cuda_why`` says why), and integer entries then fall back to NVML's
    numbering (see the module docstring).

    ``UsageError`` (exit 2) for a preset entry that names no GPU here, or integers that cannot be
    resolved without guessing (see the module docstring).
    """
    entries = parse_visible_devices(preset)
    why_not: dict[int, str] = {g.index: g.unavailable for g in gpus if g.unavailable}
    note = None
    if entries is None:
        named = {g.index for g in gpus}
    else:
        named = set()
        for position, entry in enumerate(entries):
            if entry.isdigit() and cuda_bus_ids is not None:
                gpu = _by_cuda(entry, position, gpus, cuda_bus_ids, preset or "")
            else:
                gpu = _resolve(entry, gpus, preset or "", device_order)
            if gpu is not None:
                named.add(gpu.index)
        if cuda_bus_ids is None and any(e.isdigit() for e in entries):
            note = (
                f"CUDA could not be asked how it numbers its devices ({cuda_why or 'not asked'}): the "
                f"integers in CUDA_VISIBLE_DEVICES={preset} were read as NVML's GPUs in PCI bus order"
            )
        for g in gpus:
            if g.index not in named and g.index not in why_not:
                why_not[g.index] = f"not in CUDA_VISIBLE_DEVICES={preset}"
    indices = tuple(sorted(i for i in named if i not in why_not))
    return Allowed(indices, why_not, preset, note)


def _by_cuda(
    entry: str, position: int, gpus: Sequence[GpuIdentity], cuda_bus_ids: Sequence[str], preset: str
) -> GpuIdentity:
    """The NVML GPU that CUDA's device ``position`` is (the list's ``position``-th entry), by PCI bus id."""
    where = f"CUDA_VISIBLE_DEVICES={preset}"
    hint = "set CUDA_VISIBLE_DEVICES to GPU UUIDs (`nvidia-smi -L` lists them), or unset it"
    if position >= len(cuda_bus_ids):
        # CUDA stops at the first entry it cannot use: this one, or one before it.
        raise UsageError(
            f"{where}: CUDA has no device for entry {entry!r} (it sees {len(cuda_bus_ids)} under this list)",
            hint,
        )
    bus = _bus_key(cuda_bus_ids[position])
    for g in gpus:
        if g.bus_id is not None and _bus_key(g.bus_id) == bus:
            return g
    raise UsageError(
        f"{where}: CUDA device {entry} is at PCI {cuda_bus_ids[position]}, which NVML does not list", hint
    )


def _bus_key(bus_id: str) -> str:
    """A PCI address compared across spellings: NVML's ``00000000:3B:00.0`` and a 4-digit domain alike."""
    text = bus_id.strip().upper()
    parts = text.split(":")
    if len(parts) == 3 and all(c in "0123456789ABCDEF" for c in parts[0]) and parts[0]:
        return f"{int(parts[0], 16):08X}:{parts[1]}:{parts[2]}"
    return text


def _resolve(entry: str, gpus: Sequence[GpuIdentity], preset: str, order: str | None) -> GpuIdentity | None:
    where = f"CUDA_VISIBLE_DEVICES={preset}"
    hint = "set CUDA_VISIBLE_DEVICES to GPU UUIDs (`nvidia-smi -L` lists them), or unset it"
    if _LEGACY_MIG.match(entry):
        # The pre-R470 spelling of a MIG device, ``MIG-GPU-<GPU uuid>/<GPU instance>/<compute instance>``
        # (NVIDIA MIG User Guide, "MIG Device Names", device enumeration; R470+ drivers print
        # ``MIG-<uuid>``): a MIG device too, so nothing to probe, and no reason to fail the whole probe.
        return None
    if entry.startswith("MIG-"):
        # A MIG device: its GPU is left out anyway (MIG enabled); the entry names nothing to probe.
        for g in gpus:
            if any(m == entry or m.startswith(entry) for m in g.mig_devices):
                return None
        raise UsageError(f"{where}: no MIG device {entry} on this machine", hint)
    if entry.startswith("GPU-"):
        hits = [g for g in gpus if g.uuid and g.uuid.startswith(entry)]
        if len(hits) != 1:
            what = "no GPU" if not hits else "more than one GPU"
            raise UsageError(f"{where}: {what} with UUID {entry} on this machine", hint)
        return hits[0]
    if not entry.isdigit():
        raise UsageError(f"{where}: {entry!r} is not a GPU index, UUID or MIG id", hint)
    if any(g.mig_enabled for g in gpus):
        raise UsageError(f"{where}: CUDA indices are ambiguous on a machine with MIG-enabled GPUs", hint)
    names = {g.name for g in gpus}
    if (order or "FASTEST_FIRST") != "PCI_BUS_ID" and len(names) > 1:
        raise UsageError(
            f"{where}: with mixed GPU models, CUDA's default order (fastest first) is not nvidia-smi's",
            hint + ", or set CUDA_DEVICE_ORDER=PCI_BUS_ID so the indices are nvidia-smi's",
        )
    # CUDA numbers the GPUs it can open; a GPU NVML may not open (no permission, a cgroup) is not among
    # them. Whether CUDA counts a lost or hung GPU is not knowable from here: don't guess.
    unsure = [
        g.index for g in gpus if g.uuid is None and not (g.unavailable or "").startswith("not accessible")
    ]
    if unsure:
        raise UsageError(
            f"{where}: CUDA's numbering is uncertain while GPU{','.join(map(str, unsure))} cannot be read",
            hint,
        )
    visible = sorted((g for g in gpus if g.uuid is not None), key=lambda g: (g.bus_id or "", g.index))
    k = int(entry)
    if k >= len(visible):
        raise UsageError(f"{where}: there is no CUDA device {k} (CUDA sees {len(visible)})", hint)
    return visible[k]


def check_requested(sets: Iterable[Sequence[int]], allowed: Allowed, option: str = "--gpus") -> None:
    """``UsageError`` (exit 2) naming the allowed GPUs when a set asks for any other."""
    for s in sets:
        for g in s:
            if g in allowed.indices:
                continue
            why = allowed.why_not.get(g, "no such GPU on this machine")
            raise UsageError(
                f"{option}: GPU{g} cannot be probed: {why}",
                f"the GPUs you may probe are {describe(allowed.indices)} (nvidia-smi numbering)",
            )


def describe(indices: Sequence[int]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0,1,2,5"``; ``"none"`` when empty."""
    return ",".join(str(i) for i in indices) if indices else "none"


def visible_devices(gpus: Sequence[GpuIdentity], indices: Sequence[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ranks on ``indices``: their UUIDs, in that order."""
    by_index = {g.index: g for g in gpus}
    uuids = []
    for i in indices:
        uuid = by_index[i].uuid if i in by_index else None
        if uuid is None:
            raise ValueError(f"GPU{i} has no UUID")
        uuids.append(uuid)
    return ",".join(uuids)


def cuda_bus_id(domain: int, bus: int, device: int) -> str:
    """NVML's spelling of the PCI address CUDA reports (``cudaDeviceProp.pciDomainID`` etc.)."""
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def check_rank_device(local_rank: int, expected_index: int, expected_bus: str | None, got_bus: str) -> None:
    """Raise ``RuntimeError`` (ending the rank, and so the launch) when CUDA's device for this rank is not
    the GPU NVML named: a mismatch means the ranks would measure other GPUs than the report names."""
    if expected_bus is None:
        return
    if expected_bus.upper() != got_bus.upper():
        raise RuntimeError(
            f"GPU identity mismatch: local rank {local_rank} should drive GPU{expected_index} "
            f"(PCI {expected_bus}) but CUDA gave it the device at PCI {got_bus}"
        )
