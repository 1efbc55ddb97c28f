"""What the ranks' environment does to a verdict: variables on record, caveats on the verdict line, NCCL's
transport per connection from its INIT log, and numerics pinned the same way in every rank."""

from __future__ import annotations

import types
from datetime import datetime, timezone

import pytest

from gputopo.probe.judge import environment as envmod
from gputopo.probe.judge.verdict import CheckResult, SetResult
from gputopo.probe.plan.config import DeviceInventory, build_config
from gputopo.probe.report.document import to_document, to_markdown, verdict_line
from gputopo.probe.shared import ProbeRun

# Written from NCCL's INFO format strings (src/transport/p2p.cc, shm.cc, net.cc): "Channel %02d/%01d :
# %d[%d] -> %d[%d] via P2P/%s%s%s" and friends, behind the usual "host:pid:tid [cudaDev] NCCL INFO" prefix.
NCCL_LOG = """\
node7:4711:4790 [0] NCCL INFO Bootstrap: Using eth0:10.0.0.7<0>
node7:4711:4790 [0] NCCL INFO comm 0x55d0 rank 0 nranks 2 cudaDev 0 nvmlDev 5 busId 85000 - Init START
node7:4711:4790 [0] NCCL INFO Channel 00/0 : 0[5] -> 1[6] via P2P/CUMEM/read
node7:4711:4790 [0] NCCL INFO Channel 01/0 : 0[5] -> 1[6] via P2P/CUMEM/read
node7:4711:4791 [0] NCCL INFO Channel 00/0 : 0[5] -> 1[6] via P2P/IPC
node7:4712:4792 [1] NCCL INFO Channel 00 : 1[6] -> 0[5] via SHM/direct/direct
node7:4712:4792 [1] NCCL INFO Channel 01/0 : 1[6] -> 0[5] [send] via NET/Socket/0
node7:4712:4792 [1] NCCL INFO Channel 01/0 : 0[5] -> 1[6] [receive] via NET/IB/0/GDRDMA
node7:4712:4792 [1] NCCL INFO Channel 02/0 : 1[6] -> 0[5] via P2P/direct pointer/read
node7:4712:4792 [1] NCCL INFO Channel 00 : 1[8b000] -> 0[85000] via SHM/CE/direct
node7:4712:4792 [1] NCCL INFO Connected all rings, use ring PXN 0 GDR 1
"""


def test_nccl_init_lines_parse_into_transports_per_connection():
    conns = envmod.parse_transport_lines(NCCL_LOG.splitlines())
    assert [c["transport"] for c in conns] == [
        "P2P/CUMEM",
        "P2P/CUMEM",
        "P2P/IPC",
        "SHM",
        "NET",
        "NET",
        "P2P/direct",
        "SHM",
    ]
    first = conns[0]
    assert (first["channel"], first["src_rank"], first["dst_rank"]) == (0, 0, 1)
    assert (first["src_dev"], first["dst_dev"]) == (5, 6)  # NVML indices, nvidia-smi's numbering
    assert first["via"] == "P2P/CUMEM/read"
    assert conns[4]["side"] == "send" and conns[5]["side"] == "receive"
    assert conns[7]["src_dev"] == "8b000"  # an older NCCL prints the bus id in hex


def test_transports_are_summarised_per_connection_with_their_channels():
    rows = envmod.summarize_transports(envmod.parse_transport_lines(NCCL_LOG.splitlines()))
    cumem = next(r for r in rows if r["via"] == "P2P/CUMEM/read")
    assert (cumem["src"], cumem["dst"], cumem["channels"]) == (5, 6, [0, 1])
    counts = envmod.transport_counts(rows)
    assert counts["P2P/CUMEM"] == 1 and counts["SHM"] == 2 and counts["NET"] == 2
    text = envmod.describe_transports(rows)
    assert (
        "GPU5->GPU6 P2P/CUMEM/read (2 channels)" in text
        and "GPU6->GPU5 SHM/direct/direct (1 channel)" in text
    )


