"""Slurm's side of a multi-node probe: hostlist expressions, the job a task is in, and `scontrol`.

The environments below are written from what Slurm's source sets for a task (SchedMD/slurm
src/common/env.c ``env_array_for_step``; src/plugins/gres/common/gres_common.c ``gres_common_gpu_set_env``)
plus the batch script's variables a step inherits, as `env | sort` shows them on a GPU cluster.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from gputopo.errors import UsageError
from gputopo.launch.slurm import DEFAULT_RDZV_PORT, MAX_HOSTS, SlurmJob, expand_hostlist, slurm_job
from gputopo.system import scontrol

# --------------------------------------------------------------------------------------------------------
# Hostlist expressions


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("dgx007", ["dgx007"]),
        # The lower bound's width pads the whole range; a wider upper bound does not.
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("n[1,010-011]", ["n1", "n010", "n011"]),
        ("gpu-a[1-2]-ib", ["gpu-a1-ib", "gpu-a2-ib"]),
        # Several groups: a cartesian product, leftmost group slowest.
        (
            "rack[1-2]-n[1-3]",
            ["rack1-n1", "rack1-n2", "rack1-n3", "rack2-n1", "rack2-n2", "rack2-n3"],
        ),
        (
            "r[01-02]c[3,5]n[1-2]",
            ["r01c3n1", "r01c3n2", "r01c5n1", "r01c5n2"] + ["r02c3n1", "r02c3n2", "r02c5n1", "r02c5n2"],
        ),
        # Top-level commas separate hosts; commas inside brackets do not.
        ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
        ("login1,dgx[001-002,010],spare", ["login1", "dgx001", "dgx002", "dgx010", "spare"]),
        # Slurm's tokenizer also splits on whitespace.
        ("a b,\tc", ["a", "b", "c"]),
        ("[3-4]", ["3", "4"]),
        ("n[5]", ["n5"]),
    ],
)
def test_hostlist_expressions_expand_in_slurms_order(expr, hosts):
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize(
    ("expr", "says"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("node[01-04", "never closed"),
        ("node01-04]", "without '['"),
        ("node[1-[2-3]]", "inside brackets"),
        ("node[3-1]", "runs backwards"),
        ("node[a-c]", "not a number"),
        ("node[1-x]", "not a number"),
        ("node[-3]", "not a number"),
        ("node[1--3]", "not a number"),
        ("node[]", "empty brackets"),
        ("node[1,]", "not a number"),
        ("a,,b", "empty item"),
        ("a,b,", "empty item"),
        ("node[0-99999]", str(MAX_HOSTS)),
    ],
)
def test_bad_hostlist_expressions_are_usage_errors_naming_the_expression(expr, says):
    with pytest.raises(UsageError) as err:
        expand_hostlist(expr)
    assert says in err.value.message
    assert repr(expr) in err.value.message
    assert "\n" not in err.value.message
    assert err.value.hint and "scontrol show hostnames" in err.value.hint


# --------------------------------------------------------------------------------------------------------
# The job a task runs in

# `sbatch -N4 --gpus-per-node=8 job.sh` on 8-GPU nodes; job.sh runs `srun --ntasks-per-node=1 gputopo
# probe ...`; this is the task on the third node, dgx003 (node id 2). Everything Slurm put there,
# relevant or not, plus a few variables every process has.
SRUN_NODE2_OF_4 = {
    "HOME": "/home/alice",
    "HOSTNAME": "dgx003",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "USER": "alice",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    "SLURMD_NODENAME": "dgx003",
    "SLURM_CLUSTER_NAME": "selene",
    "SLURM_CONF": "/etc/slurm/slurm.conf",
    "SLURM_CPUS_ON_NODE": "224",
    "SLURM_CPU_BIND": "quiet,mask_cpu:0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF",
    "SLURM_CPU_BIND_LIST": "0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF",
    "SLURM_CPU_BIND_TYPE": "mask_cpu:",
    "SLURM_CPU_BIND_VERBOSE": "quiet",
    "SLURM_DISTRIBUTION": "block",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_GPUS_PER_NODE": "8",
    "SLURM_GTIDS": "2",
    "SLURM_JOBID": "184467",
    "SLURM_JOB_ACCOUNT": "ml-infra",
    "SLURM_JOB_CPUS_PER_NODE": "224(x4)",
    "SLURM_JOB_END_TIME": "1795386400",
    "SLURM_JOB_GID": "1001",
    "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7",
    "SLURM_JOB_ID": "184467",
    "SLURM_JOB_NAME": "job.sh",
    "SLURM_JOB_NODELIST": "dgx[001-004]",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_JOB_PARTITION": "batch",
    "SLURM_JOB_QOS": "normal",
    "SLURM_JOB_START_TIME": "1795379200",
    "SLURM_JOB_UID": "1001",
    "SLURM_JOB_USER": "alice",
    "SLURM_LAUNCH_NODE_IPADDR": "10.40.0.1",
    "SLURM_LOCALID": "0",
    "SLURM_MEM_PER_NODE": "1900000",
    "SLURM_MPI_TYPE": "pmix",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_NODELIST": "dgx[001-004]",
    "SLURM_NPROCS": "4",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_PRIO_PROCESS": "0",
    "SLURM_PROCID": "2",
    "SLURM_SRUN_COMM_HOST": "10.40.0.1",
    "SLURM_SRUN_COMM_PORT": "41235",
    "SLURM_STEPID": "0",
    "SLURM_STEP_GPUS": "0,1,2,3,4,5,6,7",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_LAUNCHER_PORT": "41235",
    "SLURM_STEP_NODELIST": "dgx[001-004]",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
    "SLURM_SUBMIT_DIR": "/home/alice/runs",
    "SLURM_SUBMIT_HOST": "login1",
    "SLURM_TASKS_PER_NODE": "1(x4)",
    "SLURM_TASK_PID": "2841193",
    "SLURM_TOPOLOGY_ADDR": "ib-spine1.ib-leaf3.dgx003",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node",
    "SLURM_TRES_PER_NODE": "gres/gpu:8",
    "SLURM_UMASK": "0022",
}


def test_a_task_of_srun_on_node_2_of_4_reads_every_field():
    job = slurm_job(SRUN_NODE2_OF_4)
    assert job == SlurmJob(
        job_id="184467",
        nnodes=4,
        node_id=2,
        nodelist="dgx[001-004]",
        hosts=("dgx001", "dgx002", "dgx003", "dgx004"),
        gpus=(0, 1, 2, 3, 4, 5, 6, 7),
        ntasks=4,
        node_name="dgx003",
    )
    assert job.first_host == "dgx001"
    assert job.this_host == "dgx003" == SRUN_NODE2_OF_4["SLURMD_NODENAME"]
    # slurmd's own name for the node wins over the node list's entry (a test cluster's nodes share one
    # host name; the name is what tells them apart).
    assert slurm_job({**SRUN_NODE2_OF_4, "SLURMD_NODENAME": "node3"}).this_host == "node3"


def test_outside_slurm_there_is_no_job():
    assert slurm_job({"HOME": "/root", "PATH": "/usr/bin"}) is None
    assert slurm_job({"SLURM_JOB_ID": "", "SLURM_NODEID": "0"}) is None


def test_the_steps_gpus_win_over_the_job_gpus_the_step_inherited_from_node_0():
    # --gpus-per-node=4 on 8-GPU nodes with ConstrainDevices=yes: node 2 was given GPUs 4-7. The cgroup
    # renumbers them 0-3 in CUDA_VISIBLE_DEVICES; SLURM_JOB_GPUS came down from the batch script, which
    # ran on node 0 and got GPUs 0-3 there.
    env = dict(
        SRUN_NODE2_OF_4,
        SLURM_GPUS_PER_NODE="4",
        SLURM_GPUS_ON_NODE="4",
        SLURM_TRES_PER_NODE="gres/gpu:4",
        SLURM_JOB_GPUS="0,1,2,3",
        SLURM_STEP_GPUS="4,5,6,7",
        CUDA_VISIBLE_DEVICES="0,1,2,3",
    )
    assert slurm_job(env).gpus == (4, 5, 6, 7)


def test_inside_a_step_the_job_gpus_are_not_taken_for_this_nodes():
    env = dict(SRUN_NODE2_OF_4)
    del env["SLURM_STEP_GPUS"]
    assert slurm_job(env).gpus is None


@pytest.mark.parametrize("value", ["", "NoDevFiles"])
def test_a_gpu_list_slurm_could_not_fill_is_unknown(value):
    assert slurm_job(dict(SRUN_NODE2_OF_4, SLURM_STEP_GPUS=value)).gpus is None


def test_the_batch_script_on_node_0_reads_the_jobs_variables():
    # The batch script itself (no srun step): no SLURM_STEP_* variables, node id 0, the job's GPUs.
    env = {
        k: v
        for k, v in SRUN_NODE2_OF_4.items()
        if not k.startswith("SLURM_STEP") and k not in ("SLURM_STEPID", "SLURM_SRUN_COMM_HOST")
    }
    env.update(SLURM_NODEID="0", SLURM_PROCID="0", SLURMD_NODENAME="dgx001", SLURM_JOB_GPUS="0,1,2,3")
    job = slurm_job(env)
    assert (job.node_id, job.nnodes, job.this_host, job.gpus) == (0, 4, "dgx001", (0, 1, 2, 3))


def test_a_step_over_part_of_the_job_uses_the_steps_nodes():
    # `srun -N2 -r2 ...` inside the 4-node job: the step runs on dgx003 and dgx004. SLURM_NNODES and
    # SLURM_NODEID describe the step, SLURM_JOB_* the job; node id 1 is dgx004, not the job's dgx002.
    env = dict(
        SRUN_NODE2_OF_4,
        SLURM_STEP_NODELIST="dgx[003-004]",
        SLURM_STEP_NUM_NODES="2",
        SLURM_NNODES="2",
        SLURM_NODEID="1",
        SLURMD_NODENAME="dgx004",
    )
    job = slurm_job(env)
    assert (job.nnodes, job.node_id, job.nodelist) == (2, 1, "dgx[003-004]")
    assert job.hosts == ("dgx003", "dgx004")
    assert (job.first_host, job.this_host) == ("dgx003", "dgx004")


def test_older_names_are_read_when_the_newer_are_absent():
    env = {
        "SLURM_JOBID": "77",
        "SLURM_NODELIST": "cn[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
    }
    job = slurm_job(env)
    assert (job.job_id, job.hosts, job.node_id, job.gpus) == ("77", ("cn1", "cn2"), 1, None)


def test_scontrol_is_asked_before_the_expander():
    asked: list[str] = []

    def fake_scontrol(nodelist: str) -> list[str] | None:
        asked.append(nodelist)
        # Names the expander could never produce, so the test sees whose answer was used.
        return ["alpha", "bravo", "charlie", "delta"]

    job = slurm_job(SRUN_NODE2_OF_4, hostnames=fake_scontrol)
    assert asked == ["dgx[001-004]"]
    assert job.hosts == ("alpha", "bravo", "charlie", "delta")
    assert job.hosts[job.node_id] == "charlie"


@pytest.mark.parametrize("answer", [None, []])
def test_when_scontrol_has_no_answer_the_expander_does_the_work(answer):
    job = slurm_job(SRUN_NODE2_OF_4, hostnames=lambda nodelist: answer)
    assert job.hosts == ("dgx001", "dgx002", "dgx003", "dgx004")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"SLURM_NODEID": "4"}, "SLURM_NODEID=4 is not below SLURM_STEP_NUM_NODES=4"),
        ({"SLURM_STEP_NUM_NODES": "3"}, "names 4 hosts but SLURM_STEP_NUM_NODES=3"),
        ({"SLURM_STEP_NODELIST": "dgx[001-005]"}, "names 5 hosts but SLURM_STEP_NUM_NODES=4"),
        ({"SLURM_STEP_NUM_NODES": "four"}, "SLURM_STEP_NUM_NODES='four' is not a whole number"),
        ({"SLURM_NODEID": "-1"}, "SLURM_NODEID='-1' is not a whole number"),
        ({"SLURM_NODEID": "2.0"}, "SLURM_NODEID='2.0' is not a whole number"),
        ({"SLURM_STEP_NUM_NODES": "0"}, "SLURM_STEP_NUM_NODES=0 nodes"),
        ({"SLURM_STEP_GPUS": "0,1,GPU-5e1f"}, "SLURM_STEP_GPUS='0,1,GPU-5e1f' is not a list of GPU numbers"),
        ({"SLURM_STEP_NODELIST": "dgx[001-004"}, "'[' is never closed"),
        ({"SLURM_STEP_NODELIST": " "}, "names no node list"),
    ],
)
def test_an_environment_that_contradicts_itself_is_a_usage_error(change, says):
    with pytest.raises(UsageError) as err:
        slurm_job(dict(SRUN_NODE2_OF_4, **change))
    assert says in err.value.message
    assert err.value.hint


def test_a_shell_of_the_allocation_that_is_no_task_is_told_to_use_srun():
    # An `salloc` shell on the login node has the job's id and nodes but no node id of its own.
    env = {k: v for k, v in SRUN_NODE2_OF_4.items() if not k.startswith("SLURM_STEP")}
    del env["SLURM_NODEID"]
    with pytest.raises(UsageError) as err:
        slurm_job(env)
    assert "SLURM_NODEID" in err.value.message and "srun" in err.value.hint


def test_the_rendezvous_port_is_torchruns_default():
    assert DEFAULT_RDZV_PORT == 29400


# --------------------------------------------------------------------------------------------------------
# `scontrol show hostnames`


def _fake_scontrol(folder: Path, body: str) -> Path:
    script = folder / "scontrol"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


@pytest.fixture
def only_fakes_on_path(tmp_path, monkeypatch):
    """A PATH with a folder for the fake scontrol, then /bin and /usr/bin for what a script needs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"]))
    return bin_dir


