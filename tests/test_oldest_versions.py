"""The oldest-versions run in .ci/run installs exactly the lower bounds pyproject.toml declares."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_ci_oldest_pins_are_pyprojects_lower_bounds() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lower = {}
    for dep in deps:
        # A dependency whose marker leaves this Python out (tomli below 3.11) is not in the oldest run,
        # which installs on this Python.
        marker = Requirement(dep).marker
        if marker is not None and not marker.evaluate():
            continue
        m = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", dep)
        assert m, f"{dep!r}: every runtime dependency needs a lower bound"
        lower[m.group(1)] = m.group(2)
    line = next(ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("OLDEST=("))
    pins = dict(p.split("==") for p in re.findall(r'"([^"]+)"', line))
    assert set(pins) == set(lower)
    for name, version in lower.items():
        # "13.8" in pyproject is 13.8.0 in the pin.
        assert pins[name].split(".")[: len(version.split("."))] == version.split("."), (name, pins[name])
