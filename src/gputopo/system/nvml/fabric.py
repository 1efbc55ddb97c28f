"""Fabric and platform reads of one GPU: the NVLink fabric registration (NVSwitch systems, NVL racks)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from gputopo.system.nvml.answer import Answer, DeviceReads


class FabricReads(DeviceReads):
    """A GPU's place in the NVLink fabric, each an ``Answer``."""

    def fabric_info(self) -> Answer:
        """The GPU's NVLink fabric registration (NVSwitch and NVL systems) as a ``FabricInfo``: asked
        through ``nvmlDeviceGetGpuFabricInfoV`` (v2, with the health mask), else the v1 call."""
        import ctypes

        v1_type, v2_type, v2_version = _fabric_structs()
        v2 = v2_type(version=v2_version)
        answer = self._a("nvmlDeviceGetGpuFabricInfoV", ctypes.byref(v2))
        if answer.ok:
            return Answer(_fabric_of(v2, v2.healthMask))
        if self.session.missing(answer):
            v1 = v1_type()
            answer = self._a("nvmlDeviceGetGpuFabricInfo", ctypes.byref(v1))
            if answer.ok:
                return Answer(_fabric_of(v1, None))
        return answer


@dataclass(frozen=True)
class FabricInfo:
    """A GPU's fabric registration: ``state`` (``NVML_GPU_FABRIC_STATE_*``), ``status`` (an
    ``nvmlReturn_t``), its clique and (v2 only) the health mask."""

    state: int
    status: int
    clique_id: int
    health_mask: int | None


def _fabric_of(info: Any, mask: Any) -> FabricInfo:
    return FabricInfo(
        int(info.state), int(info.status), int(info.cliqueId), int(mask) if mask is not None else None
    )


@functools.cache
def _fabric_structs() -> tuple[Any, Any, int]:
    """The fabric info structs as nvml.h lays them out, ours rather than the bindings': nvidia-ml-py 12.535
    declares the v1 struct with an 80-byte clusterUuid (the device UUID buffer size), where nvml.h has 16
    (NVML_GPU_FABRIC_UUID_LEN), so every field after it would be read from the wrong place. Built on first
    use, so that importing this module does not import ctypes. Returns (v1, v2, the v2 version word)."""
    import ctypes

    class FabricInfoV1(ctypes.Structure):
        _fields_ = [
            ("clusterUuid", ctypes.c_uint8 * 16),
            ("status", ctypes.c_int),
            ("cliqueId", ctypes.c_uint32),  # "partitionId" in r525-r535's nvml.h: the same field
            ("state", ctypes.c_uint32),
        ]

    class FabricInfoV2(ctypes.Structure):
        _fields_ = [
            ("version", ctypes.c_uint32),
            ("clusterUuid", ctypes.c_uint8 * 16),
            ("status", ctypes.c_int),
            ("cliqueId", ctypes.c_uint32),
            ("state", ctypes.c_uint32),
            ("healthMask", ctypes.c_uint32),
        ]

    # nvmlGpuFabricInfo_v2 = NVML_STRUCT_VERSION(GpuFabricInfo, 2): the struct's size | 2 << 24 (nvml.h).
    return FabricInfoV1, FabricInfoV2, ctypes.sizeof(FabricInfoV2) | 2 << 24
