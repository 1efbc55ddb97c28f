"""health.state's document (pure): sections per owner, unknown ones carried, a newer schema read only,
the merge a check does under the lock, and each rule set's judgement kept beside the others."""

from __future__ import annotations

import json
import time

import pytest

from gputopo.findings import Finding
from gputopo.health import state as st


def test_parse_keeps_unknown_sections_and_refuses_what_is_not_a_state() -> None:
    raw = {"schema": st.SCHEMA, "node": "n1", "accept": {"verdict": "ok"}, "drain": None}
    doc, warning = st.parse_doc(raw, "--state f", "n1")
    assert warning is None and doc is not None and doc.section("accept") == {"verdict": "ok"}
    assert json.loads(st.dumps_doc(doc)) == raw  # written back as read
    for bad, words in (
        ([1], "not a gputopo check state ('list')"),
        ({"schema": "other/v1"}, "not a gputopo check state"),
        ({"schema": "gputopo/check-state/vX", "node": "n1"}, "not a gputopo check state"),
        ({"schema": st.SCHEMA, "node": "n2"}, "the state of node 'n2', not 'n1'"),
    ):
        doc, warning = st.parse_doc(bad, "--state f", "n1")
        assert doc is None and warning is not None and words in warning


def test_a_newer_schema_is_kept_whole_and_not_interpreted() -> None:
    raw = {"schema": "gputopo/check-state/v2", "node": "n1", "acknowledged": {"until": 4e9, "keys": []}}
    doc, warning = st.parse_doc(raw, "--state f", "n1")
    assert doc is not None and doc.newer and "written by a newer gputopo (schema v2" in (warning or "")
    assert st.check_state(doc, "n1") == st.CheckState("n1")  # its acknowledgement is not guessed at


def test_sections_are_replaced_one_at_a_time_and_reserved_keys_refused() -> None:
    doc = st.StateDoc("n1", {"accept": 1, "last": {"verdict": "healthy"}})
    doc2 = doc.with_section("accept", {"verdict": "failed"}).with_section("npd", [1])
    assert doc2.sections == {"accept": {"verdict": "failed"}, "last": {"verdict": "healthy"}, "npd": [1]}
    assert "accept" not in doc2.with_section("accept", None).sections
    for name in ("schema", "node", ""):
        with pytest.raises(ValueError):
            doc.with_section(name, 1)
    mine = st.drained(st.CheckState("n1"), "gputopo: x", ["k1"], 10.0)
    out = st.with_check_state(doc, mine)
    assert out.section("accept") == 1 and out.section("drain")["events"] == ["k1"]


def test_a_plain_check_never_undoes_the_drain_another_saved() -> None:
    fresh = st.drained(st.CheckState("n1"), "gputopo: Xid 79", ["k"], 100.0)
    mine = st.remember_judgement(st.CheckState("n1"), 200.0, "healthy", [], None)
    kept = st.merged(fresh, mine, with_record=False)
    assert kept.drained_at == 100.0 and kept.verdict == "healthy"
    assert st.merged(fresh, mine, with_record=True).drained_at is None


def _sick(gpu: int) -> Finding:
    return Finding(where=f"GPU{gpu}", gpu=gpu, what="row remap failed", remedy="replace", category="memory")


def test_each_rule_set_keeps_its_own_judgement() -> None:
    """One check per subsystem (NPD rules): a healthy run of one rule set does not erase another's fresh
    problems, also when both are saved at once (the merge under the lock keeps both)."""
    now = time.time()
    base = st.CheckState("n1")
    memory = st.remember_judgement(base, now - 20, "problems", [_sick(1)], None, rule_set="/etc/mem.toml")
    fabric = st.remember_judgement(base, now - 10, "healthy", [], None, rule_set="/etc/fabric.toml")
    both = st.merged(memory, fabric, with_record=False)  # saved one after the other, each from a stale read
    assert set(both.results) == {"/etc/mem.toml", "/etc/fabric.toml"}
    assert both.verdict == "healthy"  # "last" is the latest run's
    judged = st.fresh_judgement(both, now)
    assert judged is not None and judged["verdict"] == "problems" and len(judged["problems"]) == 1
    found, age = st.last_check_findings(both, now, {1: None})
    assert [f.gpu for f in found] == [1] and age == pytest.approx(10, abs=1)
    # A later healthy run of the memory rule set clears it; a stale one is not used.
    healed = st.merged(
        both, st.remember_judgement(both, now - 5, "healthy", [], None, rule_set="/etc/mem.toml"), False
    )
    assert st.fresh_judgement(healed, now)["verdict"] == "healthy"
    assert st.fresh_judgement(healed, now + st.FRESH_S + 60) is None


def test_a_state_written_before_rule_sets_reads_from_its_last_judgement() -> None:
    now = time.time()
    old = st.remember_judgement(st.CheckState("n1"), now - 30, "problems", [_sick(0)], None)
    doc = old.to_json()
    del doc["results"]  # as gputopo wrote it before
    state, warning = st.loads(json.dumps(doc), "f", "n1")
    assert warning is None and state.results == {}
    assert st.fresh_judgement(state, now)["verdict"] == "problems"
    assert [f.gpu for f in st.last_check_findings(state, now, {0: None})[0]] == [0]


def test_readers_look_at_roots_state_as_any_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-root users' recommend and run read root's verdict (saved 0644 in a 0755 folder); only writers
    that act for the node (check --drain, accept) default to it, as root."""
    from pathlib import Path

    from gputopo.system import state_file

    monkeypatch.delenv(st.STATE_ENV, raising=False)
    monkeypatch.setattr(state_file.os, "geteuid", lambda: 1000)
    assert state_file.reader_path() == Path(st.DEFAULT_ROOT_PATH)
    assert state_file.writer_path(True) is None
    monkeypatch.setattr(state_file.os, "geteuid", lambda: 0)
    assert (
        state_file.writer_path(True) == Path(st.DEFAULT_ROOT_PATH) and state_file.writer_path(False) is None
    )
    monkeypatch.setenv(st.STATE_ENV, "")
    assert state_file.reader_path() is None and state_file.writer_path(True) is None


def test_update_section_keeps_everything_else_and_refuses_what_it_must_not_write(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gputopo.system.state_file import update_section

    path = tmp_path / "state.json"
    drained = st.with_check_state(None, st.drained(st.CheckState("n1"), "gputopo: x", ["k"], 5.0))
    path.write_text(st.dumps_doc(drained.with_section("future", {"kept": True})))
    done = update_section(path, "n1", "accept", lambda old: {"verdict": "accepted", "was": old}, 5)
    assert done.saved and done.exit_code == 0
    doc = json.loads(path.read_text())
    assert doc["accept"] == {"verdict": "accepted", "was": None} and doc["future"] == {"kept": True}
    assert doc["drain"]["events"] == ["k"] and json.loads((tmp_path / "state.json.old").read_text())["future"]
    newer = '{"schema": "gputopo/check-state/v3", "node": "n1"}'
    path.write_text(newer)
    refused = update_section(path, "n1", "accept", lambda old: 1, 5)
    assert not refused.saved and refused.exit_code == 3 and "newer gputopo" in (refused.why_not or "")
    assert path.read_text() == newer
    link = tmp_path / "link.json"
    link.symlink_to(path)
    refused = update_section(link, "n1", "accept", lambda old: 1, 5)
    assert not refused.saved and refused.exit_code == 2 and "symbolic link" in (refused.why_not or "")
    assert path.read_text() == newer
