"""``gputopo check`` as a real Slurm node's ``HealthCheckProgram``, on the repository's one Slurm bring-up
(scripts/slurm-local, the ``slurm_cluster`` fixture: node1..node3 on this machine).

slurmd runs the program as root with no PATH and only ``SLURMD_NODENAME``; the program here is an
absolute-path wrapper that points each node at its own fake driver machine (node1's with a sick GPU) and
runs ``gputopo check --drain --resume-if-healthy``. The drain shows in ``sinfo -R`` with gputopo's reason,
the healed node is resumed by the next check, and an administrator's drain is never undone. Skipped, with
the reason, where Slurm cannot start.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import fake_driver
from test_health_reads import healthy

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(fake_driver.compiler() is None, reason="no C compiler to build the fake driver"),
]

INTERVAL_S = 2
# A few health-check rounds: slurmd starts one every INTERVAL_S; each takes ~1-2 s here.
WAIT_S = 60

WRAPPER = """#!/bin/sh
# slurmd runs this with no PATH and only SLURMD_NODENAME: every program by absolute path, the fake
# driver and this checkout's code set here, one machine file (and log) per node.
export LD_LIBRARY_PATH="{lib}" FAKE_NVML_CONFIG="{folder}/machine.$SLURMD_NODENAME.txt" PYTHONPATH="{src}"
export SLURM_CONF="{conf}"
exec "{python}" -m gputopo check --sample-s 0.2 --budget 15 --kernel-log /dev/null \\
    --drain --resume-if-healthy >> "{folder}/check.$SLURMD_NODENAME.log" 2>&1
"""


@dataclass(frozen=True)
class HealthCheck:
    cluster: Any
    folder: Path

    def machine(self, node: str, *extra: str) -> None:
        """Give ``node`` one healthy H100, plus ``extra`` fake-driver lines (atomically: slurmd may be
        reading it)."""
        path = self.folder / f"machine.{node}.txt"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(["driver 570.86.15", "cuda 12080", *healthy(0), *extra]) + "\n")
        tmp.replace(path)

    def runs(self, node: str, verdict: str) -> int:
        """How many checks of ``node`` ended in ``verdict`` (each check's first line starts with it)."""
        log = self.folder / f"check.{node}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        return sum(1 for line in text.splitlines() if line.startswith(f"{verdict}:"))

    def log(self, node: str) -> str:
        log = self.folder / f"check.{node}.log"
        return log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"


@pytest.fixture
def health_check(slurm_cluster: Any) -> Iterator[HealthCheck]:
    """Every node healthy, the wrapper as HealthCheckProgram; afterwards the program off and every node
    that gputopo drained resumed, so the cluster is as the other tests expect it."""
    folder = slurm_cluster.state_dir / "hc-gputopo-check"
    folder.mkdir(exist_ok=True)
    for old in folder.glob("*.log"):
        old.unlink()
    lib = fake_driver.build(folder / "driver")
    hc = HealthCheck(slurm_cluster, folder)
    for node in slurm_cluster.nodes:
        hc.machine(node)
    program = folder / "gputopo-check.sh"
    program.write_text(
        WRAPPER.format(
            lib=lib, folder=folder, src=fake_driver.SRC, conf=slurm_cluster.conf, python=sys.executable
        )
    )
    program.chmod(0o755)
    slurm_cluster.set_health_check(program, interval_s=INTERVAL_S)
    try:
        yield hc
    finally:
        slurm_cluster.set_health_check(None)
        # What these tests drained (gputopo's drains, the stand-in admin's) goes back into service.
        for node in slurm_cluster.drain_reasons():
            if node in slurm_cluster.nodes:
                slurm_cluster.resume(node)


def test_a_sick_gpu_drains_its_node_and_the_healed_node_is_resumed(health_check: HealthCheck) -> None:
    hc, cluster = health_check, health_check.cluster
    hc.machine("node1", "remap 0 0 0 1 0")  # a row remapping pending on GPU0
    wanted = "gputopo: a row remapping is pending on GPU0"
    cluster.wait_for(
        lambda: cluster.drain_reasons().get("node1") == wanted,
        f"node1 drained in sinfo -R with {wanted!r}\n{hc.log('node1')}",
        timeout_s=WAIT_S,
    )
    assert cluster.node_state("node1").startswith("drain")
    # The healthy nodes were checked too, and left alone.
    cluster.wait_for(lambda: hc.runs("node2", "healthy") >= 1, f"node2 checked\n{hc.log('node2')}", WAIT_S)
    assert "node2" not in cluster.drain_reasons() and "node3" not in cluster.drain_reasons()
    hc.machine("node1")  # the GPU reset applied the remap
    cluster.wait_for(
        lambda: "node1" not in cluster.drain_reasons() and cluster.node_state("node1") == "idle",
        f"node1 resumed by --resume-if-healthy\n{hc.log('node1')}",
        timeout_s=WAIT_S,
    )


def test_an_administrators_drain_is_never_undone(health_check: HealthCheck) -> None:
    hc, cluster = health_check, health_check.cluster
    cluster.run("scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=admin: fan noise")
    seen = hc.runs("node2", "healthy")
    # Two more checks of node2 run, each healthy (and asked to resume), and the admin's drain stays.
    cluster.wait_for(
        lambda: hc.runs("node2", "healthy") >= seen + 2, f"two more checks\n{hc.log('node2')}", WAIT_S
    )
    assert cluster.drain_reasons().get("node2") == "admin: fan noise"
    assert cluster.node_state("node2").startswith("drain")
