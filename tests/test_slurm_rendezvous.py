"""Where the nodes of a Slurm job meet: node 0's NodeAddr (not its name), on a port derived from the job id,
and a rendezvous that cannot work refused at once in one line (issue 22, items 7 and 14).

No Slurm needed: `scontrol` is a shell-script fake on PATH. The same paths under a real `srun` are in
tests/test_slurm_real.py.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from gputopo.cli import run_main
from gputopo.errors import UsageError
from gputopo.launch.slurm import (
    SLURM_RDZV_PORT_HIGH,
    SLURM_RDZV_PORT_LOW,
    rendezvous_port,
    slurm_job,
)
from gputopo.system import net, scontrol
from gputopo.system.scontrol import node_addr_from_show_node

skip_on_windows = pytest.mark.skipif(sys.platform == "win32", reason="shell-script fakes")

# --------------------------------------------------------------------------------------------------------
# The port


def test_the_port_is_the_same_for_one_job_and_differs_between_neighbouring_jobs():
    assert rendezvous_port("81234") == rendezvous_port("81234") == rendezvous_port(" 81234\n")
    ports = [rendezvous_port(str(job)) for job in range(5000, 5000 + 3000)]
    assert len(set(ports)) == len(ports)  # consecutive jobs sharing a first node never meet on one port


def test_the_port_stays_above_torchs_defaults_and_below_the_ephemeral_range():
    span = SLURM_RDZV_PORT_HIGH - SLURM_RDZV_PORT_LOW + 1
    assert rendezvous_port("0") == SLURM_RDZV_PORT_LOW
    assert rendezvous_port(str(span - 1)) == SLURM_RDZV_PORT_HIGH
    assert rendezvous_port(str(span)) == SLURM_RDZV_PORT_LOW  # wraps
    for job in ("1", "29400", "184467", "4294967294", "99999999999999999999"):
        port = rendezvous_port(job)
        assert 29500 < port < 32768 and port != 29400, job


def test_a_job_id_that_is_not_a_number_is_hashed_the_same_everywhere():
    span = SLURM_RDZV_PORT_HIGH - SLURM_RDZV_PORT_LOW + 1
    assert rendezvous_port("abc_1") == SLURM_RDZV_PORT_LOW + zlib.crc32(b"abc_1") % span


# --------------------------------------------------------------------------------------------------------
# NodeAddr


# `scontrol -o show node node1` on the test cluster (scripts/slurm-local), trimmed.
SHOW_NODE_ONE_LINE = (
    "NodeName=node1 Arch=x86_64 CoresPerSocket=2 CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.34 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 NodeHostName=node1 "
    "Port=6831 Version=22.05.8 OS=Linux 6.1 RealMemory=21694 State=IDLE Partitions=debug\n"
)
# `scontrol show node` (no -o): a paragraph per node.
SHOW_NODES_PARAGRAPHS = """NodeName=gpu-a07 Arch=x86_64 CoresPerSocket=32
   CPUAlloc=0 CPUEfctv=128 CPUTot=128 CPULoad=0.01
   NodeAddr=10.12.0.7 NodeHostName=gpu-a07 Version=23.02.7

NodeName=gpu-a08 Arch=x86_64 CoresPerSocket=32
   NodeAddr=gpu-a08-ib NodeHostName=gpu-a08 Version=23.02.7

NodeName=gpu-a09 Arch=x86_64 CoresPerSocket=32
   NodeAddr=(null) NodeHostName=gpu-a09 Version=23.02.7
