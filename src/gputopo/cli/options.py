"""Typer options that more than one command shares (recommend and run choose a set by the same rules),
and the one place that turns them into constraints."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from gputopo.cli.common import read_json_file
from gputopo.errors import UsageError
from gputopo.gpulist import parse_gpu_list

if TYPE_CHECKING:
    from gputopo.model import Topology
    from gputopo.recommend import Constraints


DEFAULT_MAX_USED_MIB = 1024  # mirrors gputopo.recommend.DEFAULT_MAX_USED_MIB (kept here for a fast --help)


EXCLUDE_OPTION = typer.Option(
    None, "--exclude", metavar="LIST", help="GPUs to leave out, e.g. 3,4 (see README: GPU lists)."
)


ALLOW_BUSY_OPTION = typer.Option(False, "--allow-busy", help="Count GPUs in use by other processes.")


MAX_USED_OPTION = typer.Option(
    DEFAULT_MAX_USED_MIB, "--max-used-mib", help="A GPU with more memory in use than this is busy."
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


def set_constraints(
    n: int,
    exclude: str | None,
    allow_busy: bool,
    max_used_mib: int,
    from_report: Path | None,
    **more: Any,
) -> Constraints:
    """What ``recommend`` and ``run`` choose a set by, from their shared options (checked here, once)."""
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
