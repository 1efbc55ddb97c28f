"""On GPUs the per-GPU check times every GPU at once: each rank builds its inputs (seeded on the CPU, a
second or more for an 8192-square pair) before the barrier, so the barrier releases ranks that are ready
to run and "all GPUs together" is what is timed. No GPU here: the CUDA branch runs with its device calls
recorded instead of made."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from gputopo.probe.ranks import pergpu  # noqa: E402


def test_the_inputs_are_built_before_the_barrier_and_handed_to_the_timed_work(monkeypatch):
    calls: list[str] = []
    built = object()

    def operands(device, sizes, dtype, seed):
        calls.append("operands")
        return built

    def measure_device(ctx, sizes, precision, dtype, slowed, sdc, ops=None):
        calls.append("measure" if ops is built else "measure without the built inputs")
        return {"matmul_tflops": 1.0, "memory_gbps": 1.0, "runs": {}}

    monkeypatch.setattr(pergpu, "operands", operands)
    monkeypatch.setattr(pergpu, "measure_device", measure_device)
    monkeypatch.setattr(pergpu, "wait_for_others", lambda ctx, group: calls.append("barrier"))
    monkeypatch.setattr(pergpu, "one_at_a_time", lambda ctx, group, work: calls.append("host copies"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    gather = lambda rows, row, group=None: rows.__setitem__(0, row)  # noqa: E731
    monkeypatch.setattr(pergpu.dist, "all_gather_object", gather)
    ctx = SimpleNamespace(
        spec={"precision": "bf16", "gpus": [0], "seed": 0, "inject_ranks": []},
        rank=0,
        world=1,
        is_cuda=True,
        device=torch.device("cpu"),
        inject_rank=None,
        wait_group=None,
        fault=lambda kind, check: False,
        progress=lambda *a: None,
    )
    doc = pergpu.gpu_check(ctx)
    assert calls == ["operands", "barrier", "measure", "host copies"]
    assert doc["rows"][0]["name"] == "NVIDIA H100 80GB HBM3"
