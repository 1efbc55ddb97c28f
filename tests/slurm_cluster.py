"""The ``slurm_cluster`` fixture: a real Slurm cluster of ``NODES`` nodes on this machine, for the session.

It runs ``scripts/slurm-local up`` (or uses the cluster that is already up in the same state directory, as
CI's ``.ci/run`` leaves it) and, at the end of the session, ``down`` only when it started the cluster
itself. Where Slurm cannot start (not root, no apt, no package mirror, a daemon that dies) every test
that asks for it is skipped with the script's own reason. ``GPUTOPO_SLURM=0`` skips them without trying;
``GPUTOPO_SLURM_DIR`` moves the state directory (default /tmp/gputopo-slurm, the script's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm-local"
NODES = 3
# The first start may install packages (measured 4-33 s for apt alone); the script has its own deadline.
UP_TIMEOUT_S = 600
COMMAND_TIMEOUT_S = 60


@dataclass(frozen=True)
class SlurmCluster:
    """A running cluster: nodes node1..nodeN at NodeAddr 127.0.0.1, all on this host."""

    state_dir: Path
    nodes: tuple[str, ...]
    started_here: bool

    @property
    def conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment for a Slurm client: SLURM_CONF set, any SLURM_* of an outer job
        dropped (pytest itself may run inside a Slurm job), then ``extra``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), "/usr/sbin", "/sbin"])
        env.update(extra)
        return env

    def run(self, *argv: str, timeout_s: float = COMMAND_TIMEOUT_S, check: bool = True, **kw: Any):
        """Run a Slurm command (``scontrol ...``, ``srun ...``); its output as text."""
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=kw.pop("env", None) or self.env(),
            check=False,
            **kw,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def script(self, *args: str, timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
        return self.run("bash", str(SCRIPT), *args, "--dir", str(self.state_dir), timeout_s=timeout_s)

    def set_health_check(self, program: Path | str | None, interval_s: int = 5) -> None:
        """Set ``HealthCheckProgram`` (an absolute path; ``None`` removes it) and its interval, then
        ``scontrol reconfigure`` (no restart)."""
        if program is None:
            self.script("healthcheck", "--off")
        else:
            self.script("healthcheck", str(program), str(interval_s))

    def node_state(self, node: str) -> str:
        """``sinfo``'s long state of ``node``: idle, drained, draining, ... (a trailing flag kept)."""
        out = self.run("sinfo", "-h", "-N", "-n", node, "-o", "%T").stdout.split()
        return out[0] if out else ""

    def drain_reasons(self) -> dict[str, str]:
        """``sinfo -R``: node name -> reason, for every node down or drained with one."""
        out = self.run("sinfo", "-h", "-R", "-N", "-o", "%N|%E").stdout
        return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)

    def resume(self, node: str) -> None:
        """Bring ``node`` back (``State=RESUME``) and wait until it is idle again."""
        self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        self.wait_for(lambda: self.node_state(node) == "idle", f"{node} idle again")

    def wait_for(self, ready: Any, what: str, timeout_s: float = 60) -> None:
        """Poll ``ready()`` until it holds; fail naming ``what`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"not seen within {timeout_s:g} s: {what}")
            time.sleep(0.5)


_failed: list[str] = []


def _why_not() -> str | None:
    """Why no cluster can start here, where that is known without trying."""
    if os.environ.get("GPUTOPO_SLURM") == "0":
        return "GPUTOPO_SLURM=0"
    if not sys.platform.startswith("linux"):
        return "a local Slurm cluster needs Linux"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (the daemons run as root; scripts/slurm-local up)"
    if shutil.which("bash") is None or not SCRIPT.is_file():
        return f"no bash or no {SCRIPT}"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> Any:
    """A real ``NODES``-node Slurm cluster on this machine; skips with the reason where none can start."""
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    if _failed:
        pytest.skip(_failed[0])
    state_dir = Path(os.environ.get("GPUTOPO_SLURM_DIR", "/tmp/gputopo-slurm"))
    cluster = SlurmCluster(state_dir, tuple(f"node{k}" for k in range(1, NODES + 1)), started_here=False)
    nodes_file = state_dir / "nodes"
    status = subprocess.run(
        ["bash", str(SCRIPT), "status", "--dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    up_already = (
        status.returncode == 0 and nodes_file.is_file() and nodes_file.read_text().strip() == str(NODES)
    )
    if not up_already:
        try:
            done = subprocess.run(
                ["bash", str(SCRIPT), "up", "--nodes", str(NODES), "--dir", str(state_dir)],
                capture_output=True,
                text=True,
                timeout=UP_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            done = None
        if done is None or done.returncode != 0:
            said = (done.stderr.strip().splitlines() or ["(nothing)"]) if done else ["timed out"]
            reason = f"Slurm did not start (scripts/slurm-local up): {' | '.join(said[-4:])}"
            _failed.append(reason)
            subprocess.run(["bash", str(SCRIPT), "down", "--dir", str(state_dir)], timeout=120, check=False)
            pytest.skip(reason)
        cluster = SlurmCluster(cluster.state_dir, cluster.nodes, started_here=True)
    yield cluster
    if cluster.started_here:
        subprocess.run(
            ["bash", str(SCRIPT), "down", "--dir", str(state_dir)],
            capture_output=True,
            timeout=120,
            check=False,
        )
