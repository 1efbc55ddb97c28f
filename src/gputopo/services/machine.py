"""The machine step: what a command reads of the machine before it chooses GPUs, read once and handed
down. ``recommend``, ``run`` and ``topo`` call it today; ``probe``, ``doctor`` and ``accept`` are meant
to, so the rules below exist here and nowhere else above ``health/``.

What it reads, once each (``read``):

- **the topology**: ``--input`` (a saved ``topo -m``, a JSON snapshot, NCCL's XML, ``sample:NAME``) or
  this machine, live (``system.machine.load_topology``);
- **one health sample** of the live machine (``system.machine.read_live_health``: one NVML sample judged
  by its states, with the last fresh ``gputopo check``'s problems added); never for ``--input``: that file
  is not this machine;
- **the PCIe path of every GPU pair** (ACS redirection, from sysfs), when asked (``pcie_paths``).

What it works out from those, once: the GPUs with a health problem, **the drain rule** (the GPUs whose
driver asks to keep peer-to-peer work off them, NVML recovery action DRAIN_P2P: ``no_p2p``; its one
caller outside ``health/judge.py``), and the preset ``CUDA_VISIBLE_DEVICES`` narrowing (the GPUs a
scheduler's allocation allows, resolved as CUDA numbers them).

What it hands down: a frozen ``Machine`` (topology, health, preset, redirected pairs). Warnings (a preset
that does not apply, a check state that could not be used) go to ``Hooks.warn`` as they are found.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gputopo.model import Topology
from gputopo.services.hooks import Warn, ignore

if TYPE_CHECKING:
    from gputopo.findings import Finding
    from gputopo.health.judge import Judgement
    from gputopo.probe.plan.identity import GpuIdentity

# What a command says about the health it judged by (JSON ``health.source``).
LIVE_HEALTH_SOURCE = (
    "one live NVML sample: states judged (ECC, row remaps, clocks, PCIe width, recovery action); "
    "counters' rise not sampled (`gputopo check` samples it)"
)
TOPO_HEALTH_SOURCE = (
    "one live NVML sample: states judged; counters' rise not sampled (`gputopo check` samples it)"
)

# (GPU index, GPU index, the bridges where ACS redirects their peer traffic)
Redirected = tuple[tuple[int, int, tuple[str, ...]], ...]
# (GPU index, the finding's words), sorted by GPU
GpuWords = tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class Hooks(Warn):
    """What the step tells its caller while it reads: ``warn`` (a line for stderr), and ``on_topology``,
    called with the topology as soon as it is read, before anything else is (a caller's check that
    refuses it then stops the step before the health read)."""

    on_topology: Callable[[Topology], None] = ignore


@dataclass(frozen=True, kw_only=True)
class MachineOptions:
    """What to read: ``input`` (``None``: this machine), each live NVML read within ``nvml_timeout_s``
    (``None``: ``model.DEFAULT_NVML_TIMEOUT_S``); ``health``: take the health sample (live only);
    ``preset``: narrow to a preset ``CUDA_VISIBLE_DEVICES`` (``False``: ``--ignore-visible-devices``);
    ``pcie_paths``: read each GPU pair's PCIe path (live only); ``health_gpus``: sample only these GPUs
    (a probe's sets; ``None``: every GPU)."""

    input: str | None = None
    nvml_timeout_s: float | None = None
    health: bool = True
    health_source: str = LIVE_HEALTH_SOURCE  # what the health section says it judged by
    health_gpus: tuple[int, ...] | None = None
    preset: bool = True
    pcie_paths: bool = False

    @property
    def live(self) -> bool:
        return self.input is None


@dataclass(frozen=True)
class Health:
    """The health read (``judgement`` ``None``: not read, and ``source`` says why)."""

    source: str
    judgement: Judgement | None = None

    @property
    def unhealthy(self) -> GpuWords:
        """GPU -> its first problem, for the GPUs a set leaves out."""
        return tuple(sorted(self.judgement.unhealthy_gpus().items())) if self.judgement else ()

    @property
    def no_p2p(self) -> GpuWords:
        """The drain rule: GPU -> the finding, for each GPU whose driver asks to keep P2P work off it."""
        return tuple(sorted(drained(self.judgement.findings).items())) if self.judgement else ()

    def section(self) -> dict[str, object]:
        """The ``health`` section of a command's JSON: whether it was read, how, and what it found."""
        if self.judgement is None:
            return {"checked": False, "source": self.source, "findings": [], "not_checked": []}
        unread = any(n.what == "health" for n in self.judgement.not_checked)
        return {"checked": not unread, "source": self.source, **self.judgement.to_json()}


@dataclass(frozen=True)
class Preset:
    """A preset ``CUDA_VISIBLE_DEVICES`` as this machine's GPU indices: those it allows (or names, when
    they cannot be used for their own reason) and the reason every other GPU is left out."""

    allowed: tuple[int, ...]
    outside: str


@dataclass(frozen=True)
class Machine:
    """What the step read, handed to whatever needs it."""

    topology: Topology
    live: bool  # read from this machine (not ``--input``)
    health: Health
    preset: Preset | None = None
    redirected: Redirected = ()


def read(options: MachineOptions, hooks: Hooks | None = None) -> Machine:
    """Read the machine once, as ``options`` asks (see the module's docstring)."""
    hooks = hooks or Hooks()
    topo = load_topology(options.input, options.nvml_timeout_s)
    hooks.on_topology(topo)
    preset = preset_gpus(topo, options.live, hooks.warn) if options.preset else None
    health = read_health(options, hooks.warn)
    redirected: Redirected = ()
    if options.pcie_paths and options.live:
        redirected = redirected_pairs(topo)
    return Machine(topo, options.live, health, preset, redirected)


def load_topology(spec: str | None, nvml_timeout_s: float | None = None) -> Topology:
    """The topology ``--input`` names, or this machine's (``gputopo.system.machine.load_topology``)."""
    from gputopo.system.machine import load_topology as load

    return load(spec, nvml_timeout_s=nvml_timeout_s)


def read_health(options: MachineOptions, warn: Callable[[str], None]) -> Health:
    """One live health sample (``options.health`` and live), else the reason there is none. A check state
    that could not be used (corrupt, a newer gputopo's, a link) is said through ``warn`` too, not only in
    the JSON's ``health.not_checked``: the last check's verdict is missing from what is left out."""
    if not options.live:
        return Health(f"not checked (--input {options.input}: not this machine)")
    if not options.health:
        return Health("not checked")
    from gputopo.health.state import LAST_CHECK_WHAT
    from gputopo.system.machine import read_live_health

    gpus = list(options.health_gpus) if options.health_gpus is not None else None
    judgement = read_live_health(options.nvml_timeout_s, gpus=gpus)
    for n in judgement.not_checked:
        if n.what == LAST_CHECK_WHAT:
            warn(n.why)
    return Health(options.health_source, judgement)


def drained(findings: Iterable[Finding]) -> dict[int, str]:
    """The drain rule over any findings (one sample's, a check's window): GPU -> the finding's words, for
    each GPU whose driver asks to keep peer-to-peer work off it; no set of two or more GPUs may hold one."""
    from gputopo.health.judge import p2p_drained

    return p2p_drained(findings)


def preset_gpus(topo: Topology, live: bool, warn: Callable[[str], None]) -> Preset | None:
    """The GPUs a preset ``CUDA_VISIBLE_DEVICES`` allows, as ``probe`` reads it (``probe.plan.identity``:
    UUIDs, MIG ids, integers resolved by CUDA's own answer); ``None`` when nothing is preset, or for a
    topology read from a file (the preset describes this machine, not that one: said through ``warn``)."""
    preset = os.environ.get("CUDA_VISIBLE_DEVICES")
    if preset is None:
        return None
    if not live:
        warn(f"CUDA_VISIBLE_DEVICES={preset} describes this machine, not {topo.source}: not applied")
        return None
    from gputopo.probe.plan.identity import allowed_gpus
    from gputopo.probe.pool.devices import cuda_numbering

    order = os.environ.get("CUDA_DEVICE_ORDER")
    bus_ids, why = cuda_numbering(preset, order)
    allowed = allowed_gpus(_identities(topo), preset, order, bus_ids, why)
    if allowed.note:
        warn(allowed.note)
    # A GPU the preset names but that cannot be used keeps its own reason (failing, MIG...), not this one.
    outside = f"not in CUDA_VISIBLE_DEVICES={preset}"
    named = {*allowed.indices, *(i for i, why in allowed.why_not.items() if why != outside)}
    return Preset(
        tuple(sorted(named)),
        f"{outside} (a scheduler's allocation? --ignore-visible-devices chooses among all)",
    )


def _identities(topo: Topology) -> list[GpuIdentity]:
    from gputopo.probe.plan.identity import GpuIdentity

    return [
        GpuIdentity(
            index=g.index,
            uuid=g.uuid,
            bus_id=g.pci_bus_id,
            name=g.name,
            unavailable=g.unavailable_reason,
            mig_enabled=bool(g.mig_enabled),
            mig_devices=g.mig_devices,
        )
        for g in topo.gpus
    ]


def redirected_pairs(topo: Topology) -> Redirected:
    """The GPU pairs whose PCIe path crosses a bridge where ACS redirects peer traffic (sysfs, one read
    of every pair's path; docs/topo.md); none for a topology not read from this machine (a sample, a
    file)."""
    if not topo.live:
        return ()
    from gputopo.services import fabric

    return fabric.redirected(bus_ids(topo))


def bus_ids(topo: Topology) -> Mapping[int, str]:
    """GPU index -> PCI bus id, for the GPUs that have one (what the fabric reads are keyed by)."""
    from gputopo.services import fabric

    return fabric.gpu_bus_ids([(g.index, g.pci_bus_id) for g in topo.gpus])
