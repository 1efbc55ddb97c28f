"""Shared test helpers: where the shared fixtures live (``../shared`` beside the repo root)."""

from __future__ import annotations

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
