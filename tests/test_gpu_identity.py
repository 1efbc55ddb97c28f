"""The GPU identity rule (probe/identity.py): NVML indices for people, UUIDs for ranks, presets obeyed."""

from __future__ import annotations

import pytest

from gputopo.errors import UsageError
from gputopo.probe.plan.config import DeviceInventory, build_config
from gputopo.probe.plan.identity import (
    GpuIdentity,
    allowed_gpus,
    check_rank_device,
    check_requested,
    cuda_bus_id,
    parse_visible_devices,
    visible_devices,
)


def box(n: int = 8, names: tuple[str, ...] = (), **broken: str) -> list[GpuIdentity]:
    """n GPUs; ``broken`` maps ``gpuN`` to a reason it cannot be probed."""
    return [
        GpuIdentity(
            index=i,
            uuid=f"GPU-{i:04d}aaaa-0000",
            bus_id=f"00000000:{0x10 + i:02X}:00.0",
            name=names[i] if names else "NVIDIA H100",
            unavailable=broken.get(f"gpu{i}"),
        )
        for i in range(n)
    ]


def test_parse_visible_devices() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") == ()
    assert parse_visible_devices(" 4, 5 ,6") == ("4", "5", "6")
    assert parse_visible_devices("0,,1") == ("0",)  # CUDA stops at the first invalid entry


def test_without_a_preset_every_working_gpu_is_allowed() -> None:
    allowed = allowed_gpus(box(gpu3="failing: GPU is lost"), None)
    assert allowed.indices == (0, 1, 2, 4, 5, 6, 7)
    assert allowed.why_not == {3: "failing: GPU is lost"}


def test_preset_indices_keep_their_meaning_as_nvidia_smi_indices() -> None:
    # Slurm gave GPUs 4-7: --gpus 4,5 is allowed and means physical 4,5; 0,1 is refused.
    allowed = allowed_gpus(box(), "4,5,6,7")
    assert allowed.indices == (4, 5, 6, 7)
    check_requested([(4, 5)], allowed)
    with pytest.raises(UsageError) as err:
        check_requested([(0, 1)], allowed)
    assert "GPU0 cannot be probed: not in CUDA_VISIBLE_DEVICES=4,5,6,7" in err.value.message
    assert "4,5,6,7" in err.value.hint and err.value.exit_code == 2


def test_preset_uuids_and_prefixes() -> None:
    allowed = allowed_gpus(box(), "GPU-0006aaaa-0000,GPU-0002")
    assert allowed.indices == (2, 6)


def test_cuda_indices_skip_gpus_cuda_cannot_open() -> None:
    gpus = box()
    gpus[1] = GpuIdentity(1, None, None, unavailable="not accessible: Insufficient Permissions")
    # CUDA's device 1 is the next GPU it can open: nvidia-smi's GPU2.
    assert allowed_gpus(gpus, "1", "PCI_BUS_ID").indices == (2,)


def test_cuda_indices_are_refused_while_a_gpu_cannot_be_read() -> None:
    gpus = box()
    gpus[3] = GpuIdentity(3, None, None, unavailable="failing: GPU is lost")
    with pytest.raises(UsageError, match="numbering is uncertain while GPU3 cannot be read"):
        allowed_gpus(gpus, "4", "PCI_BUS_ID")
    assert allowed_gpus(gpus, "GPU-0004").indices == (4,)  # UUIDs need no numbering


def test_cuda_indices_follow_pci_order_not_nvml_listing_order() -> None:
    gpus = box(2)
    swapped = [
        GpuIdentity(0, gpus[0].uuid, "00000000:90:00.0", "NVIDIA H100"),
        GpuIdentity(1, gpus[1].uuid, "00000000:10:00.0", "NVIDIA H100"),
    ]
    assert allowed_gpus(swapped, "0", "PCI_BUS_ID").indices == (1,)


@pytest.mark.parametrize(
    "preset, order, words",
    [
        ("0,1", None, "mixed GPU models"),
        ("GPU-9999", "PCI_BUS_ID", "no GPU with UUID GPU-9999"),
        ("GPU-000", "PCI_BUS_ID", "more than one GPU"),
        ("12", "PCI_BUS_ID", "no CUDA device 12"),
        ("MIG-abc", "PCI_BUS_ID", "no MIG device MIG-abc"),
        ("gpu0", "PCI_BUS_ID", "not a GPU index, UUID or MIG id"),
    ],
)
def test_presets_that_cannot_be_resolved_are_usage_errors(preset, order, words) -> None:
    mixed = box(2, names=("NVIDIA H100", "NVIDIA L40S"))
    with pytest.raises(UsageError, match=words):
        allowed_gpus(mixed, preset, order)


def test_integer_presets_on_a_mixed_box_are_fine_in_pci_order() -> None:
    mixed = box(2, names=("NVIDIA H100", "NVIDIA L40S"))
    assert allowed_gpus(mixed, "1", "PCI_BUS_ID").indices == (1,)


def test_integer_presets_with_mig_gpus_are_refused() -> None:
    gpus = box(2)
    gpus[1] = GpuIdentity(1, gpus[1].uuid, gpus[1].bus_id, mig_enabled=True, mig_devices=("MIG-x1",))
    with pytest.raises(UsageError, match="MIG-enabled"):
        allowed_gpus(gpus, "0", "PCI_BUS_ID")
    # A MIG id names a MIG device: nothing NCCL can probe, so nothing is allowed by it.
    assert allowed_gpus(gpus, "MIG-x1").indices == ()


