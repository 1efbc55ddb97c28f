"""``gputopo check --drain`` / ``--resume-if-healthy`` against a recording ``scontrol`` on PATH (a real
child process standing in for Slurm's): the command line, dry runs, and never undraining an admin's drain.
A run against a real slurmctld/slurmd is left to the CI machine that can start one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import fake_driver
from test_check_cli import FAST, machine
from test_health_reads import healthy

pytestmark = pytest.mark.skipif(
    fake_driver.compiler() is None, reason="no C compiler to build the fake driver"
)


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def fake_scontrol(tmp_path: Path, reason: str | None) -> tuple[Path, Path]:
    """A ``scontrol`` that records its arguments (one call a line) and shows the node with ``reason``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    show = f'echo "   Reason={reason} [admin@2026-11-25T09:00:00]"' if reason else "true"
    script = bin_dir / "scontrol"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\n'
        f'if [ "$1" = show ]; then echo "NodeName=gpu07 State=IDLE+DRAIN"; {show}; fi\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir, log


def slurm_check(driver: Path, machine_file: Path, bin_dir: Path, *args: str):  # type: ignore[no-untyped-def]
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "SLURMD_NODENAME": "gpu07"}
    return fake_driver.run(driver, machine_file, "check", *FAST, *args, timeout=60, extra_env=env)


SICK = [*healthy(0), "remap 0 0 0 1 0"]


def test_problems_drain_the_node_with_the_reason(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    result = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain")
    assert result.returncode == 1
    assert log.read_text().splitlines() == [
        "update NodeName=gpu07 State=DRAIN Reason=gputopo: a row remapping is pending on GPU0"
    ]
    assert "slurm: " in result.stderr


def test_dry_run_prints_the_command_only(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    result = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain", "--dry-run")
    assert result.returncode == 1 and not log.exists()
    assert result.stdout.splitlines()[-1].endswith(
        "scontrol update NodeName=gpu07 State=DRAIN 'Reason=gputopo: a row remapping is pending on GPU0'"
    )


def test_a_healthy_node_is_not_drained_and_unknown_is_not_drained(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, None)
    assert slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--drain").returncode == 0
    assert slurm_check(driver, tmp_path / "no-driver.txt", bin_dir, "--drain").returncode == 3
    assert not log.exists()


BAD_FILES = {
    "rules.toml": b"no_such_rule = 3\n",
    "cut.json": b'{"schema": "gputopo/baseline/v1", "gpu_count": 3, "gpus": [',
    "topo.json": b'{"schema": "gputopo/topology/v1", "gpus": []}',
    "kern.bin": b"\x00\x01\x02\xff" * 64,
}


@pytest.mark.parametrize(
    "args",
    [
        ["--since", "5x"],
        ["--budget", "0"],
        ["--expect-gpus", "-1"],
        ["--sample-s", "nan"],
        ["--thresholds", "{dir}/rules.toml"],
        ["--baseline", "{dir}/cut.json"],
        ["--baseline", "{dir}/topo.json"],
        ["--kernel-log", "{dir}/kern.bin"],
    ],
)
def test_bad_input_never_drains(driver: Path, tmp_path: Path, args: list[str]) -> None:
    # The node is sick, so a check that ran would drain it: bad input must stop before anything is read.
    for name, data in BAD_FILES.items():
        (tmp_path / name).write_bytes(data)
    bin_dir, log = fake_scontrol(tmp_path, None)
    argv = [a.format(dir=tmp_path) for a in args]
    result = slurm_check(driver, machine(tmp_path, SICK), bin_dir, "--drain", *argv)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) <= 2  # the error and its hint
    assert not log.exists()


def test_resume_only_what_gputopo_drained(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, "gputopo: a row remapping is pending on GPU0")
    result = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--resume-if-healthy")
    assert result.returncode == 0
    assert log.read_text().splitlines() == ["show node gpu07", "update NodeName=gpu07 State=RESUME"]


def test_an_admins_drain_stays(driver: Path, tmp_path: Path) -> None:
    bin_dir, log = fake_scontrol(tmp_path, "bad fan, ticket 4711")
    result = slurm_check(driver, machine(tmp_path, healthy(0)), bin_dir, "--resume-if-healthy")
    assert result.returncode == 0
    assert log.read_text().splitlines() == ["show node gpu07"]