def test_only_nccl_and_cuda_variables_are_recorded():
    got = envmod.recorded_variables(
        {"NCCL_P2P_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "5,6", "HOME": "/root", "PATH": "/bin"}
    )
    assert got == {"CUDA_VISIBLE_DEVICES": "5,6", "NCCL_P2P_DISABLE": "1"}


@pytest.mark.parametrize(
    ("name", "value", "caveat"),
    [
        ("NCCL_P2P_DISABLE", "1", "P2P path not tested: NCCL_P2P_DISABLE=1"),
        ("NCCL_P2P_LEVEL", "LOC", "P2P path not tested: NCCL_P2P_LEVEL=LOC"),
        ("NCCL_P2P_LEVEL", "PIX", "P2P used only up to path type PIX: NCCL_P2P_LEVEL=PIX"),
        ("NCCL_SHM_DISABLE", "1", "SHM path not tested: NCCL_SHM_DISABLE=1"),
        ("NCCL_ALGO", "Tree", "all-reduce algorithm forced: NCCL_ALGO=Tree"),
        ("CUDA_LAUNCH_BLOCKING", "1", "timings serialised by CUDA_LAUNCH_BLOCKING=1"),
    ],
)
def test_variables_that_change_the_test_are_named(name, value, caveat):
    assert envmod.environment_caveats({0: {name: value}, 1: {name: value}}, "nccl") == [caveat]


def test_harmless_variables_and_gloo_ranks_add_no_caveat():
    harmless = {"NCCL_P2P_DISABLE": "0", "NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert envmod.environment_caveats({0: harmless}, "nccl") == []
    assert envmod.environment_caveats({0: {"NCCL_P2P_DISABLE": "1"}}, "gloo") == []


def test_a_setting_only_some_ranks_got_names_those_ranks():
    got = envmod.environment_caveats({0: {}, 1: {"NCCL_SHM_DISABLE": "1"}}, "nccl")
    assert got == ["SHM path not tested: NCCL_SHM_DISABLE=1 (rank 1 only)"]


def _run(environment):
    config = build_config(DeviceInventory("cpu", (0, 1)), ["0,1"], model="tiny", steps=2)
    checks = (CheckResult("ddp", "pass", detail="ok", metrics={}),)
    when = datetime(2026, 11, 21, 15, 30, tzinfo=timezone.utc)
    return ProbeRun(config, (SetResult((0, 1), checks),), environment, (), when, 1.0)


def test_the_verdict_names_what_the_environment_took_out_of_the_test():
    env = {
        "caveats": ["P2P path not tested: NCCL_P2P_DISABLE=1"],
        "rank_variables": {"0": {"NCCL_P2P_DISABLE": "1"}},
    }
    doc = to_document(_run(env))
    assert doc["verdict"] == "pass" and doc["caveats"] == ["P2P path not tested: NCCL_P2P_DISABLE=1"]
    assert verdict_line(doc) == "PASS (P2P path not tested: NCCL_P2P_DISABLE=1)"
    md = to_markdown(doc)
    assert md.startswith("# gputopo probe: PASS (P2P path not tested: NCCL_P2P_DISABLE=1)")
    assert "| NCCL_P2P_DISABLE | 1 |" in md

    from rich.console import Console

    from gputopo.ui.probe_view import render_probe

    console = Console(width=200, record=True, color_system=None)
    console.print(render_probe(doc))
    text = console.export_text()
    assert "gputopo probe: PASS (P2P path not tested: NCCL_P2P_DISABLE=1)" in text


def test_worker_records_every_rank_and_sets_capture_variables_apart(tmp_path):
    from gputopo.probe.ranks import worker

    environ = {"NCCL_P2P_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "5,6", "HOME": "/root"}
    recorded = worker.recorded_rank_environment(environ)
    added = worker.prepare_rank_environment(environ, "cuda", tmp_path, 1)
    assert recorded == {"CUDA_VISIBLE_DEVICES": "5,6", "NCCL_P2P_DISABLE": "1"}
    assert added["NCCL_DEBUG"] == "INFO" and added["NCCL_DEBUG_SUBSYS"] == "INIT"
    assert added["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl-rank1.log")
    assert environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    numerics = {"cudnn_benchmark": False}
    records = [
        {"rank": 1, "variables": recorded, "set_by_probe": added, "numerics": numerics},
        {"rank": 0, "variables": recorded, "set_by_probe": added, "numerics": numerics},
    ]
    out = worker.rank_records(records, "nccl")
    assert list(out["rank_variables"]) == ["0", "1"]
    assert out["caveats"] == ["P2P path not tested: NCCL_P2P_DISABLE=1"]
    assert out["numerics_same_in_every_rank"] is True


def test_cpu_ranks_capture_no_nccl_log(tmp_path):
    from gputopo.probe.ranks import worker

    environ = {}
    added = worker.prepare_rank_environment(environ, "cpu", tmp_path, 0)
    assert "NCCL_DEBUG_FILE" not in added


# --- numerics -----------------------------------------------------------------------------------------


@pytest.fixture
def restore_torch_numerics():
    torch = pytest.importorskip("torch")
    from gputopo.probe.ranks import numerics as rank_numerics

    before = rank_numerics.numerics_state()
    yield torch
    rank_numerics.apply_numerics(before)


def test_numerics_are_pinned_through_the_api_this_torch_prefers(restore_torch_numerics):
    torch = restore_torch_numerics
    from gputopo.probe.ranks import numerics as rank_numerics

    got = rank_numerics.pin_numerics()
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert got["deterministic_algorithms"] and got["cudnn_deterministic"] and not got["cudnn_benchmark"]
    if hasattr(torch.backends, "fp32_precision"):
        assert got["tf32"]["api"] == "fp32_precision"
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    else:
        assert got["tf32"] == {"api": "allow_tf32", "matmul_allow_tf32": False, "cudnn_allow_tf32": False}


def test_the_speed_table_runs_under_torchs_defaults_and_the_pinning_comes_back(
    restore_torch_numerics, monkeypatch
):
    torch = restore_torch_numerics
    from gputopo.probe.ranks import numerics as rank_numerics

    monkeypatch.setattr(rank_numerics, "_TORCH_DEFAULTS", None)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = torch.backends.cudnn.benchmark = False
    if hasattr(torch.backends, "fp32_precision"):
        torch.backends.cudnn.conv.fp32_precision = "tf32"  # torch 2.9+'s default for convolutions
    defaults = rank_numerics.numerics_state()  # a fresh rank's numerics: torch's defaults
    rank_numerics.pin_numerics()  # the rank's start: records the defaults, then pins
    pinned = rank_numerics.numerics_state()
    assert pinned["deterministic_algorithms"] and not pinned["cudnn_benchmark"]
    with rank_numerics.speed_numerics() as flags:
        assert flags == {**defaults, "cudnn_benchmark": True}
        assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
        assert not torch.backends.cudnn.deterministic
        if hasattr(torch.backends, "fp32_precision"):
            # torch's own default: TF32 allowed for cuDNN convolutions (not "ieee" as the checks pin it)
            assert torch.backends.cudnn.conv.fp32_precision == defaults["fp32_precision"]["cudnn_conv"]
            assert torch.backends.cudnn.conv.fp32_precision != "ieee"
    assert rank_numerics.numerics_state() == pinned  # the correctness checks after it are pinned again
    with pytest.raises(RuntimeError), rank_numerics.speed_numerics():
        raise RuntimeError("a rank failing mid-table")
    assert rank_numerics.numerics_state() == pinned


def test_an_older_torch_gets_tf32_off_through_allow_tf32():
    pytest.importorskip("torch")
    from gputopo.probe.ranks import numerics as rank_numerics

    state = {}
    fake = types.SimpleNamespace(
        use_deterministic_algorithms=lambda on, warn_only: state.update(det=on, warn=warn_only),
        are_deterministic_algorithms_enabled=lambda: state["det"],
        is_deterministic_algorithms_warn_only_enabled=lambda: state["warn"],
        backends=types.SimpleNamespace(
            cudnn=types.SimpleNamespace(deterministic=False, benchmark=True, allow_tf32=True),
            cuda=types.SimpleNamespace(matmul=types.SimpleNamespace(allow_tf32=True)),
        ),
    )
    got = rank_numerics.pin_numerics(fake)
    assert fake.backends.cuda.matmul.allow_tf32 is False and fake.backends.cudnn.allow_tf32 is False
    assert fake.backends.cudnn.deterministic is True and fake.backends.cudnn.benchmark is False
    assert got["tf32"]["api"] == "allow_tf32" and got["deterministic_algorithms"] is True
