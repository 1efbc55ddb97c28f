"""`gputopo probe` options: what a user can get wrong, caught before any rank starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gputopo.errors import UnavailableError, UsageError
from gputopo.probe.plan import config as cfg
from gputopo.probe.plan.config import DeviceInventory, Fault, Mode, build_config, parse_gpu_list
from gputopo.probe.pool import devices

EIGHT_GPU_BOX = DeviceInventory("cuda", tuple(range(8)), tuple(str(i) for i in range(8)))
CPU_STAND_INS = DeviceInventory("cpu", tuple(range(8)))


def test_gpu_list_parses_and_rejects_junk():
    assert parse_gpu_list("5,6") == (5, 6)
    assert parse_gpu_list(" 0 , 3 ") == (0, 3)
    for bad in ("5,,6", "a,b", "5;6", "-1", ""):
        with pytest.raises(UsageError):
            parse_gpu_list(bad)


def test_gpu_listed_twice_is_a_usage_error():
    with pytest.raises(UsageError, match="twice"):
        parse_gpu_list("5,5")


def test_unknown_gpu_index_lists_the_gpus_that_exist():
    with pytest.raises(UsageError) as err:
        build_config(EIGHT_GPU_BOX, ["6,9"])
    assert "no GPU 9" in err.value.message
    assert "0-7" in err.value.message
    assert err.value.exit_code == 2


def test_unknown_stand_in_on_cpu_says_stand_ins():
    with pytest.raises(UsageError, match="CPU stand-ins that exist are 0-7"):
        build_config(CPU_STAND_INS, ["0,12"])


def test_default_set_is_every_gpu_on_cuda_but_must_be_named_on_cpu():
    assert build_config(EIGHT_GPU_BOX).sets == (tuple(range(8)),)
    with pytest.raises(UsageError, match="--gpus"):
        build_config(CPU_STAND_INS)


def test_repeated_gpus_make_several_sets_and_mode_picks_checks():
    c = build_config(EIGHT_GPU_BOX, ["5,6", "6,7"], mode=Mode.DDP)
    assert c.sets == ((5, 6), (6, 7))
    assert c.checks == ("ddp",)
    assert build_config(EIGHT_GPU_BOX, ["0,1"]).checks == ("gpu", "p2p", "dp", "ddp", "allreduce")


def test_each_pair_takes_the_union_of_listed_gpus_or_all():
    assert build_config(EIGHT_GPU_BOX, ["0,1", "3"], each_pair=True).sets == ((0, 1, 3),)
    assert build_config(EIGHT_GPU_BOX, each_pair=True).sets == (tuple(range(8)),)
    with pytest.raises(UsageError, match="two GPUs"):
        build_config(EIGHT_GPU_BOX, ["4"], each_pair=True)


def test_backend_and_sweep_follow_the_device():
    gpu = build_config(EIGHT_GPU_BOX, ["0,1"])
    cpu = build_config(CPU_STAND_INS, ["0,1"])
    assert (gpu.backend, cpu.backend) == ("nccl", "gloo")
    assert min(gpu.sweep_bytes) == 1 << 20 and max(gpu.sweep_bytes) >= 256 << 20
    assert max(cpu.sweep_bytes) < min(max(gpu.sweep_bytes), 64 << 20)


def test_inject_rank_defaults_to_the_last_rank_and_is_bounded():
    assert build_config(CPU_STAND_INS, ["0,1,2"], inject=Fault.NAN).inject_rank == 2
    assert build_config(CPU_STAND_INS, ["0,1"], inject=Fault.HANG, inject_rank=0).inject_rank == 0
    with pytest.raises(UsageError, match="ranks 0-1"):
        build_config(CPU_STAND_INS, ["0,1", "2,3,4"], inject=Fault.CRASH, inject_rank=2)
    with pytest.raises(UsageError, match="needs --inject"):
        build_config(CPU_STAND_INS, ["0,1"], inject_rank=1)
    assert build_config(CPU_STAND_INS, ["0,1"]).inject_rank is None


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"steps": 0}, "--steps"),
        ({"batch_size": 0}, "--batch-size"),
        ({"lr": 0.0}, "--lr"),
        ({"timeout_s": -1}, "--timeout"),
        ({"model": "vgg16"}, "--model"),
        ({"inject": Fault.NAN, "steps": 1}, "--steps 2"),
    ],
)
def test_bad_numbers_and_names_are_usage_errors(kwargs, text):
    with pytest.raises(UsageError, match=text):
        build_config(CPU_STAND_INS, ["0,1"], **kwargs)


def test_visible_devices_maps_nvidia_smi_indices_for_the_ranks():
    c = build_config(EIGHT_GPU_BOX, ["5,6"])
    assert c.visible_devices((5, 6)) == "5,6"
    # The ranks get the ids the inventory holds for those indices (UUIDs on a live machine).
    narrowed = DeviceInventory("cuda", (2, 4, 6), ("GPU-c", "GPU-e", "GPU-g"))
    assert build_config(narrowed, ["2,6"]).visible_devices((2, 6)) == "GPU-c,GPU-g"
    assert build_config(CPU_STAND_INS, ["0,1"]).visible_devices((0, 1)) is None


def test_report_dir_and_input_are_carried():
    c = build_config(CPU_STAND_INS, ["0,1"], report_dir=Path("/tmp/r"), topology_input="sample:x")
    assert c.report_dir == Path("/tmp/r") and c.topology_input == "sample:x"


def test_missing_torch_is_exit_3_with_the_install_hint(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    with pytest.raises(UnavailableError) as err:
        devices.require_torch()
    assert err.value.exit_code == 3
    assert "gputopo[probe]" in err.value.hint


def test_cpu_inventory_needs_no_gpu():
    inv = devices.detect_devices("cpu")
    assert inv.device == "cpu" and inv.gpus == tuple(range(cfg.CPU_STAND_INS))


def test_inject_gpus_names_the_sets_that_get_the_fault():
    config = build_config(EIGHT_GPU_BOX, ["4,5,6,7", "6,7"], inject=Fault.CORRUPT, inject_gpus="5,6")
    assert config.inject_gpus == (5, 6) and config.inject_rank is None
    pairs = build_config(EIGHT_GPU_BOX, each_pair=True, inject=Fault.HANG, inject_gpus="5,6")
    assert pairs.inject_gpus == (5, 6)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"inject_gpus": "5,6"}, "needs --inject"),
        ({"inject": Fault.NAN, "inject_gpus": "5,6", "inject_rank": 0}, "both say where"),
        ({"inject": Fault.NAN, "inject_gpus": "0,5"}, "no probed set holds"),
        ({"inject": Fault.NAN, "inject_gpus": "5,x"}, "comma-separated"),
    ],
)
def test_inject_gpus_mistakes_are_usage_errors(kwargs, words):
    with pytest.raises(UsageError, match=words):
        build_config(EIGHT_GPU_BOX, ["4,5,6,7"], **kwargs)
    with pytest.raises(UsageError, match="no probed set holds"):
        build_config(EIGHT_GPU_BOX, each_pair=True, inject=Fault.NAN, inject_gpus="1,2,3")


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8", 8),
        ("1K", 1024),
        ("1k", 1024),
        ("256M", 256 << 20),
        ("1G", 1 << 30),
        ("1.5K", 1536),
        (" 64 ", 64),
    ],
)
def test_sizes_read_as_nccl_tests_reads_them(text, size):
    from gputopo.probe.plan.config import parse_size

    assert parse_size("-b", text) == size


@pytest.mark.parametrize("text", ["", "lots", "1T", "-8", "1KB", "K"])
def test_sizes_nccl_tests_would_refuse_are_usage_errors(text):
    from gputopo.probe.plan.config import parse_size

    with pytest.raises(UsageError, match="expected a size"):
        parse_size("--min-bytes", text)


def test_the_sweep_follows_min_max_and_factor_like_nccl_tests():
    from gputopo.probe.plan.config import sweep_sizes

    assert sweep_sizes(8, 1024, 2) == (8, 16, 32, 64, 128, 256, 512, 1024)
    assert sweep_sizes(8, 1000, 4) == (8, 32, 128, 512)
    assert sweep_sizes(10, 10, 2) == (8,)  # whole float32 elements
    inv = DeviceInventory("cpu", (0, 1))
    config = build_config(inv, ["0,1"], min_bytes=1 << 10, max_bytes=1 << 12, step_factor=2, iters=7)
    assert config.sweep_bytes == (1024, 2048, 4096) and config.iters == 7
    assert build_config(inv, ["0,1"]).sweep_bytes == (64 << 10, 256 << 10, 1 << 20, 4 << 20)
    # A bound alone keeps the sweep non-empty.
    assert build_config(inv, ["0,1"], min_bytes=64 << 20).sweep_bytes == (64 << 20,)
    assert build_config(inv, ["0,1"], max_bytes=1 << 10).sweep_bytes == (1 << 10,)


def test_sets_must_exist_in_the_input_topology():
    from gputopo.probe.plan.config import check_sets_in_topology

    check_sets_in_topology(((0, 1), (2, 3)), (0, 1, 2, 3), "sample:x")
    with pytest.raises(UsageError, match="no GPU5,7 on sample:x") as err:
        check_sets_in_topology(((0, 5), (7,)), (0, 1, 2, 3), "sample:x")
    assert err.value.hint == "GPUs there: 0-3"
