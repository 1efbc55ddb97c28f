"""node-problem-detector's protocol, run as NPD runs it: the plugin config's rules (deploy/node-problem-
detector/gputopo-check.json, the one the Kubernetes ConfigMap carries) one at a time in the config's order
(``concurrency: 1``: pkg/custompluginmonitor/plugin/plugin.go ``runRules`` takes a slot before it starts each
rule), each command's stdout trimmed and cut at ``max_output_length`` bytes and its exit code mapped 0 OK
(condition False), 1 NonOK (True), anything else Unknown (``toConditionStatus``), on the fake driver's
boards; the NVML calls counted at the fake driver (``FAKE_NVML_TRACE``): one check's worth per interval,
whatever the number of conditions."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

import fake_driver
from test_health_reads import healthy

pytestmark = pytest.mark.skipif(
    fake_driver.compiler() is None, reason="no C compiler to build the fake driver"
)

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "deploy" / "node-problem-detector" / "gputopo-check.json"
STATE = "/var/lib/gputopo/check-state.json"
METRICS = "/var/lib/gputopo/metrics"


def xid79(ago_s: float = 60.0) -> str:
    """A dmesg Xid 79 line stamped ``ago_s`` before now in seconds since boot, inside check's 2 h window
    whatever the machine's uptime (a fixed stamp of 100 s fell out of it once the machine was up 2 h)."""
    up = float(Path("/proc/uptime").read_text().split()[0])
    stamp = f"[{max(up - ago_s, 0.0):12.6f}]"
    return f"{stamp} NVRM: Xid (PCI:0000:18:00): 79, pid=123, GPU has fallen off the bus.\n"


XID79 = xid79()
MESSAGE = re.compile(r"\[[a-z0-9_]+\] .+ - RecommendedAction: [A-Z_]+")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def board(tmp_path: Path, lines: list[str], driver_version: str = "570.86.15") -> Path:
    path = tmp_path / "machine.txt"
    path.write_text("\n".join([f"driver {driver_version}", "cuda 12080", *lines]) + "\n")
    return path


class Npd:
    """One interval of NPD over the plugin config: ``run`` returns condition -> (status, message) as NPD
    records them, and how many NVML calls each rule made."""

    def __init__(self, driver: Path, tmp_path: Path) -> None:
        self.driver, self.tmp = driver, tmp_path
        self.config = json.loads(CONFIG.read_text())
        self.state = tmp_path / "state.json"
        self.metrics = tmp_path / "metrics"
        self.metrics.mkdir(exist_ok=True)
        self.trace = tmp_path / "nvml.trace"
        self.kernel_log = tmp_path / "kern.log"
        self.kernel_log.write_text("")

    def args(self, rule: dict[str, Any]) -> list[str]:
        args = [
            str(self.state) if a == STATE else str(self.metrics) if a == METRICS else a for a in rule["args"]
        ]
        if "--subsystem" not in args:  # the first rule reads this board's kernel log, and briefly
            args += ["--kernel-log", str(self.kernel_log), "--sample-s", "0.2"]
        return args

    def run(self, machine: Path) -> tuple[dict[str, tuple[str, str]], list[int]]:
        limit = self.config["pluginConfig"]["max_output_length"]
        seen: dict[str, tuple[str, str]] = {}
        reads: list[int] = []
        for rule in self.config["rules"]:  # concurrency 1: one at a time, in order
            before = self.calls()
            done = fake_driver.run(
                self.driver,
                machine,
                *self.args(rule),
                timeout=float(rule["timeout"].rstrip("s")) + 60,  # generous: a loaded test machine
                extra_env={"FAKE_NVML_TRACE": str(self.trace)},
            )
            output = done.stdout.strip().encode()[:limit].decode("utf-8", errors="replace")
            status = {0: "False", 1: "True"}.get(done.returncode, "Unknown")
            seen[rule["condition"]] = (status, output)
            reads.append(self.calls() - before)
            assert len(done.stdout.strip().encode()) <= limit and done.stdout.count("\n") == 1, done.stdout
            assert "Traceback" not in done.stderr, done.stderr
        return seen, reads

    def calls(self) -> int:
        return len(self.trace.read_text().splitlines()) if self.trace.exists() else 0


BOARDS: dict[str, tuple[list[str], str]] = {
    "healthy": ([*healthy(0), *healthy(1)], ""),
    "ecc": ([*healthy(0), *healthy(1), "eccerr 1 0 3 0 3"], ""),
    "remap failure": ([*healthy(0), "remap 0 0 0 0 1", *healthy(1)], ""),
    "fabric fault": ([*healthy(0), *healthy(1), "fabric 1 3 0 7 5aa"], ""),
    "xid 79": ([*healthy(0), *healthy(1)], XID79),
    "unreadable gpu": ([*healthy(0), *healthy(1), "handle 1 15"], ""),
}
# What each board sets True (every other subsystem condition False; the acceptance is True everywhere:
# no `gputopo accept` ran on these boards).
EXPECTED = {
    "healthy": {},
    "ecc": {"GputopoGPUMemoryProblem": "ecc_volatile_uncorrected"},
    "remap failure": {"GputopoGPUMemoryProblem": "row_remap_failure"},
    "fabric fault": {"GputopoNVLinkProblem": "fabric_unhealthy"},
    "xid 79": {"GputopoXidProblem": "xid_hardware"},
    "unreadable gpu": {"GputopoDriverProblem": "gpu_unreadable"},
}


