"""The health judge over hand-built samples (pure): each rule, the thresholds file, and what is unknown.

The machine in most tests is an HGX H100 node as the issue found it: healthy GPUs beside one with a pending
row remap, one with an uncorrectable ECC error, one in hardware slowdown, one whose NVLink CRC errors still
climb and one trained at x8 of x16.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gputopo.errors import EXIT_USAGE, UsageError
from gputopo.findings import NOTE, PROBLEM
from gputopo.health.judge import Judgement, drains_p2p, expected_pcie_replays_per_min, judge, judge_one
from gputopo.health.readings import GpuHealth, HealthSample, NvlinkHealth, Unknown
from gputopo.health.rules import DEFAULT_THRESHOLDS, RULES, load_thresholds, parse_thresholds

WINDOW_S = 2.0


def switch_links(n: int = 18, down: tuple[int, ...] = (), **counters: int) -> tuple[NvlinkHealth, ...]:
    """A GPU's NVLinks to NVSwitches, every counter at ``counters`` (default 0)."""
    base = {"replay_errors": 0, "recovery_errors": 0, "crc_flit_errors": 0, "crc_data_errors": 0, **counters}
    return tuple(NvlinkHealth(k, k not in down, "switch", None, **base) for k in range(n))


def healthy(i: int, **kw: object) -> GpuHealth:
    """An H100 SXM with nothing wrong: ECC on, no errors, Gen5 x16, persistence on, fabric registered."""
    values: dict[str, object] = {
        "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0",
        "name": "NVIDIA H100 80GB HBM3",
        "ecc_enabled": True,
        "ecc_pending_enabled": True,
        "ecc_volatile_corrected": 0,
        "ecc_volatile_uncorrected": 0,
        "ecc_aggregate_corrected": 0,
        "ecc_aggregate_uncorrected": 0,
        "remapped_rows_corrected": 0,
        "remapped_rows_uncorrected": 0,
        "remapped_rows_pending": False,
        "remapped_rows_failure": False,
        "clocks_event_reasons": 0x1,  # idle
        "temperature_c": 35,
        "power_w": 70.0,
        "power_limit_w": 700.0,
        "pcie_gen_current": 5,
        "pcie_gen_max": 5,
        "pcie_width_current": 16,
        "pcie_width_max": 16,
        "pcie_replays": 0,
        "utilization_pct": 0,
        "persistence_mode": True,
        "recovery_action": 0,
        "fabric_state": 3,
        "fabric_status": 0,
        "fabric_health_mask": 0xAA,  # every field answered and fine (nvml.h: 2 = FALSE)
        "fabric_health_summary": 1,  # healthy
        "nvlinks": switch_links(),
    }
    values.update(kw)
    return GpuHealth(index=i, **values)  # type: ignore[arg-type]


def samples(
    before: dict[int, dict[str, object]] | None = None,
    after: dict[int, dict[str, object]] | None = None,
    n: int = 8,
) -> tuple[HealthSample, HealthSample]:
    before, after = before or {}, after or {}
    s0 = HealthSample(tuple(healthy(i, **before.get(i, {})) for i in range(n)), 100.0)
    s1 = HealthSample(tuple(healthy(i, **after.get(i, {})) for i in range(n)), 100.0 + WINDOW_S)
    return s0, s1


def found(before=None, after=None, **kw):  # type: ignore[no-untyped-def]
    s0, s1 = samples(before, after)
    return judge(s0, s1, **kw).findings


def test_a_healthy_node_has_no_findings_and_nothing_unchecked() -> None:
    s0, s1 = samples()
    result = judge(s0, s1)
    assert result.findings == () and result.not_checked == ()


def test_the_sick_hgx_node_of_the_issue() -> None:
    s0, s1 = samples(
        before={3: {"nvlinks": switch_links(crc_flit_errors=1000)}, 2: {"clocks_event_reasons": 0x8}},
        after={
            0: {"remapped_rows_pending": True},
            1: {"ecc_volatile_uncorrected": 1, "ecc_aggregate_uncorrected": 1},
            2: {"clocks_event_reasons": 0x8, "temperature_c": 88},
            3: {"nvlinks": switch_links(crc_flit_errors=1300)},
            4: {"pcie_width_current": 8},
        },
    )
    result = judge(s0, s1, WINDOW_S)
    problems = {f.gpu: f for f in result.findings if f.severity == PROBLEM}
    assert sorted(problems) == [1, 2, 3]
    # A pending row remap is reset-when-convenient (DCGM warns, Xid 63's catalogue entry): a note.
    pending = [f for f in result.findings if f.gpu == 0]
    assert [(f.severity, f.category, f.action) for f in pending] == [(NOTE, "memory", "reset")]
    assert "row remapping is pending on GPU0" in pending[0].what
    assert "1 uncorrectable ECC errors on GPU1" in problems[1].what
    assert (
        "hardware slowdown" in problems[2].what and "0x8" in problems[2].what and "88 C" in problems[2].what
    )
    assert (
        problems[3].category == "nvlink"
        and "CRC flit errors rose by 5400 in 2.0 s (2700/s" in problems[3].what
    )
    width = [f for f in result.findings if f.gpu == 4]
    assert [(f.severity, f.category) for f in width] == [(NOTE, "pcie")]
    assert "x8 of x16 (idle)" in width[0].what
    assert result.unhealthy_gpus().keys() == {1, 2, 3}
    assert result.findings[0].severity == PROBLEM and result.findings[-1].severity == NOTE


