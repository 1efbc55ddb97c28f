"""``gputopo check`` as a real Slurm node's ``HealthCheckProgram``, on the repository's one Slurm bring-up
(scripts/slurm-local, the ``slurm_cluster`` fixture: node1..node3 on this machine).

slurmd runs the program as root with no PATH and only ``SLURMD_NODENAME``; the program here is
deploy/slurm's sample itself (its settings pointed at this test's folder), calling a stand-in for
``gputopo`` that gives each node its own fake driver machine and kernel log. What an operator does is
tested: a sick board drains its node (``sinfo -R`` shows gputopo's reason) and the healed node is resumed;
their own drain is kept through a sick and a healed board; a manual resume is not undone by an old Xid
while a new one drains; several nodes sick at once drain no more than ``--max-drained``. Skipped, with the
reason, where Slurm cannot start.
"""

from __future__ import annotations

import json
import sys
import time
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
SAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "gputopo-healthcheck.sh"

# What stands in for /opt/gputopo/bin/gputopo: this checkout's code on each node's own fake driver machine
# and kernel log (slurmd gives the program nothing but SLURMD_NODENAME).
GPUTOPO = """#!/bin/sh
export LD_LIBRARY_PATH="{lib}" FAKE_NVML_CONFIG="{folder}/machine.$SLURMD_NODENAME.txt" PYTHONPATH="{src}"
export SLURM_CONF="{conf}"
exec "{python}" -m gputopo "$@" --sample-s 0.2 --kernel-log "{folder}/kern.$SLURMD_NODENAME.log"
"""


def program_from_sample(folder: Path) -> str:
    """deploy/slurm's sample itself, its four settings pointed at this test's folder."""
    text = SAMPLE.read_text()
    settings = {
        "GPUTOPO=": f"GPUTOPO={folder}/gputopo",
        "LOG=": f'LOG="{folder}/check.$SLURMD_NODENAME.log"',
        "STATE=": f'STATE="{folder}/state.$SLURMD_NODENAME.json"',
        "EXPECT_GPUS=": "EXPECT_GPUS=1",
    }
    lines = []
    for line in text.splitlines():
        key = next((k for k in settings if line.startswith(k)), None)
        lines.append(settings[key] if key else line)
    return "\n".join(lines) + "\n"


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

    def kernel_log(self, node: str, *lines: str) -> None:
        path = self.folder / f"kern.{node}.log"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(lines))
        tmp.replace(path)

    def lines(self, node: str) -> list[str]:
        log = self.folder / f"check.{node}.log"
        return log.read_text(errors="replace").splitlines() if log.exists() else []

    def runs(self, node: str, verdict: str) -> int:
        """How many checks of ``node`` ended in ``verdict`` (one log line a run: time, node, rc, line)."""
        return sum(1 for line in self.lines(node) if f" {verdict}: " in line)

    def log(self, node: str) -> str:
        return "\n".join(self.lines(node)[-8:]) or "(no log)"


@pytest.fixture
def health_check(slurm_cluster: Any) -> Iterator[HealthCheck]:
    """Every node healthy, deploy/slurm's sample as HealthCheckProgram; afterwards the program off and
    every node drained here resumed, so the cluster is as the other tests expect it."""
    folder = slurm_cluster.state_dir / "hc-gputopo-check"
    folder.mkdir(exist_ok=True)
    for old in [*folder.glob("*.log"), *folder.glob("state.*.json")]:
        old.unlink()
    lib = fake_driver.build(folder / "driver")
    hc = HealthCheck(slurm_cluster, folder)
    for node in slurm_cluster.nodes:
        hc.machine(node)
        hc.kernel_log(node)
    gputopo = folder / "gputopo"
    gputopo.write_text(
        GPUTOPO.format(
            lib=lib, folder=folder, src=fake_driver.SRC, conf=slurm_cluster.conf, python=sys.executable
        )
    )
    gputopo.chmod(0o755)
    program = folder / "gputopo-healthcheck.sh"
    program.write_text(program_from_sample(folder))
    program.chmod(0o755)
    slurm_cluster.set_health_check(program, interval_s=INTERVAL_S)
    try:
        yield hc
    finally:
        slurm_cluster.set_health_check(None)
        for node in slurm_cluster.drain_reasons():
            if node in slurm_cluster.nodes:
                slurm_cluster.resume(node)


SICK = "remap 0 0 2 0 1"  # a row remapping failed on GPU0
SICK_REASON = "gputopo: a row remapping failed on GPU0 (2 rows remapped for uncorrectable errors)"


