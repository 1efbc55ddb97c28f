"""Shared test helpers: where the shared fixtures live (``../shared`` beside the repo root)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DIR = Path(__file__).resolve().parents[1].parent / "shared"


def fixture_dir() -> Path | None:
    """``../shared/fixtures`` beside the repo root, or ``None`` when this checkout has none."""
    path = SHARED_DIR / "fixtures"
    return path if path.is_dir() else None


@pytest.fixture
def shared_fixtures() -> Path:
    """The shared fixtures folder; the test is skipped when it is absent."""
    path = fixture_dir()
    if path is None:
        pytest.skip(f"shared fixtures not found at {SHARED_DIR / 'fixtures'}")
    return path


GOLDEN = Path(__file__).parent / "golden"


def plain_env(columns: int = 120) -> dict[str, str]:
    """Colour off and a fixed width, so CLI output is the same on every terminal and in CI."""
    return {"NO_COLOR": "1", "COLUMNS": str(columns), "TERM": "dumb"}


def invoke(*args: str, columns: int = 120, env: dict[str, str] | None = None):
    """Run the gputopo CLI in-process (typer's CliRunner) with ``plain_env``."""
    from typer.testing import CliRunner

    from gputopo.cli import app

    return CliRunner().invoke(app, list(args), env={**plain_env(columns), **(env or {})})


def check_golden(name: str, text: str) -> None:
    """Compare ``text`` with tests/golden/NAME; ``GPUTOPO_UPDATE_GOLDEN=1`` rewrites the file instead."""
    path = GOLDEN / name
    if os.environ.get("GPUTOPO_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), (
        f"output differs from {path}; rerun with GPUTOPO_UPDATE_GOLDEN=1 if intended"
    )


# A real Slurm cluster on this machine for the tests that ask for it (tests/slurm_cluster.py).
from slurm_cluster import slurm_cluster  # noqa: E402, F401
