"""What ``check --drain/--resume-if-healthy`` may do (pure: health.node_action), how scontrol's output is
read, the reason Slurm shows, --max-drained, and the options object built once."""

from __future__ import annotations

import dataclasses

import pytest

from gputopo.errors import UsageError
from gputopo.findings import NOTE, PROBLEM, Finding
from gputopo.health import node_action as na
from gputopo.system.slurm_node import SlurmAction
from gputopo.ui.check_view import fit_bytes, slurm_lines

SHOW = """NodeName=node1 Arch=x86_64 CoresPerSocket=1
   CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.10
   State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Reason=maint: PSU swap (ticket 4711) [root@2026-11-28T03:00:00]

NodeName=node2 Arch=x86_64 CoresPerSocket=1
   State=IDLE ThreadsPerCore=1

NodeName=node3 Arch=x86_64 CoresPerSocket=1
   State=DOWN+DRAIN ThreadsPerCore=1
   Reason=gputopo: Xid 79 on GPU2 [root@2026-11-28T03:01:00]
"""


def test_scontrol_show_node_is_read_as_state_and_reason_without_slurms_stamp() -> None:
    nodes = {n.name: n for n in na.parse_show_node(SHOW)}
    assert nodes["node1"] == na.NodeInfo("node1", "IDLE+DRAIN", "maint: PSU swap (ticket 4711)")
    assert nodes["node1"].out_of_service and not nodes["node1"].ours
    assert nodes["node2"] == na.NodeInfo("node2", "IDLE", None) and not nodes["node2"].out_of_service
    assert nodes["node3"].drained_by_gputopo
    one_line = "NodeName=node4 Arch=x86_64 State=MIXED+DRAIN Reason=gputopo: fabric [slurm@2026-11-28]"
    assert na.parse_show_node(one_line) == [na.NodeInfo("node4", "MIXED+DRAIN", "gputopo: fabric")]


def problem(what: str, action: str = "reset") -> Finding:
    return Finding("GPU0", what, "fix it", PROBLEM, gpu=0, category="memory", action=action)


IDLE = na.NodeInfo("gpu07", "IDLE", None)
THEIRS = na.NodeInfo("gpu07", "IDLE+DRAIN", "maint: PSU swap")
OURS = na.NodeInfo("gpu07", "IDLE+DRAIN", "gputopo: old")


def decide(verdict: str, findings: list[Finding], node: na.NodeInfo | None, **kw: object) -> na.Decision:
    opts = {"drain": True, "resume": True, **kw}
    return na.decide(verdict, findings, node, **opts)  # type: ignore[arg-type]


def test_never_overrule_a_person() -> None:
    sick = [problem("Xid 79 on GPU0")]
    assert decide("problems", sick, IDLE).action == "drain"
    kept = decide("problems", sick, THEIRS)
    assert kept.action == "none" and "by someone else (Reason=maint: PSU swap)" in (kept.held_back or "")
    assert decide("healthy", [], THEIRS).action == "none"
    assert "not resumed" in (decide("healthy", [], THEIRS).held_back or "")
    assert decide("healthy", [], OURS).action == "resume"
    assert decide("healthy", [], IDLE) == na.Decision("none")
    down = na.NodeInfo("gpu07", "DOWN*", "Not responding")
    assert decide("problems", sick, down).action == "none" and decide("healthy", [], down).action == "none"
    assert decide("problems", sick, None).held_back == "not drained: the node's state could not be read"
    assert decide("unknown", [], OURS).action == "none"  # a check that could not run proves nothing


def test_only_reset_drain_replace_and_reboot_drain() -> None:
    for action in ("reset", "drain", "replace", "reboot"):
        assert decide("problems", [problem("x", action)], IDLE).action == "drain", action
    for action in ("monitor", "config", "none"):
        d = decide("problems", [problem("x", action)], IDLE)
        assert d.action == "none" and f"their action: {action}" in (d.held_back or "")
    note = Finding("GPU0", "x", "y", NOTE, gpu=0, action="reset")
    assert decide("problems", [note, problem("x", "monitor")], IDLE).action == "none"


def test_gputopos_own_reason_is_brought_up_to_date_never_a_persons() -> None:
    sick = [problem("Xid 79 on GPU0")]
    assert decide("problems", sick, OURS) == na.Decision("drain", "gputopo: Xid 79 on GPU0")
    same = na.NodeInfo("gpu07", "IDLE+DRAIN", "gputopo: Xid 79 on GPU0")
    assert decide("problems", sick, same).action == "none"


