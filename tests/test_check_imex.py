"""``gputopo check`` and IMEX: judged only where a daemon is expected, against a fake ``nvidia-imex-ctl`` on
PATH (a real child process, as the Slurm tests run a fake ``scontrol``) that answers every daemon state
DCGM's DcgmImexManager knows, the domain and member states, the "not configured" message, and one that
hangs. The JSON shapes are those health/imex.py cites (DCGM's test sample, NVIDIA's ISV suite)."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import fake_driver
from gputopo.health.imex import (
    DAEMON_STATES,
    NOT_CONFIGURED_TEXT,
    CtlAnswer,
    ImexReading,
    judge_imex,
    parse_domain,
)
from gputopo.health.rules import RULES, parse_thresholds
from gputopo.system import imex as system_imex
from gputopo.system.sysfs import FsView, view
from test_check_cli import FAST, machine
from test_health_reads import healthy

FAKE_CTL = """#!{python}
# A stand-in for nvidia-imex-ctl: answers from answers.json ("q" for -q, "N" for -N -j: out, err, rc, and
# sleep seconds before answering); every call is logged.
import json, os, sys, time
here = {here!r}
with open(os.path.join(here, "ctl.log"), "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
answers = json.load(open(os.path.join(here, "answers.json")))
a = answers.get("N" if "-N" in sys.argv else "q", {{}})
time.sleep(a.get("sleep", 0))
sys.stdout.write(a.get("out", ""))
sys.stderr.write(a.get("err", ""))
sys.exit(a.get("rc", 0))
"""

HOSTS = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]


def domain_json(
    status: str = "UP", members: dict[str, str] | None = None, links: dict[tuple[str, str], str] | None = None
) -> str:
    """``nvidia-imex-ctl -N -j`` as DCGM's sample and NVIDIA's ISV suite show it: every member with its
    status, host, an empty hostName (no -H), and its connections to every member (itself included)."""
    members = members or {}
    links = links or {}
    nodes: dict[str, Any] = {}
    for i, host in enumerate(HOSTS):
        status_i = members.get(host, "READY")
        conns = {
            str(j): {
                "host": peer,
                "status": "INVALID" if status_i != "READY" else links.get((host, peer), "CONNECTED"),
                "changed": True,
            }
            for j, peer in enumerate(HOSTS)
        }
        nodes[str(i)] = {
            "status": status_i,
            "host": host,
            "connections": conns,
            "changed": True,
            "version": "580.95.05",
            "hostName": "",
        }
    return json.dumps({"nodes": nodes, "timestamp": "11/28/2026 22:00:00.000", "status": status})


def fake_ctl(tmp_path: Path, q: dict[str, Any], n: dict[str, Any] | None = None) -> Path:
    """A bin folder holding the fake ``nvidia-imex-ctl`` with these answers."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "answers.json").write_text(json.dumps({"q": q, "N": n or {"out": domain_json()}}))
    script = bin_dir / "nvidia-imex-ctl"
    script.write_text(FAKE_CTL.format(python=sys.executable, here=str(tmp_path)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "ctl.log"
    return log.read_text().splitlines() if log.exists() else []


def etc_tree(tmp_path: Path, nodes: str | None = "\n".join(HOSTS) + "\n", config: str | None = None) -> Path:
    """An /etc with IMEX's files: ``nodes`` the node configuration (``None``: none), ``config`` config.cfg."""
    etc = tmp_path / "etc"
    (etc / "nvidia-imex").mkdir(parents=True, exist_ok=True)
    if nodes is not None:
        (etc / "nvidia-imex" / "nodes_config.cfg").write_text(nodes)
    if config is not None:
        (etc / "nvidia-imex" / "config.cfg").write_text(config)
    return etc


def ready(q: str = "READY\n") -> dict[str, Any]:
    return {"out": q}


# --- pure: what each answer means (health/imex.py) ----------------------------------------------------------


def reading(q: str | None, n: str | None = None, configured: bool = True, **kw: Any) -> ImexReading:
    daemon = CtlAnswer("nvidia-imex-ctl -q", q, **kw) if q is not None else None
    domain = CtlAnswer("nvidia-imex-ctl -N -j", n, exit_code=0) if n is not None else None
    return ImexReading(
        "/etc/nvidia-imex/nodes_config.cfg", configured, None if configured else "no file", daemon, domain
    )


def read_through_fake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, q: dict[str, Any], n: dict[str, Any] | None = None
) -> tuple[list[Any], list[Any]]:
    """Judge this node as check does: the configuration in an /etc tree, the fake nvidia-imex-ctl on PATH."""
    bin_dir = fake_ctl(tmp_path, q, n)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    got = system_imex.read_imex(False, time.monotonic() + 30, FsView(etc=etc_tree(tmp_path)))
    return judge_imex(got, expect=False)


@pytest.mark.parametrize("state", sorted(DAEMON_STATES))
def test_every_daemon_state_dcgm_knows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: str) -> None:
    found, skipped = read_through_fake(tmp_path, monkeypatch, ready(f"{state}\n"))
    assert calls(tmp_path) == ["-q", "-N -j"]  # the domain is read whatever the daemon's state
    if state == "READY":
        assert found == [] and skipped == []
    else:
        assert [f.rule for f in found] == ["imex_daemon_not_ready"]
        assert f"the IMEX daemon is {state}, not READY" in found[0].what
        assert found[0].action == "drain" and found[0].severity == "problem"


@pytest.mark.parametrize(
    ("domain", "member", "rules"),
    [
        ("UP", "READY", []),
        ("DOWN", "READY", ["imex_domain_unhealthy"]),
        ("DEGRADED", "READY", ["imex_domain_unhealthy"]),
        *(("DEGRADED", s, ["imex_member_down"]) for s in sorted(DAEMON_STATES) if s != "READY"),
        ("UP", "UNAVAILABLE", ["imex_member_down"]),  # NVIDIA's ISV suite saw UP with a member down
    ],
)
def test_every_domain_and_member_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, domain: str, member: str, rules: list[str]
) -> None:
    n = {"out": domain_json(domain, {"10.0.0.3": member})}
    found, skipped = read_through_fake(tmp_path, monkeypatch, ready(), n)
    assert [f.rule for f in found] == rules and skipped == []
    assert all(f.action == "monitor" for f in found)  # the domain and other members never drain this node
    if member != "READY":
        assert found[0].where == "IMEX member 10.0.0.3" and f"is {member}, not READY" in found[0].what


