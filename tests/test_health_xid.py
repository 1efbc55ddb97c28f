"""Xid lines from kernel logs in every form people save them, the window, the GPU they belong to, and the
kernel log reader on a machine where dmesg is refused (real child processes standing in for the tools)."""

from __future__ import annotations

import os
import stat
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from gputopo.errors import EXIT_USAGE, InputError, UsageError
from gputopo.findings import NOTE, PROBLEM
from gputopo.health import xid
from gputopo.system import kernel_log

# Noon UTC on the day of the logs; the machine booted 3 h earlier (uptime 10 800 s).
NOW = datetime(2026, 11, 25, 12, 0, 0, tzinfo=timezone.utc)
UPTIME_S = 10_800.0

# An HGX box as NVML names its GPUs: 8-digit domain, upper case, function number.
GPUS = [(i, f"00000000:{bus}:00.0") for i, bus in enumerate(["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"])]


def scan(text: str, since: str | None = "2h") -> xid.XidScan:
    return xid.scan(text, xid.parse_since(since) if since else None, uptime_s=UPTIME_S, now=NOW)


def test_plain_dmesg_stamps_are_aged_with_the_uptime() -> None:
    log = (
        "[    5.123456] nvidia: loading out-of-tree module taints kernel.\n"
        "[ 3500.000001] NVRM: Xid (PCI:0000:ab:00): 79, pid=2211, name=python, GPU has fallen off the bus.\n"
        "[ 9000.250000] NVRM: Xid (PCI:0000:ab:00): 79, pid=2211, name=python, GPU has fallen off the bus.\n"
    )
    found = scan(log)
    assert [(e.xid, e.address, e.pid, e.age_s) for e in found.events] == [(79, "0000:ab:00", 2211, 1799.75)]
    assert found.older == 1 and found.lines == 3
    f = xid.xid_findings(found, GPUS)
    assert [(x.where, x.gpu, x.severity, x.category, x.action) for x in f] == [
        ("GPU5", 5, PROBLEM, "xid", "drain")
    ]
    assert f[0].what.startswith("Xid 79 (GPU has fallen off the bus) on GPU5 1 time in the last 2h")


def test_dmesg_T_local_times() -> None:
    log = (
        "[Wed Nov 25 11:15:02 2026] NVRM: Xid (PCI:0000:3a:00): 48, pid=77, name=train, DBE (0x1) detected\n"
    )
    found = scan(log)
    assert [(e.xid, e.age_s, e.when) for e in found.events] == [(48, 2698.0, "Wed Nov 25 11:15:02 2026")]
    f = xid.xid_findings(found, GPUS)
    assert [(x.gpu, x.severity, x.action) for x in f] == [(2, PROBLEM, "reset")]
    # Every output says when as a wall-clock time, never "seconds after boot".
    at = NOW.timestamp() - 2698.0
    assert found.events[0].at == at and f"last at {xid.wall_time(at)}" in f[0].what


def test_boot_relative_stamps_are_said_as_wall_clock_times() -> None:
    found = scan("[ 9000.0] NVRM: Xid (PCI:0000:18:00): 48, pid=1, DBE\n")
    (f,) = xid.xid_findings(found, GPUS)
    assert "after boot" not in f.what
    assert f"last at {xid.wall_time(NOW.timestamp() - 1800.0)}" in f.what


def test_journalctl_short_iso_with_zone() -> None:
    log = (
        "2026-11-25T11:59:00+0000 node17 kernel: NVRM: Xid (PCI:0000:5d:00): 74, pid=0, name=, NVLink: "
        "fatal error detected on link 4\n"
        "2026-11-25T07:00:00+0000 node17 kernel: NVRM: Xid (PCI:0000:5d:00): 74, old one\n"
        "2026-11-25T12:30:00.123456+01:00 node17 kernel: NVRM: Xid (PCI:0000:5d:00): 74, again, via zone\n"
    )
    found = scan(log)
    assert [e.age_s for e in found.events] == [60.0, pytest.approx(1799.876544)]
    assert found.older == 1
    (f,) = xid.xid_findings(found, GPUS)
    assert (f.gpu, f.severity) == (3, PROBLEM) and "2 times in the last 2h" in f.what


def test_syslog_stamps_and_the_older_address_form() -> None:
    log = (
        "Nov 25 11:00:00 oldbox kernel: [ 966.503025] NVRM: Xid (0000:03:00): 31, Ch 0000000b, engmask 0120\n"
    )
    found = scan(log)
    assert [(e.xid, e.address, e.bus_key, e.age_s) for e in found.events] == [
        (31, "0000:03:00", (0, 3, 0), 3600.0)
    ]
    f = xid.xid_findings(found, [(0, "00000000:03:00.0")])
    assert [(x.gpu, x.severity, x.action) for x in f] == [(0, NOTE, "none")]  # an application fault
    assert "GPU memory page fault" in f[0].what


