"""The one door to NVML (``system/nvml.py``'s ``Session.query`` and ``Device``'s typed reads) on the Python
fake: every health signal read through it, the reason an unknown one is unknown kept, a GPU lost mid-read
failing only that GPU, and Xid events through the same door."""

from __future__ import annotations

import pynvml

from fake_nvml import FakeHealth, FakeNvml
from gputopo.health.judge import judge
from gputopo.health.readings import HealthSample
from gputopo.system import health_reads, nvml


def _sample(fake: FakeNvml) -> HealthSample:
    with fake.installed(), nvml.session() as s:
        gpus = tuple(health_reads.read_gpu_health(s, i) for i in range(s.device_count()))
    return HealthSample(gpus=gpus, taken_s=0.0)


def test_a_sound_box_reads_every_signal_through_the_door():
    fake = FakeNvml.nvswitch_box(health=True)
    sample = _sample(fake)
    g = sample.gpus[0]
    assert g.unknown == ()
    assert (g.ecc_enabled, g.remapped_rows_pending, g.persistence_mode) == (True, False, True)
    assert (g.temperature_c, g.power_w, g.power_limit_w, g.recovery_action) == (34, 71.0, 700.0, 0)
    assert (g.fabric_state, g.fabric_clique_id, g.fabric_health_mask) == (3, 7, 0)
    assert len(g.nvlinks) == 18 and g.nvlinks[0].crc_flit_errors == 0
    assert fake.calls["nvmlDeviceGetRemappedRows"] == 4  # once per GPU, through the typed backend
    assert fake.open_sessions == 0


def test_a_sick_gpu_is_judged_from_what_the_door_read():
    fake = FakeNvml.nvswitch_box(health=True)
    fake.gpus[2].health = FakeHealth(remapped_rows=(0, 1, 0, 1), fabric=(3, 0, 7, 0))
    result = judge(_sample(fake), _sample(fake))
    assert [(f.gpu, f.category) for f in result.findings if f.severity == "problem"] == [(2, "memory")]


def test_an_unknown_signal_keeps_nvmls_reason():
    fake = FakeNvml.nvswitch_box(health=True)
    fake.gpus[1].unsupported |= {"nvmlDeviceGetEccMode", "nvmlDeviceGetPowerUsage"}
    g = _sample(fake).gpus[1]
    unknown = {u.what: u.why for u in g.unknown}
    not_supported = str(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED))
    assert unknown["ECC mode"] == unknown["power draw"] == not_supported
    assert "ECC error counts" in unknown  # not asked when the mode did not answer
    assert g.temperature_c == 34  # the other signals are still read


def test_a_driver_without_the_health_functions_lists_them_as_not_checked():
    g = _sample(FakeNvml.nvswitch_box()).gpus[0]  # health=False: FUNCTION_NOT_FOUND for every health call
    whats = {u.what for u in g.unknown}
    assert {"ECC mode", "temperature", "power draw", "NVLink fabric state"} <= whats
    assert g.name == "NVIDIA H100 80GB HBM3"  # the inventory reads still answer


def test_a_gpu_lost_while_being_read_fails_only_that_gpu():
    fake = FakeNvml.nvswitch_box(health=True)
    fake.gpus[3].lost = True
    sample = _sample(fake)
    assert sample.gpus[3].error is not None and sample.gpus[3].state == "failing"
    assert all(g.error is None for g in sample.gpus[:3])


def test_xid_events_come_through_the_same_door():
    fake = FakeNvml.nvswitch_box(health=True)
    fake.gpus[1].health.xid_events = False
    with fake.installed(), nvml.session() as s:
        events = nvml.XidEventSet(s, [0, 1, 2])
        try:
            assert events.registered == [0, 2]
            assert events.skipped == {1: "the driver reports no Xid events for it"}
            fake.queue_xid(2, 79)
            assert events.wait(10) == (2, 79)
            assert events.wait(10) is None  # NVML's TIMEOUT: no event in time
        finally:
            events.close()
    assert fake.event_sets == {}