def test_the_daemon_answer_is_read_as_dcgm_does_trimmed_and_in_any_case() -> None:
    found, _ = judge_imex(reading("  waiting_for_peers \n", domain_json(), exit_code=0), expect=False)
    assert "WAITING_FOR_PEERS" in found[0].what


def test_dcgms_own_sample_is_read_whole() -> None:
    # DcgmImexManagerTests.cpp, "Handles actual sample JSON from specification" (its whitespace kept).
    sample = (
        '{"nodes":{\n\t"3": {"status":"READY","host":"10.76.186.255",\n\t\t"connections":{"1":{"host":'
        '"10.76.183.30","status":"CONNECTED","changed":true},\n\t\t\t"6":{"host":"10.76.190.23","status":'
        '"CONNECTED","changed":true}\n\t\t},\n\t\t"changed":true,\n\t\t"version":"580.30",\n\t\t"hostName":""},'
        '\n\t"1":{"status":"READY","host":"10.76.183.30",\n\t\t"connections":{"0":{"host":"10.76.179.115",'
        '"status":"CONNECTED","changed":true},\n\t\t"1":{"host":"10.76.183.30","status":"CONNECTED","changed":'
        'true}},\n\t\t"changed":true,"version":"580.30","hostName":""}},\n\t"timestamp":'
        '"5/22/2025 19:46:40.891",\n\t"status":"DEGRADED"}'
    )
    domain = parse_domain(sample)
    assert domain is not None and domain.status == "DEGRADED"
    assert [(m.index, m.host, m.status) for m in domain.members] == [
        ("1", "10.76.183.30", "READY"),
        ("3", "10.76.186.255", "READY"),
    ]
    # Every member READY and connected, yet DEGRADED: the domain's own finding, which does not drain.
    found, _ = judge_imex(reading("READY", sample, exit_code=0), expect=False)
    assert [(f.rule, f.action) for f in found] == [("imex_domain_unhealthy", "monitor")]
    assert "DEGRADED" in found[0].what