skip_on_windows = pytest.mark.skipif(sys.platform == "win32", reason="shell-script fakes")


@skip_on_windows
def test_scontrol_on_path_expands_the_list(only_fakes_on_path, tmp_path):
    args_file = tmp_path / "args"
    _fake_scontrol(
        only_fakes_on_path,
        f'printf "%s\\n" "$@" > "{args_file}"\nprintf "dgx001\\ndgx002\\n\\ndgx010\\n"\n',
    )
    assert scontrol.hostnames("dgx[001-002,010]") == ["dgx001", "dgx002", "dgx010"]
    assert args_file.read_text().splitlines() == ["show", "hostnames", "dgx[001-002,010]"]


@skip_on_windows
@pytest.mark.parametrize(
    "body",
    [
        'echo "scontrol: error: Invalid hostlist: n[1-" >&2\nexit 1\n',
        "exit 0\n",  # prints nothing
        "exec sleep 30\n",  # hangs: killed at the timeout
    ],
    ids=["fails", "silent", "hangs"],
)
def test_scontrol_without_a_usable_answer_gives_none(only_fakes_on_path, body):
    _fake_scontrol(only_fakes_on_path, body)
    assert scontrol.hostnames("n[1-", timeout_s=0.5) is None


def test_without_scontrol_there_is_no_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert scontrol.hostnames("dgx[001-004]") is None
    # ... and slurm_job falls back to its own expander.
    job = slurm_job(SRUN_NODE2_OF_4, hostnames=scontrol.hostnames)
    assert job.hosts == ("dgx001", "dgx002", "dgx003", "dgx004")
