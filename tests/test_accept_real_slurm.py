"""``gputopo accept --gate`` on the repository's real Slurm (scripts/slurm-local, the ``slurm_cluster``
fixture: node1..node3 on this machine), run the way deploy/slurm's sample runs it: as root, with no PATH and
only ``SLURMD_NODENAME``. The program is the sample itself (its settings pointed at this test's folder),
calling a stand-in for ``gputopo`` that gives each node its own fake driver machine and CPU stand-ins.

What an operator sees: a healthy node is resumed (accepted); a sick one stays drained with gputopo's reason
in ``sinfo -R``; a node an administrator drained is never resumed, whatever the verdict. Run these under
``flock /tmp/slurm-tests.lock``: the cluster is shared. Skipped, with the reason, where Slurm cannot start.
"""

from __future__ import annotations

import json
import subprocess
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
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("torch") is None, reason="the probes need torch"
    ),
]

SAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "gputopo-accept.sh"
GPUTOPO = """#!/bin/sh
export LD_LIBRARY_PATH="{lib}" FAKE_NVML_CONFIG="{folder}/machine.$SLURMD_NODENAME.txt" PYTHONPATH="{src}"
export SLURM_CONF="{conf}"
exec "{python}" -m gputopo "$@" --sample-s 0.2 --kernel-log /dev/null --device cpu
"""
SICK = "remap 0 0 2 0 1"  # a row remapping failed on GPU0


def program_from_sample(folder: Path) -> str:
    """deploy/slurm's accept sample itself, its settings pointed at this test's folder."""
    settings = {
        "GPUTOPO=": f"GPUTOPO={folder}/gputopo",
        "LOG=": f'LOG="{folder}/accept.$SLURMD_NODENAME.log"',
        "STATE=": f'STATE="{folder}/state.$SLURMD_NODENAME.json"',
        "REPORTS=": f"REPORTS={folder}/reports",
        "EXPECT_GPUS=": "EXPECT_GPUS=1",
        "BUDGET=": "BUDGET=300",
    }
    lines = []
    for line in SAMPLE.read_text().splitlines():
        key = next((k for k in settings if line.startswith(k)), None)
        lines.append(settings[key] if key else line)
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Accepting:
    cluster: Any
    folder: Path
    program: Path

    def machine(self, node: str, *extra: str) -> None:
        (self.folder / f"machine.{node}.txt").write_text(
            "\n".join(["driver 570.86.15", "cuda 12080", *healthy(0), *extra]) + "\n"
        )

    def run(self, node: str) -> subprocess.CompletedProcess[str]:
        """The sample as slurmd or systemd would start it: no PATH, only SLURMD_NODENAME."""
        return subprocess.run(
            ["/bin/sh", str(self.program)],
            env={"SLURMD_NODENAME": node},
            capture_output=True,
            text=True,
            timeout=600,
        )

    def state(self, node: str) -> dict[str, Any]:
        return json.loads((self.folder / f"state.{node}.json").read_text())


@pytest.fixture
def accepting(slurm_cluster: Any) -> Iterator[Accepting]:
    """Every node idle and healthy; afterwards every node drained here resumed, as the other tests expect."""
    folder = slurm_cluster.state_dir / "accept-gate"
    folder.mkdir(exist_ok=True)
    for old in [*folder.glob("*.log"), *folder.glob("state.*.json")]:
        old.unlink()
    lib = fake_driver.build(folder / "driver")
    gputopo = folder / "gputopo"
    gputopo.write_text(
        GPUTOPO.format(
            lib=lib, folder=folder, src=fake_driver.SRC, conf=slurm_cluster.conf, python=sys.executable
        )
    )
    gputopo.chmod(0o755)
    program = folder / "gputopo-accept.sh"
    program.write_text(program_from_sample(folder))
    program.chmod(0o755)
    acc = Accepting(slurm_cluster, folder, program)
    for node in slurm_cluster.nodes:
        acc.machine(node)
    try:
        yield acc
    finally:
        for node in slurm_cluster.drain_reasons():
            if node in slurm_cluster.nodes:
                slurm_cluster.resume(node)


def test_a_healthy_node_is_accepted_and_resumed(accepting: Accepting) -> None:
    cluster = accepting.cluster
    done = accepting.run("node1")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.startswith("ACCEPTED: accepted")
    # sinfo may mark it "idle*" a moment (slurmd answering late on a loaded machine): idle is what counts.
    cluster.wait_for(lambda: cluster.node_state("node1").rstrip("*") == "idle", "node1 idle (resumed)")
    assert "node1" not in cluster.drain_reasons()
    kept = accepting.state("node1")["accept"]
    assert kept["verdict"] == "accepted" and kept["driver"] == "570.86.15"
    log = (accepting.folder / "accept.node1.log").read_text()
    assert " node1 rc=0 ACCEPTED: accepted" in log


def test_a_sick_node_stays_drained_with_the_reason(accepting: Accepting) -> None:
    cluster = accepting.cluster
    accepting.machine("node2", SICK)
    done = accepting.run("node2")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout.startswith("REJECTED: rejected at health")
    reason = cluster.drain_reasons().get("node2", "")
    assert reason.startswith("gputopo: accept rejected: a row remapping failed on GPU0"), reason
    assert cluster.node_state("node2").startswith("drain")
    assert accepting.state("node2")["accept"]["verdict"] == "rejected"


def test_a_node_an_admin_drained_is_never_resumed(accepting: Accepting) -> None:
    cluster = accepting.cluster
    cluster.run("scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=admin: new fan, ticket 42")
    cluster.wait_for(lambda: cluster.node_state("node3").startswith("drain"), "node3 drained by the admin")
    done = accepting.run("node3")
    assert done.returncode == 0, (done.stdout, done.stderr)  # accepted, and still not resumed
    assert cluster.drain_reasons().get("node3") == "admin: new fan, ticket 42"
    assert cluster.node_state("node3").startswith("drain")