def test_one_member_down_is_one_finding_named_by_host() -> None:
    text = domain_json("DEGRADED", {"10.0.0.2": "UNAVAILABLE"})
    found, _ = judge_imex(reading("READY", text, exit_code=0), expect=False)
    # Its INVALID links and the domain's DEGRADED are not named again: one fault, one finding.
    assert [(f.where, f.rule) for f in found] == [("IMEX member 10.0.0.2", "imex_member_down")]
    assert found[0].what == (
        "IMEX member 10.0.0.2 is UNAVAILABLE, not READY (1 of 3 members not ready; "
        "the IMEX domain is DEGRADED)"
    )
    assert found[0].action == "monitor"  # another tray's fault never drains this one


def test_a_link_down_between_ready_members_is_one_finding_per_pair() -> None:
    links = {("10.0.0.1", "10.0.0.3"): "INVALID", ("10.0.0.3", "10.0.0.1"): "INVALID"}
    found, _ = judge_imex(reading("READY", domain_json("DEGRADED", links=links), exit_code=0), expect=False)
    assert [f.where for f in found] == ["IMEX link 10.0.0.1 - 10.0.0.3"]
    assert "10.0.0.1 sees 10.0.0.3 INVALID; 10.0.0.3 sees 10.0.0.1 INVALID" in found[0].what


def test_host_names_are_shown_when_ctl_gives_them() -> None:
    doc = json.loads(domain_json("DOWN", {"10.0.0.3": "UNAVAILABLE"}))
    doc["nodes"]["2"]["hostName"] = "gb200-tray-03"
    found, _ = judge_imex(reading("READY", json.dumps(doc), exit_code=0), expect=False)
    assert found[0].where == "IMEX member 10.0.0.3 (gb200-tray-03)"


def test_no_daemon_expected_is_not_checked_never_a_problem() -> None:
    # An idle node under NVIDIA's DRA driver, or an HGX B200 board: no configuration, no --expect-imex.
    found, skipped = judge_imex(reading(None, configured=False), expect=False)
    assert found == []
    assert [(s.what, s.why) for s in skipped] == [
        ("IMEX", "no IMEX daemon expected here: no file, no --expect-imex")
    ]


def test_not_configured_is_a_problem_only_where_a_daemon_is_expected() -> None:
    said = reading(f"{NOT_CONFIGURED_TEXT}\n", configured=False, exit_code=255)
    found, _ = judge_imex(said, expect=True)
    assert [(f.rule, f.category, f.action) for f in found] == [("imex_not_configured", "config", "config")]
    assert NOT_CONFIGURED_TEXT in found[0].what
    # No nvidia-imex-ctl to ask, but --expect-imex and no configuration: the same problem, from the file.
    missing = ImexReading(
        "/etc/nvidia-imex/nodes_config.cfg",
        False,
        "no /etc/nvidia-imex/nodes_config.cfg",
        CtlAnswer("nvidia-imex-ctl -q", error="nvidia-imex-ctl not found"),
    )
    found, _ = judge_imex(missing, expect=True)
    assert [f.rule for f in found] == ["imex_not_configured"]


def test_a_daemon_that_does_not_answer_is_a_problem_a_missing_tool_is_not_checked() -> None:
    down = reading("", exit_code=1, stderr="Query Status returned error code: 14\n")
    found, _ = judge_imex(down, expect=False)
    assert [f.rule for f in found] == ["imex_daemon_not_ready"]
    assert "did not answer" in found[0].what and "error code: 14" in found[0].what
    gone = ImexReading(
        "/etc/nvidia-imex/nodes_config.cfg",
        True,
        None,
        CtlAnswer("nvidia-imex-ctl -q", error="nvidia-imex-ctl not found (PATH)"),
    )
    found, skipped = judge_imex(gone, expect=False)
    assert found == [] and [s.why for s in skipped] == ["nvidia-imex-ctl not found (PATH)"]