# --- memory -----------------------------------------------------------------------------------------------


def test_volatile_uncorrectable_ecc_is_a_problem_history_alone_a_note() -> None:
    f = found(after={5: {"ecc_volatile_uncorrected": 2}})
    assert [(x.gpu, x.severity, x.category) for x in f] == [(5, PROBLEM, "memory")]
    f = found(after={5: {"ecc_aggregate_uncorrected": 7}})
    assert [(x.gpu, x.severity, x.action) for x in f] == [(5, NOTE, "monitor")]
    assert "7 uncorrectable ECC errors in GPU5's history" in f[0].what


def test_row_remap_failure_means_replace() -> None:
    f = found(after={2: {"remapped_rows_failure": True, "remapped_rows_uncorrected": 40}})
    assert [(x.gpu, x.severity, x.action) for x in f] == [(2, PROBLEM, "replace")]
    assert "row remapping failed on GPU2" in f[0].what


@pytest.mark.parametrize(("rows", "expected"), [(511, []), (512, [NOTE])])  # DCGM warns
def test_uncorrectable_remapped_rows_against_dcgms_limit(rows: int, expected: list[str]) -> None:
    f = found(after={0: {"remapped_rows_uncorrected": rows}})
    assert [x.severity for x in f] == expected


def test_retired_pages_pre_ampere() -> None:
    volta = {"remapped_rows_pending": None, "remapped_rows_failure": None, "remapped_rows_uncorrected": None}
    assert found(after={1: {**volta, "retired_pages_sbe": 40, "retired_pages_dbe": 22}}) == ()
    f = found(after={1: {**volta, "retired_pages_sbe": 40, "retired_pages_dbe": 23}})
    assert [(x.gpu, x.severity, x.action) for x in f] == [(1, PROBLEM, "replace")]
    assert "63 retired pages on GPU1 (40 single-bit, 23 double-bit" in f[0].what
    # A problem that drains says so: its row's remedy, not the wearing-out note of remapped rows.
    assert f[0].remedy == "take the GPU out of service and open an RMA"
    f = found(
        after={1: {**volta, "retired_pages_sbe": 1, "retired_pages_dbe": 0, "retired_pages_pending": True}}
    )
    assert [(x.severity, x.action) for x in f] == [(NOTE, "reset")]  # DCGM MonitorMemRetiredPending warns
    assert "pending retirement" in f[0].what


def test_ecc_off_is_a_config_note() -> None:
    f = found(after={6: {"ecc_enabled": False, "ecc_pending_enabled": False}})
    assert [(x.gpu, x.severity, x.category, x.action) for x in f] == [(6, NOTE, "config", "config")]
    # The remedy is the row's, written once, with the GPU's index filled in; the table shows it as N.
    assert (
        f[0].remedy
        == "`nvidia-smi -i 6 -e 1` and a GPU reset turn it on, if the workload can spare the memory"
    )
    assert RULES["ecc_off"].remedy.startswith("`nvidia-smi -i N -e 1` and a GPU reset")


def test_a_rule_row_makes_its_finding_with_the_rows_defaults() -> None:
    row = RULES["ecc_off"]
    f = row.finding("GPU2", "ECC is off on GPU2", gpu=2)
    assert (f.rule, f.severity, f.category, f.action, f.gpu) == ("ecc_off", NOTE, "config", "config", 2)
    assert "-i 2 -e 1" in f.remedy
    # No GPU: the table's words; the evidence may decide the severity, action, category or remedy.
    assert row.finding("node", "x").remedy == row.remedy
    g = RULES["port_down"].finding("mlx5_0:1", "x", "check its cable", severity=NOTE, action="monitor")
    assert (g.severity, g.action, g.category, g.remedy) == (NOTE, "monitor", "network", "check its cable")


