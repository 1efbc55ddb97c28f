"""`--from-report` across the doctor -> avoid the bad pair -> launch story (issue 23 item 6).

A doctor report is read as well as a probe report (its probe document sits under ``probe``); every
report records the machine it was written on, and a report from another machine, or from CPU stand-ins,
is refused for a live machine (the fake C driver under the real pynvml) in one line with exit 2, unless
``--force-report``. On simulated machines (samples) a report written for another sample is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import fake_driver
from fake_driver import bus, paths, uuid
from gputopo.cli import app
from gputopo.model import Topology
from gputopo.recommend import evidence_from_report
from gputopo.topology import samples
from gputopo.topology.identity import machine_record, report_mismatch, topology_record

QUAD = "sample:quad-nv4-pairs-2socket"
SEED = "sample:seed-8gpu-nv4"

# Four healthy H100s on the fake driver: 0-1 and 2-3 share a PCIe switch each, the switches meet at the
# host bridge. The best pair is 0,1 (the first of two equal pairs).
FOUR_GPU_MACHINE = (
    "\n".join(
        [
            "driver 550.54.15",
            "cuda 12040",
            *(f"gpu {i} {bus(i)} {uuid(i)} {i} NVIDIA H100 PCIe" for i in range(4)),
            *(f"pcie {i} 5 5 16 16" for i in range(4)),
            *(f"mem {i} 81559 0 512" for i in range(4)),
            *(f"cpus {i} ffffffff" for i in range(4)),
            *(f"nodes {i} 1" for i in range(4)),
            *(f"mig {i} 0 0" for i in range(4)),
            *paths(
                {(0, 1): "PIX", (2, 3): "PIX", (0, 2): "PHB", (0, 3): "PHB", (1, 2): "PHB", (1, 3): "PHB"}
            ),
        ]
    )
    + "\n"
)


def probe_doc(machine: dict | None, device: str = "cuda", bad_pair: tuple[int, int] = (0, 1)) -> dict:
    """A probe report whose dp check went to NaN on ``bad_pair``."""
    doc = {
        "schema": "gputopo/probe/v1",
        "device": device,
        "verdict": "fail",
        "sets": [
            {
                "gpus": list(bad_pair),
                "verdict": "fail",
                "checks": [{"name": "dp", "verdict": "fail", "kind": "nan"}],
            }
        ],
    }
    if machine is not None:
        doc["machine"] = machine
    return doc


def doctor_doc(probe: dict | None, machine: dict | None) -> dict:
    return {"schema": "gputopo/doctor/v1", "device": "cuda", "machine": machine, "probe": probe}


def live_machine(uuids: dict[int, str] | None = None, host: str = "gpu-node-7") -> dict:
    return machine_record(
        host, "cuda", "nvml", uuids if uuids is not None else {i: uuid(i) for i in range(4)}
    )


def write(tmp_path: Path, name: str, doc: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


# --- doctor reports are read --------------------------------------------------------------------------


def test_a_doctor_report_is_read_through_its_probe_section():
    ev = evidence_from_report(doctor_doc(probe_doc(None), live_machine()), "doctor.json")
    assert [g.gpus for g in ev.failed] == [(0, 1)]
    assert ev.device == "cuda" and ev.machine is not None and ev.machine["source"] == "nvml"


def test_a_doctor_report_without_a_probe_says_so():
    from gputopo.errors import InputError

    with pytest.raises(InputError, match="without a probe section"):
        evidence_from_report(doctor_doc(None, live_machine()), "doctor.json")


# --- the rule, on data ----------------------------------------------------------------------------------


def _live_topo() -> Topology:
    from dataclasses import replace

    topo = samples.load(QUAD.removeprefix("sample:"))
    gpus = tuple(replace(g, uuid=uuid(g.index)) for g in topo.gpus)
    return replace(topo, gpus=gpus, source="nvml", live=True)


def test_the_same_gpus_pass_another_machine_and_stand_ins_are_refused_live():
    here = _live_topo()
    assert report_mismatch(live_machine(), "cuda", here, live=True) is None
    other = live_machine({0: "GPU-aaaa", 1: "GPU-bbbb"}, host="other-node")
    assert "its GPU0 is GPU-aaaa" in report_mismatch(other, "cuda", here, live=True)
    cpu = machine_record("gpu-node-7", "cpu", None)
    assert "CPU stand-ins" in report_mismatch(cpu, "cpu", here, live=True)
    assert "records no machine" in report_mismatch(None, "cuda", here, live=True)
    sample = topology_record(samples.load(QUAD.removeprefix("sample:")), "laptop", "cpu", live=False)
    assert "CPU stand-ins" in report_mismatch(sample, "cpu", here, live=True)


def test_on_a_sample_only_another_machines_report_is_refused():
    quad = samples.load(QUAD.removeprefix("sample:"))
    assert (
        report_mismatch(topology_record(quad, "laptop", "cpu", live=False), "cpu", quad, live=False) is None
    )
    assert report_mismatch(None, "cuda", quad, live=False) is None  # older reports, as before
    seed = topology_record(samples.load(SEED.removeprefix("sample:")), "laptop", "cpu", live=False)
    assert f"written for {SEED}" in report_mismatch(seed, "cpu", quad, live=False)


# --- samples end to end: real reports written by probe and doctor ----------------------------------------


def gputopo(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {"NO_COLOR": "1", "COLUMNS": "160"}
    import os

    return subprocess.run(
        [sys.executable, "-m", "gputopo", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def test_the_simulated_doctor_report_records_its_sample_and_stand_ins(tmp_path: Path):
    done = gputopo("doctor", "--simulate", "--skip-probe", "--json", "--report-dir", "r", cwd=tmp_path)
    assert done.returncode in (0, 1), done.stderr
    machine = json.loads(done.stdout)["machine"]
    assert machine["source"] == QUAD and machine["device"] == "cpu" and machine["hostname"]
    assert [g["index"] for g in machine["gpus"]] == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_cpu_probe_report_on_a_sample_is_used_there_and_refused_on_another_sample(tmp_path: Path):
    pytest.importorskip("torch")
    done = gputopo(
        "probe", "--device", "cpu", "--gpus", "0,1", "--mode", "allreduce", "-b", "64K", "-e", "64K",
        "--input", QUAD, "--report-dir", "r", "--json", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["machine"]["source"] == QUAD and doc["machine"]["device"] == "cpu"
    report = str(tmp_path / doc["report"]["json"])
    runner = CliRunner()
    same = runner.invoke(app, ["recommend", "--n", "2", "--input", QUAD, "--from-report", report])
    assert same.exit_code == 0, same.output
    other = runner.invoke(app, ["recommend", "--n", "2", "--input", SEED, "--from-report", report])
    assert other.exit_code == 2 and other.stdout == ""
    (line, *_) = other.stderr.splitlines()
    assert "not this machine's report" in line and f"written for {QUAD}" in line
    forced = runner.invoke(
        app, ["recommend", "--n", "2", "--input", SEED, "--from-report", report, "--force-report"]
    )
    assert forced.exit_code == 0 and "used anyway (--force-report)" in forced.stderr


# --- a live machine: the fake C driver under the real pynvml -------------------------------------------

needs_cc = pytest.mark.skipif(fake_driver.compiler() is None, reason="no C compiler to build the fake driver")


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if fake_driver.compiler() is None:
        pytest.skip("no C compiler to build the fake driver")
    lib = fake_driver.build(tmp_path_factory.mktemp("driver"))
    machine = tmp_path_factory.mktemp("four") / "machine.txt"
    machine.write_text(FOUR_GPU_MACHINE)
    return lib, machine


def recommend_live(four: tuple[Path, Path], report: Path, *more: str) -> subprocess.CompletedProcess[str]:
    lib, machine = four
    return fake_driver.run(lib, machine, "recommend", "--n", "2", "--from-report", str(report), *more)


@needs_cc
def test_live_a_doctor_report_from_this_machine_keeps_the_bad_pair_apart(four, tmp_path: Path):
    report = write(tmp_path, "doctor.json", doctor_doc(probe_doc(live_machine()), live_machine()))
    done = recommend_live(four, report, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["best"]["gpus"] == [2, 3]
    assert [0, 1] not in [c["gpus"] for c in doc["candidates"]]


@needs_cc
@pytest.mark.parametrize(
    ("machine", "device", "why"),
    [
        (live_machine({0: "GPU-from-elsewhere", 1: uuid(1)}, host="other-node"), "cuda", "its GPU0 is"),
        (machine_record("gpu-node-7", "cpu", None), "cpu", "it ran on CPU stand-ins"),
        (machine_record("laptop", "cpu", QUAD), "cpu", "it ran on CPU stand-ins"),
        (None, "cuda", "records no machine"),
    ],
)
def test_live_a_report_from_elsewhere_or_stand_ins_is_refused_in_one_line(
    four, tmp_path: Path, machine, device, why
):
    report = write(tmp_path, "probe.json", probe_doc(machine, device=device))
    done = recommend_live(four, report)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0].startswith(f"error: --from-report {report}: not this machine's report: "), done.stderr
    assert why in lines[0] and len(lines) <= 2 and "--force-report" in done.stderr
    forced = recommend_live(four, report, "--force-report", "--json")
    assert forced.returncode == 0, forced.stderr
    assert "used anyway (--force-report)" in forced.stderr
    assert json.loads(forced.stdout)["best"]["gpus"] == [2, 3]


@needs_cc
def test_live_run_refuses_a_stand_in_report_too(four, tmp_path: Path):
    lib, machine = four
    report = write(tmp_path, "probe.json", probe_doc(machine_record("h", "cpu", None), device="cpu"))
    done = fake_driver.run(
        lib, machine, "run", "--n", "2", "--from-report", str(report), "--dry-run", "--", "python", "x.py"
    )
    assert done.returncode == 2 and "it ran on CPU stand-ins" in done.stderr
