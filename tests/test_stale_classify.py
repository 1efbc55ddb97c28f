"""The pure core of kill-stale: lsof field parsing, holder building, stale/protected rules, outcomes.

Each scene is a small machine described as data: the processes, who holds which device, what NVML says.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from gputopo.procs.document import stale_document
from gputopo.procs.holders import (
    GpuMemoryUse,
    HolderScan,
    NvmlView,
    OpenDevices,
    ProcessInfo,
    ProcessRef,
    build_holders,
    device_minor,
    parse_lsof_fields,
)
from gputopo.procs.pidmap import match_pids, names_agree
from gputopo.procs.stale import (
    PROTECTED_NAMES,
    Policy,
    StaleRun,
    StopOutcome,
    StopResult,
    assess,
    format_duration,
    memory_freed_mib,
    parse_duration_s,
    protected_name,
    settle,
)
from gputopo.ui.stale_view import render_run

NOW = 1_000_000.0
ME, SHELL, SSHD, INIT = 5000, 4000, 900, 1
ROOT, ALICE, BOB = 0, 1000, 1001


def proc(
    pid: int,
    ppid: int,
    *,
    name: str = "python",
    cmdline: tuple[str, ...] | None = None,
    age_s: float = 3600.0,
    uid: int = ALICE,
    status: str = "sleeping",
    sid: int | None = None,
    error: str | None = None,
    env: dict[str, str] | None = None,
    nspid: tuple[int, ...] | None = None,
    threads: tuple[tuple[int, str], ...] | None = None,
) -> ProcessInfo:
    """A process; by default alice's python, an hour old, in the session of the login shell, with no
    launcher variables in its (readable) environment."""
    return ProcessInfo(
        pid=pid,
        create_time_s=None if error else NOW - age_s,
        ppid=ppid,
        name=name,
        cmdline=cmdline if cmdline is not None else (name, f"job{pid}.py"),
        uid=uid,
        user={ROOT: "root", ALICE: "alice", BOB: "bob"}.get(uid),
        status=status,
        sid=sid if sid is not None else SHELL,
        error=error,
        launch_env=tuple(env.items()) if env is not None else (),
        nspid=nspid,
        threads=threads,
    )


def rank_env(rank: int, run: str = "run-1") -> dict[str, str]:
    """What torchrun puts in a rank's environment."""
    return {
        "TORCHELASTIC_RUN_ID": run,
        "GROUP_RANK": "0",
        "LOCAL_RANK": str(rank),
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


TRAIN = ("/usr/bin/python3", "-u", "train.py")
SPAWN = (
    "/usr/bin/python3",
    "-c",
    "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
    "--multiprocessing-fork",
)
TORCHRUN_CMD = ("/usr/bin/python3", "/usr/local/bin/torchrun", "--nproc-per-node=2", "train.py")


def rank(pid: int, ppid: int, r: int = 0, **kw) -> ProcessInfo:  # type: ignore[no-untyped-def]
    """A torchrun rank running train.py."""
    return proc(pid, ppid, cmdline=TRAIN, env=rank_env(r), **kw)


# The tool runs as alice from her login shell: init -> sshd -> bash (session leader) -> gputopo.
LINEAGE_PROCS = [
    proc(INIT, 0, name="systemd", uid=ROOT, sid=INIT, age_s=86400),
    proc(SSHD, INIT, name="sshd", uid=ROOT, sid=SSHD, age_s=86000),
    proc(SHELL, SSHD, name="bash", age_s=7200),
    proc(ME, SHELL, name="gputopo", age_s=1),
]


def machine(
    holders: dict[int, tuple[str, ...]],
    extra: list[ProcessInfo],
    *,
    my_uid: int = ALICE,
) -> HolderScan:
    """A scan: ``holders`` maps pid -> device files held; ``extra`` are the processes besides the tool's."""
    processes = {p.pid: p for p in [*LINEAGE_PROCS, *extra]}
    return HolderScan(
        source="lsof",
        device_files=("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"),
        open_devices=tuple(OpenDevices(pid, paths) for pid, paths in holders.items()),
        processes=processes,
        lineage=(ME, SHELL, SSHD, INIT),
        my_uid=my_uid,
        scan_time_s=NOW,
    )


def judge(scan: HolderScan, nvml: NvmlView | None = None, policy: Policy | None = None):  # type: ignore[no-untyped-def]
    nvml = nvml or NvmlView()
    holders, _ = build_holders(scan, nvml)
    report = assess(holders, scan, nvml, policy or Policy())
    return report, {a.holder.pid: a for a in report.assessments}


GPU0 = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")
GPU1 = ("/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm")


# --- lsof -F parsing -------------------------------------------------------------------------------


LSOF_OUTPUT = """p2301
g2290
R2290
cpython
u1000
Lalice
f3
au
tCHR
n/dev/nvidiactl
f4
n/dev/nvidia0
fmem
n/dev/nvidia0
p77
cXorg
u0
f12
n/dev/nvidia1
pnot-a-pid
n/dev/nvidia0

p2301
f9
n/dev/nvidia-uvm
"""


def test_lsof_fields_give_one_record_per_process_with_its_files_once() -> None:
    records = parse_lsof_fields(LSOF_OUTPUT)
    assert records == [
        OpenDevices(2301, ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"), "python", 1000),
        OpenDevices(77, ("/dev/nvidia1",), "Xorg", 0),
    ]


def test_lsof_with_no_holders_gives_nothing() -> None:
    assert parse_lsof_fields("") == []
    assert parse_lsof_fields("p12\ncsleep\n") == []  # a process set without files is no holder


def test_device_minor_reads_only_per_gpu_device_files() -> None:
    assert device_minor("/dev/nvidia7") == 7
    assert device_minor("/tmp/x/nvidia12") == 12
    assert device_minor("/dev/nvidiactl") is None
    assert device_minor("/dev/nvidia-uvm") is None
    assert device_minor("/dev/nvidia0x") is None


# --- durations ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("10m", 600), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("0.5h", 1800)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "ten minutes", "-5m", "10x", "1h30", "m"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration_s(text)


@given(st.integers(0, 99), st.integers(0, 59), st.integers(0, 59))
def test_duration_parts_add_up(h: int, m: int, s: int) -> None:
    assert parse_duration_s(f"{h}h{m}m{s}s") == h * 3600 + m * 60 + s


def test_format_duration() -> None:
    assert [format_duration(v) for v in (None, 5, 125, 900, 3700, 200000)] == [
        "?",
        "5s",
        "2m05s",
        "15m",
        "1h01m",
        "2d07h",
    ]


# --- workers whose launcher is gone -----------------------------------------------------------------


def test_rank_reparented_to_an_init_has_lost_its_launcher() -> None:
    _, by_pid = judge(machine({6000: GPU0}, [rank(6000, INIT, sid=6000)]))
    a = by_pid[6000]
    assert a.job is not None and a.job.kind == "rank" and a.job.marks == "torchrun rank 0 of run run-1"
    assert a.reasons == ("launcher gone: reparented to PID 1 (systemd)",) and a.targeted


def test_worker_whose_parent_pid_names_a_younger_process() -> None:
    newer = proc(5900, SHELL, age_s=10, name="vim")
    _, by_pid = judge(machine({6000: GPU0}, [rank(6000, 5900, age_s=600), newer]))
    assert by_pid[6000].reasons == ("launcher gone: pid 5900 now names a younger process 5900 (vim)",)


def test_worker_adopted_by_a_subreaper_outside_its_job() -> None:
    # systemd --user, or any subreaper: seen by the session the worker kept from its dead launcher.
    user_manager = proc(3000, INIT, name="systemd", sid=3000)
    reaper = proc(3100, SHELL, name="python", cmdline=("python", "supervise.py"))
    spawned = proc(6001, 3100, cmdline=SPAWN, sid=4444)
    scan = machine({6000: GPU0, 6001: GPU1}, [user_manager, reaper, rank(6000, 3000, sid=4444), spawned])
    _, by_pid = judge(scan)
    assert by_pid[6000].reasons == ("launcher gone: adopted by 3000 (systemd), a subreaper outside its job",)
    assert by_pid[6001].job is not None and by_pid[6001].job.kind == "spawn worker"
    assert by_pid[6001].reasons[0].startswith("launcher gone: adopted by 3100 (python)")


def test_workers_of_a_live_launcher_are_not_stale() -> None:
    torchrun = proc(5900, SHELL, name="python3", cmdline=TORCHRUN_CMD)
    r0 = rank(6000, 5900)
    loader = rank(6010, 6000, age_s=3000)  # a DataLoader worker: forked from the rank, same command line
    trainer = proc(5800, SHELL, cmdline=("python", "mp_train.py"))
    spawned = proc(6100, 5800, cmdline=SPAWN)
    scan = machine({6000: GPU0, 6010: GPU0, 6100: GPU1}, [torchrun, r0, loader, trainer, spawned])
    report, by_pid = judge(scan)
    assert not report.targets
    assert by_pid[6000].job.kind == "rank" and by_pid[6000].job.parent == "5900 (python3)"  # type: ignore[union-attr]
    assert by_pid[6010].job.kind == "fork worker" and "forked from 6000" in by_pid[6010].job.marks  # type: ignore[union-attr]
    assert by_pid[6100].job.kind == "spawn worker"  # type: ignore[union-attr]
    for pid in (6000, 6010, 6100):
        assert not by_pid[pid].stale
        assert by_pid[pid].spared_reasons[0].startswith("not stale: its launcher or parent")


def test_a_launcher_that_adopted_a_worker_of_its_own_job_keeps_it() -> None:
    torchrun = proc(5900, SHELL, name="python3", cmdline=TORCHRUN_CMD, sid=5900)
    orphan_of_rank = rank(6020, 5900, sid=6000)  # its rank (session 6000) died; torchrun is a subreaper
    _, by_pid = judge(machine({6020: GPU0}, [torchrun, orphan_of_rank]))
    assert not by_pid[6020].stale and "a process of the same job" in (by_pid[6020].job.why or "")  # type: ignore[union-attr]


def test_a_plain_detached_process_is_not_stale() -> None:
    nohup = proc(6000, INIT, sid=6000, cmdline=("python", "train.py"))  # nohup'd, its shell gone
    service = proc(6001, INIT, sid=6001, name="tritonserver", cmdline=("tritonserver",))
    secret = proc(6002, INIT, sid=6002)
    secret = ProcessInfo(**{**secret.__dict__, "launch_env": None})  # environment unreadable
    report, by_pid = judge(machine({6000: GPU0, 6001: GPU1, 6002: GPU0}, [nohup, service, secret]))
    assert not report.targets
    for pid in (6000, 6001, 6002):
        assert by_pid[pid].job.kind == "detached" and not by_pid[pid].stale  # type: ignore[union-attr]
        assert by_pid[pid].spared_reasons[0].startswith("not stale: detached")
    assert "environment could not be read" in (by_pid[6002].job.why or "")  # type: ignore[union-attr]
    _, by_pid = judge(machine({6000: GPU0}, [nohup]), policy=Policy(all=True))
    assert by_pid[6000].targeted


def test_no_rule_stops_a_process_for_its_parent_being_pid_1_alone() -> None:
    """Whatever PID 1 is, a holder without worker marks is never stale because its parent is PID 1."""
    for init_name in ("systemd", "tini", "torchrun", "python3", "process_api"):
        pid1 = proc(INIT, 0, name=init_name, uid=ROOT, sid=INIT)
        scan = machine({6000: GPU0}, [pid1, proc(6000, INIT, sid=6000)])
        _, by_pid = judge(scan)
        assert not by_pid[6000].stale, init_name


def test_limits_an_unreadable_pid_1_and_a_session_leading_rank_under_an_unknown_subreaper() -> None:
    hidden_init = proc(INIT, 0, uid=ROOT, error="access denied")
    _, by_pid = judge(machine({6000: GPU0}, [hidden_init, rank(6000, INIT, sid=6000)]))
    assert not by_pid[6000].stale and "PID 1 cannot be read" in (by_pid[6000].job.why or "")  # type: ignore[union-attr]
    # torchrun's ranks lead their own sessions: adopted by a subreaper that is no known init, nothing shows.
    reaper = proc(3100, SHELL, name="python", cmdline=("python", "supervise.py"))
    _, by_pid = judge(machine({6001: GPU0}, [reaper, rank(6001, 3100, sid=6001)]))
    assert not by_pid[6001].stale


def launch_env(rank: int) -> dict[str, str]:
    """What torch.distributed.launch (before torchrun), a batch script or an orchestrator sets."""
    return {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}


def test_ranks_known_only_by_rank_variables_need_the_session_evidence() -> None:
    batch = proc(5900, SHELL, name="bash", cmdline=("/bin/bash", "job.sh"))
    under_batch = proc(6000, 5900, cmdline=TRAIN, env=launch_env(0))
    supervisor = proc(3000, INIT, name="supervisord", sid=3000)
    supervised = proc(6001, 3000, cmdline=TRAIN, env=launch_env(1), sid=3000)
    adopted_one = proc(6002, 3000, cmdline=TRAIN, env=launch_env(0), sid=4444)
    scan = machine(
        {6000: GPU0, 6001: GPU1, 6002: GPU0}, [batch, under_batch, supervisor, supervised, adopted_one]
    )
    _, by_pid = judge(scan)
    assert by_pid[6000].job.kind == "rank" and not by_pid[6000].stale  # type: ignore[union-attr]
    assert "is running" in (by_pid[6000].job.why or "")  # type: ignore[union-attr]
    assert not by_pid[6001].stale and "may have started it itself" in (by_pid[6001].job.why or "")  # type: ignore[union-attr]
    assert by_pid[6002].reasons == (
        "launcher gone: adopted by 3000 (supervisord), a subreaper outside its job",
    )

    tini = proc(1, 0, name="tini", cmdline=("/usr/bin/tini", "--", "python", "train.py"), uid=ROOT, sid=1)
    own_child = proc(10, 1, cmdline=TRAIN, env=launch_env(0), uid=ROOT, sid=1)
    from_exec = proc(11, 1, cmdline=TRAIN, env=launch_env(1), uid=ROOT, sid=90)  # started from docker exec
    _, by_pid = judge(container(tini, {10: GPU0, 11: GPU1}, [own_child, from_exec]))
    assert not by_pid[10].stale and "may have started it itself" in (by_pid[10].job.why or "")  # type: ignore[union-attr]
    assert by_pid[11].reasons == ("launcher gone: reparented to PID 1 (tini)",)


# --- containers: what PID 1 is decides --------------------------------------------------------------


def container(pid1: ProcessInfo, holders: dict[int, tuple[str, ...]], extra: list[ProcessInfo]) -> HolderScan:
    """A container as root: PID 1 is ``pid1``; the tool runs from ``docker exec bash`` (parent pid 0)."""
    shell = proc(90, 0, name="bash", uid=ROOT, sid=90)
    tool = proc(95, 90, name="gputopo", uid=ROOT, sid=90, age_s=1)
    processes = {p.pid: p for p in [pid1, shell, tool, *extra]}
    return HolderScan(
        source="lsof",
        device_files=("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"),
        open_devices=tuple(OpenDevices(pid, paths) for pid, paths in holders.items()),
        processes=processes,
        lineage=(95, 90),
        my_uid=ROOT,
        scan_time_s=NOW,
    )


def test_container_whose_pid_1_is_torchrun_keeps_its_ranks_and_their_workers() -> None:
    pid1 = proc(1, 0, name="torchrun", cmdline=TORCHRUN_CMD, uid=ROOT, sid=1)
    ranks = [rank(10 + r, 1, r, uid=ROOT, sid=1) for r in range(2)]
    loader = rank(20, 10, uid=ROOT, sid=1, age_s=3000)
    scan = container(pid1, {10: GPU0, 11: GPU1, 20: GPU0}, [*ranks, loader])
    report, by_pid = judge(scan)
    assert not report.targets
    assert by_pid[10].job.why == "PID 1 (torchrun) is its launcher"  # type: ignore[union-attr]
    assert by_pid[20].job.kind == "fork worker" and not by_pid[20].stale  # type: ignore[union-attr]


def test_container_whose_pid_1_is_the_training_script_keeps_its_spawn_workers() -> None:
    pid1 = proc(1, 0, name="python", cmdline=("python", "train.py"), uid=ROOT, sid=1)
    workers = [proc(10 + i, 1, cmdline=SPAWN, uid=ROOT, sid=1) for i in range(2)]
    report, _ = judge(container(pid1, {10: GPU0, 11: GPU1}, workers))
    assert not report.targets


def test_container_whose_pid_1_is_tini_lets_orphaned_ranks_go_but_not_a_detached_job() -> None:
    pid1 = proc(1, 0, name="tini", cmdline=("/usr/bin/tini", "--", "bash"), uid=ROOT, sid=1)
    ranks = [rank(10 + r, 1, r, uid=ROOT, sid=1) for r in range(2)]
    spawned = proc(12, 1, cmdline=SPAWN, uid=ROOT, sid=1)
    nohup = proc(13, 1, cmdline=("python", "serve.py"), uid=ROOT, sid=13)
    scan = container(pid1, {10: GPU0, 11: GPU1, 12: GPU0, 13: GPU1}, [*ranks, spawned, nohup])
    report, by_pid = judge(scan)
    assert [t.pid for t in report.targets] == [10, 11, 12]
    assert by_pid[10].reasons == ("launcher gone: reparented to PID 1 (tini)",)
    assert by_pid[13].job.kind == "detached" and not by_pid[13].targeted  # type: ignore[union-attr]


def test_container_whose_pid_1_is_an_entrypoint_shell_lets_orphaned_ranks_go() -> None:
    pid1 = proc(1, 0, name="bash", cmdline=("/bin/bash", "entry.sh"), uid=ROOT, sid=1)
    report, _ = judge(container(pid1, {10: GPU0}, [rank(10, 1, uid=ROOT, sid=1)]))
    assert [t.pid for t in report.targets] == [10]


def test_all_targets_every_unprotected_holder_but_never_the_tool_or_its_ancestors() -> None:
    training = proc(7000, SHELL)
    scan = machine({7000: GPU0, ME: ("/dev/nvidiactl",), SHELL: ("/dev/nvidiactl",)}, [training])
    _, by_pid = judge(scan, policy=Policy(all=True))
    assert by_pid[7000].targeted
    assert by_pid[ME].protected_reasons == ("this gputopo process",)
    assert "an ancestor of this gputopo (bash)" in by_pid[SHELL].protected_reasons[0]
    assert not by_pid[ME].targeted and not by_pid[SHELL].targeted


def test_pid_1_is_never_a_target() -> None:
    scan = machine({INIT: ("/dev/nvidiactl",)}, [])
    _, by_pid = judge(scan, policy=Policy(all=True))
    assert by_pid[INIT].protected and not by_pid[INIT].targeted


@pytest.mark.parametrize(
    ("name", "argv0"),
    [
        ("nvidia-persistenced", "/usr/bin/nvidia-persistenced"),
        ("nvidia-persiste", "/usr/bin/nvidia-persistenced"),  # the kernel cuts names to 15 characters
        ("Xorg", "/usr/lib/xorg/Xorg"),
        ("python3", "/usr/bin/dcgm-exporter"),  # known by argv[0]
    ],
)
def test_daemons_and_the_display_stack_are_protected(name: str, argv0: str) -> None:
    daemon = proc(800, INIT, name=name, cmdline=(argv0,), uid=ALICE, sid=800, env=rank_env(0))
    assert protected_name(daemon) is not None
    _, by_pid = judge(machine({800: GPU0}, [daemon]), policy=Policy(all=True))
    assert by_pid[800].stale  # even with a rank's marks and no launcher, it is protected
    assert by_pid[800].protected and not by_pid[800].targeted
    _, by_pid = judge(machine({800: GPU0}, [daemon]), policy=Policy(pids=frozenset({800})))
    assert not by_pid[800].targeted


def test_protected_names_are_one_list() -> None:
    for name in ("nvidia-persistenced", "nv-hostengine", "nvidia-fabricmanager", "dcgm-exporter", "Xwayland"):
        assert name in PROTECTED_NAMES


def test_other_users_are_protected_unless_root_asks_for_all_users() -> None:
    bobs = rank(6100, INIT, uid=BOB, sid=6100)
    as_alice = machine({6100: GPU0}, [bobs])
    _, by_pid = judge(as_alice, policy=Policy(all=True, all_users=True))
    assert "only root with --all-users" in by_pid[6100].protected_reasons[0] and not by_pid[6100].targeted

    as_root = machine({6100: GPU0}, [bobs], my_uid=ROOT)
    _, by_pid = judge(as_root)
    assert "add --all-users" in by_pid[6100].protected_reasons[0] and not by_pid[6100].targeted
    _, by_pid = judge(as_root, policy=Policy(all_users=True))
    assert by_pid[6100].targeted


def test_unreadable_process_is_listed_but_never_signalled() -> None:
    hidden = proc(6200, INIT, error="access denied")
    _, by_pid = judge(machine({6200: GPU0}, [hidden]), policy=Policy(all=True))
    assert "cannot be read (access denied)" in by_pid[6200].protected_reasons
    assert by_pid[6200].target is None


def test_a_zombie_is_never_a_reason_to_stop_its_parent() -> None:
    # A process that has really exited holds no files (do_exit closes them before it becomes a zombie):
    # one seen holding a GPU exited between the scan and the read. Stopping its parent (here a torchrun
    # agent) would free nothing.
    agent = proc(5900, SHELL, name="torchrun", cmdline=("torchrun", "--nproc-per-node", "8", "train.py"))
    zombie = proc(6000, 5900, status="zombie", threads=((6000, "Z"),))
    report, by_pid = judge(machine({6000: GPU0}, [agent, zombie]), policy=Policy(all=True))
    assert by_pid[6000].target is None and not by_pid[6000].stale
    assert any("a zombie holds no files" in r and "5900 (torchrun)" in r for r in by_pid[6000].spared_reasons)
    assert report.targets == ()


def test_an_exited_main_thread_whose_threads_are_stuck_in_the_driver_is_reported_not_targeted() -> None:
    # The holder's main thread exited (it shows as a zombie); its last thread sleeps in the driver.
    agent = proc(5900, SHELL, name="torchrun")
    leader = rank(6000, 5900, status="zombie", threads=((6000, "Z"), (6001, "D"), (6002, "S")))
    report, by_pid = judge(machine({6000: GPU0}, [agent, leader]), policy=Policy(all=True))
    a = by_pid[6000]
    assert a.stale and a.reasons[0].startswith("stuck in the driver: its main thread exited; thread 6001")
    assert "reset the GPU or reboot" in a.reasons[0]
    assert a.target is None and report.targets == ()  # neither the holder nor its parent
    assert "stuck in the driver: no signal frees it (reset the GPU or reboot)" in a.spared_reasons


def test_an_exited_main_thread_with_live_threads_is_judged_as_the_process_it_still_is() -> None:
    # An orphaned rank whose main thread exited: its threads hold the GPU and a signal to its pid reaches
    # them, so it is the target itself; its parent (init) never is.
    leader = rank(6000, INIT, sid=6000, status="zombie", threads=((6000, "Z"), (6001, "S")))
    _, by_pid = judge(machine({6000: GPU0}, [leader]))
    a = by_pid[6000]
    assert a.reasons[0].startswith("launcher gone")
    assert a.target == ProcessRef(6000, leader.create_time_s or 0)
    assert any(n.startswith("its main thread exited; 1 thread(s) live on") for n in a.notes)
    # The same process with a live launcher is not stale, and nothing of its family is targeted.
    agent = proc(5900, SHELL, name="torchrun")
    live = rank(6000, 5900, status="zombie", threads=((6000, "Z"), (6001, "R")))
    report, by_pid = judge(machine({6000: GPU0}, [agent, live]))
    assert not by_pid[6000].stale and report.targets == ()


def test_older_than_spares_young_stale_holders() -> None:
    young = rank(6000, INIT, age_s=120, sid=6000)
    old = rank(6001, INIT, 1, age_s=7200, sid=6001)
    _, by_pid = judge(machine({6000: GPU0, 6001: GPU1}, [young, old]), policy=Policy(older_than_s=600))
    assert not by_pid[6000].targeted
    assert by_pid[6000].spared_reasons == ("running for 2m00s, younger than --older-than 10m",)
    assert by_pid[6001].targeted


# --- NVML: GPU numbers, memory, invisibility ---------------------------------------------------------


MINORS = {0: 1, 1: 0}  # minor numbers need not follow indices: /dev/nvidia0 is GPU 1 here


def test_devices_map_to_gpus_through_minor_numbers_and_memory_is_attached() -> None:
    listed = proc(7000, SHELL)
    scan = machine({7000: ("/dev/nvidia0", "/dev/nvidiactl")}, [listed])
    nvml = NvmlView((GpuMemoryUse(7000, 1, 2048), GpuMemoryUse(7000, 1, None)), MINORS, True)
    holders, _ = build_holders(scan, nvml)
    assert holders[0].gpus == (1,) and holders[0].gpu_memory_mib == 2048 and holders[0].nvml_listed


def test_gpus_come_from_nvml_lists_when_its_pids_are_usable() -> None:
    # 7000 opened both GPUs' files but has a context on GPU 1 only; 7010 is its forked worker (no context);
    # 7001 holds /dev/nvidia1 = GPU 0 but NVML lists it nowhere (an NVML client).
    a, b, ctl = proc(7000, SHELL), proc(7001, SHELL), proc(7002, SHELL)
    worker = proc(7010, 7000)
    scan = machine(
        {
            7000: ("/dev/nvidia0", "/dev/nvidia1"),
            7001: ("/dev/nvidia1",),
            7002: ("/dev/nvidiactl",),
            7010: GPU0,
        },
        [a, b, ctl, worker],
    )
    nvml = NvmlView((GpuMemoryUse(7000, 1, 100),), MINORS, True)
    holders, _ = build_holders(scan, nvml)
    got = {h.pid: (h.gpus, h.gpu_basis, h.nvml_listed) for h in holders}
    assert got[7000] == ((1,), "nvml", True)
    assert got[7010] == ((1,), "nvml", False)  # its parent's GPU
    assert got[7001] == ((), "nvml", False)
    holders, _ = build_holders(scan, nvml, gpus=frozenset({0}))
    assert holders == []
    holders, _ = build_holders(scan, nvml, gpus=frozenset({1}))
    assert [h.pid for h in holders] == [7000, 7010]


def test_gpus_from_device_files_when_nvml_pids_are_unusable() -> None:
    a, b, ctl = proc(7000, SHELL), proc(7001, SHELL), proc(7002, SHELL)
    scan = machine({7000: ("/dev/nvidia0",), 7001: ("/dev/nvidia1",), 7002: ("/dev/nvidiactl",)}, [a, b, ctl])
    nvml = NvmlView((GpuMemoryUse(40001, 0, 100),), MINORS, False)
    holders, _ = build_holders(scan, nvml, gpus=frozenset({0}))
    assert [(h.pid, h.gpus, h.gpu_basis) for h in holders] == [(7001, (0,), "device files")]
    _, by_pid = judge(scan, nvml)
    assert any("GPUs from the device files" in n for n in by_pid[7000].notes)


def test_gpus_never_selects_a_holder_whose_minor_is_unmapped() -> None:
    odd = proc(7000, SHELL)
    known = proc(7001, SHELL)
    scan = machine({7000: ("/dev/nvidia7",), 7001: ("/dev/nvidia0",)}, [odd, known])
    nvml = NvmlView((GpuMemoryUse(40001, 0, 100),), MINORS, False)
    holders, notes = build_holders(scan, nvml, gpus=frozenset({0, 1}))
    assert [h.pid for h in holders] == [7001]
    assert notes == [
        "pid 7000 (python): its GPUs are unknown (no GPU has minor number 7), so --gpus does not select it"
    ]
    holders, _ = build_holders(scan, nvml)
    assert holders[0].gpus is None
    _, by_pid = judge(scan, nvml)
    assert any("its GPUs are unknown" in n for n in by_pid[7000].notes)


def test_a_refused_process_list_is_unknown_not_empty() -> None:
    # On a MIG GPU without the privilege to list processes, NVML refuses GPU 0's list.
    mig = proc(7000, SHELL)
    other = proc(7001, SHELL)
    scan = machine({7000: ("/dev/nvidia1",), 7001: ("/dev/nvidia0",)}, [mig, other])
    nvml = NvmlView((GpuMemoryUse(7001, 1, 10),), MINORS, True, refused={0: "compute list: No permission"})
    holders, _ = build_holders(scan, nvml, gpus=frozenset({0}))
    assert [(h.pid, h.gpus, h.nvml_listed, h.gpu_basis) for h in holders] == [
        (7000, (0,), None, "nvml and device files")
    ]
    report, by_pid = judge(scan, nvml)
    assert any("GPU0: NVML refused a process list" in n for n in report.notes)
    assert not any("NVML lists no context" in n for n in by_pid[7000].notes)


def test_without_nvml_gpus_and_memory_are_unknown() -> None:
    scan = machine({7000: GPU0}, [proc(7000, SHELL)])
    holders, _ = build_holders(scan, NvmlView())
    assert holders[0].gpus is None and holders[0].gpu_memory_mib is None and holders[0].nvml_listed is None
    report, _ = judge(scan)
    assert any("NVML unavailable" in n for n in report.notes)


def test_invisible_to_nvml_is_a_note_never_a_reason() -> None:
    hidden = proc(7000, SHELL)
    detached = proc(7001, INIT, sid=7001)
    scan = machine({7000: GPU0, 7001: GPU1}, [hidden, detached])
    report, by_pid = judge(scan, NvmlView((GpuMemoryUse(42, 0, 100),), MINORS, True))
    for pid in (7000, 7001):
        assert not by_pid[pid].stale and not by_pid[pid].targeted
        assert any(n.startswith("NVML lists no context of it") for n in by_pid[pid].notes)

    report, by_pid = judge(scan, NvmlView((GpuMemoryUse(42, 0, 100),), MINORS, False, pid_note="foreign"))
    assert not by_pid[7000].notes or not any("NVML lists no" in n for n in by_pid[7000].notes)
    assert any("cannot be matched" in n and "foreign" in n for n in report.notes)


# --- matching NVML's pids to this PID namespace -----------------------------------------------------


def holder_procs(*infos: ProcessInfo) -> dict[int, ProcessInfo]:
    return {p.pid: p for p in infos}


def test_nvml_pids_are_ours_when_most_match_holders_with_their_names() -> None:
    local = holder_procs(proc(7000, SHELL), proc(7001, SHELL), proc(7002, SHELL, name="bash"))
    names = {7000: "python", 7001: "/usr/bin/python", 7002: "python", 7003: None}
    got = match_pids([7000, 7001, 7002, 7003, 7000], names, local, frozenset({7000, 7001}))
    # 7002 is a bash here (names disagree) and holds no GPU; 7003 is not here: 2 of 4 is not most.
    assert got.mapping is None and got.sees_pid_namespace is False
    got = match_pids([7000, 7001, 7002], names, local, frozenset({7000, 7001}))
    assert got.mapping == {7000: 7000, 7001: 7001} and got.sees_pid_namespace is True and got.level == 0


def test_host_namespace_pids_with_one_accidental_match_are_not_ours() -> None:
    # NVML (an older driver, in a container) lists host pids; one equals a local rank's pid by chance.
    local = holder_procs(rank(45, INIT, sid=45), rank(46, INIT, 1, sid=46))
    names = {45: "python", 812345: None, 812346: None, 812347: None}
    got = match_pids([812345, 812346, 812347, 45], names, local, frozenset({45, 46}))
    assert got.mapping is None and got.sees_pid_namespace is False
    assert "only 1 of the 4 pids" in got.note
    nvml = NvmlView(
        tuple(GpuMemoryUse(p, 0, 100) for p in (812345, 812346, 812347, 45)),
        MINORS,
        got.sees_pid_namespace,
        got.mapping,
        pid_note=got.note,
    )
    scan = machine({45: GPU0, 46: GPU1}, list(local.values()))
    holders, _ = build_holders(scan, nvml)
    assert all(h.gpu_memory_mib is None and h.nvml_listed is None for h in holders)
    assert [h.gpus for h in holders] == [(1,), (0,)]  # from the device files (minor 0 is GPU 1)


def test_nvml_pids_of_another_namespace_map_through_nspid() -> None:
    # This /proc shows host pids (level 0); NVML reports the container's (level 1).
    a = proc(70000, SHELL, nspid=(70000, 12))
    b = proc(70001, SHELL, nspid=(70001, 13))
    c = proc(70002, SHELL, nspid=(70002, 12, 5))  # another container's 12 at level 1: ambiguous there
    names = {12: "python", 13: "python", 14: None}
    got = match_pids([12, 13, 14], names, holder_procs(a, b, c), frozenset({70000, 70001, 70002}))
    assert got.mapping is None  # 12 is ambiguous at level 1, so only 13 matches: 1 of 3
    got = match_pids([12, 13], names, holder_procs(a, b), frozenset({70000, 70001}))
    assert got.mapping == {12: 70000, 13: 70001} and got.level == 1 and got.sees_pid_namespace is False
    nvml = NvmlView((GpuMemoryUse(12, 1, 500), GpuMemoryUse(13, 0, 300)), MINORS, False, got.mapping)
    scan = machine({70000: GPU0, 70001: GPU1}, [a, b])
    holders, _ = build_holders(scan, nvml)
    assert [(h.pid, h.gpus, h.gpu_memory_mib) for h in holders] == [(70000, (1,), 500), (70001, (0,), 300)]


def test_nvml_pids_cannot_be_judged_without_processes_or_names() -> None:
    assert match_pids([], {}, {}, frozenset()).sees_pid_namespace is None
    got = match_pids([812345], {812345: None}, {}, frozenset())
    assert got.mapping is None and got.sees_pid_namespace is None


def test_names_agree_by_file_name_and_the_kernels_15_characters() -> None:
    info = proc(7000, SHELL, name="pt_main_thread", cmdline=("/opt/conda/bin/python", "train.py"))
    assert names_agree("/opt/conda/bin/python", info) and names_agree("pt_main_thread", info)
    assert names_agree("nvidia-persistenced", proc(1, 0, name="nvidia-persiste", cmdline=("x",)))
    assert not names_agree("bash", info) and not names_agree(None, info)


def test_holder_that_exited_during_the_scan_is_dropped_with_a_note() -> None:
    scan = machine({7000: GPU0, 7001: GPU0}, [proc(7000, SHELL)])
    holders, notes = build_holders(scan, NvmlView())
    assert [h.pid for h in holders] == [7000]
    assert notes == ["pid 7001 (?) exited during the scan"]


# --- outcomes, memory freed, JSON --------------------------------------------------------------------


def test_memory_freed_needs_nvml_before_and_after() -> None:
    before = NvmlView((GpuMemoryUse(7000, 0, 1000), GpuMemoryUse(7000, 1, 500)), MINORS, True)
    assert memory_freed_mib(before, NvmlView((), MINORS, True), 7000) == 1500
    assert memory_freed_mib(before, NvmlView((GpuMemoryUse(7000, 0, 1000),), MINORS, True), 7000) is None
    assert memory_freed_mib(before, None, 7000) is None
    assert memory_freed_mib(before, NvmlView((), MINORS, False), 7000) is None
    hidden = NvmlView((GpuMemoryUse(7000, 0, None),), MINORS, True)
    assert memory_freed_mib(hidden, NvmlView((), MINORS, True), 7000) is None


def scene_after_stop():  # type: ignore[no-untyped-def]
    """Three orphans (the third's main thread has exited, a thread of it lives on), a daemon; one orphan
    refused the signal."""
    a = rank(6000, INIT, sid=6000)
    b = rank(6001, INIT, 1, sid=6001)
    parent = proc(5900, SHELL, name="train")
    zombie = rank(6002, INIT, 2, sid=6002, status="zombie", threads=((6002, "Z"), (6003, "S")))
    daemon = proc(800, INIT, name="nvidia-persistenced", uid=ALICE, sid=800)
    scan = machine(
        {6000: GPU0, 6001: GPU1, 6002: GPU0, 800: ("/dev/nvidiactl",)}, [a, b, parent, zombie, daemon]
    )
    before = NvmlView((GpuMemoryUse(6000, 1, 30000), GpuMemoryUse(6001, 0, 20000)), MINORS, True)
    holders, _ = build_holders(scan, before)
    report = assess(holders, scan, before, Policy())
    outcomes = [
        StopOutcome(a.ref, StopResult.KILLED, "ignored SIGTERM for 10 s; SIGKILL"),  # type: ignore[arg-type]
        StopOutcome(b.ref, StopResult.ACCESS_DENIED, "not permitted to signal it"),  # type: ignore[arg-type]
        StopOutcome(zombie.ref, StopResult.TERMINATED, "exited after SIGTERM"),  # type: ignore[arg-type]
    ]
    after = NvmlView((GpuMemoryUse(6001, 0, 20000),), MINORS, True)
    return report, before, outcomes, after


def test_settle_names_each_holders_action() -> None:
    report, before, outcomes, after = scene_after_stop()
    dry = {h.assessment.holder.pid: h for h in settle(report, None, before)}
    assert {pid: h.action for pid, h in dry.items()} == {
        800: "spared",
        6000: "listed",
        6001: "listed",
        6002: "listed",
    }

    done = {h.assessment.holder.pid: h for h in settle(report, outcomes, before, after)}
    assert done[6000].action == "killed" and done[6000].memory_freed_mib == 30000
    assert done[6001].action == "failed" and done[6001].result is StopResult.ACCESS_DENIED
    assert done[6001].gone is False and done[6001].memory_freed_mib is None
    assert done[6002].action == "terminated" and done[6002].detail == "exited after SIGTERM"
    assert done[800].action == "spared" and done[800].gone is None


def test_already_gone_counts_as_gone() -> None:
    assert StopResult.ALREADY_GONE.gone and StopResult.KILLED.gone
    assert not StopResult.ACCESS_DENIED.gone and not StopResult.FAILED.gone


def make_run(dry_run: bool) -> StaleRun:
    report, before, outcomes, after = scene_after_stop()
    settled = settle(report, None if dry_run else outcomes, before, None if dry_run else after)
    return StaleRun(
        "lsof", "/dev/nvidia*", ("/dev/nvidia0",), Policy(), 10.0, dry_run, before, settled, report.notes
    )


def test_json_document_has_the_design_keys() -> None:
    doc = json.loads(json.dumps(stale_document(make_run(dry_run=False))))
    assert doc["schema"] == "gputopo/stale/v1" and doc["dry_run"] is False
    for h in doc["holders"]:
        assert {
            "pid",
            "user",
            "command",
            "devices",
            "gpus",
            "stale",
            "reasons",
            "protected",
            "action",
        } <= set(h)
        assert h["action"] in {"listed", "terminated", "killed", "spared", "failed"}
    by_pid = {h["pid"]: h for h in doc["holders"]}
    assert by_pid[6001]["result"] == "access denied" and by_pid[6001]["gpus"] == [0]
    assert by_pid[6002]["target_pid"] == 6002
    assert doc["summary"] == {
        "holders": 4,
        "stale": 3,
        "protected": 1,
        "targeted": 3,
        "not_stopped": 1,
        "memory_freed_mib": 30000,
    }


def render_text(run: StaleRun) -> str:
    console = Console(width=110, record=True, color_system=None, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render_run(run))
    return console.export_text()


def test_human_output_says_what_yes_would_do_then_what_was_done() -> None:
    dry = render_text(make_run(dry_run=True))
    assert "Dry run: --yes would stop 3 processes" in dry and "would stop" in dry
    assert "protected: NVIDIA persistence daemon" in dry
    assert "GPU 1" in dry and "30000 MiB" in dry

    done = render_text(make_run(dry_run=False))
    assert "Stopped 2 of 3: 1 killed, 1 access denied, 1 terminated. GPU memory freed: 30000 MiB." in done


def test_doctor_reports_say_why_a_holder_is_not_stale() -> None:
    from gputopo.ui.doctor_markdown import holder_why

    doc = stale_document(make_run(dry_run=True))
    by_pid = {h["pid"]: h for h in doc["holders"]}
    assert by_pid[800]["kind"] == "detached" and holder_why(by_pid[800]).startswith("detached: parent 1")
    assert holder_why(by_pid[6000]) == "launcher gone: reparented to PID 1 (systemd)"
    assert by_pid[6000]["kind"] == "rank" and by_pid[6000]["parent"] == "1 (systemd)"
    assert by_pid[6002]["why"].startswith("launcher gone")


def test_a_narrow_terminal_never_cuts_a_pid_a_verdict_or_an_action() -> None:
    run = make_run(dry_run=True)
    for width in (80, 100, 140):
        console = Console(width=width, record=True, color_system=None, file=open("/dev/null", "w"))  # noqa: SIM115
        console.print(render_run(run))
        table = console.export_text().split("Why:")[0]
        rows = {line.split()[0]: line for line in table.splitlines() if line[:1].isdigit()}
        assert {"800", "6000", "6001", "6002"} <= set(rows)
        assert "would stop" in rows["6000"] and "protected" in rows["800"] and "spared" in rows["800"]
        assert ("alice" in rows["6000"]) == (width >= 100)  # USER and AGE only where they fit