# --- NVLink -----------------------------------------------------------------------------------------------


def test_links_down_are_pinned_on_the_gpu_that_reports_them() -> None:
    f = found(after={3: {"nvlinks": switch_links(down=(4, 11))}})
    assert [(x.where, x.gpu, x.severity) for x in f] == [("GPU3", 3, PROBLEM)]
    assert f[0].what.startswith("GPU3: 2 of its 18 NVLinks are down (link 4, 11, to NVSwitches)")


def test_links_of_a_mig_gpu_and_of_a_card_without_bridge_are_not_down() -> None:
    assert found(after={3: {"nvlinks": switch_links(down=(4,)), "mig_enabled": True}}) == ()
    # Its peers' links to it read down too: no GPU's link status is judged while any is in MIG mode.
    s0, s1 = samples(after={3: {"mig_enabled": True}, 5: {"nvlinks": switch_links(down=(0, 1))}})
    result = judge(s0, s1)
    assert result.findings == ()
    assert [(n.what, n.why) for n in result.not_checked] == [
        ("node: NVLink status", "GPU3 in MIG mode (links to it read down, as DCGM knows)")
    ]
    bridgeless = tuple(NvlinkHealth(k, False, None, None) for k in range(4))
    assert found(before={2: {"nvlinks": bridgeless}}, after={2: {"nvlinks": bridgeless}}) == ()


@pytest.mark.parametrize("counter", ["replay_errors", "recovery_errors"])
def test_any_rise_of_replay_or_recovery_errors_is_a_problem(counter: str) -> None:
    f = found(
        before={7: {"nvlinks": switch_links(**{counter: 5})}},
        after={7: {"nvlinks": switch_links(**{counter: 6})}},
    )
    assert [(x.gpu, x.severity, x.category) for x in f] == [(7, PROBLEM, "nvlink")]
    assert "rose by 18 in 2.0 s" in f[0].what  # one per link, 18 links


def test_replay_totals_that_do_not_move_are_history() -> None:
    links = switch_links(replay_errors=3)
    f = found(before={7: {"nvlinks": links}}, after={7: {"nvlinks": links}})
    assert [(x.severity, x.action) for x in f] == [(NOTE, "monitor")]
    assert "54 NVLink replay/recovery errors in the counters' history, none in 2.0 s" in f[0].what


def test_crc_errors_rising_slowly_are_a_note_fast_a_problem() -> None:
    one_link = lambda v: tuple(  # noqa: E731
        replace(n, crc_data_errors=v if n.link == 0 else 0) for n in switch_links()
    )
    f = found(before={1: {"nvlinks": one_link(0)}}, after={1: {"nvlinks": one_link(10)}})
    assert [(x.severity, x.category) for x in f] == [(NOTE, "nvlink")]
    assert "5.0/s, below 100/s; link 0: +10" in f[0].what
    f = found(before={1: {"nvlinks": one_link(0)}}, after={1: {"nvlinks": one_link(200)}})
    assert [x.severity for x in f] == [PROBLEM] and "(100/s; limit 100/s per counter" in f[0].what


def test_each_crc_counter_is_judged_on_its_own_as_dcgm_does() -> None:
    # 60/s of flit errors and 60/s of data errors are two counters below 100/s, not 120/s.
    both = lambda v: tuple(  # noqa: E731
        replace(n, crc_flit_errors=v, crc_data_errors=v) if n.link == 0 else n for n in switch_links()
    )
    f = found(before={1: {"nvlinks": both(0)}}, after={1: {"nvlinks": both(120)}})
    assert [(x.severity, x.rule) for x in f] == [(NOTE, "nvlink_crc_rise"), (NOTE, "nvlink_crc_rise")]
    assert "CRC flit errors rose by 120" in f[0].what and "CRC data errors rose by 120" in f[1].what


def test_a_counter_that_went_down_was_reset_and_counts_from_zero() -> None:
    f = found(
        after={0: {"nvlinks": switch_links(replay_errors=3)}},
        before={0: {"nvlinks": switch_links(replay_errors=9)}},
    )
    assert [x.severity for x in f] == [PROBLEM] and "rose by 54" in f[0].what


