"""``gputopo topo``'s service: the link map of this machine, a saved output, a snapshot or a sample.

``run`` reads the machine through the one machine step (``services.machine``: the topology, and on the
live machine in text one health sample) and, for the terminal on the live machine, the network ports and
each GPU pair's PCIe path (``fabric.snapshot``). ``--json`` is the topology alone (it reads back equal
with ``--input``), with the node's facts on the live machine (``gputopo nodes`` reads them). ``samples``
is ``--list-samples``.

Nothing here imports typer, rich or the views: warnings go to ``Hooks.warn``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gputopo.services.hooks import Warn

if TYPE_CHECKING:
    from gputopo.model import Topology
    from gputopo.services.fabric import FabricResult


# What the service tells its caller while it reads: ``warn`` (a line for stderr).
Hooks = Warn


@dataclass(frozen=True, kw_only=True)
class Options:
    """What ``gputopo topo`` was asked: ``input`` (``None``: this machine), each live NVML read within
    ``nvml_timeout_s``, ``no_health`` (neither the health sample nor the ports and PCIe paths),
    ``json_out`` (the snapshot: no health, no fabric, the node's facts when live)."""

    input: str | None = None
    nvml_timeout_s: float | None = None
    no_health: bool = False
    json_out: bool = False


@dataclass(frozen=True)
class TopoReport:
    """The topology (with the node's facts in a live ``--json``), the health section and the fabric
    reading (live text only, else ``None``); ``document()`` is the JSON snapshot."""

    topology: Topology
    health: dict[str, Any] | None = None
    fabric: FabricResult | None = None
    exit_code: int = 0

    def with_files(self, paths: dict[str, str]) -> TopoReport:
        return self  # topo writes no report files

    def document(self) -> dict[str, Any]:
        """The snapshot (``topology.snapshot``; docs/topo.md), built here and nowhere else."""
        from gputopo.topology import snapshot

        return snapshot.to_dict(self.topology)


@dataclass(frozen=True)
class SamplesReport:
    """``--list-samples``: each built-in sample machine's name and one-line summary."""

    samples: tuple[tuple[str, str], ...]
    exit_code: int = 0

    def with_files(self, paths: dict[str, str]) -> SamplesReport:
        return self

    def document(self) -> dict[str, Any]:
        return {"samples": [{"name": name, "summary": summary} for name, summary in self.samples]}

    def lines(self) -> list[str]:
        """As the terminal shows them: ``sample:NAME`` (what ``--input`` takes), then the summary."""
        return [f"sample:{name:<26} {summary}" for name, summary in self.samples]


def samples() -> SamplesReport:
    """The built-in sample machines (``--input sample:NAME``)."""
    from gputopo.topology import samples as built_in

    return SamplesReport(tuple((s.name, s.summary) for s in built_in.SAMPLES.values()))


def run(options: Options, hooks: Hooks | None = None) -> TopoReport:
    """Read the machine once (the topology's warnings said as soon as it is read) and what the chosen
    output shows of it."""
    from gputopo.services import machine as step

    hooks = hooks or Hooks()

    def said(topo: Topology) -> None:
        for line in dict.fromkeys(topo.warnings):
            hooks.warn(line)

    live = options.input is None
    # Health only where it is this machine's, and only for the terminal: the JSON snapshot stays the
    # topology alone, so it reads back equal (`gputopo check --json` has the health document).
    wants_health = live and not options.no_health and not options.json_out
    got = step.read(
        step.MachineOptions(
            input=options.input,
            nvml_timeout_s=options.nvml_timeout_s,
            health=wants_health,
            health_source=step.TOPO_HEALTH_SOURCE,
            preset=False,  # topo shows every GPU, whatever a scheduler allows
        ),
        # The check state's problem, if any, is shown in the health block's "not checked" lines.
        step.Hooks(on_topology=said),
    )
    topo = got.topology
    if options.json_out:
        return TopoReport(_with_node_facts(topo, hooks) if live else topo)
    if not wants_health:
        return TopoReport(topo)
    from gputopo.services import fabric

    # The network ports and each GPU pair's PCIe path (ACS), from sysfs (docs/topo.md).
    return TopoReport(topo, got.health.section(), fabric.snapshot(step.bus_ids(topo)))


def _with_node_facts(topo: Topology, hooks: Hooks) -> Topology:
    """The live snapshot as the node's facts (``gputopo nodes``): its name, its last fresh check, and
    ``accept``'s verdict; a state file that could not be used is said."""
    from gputopo.system.machine import node_facts

    facts: dict[str, Any] = node_facts(topo, topo.warnings)
    for line in dict.fromkeys(facts.get("warnings", ())[len(topo.warnings) :]):
        hooks.warn(line)
    return replace(topo, **facts)
