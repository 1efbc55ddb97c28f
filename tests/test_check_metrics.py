"""``gputopo check --format prometheus`` per GPU, as Prometheus reads it (prometheus_client's own parser):
a health gauge per GPU, problems per GPU by rule, Xid lines counted once each across checks (a counter
that does not fall when a line leaves ``--since``), the check's own ``up``, each subsystem's status, the
acceptance and the NVLink domain in ``nvidia.com/gpu.clique``'s form; and that form itself, as GPU
feature discovery builds it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import fake_driver
from test_check_cli import check, machine
from test_health_reads import healthy

pytestmark = pytest.mark.skipif(
    fake_driver.compiler() is None, reason="no C compiler to build the fake driver"
)

parser = pytest.importorskip("prometheus_client.parser")

UUID0 = "GPU-00000000-aaaa-bbbb-cccc-000000000000"
UUID1 = "GPU-00000001-aaaa-bbbb-cccc-000000000001"
CLUSTER = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31"


def since_boot(ago_s: float) -> str:
    """A dmesg stamp ``ago_s`` before now, in seconds since boot: inside check's 2 h window whatever the
    machine's uptime (fixed stamps of 100-200 s fell out of it once the machine was up 2 h)."""
    up = float(Path("/proc/uptime").read_text().split()[0])
    return f"[{max(up - ago_s, 0.0):12.6f}]"


XID79 = f"{since_boot(90)} NVRM: Xid (PCI:0000:18:00): 79, pid=123, GPU has fallen off the bus.\n"
XID48 = f"{since_boot(80)} NVRM: Xid (PCI:0000:28:00): 48, pid=7, DBE (double bit error) ECC error.\n"


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def by_labels(family: Any, *keys: str) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels[k] for k in keys): s.value for s in family.samples}


def metrics(driver: Path, tmp_path: Path, lines: list[str], log: str, state: Path | None, *extra: str):  # type: ignore[no-untyped-def]
    kern = tmp_path / "kern.log"
    kern.write_text(log)
    args = ["--sample-s", "0.2", "--kernel-log", str(kern), "--format", "prometheus", *extra]
    if state is not None:
        args += ["--state", str(state)]
    return check(driver, machine(tmp_path, lines), *args)


SICK = [*healthy(0), "remap 0 0 0 0 1", *healthy(1), "eccerr 1 0 3 0 3"]


def test_per_gpu_health_problems_by_rule_and_up(driver: Path, tmp_path: Path) -> None:
    result = metrics(driver, tmp_path, SICK, XID79, tmp_path / "state.json")
    assert result.returncode == 1, result.stderr
    fam = families(result.stdout)
    assert fam["gputopo_check_up"].type == "gauge" and fam["gputopo_check_up"].samples[0].value == 1
    healthy_gauge = by_labels(fam["gputopo_gpu_healthy"], "uuid", "index")
    assert healthy_gauge == {(UUID0, "0"): 0, (UUID1, "1"): 0}
    problems = by_labels(fam["gputopo_gpu_problems"], "uuid", "index", "rule")
    assert problems == {
        (UUID0, "0", "row_remap_failure"): 1,
        (UUID0, "0", "xid_hardware"): 1,
        (UUID1, "1", "ecc_volatile_uncorrected"): 1,
    }
    # A counter by Prometheus' conventions: the family is named without _total, its sample with it.
    xids = fam["gputopo_gpu_xid_events"]
    assert xids.type == "counter" and [s.name for s in xids.samples] == ["gputopo_gpu_xid_events_total"]
    assert by_labels(xids, "uuid", "index", "xid") == {(UUID0, "0", "79"): 1}
    status = by_labels(fam["gputopo_subsystem_status"], "subsystem", "condition")
    assert status == {
        ("memory", "GputopoGPUMemoryProblem"): 1,
        ("nvlink", "GputopoNVLinkProblem"): 0,
        ("xid", "GputopoXidProblem"): 1,
        ("pcie", "GputopoPCIeProblem"): 0,
        ("imex", "GputopoIMEXProblem"): 0,  # no IMEX daemon expected here: not applicable, not an alarm
        ("driver", "GputopoDriverProblem"): 0,
        ("accept", "GputopoNotAccepted"): 1,  # never accepted
    }
    assert fam["gputopo_node_accepted"].samples[0].value == 0
    assert by_labels(fam["gputopo_node_accept_state"], "state") == {
        ("accepted",): 0,
        ("rejected",): 0,
        ("stale",): 0,
        ("none",): 1,
        ("unknown",): 0,
    }
    # Every series once per scrape.
    for f in fam.values():
        keys = [(s.name, tuple(sorted(s.labels.items()))) for s in f.samples]
        assert len(keys) == len(set(keys)), f.name
    well = metrics(driver, tmp_path, [*healthy(0), *healthy(1)], "", None)
    fam = families(well.stdout)
    assert by_labels(fam["gputopo_gpu_healthy"], "uuid") == {(UUID0,): 1, (UUID1,): 1}
    assert fam["gputopo_gpu_problems"].samples == []
    assert "gputopo_gpu_xid_events" not in fam  # no --state: no running count, so no counter at all


