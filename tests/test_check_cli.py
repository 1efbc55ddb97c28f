"""``gputopo check`` as a scheduler runs it: a real process on the fake driver, its exit code, its first line,
its formats, bad input, and a baseline saved on one node and compared on a broken one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fake_driver
from test_health_reads import healthy

pytestmark = pytest.mark.skipif(
    fake_driver.compiler() is None, reason="no C compiler to build the fake driver"
)

FAST = ("--sample-s", "0.2", "--kernel-log", "/dev/null")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def machine(tmp_path: Path, lines: list[str], name: str = "machine.txt") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(["driver 570.86.15", "cuda 12080", *lines]) + "\n")
    return path


def check(driver: Path, machine_file: Path, *args: str):  # type: ignore[no-untyped-def]
    return fake_driver.run(driver, machine_file, "check", *args, timeout=60)


@fake_driver.NEEDS_FABRIC_BINDINGS
def test_a_healthy_node_exits_0_with_the_reason_first(driver: Path, tmp_path: Path) -> None:
    result = check(driver, machine(tmp_path, [*healthy(0), *healthy(1)]), *FAST)
    assert result.returncode == 0, result.stderr
    # No IMEX configuration here: no daemon is expected, so IMEX is not checked (never a problem).
    assert result.stdout.splitlines() == [
        "healthy: 2 GPUs, no problems, 1 not checked",
        "not checked: IMEX (no IMEX daemon expected here: no /etc/nvidia-imex/nodes_config.cfg, "
        "no --expect-imex)",
    ]


def test_a_failed_row_remap_exits_1_and_names_it_first(driver: Path, tmp_path: Path) -> None:
    result = check(driver, machine(tmp_path, [*healthy(0), *healthy(1), "remap 1 0 2 0 1"]), *FAST)
    assert result.returncode == 1
    assert result.stdout.splitlines()[0] == (
        "problems: a row remapping failed on GPU1 (2 rows remapped for uncorrectable errors)"
    )


@fake_driver.NEEDS_FABRIC_BINDINGS
def test_a_pending_row_remap_is_reset_when_convenient_a_note(driver: Path, tmp_path: Path) -> None:
    result = check(driver, machine(tmp_path, [*healthy(0), *healthy(1), "remap 1 0 0 1 0"]), *FAST)
    assert result.returncode == 0
    assert result.stdout.splitlines()[:2] == [
        "healthy: 2 GPUs, no problems, 1 note, 1 not checked",
        "NOTE     GPU1       memory/reset: a row remapping is pending on GPU1",
    ]


@fake_driver.NEEDS_FABRIC_BINDINGS
def test_json_document(driver: Path, tmp_path: Path) -> None:
    result = check(
        driver, machine(tmp_path, [*healthy(0), "clocks 0 8"]), *FAST, "--json", "--expect-gpus", "2"
    )
    assert result.returncode == 1
    doc = json.loads(result.stdout)
    assert doc["schema"] == "gputopo/check/v1" and doc["verdict"] == "problems"
    assert {"where", "gpu", "category", "what", "remedy", "severity", "action", "rule"} == set(
        doc["findings"][0]
    )
    assert [f["what"] for f in doc["findings"] if f["severity"] == "problem"][:2] == [
        "NVML sees 1 GPUs, 2 expected",
        "GPU0: clocks held down by hardware slowdown (clocks event reasons 0x8; 34 C, 71 W of 700 W)",
    ]
    g = doc["gpus"][0]
    assert (g["index"], g["pci_bus_id"], g["health"]["clocks_event_reasons"]) == (0, "00000000:18:00.0", 8)
    assert [n["what"] for n in doc["not_checked"]] == ["IMEX"] and doc["elapsed_s"] > 0


@pytest.mark.parametrize(
    ("extra", "code", "word"),
    [([], 0, "OK"), (["persist 0 0"], 1, "WARNING"), (["field 0 230 2"], 2, "CRITICAL")],
)
def test_nagios_codes(driver: Path, tmp_path: Path, extra: list[str], code: int, word: str) -> None:
    result = check(driver, machine(tmp_path, [*healthy(0), *extra]), *FAST, "--format", "nagios")
    assert result.returncode == code
    assert result.stdout.startswith(f"GPUTOPO {word} - ") and len(result.stdout.splitlines()) == 1


def test_no_driver_is_unknown_exit_3(driver: Path, tmp_path: Path) -> None:
    result = check(driver, tmp_path / "no-such-machine.txt", *FAST)  # the fake answers DriverNotLoaded
    assert result.returncode == 3
    assert result.stdout.splitlines()[0].startswith("unknown: NVML could not start")
    nagios = check(driver, tmp_path / "no-such-machine.txt", *FAST, "--format", "nagios")
    assert nagios.returncode == 3 and nagios.stdout.startswith("GPUTOPO UNKNOWN - ")


def test_an_xid_in_the_kernel_log_is_pinned_on_its_gpu(driver: Path, tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("NVRM: Xid (PCI:0000:28:00): 79, pid=1, GPU has fallen off the bus.\n")
    result = check(
        driver, machine(tmp_path, [*healthy(0), *healthy(1)]), "--sample-s", "0.2", "--kernel-log", str(log)
    )
    assert result.returncode == 1
    assert result.stdout.splitlines()[0].startswith("problems: Xid 79 (GPU has fallen off the bus) on GPU1")


def test_a_hung_gpu_ends_within_the_budget_as_a_problem(driver: Path, tmp_path: Path) -> None:
    lines = [*healthy(0), *healthy(1), "hang 1 nvmlDeviceGetTemperature"]
    result = check(driver, machine(tmp_path, lines), *FAST, "--budget", "8", "--json")
    assert result.returncode == 1  # the subprocess timeout (60 s) is the guard against a hang
    doc = json.loads(result.stdout)
    assert doc["gpus"][1]["health"]["state"] == "not responding"
    assert doc["gpus"][0]["health"]["ecc_enabled"] is True


def test_a_gpu_whose_answer_breaks_the_bindings_is_unknown_and_the_others_are_judged(
    driver: Path, tmp_path: Path
) -> None:
    # A VBIOS version that is not UTF-8 makes nvidia-ml-py's own decode raise UnicodeDecodeError: a
    # surprise in one GPU's read. GPU0 is still judged (its pending row remap found), GPU1 is unknown.
    path = machine(tmp_path, [*healthy(0), *healthy(1), "remap 0 0 0 0 1"])
    path.write_bytes(path.read_bytes() + b"vbios 1 \xff\xfe\n")
    result = check(driver, path, *FAST, "--json")
    assert result.returncode == 1, result.stderr
    doc = json.loads(result.stdout)
    assert doc["reason"] == "a row remapping failed on GPU0 (0 rows remapped for uncorrectable errors)"
    assert doc["gpus"][1]["health"]["ecc_enabled"] is None
    [gpu1] = [n for n in doc["not_checked"] if n["what"].startswith("GPU1")]
    assert gpu1["why"].startswith("reading it failed: UnicodeDecodeError")
    only = machine(tmp_path, [*healthy(0)], "only.txt")
    only.write_bytes(only.read_bytes() + b"vbios 0 \xff\xfe\n")
    alone = check(driver, only, *FAST)
    assert alone.returncode == 3, alone.stderr
    assert alone.stdout.splitlines()[0] == "unknown: no GPU could be read"


def test_gpus_that_all_hang_cost_the_budget_once_and_the_rest_are_not_read(
    driver: Path, tmp_path: Path
) -> None:
    # Every GPU hangs. Each hang costs one NVML deadline (a quarter of the budget here) until the budget is
    # near; the GPU then being read gets only what is left, and is "not read", not "not responding".
    lines = [*(line for i in range(6) for line in healthy(i)), "hang * nvmlDeviceGetTemperature"]
    result = check(driver, machine(tmp_path, lines), *FAST, "--budget", "6", "--json")
    assert result.returncode == 1, result.stderr
    doc = json.loads(result.stdout)
    states = [g["health"]["state"] for g in doc["gpus"]]
    hung = states.count("not responding")
    assert 1 <= hung < 6 and states[:hung] == ["not responding"] * hung
    assert all(state is None for state in states[hung:])
    budget = [n["what"] for n in doc["not_checked"] if "time budget ran out" in n["why"]]
    assert budget == [", ".join(f"GPU{i}" for i in range(hung, 6)) + ": every health value"]


def test_a_budget_spent_before_any_gpu_is_read_is_unknown_exit_3(driver: Path, tmp_path: Path) -> None:
    result = check(
        driver,
        machine(tmp_path, [*healthy(0)]),
        "--sample-s",
        "0",
        "--budget",
        "0.5",
        "--kernel-log",
        "/dev/null",
    )
    assert result.returncode == 3
    assert result.stdout.splitlines()[0] == "unknown: the time budget ran out before any GPU was read"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "5x"], "--since 5x: not a duration"),
        (["--budget", "0"], "--budget 0: must be more than 0 seconds"),
        (["--expect-gpus", "-1"], "--expect-gpus -1: must be 0 or more"),
        (["--sample-s", "30"], "--sample-s 30: must be at least 0 and less than --budget"),
        (["--format", "xml"], "--format xml: not a format"),
        # Every command refuses a number option that is not finite, in one place (cli/common.guarded).
        (["--sample-s", "nan"], "--sample-s nan: must be a finite number"),
        (["--budget", "inf"], "--budget inf: must be a finite number"),
        (["--nvml-timeout", "nan"], "--nvml-timeout nan: must be a finite number"),
        (["--thresholds", "/nonexistent.toml"], "cannot read it"),
        (["--baseline", "/nonexistent.json"], "cannot read it"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_read(
    driver: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    result = check(driver, machine(tmp_path, ["hang-init"]), *args)  # NVML would hang if it were touched
    assert result.returncode == 2
    assert result.stdout == ""
    assert message in result.stderr.splitlines()[0]


def test_bad_thresholds_file_is_exit_2(driver: Path, tmp_path: Path) -> None:
    bad = tmp_path / "t.toml"
    bad.write_text("no_such_rule = 3\n")
    result = check(driver, machine(tmp_path, ["hang-init"]), "--thresholds", str(bad))
    assert result.returncode == 2 and "unknown rule 'no_such_rule'" in result.stderr


def test_thresholds_file_changes_the_verdict(driver: Path, tmp_path: Path) -> None:
    t = tmp_path / "t.toml"
    t.write_text("[clocks_hw_slowdown]\nseverity = 'note'\n")
    result = check(driver, machine(tmp_path, [*healthy(0), "clocks 0 8"]), *FAST, "--thresholds", str(t))
    assert result.returncode == 0 and result.stdout.startswith("healthy: 1 GPU, no problems, 1 note")


def test_baseline_saved_then_a_gpu_goes_missing(driver: Path, tmp_path: Path) -> None:
    golden = tmp_path / "golden.json"
    good = machine(tmp_path, [*healthy(0), *healthy(1), *healthy(2)], "good.txt")
    saved = check(driver, good, *FAST, "--save-baseline", str(golden))
    assert saved.returncode == 0, saved.stderr
    assert json.loads(golden.read_text())["gpu_count"] == 3
    same = check(driver, good, *FAST, "--baseline", str(golden))
    assert same.returncode == 0, same.stdout
    broken = machine(tmp_path, [*healthy(0), *healthy(1)], "broken.txt")
    result = check(driver, broken, *FAST, "--baseline", str(golden))
    assert result.returncode == 1
    assert result.stdout.splitlines()[0] == "problems: 2 GPUs, the baseline has 3 (and 1 more problem)"
    assert (
        "the GPU at 00000000:38:00.0 (NVIDIA H100 80GB HBM3, GPU2 in the baseline) is missing"
        in result.stdout
    )


def test_a_truncated_baseline_is_exit_2(driver: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.json"
    cut.write_text('{"schema": "gputopo/baseline/v1", "gpu_count": 3, "gpus": [')
    result = check(driver, machine(tmp_path, ["hang-init"]), "--baseline", str(cut))
    assert result.returncode == 2 and "truncated" in result.stderr


def test_a_hung_gpu_skips_the_baseline_comparison_rather_than_wait_on_it_again(
    driver: Path, tmp_path: Path
) -> None:
    golden = tmp_path / "golden.json"
    good = machine(tmp_path, [*healthy(0), *healthy(1)], "good.txt")
    assert check(driver, good, *FAST, "--save-baseline", str(golden)).returncode == 0
    hung = machine(tmp_path, [*healthy(0), *healthy(1), "hang 1 nvmlDeviceGetTemperature"], "hung.txt")
    result = check(driver, hung, *FAST, "--budget", "8", "--baseline", str(golden), "--json")
    assert result.returncode == 1, result.stderr
    doc = json.loads(result.stdout)
    assert doc["gpus"][1]["health"]["state"] == "not responding"
    [skipped] = [n for n in doc["not_checked"] if n["what"] == "baseline comparison"]
    assert skipped["why"].startswith("GPU1 did not answer NVML")


def test_every_gpu_refusing_access_is_never_healthy(driver: Path, tmp_path: Path) -> None:
    # NVML's Insufficient Permissions (4) for every GPU: nothing could be judged. For root (the health
    # check's user) that is a broken node: a problem naming the driver. Never "healthy", never exit 0.
    import os

    lines = [*healthy(0), *healthy(1), "handle 0 4", "handle 1 4"]
    result = check(driver, machine(tmp_path, lines), *FAST, "--format", "nagios")
    assert result.returncode != 0 and not result.stdout.startswith("GPUTOPO OK")
    text = check(driver, machine(tmp_path, lines), *FAST)
    if os.geteuid() == 0:
        assert text.returncode == 1
        assert text.stdout.startswith(
            "problems: every GPU (2) refused NVML access to root (Insufficient Permissions; driver 570.86.15)"
        )
    else:
        assert text.returncode == 3 and "all 2 refused access" in text.stdout


def test_all_refused_reads_unknown_for_a_user() -> None:
    from gputopo.health.check import summarize
    from gputopo.health.readings import GpuHealth, HealthSample

    refused = tuple(
        GpuHealth(index=i, error="Insufficient Permissions", state="not accessible") for i in range(2)
    )
    result = summarize(HealthSample(refused, 0.0), None, (), (), 0.1)
    assert (result.verdict, result.exit_code) == ("unknown", 3)
    assert result.reason == (
        "no GPU could be read: all 2 refused access (Insufficient Permissions); run the check as root"
    )


def test_the_problems_summary_keeps_apostrophes_and_the_slurm_reason_drops_them() -> None:
    # Issue 42: the one-line summary read "the fabrics health summary" for "the fabric's health summary".
    from gputopo.findings import PROBLEM, Finding
    from gputopo.health.check import summarize
    from gputopo.health.node_action import slurm_reason

    what = "GPU2: the fabric's health summary is UNHEALTHY though its health mask (0x1aa) names no fault"
    f = Finding("GPU2", what, "check nvidia-fabricmanager", PROBLEM, gpu=2, category="nvlink", action="drain")
    result = summarize(None, None, (f,), (), 0.1)
    assert result.reason.startswith("GPU2: the fabric's health summary")
    assert "fabrics health" in slurm_reason([f]) and "'" not in slurm_reason([f])