def test_a_sick_gpu_drains_its_node_and_the_healed_node_is_resumed(health_check: HealthCheck) -> None:
    hc, cluster = health_check, health_check.cluster
    hc.machine("node1", SICK)
    cluster.wait_for(
        lambda: cluster.drain_reasons().get("node1") == SICK_REASON,
        f"node1 drained in sinfo -R with {SICK_REASON!r}\n{hc.log('node1')}",
        timeout_s=WAIT_S,
    )
    assert cluster.node_state("node1").startswith("drain")
    # The healthy nodes were checked too, and left alone.
    cluster.wait_for(lambda: hc.runs("node2", "healthy") >= 1, f"node2 checked\n{hc.log('node2')}", WAIT_S)
    assert "node2" not in cluster.drain_reasons() and "node3" not in cluster.drain_reasons()
    # The sample's log: one timestamped line a run, with the node, the exit code and the reason.
    first = next(line for line in hc.lines("node1") if "problems:" in line)
    stamp, node, rc, rest = first.split(" ", 3)
    assert len(stamp) >= 19 and stamp[4] == "-" and "T" in stamp
    assert (node, rc) == ("node1", "rc=1") and rest.startswith("problems: a row remapping failed on GPU0")
    hc.machine("node1")  # the GPU was replaced
    cluster.wait_for(
        lambda: "node1" not in cluster.drain_reasons() and cluster.node_state("node1") == "idle",
        f"node1 resumed by --resume-if-healthy\n{hc.log('node1')}",
        timeout_s=WAIT_S,
    )


ADMIN = "maint: PSU swap (ticket 4711)"


def test_an_administrators_drain_is_kept_through_a_sick_and_a_healed_board(health_check: HealthCheck) -> None:
    hc, cluster = health_check, health_check.cluster
    cluster.run("scontrol", "update", "NodeName=node2", "State=DRAIN", f"Reason={ADMIN}")
    hc.machine("node2", SICK)
    cluster.wait_for(lambda: hc.runs("node2", "problems") >= 2, f"two sick checks\n{hc.log('node2')}", WAIT_S)
    assert cluster.drain_reasons().get("node2") == ADMIN
    assert any("slurm: not drained: node2 is already" in line and ADMIN in line for line in hc.lines("node2"))
    seen = hc.runs("node2", "healthy")
    hc.machine("node2")
    cluster.wait_for(
        lambda: hc.runs("node2", "healthy") >= seen + 2, f"two healed checks\n{hc.log('node2')}", WAIT_S
    )
    assert cluster.drain_reasons().get("node2") == ADMIN
    assert cluster.node_state("node2").startswith("drain")


def xid(code: int, when: float, text: str) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime(when))
    return f"{stamp} node kernel: NVRM: Xid (PCI:0000:18:00): {code}, pid=0, name=none, {text}\n"


def test_a_manual_resume_is_not_undone_by_an_old_xid_and_a_new_one_drains(health_check: HealthCheck) -> None:
    hc, cluster = health_check, health_check.cluster
    old = xid(79, time.time() - 120, "GPU has fallen off the bus.")
    hc.kernel_log("node3", old)
    cluster.wait_for(
        lambda: cluster.drain_reasons().get("node3", "").startswith("gputopo: Xid 79"),
        f"node3 drained for the Xid 79\n{hc.log('node3')}",
        WAIT_S,
    )
    # The administrator reseats the GPU and resumes the node by hand; the old line stays in the log.
    cluster.resume("node3")
    resumed_at = time.time()
    cluster.wait_for(
        lambda: hc.runs("node3", "healthy") >= 2, f"two checks after the resume\n{hc.log('node3')}", WAIT_S
    )
    assert "node3" not in cluster.drain_reasons() and cluster.node_state("node3") == "idle"
    state = json.loads((hc.folder / "state.node3.json").read_text())
    assert state["drain"] is None and state["acknowledged"]["by"] == "a person's resume"
    assert any(k.startswith("79|0000:18:00|") for k in state["acknowledged"]["keys"])
    # A new Xid after the resume drains again.
    time.sleep(max(0.0, resumed_at + 1.5 - time.time()))
    hc.kernel_log("node3", old, xid(48, time.time(), "DBE (0x1) detected"))
    cluster.wait_for(
        lambda: cluster.drain_reasons().get("node3", "").startswith("gputopo: Xid 48"),
        f"node3 drained for the new Xid 48\n{hc.log('node3')}",
        WAIT_S,
    )


