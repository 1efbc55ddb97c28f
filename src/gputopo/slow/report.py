"""``gputopo slow``'s report: the judgement (``slow.judge``), where each rank ran, and the
``gputopo/slow/v1`` document (``SlowReport.document()``, built there and nowhere else). Kept in ``slow/``,
not in its service (``services.slow``), so that ``ui/slow_view`` renders it without importing a service."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gputopo.findings import NOTE, PROBLEM, Finding
from gputopo.slow import judge as J


@dataclass(frozen=True)
class RankPlace:
    rank: int
    host: str | None
    gpu: int | None
    pid: int | None = None


SCHEMA = "gputopo/slow/v1"


@dataclass(frozen=True)
class SlowReport:
    """What ``gputopo slow`` found: the judgement over the ranks' lateness, where each rank ran (``places``),
    how the clocks were compared, notes and findings; ``document()`` is the whole ``gputopo/slow/v1`` JSON."""

    source: str  # "inspector" | "flight-recorder" | "nccl-tests"
    path: str
    judgement: J.Judgement
    places: dict[int, RankPlace]
    clock: str
    notes: tuple[str, ...] = ()
    unit: str = "rank"  # "process" for nccl-tests
    findings: tuple[Finding, ...] = field(default=())

    @property
    def exit_code(self) -> int:
        return 1 if self.judgement.stragglers else 0

    def place(self, rank: int) -> RankPlace:
        return self.places.get(rank) or RankPlace(rank, None, None)

    def sentence(self) -> str:
        j = self.judgement
        if j.stragglers:
            return "; ".join(self.about(s) for s in j.stragglers)
        if j.undecided:
            return f"undecided: {j.undecided}"
        spread = f"; spread {j.spread_pct:.0f}%" if j.spread_pct is not None else ""
        return f"no {self.unit} is consistently late{spread}"

    def about(self, s: J.Straggler) -> str:
        p = self.place(s.rank)
        where = []
        if p.host:
            where.append(f"on {p.host}")
        if p.gpu is not None:
            where.append(f"GPU {p.gpu}")
        at = (" " + ", ".join(where)) if where else ""
        return (
            f"{self.unit} {s.rank}{at} arrives {s.lateness_ms:.3g} ms late (median) and last in "
            f"{s.late_share:.0%} of its operations; the job loses {s.waiting_share:.0%} of its collective "
            f"time waiting for it"
        )

    def document(self) -> dict[str, Any]:
        j = self.judgement
        return {
            "schema": SCHEMA,
            "source": self.source,
            "path": self.path,
            "verdict": "straggler" if j.stragglers else ("undecided" if j.undecided else "none"),
            "sentence": self.sentence(),
            "stragglers": [
                {
                    "rank": s.rank,
                    "host": self.place(s.rank).host,
                    "gpu": self.place(s.rank).gpu,
                    "lateness_ms": round(s.lateness_ms, 4),
                    "waiting_share": round(s.waiting_share, 4),
                    "late_share": round(s.late_share, 4),
                    "windows_flagged": s.windows_flagged,
                    "windows": s.windows,
                    "communicators": list(s.communicators),
                    "operations": list(s.operations),
                }
                for s in j.stragglers
            ],
            "waited": [
                {
                    "rank": w.rank,
                    "host": self.place(w.rank).host,
                    "gpu": self.place(w.rank).gpu,
                    "waited_for": list(w.waited_for),
                    "communicators": list(w.communicators),
                }
                for w in j.waited
            ],
            "ranks": [
                {
                    "rank": r,
                    "host": self.place(r).host,
                    "gpu": self.place(r).gpu,
                    "median_lateness_ms": round(v, 4),
                }
                for r, v in j.ranks.items()
            ],
            "operations": j.operations,
            "windows": j.windows,
            "spread_pct": None if j.spread_pct is None else round(j.spread_pct, 2),
            "undecided": j.undecided,
            "clock": self.clock,
            "rule": j.params,
            "findings": [f.to_json() for f in self.findings],
            "notes": list(self.notes),
        }


def make_report(
    source: str,
    path: Path,
    j: J.Judgement,
    places: dict[int, RankPlace],
    clock: str,
    notes: list[str],
    unit: str = "rank",
) -> SlowReport:
    """The report on ``j``, with a finding per straggler (or a note on why it is undecided)."""
    report = SlowReport(source, str(path), j, places, clock, tuple(notes), unit)
    findings = []
    for s in j.stragglers:
        p = report.place(s.rank)
        findings.append(
            Finding(
                where=f"{unit} {s.rank}"
                + (f" ({p.host} GPU {p.gpu})" if p.host and p.gpu is not None else ""),
                what=report.about(s) + f" (outlier in {s.windows_flagged} of {s.windows} windows)",
                remedy="look at what that rank does between collectives: its GPU clocks and health "
                "(gputopo check on its node), its data loader and host load, its NIC",
                severity=PROBLEM,
                gpu=p.gpu,
                category="compute",
                action="monitor",
            )
        )
    if not j.stragglers and j.undecided:
        findings.append(
            Finding(
                where="job",
                what=j.undecided,
                remedy="record more operations",
                severity=NOTE,
                category="process",
            )
        )
    return replace(report, findings=tuple(findings))