def test_fabric_registration_not_complete_is_a_problem() -> None:
    f = found(after={4: {"fabric_state": 1}})
    assert [(x.gpu, x.severity, x.action) for x in f] == [(4, PROBLEM, "drain")]
    assert "registration not started" in f[0].what and "802" in f[0].what
    # DCGM MonitorFabricFields warns on a registration in progress: our note, never a drain.
    f = found(after={4: {"fabric_state": 2}})
    assert [(x.gpu, x.severity, x.rule) for x in f] == [(4, NOTE, "fabric_in_progress")]
    f = found(after={4: {"fabric_status": 999}})
    assert "completed with NVML_ERROR_UNKNOWN (999)" in f[0].what  # the NVML error by name
    assert found(after={4: {"fabric_state": 0, "nvlinks": ()}}) == ()  # not an NVSwitch system


def test_fabric_health_mask_degraded_bandwidth() -> None:
    f = found(after={4: {"fabric_health_mask": 0x1}})
    assert [x.severity for x in f] == [PROBLEM] and "bandwidth degraded" in f[0].what
    assert found(after={4: {"fabric_health_mask": 0x2 | 0x100}}) == ()  # FALSE and "no incorrect config"


# --- PCIe -------------------------------------------------------------------------------------------------


def test_expected_replay_rate_matches_dcgms_table() -> None:
    assert expected_pcie_replays_per_min(4, 16) == 16
    assert expected_pcie_replays_per_min(5, 16) == 31
    assert expected_pcie_replays_per_min(4, 8) == 8
    assert expected_pcie_replays_per_min(9, 16) == expected_pcie_replays_per_min(6, 16)  # capped as DCGM


def test_pcie_replays_scaled_to_the_window_gen_and_width() -> None:
    gen4 = {"pcie_gen_current": 4, "pcie_gen_max": 4}
    s0 = HealthSample((healthy(0, **gen4, pcie_replays=100),), 0.0)
    ok = HealthSample((healthy(0, **gen4, pcie_replays=116),), 60.0)  # 16/min on Gen4 x16: allowed
    bad = HealthSample((healthy(0, **gen4, pcie_replays=117),), 60.0)
    assert judge(s0, ok).findings == ()
    f = judge(s0, bad).findings
    # DCGM MonitorPcie warns above the expected rate: a note to watch, never a drain.
    assert [(x.severity, x.category, x.action) for x in f] == [(NOTE, "pcie", "monitor")]
    assert "a Gen4 x16 link at BER 1e-12 allows 16/min" in f[0].what
    # A window shorter than a minute is judged against the per-minute count, never scaled up: one replay
    # in 2 s is not 30 a minute. 31 replays on Gen5 x16 are allowed in any minute, 32 are not.
    assert found(after={0: {"pcie_replays": 1}}) == ()
    assert found(after={0: {"pcie_replays": 31}}) == ()
    assert [x.category for x in found(after={0: {"pcie_replays": 32}})] == ["pcie"]


def test_a_narrow_link_is_a_slow_link_note_unless_it_also_errors() -> None:
    assert found(after={2: {"pcie_gen_current": 1}}) == ()  # idle power saving
    idle = found(after={2: {"pcie_width_current": 8}})
    assert [(x.severity, x.action) for x in idle] == [(NOTE, "monitor")]
    busy = found(after={2: {"pcie_width_current": 8, "utilization_pct": 97}})
    assert [(x.severity, x.action) for x in busy] == [(NOTE, "monitor")]
    assert "x8 of x16 while busy: a slow link, ranked lower" in busy[0].what
    # Narrow and replaying: a failing link.
    erroring = found(after={2: {"pcie_width_current": 8, "utilization_pct": 97, "pcie_replays": 3}})
    assert [(x.severity, x.action) for x in erroring] == [(PROBLEM, "replace")]
    assert "and its replays rose by 3" in erroring[0].what
    gen = found(after={2: {"pcie_gen_current": 3, "utilization_pct": 97}})
    assert [(x.severity, x.what) for x in gen] == [(NOTE, "GPU2: PCIe link at Gen3 of Gen5 while busy")]


# --- clocks, driver, node ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mask", "words", "category", "severity"),
    [
        (0x8, "hardware slowdown", "power", PROBLEM),
        (0x20, "software thermal slowdown", "thermal", NOTE),
        (0x40, "hardware thermal slowdown", "thermal", PROBLEM),
        (0x80, "hardware power brake", "power", PROBLEM),
    ],
)
def test_clocks_held_by_hardware_thermal_or_power_brake(
    mask: int, words: str, category: str, severity: str
) -> None:
    f = found(before={6: {"clocks_event_reasons": mask}}, after={6: {"clocks_event_reasons": mask | 0x1}})
    assert [(x.gpu, x.severity, x.category) for x in f] == [(6, severity, category)]
    assert f"clocks held down by {words}" in f[0].what


