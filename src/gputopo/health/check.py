"""``gputopo check``'s verdict (pure): health samples, Xid lines and baseline changes -> one result, the
one-line reason a scheduler shows, the exit code and the ``gputopo/check/v1`` document.

Exit codes follow node-problem-detector's custom-plugin convention (0 OK, 1 problem, anything else
unknown): 0 healthy (notes allowed), 1 problems, 3 could not check. ``--format nagios`` uses Nagios's
codes instead: 0 OK, 1 WARNING (notes worth a look), 2 CRITICAL, 3 UNKNOWN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gputopo.errors import EXIT_OK, EXIT_PROBLEM, EXIT_UNAVAILABLE, UsageError
from gputopo.findings import NOTE, PROBLEM, Finding
from gputopo.health.judge import Judgement, NotChecked
from gputopo.health.readings import BUDGET_SPENT, NOT_READ, GpuHealth, HealthSample

SCHEMA = "gputopo/check/v1"
HEALTHY, PROBLEMS, UNKNOWN = "healthy", "problems", "unknown"
DEFAULT_SAMPLE_S = 2.0
DEFAULT_BUDGET_S = 20.0
# Slurm's drain reason is free text on one line; long ones are cut (sinfo -R shows the first ~40 columns).
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

    @property
    def exit_code(self) -> int:
        return {HEALTHY: EXIT_OK, PROBLEMS: EXIT_PROBLEM}.get(self.verdict, EXIT_UNAVAILABLE)

    def nagios(self) -> tuple[int, str]:
        """(Nagios exit code, status line): ``GPUTOPO CRITICAL - ...``, ``OK``, ``WARNING``, ``UNKNOWN``."""
        if self.verdict == PROBLEMS:
            return 2, f"GPUTOPO CRITICAL - {self.reason}"
        if self.verdict == UNKNOWN:
            return 3, f"GPUTOPO UNKNOWN - {self.reason}"
        if any(f.severity == NOTE for f in self.findings):
            return 1, f"GPUTOPO WARNING - {self.reason}"
        return 0, f"GPUTOPO OK - {self.reason}"

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


def validate_options(sample_s: float, budget_s: float, expect_gpus: int | None) -> None:
    """The numbers of ``check``'s options; ``UsageError`` (exit 2) for one that makes no sense."""
    if not 0 < budget_s < math.inf:
        raise UsageError(
            f"--budget {budget_s:g}: must be more than 0 seconds (and finite)",
            "e.g. --budget 20 (the default)",
        )
    if not 0 <= sample_s < budget_s:  # NaN fails every comparison, so it lands here too
        raise UsageError(
            f"--sample-s {sample_s:g}: must be at least 0 and less than --budget ({budget_s:g} s)",
            "e.g. --sample-s 2 (the default)",
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
) -> CheckResult:
    """Put the parts together. ``unavailable`` is why NVML could not be read at all (verdict unknown,
    unless a problem was found elsewhere, e.g. an Xid 79 in the kernel log)."""
    findings = list(judgement.findings if judgement else ()) + list(extra_findings)
    findings.sort(key=lambda f: f.severity != PROBLEM)
    not_checked = tuple(judgement.not_checked if judgement else ()) + tuple(extra_not_checked)
    problems = [f for f in findings if f.severity == PROBLEM]
    notes = [f for f in findings if f.severity == NOTE]
    read = [g for g in (sample.gpus if sample else ()) if g.error is not None or _was_read(g)]
    if problems:
        first = problems[0].what
        more = (
            f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
            if len(problems) > 1
            else ""
        )
        return CheckResult(PROBLEMS, one_line(first + more), sample, tuple(findings), not_checked, elapsed_s)
    if unavailable is not None:
        return CheckResult(UNKNOWN, one_line(unavailable), sample, tuple(findings), not_checked, elapsed_s)
    if sample is None or not read:
        budget = any(u.why == BUDGET_SPENT for g in (sample.gpus if sample else ()) for u in g.unknown)
        why = "the time budget ran out before any GPU was read" if budget else "no GPU could be read"
        return CheckResult(UNKNOWN, why, sample, tuple(findings), not_checked, elapsed_s)
    n = len(sample.gpus)
    parts = [f"healthy: {n} GPU{'s' if n != 1 else ''}, no problems"]
    if notes:
        parts.append(f"{len(notes)} note{'s' if len(notes) != 1 else ''}")
    if not_checked:
        parts.append(f"{len(not_checked)} not checked")
    return CheckResult(HEALTHY, ", ".join(parts), sample, tuple(findings), not_checked, elapsed_s)


def _was_read(g: GpuHealth) -> bool:
    return not any(u.what == NOT_READ for u in g.unknown)


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """Text safe for a scheduler's reason field: one line, no quotes, at most ``limit`` characters."""
    flat = " ".join(text.replace('"', "").replace("'", "").replace("`", "").split())
    return flat if len(flat) <= limit else flat[: limit - 3].rstrip() + "..."
