"""gputopo under a real Slurm: a three-node cluster on this machine (scripts/slurm-local, the
``slurm_cluster`` fixture), skipped with the reason where Slurm cannot start.

The nodes node1..node3 are three ``slurmd -N nodeK`` at NodeAddr 127.0.0.1: their names do not resolve
and they share this host's hostname, as on clusters whose node names are not the address to connect to.
What gputopo must get right there: read the step from the environment srun really sets, meet at node 0's
NodeAddr on the job's own port, name nodes by their Slurm names, and survive slurmd's empty environment.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from gputopo.launch.slurm import rendezvous_port
from gputopo.system import net

pytestmark = pytest.mark.slurm

SRC = Path(__file__).resolve().parents[1] / "src"


def srun(cluster: Any, nodes: int, *argv: str, timeout_s: float = 120, **kw: Any):
    """``srun -N nodes --ntasks-per-node 1`` with a time limit, the rest of the nodes left running
    when one task fails (the probe's nodes each exit by the run's verdict)."""
    return cluster.run(
        "srun", "-N", str(nodes), "--ntasks-per-node", "1", "--time", "5", "--kill-on-bad-exit=0",
        *argv, timeout_s=timeout_s, check=False, **kw,
    )  # fmt: skip


def task_env(cluster: Any, **extra: str) -> dict[str, str]:
    """The test process's environment for srun, with this checkout's code first on PYTHONPATH."""
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return cluster.env(PYTHONPATH=path, GPUTOPO_DEBUG="0", **extra)


# What each task sees, and what gputopo.launch.slurm makes of it (with the real scontrol).
SHOW_TASK = """
import json, os, socket
from gputopo.launch.slurm import slurm_job
from gputopo.system.scontrol import hostnames, node_addr
job = slurm_job(os.environ, hostnames=hostnames, node_addr=node_addr)
keys = ("SLURM_NODEID", "SLURMD_NODENAME", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_JOB_ID",
        "SLURM_STEP_NUM_TASKS", "SLURM_JOB_NODELIST")
