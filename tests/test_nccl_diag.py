"""`gputopo hang --nccl-log`: NCCL's active diagnostics (NCCL_RUN_DIAGNOSTICS=1) read from a job's output.

No NCCL >= 2.31 runs here (the installed one is older and there is no GPU), so the log is written in the
exact format of NVIDIA/nccl's DIAG_PRINT (src/include/diagnostics_log.h: "<host>:<pid> NCCL DIAG ...")
with the texts of src/diagnostics.cc and src/diagnostics/p2p.cc, behind torchrun's --tee prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import invoke
from gputopo.hang.nccl_diag import diag_findings, parse_diag
from hang_dumps import copy_dumps, real_dumps

LOG = """\
some training output
[default0]:node-a:4242 NCCL DIAG === NCCL Diagnostics ===
[default0]:node-a:4242 NCCL DIAG [OK] net bw: skipped (single host or no network transport)
[default0]:node-a:4242 NCCL DIAG [INFO] p2p: write mismatch srcRank=0 srcCudaDev=0 srcNvmlDev=4 dstRank=1 \
dstCudaDev=1 dstNvmlDev=5 path=NVL handle=CUMEM_POSIX_FD expected=0x00000000d1a60001 got=0x0000000000000000 \
verify=0x0000000000000000; check the single-node NVLink topology and peer-access state with \
'nvidia-smi topo -m' and 'nvidia-smi topo -p2p n'
[default0]:node-a:4242 NCCL DIAG [INFO] p2p: only 55/56 GPU-to-GPU peer accesses passed verification
[default0]:node-a:4242 NCCL DIAG [INFO] transport detect returned 3
[default0]:node-a:4242 NCCL DIAG NCCL diagnostics completed in 12.3 ms across 8 ranks
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fr")


def test_diag_lines_are_parsed_with_host_pid_tag_and_pair() -> None:
    lines = parse_diag(LOG)
    assert [(x.host, x.pid, x.level) for x in lines][:3] == [
        ("node-a", 4242, None),
        ("node-a", 4242, "OK"),
        ("node-a", 4242, "INFO"),
    ]
    assert len(lines) == 6
    found, notes = diag_findings(lines, "job.log")
    assert [f["category"] for f in found] == ["nvlink", "topology"]
    pair = found[0]
    assert pair["where"] == "node-a:4242 GPU4-GPU5" and pair["severity"] == "problem"
    assert "rank 0 GPU 4 -> rank 1 GPU 5, path NVL" in pair["what"]
    assert pair["remedy"].startswith("check the single-node NVLink topology")
    assert notes[0] == "job.log: 6 NCCL DIAG line(s): 1 check(s) OK, 2 failed"
    assert any("transport detect returned 3" in n for n in notes)


def test_hang_nccl_log_alone_is_incomplete_with_the_findings(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text(LOG)
    result = invoke("hang", "--nccl-log", str(log), "--json")
    assert result.exit_code == 3
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "incomplete"
    assert sum(1 for f in doc["findings"] if f["what"].startswith("NCCL DIAG")) == 2


def test_hang_with_dumps_and_a_log_keeps_the_hang_and_adds_the_diag(base: Path, tmp_path: Path) -> None:
    folder = copy_dumps(real_dumps("never", base), tmp_path / "run")
    log = tmp_path / "job.log"
    log.write_text("nothing from NCCL here\n")
    doc = json.loads(invoke("hang", str(folder), "--nccl-log", str(log), "--json").stdout)
    assert doc["verdict"] == "hang"
    assert any("no `NCCL DIAG` lines" in n for n in doc["notes"])
    log.write_text(LOG)
    doc = json.loads(invoke("hang", str(folder), "--nccl-log", str(log), "--json").stdout)
    assert doc["verdict"] == "hang" and any(f["what"].startswith("NCCL DIAG") for f in doc["findings"])


def test_a_missing_log_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = invoke("hang", "--nccl-log", str(tmp_path / "nope.log"))
    assert result.exit_code == 2 and "--nccl-log" in result.output and "no such file" in result.output


def _doctor(log: Path, tmp_path: Path):
    return invoke(
        "doctor",
        "--simulate",
        "--skip-probe",
        "--nccl-log",
        str(log),
        "--json",
        "--report-dir",
        str(tmp_path / "reports"),
    )


def test_doctor_nccl_log_with_a_failed_check_is_a_problem(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text(LOG)
    result = _doctor(log, tmp_path)
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "problems"
    diag = [f for f in doc["findings"] if f["what"].startswith("NCCL DIAG")]
    assert [(f["where"], f["category"], f["severity"]) for f in diag if f["severity"] == "problem"] == [
        ("node-a:4242 GPU4-GPU5", "nvlink", "problem"),
        ("node-a:4242", "topology", "problem"),
    ]
    assert any(f["what"] == f"{log}: 6 NCCL DIAG line(s): 1 check(s) OK, 2 failed" for f in doc["findings"])
    # The saved report (Markdown through the shared findings view) shows it too.
    markdown = Path(doc["report"]["markdown"]).read_text()
    assert "write mismatch" in markdown and "node-a:4242 GPU4-GPU5" in markdown


def test_doctor_nccl_log_with_only_ok_lines_is_healthy(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    ok = [line for line in LOG.splitlines() if "[INFO]" not in line]
    log.write_text("\n".join(ok) + "\n")
    result = _doctor(log, tmp_path)
    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["verdict"] == "healthy"
    assert not [f for f in doc["findings"] if f["severity"] == "problem"]
    assert any("3 NCCL DIAG line(s): 1 check(s) OK, 0 failed" in f["what"] for f in doc["findings"])


def test_doctor_nccl_log_without_diag_lines_says_so(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text("epoch 1 loss 0.3\n")
    result = _doctor(log, tmp_path)
    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["verdict"] == "healthy"
    [note] = [f for f in doc["findings"] if "NCCL DIAG" in f["what"]]
    assert note["severity"] == "note" and "no `NCCL DIAG` lines" in note["what"]
    assert "--nccl-diagnostics" in note["remedy"]


def test_doctor_missing_nccl_log_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = _doctor(tmp_path / "nope.log", tmp_path)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--nccl-log" in result.output and "no such file" in result.output
    assert not (tmp_path / "reports").exists() or not any((tmp_path / "reports").iterdir())
