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


@pytest.fixture(scope="session")
def _clean_sysfs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import sysfs_tree

    return sysfs_tree.every_bus_tree(tmp_path_factory.mktemp("sysfs")).env


@pytest.fixture(autouse=True)
def _no_host_sysfs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test reads a clean captured-shape sysfs/procfs tree (tests/sysfs_tree.py), never this host's
    own (GPUTOPO_SYSFS_ROOT, GPUTOPO_PROCFS_ROOT): its NICs, ACS and kernel command line would change
    the outcome. Tests marked ``gpu`` read the real machine."""
    if request.node.get_closest_marker("gpu") is None:
        for key, value in request.getfixturevalue("_clean_sysfs").items():
            monkeypatch.setenv(key, value)


GOLDEN = Path(__file__).parent / "golden"


# The stop signals a test sends to a gputopo it started. A runner started under `nohup`, or as a
# background job of a script (SIGINT and SIGQUIT ignored), passes those dispositions on, and gputopo rightly
# keeps an ignored signal ignored: such a child would never see the test's signal.
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")


def default_stop_signals() -> None:
    """``preexec_fn`` for a gputopo a test will signal: the stop signals as a terminal's shell leaves them."""
    import signal

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)


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