def test_the_rules_can_be_turned_off_and_are_in_the_table() -> None:
    assert {
        "imex_not_configured",
        "imex_daemon_not_ready",
        "imex_domain_unhealthy",
        "imex_member_down",
    } <= set(RULES)
    sick = reading("READY", domain_json("DEGRADED", {"10.0.0.2": "UNAVAILABLE"}), exit_code=0)
    # With the member rule off, the domain's own finding still names the member it was told of.
    off = parse_thresholds("[imex_member_down]\nenabled = false\n", "t.toml")
    found, _ = judge_imex(sick, expect=False, thresholds=off)
    assert [(f.rule, f.what) for f in found] == [
        (
            "imex_domain_unhealthy",
            "the IMEX domain is DEGRADED (`nvidia-imex-ctl -N -j`): IMEX member 10.0.0.2",
        )
    ]
    both = "[imex_member_down]\nenabled = false\n[imex_domain_unhealthy]\nenabled = false\n"
    assert judge_imex(sick, expect=False, thresholds=parse_thresholds(both, "t.toml"))[0] == []


def test_the_imex_rules_are_listed_with_their_source() -> None:
    from test_check_rules import list_rules

    rows = {r["name"]: r for r in json.loads(list_rules("--json").stdout)["rules"]}
    assert rows["imex_daemon_not_ready"]["drains"] is True and rows["imex_daemon_not_ready"]["dcgm"] == "fail"
    assert "DcgmImexManager" in rows["imex_daemon_not_ready"]["source"]
    assert [
        rows[n]["drains"] for n in ("imex_not_configured", "imex_domain_unhealthy", "imex_member_down")
    ] == [
        False,
        False,
        False,
    ]
    text = list_rules().stdout
    assert "imex_member_down  [nvlink] problem/monitor, does not drain" in text


# --- system: the configuration and the runs (system/imex.py) ---------------------------------------------


def test_the_node_configuration_is_found_where_config_cfg_names_it(tmp_path: Path) -> None:
    etc = etc_tree(
        tmp_path, nodes=None, config="# IMEX\nIMEX_NODE_CONFIG_FILE=/etc/nvidia-imex/rack7.cfg  # ours\n"
    )
    fs = FsView(etc=etc)
    assert system_imex.read_config(fs) == (
        "/etc/nvidia-imex/rack7.cfg",
        False,
        "no /etc/nvidia-imex/rack7.cfg",
    )
    (etc / "nvidia-imex" / "rack7.cfg").write_text("# emptied by the Slurm prolog between jobs\n\n")
    assert system_imex.read_config(fs)[1:] == (False, "/etc/nvidia-imex/rack7.cfg lists no node")
    (etc / "nvidia-imex" / "rack7.cfg").write_text("10.0.0.1\n10.0.0.2\n")
    assert system_imex.read_config(fs) == ("/etc/nvidia-imex/rack7.cfg", True, None)
    assert view({"GPUTOPO_ETC_ROOT": str(etc)}).etc == etc and view({}).etc == Path("/etc")


def test_nothing_is_run_where_no_daemon_is_expected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = fake_ctl(tmp_path, ready())
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    got = system_imex.read_imex(False, time.monotonic() + 30, FsView(etc=etc_tree(tmp_path, nodes=None)))
    assert got.daemon is None and calls(tmp_path) == []
    got = system_imex.read_imex(False, time.monotonic() + 30, FsView(etc=etc_tree(tmp_path)))
    assert got.configured and calls(tmp_path) == ["-q", "-N -j"]
    assert got.daemon is not None and got.daemon.stdout == "READY\n"


def test_a_spent_budget_runs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = fake_ctl(tmp_path, ready())
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    got = system_imex.read_imex(True, time.monotonic(), FsView(etc=etc_tree(tmp_path)))
    assert calls(tmp_path) == [] and got.daemon is not None
    assert got.daemon.error == "`nvidia-imex-ctl -q` not run: the time budget (--budget) was spent"


# --- the command, on the fake driver ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if fake_driver.compiler() is None:
        pytest.skip("no C compiler to build the fake driver")
    return fake_driver.build(tmp_path_factory.mktemp("driver"))


def imex_check(driver: Path, tmp_path: Path, bin_dir: Path, etc: Path, *args: str, timeout: float = 60):  # type: ignore[no-untyped-def]
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "GPUTOPO_ETC_ROOT": str(etc)}
    return fake_driver.run(
        driver,
        machine(tmp_path, healthy(0)),
        "check",
        *FAST,
        "--json",
        *args,
        timeout=timeout,
        extra_env=env,
    )