def test_max_drained_holds_a_drain_back_on_a_3_node_cluster(health_check: HealthCheck) -> None:
    # The default --max-drained (10%, at least 1 node) lets one node of three carry a gputopo drain.
    hc, cluster = health_check, health_check.cluster
    hc.machine("node1", SICK)
    cluster.wait_for(
        lambda: cluster.drain_reasons().get("node1") == SICK_REASON,
        f"node1 drained\n{hc.log('node1')}",
        WAIT_S,
    )
    hc.machine("node2", SICK)
    cluster.wait_for(
        lambda: any("already carry a gputopo drain" in line for line in hc.lines("node2")),
        f"node2's drain held back\n{hc.log('node2')}",
        WAIT_S,
    )
    assert "node2" not in cluster.drain_reasons()
    # node1 healed: resumed, and node2 may be drained now.
    hc.machine("node1")
    cluster.wait_for(
        lambda: (
            cluster.drain_reasons().get("node2") == SICK_REASON and "node1" not in cluster.drain_reasons()
        ),
        f"node1 resumed, node2 drained\n{hc.log('node1')}\n{hc.log('node2')}",
        WAIT_S,
    )


# The real scontrol, with every call logged: how many `update ... State=DRAIN` the checks made.
LOGGING_SCONTROL = """#!/bin/sh
echo "$*" >> "{log}"
exec /usr/bin/scontrol "$@"
"""


def test_twenty_drains_at_once_drain_a_real_node_once_and_a_resume_is_kept(
    slurm_cluster: Any, tmp_path: Path
) -> None:
    """The drain race on the real Slurm: 20 `check --drain` at once on a sick node (one beside a plain
    check) make one `scontrol update ... State=DRAIN`; after the administrator's resume, a plain and a
    --drain check at once do not drain it again on the same old Xid."""
    import os
    import subprocess

    cluster = slurm_cluster
    if not Path("/usr/bin/scontrol").exists():
        pytest.skip("no /usr/bin/scontrol to wrap")
    lib = fake_driver.build(tmp_path / "driver")
    machine = tmp_path / "machine.txt"
    machine.write_text("\n".join(["driver 570.86.15", "cuda 12080", *healthy(0)]) + "\n")
    kern = tmp_path / "kern.log"
    kern.write_text(xid(79, time.time() - 60, "GPU has fallen off the bus."))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(LOGGING_SCONTROL.format(log=log))
    (bin_dir / "scontrol").chmod(0o755)
    state = tmp_path / "state.json"
    env = {
        **fake_driver.env_for(lib, machine),
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "SLURM_CONF": str(cluster.conf),
        "SLURMD_NODENAME": "node1",
    }
    env = {k: v for k, v in env.items() if not (k.startswith("SLURM_") and k not in ("SLURM_CONF",))}
    env["SLURMD_NODENAME"] = "node1"
    argv = [sys.executable, "-m", "gputopo", "check", "--sample-s", "0.2", "--kernel-log", str(kern)]
    argv += ["--state", str(state), "--budget", "120", "--max-drained", "3"]

    def at_once(*drain_flags: bool) -> list[subprocess.CompletedProcess[str]]:
        procs = [
            subprocess.Popen(
                argv + (["--drain"] if d else []),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for d in drain_flags
        ]
        return [subprocess.CompletedProcess(p.args, p.wait(300), *p.communicate()) for p in procs]

    def drains() -> int:
        return sum(1 for c in log.read_text().splitlines() if "State=DRAIN" in c) if log.exists() else 0

    try:
        results = at_once(*([True] * 20), False)
        assert [r.returncode for r in results] == [1] * 21, [r.stderr for r in results if r.returncode != 1]
        assert drains() == 1, log.read_text()
        assert cluster.drain_reasons().get("node1", "").startswith("gputopo: Xid 79")
        assert json.loads(state.read_text())["drain"] is not None
        cluster.resume("node1")  # the administrator reseats the GPU and resumes the node
        cluster.wait_for(lambda: "node1" not in cluster.drain_reasons(), "node1 resumed", 30)
        results = at_once(False, True)
        # The plain check reads no node: until a --drain check records the resume it still sees the Xid
        # (exit 1); the --drain check sees the resume, acknowledges the line and is healthy.
        assert results[1].returncode == 0, results[1].stdout + results[1].stderr
        assert drains() == 1 and "node1" not in cluster.drain_reasons()
        assert json.loads(state.read_text())["acknowledged"]["by"] == "a person's resume"
    finally:
        if "node1" in cluster.drain_reasons():
            cluster.resume("node1")
