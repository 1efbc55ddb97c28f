"""Report writes as people meet them: runs at the same moment, `--html` pointed at a device, a fifo or a
symbolic link. Real files, real concurrent writers, real `gputopo report` processes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest

from gputopo.outputs import NotRegularFile, atomic_write
from gputopo.report import write_report

NOON = datetime(2026, 11, 21, 15, 30, 0, tzinfo=timezone.utc)
WRITERS = 4


def test_four_concurrent_writers_in_the_same_second_get_four_reports(tmp_path):
    # The same timestamp for all four, started together: only an exclusive claim keeps them apart.
    barrier = threading.Barrier(WRITERS)
    results: list[dict[str, str]] = []

    def writer(n: int) -> None:
        barrier.wait()
        results.append(write_report("doctor", {"writer": n}, f"# {n}\n", tmp_path, now=NOON))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = {r["json"] for r in results}
    assert len(names) == WRITERS
    writers = {json.loads(Path(p).read_text())["writer"] for p in names}
    assert writers == set(range(WRITERS))
    assert len(list(tmp_path.glob("doctor-*.json"))) == WRITERS
    assert len(list(tmp_path.glob("doctor-*.md"))) == WRITERS
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left


def test_four_concurrent_doctor_processes_leave_four_reports(tmp_path):
    cmd = [sys.executable, "-m", "gputopo", "doctor", "--simulate", "--skip-probe", "--json"]
    cmd += ["--report-dir", str(tmp_path / "reports")]
    procs = [
        subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(WRITERS)
    ]
    docs = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert len({d["report"]["json"] for d in docs}) == WRITERS
    assert len(list((tmp_path / "reports").glob("doctor-*.json"))) == WRITERS


@pytest.fixture(scope="module")
def saved_report(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("saved")
    done = subprocess.run(
        [sys.executable, "-m", "gputopo", "doctor", "--simulate", "--skip-probe", "--json"]
        + ["--report-dir", str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=folder,
    )
    return Path(json.loads(done.stdout)["report"]["json"])


def _report_html(saved: Path, target: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gputopo", "report", str(saved), "--html", str(target)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_html_at_a_fifo_is_refused_and_the_fifo_stays(tmp_path, saved_report):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    done = _report_html(saved_report, fifo)
    assert done.returncode == 2, done.stderr
    assert "is a fifo, not a regular file" in done.stderr
    assert len([line for line in done.stderr.splitlines() if line.startswith("error:")]) == 1
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_html_at_a_character_device_is_refused_and_untouched(tmp_path, saved_report):
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers, in our own folder
    except PermissionError:
        device = Path("/dev/null")  # not root: the real one, which must come out exactly as it was
    before = os.lstat(device)
    done = _report_html(saved_report, device)
    assert done.returncode == 2, done.stderr
    assert "is a character device, not a regular file" in done.stderr
    after = os.lstat(device)
    assert stat.S_ISCHR(after.st_mode)
    assert (after.st_ino, after.st_mode, after.st_rdev) == (before.st_ino, before.st_mode, before.st_rdev)


def test_html_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path, saved_report):
    pytest.importorskip("matplotlib")  # the HTML report draws pictures
    target = tmp_path / "real.html"
    target.write_text("old")
    link = tmp_path / "link.html"
    link.symlink_to(target)
    done = _report_html(saved_report, link)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert "<html" in target.read_text().lower()


def test_atomic_write_refuses_non_regular_files_and_writes_through_links(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(NotRegularFile, match="is a fifo"):
        atomic_write(tmp_path / "fifo", "x")
    (tmp_path / "dir").mkdir()
    with pytest.raises(NotRegularFile, match="is a folder"):
        atomic_write(tmp_path / "dir", "x")
    (tmp_path / "to-fifo").symlink_to(tmp_path / "fifo")
    with pytest.raises(NotRegularFile, match="is a fifo"):
        atomic_write(tmp_path / "to-fifo", "x")
    (tmp_path / "dangling").symlink_to(tmp_path / "new.txt")
    atomic_write(tmp_path / "dangling", "made")
    assert (tmp_path / "dangling").is_symlink() and (tmp_path / "new.txt").read_text() == "made"


def test_html_without_matplotlib_is_one_line_and_exit_3(tmp_path, saved_report):
    """A base install (no [probe] extra) asked for the HTML report: say what is missing, write nothing."""
    target = tmp_path / "out.html"
    # sys.modules["matplotlib"] = None makes every import of it fail as a missing module would.
    script = (
        "import sys; sys.modules['matplotlib'] = None; from gputopo.cli import main; "
        f"sys.argv = ['gputopo', 'report', {str(saved_report)!r}, '--html', {str(target)!r}]; main()"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr
    assert "needs matplotlib" in done.stderr and "Traceback" not in done.stderr
    assert "internal error" not in done.stderr
    assert not target.exists()


# --- Every user-named output goes through the one writer (gputopo.outputs) --------------------------------
#
# Each command below is pointed at a fifo nobody reads: opening it for writing would block for ever, so a
# refusal proves the path was looked at, not opened. The subprocess timeout is the guard; the elapsed time
# is for the report, not an assertion.


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["hang", "{dir}", "--html", "{fifo}"], id="hang --html"),
        pytest.param(["check", "--save-baseline", "{fifo}"], id="check --save-baseline"),
    ],
)
def test_an_output_pointed_at_a_fifo_is_refused_at_once_in_one_line(tmp_path, args):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    argv = [a.format(dir=tmp_path, fifo=fifo) for a in args]
    done = subprocess.run(
        [sys.executable, "-m", "gputopo", *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {argv[-2]} {fifo}: is a fifo, not a regular file; nothing was written"]
    assert "Traceback" not in done.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("option", ["--html", "--save-baseline"])
def test_an_output_at_a_folder_or_in_a_missing_folder_is_refused(tmp_path, option):
    from gputopo.errors import UsageError
    from gputopo.outputs import check_output, write_output

    with pytest.raises(UsageError, match=f"^{option} .*: is a folder"):
        check_output(tmp_path, option)
    with pytest.raises(UsageError, match="cannot write: the folder .* does not exist"):
        write_output(tmp_path / "no" / "such.json", "x", option)
    write_output(tmp_path / "fine.json", "made", option)
    assert (tmp_path / "fine.json").read_text() == "made"


def test_a_finished_temp_file_gets_the_mode_asked_whatever_the_umask(tmp_path):
    # The check state's writer asks 0644 (users read root's verdict); without a mode, mkstemp's 0600 stays.
    from gputopo.outputs import finished_temp

    old = os.umask(0o077)
    try:
        shared = finished_temp(tmp_path, "state.json", "{}\n", mode=0o644)
        private = finished_temp(tmp_path, "state.json", "{}\n")
    finally:
        os.umask(old)
    assert shared.read_text() == "{}\n" and shared.name.startswith(".state.json.")
    assert oct(shared.stat().st_mode & 0o777) == "0o644"
    assert oct(private.stat().st_mode & 0o777) == "0o600"