print(json.dumps({
    "env": {k: os.environ.get(k) for k in keys},
    "gethostname": socket.gethostname(),
    "job": {"node_id": job.node_id, "nnodes": job.nnodes, "hosts": list(job.hosts),
            "this_host": job.this_host, "ntasks": job.ntasks, "rendezvous_host": job.rendezvous_host,
            "rendezvous_port": job.rendezvous_port},
}))
"""


def test_srun_sets_what_gputopo_reads(slurm_cluster, tmp_path):
    done = srun(slurm_cluster, 3, "--output", str(tmp_path / "out-%t"), sys.executable, "-c", SHOW_TASK,
                env=task_env(slurm_cluster))  # fmt: skip
    assert done.returncode == 0, done.stderr
    tasks = [json.loads((tmp_path / f"out-{t}").read_text()) for t in range(3)]
    job_id = tasks[0]["env"]["SLURM_JOB_ID"]
    for task in tasks:
        env, job = task["env"], task["job"]
        assert env["SLURM_STEP_NODELIST"] == env["SLURM_JOB_NODELIST"] == "node[1-3]"
        assert (env["SLURM_STEP_NUM_NODES"], env["SLURM_STEP_NUM_TASKS"]) == ("3", "3")
        assert job["hosts"] == ["node1", "node2", "node3"] and (job["nnodes"], job["ntasks"]) == (3, 3)
        assert job["node_id"] == int(env["SLURM_NODEID"])
        # This node's name as slurmd knows it is the one gputopo names the node by.
        assert job["this_host"] == env["SLURMD_NODENAME"] == f"node{job['node_id'] + 1}"
        # Every node meets at node1's NodeAddr, on one port derived from the job id.
        assert job["rendezvous_host"] == "127.0.0.1"
        assert env["SLURM_JOB_ID"] == job_id and job["rendezvous_port"] == rendezvous_port(job_id)
    assert sorted(t["job"]["node_id"] for t in tasks) == [0, 1, 2]
    # Why nodes are never told apart by gethostname(): here all three share one.
    assert len({t["gethostname"] for t in tasks}) == 1


def test_the_node_name_does_not_resolve_but_scontrol_has_its_address(slurm_cluster):
    from gputopo.system import scontrol

    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(slurm_cluster.conf)
    try:
        assert scontrol.node_addr("node1") == "127.0.0.1"
        assert scontrol.node_addr("node-that-is-not-there") is None
        assert scontrol.hostnames("node[1-3]") == ["node1", "node2", "node3"]
    finally:
        if old is None:
            del os.environ["SLURM_CONF"]
        else:
            os.environ["SLURM_CONF"] = old
    if net.resolves("node1"):
        pytest.skip("this machine resolves node1: the unresolvable-name half does not apply")
    show = slurm_cluster.run("scontrol", "show", "node", "node1").stdout
    assert "NodeAddr=127.0.0.1" in show


def probe_argv(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "gputopo", "probe", "--device", "cpu", "--gpus", "0", "--mode", "allreduce",
        "--timeout", "30", "--rdzv-timeout", "60", "--report-dir", str(tmp_path / "reports"), "--json",
        "-b", "64K", "-e", "256K", *extra,
    ]  # fmt: skip


def run_probe(cluster: Any, tmp_path: Path, nodes: int, *extra: str, **env: str):
    """``srun -N nodes gputopo probe ...``: (srun's exit, each task's JSON document or None, stderr)."""
    done = srun(
        cluster, nodes, "--output", str(tmp_path / "out-%t.json"), "--error", str(tmp_path / "err-%t.txt"),
        *probe_argv(tmp_path, *extra), timeout_s=300, env=task_env(cluster, **env),
    )  # fmt: skip
    docs, errs = [], []
    for t in range(nodes):
        out = tmp_path / f"out-{t}.json"
        text = out.read_text() if out.exists() else ""
        docs.append(json.loads(text) if text.strip() else None)
        err = tmp_path / f"err-{t}.txt"
        errs.append(err.read_text() if err.exists() else "")
    return done, docs, errs


@pytest.mark.slow
def test_the_multinode_probe_runs_under_srun(slurm_cluster, tmp_path):
    pytest.importorskip("torch")
    done, docs, errs = run_probe(slurm_cluster, tmp_path, 3)
    assert done.returncode == 0, "\n".join(errs) + done.stderr
    doc = docs[0]
    assert doc is not None and doc["verdict"] == "pass", errs[0]
    assert doc["report"] is not None and all(d is not None and d["report"] is None for d in docs[1:])
    # Nodes named by Slurm, not by the hostname they all share.
    assert [(n["node_rank"], n["host"]) for n in doc["nodes"]] == [(0, "node1"), (1, "node2"), (2, "node3")]
    section = doc["internode"]
    assert section["status"] == "ok" and section["source"] == "slurm"
    host, port = section["endpoint"].rsplit(":", 1)
    assert host == "127.0.0.1" and 29500 < int(port) < 32768
    assert all(t["wrong"] == 0 for t in section["tests"])
    # CPU ranks talk gloo, not NCCL: no transport or line rate to judge, and the report says so.
    assert section["network"] == {"transport": "gloo", "judged": False}
    assert any("not judged (gloo" in n for n in section["notes"])
    assert not net.port_taken(int(port))  # nothing of the run is left holding the job's port


@pytest.mark.slow
def test_a_corrupting_node_under_srun_is_named(slurm_cluster, tmp_path):
    pytest.importorskip("torch")
    done, docs, errs = run_probe(slurm_cluster, tmp_path, 3, "--inject", "corrupt", "--inject-node", "1")
    assert done.returncode != 0  # every node exits 1 on a failed run
    doc = docs[0]
    assert doc is not None and doc["verdict"] == "fail", errs[0]
    found = [(f["kind"], f["nodes"]) for n in doc["nodes"] for f in n["findings"]]
    assert found == [("corrupt", [1])]
    assert [n["verdict"] for n in doc["nodes"]] == ["pass", "fail", "pass"]
    assert "node 1 (node2)" in doc["nodes"][1]["findings"][0]["detail"]


@pytest.mark.slow
def test_a_slow_node_under_srun_is_named_by_its_slurm_name(slurm_cluster, tmp_path):
    pytest.importorskip("torch")
    done, docs, errs = run_probe(slurm_cluster, tmp_path, 3, "--inject", "slow", "--inject-node", "2")
    assert done.returncode != 0
    doc = docs[0]
    assert doc is not None and doc["verdict"] == "fail", errs[0]
    found = [(f["kind"], f["nodes"]) for n in doc["nodes"] for f in n["findings"]]
    assert found == [("straggler", [2])]
    assert "node 2 (node3)" in doc["nodes"][2]["findings"][0]["detail"]
    # Every node shares this machine's host name; the document goes by Slurm's.
    assert doc["environment"]["hostname"] == "node1"


@pytest.mark.slow
def test_doctor_across_nodes_runs_under_srun(slurm_cluster, tmp_path):
    pytest.importorskip("torch")
    argv = [
        sys.executable, "-m", "gputopo", "doctor", "--input", "sample:workstation-2gpu-nvlink",
        "--skip-probe", "--rdzv-timeout", "60", "--report-dir", str(tmp_path / "reports"), "--json",
    ]  # fmt: skip
    done = srun(
        slurm_cluster, 2, "--output", str(tmp_path / "out-%t"), "--error", str(tmp_path / "err-%t"), *argv,
        timeout_s=300, env=task_env(slurm_cluster),
    )  # fmt: skip
    errs = [(tmp_path / f"err-{t}").read_text() for t in range(2)]
    assert done.returncode == 0, "\n".join(errs)
    doc = json.loads((tmp_path / "out-0").read_text())
    assert doc["verdict"] == "healthy"
    assert [(n["node_rank"], n["host"], n["verdict"]) for n in doc["nodes"]] == [
        (0, "node1", "pass"),
        (1, "node2", "pass"),
    ]
    assert doc["internode"]["endpoint"].startswith("127.0.0.1:")


@pytest.mark.slow
def test_without_node_0s_address_every_node_fails_at_once_in_one_line(slurm_cluster, tmp_path):
    # No scontrol on PATH: node 0's address cannot be asked, its name stands in and does not resolve.
    # Before the check every node waited the whole --rdzv-timeout for it.
    if net.resolves("node1"):
        pytest.skip("this machine resolves node1")
    pytest.importorskip("torch")
    empty = tmp_path / "no-scontrol"
    empty.mkdir()
    # srun itself is started with the full PATH; the tasks get one without scontrol (srun's
    # `--export ALL,PATH=...` kept the caller's PATH on Slurm 22.05, so env(1) sets it).
    done = srun(
        slurm_cluster, 2, "--output", str(tmp_path / "out-%t"), "--error", str(tmp_path / "err-%t"),
        "/usr/bin/env", f"PATH={empty}", *probe_argv(tmp_path), env=task_env(slurm_cluster),
    )  # fmt: skip
    assert done.returncode != 0
    for t in range(2):
        err = (tmp_path / f"err-{t}").read_text().strip().splitlines()
        assert len(err) == 2 and err[0].startswith("error: ") and err[1].startswith("hint: "), err
        assert "'node1'" in err[0] and "does not resolve" in err[0]


@pytest.mark.slow
def test_a_rendezvous_port_another_job_holds_is_refused_on_node_0(slurm_cluster, tmp_path):
    # Node 0 of this job finds its derived port held (as another job's store would hold it) and says so
    # at once, instead of joining that store; the other node gives up after its short --rdzv-timeout.
    pytest.importorskip("torch")
    holder = f"""
