"""Real Flight Recorder dumps for the hang tests, made once per test session and per scenario.

Each scenario runs ``tests/helpers/fr_dumps.py`` in a child Python (3 CPU ranks with gloo; see that file
for what each fault does under gloo), so a test module that needs two scenarios pays for two runs, and a
later module reuses them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HELPER = Path(__file__).resolve().parent / "helpers" / "fr_dumps.py"
PREFIX = "rank_trace"
WORLD = 3
_CACHE: dict[str, Path] = {}
WORLDS = {"subgroups4": 4}  # scenarios that need more ranks than WORLD


def real_dumps(scenario: str, base: Path) -> Path:
    """The folder of ``scenario``'s dumps (pickle at the top, JSON under ``json/``), made under ``base``
    the first time it is asked for in this session."""
    import pytest

    pytest.importorskip("torch")
    # A cached folder may be gone: another module's base (test_golden_commands' corpus) is removed when
    # that module ends, and a later module asking for the same scenario would get a path to nothing.
    if scenario in _CACHE and _CACHE[scenario].is_dir():
        return _CACHE[scenario]
    world = WORLDS.get(scenario, WORLD)
    out = base / scenario
    if out.exists():
        shutil.rmtree(out)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000"}
    run = subprocess.run(
        [sys.executable, str(HELPER), scenario, str(out), str(world)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    _CACHE[scenario] = out
    return out


def copy_dumps(src: Path, dst: Path, json_dumps: bool = False) -> Path:
    """A copy of one scenario's dumps (pickle, or the JSON ones) in ``dst``, to add files beside them."""
    dst.mkdir(parents=True, exist_ok=True)
    folder = src / "json" if json_dumps else src
    for p in folder.iterdir():
        if p.is_file() and p.name.startswith(PREFIX):
            shutil.copy(p, dst / p.name)
    return dst
