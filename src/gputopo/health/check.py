"""``gputopo check``'s verdict (pure): health samples, Xid lines and baseline changes -> one result, the
one-line reason a scheduler shows, the exit code and the ``gputopo/check/v1`` document.

Exit codes follow node-problem-detector's custom-plugin convention (0 OK, 1 problem, anything else
unknown): 0 healthy (notes allowed), 1 problems, 3 could not check. ``--format nagios`` uses Nagios's
codes instead: 0 OK, 1 WARNING (notes worth a look), 2 CRITICAL, 3 UNKNOWN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gputopo.errors import EXIT_OK, EXIT_PROBLEM, EXIT_UNAVAILABLE, UsageError
from gputopo.findings import NOTE, PROBLEM, Finding
from gputopo.health.judge import Judgement, NotChecked
from gputopo.health.readings import BUDGET_SPENT, NOT_READ, GpuHealth, HealthSample
from gputopo.model import (  # noqa: F401 - DEFAULT_NVML_TIMEOUT_S: check's, re-exported
    DEFAULT_HEALTH_WINDOW_S,
    DEFAULT_NVML_TIMEOUT_S,
    GPU_NOT_ACCESSIBLE,
)

SCHEMA = "gputopo/check/v1"
HEALTHY, PROBLEMS, UNKNOWN = "healthy", "problems", "unknown"
# check's defaults, written once: the window between the two samples, the whole check's time budget, one
# GPU's NVML deadline, and the Xid window (--since).
DEFAULT_SAMPLE_S = DEFAULT_HEALTH_WINDOW_S
DEFAULT_BUDGET_S = 20.0
DEFAULT_SINCE = "2h"
DEFAULT_SINCE_S = 7200.0
# How old the last check's per-subsystem record may be for ``check --subsystem`` to answer from it (s).
DEFAULT_MAX_AGE_S = 120.0
# node-problem-detector's own default max_output_length (pkg/custompluginmonitor/types/config.go:
# defaultMaxOutputLength): --format npd cuts its line to this many bytes unless told otherwise.
NPD_DEFAULT_MAX_OUTPUT = 80
# The one-line reason every output starts with.
REASON_CHARS = 200


@dataclass(frozen=True)
class CheckResult:
    """The whole check: verdict, one-line reason, the GPUs as read, findings, what was not checked."""

    verdict: str
    reason: str
    sample: HealthSample | None
    findings: tuple[Finding, ...]
    not_checked: tuple[NotChecked, ...]
    elapsed_s: float
    # The Xid lines of the window not acknowledged (their keys): what a drain now remembers.
    xid_keys: tuple[str, ...] = ()
    # The network ports' counters as read (port -> counter -> value): what the state file remembers.
    ports: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    # Every Xid line of the window, acknowledged or not, as (line key, PCI address as logged, Xid code):
    # what the running Xid counters (health.subsystems.count_xids) count once each.
    xid_events: tuple[tuple[str, str, int], ...] = ()
    # The GPU pairs behind an ACS-redirecting bridge, from the PCIe path table the check read (its network
    # half): (lower index, higher index, bridges). Handed to doctor, which so reads that table once.
    redirected: tuple[tuple[int, int, tuple[str, ...]], ...] = ()

    @property
    def exit_code(self) -> int:
        return {HEALTHY: EXIT_OK, PROBLEMS: EXIT_PROBLEM}.get(self.verdict, EXIT_UNAVAILABLE)

    def to_json(self) -> dict[str, object]:
        gpus = []
        for g in self.sample.gpus if self.sample is not None else ():
            gpus.append(
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "pci_bus_id": g.pci_bus_id,
                    "name": g.name,
                    "health": g.to_json(),
                }
            )
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "reason": self.reason,
            "gpus": gpus,
            "findings": [f.to_json() for f in self.findings],
            "not_checked": [n.to_json() for n in self.not_checked],
            "elapsed_s": round(self.elapsed_s, 3),
        }


def validate_numbers(
    sample_s: float, budget_s: float, nvml_timeout_s: float, expect_gpus: int | None
) -> None:
    """The numbers of ``check``'s options, one rule each; ``UsageError`` (exit 2) for one that makes no
    sense. ``check.CheckOptions`` calls it once, when the options are built."""
    if not 0 < budget_s < math.inf:
        raise UsageError(
            f"--budget {budget_s:g}: must be more than 0 seconds (and finite)",
            f"e.g. --budget {DEFAULT_BUDGET_S:g} (the default)",
        )
    if not 0 <= sample_s < budget_s:  # NaN fails every comparison, so it lands here too
        raise UsageError(
            f"--sample-s {sample_s:g}: must be at least 0 and less than --budget ({budget_s:g} s)",
            f"e.g. --sample-s {DEFAULT_SAMPLE_S:g} (the default)",
        )
    if not 0 < nvml_timeout_s < math.inf:
        raise UsageError(
            f"--nvml-timeout {nvml_timeout_s:g}: must be positive",
            f"e.g. --nvml-timeout {DEFAULT_NVML_TIMEOUT_S:g} (the default)",
        )
    if expect_gpus is not None and expect_gpus < 0:
        raise UsageError(f"--expect-gpus {expect_gpus}: must be 0 or more", "e.g. --expect-gpus 8")


def summarize(
    sample: HealthSample | None,
    judgement: Judgement | None,
    extra_findings: Sequence[Finding],
    extra_not_checked: Sequence[NotChecked],
    elapsed_s: float,
    unavailable: str | None = None,
    xid_keys: tuple[str, ...] = (),
) -> CheckResult:
    """Put the parts together. ``unavailable`` is why NVML could not be read at all (verdict unknown,
    unless a problem was found elsewhere, e.g. an Xid 79 in the kernel log)."""
    findings = list(judgement.findings if judgement else ()) + list(extra_findings)
    findings.sort(key=lambda f: f.severity != PROBLEM)
    not_checked = tuple(judgement.not_checked if judgement else ()) + tuple(extra_not_checked)
    problems = [f for f in findings if f.severity == PROBLEM]
    notes = [f for f in findings if f.severity == NOTE]
    # A GPU that refused access was not read: a node where every GPU refused is unknown, never healthy.
    read = [
        g
        for g in (sample.gpus if sample else ())
        if (g.error is not None and g.state != GPU_NOT_ACCESSIBLE) or (g.error is None and _was_read(g))
    ]
    if problems:
        first = problems[0].what
        more = (
            f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
            if len(problems) > 1
            else ""
        )
        return CheckResult(
            PROBLEMS,
            one_line(first, REASON_CHARS - len(more)) + more,
            sample,
            tuple(findings),
            not_checked,
            elapsed_s,
            xid_keys,
        )
    if unavailable is not None:
        return CheckResult(
            UNKNOWN, one_line(unavailable), sample, tuple(findings), not_checked, elapsed_s, xid_keys
        )
    if sample is None or not read:
        budget = any(u.why == BUDGET_SPENT for g in (sample.gpus if sample else ()) for u in g.unknown)
        refused = [g for g in (sample.gpus if sample else ()) if g.state == GPU_NOT_ACCESSIBLE]
        why = "the time budget ran out before any GPU was read" if budget else "no GPU could be read"
        if refused and not budget:
            why = (
                f"no GPU could be read: all {len(refused)} refused access ({refused[0].error}); run the "
                "check as root"
            )
        return CheckResult(UNKNOWN, why, sample, tuple(findings), not_checked, elapsed_s, xid_keys)
    n = len(sample.gpus)
    parts = [f"healthy: {n} GPU{'s' if n != 1 else ''}, no problems"]
    if notes:
        parts.append(f"{len(notes)} note{'s' if len(notes) != 1 else ''}")
    if not_checked:
        parts.append(f"{len(not_checked)} not checked")
    return CheckResult(HEALTHY, ", ".join(parts), sample, tuple(findings), not_checked, elapsed_s, xid_keys)


def _was_read(g: GpuHealth) -> bool:
    return not any(u.what == NOT_READ for u in g.unknown)


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """The summary on one line, at most ``limit`` characters, without double quotes or backticks; an
    apostrophe stays ("the fabric's health summary"), as the finding says it. The scheduler's reason field
    is made apart, without any quote (``node_action.slurm_reason``)."""
    flat = " ".join(text.replace('"', "").replace("`", "").split())
    return flat if len(flat) <= limit else flat[: limit - 3].rstrip() + "..."
