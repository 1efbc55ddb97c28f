"""The admin's Xid policy (issue 42): ``check --xid-policy FILE`` (or ``[xid_policy]`` in the thresholds
file) says which codes are the application's (a note, never a drain) and which the node's (a problem), as
operators ask of every Xid tool (NVIDIA/k8s-device-plugin #234 and #268, gpu-operator #1065; the device
plugin's and DRA driver's default non-fatal list is 13, 31, 43, 45, 68, 109, api/config/v1
GetIgnoredXIDs). A code DCGM fails (48, 74, 79, 95, 119, 120, 140: BuildXidMappings' m_devastatingXids) is
the application's only with ``allow_fatal = true``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

import fake_driver
from gputopo.errors import UsageError
from gputopo.findings import NOTE, PROBLEM
from gputopo.health import xid
from gputopo.health.rules import (
    DEFAULT_THRESHOLDS,
    DEVICE_PLUGIN_APPLICATION_XIDS,
    load_xid_policy,
    parse_thresholds,
    parse_xid_policy,
)
from test_check_cli import machine
from test_health_reads import healthy

NOW = datetime(2026, 11, 25, 12, 0, 0, tzinfo=timezone.utc)
GPUS = [(0, "00000000:18:00.0")]
POLICY = "application = [13, 31]\nnode = [94]\n"
LOG = (
    "[ 10000.0] NVRM: Xid (PCI:0000:18:00): 13, pid=1, Graphics SM Warp Exception on (GPC 0, TPC 0)\n"
    "[ 10001.0] NVRM: Xid (PCI:0000:18:00): 31, pid=1, MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted\n"
    "[ 10002.0] NVRM: Xid (PCI:0000:18:00): 94, pid=1, Contained: SM (0x1). RST: No, D-RST: No\n"
    "[ 10003.0] NVRM: Xid (PCI:0000:18:00): 109, pid=1, CTX SWITCH TIMEOUT\n"
)


def verdicts(policy: str | None) -> dict[int, tuple[str, str, bool]]:
    t = DEFAULT_THRESHOLDS
    if policy is not None:
        from dataclasses import replace

        t = replace(t, xid_policy=parse_xid_policy(_toml(policy), "--xid-policy p.toml", "p.toml"))
    out = xid.xid_findings(xid.scan(LOG, None, uptime_s=10_800.0, now=NOW), GPUS, t)
    return {int(f.what.split()[1]): (f.severity, f.action, "Xid policy" in f.what) for f in out}


def _toml(text: str) -> dict:  # type: ignore[type-arg]
    from gputopo.health.rules import _toml_loads

    return _toml_loads(text)


def test_the_verdicts_follow_the_policy_and_say_so() -> None:
    assert verdicts(None) == {
        13: (NOTE, "none", False),
        31: (NOTE, "none", False),
        94: (NOTE, "reset", False),
        109: (PROBLEM, "reset", False),
    }
    # 13 and 31 were notes already: the policy changes nothing there and says nothing. 94 becomes a problem.
    assert verdicts(POLICY) == {
        13: (NOTE, "none", False),
        31: (NOTE, "none", False),
        94: (PROBLEM, "reset", True),
        109: (PROBLEM, "reset", False),
    }
    # 109 (the device plugin's list calls it the application's): demoted, and it says so.
    got = verdicts("application = [109]\n")
    assert got[109] == (NOTE, "none", True)


def test_a_code_dcgm_fails_is_demoted_only_with_allow_fatal() -> None:
    with pytest.raises(UsageError) as e:
        parse_xid_policy({"application": [13, 79]}, "--xid-policy p.toml", "p.toml")
    assert "Xid 79 is one DCGM fails" in e.value.message and "allow_fatal" in e.value.message
    p = parse_xid_policy({"application": [79], "allow_fatal": True}, "--xid-policy p.toml", "p.toml")
    assert p.says(79) == "application"
    for bad in (
        {"application": [13], "node": [13]},
        {"application": ["13"]},
        {"application": [True]},
        {"nodes": [94]},
        {"allow_fatal": "yes"},
        [13],
    ):
        with pytest.raises(UsageError):
            parse_xid_policy(bad, "--xid-policy p.toml", "p.toml")


def test_the_device_plugins_list_is_a_valid_policy_and_in_the_thresholds_file() -> None:
    codes = list(DEVICE_PLUGIN_APPLICATION_XIDS)
    assert codes == [13, 31, 43, 45, 68, 109]
    t = parse_thresholds(f"[xid_policy]\napplication = {codes}\n", "t.toml")
    assert t.xid_policy is not None and t.xid_policy.says(109) == "application"
    assert t.xid_policy.source == "t.toml"
    t = parse_thresholds(json.dumps({"xid_policy": {"node": [94]}}), "t.json", "json")
    assert t.xid_policy is not None and t.xid_policy.says(94) == "node"


def test_load_reads_toml_and_json(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text(POLICY)
    (tmp_path / "p.json").write_text(json.dumps({"application": [13, 31], "node": [94]}))
    for name in ("p.toml", "p.json"):
        p = load_xid_policy(tmp_path / name)
        assert (sorted(p.application), sorted(p.node)) == ([13, 31], [94])
    (tmp_path / "bad.toml").write_text("application = [13")
    with pytest.raises(UsageError):
        load_xid_policy(tmp_path / "bad.toml")


def _gputopo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(fake_driver.SRC)}
    return subprocess.run(
        [sys.executable, "-m", "gputopo", "check", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_list_rules_shows_the_policy_in_force_and_its_file(tmp_path: Path) -> None:
    policy = tmp_path / "xid-policy.toml"
    policy.write_text(POLICY)
    done = _gputopo("--list-rules", "--xid-policy", str(policy))
    assert done.returncode == 0, done.stderr
    assert f"Xid policy in force ({policy}): application (a note) 13, 31; node (a problem) 94" in done.stdout
    assert "Xid  94 ROBUST_CHANNEL_CONTAINED_ERROR" in done.stdout
    line94 = next(ln for ln in done.stdout.splitlines() if ln.startswith("  Xid  94 "))
    assert line94.endswith("problem/reset (Xid policy: node)")
    doc = json.loads(_gputopo("--list-rules", "--json", "--xid-policy", str(policy)).stdout)
    assert doc["xid_policy"] == {
        "application": [13, 31],
        "node": [94],
        "allow_fatal": False,
        "source": str(policy),
    }
    rows = {r["xid"]: r for r in doc["xids"]}
    assert (rows[94]["severity"], rows[94]["policy"]) == (PROBLEM, "node")
    assert json.loads(_gputopo("--list-rules", "--json").stdout)["xid_policy"] is None


def test_a_fatal_code_without_allow_fatal_is_exit_2_in_one_line(tmp_path: Path) -> None:
    policy = tmp_path / "p.toml"
    policy.write_text("application = [79]\n")
    done = _gputopo("--list-rules", "--xid-policy", str(policy))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "Xid 79 is one DCGM fails" in done.stderr and done.stdout == ""


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if fake_driver.compiler() is None:
        pytest.skip("no C compiler to build the fake driver")
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def test_check_follows_the_policy_on_the_fake_driver(driver: Path, tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("NVRM: Xid (PCI:0000:18:00): 94, pid=1, Contained: SM (0x1). RST: No, D-RST: No\n")
    node = machine(tmp_path, [*healthy(0), *healthy(1)])
    args = ("check", "--json", "--sample-s", "0.2", "--kernel-log", str(log))
    plain = fake_driver.run(driver, node, *args, timeout=60)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    policy = tmp_path / "p.toml"
    policy.write_text(POLICY)
    done = fake_driver.run(driver, node, *args, "--xid-policy", str(policy), timeout=60)
    (f,) = [f for f in json.loads(done.stdout)["findings"] if f["rule"].startswith("xid")]
    assert done.returncode == 1 and f["severity"] == PROBLEM and "Xid policy" in f["what"]
