"""What more than one room of ``probe`` needs, in the one place they all may import (no torch here).

``ranks`` (inside torch), ``pool`` (starting and watching ranks), ``report`` (documents) and the
orchestration above them hand these around: the finished run (``ProbeRun``) with the topology it was
judged against (``TopologyView``), and the grace that orders the parent's hang verdict before a
collective's own timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputopo.errors import GputopoError
from gputopo.model import Topology
from gputopo.probe.judge import verdict
from gputopo.probe.judge.verdict import SetResult

if TYPE_CHECKING:
    from gputopo.probe.plan.config import ProbeConfig

# Grace on top of the parent's --timeout: the parent must always be the one that declares a hang, with
# its diagnosis, before a collective's own timeout turns it into a crash.
COLLECTIVE_TIMEOUT_GRACE_S = 60


@dataclass(frozen=True)
class TopologyView:
    """What the bandwidth model and NVML say about the sets, read once per run (``None`` when unknown)."""

    topology: Topology | None
    note: str | None = None

    def expected_busbw_gbps(self, gpus: tuple[int, ...]) -> tuple[float | None, str | None]:
        """The ring model's busbw for ``gpus``, or ``None`` with the reason."""
        if self.topology is None:
            return None, self.note
        from gputopo.topology.bandwidth import ring_busbw_gbps

        try:
            value = ring_busbw_gbps(self.topology, gpus)
        except GputopoError as exc:
            return None, exc.message
        if value is None:
            return None, "the topology does not know every link of this set"
        return value, None

    def nvml_p2p(self) -> dict[tuple[int, int], str] | None:
        """NVML's P2P read status per ordered GPU pair, where the topology has it."""
        topo = self.topology
        if topo is None or not topo.p2p or "read" not in topo.p2p:
            return None
        matrix = topo.p2p["read"]
        indices = topo.gpu_indices
        return {(a, b): matrix[i][j] for i, a in enumerate(indices) for j, b in enumerate(indices) if a != b}


@dataclass(frozen=True)
class ProbeRun:
    """A finished probe: per-set verdicts, the ranks' environment, notes, timing."""

    config: ProbeConfig
    sets: tuple[SetResult, ...]
    environment: dict[str, Any]
    notes: tuple[str, ...]
    started_utc: datetime
    wall_s: float
    launches: tuple[dict[str, Any], ...] = field(default=())
    warnings: tuple[str, ...] = ()  # what reading the topology (--input or live) warned about

    @property
    def verdict(self) -> str:
        """``fail`` if any check failed, else ``pass``."""
        return verdict.FAIL if any(s.verdict == verdict.FAIL for s in self.sets) else verdict.PASS


STDERR_TAIL_LINES = 20


def tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])
