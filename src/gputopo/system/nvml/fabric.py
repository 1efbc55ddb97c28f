"""Fabric and platform reads of one GPU: the NVLink fabric registration (NVSwitch systems, NVL racks), the
platform's place for the GPU (rack chassis, slot, tray), and the C2C mode (Grace: GPU and CPU joined by
NVLink-C2C).

The structs are ours, laid out as nvml.h lays them out (NVIDIA/go-nvml pkg/nvml/nvml.h, r580:
``nvmlGpuFabricInfo_t``, ``_v2_t``, ``_v3_t``, ``nvmlPlatformInfo_v2_t``, ``nvmlC2cModeInfo_v1_t``; the
v4 struct and ``nvmlGpuFabricClique_v1_t`` as nvidia-ml-py 13.615's pynvml.py declares them, NVML v615's
release notes: "Added nvmlDeviceGetGpuFabricInfo_v4() to retrieve per-type fabric clique assignments").
The oldest nvidia-ml-py gputopo allows (12.535.77) has no v3/v4 struct, no platform or C2C call: each read
it lacks answers "not supported" (``NOT_IN_BINDINGS``), never an error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

from gputopo.system.nvml.answer import Answer, DeviceReads

# nvmlReturn_t NVML_ERROR_ARGUMENT_VERSION_MISMATCH (nvml.h): a driver older than the struct's version.
_VERSION_MISMATCH = 25


@dataclass(frozen=True)
class FabricInfo:
    """A GPU's fabric registration: ``state`` (``NVML_GPU_FABRIC_STATE_*``), ``status`` (an
    ``nvmlReturn_t``, meaningful once the state is completed), its clique, and what newer structs add:
    ``health_mask`` (v2), ``health_summary`` (v3, ``NVML_GPU_FABRIC_HEALTH_SUMMARY_*``),
    ``cluster_uuid`` (the 16 bytes in the canonical 8-4-4-4-12 form), ``cliques`` (v4: ``(type, id)``
    per clique type). ``version`` says which struct the driver answered (1-3)."""

    state: int
    status: int
    clique_id: int
    health_mask: int | None
    cluster_uuid: str | None = None
    health_summary: int | None = None
    cliques: tuple[tuple[int, int], ...] | None = None
    version: int = 1


@dataclass(frozen=True)
class PlatformInfo:
    """Where the platform places the GPU (``nvmlPlatformInfo_v2_t``, Blackwell and later): the rack's
    chassis serial number (``None`` when empty, as on an HGX board), the slot in the chassis (switch trays
    included), the compute tray index (switch trays not counted), the host within the tray, the NVLink
    peer type (nvml.h names no values; nvidia-smi prints e.g. "Switch Connected") and the module id."""

    chassis_serial: str | None
    slot_number: int
    tray_index: int
    host_id: int
    peer_type: int
    module_id: int


def uuid_text(raw: Any) -> str | None:
    """NVML's 16-byte cluster UUID as ``xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (lower case, the form
    nvidia-smi prints and GPU feature discovery puts in ``nvidia.com/gpu.clique``)."""
    data = bytes(raw)[:16]
    if len(data) != 16:
        return None
    h = data.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _serial(raw: Any) -> str | None:
    # nvml.h: 13 bytes on Blackwell, the rest zero; an HGX board leaves it empty.
    text = bytes(raw).split(b"\x00", 1)[0].decode("ascii", errors="replace").strip()
    return text or None


class FabricReads(DeviceReads):
    """A GPU's place in the NVLink fabric and the rack, each an ``Answer``."""

    def fabric_info(self) -> Answer:
        """The GPU's NVLink fabric registration as a ``FabricInfo``: ``nvmlDeviceGetGpuFabricInfoV`` with
        the v3 struct (health summary), a driver that answers ARGUMENT_VERSION_MISMATCH again with v2
        (health mask), a driver or bindings without the versioned call the v1 call; then the v4 clique
        list where the driver has ``nvmlDeviceGetGpuFabricInfo_v4``."""
        import ctypes

        s = _structs()
        info = None
        for struct, version in ((s.v3, 3), (s.v2, 2)):
            value = struct(version=ctypes.sizeof(struct) | version << 24)  # NVML_STRUCT_VERSION (nvml.h)
            answer = self._a("nvmlDeviceGetGpuFabricInfoV", ctypes.byref(value))
            if answer.ok:
                summary = int(value.healthSummary) if version == 3 else None
                info = _fabric_of(value, int(value.healthMask), summary, version)
                break
            if answer.code != _VERSION_MISMATCH:
                break
        if info is None:
            if not self.session.missing(answer):
                return answer
            v1 = s.v1()
            answer = self._a("nvmlDeviceGetGpuFabricInfo", ctypes.byref(v1))
            if not answer.ok:
                return answer
            info = _fabric_of(v1, None, None, 1)
        v4 = s.v4()
        if self._a("nvmlDeviceGetGpuFabricInfo_v4", ctypes.byref(v4)).ok:
            count = min(int(v4.numCliques), len(v4.cliques))
            cliques = tuple((int(c.type), int(c.id)) for c in v4.cliques[:count])
            info = replace(info, cliques=cliques)
        return Answer(info)

    def platform_info(self) -> Answer:
        """The platform's place for the GPU as a ``PlatformInfo`` (``nvmlDeviceGetPlatformInfo``, v2
        struct; Blackwell and later). NOT_SUPPORTED on older GPUs; missing in older bindings."""
        import ctypes

        value = _structs().platform(version=ctypes.sizeof(_structs().platform) | 2 << 24)
        answer = self._a("nvmlDeviceGetPlatformInfo", ctypes.byref(value))
        if not answer.ok:
            return answer
        return Answer(
            PlatformInfo(
                chassis_serial=_serial(value.chassisSerialNumber),
                slot_number=int(value.slotNumber),
                tray_index=int(value.trayIndex),
                host_id=int(value.hostId),
                peer_type=int(value.peerType),
                module_id=int(value.moduleId),
            )
        )

    def c2c_enabled(self) -> Answer:
        """Whether NVLink-C2C joins the GPU to its CPU (``nvmlDeviceGetC2cModeInfoV``: Grace Hopper and
        Grace Blackwell); NOT_SUPPORTED elsewhere. pynvml's wrapper returns ``nvmlC2cModeInfo_v1_t``."""
        return self._a("nvmlDeviceGetC2cModeInfoV").then(lambda info: bool(int(info.isC2cEnabled)))


