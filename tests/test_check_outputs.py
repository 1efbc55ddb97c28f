"""``gputopo check``'s integrations as their consumers read them: node-problem-detector's custom plugin
(stdout trimmed and cut at max_output_length bytes, exit 0 OK / 1 NonOK / other Unknown, as
pkg/custompluginmonitor/plugin/plugin.go does), Prometheus's text format parsed by prometheus_client's own
parser, the textfile written atomically; node-level faults said once; the fleet baseline; rates judged
over the time since the last check (the state file)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import fake_driver
from test_check_cli import FAST, check, machine
from test_health_reads import healthy

pytestmark = pytest.mark.skipif(
    fake_driver.compiler() is None, reason="no C compiler to build the fake driver"
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def npd_reads(stdout: str, exit_code: int, max_output_length: int) -> tuple[str, str]:
    """(status, message) as node-problem-detector's plugin.run makes them: TrimSpace(stdout), cut at
    max_output_length bytes, exit 0 OK, 1 NonOK, anything else Unknown."""
    output = stdout.strip().encode()[:max_output_length].decode("utf-8", errors="replace")
    return {0: "OK", 1: "NonOK"}.get(exit_code, "Unknown"), output


SICK = [*healthy(0), "remap 0 0 0 0 1", *healthy(1), "eccerr 1 0 3 0 3"]


@fake_driver.NEEDS_FABRIC_BINDINGS
@pytest.mark.parametrize("limit", [80, 40])
def test_npd_gets_one_line_that_fits_and_the_exit_code_it_maps(
    driver: Path, tmp_path: Path, limit: int
) -> None:
    result = check(
        driver, machine(tmp_path, SICK), *FAST, "--format", "npd", "--max-output-length", str(limit)
    )
    status, message = npd_reads(result.stdout, result.returncode, limit)
    assert status == "NonOK" and result.stdout.count("\n") == 1
    assert message == result.stdout.strip() and len(message.encode()) <= limit  # nothing cut by NPD
    assert message.startswith("problems: a row remapping failed on GPU0") or message.endswith("...")
    ok = check(driver, machine(tmp_path, healthy(0)), *FAST, "--format", "npd")
    assert npd_reads(ok.stdout, ok.returncode, 80) == ("OK", "healthy: 1 GPU, no problems, 1 not checked")
    unknown = check(driver, tmp_path / "no-driver.txt", *FAST, "--format", "npd")
    assert npd_reads(unknown.stdout, unknown.returncode, 80)[0] == "Unknown"


def test_the_npd_sample_config_matches_npds_plugin_contract() -> None:
    doc = json.loads((REPO / "deploy" / "node-problem-detector" / "gputopo-check.json").read_text())
    assert doc["plugin"] == "custom"
    limit = doc["pluginConfig"]["max_output_length"]
    (rule,) = doc["rules"]
    args = rule["args"]
    assert args[:1] == ["check"] and args[args.index("--format") + 1] == "npd"
    assert int(args[args.index("--max-output-length") + 1]) == limit
    budget = float(args[args.index("--budget") + 1])
    timeout = float(rule["timeout"].rstrip("s"))
    assert budget + 5 <= timeout  # the check ends (and prints its line) before NPD kills it


def test_prometheus_parsed_by_prometheus_clients_own_parser(driver: Path, tmp_path: Path) -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    lines = [*SICK, "persist 1 0"]
    result = check(driver, machine(tmp_path, lines), *FAST, "--format", "prometheus")
    assert result.returncode == 1
    families = {f.name: f for f in parser.text_string_to_metric_families(result.stdout)}
    (status,) = families["gputopo_check_status"].samples
    assert status.value == 1 and families["gputopo_check_status"].type == "gauge"
    samples = families["gputopo_check_finding"].samples
    by_rule = {s.labels["rule"]: s for s in samples}
    remap = by_rule["row_remap_failure"]
    assert remap.labels == {
        "gpu": "0",
        "UUID": "GPU-00000000-aaaa-bbbb-cccc-000000000000",
        "pci_bus_id": "00000000:18:00.0",
        "category": "memory",
        "rule": "row_remap_failure",
        "severity": "problem",
        "action": "replace",
    }
    assert remap.value == 1
    assert by_rule["persistence_off"].labels["severity"] == "note"
    assert len(samples) == len({tuple(sorted(s.labels.items())) for s in samples})  # each series once
    healthy_run = check(driver, machine(tmp_path, healthy(0)), *FAST, "--format", "prometheus")
    families = {f.name: f for f in parser.text_string_to_metric_families(healthy_run.stdout)}
    assert (
        families["gputopo_check_status"].samples[0].value == 0
        and families["gputopo_check_finding"].samples == []
    )


def test_textfile_is_written_atomically_beside_any_format(driver: Path, tmp_path: Path) -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    folder = tmp_path / "textfile"
    folder.mkdir()
    result = check(driver, machine(tmp_path, SICK), *FAST, "--textfile", str(folder))
    assert result.returncode == 1 and result.stdout.startswith("problems: ")  # the text output as usual
    assert sorted(p.name for p in folder.iterdir()) == ["gputopo.prom"]  # no temporary file left
    families = {f.name for f in parser.text_string_to_metric_families((folder / "gputopo.prom").read_text())}
    assert {"gputopo_check_status", "gputopo_check_finding"} <= families
    # A FIFO where the file goes is refused in one warning, never waited on.
    (folder / "gputopo.prom").unlink()
    os.mkfifo(folder / "gputopo.prom")
    refused = check(driver, machine(tmp_path, SICK), *FAST, "--textfile", str(folder))
    assert refused.returncode == 1 and "gputopo.prom not written" in refused.stderr
    bad = check(driver, machine(tmp_path, SICK), *FAST, "--textfile", str(tmp_path / "missing"))
    assert bad.returncode == 2 and "--textfile" in bad.stderr


def test_fabric_manager_down_is_one_node_finding_not_one_per_gpu(driver: Path, tmp_path: Path) -> None:
    lines = []
    for i in range(4):
        lines += [*healthy(i), f"fabric {i} 1 0 7 0"]  # registration not started on every GPU
    result = check(driver, machine(tmp_path, lines), *FAST, "--json")
    doc = json.loads(result.stdout)
    problems = [f for f in doc["findings"] if f["severity"] == "problem"]
    assert [(f["where"], f["gpu"], f["rule"]) for f in problems] == [("node", None, "fabric_not_ready")]
    assert "nvidia-fabricmanager" in problems[0]["what"] and "all 4 GPUs" in problems[0]["what"]
    # On one GPU only, it stays that GPU's.
    single = [*(x for i in range(4) for x in healthy(i)), "fabric 3 1 0 7 0"]
    one = json.loads(check(driver, machine(tmp_path, single), *FAST, "--json").stdout)
    assert [f["where"] for f in one["findings"] if f["severity"] == "problem"] == ["GPU3"]


@fake_driver.NEEDS_FABRIC_BINDINGS
def test_a_fleet_baseline_compares_cleanly_on_a_sibling(driver: Path, tmp_path: Path) -> None:
    golden = tmp_path / "fleet.json"
    saved = check(
        driver,
        machine(tmp_path, [*healthy(0), *healthy(1)]),
        *FAST,
        "--save-baseline",
        str(golden),
        "--fleet",
    )
    assert saved.returncode == 0, saved.stderr
    doc = json.loads(golden.read_text())
    assert doc["fleet"] is True and all(g["uuid"] is None and g["vbios"] is None for g in doc["gpus"])
    # A sibling: same build, other GPUs (other UUIDs and VBIOS).
    sibling = [
        line.replace("GPU-0000", "GPU-9999").replace("96.00.99.00.01", "96.00.aa.00.02")
        for line in [*healthy(0), *healthy(1)]
    ]
    compared = check(driver, machine(tmp_path, sibling, "sibling.txt"), *FAST, "--baseline", str(golden))
    assert compared.returncode == 0 and compared.stdout.splitlines() == [
        "healthy: 2 GPUs, no problems, 1 not checked",
        "not checked: IMEX (no IMEX daemon expected here: no /etc/nvidia-imex/nodes_config.cfg, "
        "no --expect-imex)",
    ]
    per_node = tmp_path / "node.json"
    check(driver, machine(tmp_path, [*healthy(0), *healthy(1)]), *FAST, "--save-baseline", str(per_node))
    noisy = check(driver, machine(tmp_path, sibling, "sibling.txt"), *FAST, "--baseline", str(per_node))
    assert "UUID" in noisy.stdout  # what --fleet leaves out


def test_counters_are_judged_over_the_time_since_the_last_check(driver: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    lines = [*healthy(0), *healthy(1), "nverr 0 2 40 0 0 0", "replay 1 500"]
    env = {"GPUTOPO_CHECK_STATE": str(state)}
    first = fake_driver.run(driver, machine(tmp_path, lines), "check", *FAST, timeout=60, extra_env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    doc = json.loads(state.read_text())
    gpu0 = doc["counters"]["gpus"]["GPU-00000000-aaaa-bbbb-cccc-000000000000"]
    assert gpu0["links"]["2"][0] == 40
    # Ten minutes ago the counters were lower: 5 replays on link 2 since, and 400 PCIe replays on GPU1.
    doc["counters"]["at"] = time.time() - 600
    gpu0["links"]["2"][0] = 35
    doc["counters"]["gpus"]["GPU-00000001-aaaa-bbbb-cccc-000000000001"]["pcie_replays"] = 100
    state.write_text(json.dumps(doc))
    again = fake_driver.run(
        driver, machine(tmp_path, lines), "check", *FAST, "--json", timeout=60, extra_env=env
    )
    result = json.loads(again.stdout)
    rules = {(f["gpu"], f["rule"]): f for f in result["findings"]}
    slow = rules[(0, "nvlink_replay_rise")]
    assert (
        slow["severity"] == "problem"
        and "rose by 5" in slow["what"]
        and "since the last check, 10 min ago" in slow["what"]
    )
    pcie = rules[(1, "pcie_replay_rate")]
    assert pcie["severity"] == "note" and "(40/min" in pcie["what"]
    assert again.returncode == 1


def test_recommend_run_and_doctor_use_the_last_checks_judgement_while_fresh(
    driver: Path, tmp_path: Path
) -> None:
    # check judges GPU0's NVLink replays over the 10 minutes since its last run; one live sample cannot.
    state = tmp_path / "state.json"
    lines = [*healthy(0), *healthy(1), "nverr 0 2 40 0 0 0"]
    env = {"GPUTOPO_CHECK_STATE": str(state)}
    path = machine(tmp_path, lines)
    assert fake_driver.run(driver, path, "check", *FAST, timeout=60, extra_env=env).returncode == 0
    doc = json.loads(state.read_text())
    doc["counters"]["at"] = time.time() - 600
    doc["counters"]["gpus"]["GPU-00000000-aaaa-bbbb-cccc-000000000000"]["links"]["2"][0] = 30
    state.write_text(json.dumps(doc))
    checked = fake_driver.run(driver, path, "check", *FAST, timeout=60, extra_env=env)
    assert checked.returncode == 1 and "GPU0: NVLink replay errors rose by 10" in checked.stdout
    rec = json.loads(
        fake_driver.run(driver, path, "recommend", "--n", "1", "--json", timeout=60, extra_env=env).stdout
    )
    why = {e["gpu"]: e["why"] for e in rec["excluded"]}
    assert list(why) == [0] and "NVLink replay errors rose by 10" in why[0] and "(gputopo check, " in why[0]
    assert rec["best"]["gpus"] == [1]
    run = fake_driver.run(
        driver,
        path,
        "run",
        "--n",
        "1",
        "--dry-run",
        "--json",
        "--",
        "python",
        "t.py",
        timeout=60,
        extra_env=env,
    )
    assert [e["gpu"] for e in json.loads(run.stdout)["excluded"]] == [0]
    # Without the state (or once stale), one live sample says nothing about GPU0.
    alone = json.loads(
        fake_driver.run(
            driver, path, "recommend", "--n", "1", "--json", timeout=60, extra_env={"GPUTOPO_CHECK_STATE": ""}
        ).stdout
    )
    assert alone["excluded"] == []
    doc = json.loads(state.read_text())
    doc["last"]["at"] = time.time() - 3600
    for judged in doc["results"].values():  # each rule set's judgement (here the default rules')
        judged["at"] = time.time() - 3600
    state.write_text(json.dumps(doc))
    stale = json.loads(
        fake_driver.run(driver, path, "recommend", "--n", "1", "--json", timeout=60, extra_env=env).stdout
    )
    assert stale["excluded"] == []


def _bindings_have(what: str) -> bool:
    """Whether the installed nvidia-ml-py has ``what``: the unrepairable-memory call, or (field, scope)
    pairs in nvmlDeviceGetFieldValues (the oldest supported bindings may lack either; gputopo then reads
    neither, and says nothing)."""
    import inspect

    import pynvml

    if what == "scoped fields":
        return "scopeId" in inspect.getsource(pynvml.nvmlDeviceGetFieldValues)
    return hasattr(pynvml, what)


@pytest.mark.skipif(
    not _bindings_have("scoped fields"), reason="these nvidia-ml-py bindings cannot scope a field"
)
def test_nvlink5_counters_on_the_c_fake_driver(driver: Path, tmp_path: Path) -> None:
    # Link 2's NVLink5 receive-error counter (NVML field 208, scoped to the link) rises by 3 a read.
    lines = [*healthy(0), "lfield 0 2 208 5 3", "lfield 0 2 221 0"]
    result = check(driver, machine(tmp_path, lines), *FAST, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["gpus"][0]["health"]["nvlinks"][2]["nvl5"] == [[208, 8], [221, 0]]
    (f,) = [f for f in doc["findings"] if f["rule"] == "nvlink5_error_rise"]
    assert f["what"].startswith("GPU0: NVLink5 receive errors rose by 3 in ")


@pytest.mark.skipif(
    not _bindings_have("nvmlDeviceGetUnrepairableMemoryFlag_v1"), reason="these nvidia-ml-py bindings lack it"
)
def test_unrepairable_memory_on_the_c_fake_driver(driver: Path, tmp_path: Path) -> None:
    result = check(
        driver, machine(tmp_path, [*healthy(0), "unrepairable 0 1", *healthy(1), "unrepairable 1 0"]), *FAST
    )
    assert result.returncode == 1
    assert result.stdout.splitlines()[0] == "problems: the driver flags the memory of GPU0 as unrepairable"


def test_nvlink5_ecc_total_and_ber_levels_on_the_c_fake_driver(driver: Path, tmp_path: Path) -> None:
    # Issue 42: DCGM 4.6 MonitorNVLink5Fields (DcgmHealthWatch.cpp lines 2807-2947 at 72fa3fe) fails a rise
    # of the NVLink ECC data error total (NVML field 160) and an effective BER worse than 1e-12 (field 220,
    # read with scopeId UINT_MAX), even while no per-link counter moves. 0x50b: mantissa 5, exponent 11.
    nvl5 = ["lfield 0 2 208 5", "lfield 0 2 221 0"]
    lines = [*healthy(0), *nvl5, "field 0 160 40 1", "field 0 220 1291", "field 0 222 0"]
    result = check(driver, machine(tmp_path, lines), *FAST, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    rules = sorted(f["rule"] for f in doc["findings"])
    assert rules == ["nvlink_ecc_data_rise", "nvlink_effective_ber"], doc["findings"]
    health = doc["gpus"][0]["health"]
    assert (health["nvlink_effective_ber_raw"], health["nvlink_symbol_ber_raw"]) == (1291, 0)
    # Healthy levels (1e-15 effective, a zero symbol BER) and a still total: healthy.
    lines = [*healthy(0), *nvl5, "field 0 160 40", "field 0 220 271", "field 0 222 0"]
    result = check(driver, machine(tmp_path, lines, "fine.txt"), *FAST, "--json")
    assert result.returncode == 0, result.stdout
    assert not [n for n in json.loads(result.stdout)["not_checked"] if "field 2" in n["why"] + n["what"]]
    # A driver without those fields on an NVLink5 GPU: not checked, never a fault.
    result = check(driver, machine(tmp_path, [*healthy(0), *nvl5], "old.txt"), *FAST, "--json")
    assert result.returncode == 0, result.stdout
    skipped = [n["what"] for n in json.loads(result.stdout)["not_checked"]]
    for what in ("field 160", "field 220", "field 222"):
        assert any(what in s for s in skipped), skipped
    # Before NVLink5 (no per-link NVLink5 counters): a missing field is no gap.
    result = check(driver, machine(tmp_path, healthy(0), "h100.txt"), *FAST, "--json")
    assert not [n for n in json.loads(result.stdout)["not_checked"] if "NVML field" in n["what"]]