def test_max_drained() -> None:
    sick = [problem("Xid 79 on GPU0")]
    held = decide("problems", sick, IDLE, drained_elsewhere=2, max_drained=2)
    assert held.action == "none" and "2 nodes already carry a gputopo drain (--max-drained 2)" in (
        held.held_back or ""
    )
    assert decide("problems", sick, IDLE, drained_elsewhere=1, max_drained=2).action == "drain"
    assert na.parse_max_drained("10%") == (None, 0.1) and na.parse_max_drained("3") == (3, None)
    assert na.max_drained_nodes(None, 0.1, 3) == 1  # at least one node may always be drained
    assert na.max_drained_nodes(None, 0.1, 200) == 20 and na.max_drained_nodes(5, None, 3) == 5
    for bad in ("", "x", "-1", "0%", "150%", "2.5"):
        with pytest.raises(UsageError):
            na.parse_max_drained(bad)


def test_the_slurm_reason_fits_and_keeps_the_count_of_further_problems() -> None:
    many = [problem("NVLink fabric registration not started on GPU0 " + "x" * 300)] + [problem("y")] * 7
    reason = na.slurm_reason(many)
    assert len(reason) <= na.REASON_CHARS and reason.startswith("gputopo: NVLink fabric")
    assert reason.endswith("... (+7 more)")
    assert na.slurm_reason([problem('a "quoted" `one`')]) == "gputopo: a quoted one"


def test_slurm_lines_say_what_was_held_back_and_never_could_not_none() -> None:
    held = SlurmAction("none", None, False, None, "not drained: 2 nodes already carry a gputopo drain")
    assert slurm_lines(held) == ["slurm: not drained: 2 nodes already carry a gputopo drain"]
    failed = SlurmAction("none", None, False, "scontrol did not answer within 2.5 s")
    assert slurm_lines(failed) == ["slurm: could not act on this node: scontrol did not answer within 2.5 s"]
    assert slurm_lines(SlurmAction("drain", "scontrol update ...", False, "Invalid user")) == [
        "slurm: could not drain this node: Invalid user"
    ]


def test_npd_line_is_cut_in_bytes_not_characters() -> None:
    assert fit_bytes("problems: GPU0 – über", 14) == "problems: G..."
    assert fit_bytes("ab–c", 5) == "ab..."  # the dash is 3 bytes: never half a character
    assert len(fit_bytes("é" * 100, 80).encode()) <= 80
    assert fit_bytes("a\nb  c", 80) == "a b c"


def test_check_options_are_keyword_only_and_validated_once() -> None:
    from gputopo.services.check import CheckOptions

    with pytest.raises(TypeError):
        CheckOptions(2.0, 20.0)  # type: ignore[misc]
    o = CheckOptions()
    assert (o.sample_s, o.budget_s, o.nvml_timeout_s) == (2.0, 20.0, 5.0)
    for kw, words in (
        ({"sample_s": 30.0}, "--sample-s 30: must be at least 0 and less than --budget"),
        ({"sample_s": float("nan")}, "--sample-s nan"),
        ({"budget_s": 0.0}, "--budget 0"),
        ({"nvml_timeout_s": -1.0}, "--nvml-timeout -1"),
        ({"expect_gpus": -1}, "--expect-gpus -1"),
    ):
        with pytest.raises(UsageError) as err:
            CheckOptions(**kw)  # type: ignore[arg-type]
        assert err.value.message.startswith(words)
    with pytest.raises(UsageError):
        dataclasses.replace(o, sample_s=-1.0)


def test_the_hint_names_the_flag_that_would_admit_a_gpu_never_one_given() -> None:
    from gputopo.recommend.constraints import Exclusion
    from gputopo.recommend.reasons import fewer_hint

    # A health finding that says "while busy" is a health reason: --allow-unhealthy admits it.
    sick = Exclusion(2, "health: GPU2: PCIe link trained at x8 of x16 while busy, and its replays rose by 3")
    assert (
        fewer_hint((sick,))
        == "ask for fewer GPUs, or count GPUs with a health problem in with --allow-unhealthy"
    )
    busy = Exclusion(1, "busy: 2 compute processes (pid 10, 11)")
    assert fewer_hint((busy,)) == "ask for fewer GPUs, or count busy GPUs in with --allow-busy"
    both = fewer_hint((busy, sick))
    assert "--allow-busy" in both and "--allow-unhealthy" in both
    assert fewer_hint((Exclusion(0, "excluded by --exclude"),)) == "ask for fewer GPUs"