def _fabric_of(info: Any, mask: int | None, summary: int | None, version: int) -> FabricInfo:
    return FabricInfo(
        state=int(info.state),
        status=int(info.status),
        clique_id=int(info.cliqueId),
        health_mask=mask,
        cluster_uuid=uuid_text(info.clusterUuid),
        health_summary=summary,
        version=version,
    )


@dataclass(frozen=True)
class _Structs:
    v1: Any
    v2: Any
    v3: Any
    v4: Any
    platform: Any


@functools.cache
def _structs() -> _Structs:
    """The structs as nvml.h lays them out, ours rather than the bindings': nvidia-ml-py 12.535 declares
    the v1 fabric struct with an 80-byte clusterUuid (the device UUID buffer size) where nvml.h has 16
    (NVML_GPU_FABRIC_UUID_LEN), so every field after it would be read from the wrong place. Built on first
    use, so that importing this module does not import ctypes."""
    import ctypes

    u8, u32, uuid = ctypes.c_uint8, ctypes.c_uint32, ctypes.c_uint8 * 16
    # nvmlGpuFabricState_t is an unsigned char in nvml.h; the uint that follows it aligns to 4 bytes.
    head = [("clusterUuid", uuid), ("status", ctypes.c_int), ("cliqueId", u32), ("state", u8)]

    class FabricInfoV1(ctypes.Structure):
        _fields_ = head

    class FabricInfoV2(ctypes.Structure):  # 36 bytes: nvmlGpuFabricInfo_v2 = 0x02000024
        _fields_ = [("version", ctypes.c_uint), *head, ("healthMask", u32)]

    class FabricInfoV3(ctypes.Structure):  # 40 bytes: nvmlGpuFabricInfo_v3 = 0x03000028
        _fields_ = [("version", ctypes.c_uint), *head, ("healthMask", u32), ("healthSummary", u8)]

    class FabricClique(ctypes.Structure):  # nvmlGpuFabricClique_v1_t
        _fields_ = [("type", u8), ("id", u32)]

    class FabricInfoV4(ctypes.Structure):  # no version word: the function name carries the version
        _fields_ = [
            ("clusterUuid", uuid),
            ("status", ctypes.c_int),
            ("cliques", FabricClique * 64),  # NVML_GPU_FABRIC_CLIQUE_MAX
            ("numCliques", u32),
            ("state", u8),
            ("healthMask", u32),
            ("healthSummary", u8),
        ]

    class PlatformInfoV2(ctypes.Structure):  # 44 bytes: nvmlPlatformInfo_v2 = 0x0200002c
        _fields_ = [
            ("version", ctypes.c_uint),
            ("ibGuid", u8 * 16),
            ("chassisSerialNumber", u8 * 16),
            ("slotNumber", u8),
            ("trayIndex", u8),
            ("hostId", u8),
            ("peerType", u8),
            ("moduleId", u8),
        ]

    return _Structs(FabricInfoV1, FabricInfoV2, FabricInfoV3, FabricInfoV4, PlatformInfoV2)