@fake_driver.NEEDS_FABRIC_BINDINGS
@pytest.mark.parametrize("name", list(BOARDS))
def test_each_condition_as_npd_records_it_with_one_nvml_read_per_interval(
    driver: Path, tmp_path: Path, name: str
) -> None:
    from gputopo.health.subsystems import ROLLUP_CONDITION, SUBSYSTEMS

    lines, log = BOARDS[name]
    npd = Npd(driver, tmp_path)
    npd.kernel_log.write_text(log)
    seen, reads = npd.run(board(tmp_path, lines))
    print(f"\n{name}:")  # what NPD would record (pytest -s shows it)
    for condition, (status, message) in seen.items():
        print(f"  {condition}={status}: {message}")
    # One NVML read per interval: the first rule read the GPUs; the seven others made no NVML call.
    assert reads[0] > 0 and reads[1:] == [0] * len(SUBSYSTEMS), reads
    expected = EXPECTED[name]
    for s in SUBSYSTEMS:
        status, message = seen[s.condition]
        assert MESSAGE.fullmatch(message), message
        if s.name == "accept":
            assert (status, message) == (
                "True",
                "[accept_missing] no gputopo accept verdict on this node - "
                "RecommendedAction: RUN_GPUTOPO_ACCEPT",
            )
        elif s.condition in expected:
            assert status == "True" and message.startswith(f"[{expected[s.condition]}] "), message
        else:
            assert status == "False" and message.startswith("[ok] "), (s.condition, message)
    rollup = seen[ROLLUP_CONDITION]
    assert rollup[0] == ("True" if expected else "False"), rollup
    if name == "healthy":  # IMEX on a node that runs none (an idle DRA node, an HGX board): not an alarm
        assert seen["GputopoIMEXProblem"][1].startswith("[ok] not applicable: no IMEX daemon expected here")
    if name == "remap failure":
        assert seen["GputopoGPUMemoryProblem"][1].endswith("- RecommendedAction: REPLACE_HARDWARE")
    if name == "xid 79":
        assert "Xid 79" in seen["GputopoXidProblem"][1]


def test_no_gpu_readable_is_unknown_never_ok(driver: Path, tmp_path: Path) -> None:
    npd = Npd(driver, tmp_path)
    seen, reads = npd.run(tmp_path / "no-driver.txt")  # no machine: the driver answers DriverNotLoaded
    assert seen["GputopoGPUProblem"][0] == "Unknown"
    for condition in (
        "GputopoGPUMemoryProblem",
        "GputopoNVLinkProblem",
        "GputopoPCIeProblem",
        "GputopoDriverProblem",
    ):
        status, message = seen[condition]
        assert status == "Unknown" and message.startswith("[not_checked] "), (condition, message)
    assert seen["GputopoXidProblem"][0] == "False"  # the kernel log was read: no Xid in it
    # Never accepted is known without a GPU: no verdict at all (with one, unknown: nothing to compare).
    assert seen["GputopoNotAccepted"][1].startswith("[accept_missing] ")
    assert reads[1:] == [0] * (len(reads) - 1)


def test_a_stale_or_missing_record_is_unknown(driver: Path, tmp_path: Path) -> None:
    npd = Npd(driver, tmp_path)
    machine = board(tmp_path, [*healthy(0)])
    rule = npd.config["rules"][1]

    def answer() -> tuple[int, str]:
        done = fake_driver.run(driver, machine, *npd.args(rule), timeout=60)
        return done.returncode, done.stdout.strip()

    code, out = answer()
    assert code == 3 and out.startswith("[no_result] no check has recorded a result yet"), out
    npd.run(machine)
    assert answer() == (0, "[ok] no GPU memory problem on 1 GPU - RecommendedAction: NONE")
    doc = json.loads(npd.state.read_text())
    doc["subsystems"]["at"] = time.time() - 600  # the last interval's record: the check did not run since
    npd.state.write_text(json.dumps(doc))
    code, out = answer()
    assert code == 3 and re.match(
        r"\[stale\] the last check's result is \d+ s old \(more than --max-age 120 s\)", out
    )
    bad = fake_driver.run(
        driver, machine, "check", "--format", "npd", "--subsystem", "gpu", "--state", str(npd.state)
    )
    assert bad.returncode == 2 and "not a subsystem" in bad.stderr
    # Without --state a rule reads where readers read (GPUTOPO_CHECK_STATE, else root's default) ...
    by_env = fake_driver.run(
        driver,
        machine,
        "check",
        "--format",
        "npd",
        "--subsystem",
        "memory",
        extra_env={"GPUTOPO_CHECK_STATE": str(npd.state)},
    )
    assert by_env.returncode == 3 and by_env.stdout.startswith("[stale]"), by_env.stdout
    # ... and with no state at all (GPUTOPO_CHECK_STATE empty) it is a usage error.
    no_state = fake_driver.run(
        driver,
        machine,
        "check",
        "--format",
        "npd",
        "--subsystem",
        "memory",
        extra_env={"GPUTOPO_CHECK_STATE": ""},
    )
    assert no_state.returncode == 2 and "needs the check state" in no_state.stderr