def test_application_xids_are_notes_hardware_ones_problems() -> None:
    log = "".join(f"[ 10000.0] NVRM: Xid (PCI:0000:18:00): {code}, pid=1, x\n" for code in (13, 31, 43, 45))
    assert {(f.severity, f.action) for f in xid.xid_findings(scan(log), GPUS)} == {(NOTE, "none")}
    log = "".join(
        f"[ 10000.0] NVRM: Xid (PCI:0000:18:00): {code}, pid=1, x\n"
        for code in (48, 63, 64, 74, 79, 92, 94, 95, 119, 120)
    )
    f = xid.xid_findings(scan(log), GPUS)
    assert len(f) == 10 and {x.gpu for x in f} == {0}
    by_code = {int(x.what.split()[1]): x for x in f}
    # 63 and 94 are reset-when-convenient (NVIDIA's catalogue; DCGM warns), 92 a DCGM warning: notes.
    assert {c for c, x in by_code.items() if x.severity == NOTE} == {63, 92, 94}
    assert {c for c, x in by_code.items() if x.severity == PROBLEM} == {48, 64, 74, 79, 95, 119, 120}
    assert by_code[64].action == "replace" and by_code[79].action == "drain"
    assert by_code[94].action == "reset" and "when convenient" in by_code[94].remedy


def test_xid_154_is_judged_by_the_recovery_action_its_line_names() -> None:
    def one(text: str):  # type: ignore[no-untyped-def]
        (f,) = xid.xid_findings(scan(f"[ 10000.0] NVRM: Xid (PCI:0000:18:00): 154, {text}\n"), GPUS)
        return f.severity, f.action

    assert one("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)") == (
        PROBLEM,
        "reset",
    )
    assert one("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)") == (
        PROBLEM,
        "reboot",
    )
    assert one("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)") == (NOTE, "monitor")
    assert one("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)") == (NOTE, "none")


def test_an_xid_gputopos_table_does_not_know_is_a_note_to_look_up() -> None:
    (f,) = xid.xid_findings(scan("[ 10000.0] NVRM: Xid (PCI:0000:18:00): 999, pid=1, new code\n"), GPUS)
    assert (f.gpu, f.severity) == (0, NOTE) and "Xid catalog" in f.remedy


def test_an_xid_for_a_bus_nvml_no_longer_lists_is_a_problem_on_that_bus() -> None:
    (f,) = xid.xid_findings(
        scan("[ 10000.0] NVRM: Xid (PCI:0000:ee:00): 79, pid=1, GPU has fallen off the bus.\n"), GPUS
    )
    assert (f.where, f.gpu, f.severity, f.action, f.rule) == (
        "PCI:0000:ee:00",
        None,
        PROBLEM,
        "drain",
        "xid_unlisted_gpu",
    )
    assert "a GPU NVML no longer lists" in f.what and "lspci -d 10de:" in f.remedy
    # An application Xid there stays a note.
    (f,) = xid.xid_findings(scan("[ 10000.0] NVRM: Xid (PCI:0000:ee:00): 13, pid=1, x\n"), GPUS)
    assert f.severity == NOTE


def test_lines_a_person_acknowledged_never_drain_again_and_new_ones_do() -> None:
    log = (
        "[ 9000.0] NVRM: Xid (PCI:0000:18:00): 79, pid=1, GPU has fallen off the bus.\n"
        "[ 10700.0] NVRM: Xid (PCI:0000:2a:00): 48, pid=1, DBE\n"
    )
    found = scan(log)
    old, new = found.events
    ack = xid.Acknowledged(until=old.at + 60, keys=frozenset(), by="a person's resume")
    f = xid.xid_findings(found, GPUS, acknowledged=ack)
    assert [(x.where, x.severity) for x in f] == [("GPU1", PROBLEM), ("node", NOTE)]
    assert "1 Xid line (Xid 79) acknowledged by a person's resume" in f[1].what
    # A line of unknown age is acknowledged by its key.
    unaged = xid.scan("NVRM: Xid (PCI:0000:18:00): 79, pid=1, off the bus\n", None, now=NOW)
    ack = xid.Acknowledged(None, frozenset({unaged.events[0].key}))
    assert [x.severity for x in xid.xid_findings(unaged, GPUS, acknowledged=ack)] == [NOTE]


def test_bus_ids_match_whatever_the_domain_width_and_case() -> None:
    assert xid.bus_key("PCI:0000:3b:00") == xid.bus_key("00000000:3B:00.0") == (0, 0x3B, 0)
    assert xid.bus_key("0001:3B:00") == (1, 0x3B, 0) != xid.bus_key("0000:3b:00")
    assert xid.bus_key("3b:00.0") == (0, 0x3B, 0)
    assert xid.bus_key("nonsense") is None


def test_lines_of_unknown_age_count_as_since_boot_and_say_so() -> None:
    log = "NVRM: Xid (PCI:0000:18:00): 95, pid=1, Uncontained\n[ 7000.0] NVRM: Xid (PCI:0000:18:00): 95, x\n"
    found = xid.scan(log, 7200.0, uptime_s=None, now=NOW)  # no uptime: even [7000.0] cannot be aged
    assert [e.age_s for e in found.events] == [None, None]
    (f,) = xid.xid_findings(found, GPUS)
    assert "2 times in the last 2h (2 of unknown age, counted as since boot)" in f.what