"""


def test_node_addr_is_read_from_scontrol_show_node():
    assert node_addr_from_show_node(SHOW_NODE_ONE_LINE, "node1") == "127.0.0.1"
    assert node_addr_from_show_node(SHOW_NODES_PARAGRAPHS, "gpu-a07") == "10.12.0.7"
    assert node_addr_from_show_node(SHOW_NODES_PARAGRAPHS, "gpu-a08") == "gpu-a08-ib"
    # Another node's address is never taken for this one's; nothing known is None.
    assert node_addr_from_show_node(SHOW_NODES_PARAGRAPHS, "gpu-a09") is None
    assert node_addr_from_show_node(SHOW_NODES_PARAGRAPHS, "gpu-a0") is None
    assert node_addr_from_show_node(SHOW_NODE_ONE_LINE, "node2") is None
    assert node_addr_from_show_node("", "node1") is None
    assert node_addr_from_show_node("Node node1 not found\n", "node1") is None


# What `srun -N2` gives node 1 of a two-node job.
SRUN_NODE1_OF_2 = {
    "SLURM_JOB_ID": "81234",
    "SLURM_JOB_NODELIST": "gpu-a[07-08]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "gpu-a[07-08]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NODEID": "1",
    "SLURMD_NODENAME": "gpu-a08",
    "SLURM_STEP_NUM_TASKS": "2",
}


def test_the_job_meets_at_node_0s_address_on_its_own_port():
    asked: list[str] = []

    def addr(name: str) -> str | None:
        asked.append(name)
        return {"gpu-a07": "10.12.0.7"}.get(name)

    job = slurm_job(SRUN_NODE1_OF_2, hostnames=lambda _: None, node_addr=addr)
    assert job is not None and asked == ["gpu-a07"]
    assert (job.first_host, job.this_host, job.rendezvous_host) == ("gpu-a07", "gpu-a08", "10.12.0.7")
    assert job.rendezvous_endpoint == f"10.12.0.7:{rendezvous_port('81234')}"
    # No address known: the name stands in (and is checked for resolving before the run).
    job = slurm_job(SRUN_NODE1_OF_2, hostnames=lambda _: None, node_addr=lambda _: None)
    assert job is not None and job.rendezvous_host == "gpu-a07"
    # An IPv6 NodeAddr is bracketed, as --rdzv-endpoint spells it.
    job = slurm_job(SRUN_NODE1_OF_2, hostnames=lambda _: None, node_addr=lambda _: "fd00::7")
    assert job is not None and job.rendezvous_endpoint == f"[fd00::7]:{rendezvous_port('81234')}"


def test_a_one_node_job_asks_slurm_for_no_address():
    one = {**SRUN_NODE1_OF_2, "SLURM_STEP_NODELIST": "gpu-a07", "SLURM_STEP_NUM_NODES": "1"}
    one.update({"SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_NODEID": "0"})

    def addr(name: str) -> str | None:
        raise AssertionError("scontrol show node asked for a one-node job")

    job = slurm_job(one, hostnames=lambda _: None, node_addr=addr)
    assert job is not None and job.first_addr is None


def _fake_scontrol(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "scontrol"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


FAKE_SCONTROL = """echo "$@" >> "{log}"
case "$1 $2 $3" in
"show hostnames "*) echo gpu-a07; echo gpu-a08 ;;
"-o show node") {show_node} ;;
*) exit 1 ;;
esac
"""


@skip_on_windows
def test_scontrol_node_addr_asks_for_one_line_per_node(tmp_path, monkeypatch):
    log = tmp_path / "args"
    show = "echo 'NodeName=gpu-a07 Arch=x86_64 NodeAddr=10.12.0.7 NodeHostName=gpu-a07 Port=6818'"
    _fake_scontrol(tmp_path / "bin", FAKE_SCONTROL.format(log=log, show_node=show))
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "bin"), "/usr/bin", "/bin"]))
    assert scontrol.node_addr("gpu-a07") == "10.12.0.7"
    assert log.read_text().splitlines() == ["-o show node gpu-a07"]
    assert scontrol.node_addr("gpu-a08") is None  # the answer names another node


@skip_on_windows
@pytest.mark.parametrize(
    "show",
    [
        "echo 'slurm_load_node error: Unable to contact slurm controller' >&2; exit 1",
        "exec sleep 5",
        "true",
    ],
)
def test_scontrol_node_addr_without_an_answer_is_none(tmp_path, monkeypatch, show):
    _fake_scontrol(tmp_path / "bin", FAKE_SCONTROL.format(log=tmp_path / "args", show_node=show))
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "bin"), "/usr/bin", "/bin"]))
    assert scontrol.node_addr("gpu-a07", timeout_s=0.5) is None


@skip_on_windows
def test_without_any_path_scontrol_is_found_where_slurm_installs_it(tmp_path, monkeypatch):
    # slurmd runs a HealthCheckProgram with no PATH at all (tests/test_slurm_real.py sees it).
    fake = _fake_scontrol(tmp_path / "opt-slurm-bin", "exit 0\n")
    monkeypatch.setattr(scontrol, "NO_PATH_DIRS", (str(tmp_path / "nothing-here"), str(fake.parent)))
    monkeypatch.delenv("PATH", raising=False)
    assert scontrol.scontrol_path() == str(fake)
    # A PATH that is set is obeyed, even when it lacks scontrol.
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    assert scontrol.scontrol_path() is None


# --------------------------------------------------------------------------------------------------------
# The machine's answers: does a host resolve, is a port taken


def test_resolves():
    assert net.resolves("localhost")
    assert net.resolves("127.0.0.1")
    # RFC 6761: names under .invalid never resolve.
    assert not net.resolves("node1.gputopo-test.invalid")
    assert not net.resolves("")


def test_port_taken_sees_a_listener_and_not_a_closed_port():
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert net.port_taken(port)
    assert not net.port_taken(port)


# --------------------------------------------------------------------------------------------------------
# The CLI under a (faked) Slurm step


@pytest.fixture
def slurm_node0(tmp_path, monkeypatch):
    """This process as node 0 of a two-node step whose node 0 has NodeAddr 127.0.0.1."""
    show = "echo 'NodeName=gpu-a07 NodeAddr=127.0.0.1 NodeHostName=gpu-a07 Port=6818'"
    _fake_scontrol(tmp_path / "bin", FAKE_SCONTROL.format(log=tmp_path / "args", show_node=show))
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "bin"), os.environ.get("PATH", "")]))
    for name in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(name)
    env = {**SRUN_NODE1_OF_2, "SLURM_NODEID": "0", "SLURM_STEP_NODEID": "0", "SLURMD_NODENAME": "gpu-a07"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@skip_on_windows
def test_under_srun_the_node_is_named_by_slurm_and_meets_at_the_node_addr(slurm_node0):
    from gputopo.services.across_nodes import node_options

    port = rendezvous_port(slurm_node0["SLURM_JOB_ID"])
    if net.port_taken(port):
        pytest.skip(f"port {port} is taken on this machine by something else")
    node = node_options(None, None, None, None, None, None, None)
    assert (node.nnodes, node.node_rank, node.source) == (2, 0, "slurm")
    assert (node.host, node.port, node.hostname) == ("127.0.0.1", port, "gpu-a07")
    assert node.rdzv_id == "gputopo-81234"
    # --rdzv-endpoint wins over the job's address and port; the node keeps its Slurm name.
    node = node_options(None, None, "head:5000", None, None, None, None)
    assert (node.host, node.port, node.hostname) == ("head", 5000, "gpu-a07")


@skip_on_windows
def test_under_srun_a_taken_rendezvous_port_is_refused_in_one_line(slurm_node0, capsys, tmp_path):
    port = rendezvous_port(slurm_node0["SLURM_JOB_ID"])
    with socket.socket() as other_jobs_store:
        other_jobs_store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            other_jobs_store.bind(("0.0.0.0", port))
        except OSError:
            pytest.skip(f"port {port} is taken on this machine by something else")
        other_jobs_store.listen()
        got = run_main(["probe", "--device", "cpu", "--gpus", "0", "--report-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert got == 2
    assert len(err) == 2 and err[0].startswith("error: ") and err[1].startswith("hint: ")
    assert f"port {port}" in err[0] and "already taken" in err[0] and "--rdzv-endpoint" in err[1]


def test_with_a_taken_port_only_node_0_refuses(slurm_node0, monkeypatch):
    # The other nodes are clients of node 0's store: the port is node 0's to hold.
    from gputopo.services.across_nodes import node_options

    monkeypatch.setattr(net, "port_taken", lambda port: True)
    with pytest.raises(UsageError, match="already taken"):
        node_options(None, None, None, None, None, None, None)
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_STEP_NODEID", "1")
    assert node_options(None, None, None, None, None, None, None).node_rank == 1


@pytest.mark.slow
def test_a_rendezvous_host_that_does_not_resolve_fails_at_once_in_one_line(tmp_path):
    pytest.importorskip("torch")
    argv = [
        sys.executable, "-m", "gputopo", "probe", "--device", "cpu", "--gpus", "0", "--mode", "allreduce",
        "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node1.gputopo-test.invalid:29400",
        "--report-dir", str(tmp_path),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    # Before this check every node waited the whole --rdzv-timeout (600 s) for the name.
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(err) == 2 and err[0].startswith("error: ") and err[1].startswith("hint: "), done.stderr
    assert "'node1.gputopo-test.invalid'" in err[0] and "does not resolve" in err[0]