def test_no_gpu_readable_is_up_0_and_no_healthy_gauge(driver: Path, tmp_path: Path) -> None:
    result = check(
        driver,
        tmp_path / "no-driver.txt",
        "--sample-s",
        "0.2",
        "--kernel-log",
        "/dev/null",
        "--format",
        "prometheus",
    )
    assert result.returncode == 3
    fam = families(result.stdout)
    assert fam["gputopo_check_up"].samples[0].value == 0
    assert "gputopo_gpu_healthy" not in fam  # never "healthy" with nothing seen
    status = by_labels(fam["gputopo_subsystem_status"], "subsystem")
    assert all(status[(s,)] == 3 for s in ("memory", "nvlink", "pcie", "driver", "accept"))


def test_the_xid_counter_never_falls_when_a_line_leaves_the_window(driver: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    lines = [*healthy(0), *healthy(1)]

    def count(log: str) -> dict[tuple[str, ...], float]:
        result = metrics(driver, tmp_path, lines, log, state)
        return by_labels(families(result.stdout)["gputopo_gpu_xid_events"], "uuid", "xid")

    assert count(XID79) == {(UUID0, "79"): 1}
    assert count(XID79) == {(UUID0, "79"): 1}  # the same line again: counted once
    assert count("") == {(UUID0, "79"): 1}  # it left the window: the count stays
    assert count(XID79 + XID48) == {(UUID0, "79"): 1, (UUID1, "48"): 1}
    # Another Xid 79 line (a later stamp) on the same GPU adds one.
    again = f"{since_boot(30)} NVRM: Xid (PCI:0000:18:00): 79, pid=123, GPU has fallen off the bus.\n"
    assert count(again) == {(UUID0, "79"): 2, (UUID1, "48"): 1}
    doc = json.loads(state.read_text())
    assert len(doc["xid_counter"]["counted"]) == 3 and doc["schema"] == "gputopo/check-state/v1"


@fake_driver.NEEDS_FABRIC_BINDINGS
def test_the_nvlink_domain_in_gpu_clique_form_in_metrics_npd_and_topo(driver: Path, tmp_path: Path) -> None:
    lines = [*healthy(0), *healthy(1), f"fabricv3 0 {CLUSTER} 1", f"fabricv3 1 {CLUSTER} 1"]
    result = metrics(driver, tmp_path, lines, "", tmp_path / "state.json")
    assert result.returncode == 0, result.stdout + result.stderr
    (info,) = families(result.stdout)["gputopo_nvlink_domain_info"].samples
    assert info.labels == {"gpu_clique": f"{CLUSTER}.7"} and info.value == 1
    npd = check(
        driver,
        machine(tmp_path, lines),
        "--format",
        "npd",
        "--subsystem",
        "nvlink",
        "--state",
        str(tmp_path / "state.json"),
        "--max-output-length",
        "200",
    )
    assert npd.returncode == 0 and f"gpu.clique {CLUSTER}.7" in npd.stdout
    topo = fake_driver.run(driver, machine(tmp_path, lines), "topo", "--json")
    assert json.loads(topo.stdout)["gpu_clique"] == f"{CLUSTER}.7"
    # Registration still in progress on one GPU: that GPU does not count (GFD's IsFabricAttached).
    pending = [ln.replace("fabric 1 3 0 7", "fabric 1 2 0 7") for ln in lines]
    topo = fake_driver.run(driver, machine(tmp_path, pending), "topo", "--json")
    assert json.loads(topo.stdout)["gpu_clique"] == f"{CLUSTER}.7"
    # No cluster UUID (an HGX board behind its own NVSwitches): no label, no domain info.
    plain = metrics(driver, tmp_path, [*healthy(0), *healthy(1)], "", None)
    assert families(plain.stdout)["gputopo_nvlink_domain_info"].samples == []


def test_clique_label_is_formed_as_gpu_feature_discovery_forms_it() -> None:
    from gputopo.topology.nvlink_domain import ZERO_UUID, clique_label

    ok = (True, 0, CLUSTER, 32766)
    assert clique_label([ok, ok]) == f"{CLUSTER}.32766"
    assert clique_label([(True, 0, CLUSTER.upper(), 3)]) == f"{CLUSTER}.3"  # uuid.String() is lower case
    assert clique_label([(True, 0, CLUSTER, 0)]) == f"{CLUSTER}.0"  # clique 0 is labelled too
    assert clique_label([ok, (False, 0, CLUSTER, 5)]) == f"{CLUSTER}.32766"  # not completed: not counted
    assert clique_label([ok, (True, 0, ZERO_UUID, 5)]) == f"{CLUSTER}.32766"  # zero UUID: not counted
    assert clique_label([ok, (True, 27, CLUSTER, 5)]) == f"{CLUSTER}.32766"  # failed status: not counted
    assert clique_label([ok, (True, 0, CLUSTER, 5)]) is None  # cliques disagree: GFD sets no label
    assert clique_label([ok, (True, 0, "11111111-2222-3333-4444-555555555555", 32766)]) is None
    assert clique_label([(False, 0, CLUSTER, 1)]) is None and clique_label([]) is None


def test_an_npd_message_keeps_its_rule_and_action_within_the_limit() -> None:
    from gputopo.health.subsystems import SubsystemResult
    from gputopo.ui.check_view import npd_message

    res = SubsystemResult(1, "row_remap_failure", "a row remapping failed on GPU0 " * 20, "replace")
    for limit in (80, 120, 200):
        message = npd_message(res, limit)
        assert len(message.encode()) <= limit
        assert message.startswith("[row_remap_failure] a row remapping")
        assert message.endswith("... - RecommendedAction: REPLACE_HARDWARE")
    assert npd_message(SubsystemResult(0, "ok", "fine"), 80) == "[ok] fine - RecommendedAction: NONE"
    assert len(npd_message(res, 30).encode()) <= 30  # too short for both: the words, cut


def test_the_state_keeps_other_writers_sections() -> None:
    from gputopo.health.state import CheckState, dumps_doc, parse_doc, with_check_state

    raw = {"schema": "gputopo/check-state/v1", "node": "n1", "accept": {"verdict": "accepted"}, "x": [1]}
    doc, warning = parse_doc(raw, "s.json", "n1")
    assert warning is None and doc is not None
    assert doc.sections == {"accept": {"verdict": "accepted"}, "x": [1]}
    doc = with_check_state(doc, CheckState("n1")).with_section("xid_counter", {"counted": []})
    again = json.loads(dumps_doc(doc))
    assert again["accept"] == {"verdict": "accepted"} and again["x"] == [1] and again["node"] == "n1"
    assert again["xid_counter"] == {"counted": []} and again["schema"] == "gputopo/check-state/v1"


def test_acceptance_goes_stale_when_a_vbios_changes() -> None:
    from gputopo.health.readings import GpuHealth, HealthSample
    from gputopo.health.subsystems import accept_status

    gpu = GpuHealth(0, "00000000:18:00.0", UUID0, vbios_version="96.00.99.00.02")
    sample = HealthSample((gpu,), 0.0, driver_version="570.86.15")
    section = {
        "verdict": "accepted",
        "at": 1.0,
        "driver": "570.86.15",
        "gpus": [{"uuid": UUID0, "vbios": "96.00.99.00.01"}],
    }
    status = accept_status(section, sample)
    assert status.state == "stale" and "GPU0's VBIOS changed (96.00.99.00.01 -> 96.00.99.00.02)" in status.why
    fine = accept_status({**section, "gpus": [{"uuid": UUID0, "vbios": "96.00.99.00.02"}]}, sample)
    assert fine.accepted and accept_status(None, sample).state == "none"
    assert accept_status(section, None).state == "unknown"
