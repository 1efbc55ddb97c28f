"""Which devices a probe can use here: torch present or not, GPUs as NVML and the topology see them
(CUDA's numbering included), or CPU ranks standing in. The one place that asks the machine; it imports
torch lazily so the rest of gputopo never pays for it. What it finds (``DeviceInventory``) goes to the
pure ``plan.config.build_config``."""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

from gputopo.errors import UnavailableError
from gputopo.probe.plan.config import CPU_STAND_INS, DeviceInventory, describe_indices
from gputopo.probe.plan.identity import GpuIdentity, allowed_gpus

if TYPE_CHECKING:
    from gputopo.model import Topology

INSTALL_HINT = "pip install 'gputopo[probe]'  (it brings torch and torchvision)"


def torch_installed() -> bool:
    """True when torch and torchvision can be imported (checked without importing them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "torchvision"))


def require_torch() -> None:
    """Raise ``UnavailableError`` (exit 3) with the install hint when torch is missing."""
    if not torch_installed():
        raise UnavailableError(
            "gputopo probe needs torch and torchvision, which are not installed", INSTALL_HINT
        )


def detect_devices(
    requested: str | None,
    need_cuda: bool = True,
    nvml_timeout_s: float | None = None,
    topology: Topology | None = None,
) -> DeviceInventory:
    """What can be probed. ``requested`` is ``"cuda"``, ``"cpu"`` or ``None`` (CUDA if any).

    GPUs come from NVML, numbered as nvidia-smi numbers them and narrowed by a preset
    ``CUDA_VISIBLE_DEVICES`` (``identity``); ``need_cuda`` also asks torch whether it can drive them
    (``probe --dry-run`` does not: it starts neither torch nor CUDA). ``topology``: this machine as the
    caller already read it live (doctor), so NVML is not read again.
    """
    if requested == "cpu":
        require_torch()
        return DeviceInventory("cpu", tuple(range(CPU_STAND_INS)), note="CPU ranks stand in for GPUs")
    inventory = nvml_inventory(nvml_timeout_s=nvml_timeout_s, ask_cuda=need_cuda, topology=topology)
    if need_cuda:
        require_torch()
        from gputopo.probe.ranks.cuda import cuda_unavailable

        why = cuda_unavailable()
        if why is not None:
            raise UnavailableError(f"--device cuda: {why}", _CPU_HINT)
    return inventory


_CPU_HINT = "run on CPU ranks with `--device cpu --gpus 0,1` (the same checks with gloo)"


def nvml_inventory(
    preset: str | None = None,
    device_order: str | None = None,
    nvml_timeout_s: float | None = None,
    ask_cuda: bool = True,
    topology: Topology | None = None,
) -> DeviceInventory:
    """The GPUs NVML lists, under the identity rule; ``preset`` and ``device_order`` default to this
    process's ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``. Integer entries of the preset are
    resolved by CUDA's own answer (a short child; ``ask_cuda=False``, as for ``--dry-run``, starts no
    CUDA and falls back to NVML's numbering, saying so)."""
    from gputopo.system.machine import load_topology

    if preset is None:
        preset = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device_order is None:
        device_order = os.environ.get("CUDA_DEVICE_ORDER")
    try:
        topo = topology if topology is not None else load_topology(None, nvml_timeout_s=nvml_timeout_s)
    except UnavailableError as exc:
        raise UnavailableError(f"--device cuda: {exc.message}", _CPU_HINT) from None
    identities = tuple(
        GpuIdentity(
            index=g.index,
            uuid=g.uuid,
            bus_id=g.pci_bus_id,
            name=g.name,
            unavailable=g.unavailable_reason or (None if g.uuid else "NVML gives no UUID for it"),
            mig_enabled=bool(g.mig_enabled),
            mig_devices=g.mig_devices,
            cpu_affinity=g.cpu_affinity,
        )
        for g in topo.gpus
    )
    bus_ids, why = cuda_numbering(preset, device_order, ask_cuda)
    allowed = allowed_gpus(identities, preset, device_order, bus_ids, why)
    uuids = {g.index: g.uuid or "" for g in identities}
    note = (
        f"CUDA_VISIBLE_DEVICES={preset} allows GPUs {describe_indices(allowed.indices)}" if preset else None
    )
    if note and allowed.note:
        note = f"{note}; {allowed.note}"
    return DeviceInventory(
        "cuda",
        allowed.indices,
        tuple(uuids[i] for i in allowed.indices),
        note=note,
        identities=identities,
        why_not=allowed.why_not,
    )


def cuda_numbering(
    preset: str | None, device_order: str | None, ask: bool = True
) -> tuple[tuple[str, ...] | None, str | None]:
    """CUDA's bus id per device under ``CUDA_VISIBLE_DEVICES=preset``, asked only when the preset holds an
    integer (UUIDs need no numbering); ``(None, why)`` when CUDA is not or cannot be asked."""
    from gputopo.probe.plan.identity import parse_visible_devices

    entries = parse_visible_devices(preset)
    if not entries or not any(e.isdigit() for e in entries):
        return None, None
    if not ask:
        return None, "--dry-run starts no CUDA"
    if not torch_installed():
        return None, "torch is not installed"
    from gputopo.probe.pool.launch import ask_cuda_bus_ids

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": preset or ""}
    if device_order is not None:
        env["CUDA_DEVICE_ORDER"] = device_order
    bus_ids, why = ask_cuda_bus_ids(env)
    return bus_ids, why or None