def test_answering_rules_take_no_lock_and_the_record_is_written_only_under_it(
    driver: Path, tmp_path: Path
) -> None:
    """While another writer holds the state's lock, a one-subsystem rule still answers at once (it only
    reads); the checking rule saves nothing, its per-subsystem record and Xid counters included (they are
    written only under the lock, with the check's own sections)."""
    import fcntl
    import os

    npd = Npd(driver, tmp_path)
    npd.kernel_log.write_text(XID79)
    machine = board(tmp_path, [*healthy(0)])
    npd.run(machine)
    saved = json.loads(npd.state.read_text())
    assert saved["xid_counter"]["counts"][0]["xid"] == 79
    assert saved["subsystems"]["results"]["xid"]["status"] == 1
    held = os.open(npd.state.with_name(npd.state.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        done = fake_driver.run(driver, machine, *npd.args(npd.config["rules"][3]), timeout=60)
        assert done.returncode == 1 and done.stdout.startswith("[xid_hardware]"), done.stdout
        assert time.monotonic() - started < 20  # it never waited on the lock (held until the end)
        npd.kernel_log.write_text(XID79 + xid79(ago_s=30.0))
        check = fake_driver.run(driver, machine, *npd.args(npd.config["rules"][0]), "--budget", "3")
        assert check.returncode == 3 and "held by another gputopo" in check.stderr + check.stdout
        assert json.loads(npd.state.read_text()) == saved  # nothing written without the lock
    finally:
        os.close(held)


def accepted_section(lines: list[str]) -> dict[str, Any]:
    """What `gputopo accept` keeps after passing on a board (its own section of the state, in the shape of
    i45's accept/record.py ``make``: the verdict, when, the driver and each GPU's UUID and VBIOS)."""
    gpus = [ln.split() for ln in lines if ln.startswith("gpu ")]
    return {
        "schema": "gputopo/accept-record/v1",
        "verdict": "accepted",
        "reason": "every step passed",
        "at": time.time(),
        "driver": "570.86.15",
        "gpus": [{"index": int(g[1]), "uuid": g[3], "vbios": "96.00.99.00.01"} for g in gpus],
    }


@fake_driver.NEEDS_FABRIC_BINDINGS
def test_accepted_then_not_after_the_driver_changes(driver: Path, tmp_path: Path) -> None:
    lines = [*healthy(0), *healthy(1)]
    npd = Npd(driver, tmp_path)
    seen, _ = npd.run(board(tmp_path, lines))  # before: never accepted
    assert seen["GputopoNotAccepted"][0] == "True"
    doc = json.loads(npd.state.read_text())
    doc["accept"] = accepted_section(lines)  # as `gputopo accept` leaves it (i45's section)
    npd.state.write_text(json.dumps(doc))
    seen, _ = npd.run(board(tmp_path, lines))
    assert seen["GputopoNotAccepted"] == (
        "False",
        "[ok] accepted for these GPUs and this driver - RecommendedAction: NONE",
    )
    assert json.loads(npd.state.read_text())["accept"] == doc["accept"]  # the check kept accept's section
    seen, _ = npd.run(board(tmp_path, lines, driver_version="575.51.03"))
    assert seen["GputopoNotAccepted"] == (
        "True",
        "[accept_stale] not accepted since the driver changed (570.86.15 -> 575.51.03) - "
        "RecommendedAction: RUN_GPUTOPO_ACCEPT",
    )
    swapped = [ln.replace("GPU-00000001-aaaa", "GPU-00000009-aaaa") for ln in lines]
    seen, _ = npd.run(board(tmp_path, swapped))
    assert seen["GputopoNotAccepted"][0] == "True" and "the GPUs changed" in seen["GputopoNotAccepted"][1]
    doc = json.loads(npd.state.read_text())
    doc["accept"] = {**accepted_section(lines), "verdict": "rejected"}
    npd.state.write_text(json.dumps(doc))
    seen, _ = npd.run(board(tmp_path, lines))
    assert seen["GputopoNotAccepted"][1].startswith("[accept_rejected] gputopo accept said 'rejected': every")
