"""Output where people send it: a narrow or zero-width terminal, a pipe whose reader stops (`| head -1`),
a full disk (`> /dev/full`), a file rather than a terminal, and a command that does not exist. Each case
runs the real `gputopo` program with its stdout where the user would put it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

SAMPLE = "sample:seed-8gpu-nv4"


def gputopo(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gputopo", *args],
        env={**os.environ, **(env or {})},
        capture_output="stdout" not in kw,
        text=True,
        timeout=120,
        **kw,
    )


def in_terminal(columns: int, *args: str, env: dict | None = None) -> str:
    """What ``gputopo ARGS`` shows on a terminal ``columns`` wide (a real pseudo-terminal)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | (env or {})
    env["TERM"] = "xterm"  # rich lays a "dumb" terminal out at 80 columns whatever its size
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputopo", *args], stdout=follower, stderr=subprocess.DEVNULL, env=env
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the terminal closed: the program has ended
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)  # styles


@pytest.mark.parametrize("columns", ["0", "20", "abc"])
def test_an_unusable_columns_is_treated_as_unset(columns):
    done = gputopo("topo", "--input", SAMPLE, env={"COLUMNS": columns})
    assert done.returncode == 0
    unset = gputopo("topo", "--input", SAMPLE, env={"COLUMNS": ""})
    assert done.stdout == unset.stdout and "GPU0" in done.stdout


def test_a_narrow_terminal_folds_the_gpu_column_instead_of_cutting_it():
    shown = in_terminal(44, "recommend", "--n", "8", "--input", SAMPLE, env={"COLUMNS": "20"})
    lines = shown[shown.index("Ranked") :].splitlines()
    header = next(i for i, line in enumerate(lines) if "GPUs" in line)
    col = lines[header].index("GPUs")
    body = lines[header + 2 :]  # under the rule: the one 8-GPU set, folded over several lines
    end = next((i for i, line in enumerate(body) if not line.strip()), len(body))
    gpus = "".join(line[col : col + 8].strip() for line in body[:end])
    assert gpus.startswith("0,1,2,3,4,5,6,7"), shown  # whole: folded, never cut to `0,1…`
    assert "…" not in "".join(line[col : col + 8] for line in body[:end])


def test_piped_kill_stale_is_not_padded(tmp_path):
    device = tmp_path / "nvidia0"
    device.write_text("")
    holder = subprocess.Popen(["sh", "-c", f"exec 3<{device}; exec sleep 60"])
    try:
        time.sleep(0.3)
        done = gputopo("kill-stale", "--device-files", str(tmp_path / "nvidia*"))
    finally:
        holder.kill()
        holder.wait()
    assert str(holder.pid) in done.stdout, done.stdout + done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) < 400


@pytest.mark.parametrize("args", [["topo", "--input", SAMPLE], ["topo", "--input", SAMPLE, "--json"]])
def test_a_reader_that_stops_reading_is_no_failure(args):
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first line: every write meets a closed pipe
    try:
        done = gputopo(*args, stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_head_dash_1_exits_0():
    done = subprocess.run(
        f"{sys.executable} -m gputopo topo --input sample:dgx2-v100-16gpu | head -1 >/dev/null; "
        'echo "${PIPESTATUS[0]}"',
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip() == "0", done.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_a_full_disk_is_one_line_and_exit_2(extra):
    with open("/dev/full", "w") as full:
        done = gputopo("topo", "--input", SAMPLE, *extra, stdout=full, stderr=subprocess.PIPE)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr
    assert len(errors) == 1 and "no space left on device" in errors[0]
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("torchrun", [[], ["--torchrun"]])
def test_run_of_a_missing_command_says_so_before_starting_anything(tmp_path, torchrun):
    done = gputopo("run", "--n", "2", *torchrun, "--input", SAMPLE, "--", "nonexistent-cmd", cwd=tmp_path)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr
    assert errors == ["error: command not found: nonexistent-cmd"]
    assert "gputopo run: GPUs" not in done.stderr  # nothing was launched
    assert "Traceback" not in done.stderr
