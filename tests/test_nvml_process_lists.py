"""NVML's process lists as kill-stale reads them: compute, graphics and MPS clients per GPU, NVML's names,
and a list NVML refused kept unknown (not empty). The fake NVML answers with pynvml's own errors."""

from __future__ import annotations

from typing import Any

import pynvml

from fake_nvml import FakeHandle, FakeNvml
from gputopo.system.inventory import ProcessListing, process_listing


class ProcessFake(FakeNvml):
    """The fake NVML plus MPS client lists, process names, and per-list errors.

    ``mps`` maps a GPU to its MPS clients; ``names`` a pid to NVML's name; ``errors`` maps
    ``(gpu, pynvml function name)`` to the ``NVML_ERROR_*`` code that list fails with.
    """

    def __init__(self, base: FakeNvml, mps=None, names=None, errors=None, mps_api: bool = True) -> None:  # type: ignore[no-untyped-def]
        self.__dict__.update(base.__dict__)
        self.mps = mps or {}
        self.names = names or {}
        self.errors = errors or {}
        self.mps_api = mps_api

    def _fail(self, handle: FakeHandle, fn: str) -> None:
        code = self.errors.get((handle.index, fn))
        if code is not None:
            raise pynvml.NVMLError(code)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        self._fail(handle, "compute")
        return super().nvmlDeviceGetComputeRunningProcesses(handle)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        self._fail(handle, "graphics")
        return super().nvmlDeviceGetGraphicsRunningProcesses(handle)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        if not self.mps_api:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        self._fail(handle, "mps")
        return self._procs(self.mps, handle, "nvmlDeviceGetMPSComputeRunningProcesses")

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        if pid not in self.names:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return self.names[pid]


def test_lists_compute_graphics_and_mps_clients_with_names() -> None:
    base = FakeNvml.pcie_box(processes={0: [(100, 500)]}, graphics_processes={1: [(200, 20)]})
    fake = ProcessFake(base, mps={2: [(300, None)]}, names={100: "python", 300: "/usr/bin/python3"})
    with fake.installed():
        got = process_listing()
    assert got == ProcessListing(
        ((100, 0, 500, "compute"), (200, 1, 20, "graphics"), (300, 2, None, "mps")),
        {},
        {100: "python", 200: None, 300: "/usr/bin/python3"},
    )
    assert fake.open_sessions == 0


def test_a_refused_list_is_unknown_not_empty() -> None:
    # A MIG GPU without the privilege to list its processes; GPU 3's graphics list is simply unsupported.
    base = FakeNvml.pcie_box(processes={0: [(100, 500)], 1: [(101, 10)]})
    fake = ProcessFake(
        base,
        errors={
            (1, "compute"): pynvml.NVML_ERROR_NO_PERMISSION,
            (3, "graphics"): pynvml.NVML_ERROR_NOT_SUPPORTED,
            (4, "mps"): pynvml.NVML_ERROR_NO_PERMISSION,
        },
    )
    with fake.installed():
        got = process_listing()
    assert got is not None
    assert set(got.refused) == {1, 4}
    assert "compute list" in got.refused[1] and "mps list" in got.refused[4]
    assert [(e[0], e[1]) for e in got.entries] == [(100, 0)]


def test_a_lost_gpu_is_unknown_and_the_others_are_read() -> None:
    fake = ProcessFake(FakeNvml.lost_gpu_box(processes={5: [(1, 10)], 6: [(2, 20)]}))
    with fake.installed():
        got = process_listing()
    assert got is not None and 5 in got.refused and [(e[0], e[1]) for e in got.entries] == [(2, 6)]


def test_a_driver_without_the_mps_query_or_the_v3_struct() -> None:
    base = FakeNvml.nvlink_box(process_api_v3=False, processes={1: [(4242, 1024)]})
    with ProcessFake(base, mps_api=False).installed():
        got = process_listing()
    assert got is not None and got.refused == {} and got.entries == ((4242, 1, 1024, "compute"),)


def test_without_nvml_there_is_no_listing() -> None:
    with FakeNvml.no_driver().installed():
        assert process_listing() is None