def test_a_clocks_event_bit_in_one_sample_only_is_not_judged() -> None:
    s0, s1 = samples(after={6: {"clocks_event_reasons": 0x8}})
    result = judge(s0, s1)
    assert result.findings == ()
    assert [(n.what, n.why) for n in result.not_checked] == [
        ("GPU6: clocks event reasons", "seen in one sample only (a bit must hold in both)")
    ]


def test_software_power_cap_idle_and_boost_are_not_faults() -> None:
    assert found(after={6: {"clocks_event_reasons": 0x1 | 0x2 | 0x4 | 0x10 | 0x100}}) == ()


@pytest.mark.parametrize(
    ("action", "words", "what_to_do"),
    [
        (1, "GPU reset", "reset"),
        (2, "node reboot", "reboot"),
        (3, "drain P2P", "monitor"),
        (4, "drain and reset", "drain"),
    ],
)
def test_the_drivers_recovery_action_in_its_words(action: int, words: str, what_to_do: str) -> None:
    f = found(after={5: {"recovery_action": action}})
    # DCGM MonitorGpuRecoveryAction: drain P2P warns (a note: P2P work only, never a node drain).
    severity = NOTE if action == 3 else PROBLEM
    assert [(x.gpu, x.severity, x.category, x.action) for x in f] == [(5, severity, "driver", what_to_do)]
    assert f"the driver asks for recovery: {words} (NVML recovery action {action})" in f[0].what
    # Drain P2P has a rule of its own: what keeps the GPU out of multi-GPU sets, and what a thresholds
    # file can raise to a problem.
    assert f[0].rule == ("recovery_drain_p2p" if action == 3 else "recovery_action")
    assert drains_p2p(f[0]) is (action == 3)


def test_drain_p2p_raised_to_a_problem_by_a_thresholds_file_still_steers_the_sets() -> None:
    t = parse_thresholds('[recovery_drain_p2p]\nseverity = "problem"\naction = "drain"\n', "t.toml")
    f = found(after={2: {"recovery_action": 3}}, thresholds=t)
    assert [(x.gpu, x.severity, x.action, drains_p2p(x)) for x in f] == [(2, PROBLEM, "drain", True)]


def test_persistence_off_is_a_note() -> None:
    f = found(after={0: {"persistence_mode": False}})
    assert [(x.severity, x.category) for x in f] == [(NOTE, "config")]


def test_fewer_gpus_than_expected() -> None:
    s0, s1 = samples(n=7)
    f = judge(s0, s1, expect_gpus=8).findings
    assert [(x.where, x.gpu, x.severity, x.action) for x in f] == [("node", None, PROBLEM, "drain")]
    assert "NVML sees 7 GPUs, 8 expected" in f[0].what
    assert judge(s0, s1, expect_gpus=7).findings == ()


def test_a_gpu_that_cannot_be_read_is_a_problem_not_healthy() -> None:
    s0, s1 = samples()
    lost = GpuHealth(index=3, error="GPU is lost", state="failing")
    s1 = replace(s1, gpus=(*s1.gpus[:3], lost, *s1.gpus[4:]))
    f = judge(s0, s1).findings
    assert [(x.gpu, x.severity, x.category) for x in f] == [(3, PROBLEM, "driver")]
    assert "GPU3 could not be read (failing: GPU is lost)" in f[0].what


# --- unknown ----------------------------------------------------------------------------------------------


def test_unknown_signals_are_not_checked_with_why_grouped_over_gpus() -> None:
    blank = {"remapped_rows_pending": None, "remapped_rows_failure": None, "remapped_rows_uncorrected": None}
    why = (Unknown("remapped rows", "Function Not Found"), Unknown("clocks event reasons", "Not Supported"))
    s0, s1 = samples(after={i: {**blank, "unknown": why} for i in (1, 2)})
    result = judge(s0, s1)
    assert result.findings == ()
    assert [(n.what, n.why) for n in result.not_checked] == [
        ("GPU1, GPU2: remapped rows", "Function Not Found"),
        ("GPU1, GPU2: clocks event reasons", "Not Supported"),
    ]


def test_one_sample_checks_states_and_lists_the_counters_as_not_checked() -> None:
    _, s1 = samples(after={0: {"remapped_rows_pending": True, "pcie_replays": 10_000}}, n=2)
    result = judge_one(s1)
    assert [(f.gpu, f.category) for f in result.findings] == [(0, "memory")]
    assert [(n.what, n.why) for n in result.not_checked] == [
        ("GPU0, GPU1: error counters' rise", "one sample only")
    ]


# --- thresholds -------------------------------------------------------------------------------------------


