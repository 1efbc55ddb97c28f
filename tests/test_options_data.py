"""Options as data: each command's options are one frozen, keyword-only object, built and checked once
from the parsed command line; a bad value is refused once, in one line and a hint, exit 2, before the
machine is read."""

from __future__ import annotations

import dataclasses

import pytest

from gputopo.cli import run_main
from gputopo.probe.plan.config import ProbeConfig
from gputopo.procs.stale import Policy
from gputopo.recommend import Constraints
from gputopo.services import check, recommend, run, stale, topo
from gputopo.services.check import CheckOptions
from gputopo.services.doctor import DoctorOptions
from gputopo.services.machine import MachineOptions

OPTION_OBJECTS = [CheckOptions, check.Options, DoctorOptions, stale.Options, Policy, Constraints, ProbeConfig]
# recommend's, run's and topo's options, the set choice they share, and the machine step's
OPTION_OBJECTS += [recommend.Options, recommend.Choice, run.Options, topo.Options, MachineOptions]


@pytest.mark.parametrize("cls", OPTION_OBJECTS, ids=[f"{c.__module__}.{c.__name__}" for c in OPTION_OBJECTS])
def test_option_objects_are_frozen_and_keyword_only(cls: type) -> None:
    assert dataclasses.is_dataclass(cls)
    assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
    positional = [f.name for f in dataclasses.fields(cls) if f.init and not f.kw_only]
    assert positional == [], f"{cls.__name__}: {positional} can be given by position"
    with pytest.raises(TypeError):
        cls(1)  # no field is taken by position: three floats in a row cannot be swapped unseen


def test_kill_stale_options_are_built_from_keywords_only() -> None:
    built = stale.Options(
        act=False,
        all_holders=True,
        all_users=False,
        older_than="10m",
        grace_s=2.5,
        gpus="5,6",
        device_files=None,
        pids=(42,),
    )
    assert built.policy == Policy(all=True, older_than_s=600.0, pids=frozenset({42}))
    assert built.gpu_set == frozenset({5, 6})
    assert built.grace_s == 2.5 and not built.act
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.grace_s = 0  # type: ignore[misc]
    # No defaults in kill-stale's options: each default is the CLI's, written once.
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(stale.Options))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["kill-stale", "--grace", "-1", "--older-than", "soon"], "error: --grace -1: must be 0 or more"),
        (["kill-stale", "--older-than", "soon"], "error: --older-than soon: not a duration"),
        (["kill-stale", "--pid", "0"], "error: --pid: a process id is a positive number"),
        (
            ["recommend", "--n", "2", "--max-used-mib", "-5", "--input", "sample:seed-8gpu-nv4"],
            "error: --max-used-mib -5: must be 0 or more",
        ),
        (["check", "--sample-s", "-1"], "error: --sample-s"),
        (
            ["probe", "--dry-run", "--device", "cpu", "--gpus", "0,1", "--min-bytes", "lots"],
            "error: --min-bytes",
        ),
    ],
)
def test_a_bad_value_is_refused_once_in_one_line(args, message, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)
    assert run_main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip("\n").splitlines()
    assert len(lines) == 2, captured.err  # the error, then its hint: said once, the first rule only
    assert lines[0].startswith(message) and lines[1].startswith("hint: "), captured.err
    assert captured.out == ""


def test_defaults_kept_apart_for_a_fast_help_equal_the_services() -> None:
    """The CLI spells two recommend defaults itself (importing ``gputopo.recommend`` would slow every
    ``--help``); they must stay the service's."""
    from gputopo.cli import options
    from gputopo.cli import recommend as cli_recommend
    from gputopo.recommend import DEFAULT_MAX_USED_MIB, DEFAULT_TOP

    assert options.DEFAULT_MAX_USED_MIB == DEFAULT_MAX_USED_MIB
    assert cli_recommend.DEFAULT_TOP == DEFAULT_TOP