def test_legacy_mig_entries_are_skipped_not_fatal() -> None:
    # Drivers before R470 spell a MIG device MIG-GPU-<GPU uuid>/<GPU instance>/<compute instance>.
    gpus = box(3)
    gpus[1] = GpuIdentity(1, gpus[1].uuid, gpus[1].bus_id, mig_enabled=True, mig_devices=("MIG-x1",))
    preset = f"MIG-{gpus[1].uuid}/1/0,GPU-0002"
    allowed = allowed_gpus(gpus, preset)
    assert allowed.indices == (2,)
    assert allowed.why_not[0] == f"not in CUDA_VISIBLE_DEVICES={preset}"
    assert allowed_gpus(gpus, f"MIG-{gpus[1].uuid}/2/0").indices == ()
    with pytest.raises(UsageError, match="no MIG device"):  # a malformed one is still refused
        allowed_gpus(gpus, f"MIG-{gpus[1].uuid}/x")


def test_ranks_see_uuids_in_the_sets_order() -> None:
    assert visible_devices(box(), (6, 2)) == "GPU-0006aaaa-0000,GPU-0002aaaa-0000"


def test_build_config_refuses_a_gpu_outside_the_preset_naming_the_allowed_ones() -> None:
    gpus = box()
    allowed = allowed_gpus(gpus, "4,5,6,7")
    inv = DeviceInventory(
        "cuda",
        allowed.indices,
        tuple(g.uuid or "" for g in gpus if g.index in allowed.indices),
        identities=tuple(gpus),
        why_not=allowed.why_not,
    )
    c = build_config(inv, ["4,5"])
    assert c.visible_devices((4, 5)) == "GPU-0004aaaa-0000,GPU-0005aaaa-0000"
    assert inv.bus_id(5) == "00000000:15:00.0"
    with pytest.raises(UsageError, match="GPU1 cannot be probed"):
        build_config(inv, ["1,4"])


def test_rank_device_check() -> None:
    assert cuda_bus_id(0, 0x3B, 0) == "00000000:3B:00.0"
    check_rank_device(0, 5, "00000000:3B:00.0", "00000000:3b:00.0")
    check_rank_device(0, 5, None, "00000000:3B:00.0")  # nothing known: nothing to compare
    with pytest.raises(RuntimeError, match="GPU identity mismatch: local rank 1 should drive GPU5"):
        check_rank_device(1, 5, "00000000:3B:00.0", "00000000:5E:00.0")


# A workstation where NVML lists an old display card first, one the installed CUDA release no longer
# drives (issue 22 item 9: "an old display card under CUDA 12"), so CUDA numbers only the two A100s.
# nvidia-smi: GPU0 = the display card, GPU1 and GPU2 = the A100s; CUDA: device 0 and 1 = the A100s.
WORKSTATION = [
    GpuIdentity(0, "GPU-0000dddd-0000", "00000000:02:00.0", "Quadro K2000"),
    GpuIdentity(1, "GPU-0001aaaa-0000", "00000000:3B:00.0", "NVIDIA A100-PCIE-40GB"),
    GpuIdentity(2, "GPU-0002aaaa-0000", "00000000:86:00.0", "NVIDIA A100-PCIE-40GB"),
]


def test_integer_presets_are_resolved_by_cudas_own_answer_when_cuda_skips_a_display_gpu() -> None:
    # What `python -m gputopo.probe.ranks.cuda` answers under CUDA_VISIBLE_DEVICES=0 / =1 / =0,1.
    assert allowed_gpus(WORKSTATION, "0", "PCI_BUS_ID", ("00000000:3B:00.0",)).indices == (1,)
    assert allowed_gpus(WORKSTATION, "1", None, ("00000000:86:00.0",)).indices == (2,)
    both = allowed_gpus(WORKSTATION, "1,0", None, ("00000000:86:00.0", "00000000:3B:00.0"))
    assert both.indices == (1, 2) and both.note is None
    assert both.why_not[0] == "not in CUDA_VISIBLE_DEVICES=1,0"
    # A 4-digit PCI domain (as some tools print it) is the same address.
    assert allowed_gpus(WORKSTATION, "0", None, ("0000:3B:00.0",)).indices == (1,)
    # NVML's numbering alone would have named the display card.
    assert allowed_gpus(WORKSTATION, "0", "PCI_BUS_ID").indices == (0,)


def test_an_entry_cuda_has_no_device_for_is_refused() -> None:
    # CUDA stops at the first entry it cannot use: "0,5" gives it one device.
    with pytest.raises(UsageError, match="CUDA has no device for entry '5' \\(it sees 1"):
        allowed_gpus(WORKSTATION, "0,5", None, ("00000000:3B:00.0",))
    with pytest.raises(UsageError, match="is at PCI 00000000:AF:00.0, which NVML does not list"):
        allowed_gpus(WORKSTATION, "0", None, ("00000000:AF:00.0",))


def test_without_cudas_answer_integers_fall_back_to_nvml_numbering_and_say_so() -> None:
    allowed = allowed_gpus(box(), "4,5", None, None, "torch is not installed")
    assert allowed.indices == (4, 5)
    assert allowed.note is not None and allowed.note.startswith(
        "CUDA could not be asked how it numbers its devices (torch is not installed)"
    )
    # UUIDs need no numbering, so nothing is said.
    assert allowed_gpus(box(), "GPU-0004", None, None, "torch is not installed").note is None


def test_the_cuda_child_answers_with_this_machines_devices() -> None:
    pytest.importorskip("torch")
    import os

    from gputopo.probe.pool.launch import ask_cuda_bus_ids

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    bus_ids, why = ask_cuda_bus_ids(env)
    assert bus_ids is not None, why  # a CPU-only machine: CUDA answers with no device at all
    assert all(len(b.split(":")) == 3 for b in bus_ids) and len(bus_ids) <= 1
    assert ask_cuda_bus_ids(env, timeout_s=0.001) == (None, "CUDA did not answer within 0.001 s")
