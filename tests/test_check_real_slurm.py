"""``gputopo check`` as a real Slurm node's ``HealthCheckProgram``: a one-node cluster of Debian's munge,
slurmctld and slurmd, started here as root with its own ports, socket, state and PID files (see
shared/docs/SLURM-LOCAL.md for the pitfalls). slurmd runs the check with no PATH and only
``SLURMD_NODENAME``; the check drains the node (seen in ``sinfo -R``), resumes it once healed, and leaves an
administrator's drain alone. Skipped, with the reason, where Slurm cannot start."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import fake_driver
from test_health_reads import healthy

SLURM_TOOLS = ("slurmctld", "slurmd", "scontrol", "sinfo", "munged")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="a Slurm cluster needs root"),
    pytest.mark.skipif(
        any(shutil.which(t, path="/usr/sbin:/usr/bin:/sbin:/bin") is None for t in SLURM_TOOLS),
        reason="Slurm or munge is not installed (apt-get install munge slurmctld slurmd slurm-client)",
    ),
    pytest.mark.skipif(fake_driver.compiler() is None, reason="no C compiler to build the fake driver"),
]

INTERVAL_S = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, check: Callable[[], bool], timeout_s: float, log: Path | None = None) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
    pytest.fail(f"{what} within {timeout_s:g} s\n{tail}")


def _stop(pid_file: Path) -> None:
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


class Cluster:
    def __init__(self, root: Path, node: str) -> None:
        self.root = root
        self.node = node
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        self.machine = root / "machine.txt"

    def run(self, *args: str) -> str:
        done = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=30)
        return done.stdout + done.stderr

    def reasons(self) -> str:
        return self.run("sinfo", "-R", "-h", "-o", "%E")

    def state(self) -> str:
        return self.run("sinfo", "-h", "-n", self.node, "-o", "%T").strip()

    def write_machine(self, lines: list[str]) -> None:
        self.machine.write_text("\n".join(["driver 570.86.15", "cuda 12080", *lines]) + "\n")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="gputopo-slurm-", dir="/tmp"))
    root.chmod(0o755)
    node = socket.gethostname().split(".", 1)[0]
    c = Cluster(root, node)
    try:
        munge_dir = root / "munge"
        munge_dir.mkdir()
        shutil.copy("/etc/munge/munge.key", munge_dir / "munge.key")
        shutil.chown(munge_dir, "munge", "munge")
        shutil.chown(munge_dir / "munge.key", "munge", "munge")
        munge_dir.chmod(0o700)
        (munge_dir / "munge.key").chmod(0o600)
        sock_dir = root / "munge-socket"  # munged wants its socket's folder open to all (execute)
        sock_dir.mkdir()
        shutil.chown(sock_dir, "munge", "munge")
        sock_dir.chmod(0o755)
        sock = sock_dir / "munge.sock"
        started = subprocess.run(
            [
                "runuser", "-u", "munge", "--", "/usr/sbin/munged",
                f"--key-file={munge_dir / 'munge.key'}", f"--socket={sock}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={munge_dir / 'munged.log'}", f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if started.returncode != 0:
            pytest.skip(f"munged does not start here: {started.stderr.strip()[:200]}")
        lib = fake_driver.build(root / "driver")
        c.write_machine(healthy(0))
        hc = root / "healthcheck.sh"
        hc.write_text(
            "#!/bin/sh\n"
            "# slurmd runs this with no PATH: everything by absolute path, the environment set here.\n"
            f"export LD_LIBRARY_PATH={lib} FAKE_NVML_CONFIG={c.machine} PYTHONPATH={fake_driver.SRC} "
            f"SLURM_CONF={root / 'slurm.conf'}\n"
            f"exec {sys.executable} -m gputopo check --sample-s 0.2 --budget 15 --kernel-log /dev/null "
            f"--drain --resume-if-healthy >> {root / 'healthcheck.log'} 2>&1\n"
        )
        hc.chmod(0o755)
        spec = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout.split()
        fields = dict(p.split("=", 1) for p in spec if "=" in p)
        memory = int(int(fields.get("RealMemory", "1024")) * 0.9)
        hardware = " ".join(
            f"{k}={fields[k]}"
            for k in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
            if k in fields
        )
        for d in ("state", "spool"):
            (root / d).mkdir()
        (root / "slurm.conf").write_text(
            f"""ClusterName=gputopotest
    SlurmctldHost={node}(127.0.0.1)
    SlurmctldPort={_free_port()}
    SlurmdPort={_free_port()}
    AuthType=auth/munge
    AuthInfo=socket={sock}
    CredType=cred/munge
    SlurmUser=root
    SlurmdUser=root
    StateSaveLocation={root / "state"}
    SlurmdSpoolDir={root / "spool"}
    SlurmctldPidFile={root / "slurmctld.pid"}
    SlurmdPidFile={root / "slurmd.pid"}
    SlurmctldLogFile={root / "slurmctld.log"}
    SlurmdLogFile={root / "slurmd.log"}
    ProctrackType=proctrack/linuxproc
    TaskPlugin=task/none
    JobAcctGatherType=jobacct_gather/none
    ReturnToService=2
    MpiDefault=none
    MailProg=/bin/true
    HealthCheckProgram={hc}
    HealthCheckInterval={INTERVAL_S}
    HealthCheckNodeState=ANY
    NodeName={node} NodeAddr=127.0.0.1 {hardware} RealMemory={memory} State=UNKNOWN
    PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
    """
        )
        for cmd in (["slurmctld", "-i", "-c"], ["slurmd"]):
            done = subprocess.run(cmd, env=c.env, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                pytest.skip(f"{cmd[0]} does not start here: {(done.stderr or done.stdout).strip()[:200]}")
        _wait("slurmctld answering", lambda: "is UP" in c.run("scontrol", "ping"), 30, root / "slurmctld.log")
        _wait(
            "the node up",
            lambda: c.state() in ("idle", "drained", "draining", "mixed"),
            30,
            root / "slurmd.log",
        )
        yield c
    finally:
        _stop(root / "slurmd.pid")
        _stop(root / "slurmctld.pid")
        _stop(munge_dir / "munged.pid")
        shutil.rmtree(root, ignore_errors=True)


def test_health_check_program_drains_then_resumes_a_healed_node(cluster: Cluster) -> None:
    cluster.write_machine([*healthy(0), "remap 0 0 0 1 0"])
    wanted = "gputopo: a row remapping is pending on GPU0"
    log = cluster.root / "healthcheck.log"
    _wait("the drain reason in sinfo -R", lambda: wanted in cluster.reasons(), 6 * INTERVAL_S, log)
    cluster.write_machine(healthy(0))
    _wait("the node resumed", lambda: wanted not in cluster.reasons(), 6 * INTERVAL_S, log)
    assert "drain" not in cluster.state()


def test_an_administrators_drain_is_left_alone(cluster: Cluster) -> None:
    cluster.write_machine(healthy(0))
    cluster.run("scontrol", "update", f"NodeName={cluster.node}", "State=DRAIN", "Reason=admin: fan noise")
    log = cluster.root / "healthcheck.log"
    seen = _healthy_runs(log)
    # Two more health checks run, each healthy, and the admin's reason stays.
    _wait("two more health checks", lambda: _healthy_runs(log) >= seen + 2, 4 * INTERVAL_S, log)
    assert "admin: fan noise" in cluster.reasons()
    cluster.run("scontrol", "update", f"NodeName={cluster.node}", "State=RESUME")


def _healthy_runs(log: Path) -> int:
    return log.read_text(errors="replace").count("healthy: ") if log.exists() else 0
