"""Configuration drift across nodes, as the probe's judges read it: the pure rules live on the pure floor in
``gputopo.drift`` (shared with ``hang``, which sits beside ``probe``, not above it); this name is kept for
the probe's own imports."""

from __future__ import annotations

from gputopo.drift import (
    FACT_KEYS,
    LABELS,
    NO_PLUGIN,
    PROBLEM_KEYS,
    UNKNOWN,
    UNSET,
    Drift,
    compare,
    findings,
)

__all__ = [
    "FACT_KEYS",
    "LABELS",
    "NO_PLUGIN",
    "PROBLEM_KEYS",
    "UNKNOWN",
    "UNSET",
    "Drift",
    "compare",
    "findings",
]