def test_no_window_keeps_everything() -> None:
    log = "[ 1.0] NVRM: Xid (PCI:0000:18:00): 48, x\n"
    assert len(scan(log, since=None).events) == 1 and scan(log).older == 1


def test_syslog_lines_from_last_year() -> None:
    new_year = datetime(2027, 1, 1, 0, 30, tzinfo=timezone.utc)
    found = xid.scan("Dec 31 23:45:00 h kernel: NVRM: Xid (PCI:0000:18:00): 79, x\n", 3600.0, now=new_year)
    assert [e.age_s for e in found.events] == [2700.0]


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400), ("1.5h", 5400)]
)
def test_since(text: str, seconds: float) -> None:
    assert xid.parse_since(text) == seconds


@pytest.mark.parametrize("text", ["5x", "", "0h", "-2h", "2", "h", "2 hours"])
def test_bad_since_is_exit_2(text: str) -> None:
    with pytest.raises(UsageError) as err:
        xid.parse_since(text)
    assert err.value.exit_code == EXIT_USAGE and "not a duration" in err.value.message


def test_binary_or_huge_logs_are_refused_long_lines_skipped() -> None:
    with pytest.raises(InputError, match="binary data"):
        xid.decode_log(b"\x7fELF\x02\x01\x00\x00", "a.out")
    with pytest.raises(InputError, match="more than a kernel log"):
        xid.decode_log(b"x" * (xid.MAX_LOG_BYTES + 1), "big.log")
    long_line = "[ 10000.0] NVRM: Xid (PCI:0000:18:00): 79, " + "y" * xid.MAX_LINE_CHARS + "\n"
    assert scan(long_line).events == ()


def test_findings_group_by_gpu_and_code() -> None:
    log = "".join(f"[ {9000 + k}.0] NVRM: Xid (PCI:0000:18:00): 13, pid={k}, x\n" for k in range(5))
    log += "[ 9100.0] NVRM: Xid (PCI:0000:2a:00): 13, pid=9, y\n"
    f = xid.xid_findings(scan(log), GPUS)
    assert [(x.gpu, x.what.split(" in the last")[0]) for x in f] == [
        (0, "Xid 13 (graphics engine exception) on GPU0 5 times"),
        (1, "Xid 13 (graphics engine exception) on GPU1 1 time"),
    ]


# --- the machine's kernel log ----------------------------------------------------------------------------


def tool(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def test_kernel_log_from_dmesg(tools: Path) -> None:
    tool(tools, "dmesg", "echo '[ 100.0] NVRM: Xid (PCI:0000:18:00): 79, pid=1, GPU has fallen off the bus.'")
    log = kernel_log.read_kernel_log(7200)
    assert log.source == "dmesg" and log.refused is None and "Xid" in (log.text or "")
    assert log.uptime_s is not None and log.uptime_s > 0


def test_dmesg_refused_falls_back_to_journalctl(tools: Path) -> None:
    tool(tools, "dmesg", "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1")
    tool(
        tools,
        "journalctl",
        f'echo "$@" > {tools / "args"}; echo "2026-11-25T11:00:00+0000 h kernel: hi"',
    )
    log = kernel_log.read_kernel_log(7200)
    assert log.source == "journalctl -k" and log.text and "hi" in log.text
    assert (tools / "args").read_text().split() == [
        "-k",
        "-o",
        "short-iso",
        "--no-pager",
        "-q",
        "--since=-7201s",
    ]


def test_both_refused_is_said_once(tools: Path) -> None:
    tool(tools, "dmesg", "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1")
    tool(tools, "journalctl", "echo 'No journal files were opened due to insufficient permissions.' >&2")
    log = kernel_log.read_kernel_log(7200)
    assert log.text is None
    assert log.refused == (
        "dmesg: Operation not permitted; "
        "journalctl: No journal files were opened due to insufficient permissions."
    )


def test_saved_log_file_and_stdin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kern.log"
    path.write_text("[ 1.0] NVRM: Xid (PCI:0000:18:00): 79, x\n")
    log = kernel_log.read_log_file(str(path))
    assert log.source == str(path) and "Xid" in (log.text or "")
    old = tmp_path / "old.log"
    old.write_text("x\n")
    os.utime(old, (0, 0))  # written long before this boot: its boot-relative stamps cannot be aged
    assert kernel_log.read_log_file(str(old)).uptime_s is None
    with pytest.raises(InputError, match="cannot read it"):
        kernel_log.read_log_file(str(tmp_path / "missing.log"))


def test_uptime(tmp_path: Path) -> None:
    (tmp_path / "uptime").write_text("12345.67 99999.00\n")
    assert kernel_log.uptime_s(tmp_path / "uptime") == 12345.67
    assert kernel_log.uptime_s(tmp_path / "nope") is None


def test_now_defaults_to_the_clock() -> None:
    recent = (datetime.now(timezone.utc) - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%S+0000")
    found = xid.scan(f"{recent} h kernel: NVRM: Xid (PCI:0000:18:00): 79, x\n", 3600.0)
    assert len(found.events) == 1 and 290 < (found.events[0].age_s or 0) < 400