def imex_of(doc: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    found = [f for f in doc["findings"] if (f.get("rule") or "").startswith("imex_")]
    skipped = [n for n in doc["not_checked"] if n["what"].startswith("IMEX")]
    return found, skipped


def test_cli_healthy_domain(driver: Path, tmp_path: Path) -> None:
    result = imex_check(driver, tmp_path, fake_ctl(tmp_path, ready()), etc_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert imex_of(json.loads(result.stdout)) == ([], [])
    assert calls(tmp_path) == ["-q", "-N -j"]


def test_cli_one_member_unavailable_is_named_by_host(driver: Path, tmp_path: Path) -> None:
    n = {"out": domain_json("DEGRADED", {"10.0.0.3": "UNAVAILABLE"})}
    result = imex_check(driver, tmp_path, fake_ctl(tmp_path, ready(), n), etc_tree(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    found, _ = imex_of(json.loads(result.stdout))
    assert [(f["where"], f["rule"], f["category"]) for f in found] == [
        ("IMEX member 10.0.0.3", "imex_member_down", "nvlink")
    ]


def test_cli_daemon_waiting_for_peers(driver: Path, tmp_path: Path) -> None:
    result = imex_check(
        driver, tmp_path, fake_ctl(tmp_path, ready("WAITING_FOR_PEERS\n")), etc_tree(tmp_path)
    )
    assert result.returncode == 1
    doc = json.loads(result.stdout)
    assert doc["reason"].startswith("the IMEX daemon is WAITING_FOR_PEERS, not READY")
    assert [f["rule"] for f in imex_of(doc)[0]] == ["imex_daemon_not_ready"]


def test_cli_failed_to_read_node_configuration_file(driver: Path, tmp_path: Path) -> None:
    # --expect-imex on a node with no node configuration: nvidia-imex-ctl says so (and exits 255).
    q = {"out": f"{NOT_CONFIGURED_TEXT}\n", "rc": 255}
    result = imex_check(
        driver, tmp_path, fake_ctl(tmp_path, q), etc_tree(tmp_path, nodes=None), "--expect-imex"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    found, _ = imex_of(json.loads(result.stdout))
    assert [f["rule"] for f in found] == ["imex_not_configured"]
    assert NOT_CONFIGURED_TEXT in found[0]["what"]
    assert calls(tmp_path) == ["-q"]


def test_cli_idle_dra_node_has_no_finding(driver: Path, tmp_path: Path) -> None:
    # NVIDIA's DRA driver runs IMEX daemons only while a ComputeDomain is active: an idle node has no
    # configuration and no daemon, and the tool (were it asked) could only fail. It is not asked.
    q = {"out": "", "err": "Query Status returned error code: 14\n", "rc": 1}
    result = imex_check(driver, tmp_path, fake_ctl(tmp_path, q), etc_tree(tmp_path, nodes=None))
    assert result.returncode == 0, result.stdout + result.stderr
    found, skipped = imex_of(json.loads(result.stdout))
    assert found == [] and calls(tmp_path) == []
    assert skipped[0]["why"].startswith("no IMEX daemon expected here")


def test_cli_hung_ctl_is_not_checked_within_the_budget(driver: Path, tmp_path: Path) -> None:
    budget = 6.0
    q = {"out": "READY\n", "sleep": 120}
    result = imex_check(
        driver, tmp_path, fake_ctl(tmp_path, q), etc_tree(tmp_path), "--budget", str(budget), timeout=90
    )
    assert result.returncode == 0, result.stdout + result.stderr  # healthy otherwise: never a problem
    doc = json.loads(result.stdout)
    found, skipped = imex_of(doc)
    assert found == [] and len(skipped) == 1
    why = skipped[0]["why"]
    assert why.startswith("`nvidia-imex-ctl -q` did not answer within ") and why.endswith(
        "(cut off to keep --budget)"
    )
    cut_s = float(why.split("within ")[1].split(" s")[0])
    assert cut_s <= budget  # the cut-off came from the budget; -N -j was not tried after it
    assert calls(tmp_path) == ["-q"]
    assert doc["elapsed_s"] < budget + 30  # generous: finished long before the fake's two minutes


def test_doctor_shows_the_imex_findings_like_any_other(driver: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")  # doctor's tests run where its probe extras are installed
    bin_dir = fake_ctl(tmp_path, ready(), {"out": domain_json("DEGRADED", {"10.0.0.2": "UNAVAILABLE"})})
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "GPUTOPO_ETC_ROOT": str(etc_tree(tmp_path)),
    }
    out = fake_driver.run(
        driver, machine(tmp_path, healthy(0)), "doctor", "--skip-probe", "--json", extra_env=env, timeout=280
    )
    doc = json.loads(out.stdout)
    found = [f for f in doc["findings"] if f.get("rule") == "imex_member_down"]
    assert [f["where"] for f in found] == ["IMEX member 10.0.0.2"], out.stderr
    assert calls(tmp_path) == ["-q", "-N -j"]


# --- this node once (issue 42) ---------------------------------------------------------------------------


def test_a_daemon_waiting_for_peers_is_one_problem_not_also_a_member() -> None:
    # This node is 10.0.0.1; its daemon answers WAITING_FOR_PEERS and -N lists it so, its peers' links to it
    # not CONNECTED: the daemon's problem, not also "member 10.0.0.1 ... restart nvidia-imex on the member".
    n = domain_json("DEGRADED", {"10.0.0.1": "WAITING_FOR_PEERS"}, {("10.0.0.2", "10.0.0.1"): "DISCONNECTED"})
    r = reading("WAITING_FOR_PEERS\n", n, exit_code=0)
    for own in (("10.0.0.1",), ()):  # by its address, or by the daemon's own answer
        found, _ = judge_imex(ImexReading(r.nodes_config, True, None, r.daemon, r.domain, own), expect=False)
        assert [f.rule for f in found] == ["imex_daemon_not_ready"], found
    # Another member down as well: named, and only it.
    n = domain_json("DEGRADED", {"10.0.0.1": "WAITING_FOR_PEERS", "10.0.0.3": "UNAVAILABLE"})
    r = reading("WAITING_FOR_PEERS\n", n, exit_code=0)
    found, _ = judge_imex(ImexReading(r.nodes_config, True, None, r.daemon, r.domain, ("10.0.0.1",)), False)
    assert [(f.where, f.rule) for f in found] == [
        ("IMEX", "imex_daemon_not_ready"),
        ("IMEX member 10.0.0.3", "imex_member_down"),
    ]
    assert "1 of 2 other members" in found[1].what


def test_a_ready_daemon_keeps_naming_members_even_its_own_address_listed() -> None:
    n = domain_json("DEGRADED", {"10.0.0.3": "UNAVAILABLE"})
    r = reading("READY\n", n, exit_code=0)
    found, _ = judge_imex(ImexReading(r.nodes_config, True, None, r.daemon, r.domain, ("10.0.0.1",)), False)
    assert [(f.where, f.rule) for f in found] == [("IMEX member 10.0.0.3", "imex_member_down")]


def test_this_host_finds_itself_by_its_own_addresses() -> None:
    hosts = system_imex.own_hosts()
    assert "127.0.0.1" in hosts or "::1" in hosts


def test_through_the_fake_ctl_this_host_is_found_by_its_own_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The member at 127.0.0.1 is this host (psutil lists the loopback address): its daemon WAITING_FOR_PEERS
    # is reported once, as the daemon; 10.0.0.3 sees it DISCONNECTED and that is not a second problem.
    doc = json.loads(domain_json("DEGRADED"))
    doc["nodes"]["0"]["host"] = "127.0.0.1"
    doc["nodes"]["0"]["status"] = "WAITING_FOR_PEERS"
    doc["nodes"]["1"]["status"] = "WAITING_FOR_PEERS"  # two in the daemon's state: only the address tells
    for node in doc["nodes"].values():
        for c in node["connections"].values():
            if c["host"] == "10.0.0.1":
                c["host"], c["status"] = "127.0.0.1", "DISCONNECTED"
    found, _ = read_through_fake(
        tmp_path, monkeypatch, ready("WAITING_FOR_PEERS\n"), {"out": json.dumps(doc)}
    )
    assert [(f.where, f.rule) for f in found] == [
        ("IMEX", "imex_daemon_not_ready"),
        ("IMEX member 10.0.0.2", "imex_member_down"),
    ], found