import os, socket, subprocess, sys
from gputopo.launch.slurm import rendezvous_port
held = None
if os.environ["SLURM_NODEID"] == "0":
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("0.0.0.0", rendezvous_port(os.environ["SLURM_JOB_ID"])))
    held.listen()
sys.exit(subprocess.call({probe_argv(tmp_path)!r} + ["--rdzv-timeout", "10"]))
"""
    done = srun(
        slurm_cluster, 2, "--output", str(tmp_path / "out-%t"), "--error", str(tmp_path / "err-%t"),
        sys.executable, "-c", holder, env=task_env(slurm_cluster),
    )  # fmt: skip
    assert done.returncode != 0
    err = (tmp_path / "err-0").read_text().strip().splitlines()
    assert len(err) == 2 and err[0].startswith("error: port ") and "already taken" in err[0], err
    assert "node1" in err[0] and "--rdzv-endpoint" in err[1]


HEALTH_RECORDER = """#!/bin/sh
# Records the environment slurmd gives a HealthCheckProgram (absolute paths only: there may be no PATH).
/usr/bin/env > "{folder}/env.$SLURMD_NODENAME.tmp"
/bin/mv "{folder}/env.$SLURMD_NODENAME.tmp" "{folder}/env.$SLURMD_NODENAME"
"""


def test_slurmd_runs_the_health_check_with_no_path(slurm_cluster, tmp_path):
    folder = slurm_cluster.state_dir / "hc-record"
    folder.mkdir(exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    program = folder / "record-env.sh"
    program.write_text(HEALTH_RECORDER.format(folder=folder))
    program.chmod(0o755)
    slurm_cluster.set_health_check(program, interval_s=5)
    try:
        slurm_cluster.wait_for(
            lambda: all((folder / f"env.{n}").exists() for n in slurm_cluster.nodes),
            "every slurmd running HealthCheckProgram",
        )
    finally:
        slurm_cluster.set_health_check(None)
    for node in slurm_cluster.nodes:
        env = dict(
            line.split("=", 1) for line in (folder / f"env.{node}").read_text().splitlines() if "=" in line
        )
        assert env.get("SLURMD_NODENAME") == node
        # What `gputopo check --drain` must survive: no PATH (so no `scontrol` by name), no SLURM_CONF.
        assert "PATH" not in env and "SLURM_CONF" not in env, env
        assert set(env) <= {"SLURMD_NODENAME", "PWD", "SHLVL", "_"}, env


HEALTH_DRAINER = """#!/bin/sh
# A health check that finds a problem on node3 only and drains it the way `gputopo check --drain` will:
# gputopo's own scontrol lookup, with nothing in the environment but SLURMD_NODENAME.
[ "$SLURMD_NODENAME" = node3 ] || exit 0
PYTHONPATH="{src}" exec "{python}" -c '
import os, subprocess
from gputopo.system.scontrol import scontrol_path
exe = scontrol_path()
subprocess.run([exe, "update", "NodeName=" + os.environ["SLURMD_NODENAME"], "State=DRAIN",
                "Reason=gputopo: health check test"], check=True)
