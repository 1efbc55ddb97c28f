"""The rule table and the Xid table against DCGM's health watches and Xid mappings (tests/dcgm_health_watch),
and ``gputopo check --list-rules`` printing the table itself.

Every row states DCGM's severity beside ours; where ours would drain and DCGM only warns (or the other way
round), the row must say why. The transcription of DCGM is itself checked against DCGM's source where a
copy is at hand (the repository fetched to /work/.mirror, or DCGM_SOURCE naming the .cpp file)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dcgm_health_watch as dcgm
import fake_driver
from gputopo.findings import NOTE, PROBLEM
from gputopo.health.rules import DCGM_FAIL, DCGM_NONE, DCGM_WARN, RULES
from gputopo.health.xid import XID_TABLE


def _monitor(source: str) -> str | None:
    m = re.search(r"\b(Monitor\w+|BuildXidMappings)\b", source)
    return m.group(1) if m else None


def test_every_rule_states_dcgms_severity_and_explains_a_difference() -> None:
    for rule in RULES.values():
        assert rule.dcgm in (DCGM_FAIL, DCGM_WARN, DCGM_NONE), rule.name
        if rule.dcgm == DCGM_NONE:
            continue
        watch = _monitor(rule.dcgm_source)
        assert watch is not None, f"{rule.name}: DCGM's severity without the watch it comes from"
        if watch != "BuildXidMappings":
            assert watch in dcgm.WATCHES, f"{rule.name}: {watch} is not one of DCGM's watches"
            assert rule.dcgm in dcgm.WATCHES[watch], f"{rule.name}: DCGM's {watch} never says {rule.dcgm}"
        # DCGM fail <-> gputopo drains; DCGM warn <-> a note or a problem that does not drain.
        agrees = rule.drains == (rule.dcgm == DCGM_FAIL)
        assert agrees or rule.why, (
            f"{rule.name}: ours ({rule.severity}/{rule.action}) differs from DCGM's {rule.dcgm}, no why"
        )


def test_every_dcgm_watch_has_a_rule_or_says_why_not() -> None:
    cited = {_monitor(r.dcgm_source) for r in RULES.values()} | {
        w for r in RULES.values() for w in re.findall(r"Monitor\w+", r.dcgm_source + " " + r.source)
    }
    for watch in dcgm.WATCHES:
        assert watch in cited or watch in dcgm.NOT_COVERED, f"DCGM's {watch} has no rule"


def test_every_xid_dcgm_maps_is_in_the_table_with_dcgms_severity() -> None:
    for code, severity in dcgm.XIDS.items():
        assert code in XID_TABLE, f"Xid {code} (DCGM: {severity}) is not in gputopo's table"
        c = XID_TABLE[code]
        assert c.dcgm == severity, f"Xid {code}: DCGM says {severity}, the table says {c.dcgm}"
        drains = c.severity == PROBLEM and c.action in ("reset", "drain", "replace", "reboot")
        agrees = drains == (severity == "fail")
        assert agrees or c.why, f"Xid {code}: ours ({c.severity}/{c.action}) differs from DCGM's {severity}"
    # A code DCGM does not map that we treat as a problem says why.
    for code, c in XID_TABLE.items():
        assert c.severity in (PROBLEM, NOTE)
        if code not in dcgm.XIDS and c.severity == PROBLEM:
            assert c.why, f"Xid {code}: a problem DCGM does not map, without saying why"


def test_the_catalogues_reset_when_convenient_and_blackwell_codes() -> None:
    for code in (63, 94):
        assert XID_TABLE[code].severity == NOTE and "when convenient" in XID_TABLE[code].remedy
    for code in (109, 110, 119, 120, 136, 140, 143, 155, 156, 158):
        assert XID_TABLE[code].severity == PROBLEM and XID_TABLE[code].action == "reset", code
    for code in range(144, 151):
        assert "NVLink5" in XID_TABLE[code].description


def _dcgm_source() -> str | None:
    named = os.environ.get("DCGM_SOURCE")
    if named and Path(named).is_file():
        return Path(named).read_text(errors="replace")
    mirror = Path("/work/.mirror/NVIDIA+DCGM/repo")
    if not mirror.exists():
        return None
    done = subprocess.run(
        ["git", "-C", str(mirror), "show", f"{dcgm.DCGM_COMMIT}:modules/health/DcgmHealthWatch.cpp"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout if done.returncode == 0 else None


def test_the_transcription_matches_dcgms_source() -> None:
    source = _dcgm_source()
    if source is None:
        pytest.skip(
            "no copy of DCGM's DcgmHealthWatch.cpp here (fetch github:NVIDIA/DCGM or set DCGM_SOURCE)"
        )
    xids = source[source.index("void DcgmHealthWatch::BuildXidMappings") :]
    found = {
        int(code): sev.lower()
        for code, sev in re.findall(r"\{\s*(\d+),\s*\{\s*DCGM_HEALTH_RESULT_(WARN|FAIL)", xids[:8000])
    }
    assert found == dcgm.XIDS
    bodies = re.split(r"\ndcgmReturn_t DcgmHealthWatch::", source)
    for body in bodies:
        name = body.split("(", 1)[0]
        if name in dcgm.WATCHES:
            said = {s.lower() for s in re.findall(r"DCGM_HEALTH_RESULT_(WARN|FAIL)", body)}
            assert said == set(dcgm.WATCHES[name]), name


# --- --list-rules -------------------------------------------------------------------------------------------


def list_rules(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(fake_driver.SRC)}
    return subprocess.run(
        [sys.executable, "-m", "gputopo", "check", "--list-rules", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_list_rules_prints_the_table_itself_text_and_json(tmp_path: Path) -> None:
    text = list_rules()
    assert text.returncode == 0, text.stderr
    for rule in RULES.values():
        assert rule.name in text.stdout and rule.source in text.stdout
    assert (
        "pcie_replay_rate  [pcie] note/monitor, does not drain; limit 1e-12 bit error rate per lane"
        in text.stdout
    )
    doc = json.loads(list_rules("--json").stdout)
    assert [r["name"] for r in doc["rules"]] == list(RULES)
    row = {r["name"]: r for r in doc["rules"]}["clocks_hw_slowdown"]
    assert (row["severity"], row["action"], row["dcgm"], row["drains"]) == ("problem", "drain", "warn", True)
    assert row["why"] and row["remedy"] and row["source"]
    # With --thresholds, the table in force.
    rules = tmp_path / "t.json"
    rules.write_text('{"nvlink_crc_per_s": 250, "persistence_off": {"enabled": false}}')
    doc = json.loads(list_rules("--json", "--thresholds", str(rules)).stdout)
    row = {r["name"]: r for r in doc["rules"]}
    assert row["nvlink_crc_per_s"]["limit"] == 250 and row["persistence_off"]["enabled"] is False
    # The network and PCIe-path rules are in the same listing, and overridable the same way.
    assert "port_symbol_errors  [network] problem/replace, drains; limit 10 errors per second" in text.stdout
    assert "acs_redirect  [pcie] problem/config, does not drain; limit -" in text.stdout
    assert "DCGM: n/a (DCGM's health watches read GPUs and NVSwitches, not NIC ports" in text.stdout
    rules.write_text('{"port_symbol_errors": 25}')
    doc = json.loads(list_rules("--json", "--thresholds", str(rules)).stdout)
    row = {r["name"]: r for r in doc["rules"]}
    assert row["port_symbol_errors"]["limit"] == 25 and row["port_symbol_errors"]["dcgm"] == "none"


def test_the_docs_rule_reference_is_the_table_itself() -> None:
    from gputopo.ui.check_view import rules_markdown

    page = Path(__file__).resolve().parents[1] / "docs" / "health-rules.md"
    text = page.read_text()
    begin, end = "<!-- rules:begin -->\n", "<!-- rules:end -->"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    table = rules_markdown(RULES.values(), sorted(XID_TABLE.items()))
    if os.environ.get("GPUTOPO_WRITE_DOCS") == "1":
        page.write_text(head + begin + table + end + tail)
        return
    assert rest.split(end, 1)[0] == table, (
        "docs/health-rules.md's rule reference is out of date: GPUTOPO_WRITE_DOCS=1 pytest "
        "tests/test_check_rules.py -k reference"
    )


# --- NVLink5 (Blackwell) counters, read through the NVML door ---------------------------------------------


def test_nvlink5_counters_are_read_per_link_through_the_door_and_each_rise_fails() -> None:
    from fake_nvml import FakeNvml
    from gputopo.health.judge import judge
    from gputopo.health.readings import HealthSample
    from gputopo.system import health_reads, nvml

    def sample(fake: FakeNvml) -> HealthSample:
        with fake.installed(), nvml.session() as s:
            return HealthSample(
                tuple(health_reads.read_gpu_health(s, i) for i in range(s.device_count())), 0.0
            )

    fake = FakeNvml.nvswitch_box(health=True)
    before = sample(fake)
    assert all(n.nvl5 is None for g in before.gpus for n in g.nvlinks)  # before NVLink5: nothing, no gap
    assert all(g.unknown == () for g in before.gpus)
    fake.gpus[1].health.fields.update({(208, 3): 5, (221, 3): 0, (221, 4): 0})
    first = sample(fake)
    assert first.gpus[1].nvlinks[3].nvl5 == ((208, 5), (221, 0))
    fake.gpus[1].health.fields.update({(208, 3): 8, (221, 4): 1})
    second = sample(fake)
    found = [f for f in judge(first, second, window_s=2.0).findings if f.rule == "nvlink5_error_rise"]
    assert [(f.gpu, f.severity, f.action) for f in found] == [(1, PROBLEM, "reset"), (1, PROBLEM, "reset")]
    assert "NVLink5 receive errors rose by 3 in 2.0 s (NVML field 208; link 3: +3)" in found[0].what
    assert "NVLink5 symbol errors rose by 1" in found[1].what


def test_unrepairable_memory_is_read_where_the_driver_has_it_and_fails_as_in_dcgm() -> None:
    from fake_nvml import FakeNvml
    from gputopo.health.judge import judge
    from gputopo.health.readings import HealthSample
    from gputopo.system import health_reads, nvml

    fake = FakeNvml.nvswitch_box(health=True)
    fake.gpus[2].health.unrepairable_memory = True
    fake.gpus[3].health.unrepairable_memory = False
    with fake.installed(), nvml.session() as s:
        sample = HealthSample(tuple(health_reads.read_gpu_health(s, i) for i in range(s.device_count())), 0.0)
    assert [g.memory_unrepairable for g in sample.gpus] == [None, None, True, False]
    assert all(g.unknown == () for g in sample.gpus)  # a driver without it is no gap
    found = judge(sample, sample, window_s=2.0).findings
    assert [(f.gpu, f.rule, f.severity, f.action) for f in found] == [
        (2, "memory_unrepairable", PROBLEM, "replace")
    ]
