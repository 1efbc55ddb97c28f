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
    from gputopo.health.judge import Judgement
    from gputopo.recommend import Constraints


DEFAULT_MAX_USED_MIB = 1024  # mirrors gputopo.recommend.DEFAULT_MAX_USED_MIB (kept here for a fast --help)


EXCLUDE_OPTION = typer.Option(
    None, "--exclude", metavar="LIST", help="GPUs to leave out, e.g. 3,4 (see README: GPU lists)."
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
    None, "--from-report", metavar="PATH", help="A probe report: keep failing pairs apart, use measurements."
)


def set_constraints(
    n: int,
    exclude: str | None,
    allow_busy: bool,
    max_used_mib: int,
    from_report: Path | None,
    allow_unhealthy: bool = False,
    **more: Any,
) -> Constraints:
    """What ``recommend`` and ``run`` choose a set by, from their shared options (checked here, once)."""
    from gputopo.recommend import Constraints, evidence_from_report

    if max_used_mib < 0:
        raise UsageError(f"--max-used-mib {max_used_mib}: must be 0 or more", "e.g. --max-used-mib 1024")
    evidence = None
    if from_report is not None:
        label = f"--from-report {from_report}"
        doc = read_json_file(from_report, label, "give the .json report `gputopo probe` wrote under reports/")
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
    sick = judgement.unhealthy_gpus()
    section = health_doc(judgement, LIVE_HEALTH_SOURCE)
    section["allowed"] = constraints.allow_unhealthy
    return replace(constraints, unhealthy=tuple(sorted(sick.items()))), section


def health_doc(judgement: Judgement, source: str) -> dict[str, Any]:
    """The ``health`` section of a command's JSON: whether it was read, how, and what it found."""
    unread = any(n.what == "health" for n in judgement.not_checked)
    return {"checked": not unread, "source": source, **judgement.to_json()}