' > "{folder}/drain.out" 2>&1
"""


def test_a_health_check_drains_its_node_with_no_path_and_it_resumes(slurm_cluster, tmp_path):
    etc = Path("/etc/slurm/slurm.conf")
    if not etc.exists() or etc.resolve() != slurm_cluster.conf.resolve():
        pytest.skip(f"{etc} is not this cluster's: scontrol without SLURM_CONF would ask another cluster")
    folder = slurm_cluster.state_dir / "hc-drain"
    folder.mkdir(exist_ok=True)
    program = folder / "drain-node3.sh"
    program.write_text(HEALTH_DRAINER.format(src=SRC, python=sys.executable, folder=folder))
    program.chmod(0o755)
    slurm_cluster.set_health_check(program, interval_s=5)
    try:
        slurm_cluster.wait_for(
            lambda: slurm_cluster.drain_reasons().get("node3") == "gputopo: health check test",
            f"node3 drained by the health check ({folder / 'drain.out'})",
        )
        assert slurm_cluster.node_state("node3").startswith("drain")
        assert set(slurm_cluster.drain_reasons()) == {"node3"}
    finally:
        slurm_cluster.set_health_check(None)
        slurm_cluster.resume("node3")
    assert "node3" not in slurm_cluster.drain_reasons()


def test_drain_and_resume_round_trip(slurm_cluster):
    cluster = slurm_cluster
    try:
        cluster.run("scontrol", "update", "NodeName=node1", "State=DRAIN", "Reason=gputopo: test")
        assert cluster.drain_reasons().get("node1") == "gputopo: test"
        assert cluster.node_state("node1") in ("drained", "draining")
        # A drained node takes no new job: a three-node step cannot start while it is out.
        done = cluster.run("srun", "-N3", "--immediate=5", "true", check=False, timeout_s=60)
        assert done.returncode != 0
    finally:
        cluster.resume("node1")
    assert "node1" not in cluster.drain_reasons()
    assert cluster.run("srun", "-N3", "true", check=False).returncode == 0
