"""Typer options that more than one command shares (recommend and run choose a set by the same rules),
and the one place that turns them into constraints."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from gputopo.cli.common import read_json_file
from gputopo.errors import UsageError
from gputopo.gpulist import parse_gpu_list

if TYPE_CHECKING:
    from gputopo.health.judge import Judgement
    from gputopo.model import Topology
    from gputopo.recommend import Constraints


DEFAULT_MAX_USED_MIB = 1024  # mirrors gputopo.recommend.DEFAULT_MAX_USED_MIB (kept here for a fast --help)


EXCLUDE_OPTION = typer.Option(
    None, "--exclude", metavar="LIST", help="GPUs to leave out, e.g. 3,4 (see docs/output.md: GPU lists)."
)


ALLOW_BUSY_OPTION = typer.Option(False, "--allow-busy", help="Count GPUs in use by other processes.")


MAX_USED_OPTION = typer.Option(
    DEFAULT_MAX_USED_MIB, "--max-used-mib", help="A GPU with more memory in use than this is busy."
)


ALLOW_UNHEALTHY_OPTION = typer.Option(
    False,
    "--allow-unhealthy",
    help="Count GPUs with a health problem (uncorrectable ECC, pending row remap, slowdown, ...) in.",
)


REPORT_OPTION = typer.Option(
    None,
    "--from-report",
    metavar="PATH",
    help="A probe or doctor report (JSON) from this machine: keep failing pairs apart, use measurements.",
)


FORCE_REPORT_OPTION = typer.Option(
    False,
    "--force-report",
    help="Use --from-report even when it was written on another machine or on CPU stand-ins.",
)


IGNORE_VISIBLE_OPTION = typer.Option(
    False,
    "--ignore-visible-devices",
    help="Choose among every GPU here, not only those a preset CUDA_VISIBLE_DEVICES (a scheduler's "
    "allocation) allows.",
)


def within_preset(
    constraints: Constraints, topo: Topology, ignore: bool, from_input: bool, warn: Any
) -> Constraints:
    """``constraints`` narrowed to the GPUs a preset ``CUDA_VISIBLE_DEVICES`` allows, as ``probe`` does
    (``probe.plan.identity``: UUIDs, MIG ids, integers resolved by CUDA's own answer); unchanged when
    nothing is preset, with ``--ignore-visible-devices``, or for a topology read from a file (the preset
    describes this machine, not that one)."""
    preset = os.environ.get("CUDA_VISIBLE_DEVICES")
    if preset is None or ignore:
        return constraints
    if from_input:
        warn(f"CUDA_VISIBLE_DEVICES={preset} describes this machine, not {topo.source}: not applied")
        return constraints
    from gputopo.probe.plan.identity import GpuIdentity, allowed_gpus
    from gputopo.probe.pool.devices import cuda_numbering

    gpus = [
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
    order = os.environ.get("CUDA_DEVICE_ORDER")
    bus_ids, why = cuda_numbering(preset, order)
    allowed = allowed_gpus(gpus, preset, order, bus_ids, why)
    if allowed.note:
        warn(allowed.note)
    # A GPU the preset names but that cannot be used keeps its own reason (failing, MIG...), not this one.
    outside = f"not in CUDA_VISIBLE_DEVICES={preset}"
    named = {*allowed.indices, *(i for i, why in allowed.why_not.items() if why != outside)}
    return replace(
        constraints,
        allowed=tuple(sorted(named)),
        outside_allowed=f"not in CUDA_VISIBLE_DEVICES={preset} (a scheduler's allocation? "
        "--ignore-visible-devices chooses among all)",
    )


def set_constraints(
    *,
    n: int,
    exclude: str | None,
    allow_busy: bool,
    max_used_mib: int,
    from_report: Path | None,
    allow_unhealthy: bool,
    **more: Any,
) -> Constraints:
    """What ``recommend`` and ``run`` choose a set by, from their shared options: the keyword-only
    ``Constraints``, each option checked here once (``UsageError``, exit 2) before the machine is read."""
    from gputopo.recommend import Constraints, evidence_from_report

    if max_used_mib < 0:
        raise UsageError(f"--max-used-mib {max_used_mib}: must be 0 or more", "e.g. --max-used-mib 1024")
    evidence = None
    if from_report is not None:
        label = f"--from-report {from_report}"
        doc = read_json_file(
            from_report, label, "give the .json report `gputopo probe` or `doctor` wrote under reports/"
        )
        evidence = evidence_from_report(doc, str(from_report))
    return Constraints(
        n=n,
        exclude=parse_gpu_list(exclude, "--exclude") if exclude else (),
        allow_busy=allow_busy,
        max_used_mib=max_used_mib,
        evidence=evidence,
        allow_unhealthy=allow_unhealthy,
        **more,
    )


def check_report_machine(
    constraints: Constraints, topo: Topology, live: bool, force: bool, warn: Any
) -> None:
    """Refuse ``--from-report`` written on another machine (or on CPU stand-ins, for a live one): its
    GPU numbers would point at other GPUs here. ``--force-report`` turns the refusal into a warning."""
    from gputopo.topology.identity import report_mismatch

    evidence = constraints.evidence
    if evidence is None:
        return
    why = report_mismatch(evidence.machine, evidence.device, topo, live)
    if why is None:
        return
    if force:
        warn(f"--from-report {evidence.source}: {why}; used anyway (--force-report)")
        return
    raise UsageError(
        f"--from-report {evidence.source}: not this machine's report: {why}",
        "probe this machine (gputopo doctor, or gputopo probe), or add --force-report to use it anyway",
    )


# What recommend and run say about the health they judged by (JSON ``health.source``).
LIVE_HEALTH_SOURCE = (
    "one live NVML sample: states judged (ECC, row remaps, clocks, PCIe width, recovery action); "
    "counters' rise not sampled (`gputopo check` samples it)"
)

TOPO_HEALTH_SOURCE = (
    "one live NVML sample: states judged; counters' rise not sampled (`gputopo check` samples it)"
)


def with_health(
    constraints: Constraints, input: str | None, nvml_timeout_s: float | None = None
) -> tuple[Constraints, dict[str, Any]]:
    """``constraints`` with this machine's unhealthy GPUs (read live, one sample) and the health section
    of the JSON document. Reading ``--input`` there is no health to read: said so, nothing left out."""
    from dataclasses import replace

    if input is not None:
        source = f"not checked (--input {input}: not this machine)"
        return constraints, {"checked": False, "source": source, "findings": [], "not_checked": []}
    from gputopo.machine import read_live_health

    judgement = read_live_health(nvml_timeout_s)
    # A check state that could not be used (corrupt, a newer gputopo's, a link) is said, not only in the
    # JSON's health.not_checked: the last check's verdict is missing from what is left out.
    from gputopo.health.state import LAST_CHECK_WHAT
    from gputopo.ui.output import Output

    Output().warnings(n.why for n in judgement.not_checked if n.what == LAST_CHECK_WHAT)
    sick = judgement.unhealthy_gpus()
    section = health_doc(judgement, LIVE_HEALTH_SOURCE)
    section["allowed"] = constraints.allow_unhealthy
    no_p2p = tuple(sorted(judgement.p2p_drained_gpus().items()))
    return replace(constraints, unhealthy=tuple(sorted(sick.items())), no_p2p=no_p2p), section


def health_doc(judgement: Judgement, source: str) -> dict[str, Any]:
    """The ``health`` section of a command's JSON: whether it was read, how, and what it found."""
    unread = any(n.what == "health" for n in judgement.not_checked)
    return {"checked": not unread, "source": source, **judgement.to_json()}