def test_every_rule_names_its_source_and_a_valid_severity_and_action() -> None:
    from gputopo.findings import ACTIONS, CATEGORIES

    for rule in RULES.values():
        assert rule.source and rule.meaning
        assert rule.severity in (PROBLEM, NOTE) and rule.action in ACTIONS and rule.category in CATEGORIES


def test_thresholds_file_in_toml_raises_the_crc_limit_and_silences_a_rule(tmp_path: Path) -> None:
    path = tmp_path / "thresholds.toml"
    path.write_text(
        "nvlink_crc_per_s = 1000\n[persistence_off]\nenabled = false\n"
        '[pcie_width_idle]\nseverity = "problem"\n'
    )
    t = load_thresholds(path)
    s0, s1 = samples(
        before={3: {"nvlinks": switch_links(crc_flit_errors=0)}},
        after={
            3: {"nvlinks": switch_links(crc_flit_errors=50)},  # 18 links x 50 in 2 s: 450/s
            0: {"persistence_mode": False},
            4: {"pcie_width_current": 8},
        },
    )
    assert {(f.gpu, f.severity) for f in judge(s0, s1).findings} == {(3, PROBLEM), (0, NOTE), (4, NOTE)}
    assert {(f.gpu, f.severity) for f in judge(s0, s1, thresholds=t).findings} == {(3, NOTE), (4, PROBLEM)}


