"""services/check.py: check's options are validated once, when built (every cross-option rule there, none
in cli/), and its report builds the whole gputopo/check/v1 document in one place."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gputopo.errors import UsageError
from gputopo.health import state as st
from gputopo.health.check import summarize
from gputopo.services import check
from gputopo.system.slurm_node import SlurmAction


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"subsystem": "memory"}, "--subsystem: only with --format npd"),
        ({"subsystem": "memory", "output": "npd", "max_output_length": 0}, "--max-output-length 0"),
        ({"subsystem": "bogus", "output": "npd"}, "--subsystem bogus: not a subsystem"),
        ({"subsystem": "memory", "output": "npd", "max_age_s": 0}, "--max-age 0"),
        ({"since": "soon", "budget_s": 0}, "--since"),  # --since is judged first, as before
        ({"budget_s": 0}, "--budget 0"),
        ({"max_drained": "lots"}, "--max-drained"),
        ({"max_output_length": 0}, "--max-output-length 0"),
        ({"fleet": True}, "--fleet: only with --save-baseline"),
    ],
)
def test_options_refuse_bad_input_when_built(kw, message) -> None:
    with pytest.raises(UsageError) as err:
        check.Options(**kw)
    assert message in err.value.message


def test_textfile_must_be_a_folder(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a folder"):
        check.Options(textfile=tmp_path / "missing")
    assert check.Options(textfile=tmp_path).textfile == tmp_path


def test_a_subsystem_answer_uses_nothing_else_of_a_check() -> None:
    # NPD's one-subsystem rule: the check's other options are not read, so not judged either.
    options = check.Options(subsystem="memory", output="npd", budget_s=0, since="soon")
    assert options.subsystem == "memory"


def test_options_parse_their_text_once_and_are_frozen_and_keyword_only() -> None:
    options = check.Options(since="30m", max_drained="10%", drain=True)
    assert options.since_s == 1800.0 and options.max_drained_limit == (None, 0.1) and options.acting
    with pytest.raises(TypeError):
        check.Options(1)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.drain = False  # type: ignore[misc]


def test_the_report_document_is_the_result_with_slurm_and_accept_last() -> None:
    result = summarize(None, None, (), (), 0.1, "NVML is not available")
    plain = check.CheckReport(result)
    assert plain.document() == {**result.to_json(), "accept": None}
    assert plain.exit_code == result.exit_code == 3
    slurm = SlurmAction("drain", "scontrol update NodeName=n1 State=DRAIN", False, dry_run=True)
    acting = check.CheckReport(result, slurm, {"state": "accepted"})
    doc = acting.document()
    assert list(doc)[-2:] == ["slurm", "accept"]
    assert doc["slurm"] == slurm.to_json() and doc["accept"] == {"state": "accepted"}
    assert acting.dry_run_line == slurm.command  # --dry-run prints the command it did not run
    assert check.CheckReport(result, dataclasses.replace(slurm, done=True)).dry_run_line is None


def test_merged_takes_every_field_of_a_check_state_by_a_named_rule() -> None:
    # A new CheckState field must be sorted into the judgement or the node record (or kept from the
    # re-read state, as the node name is, and results, merged on their own).
    named = {*st.JUDGEMENT_FIELDS, *st.RECORD_FIELDS, "node", "results"}
    assert {f.name for f in dataclasses.fields(st.CheckState)} == named
    fresh = st.CheckState("n1", drained_at=5.0, verdict="healthy")
    mine = st.CheckState("n1", drained_at=None, verdict="problems")
    assert st.merged(fresh, mine, with_record=False).drained_at == 5.0
    assert st.merged(fresh, mine, with_record=False).verdict == "problems"
    assert st.merged(fresh, mine, with_record=True).drained_at is None
