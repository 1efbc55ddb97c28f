"""The one machine step (``services.machine``, issue 41 item 4): the topology, one health sample, the
drain rule and the preset ``CUDA_VISIBLE_DEVICES`` read once and handed down; and the set choice that
``recommend`` and ``run`` share through it (``services.recommend.Choice``, declared once in the CLI)."""

from __future__ import annotations

import dataclasses

import pytest

from fake_nvml import FakeNvml
from gputopo.errors import UsageError
from gputopo.services import machine as step
from gputopo.services import recommend, run

SEED = "sample:seed-8gpu-nv4"


@pytest.fixture(autouse=True)
def _no_check_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """No last check from this host's /var/lib/gputopo: the step reads only what the test gives it."""
    monkeypatch.setenv("GPUTOPO_CHECK_STATE", "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def drained_gpu3_box() -> FakeNvml:
    """The NVSwitch box with health answered, GPU3's driver asking to drain P2P (recovery action 3)."""
    fake = FakeNvml.nvswitch_box(health=True)
    fake.gpus[3].health.fields[230] = 3  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: DRAIN_P2P
    return fake


def test_a_saved_machine_has_no_health_and_no_preset_and_says_why(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    said: list[str] = []
    got = step.read(step.MachineOptions(input=SEED), step.Hooks(warn=said.append))
    assert got.topology.source and not got.live and got.preset is None
    assert got.health.judgement is None and got.health.unhealthy == () and got.health.no_p2p == ()
    assert got.health.section() == {
        "checked": False,
        "source": f"not checked (--input {SEED}: not this machine)",
        "findings": [],
        "not_checked": [],
    }
    source = got.topology.source
    assert said == [f"CUDA_VISIBLE_DEVICES=0,1 describes this machine, not {source}: not applied"]


def test_the_drain_rule_is_applied_once_from_one_health_sample() -> None:
    fake = drained_gpu3_box()
    with fake.installed():
        got = step.read(step.MachineOptions())
    assert got.live and got.health.judgement is not None
    assert [g for g, _ in got.health.no_p2p] == [3]
    assert "recovery" in dict(got.health.no_p2p)[3]
    section = got.health.section()
    assert section["checked"] is True and section["source"] == step.LIVE_HEALTH_SOURCE
    # the topology and the health are each read once: one NVML session for each, no second sample
    assert fake.open_sessions == 0


def test_a_sample_of_some_gpus_judges_only_those() -> None:
    """A probe's sets: the health sample of the GPUs it will use; GPU3 outside them is not judged."""
    with drained_gpu3_box().installed():
        got = step.read(step.MachineOptions(health_gpus=(0, 1)))
    assert got.health.no_p2p == ()
    assert got.health.judgement is not None
    assert {f.gpu for f in got.health.judgement.findings} <= {0, 1, None}


def test_the_drain_rule_over_any_findings_is_the_same_rule() -> None:
    with drained_gpu3_box().installed():
        got = step.read(step.MachineOptions())
    assert got.health.judgement is not None
    assert step.drained(got.health.judgement.findings) == dict(got.health.no_p2p)


def test_a_preset_of_uuids_narrows_the_choice_without_asking_cuda(monkeypatch) -> None:
    fake = FakeNvml.nvlink_box()
    with fake.installed():
        uuids = [g.uuid for g in step.load_topology(None).gpus]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{uuids[2]},{uuids[3]}")
        got = step.read(step.MachineOptions())
        ignored = step.read(step.MachineOptions(preset=False))
    assert got.preset is not None and got.preset.allowed == (2, 3)
    assert got.preset.outside.startswith(f"not in CUDA_VISIBLE_DEVICES={uuids[2]},{uuids[3]}")
    assert ignored.preset is None  # --ignore-visible-devices


def test_a_refused_topology_stops_the_step_before_the_health_read(monkeypatch) -> None:
    def no_health(*_a, **_k):
        raise AssertionError("health read after the topology was refused")

    monkeypatch.setattr("gputopo.system.machine.read_live_health", no_health)

    def refuse(_topo) -> None:
        raise UsageError("not this one", "a hint")

    with FakeNvml.nvlink_box().installed(), pytest.raises(UsageError, match="not this one"):
        step.read(step.MachineOptions(), step.Hooks(on_topology=refuse))


def test_recommend_and_run_leave_the_drained_gpu_out_of_every_multi_gpu_set() -> None:
    with drained_gpu3_box().installed():
        rec = recommend.run(recommend.Options(n=2, top=20))
        planned = run.plan(run.Options(n=3, command=("python", "x.py"), dry_run=True))
    sets = [c["gpus"] for c in rec.document()["candidates"]]
    assert sets and all(3 not in s for s in sets)
    assert 3 not in planned.plan.gpus
    assert {e["gpu"] for e in planned.document()["excluded"]} >= {3}


def test_the_choice_is_checked_once_when_built() -> None:
    with pytest.raises(UsageError, match="--max-used-mib -5: must be 0 or more"):
        recommend.Choice(max_used_mib=-5)
    assert recommend.Choice(exclude="3,4").excluded == (3, 4)
    with pytest.raises(UsageError, match="--exclude"):
        recommend.Choice(exclude="three")
    with pytest.raises(dataclasses.FrozenInstanceError):
        recommend.Choice().exclude = "1"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: recommend.Options(n=2, nnodes=2), "--nnodes goes with --launch"),
        (lambda: recommend.Options(n=2, id_format="name"), "--format name: not a format"),
        (lambda: run.Options(n=2, command=("x",), json_out=True), "--json goes with --dry-run"),
        (lambda: run.Options(n=2), "no command given"),
    ],
)
def test_cross_option_rules_live_in_the_options(build, message) -> None:
    with pytest.raises(UsageError, match=message):
        build()


def test_a_missing_inspector_plugin_is_refused_before_the_machine_is_read(tmp_path) -> None:
    with pytest.raises(UsageError, match="no such file"):
        run.Options(n=2, command=("x",), inspector_plugin=tmp_path / "absent.so")


def test_recommend_and_run_declare_the_shared_options_once() -> None:
    """Each shared option shows once in each command's --help (declared in cli/options.CHOICE_OPTIONS),
    and a bad value of one is refused in one line by both."""
    from conftest import invoke
    from gputopo.cli.options import CHOICE_OPTIONS

    for command in ("recommend", "run"):
        text = invoke(command, "--help", columns=200).output
        for name, _, _ in CHOICE_OPTIONS:
            flag = "--" + name.replace("_", "-")
            assert text.count(flag + " ") + text.count(flag + "\n") >= 1, (command, flag)
        tail = ("--", "python", "x.py") if command == "run" else ()
        bad = invoke(command, "--n", "2", "--input", SEED, "--max-used-mib", "-1", *tail)
        assert bad.exit_code == 2
        assert "--max-used-mib -1: must be 0 or more" in bad.output