def test_thresholds_file_in_json(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"remapped_rows_uncorrected": {"limit": 10, "action": "drain"}}))
    t = load_thresholds(path)
    f = found(after={0: {"remapped_rows_uncorrected": 10}}, thresholds=t)
    assert [(x.severity, x.action) for x in f] == [(NOTE, "drain")]
    assert DEFAULT_THRESHOLDS["remapped_rows_uncorrected"].limit == 512  # the defaults are untouched


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nvlink_crc_per_sec = 5\n", "unknown rule 'nvlink_crc_per_sec'"),
        ("nvlink_crc_per_s = \n", "not valid TOML"),
        ('{"nvlink_crc_per_s": }', "not valid JSON"),
        ('nvlink_crc_per_s = "lots"\n', "limit must be a number >= 0"),
        ("nvlink_crc_per_s = -1\n", "limit must be a number >= 0"),
        ("[nvlink_down]\nlimit = 3\n", "this rule has no limit"),
        ('[nvlink_down]\nseverity = "critical"\n', "severity must be problem or note"),
        ('[nvlink_down]\naction = "panic"\n', "action must be one of"),
        ("[nvlink_down]\nenabled = 1\n", "enabled must be true or false"),
        ("[nvlink_down]\nlevel = 1\n", "unknown key 'level'"),
        ("[1, 2]", "not valid TOML"),
    ],
)
def test_a_bad_thresholds_file_is_one_line_and_exit_2(text: str, message: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_thresholds(text, "t.toml")
    assert message in err.value.message and "\n" not in err.value.message
    assert err.value.exit_code == EXIT_USAGE


def test_thresholds_file_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read it"):
        load_thresholds(tmp_path / "missing.toml")
    binary = tmp_path / "t.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UsageError, match="not UTF-8"):
        load_thresholds(binary)


def test_finding_json_has_the_one_shape() -> None:
    f = found(after={1: {"ecc_volatile_uncorrected": 1}})[0]
    assert f.to_json() == {
        "where": "GPU1",
        "gpu": 1,
        "category": "memory",
        "what": f.what,
        "remedy": f.remedy,
        "severity": "problem",
        "action": "reset",
        "rule": "ecc_volatile_uncorrected",
    }


# --- The fabric of NVL racks (issue 34) -------------------------------------------------------------------

RACK = {
    "fabric_cluster_uuid": "00000001-0000-0000-0000-000000000001",
    "fabric_clique_id": 32766,
    "platform_chassis_serial": "1820000000001",
    "platform_tray_index": 15,
}


def rack(n: int = 4, **after: dict[str, object]) -> Judgement:
    s0, s1 = samples(
        {i: RACK for i in range(n)}, {i: {**RACK, **after.get(f"g{i}", {})} for i in range(n)}, n
    )
    return judge(s0, s1)


def test_healthy_masks_of_the_captures_are_no_fault() -> None:
    for mask in (0xAA, 0x1AA, 0x80):
        assert rack(g0={"fabric_health_mask": mask}).findings == ()
    # B200 and H100 boards: clique 0, zero UUID, no chassis serial; the H100's summary not available.
    board = {"fabric_cluster_uuid": "00000000-0000-0000-0000-000000000000", "fabric_clique_id": 0}
    assert found(after={i: board for i in range(8)}) == ()
    h100 = judge(
        *samples(None, {i: {**board, "fabric_health_mask": 0, "fabric_health_summary": 0} for i in range(8)})
    )
    assert h100.findings == ()
    assert [n.why for n in h100.not_checked] == ["the driver answers every fabric health field not supported"]


def test_each_fabric_fault_is_named_once_per_gpu() -> None:
    cases = {
        "registration stuck in progress": ({"fabric_state": 2}, "fabric_in_progress", NOTE),
        "status error with clique 0": (
            {"fabric_status": 999, "fabric_clique_id": 0},
            "fabric_not_ready",
            PROBLEM,
        ),
        "summary unhealthy, bandwidth full": (
            {"fabric_health_summary": 2},
            "fabric_summary_unhealthy",
            PROBLEM,
        ),
        "route unhealthy": (
            {"fabric_health_mask": 0x19A, "fabric_health_summary": 2},
            "fabric_unhealthy",
            PROBLEM,
        ),
        "insufficient nvlinks": ({"fabric_health_mask": 0x5AA}, "fabric_unhealthy", PROBLEM),
        "other cluster": (
            {"fabric_cluster_uuid": "00000002-0000-0000-0000-000000000002"},
            "fabric_domain_split",
            PROBLEM,
        ),
    }
    for name, (change, rule, severity) in cases.items():
        f = rack(g2=change).findings
        assert [(x.gpu, x.rule, x.severity) for x in f] == [(2, rule, severity)], (name, f)
    assert "route unhealthy" in rack(g2=cases["route unhealthy"][0]).findings[0].what
    assert "insufficient NVLinks" in rack(g2=cases["insufficient nvlinks"][0]).findings[0].what
    assert "bandwidth full" in rack(g2=cases["summary unhealthy, bandwidth full"][0]).findings[0].what


def test_limited_capacity_is_a_note_saying_what_bandwidth_is_left() -> None:
    f = rack(g1={"fabric_health_summary": 3, "fabric_health_mask": 0xA8}).findings
    assert [(x.gpu, x.rule, x.severity) for x in f] == [(1, "fabric_limited_capacity", NOTE)]
    assert "bandwidth not reported" in f[0].what
    # With the mask's bandwidth field TRUE (degraded), DCGM fails the GPU: one problem, the summary in it.
    f = rack(g1={"fabric_health_summary": 3, "fabric_health_mask": 0xA9}).findings
    assert [(x.gpu, x.rule, x.severity) for x in f] == [(1, "fabric_unhealthy", PROBLEM)]


def test_a_tray_in_a_rack_without_a_domain_is_a_problem_but_a_board_is_not() -> None:
    zero = {"fabric_cluster_uuid": "00000000-0000-0000-0000-000000000000"}
    f = rack(g3=zero).findings
    assert [(x.gpu, x.rule) for x in f] == [(3, "fabric_no_domain")] and "tray 15" in f[0].what
    whole = rack(**{f"g{i}": zero for i in range(4)}).findings
    assert [(x.where, x.rule) for x in whole] == [("node", "fabric_no_domain")]
    # A failed registration is judged alone, not also as a tray without a domain.
    failed = rack(g3={**zero, "fabric_status": 999}).findings
    assert [(x.gpu, x.rule) for x in failed] == [(3, "fabric_not_ready")]


# --- The fabric mask in every registration state (issue 42) -----------------------------------------------
# DCGM 4.6 MonitorFabricFields (NVIDIA/DCGM modules/health/DcgmHealthWatch.cpp at 72fa3fe, lines 3599-3729)
# reads DCGM_FI_DEV_FABRIC_HEALTH_MASK first and fails a TRUE field or an incorrect configuration whatever
# the registration's state; then it judges the state (in progress: warn; not started, failed: fail).


def test_a_mask_fault_during_registration_in_progress_is_a_problem_naming_the_field() -> None:
    # 0x4aa: every 2-bit field FALSE, INCORRECT_CONFIGURATION = 4 (NO_PARTITION); summary UNHEALTHY.
    stuck = {"fabric_state": 2, "fabric_health_mask": 0x4AA, "fabric_health_summary": 2}
    f = rack(g2=stuck).findings
    assert [(x.gpu, x.rule, x.severity) for x in f] == [(2, "fabric_unhealthy", PROBLEM)]  # one, not two
    assert "no partition" in f[0].what and "registration in progress" in f[0].what
    # On every GPU (DCGM fails all four): one node finding that names all of them, a problem.
    (node,) = rack(**{f"g{i}": stuck for i in range(4)}).findings
    assert (node.where, node.severity, node.rule) == ("node", PROBLEM, "fabric_unhealthy")
    assert "all 4 GPUs" in node.what and "no partition" in node.what
    # Not started with a TRUE field: one problem, the mask's, naming the state.
    f = rack(g1={"fabric_state": 1, "fabric_health_mask": 0x1A9}).findings
    assert [(x.gpu, x.rule) for x in f] == [(1, "fabric_unhealthy")]
    assert "bandwidth degraded" in f[0].what and "registration not started" in f[0].what


def test_partition_assigned_is_read_with_its_own_polarity() -> None:
    # PARTITION_ASSIGNED (bits 12-13): 1 (TRUE) is the good value, 2 (FALSE) no partition.
    f = rack(g0={"fabric_health_mask": 0x21AA}).findings
    assert [(x.gpu, x.rule, x.severity) for x in f] == [(0, "fabric_unhealthy", PROBLEM)]
    assert "partition not assigned (PARTITION_ASSIGNED FALSE)" in f[0].what
    for mask in (0x11AA, 0x01AA, 0xAA, 0x80):
        assert rack(g0={"fabric_health_mask": mask}).findings == (), hex(mask)


def test_a_registration_that_completed_with_an_error_names_the_nvml_error() -> None:
    (f,) = rack(g3={"fabric_status": 23}).findings
    assert f.rule == "fabric_not_ready" and "NVML_ERROR_INSUFFICIENT_RESOURCES (23)" in f.what


# --- NVLink5 as DCGM judges it: the ECC data total, effective and symbol BER (issue 42) ---------------------
# DCGM 4.6 MonitorNVLink5Fields (NVIDIA/DCGM modules/health/DcgmHealthWatch.cpp lines 2807-2947 at
# 72fa3fe) fails a rise of DCGM_FI_DEV_NVLINK_ECC_ERROR_TOTAL (NVML field 160) and an effective or symbol
# BER over its threshold (levels). NVML encodes a BER as mantissa (bits 8-11) * 10^-exponent (bits 0-7).


def _ber(mantissa: int, exponent: int) -> int:
    return mantissa << 8 | exponent


def test_the_nvlink_ecc_data_total_rising_is_a_problem() -> None:
    f = found(before={2: {"nvlink_ecc_data_errors": 40}}, after={2: {"nvlink_ecc_data_errors": 41}})
    assert [(x.gpu, x.rule, x.severity, x.action) for x in f] == [
        (2, "nvlink_ecc_data_rise", PROBLEM, "reset")
    ]
    assert "rose by 1" in f[0].what and "field 160" in f[0].what
    assert found(before={2: {"nvlink_ecc_data_errors": 40}}, after={2: {"nvlink_ecc_data_errors": 40}}) == ()


def test_an_effective_ber_worse_than_1e_12_is_a_problem_with_no_counter_moving() -> None:
    # The same level in both samples: nothing rises, DCGM still fails it, so does gputopo.
    bad = {"nvlink_effective_ber_raw": _ber(5, 11)}
    f = found(before={1: bad}, after={1: bad})
    assert [(x.gpu, x.rule, x.severity) for x in f] == [(1, "nvlink_effective_ber", PROBLEM)]
    assert "5e-11 is worse than 1e-12" in f[0].what
    # DCGM's boundaries (IsEffectiveBerThresholdExceeded): 1e-12 and 10e-13 pass, 2e-12 and 11e-13 fail,
    # 15e-255 is a zero BER.
    for (m, e), bad_ in {(1, 12): False, (2, 12): True, (10, 13): False, (11, 13): True, (9, 14): False,
                         (15, 255): False, (1, 3): True}.items():  # fmt: skip
        got = found(after={1: {"nvlink_effective_ber_raw": _ber(m, e)}})
        assert bool(got) is bad_, (m, e, got)


def test_a_symbol_ber_above_its_floor_is_a_problem() -> None:
    # DCGM_SYMBOL_BER_FLOOR_EXP_AGGREGATED = 238 with a floor mantissa of 15; a zero mantissa is healthy.
    f = found(after={5: {"nvlink_symbol_ber_raw": _ber(3, 9)}})
    assert [(x.gpu, x.rule) for x in f] == [(5, "nvlink_symbol_ber")] and "3e-9" in f[0].what
    for (m, e), bad in {(0, 9): False, (15, 238): False, (1, 239): False, (2, 237): True}.items():
        assert bool(found(after={5: {"nvlink_symbol_ber_raw": _ber(m, e)}})) is bad, (m, e)
