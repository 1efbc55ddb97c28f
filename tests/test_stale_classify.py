"""The pure core of kill-stale: lsof field parsing, holder building, stale/protected rules, outcomes.

Each scene is a small machine described as data: the processes, who holds which device, what NVML says.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

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
from gputopo.procs.stale import (
    PROTECTED_NAMES,
    Policy,
    StaleRun,
    StopOutcome,
    StopResult,
    assess,
    format_duration,
    memory_freed_mib,
    orphan_reason,
    parse_duration_s,
    protected_name,
    settle,
)
from gputopo.ui.stale_view import render_run, stale_document

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
) -> ProcessInfo:
    """A process; by default alice's python, an hour old, in the session of the login shell."""
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
    )


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


# --- orphans -----------------------------------------------------------------------------------------


def test_orphan_reparented_to_pid_1() -> None:
    worker = proc(6000, INIT, sid=6000)  # a torchrun worker (own session) whose launcher died
    assert (
        orphan_reason(worker, LINEAGE_PROCS[0])
        == "orphaned: its parent exited and it was reparented to PID 1"
    )


def test_orphan_when_the_parent_pid_names_a_younger_process() -> None:
    worker = proc(6000, 5900, age_s=600)
    newer = proc(5900, SHELL, age_s=10)
    assert "pid 5900 now belongs to a younger process" in (orphan_reason(worker, newer) or "")


def test_orphan_adopted_by_a_subreaper_from_another_session() -> None:
    subreaper = proc(3000, INIT, name="systemd", sid=3000)
    worker = proc(6000, 3000, sid=4444)  # its shell's session; that shell is gone
    assert "adopted by 3000 (systemd)" in (orphan_reason(worker, subreaper) or "")


def test_not_orphans_children_of_live_parents() -> None:
    launcher = proc(5900, SHELL)
    assert orphan_reason(proc(6000, 5900), launcher) is None
    # A session leader (torchrun starts each worker in its own session) under its live launcher.
    assert orphan_reason(proc(6001, 5900, sid=6001), launcher) is None
    # Documented limit: adopted by a subreaper of its own session leaves no evidence.
    assert orphan_reason(proc(6002, 3000, sid=SHELL), proc(3000, SHELL, sid=SHELL)) is None


# --- classification ----------------------------------------------------------------------------------


def test_a_crashed_ddp_run_leaves_orphans_that_are_targeted() -> None:
    workers = [proc(6000 + r, INIT, sid=6000 + r) for r in range(2)]
    training = proc(7000, SHELL)  # another job, parent alive
    scan = machine({6000: GPU0, 6001: GPU1, 7000: GPU0}, [*workers, training])
    report, by_pid = judge(scan)
    assert by_pid[6000].stale and by_pid[6000].target == ProcessRef(6000, NOW - 3600)
    assert by_pid[6001].targeted
    assert not by_pid[7000].stale and not by_pid[7000].targeted
    assert by_pid[7000].spared_reasons == ("not stale (--all would stop it)",)
    assert report.targets == (ProcessRef(6000, NOW - 3600), ProcessRef(6001, NOW - 3600))


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
    daemon = proc(800, INIT, name=name, cmdline=(argv0,), uid=ALICE, sid=800)
    assert protected_name(daemon) is not None
    _, by_pid = judge(machine({800: GPU0}, [daemon]), policy=Policy(all=True))
    assert by_pid[800].stale  # orphan-looking, as daemons are, yet protected
    assert by_pid[800].protected and not by_pid[800].targeted


def test_protected_names_are_one_list() -> None:
    for name in ("nvidia-persistenced", "nv-hostengine", "nvidia-fabricmanager", "dcgm-exporter", "Xwayland"):
        assert name in PROTECTED_NAMES


def test_other_users_are_protected_unless_root_asks_for_all_users() -> None:
    bobs = proc(6100, INIT, uid=BOB, sid=6100)
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


def test_zombie_is_stale_and_its_parent_is_the_target() -> None:
    parent = proc(5900, SHELL, name="train")
    zombie = proc(6000, 5900, status="zombie")
    _, by_pid = judge(machine({6000: GPU0}, [parent, zombie]))
    assert by_pid[6000].reasons[0].startswith("zombie: it exited but its parent 5900 (train)")
    assert by_pid[6000].target == ProcessRef(5900, parent.create_time_s or 0)


def test_zombie_of_a_protected_parent_is_spared() -> None:
    zombie = proc(6000, SHELL, status="zombie")  # the user's own shell has not reaped it
    _, by_pid = judge(machine({6000: GPU0}, [zombie]))
    assert by_pid[6000].stale and by_pid[6000].target is None
    assert any(r.startswith(f"its parent {SHELL}: an ancestor") for r in by_pid[6000].protected_reasons)


def test_older_than_spares_young_stale_holders() -> None:
    young = proc(6000, INIT, age_s=120, sid=6000)
    old = proc(6001, INIT, age_s=7200, sid=6001)
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


def test_gpus_filter_keeps_holders_of_those_gpus() -> None:
    a, b, ctl = proc(7000, SHELL), proc(7001, SHELL), proc(7002, SHELL)
    scan = machine({7000: ("/dev/nvidia0",), 7001: ("/dev/nvidia1",), 7002: ("/dev/nvidiactl",)}, [a, b, ctl])
    holders, _ = build_holders(scan, NvmlView((), MINORS, True), gpus=frozenset({0}))
    assert [h.pid for h in holders] == [7001]


def test_without_nvml_gpus_and_memory_are_unknown() -> None:
    scan = machine({7000: GPU0}, [proc(7000, SHELL)])
    holders, _ = build_holders(scan, NvmlView())
    assert holders[0].gpus is None and holders[0].gpu_memory_mib is None and holders[0].nvml_listed is None
    report, _ = judge(scan)
    assert any("NVML unavailable" in n for n in report.notes)


def test_invisible_to_nvml_only_when_nvml_sees_this_namespace() -> None:
    hidden = proc(7000, SHELL)
    ctl_only = proc(7001, SHELL)
    scan = machine({7000: GPU0, 7001: ("/dev/nvidiactl",)}, [hidden, ctl_only])
    _, by_pid = judge(scan, NvmlView((GpuMemoryUse(42, 0, 100),), MINORS, True))
    assert by_pid[7000].reasons == ("invisible to NVML: holds /dev/nvidia0 but NVML lists no such pid",)
    assert not by_pid[7001].stale  # nvidiactl alone is no GPU

    report, by_pid = judge(scan, NvmlView((GpuMemoryUse(42, 0, 100),), MINORS, False))
    assert not by_pid[7000].stale
    assert any("another PID namespace" in n for n in report.notes)
    report, by_pid = judge(scan, NvmlView((), MINORS, None))
    assert not by_pid[7000].stale
    assert any("cannot tell" in n for n in report.notes)


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
    """Two orphans, a zombie whose parent is a target, a daemon; one orphan refused the signal."""
    a = proc(6000, INIT, sid=6000)
    b = proc(6001, INIT, sid=6001)
    parent = proc(5900, SHELL, name="train")
    zombie = proc(6002, 5900, status="zombie")
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
        StopOutcome(parent.ref, StopResult.TERMINATED, "exited after SIGTERM"),  # type: ignore[arg-type]
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
    assert (
        done[6002].action == "terminated"
        and done[6002].detail == "acted on its parent 5900: exited after SIGTERM"
    )
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
    assert by_pid[6002]["target_pid"] == 5900
    assert doc["summary"] == {
        "holders": 4,
        "stale": 4,
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
