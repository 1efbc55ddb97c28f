"""What the driver told us about each GPU's health, at one moment (pure data, no NVML here).

``system/health_reads.py`` fills these from NVML; tests build them by hand. Every value is optional: ``None``
means unknown, and ``GpuHealth.unknown`` says why for each signal that could not be read (the driver lacks
the function, the GPU does not support it, or permission was refused). Unknown is never healthy and never a
fault: the judge lists it as not checked.

Numeric codes are NVML's, so a reader can look them up: the clocks event reason bits
(``nvmlClocksEventReason*``), the recovery action (``NVML_GPU_RECOVERY_ACTION_*``), the fabric state
(``NVML_GPU_FABRIC_STATE_*``) and fabric status (an ``nvmlReturn_t``). Counters are NVML's totals: the
judge compares two samples to see how they move.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

RemoteKind = Literal["gpu", "switch", "cpu"]


@dataclass(frozen=True)
class Unknown:
    """A signal that could not be read: ``what`` (``remapped rows``), ``why`` (NVML's words, e.g.
    ``Not Supported``, ``Function Not Found``, ``Insufficient Permissions``)."""

    what: str
    why: str


@dataclass(frozen=True)
class NvlinkHealth:
    """One NVLink of a GPU: whether it is up, what is on the far end, and its error counters (totals since
    the driver loaded or the counters were reset; ``None`` where NVML has no such counter)."""

    link: int
    up: bool | None
    remote_kind: RemoteKind | None = None
    remote_bus_id: str | None = None
    replay_errors: int | None = None
    recovery_errors: int | None = None
    crc_flit_errors: int | None = None
    crc_data_errors: int | None = None
    # NVLink5 (Blackwell) error counters of this link, as (NVML field id, total) pairs; ``None`` where the
    # GPU has none (before NVLink5 every one answers NOT_SUPPORTED). Names in ``NVLINK5_COUNTERS``.
    nvl5: tuple[tuple[int, int], ...] | None = None


# NVLink5 error counters (NVML field ids, read scoped to each link) that DCGM 4.6's MonitorNVLink5Fields and
# MonitorNVLinkErrorFields fail on when they rise by DCGM_LIMIT_MAX_NVLINK_ERROR (1): the fields DCGM's
# compatibility names map to (dcgm_fields.h: DCGM_FI_DEV_NVLINK_COUNT_RX_MALFORMED_PACKET_ERRORS ->
# ..._RX_PACKET_MALFORMED_TOTAL, ...). The raw BER fields (220, 222) are encoded mantissa/exponent values:
# not judged here.
NVLINK5_COUNTERS = {
    206: "malformed packet",
    207: "buffer overrun (dropped packet)",
    208: "receive",
    209: "remote receive",
    210: "general receive",
    211: "link integrity",
    214: "failed link recovery",
    215: "link recovery",
    219: "effective",
    221: "symbol",
}

# The NVLink fields read for the whole GPU (nvml.h): NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_TOTAL (160,
# "total for all links"; DCGM_FI_DEV_NVLINK_ECC_ERROR_TOTAL), NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_BER (220)
# and NVML_FI_DEV_NVLINK_COUNT_SYMBOL_BER (222; DCGM_FI_DEV_NVLINK_EFFECTIVE_BER_RAW and _SYMBOL_BER_RAW).
FIELD_NVLINK_ECC_DATA_TOTAL = 160
FIELD_NVLINK_EFFECTIVE_BER = 220
FIELD_NVLINK_SYMBOL_BER = 222
# nvmlFieldValue_t.scopeId for the NVLink5 aggregate over every link (DCGM DcgmCacheManager.cpp,
# "NVLink5+ requires scopeId = UINT_MAX for aggregate data"; NvmlFieldRequiresNvLinkAggregate).
SCOPE_ALL_LINKS = 0xFFFFFFFF


def ber_parts(raw: int) -> tuple[int, int]:
    """NVML's encoded BER as (mantissa, exponent): the value is mantissa * 10^-exponent, mantissa in bits
    8-11 and exponent in bits 0-7 (nvml.h NVML_NVLINK_BER_MANTISSA_* / _EXP_*; DCGM NvmlBerParser)."""
    return (raw >> 8) & 0xF, raw & 0xFF


def ber_words(raw: int) -> str:
    """``0x50b`` -> ``5e-11``."""
    mantissa, exponent = ber_parts(raw)
    return f"{mantissa}e-{exponent}"


# The NVLink counters the judge follows, by attribute name and the words a finding uses.
NVLINK_COUNTERS = {
    "replay_errors": "replay",
    "recovery_errors": "recovery",
    "crc_flit_errors": "CRC flit",
    "crc_data_errors": "CRC data",
}


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's health values at one moment. ``error`` is set when the GPU could not be read at all
    (lost, refused, not responding); then every value is ``None``.

    ECC counts are NVML's "total" counts: volatile since the driver loaded, aggregate over the GPU's life.
    Retired pages and pending retirement are pre-Ampere page retirement; remapped rows are Ampere and later.
    ``clocks_event_reasons`` is NVML's bitmask (``nvmlDeviceGetCurrentClocksEventReasons``, or
    ``...ClocksThrottleReasons`` on older drivers). Power is in watts (NVML reports milliwatts).
    """

    index: int
    pci_bus_id: str | None = None
    uuid: str | None = None
    name: str | None = None
    error: str | None = None
    state: str | None = None
    vbios_version: str | None = None
    serial: str | None = None  # the board serial (nvmlDeviceGetSerial), or None where not read
    ecc_enabled: bool | None = None
    ecc_pending_enabled: bool | None = None
    ecc_volatile_corrected: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    memory_unrepairable: bool | None = None
    clocks_event_reasons: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    pcie_replays: int | None = None
    utilization_pct: int | None = None
    persistence_mode: bool | None = None
    mig_enabled: bool | None = None
    recovery_action: int | None = None
    fabric_state: int | None = None
    fabric_status: int | None = None
    fabric_clique_id: int | None = None
    fabric_health_mask: int | None = None
    fabric_health_summary: int | None = None
    fabric_cluster_uuid: str | None = None
    platform_chassis_serial: str | None = None
    platform_tray_index: int | None = None
    nvlinks: tuple[NvlinkHealth, ...] | None = None
    # The GPU's NVLink totals and levels DCGM 4.6 MonitorNVLink5Fields judges beside the per-link counters:
    # the NVLink ECC data error total of every link (NVML field 160, a counter), and the effective and
    # symbol BER of the links together (fields 220 and 222, read with scopeId UINT_MAX as DCGM reads them
    # on NVLink5, levels in NVML's mantissa/exponent encoding). ``None``: the driver lacks it.
    nvlink_ecc_data_errors: int | None = None
    nvlink_effective_ber_raw: int | None = None
    nvlink_symbol_ber_raw: int | None = None
    unknown: tuple[Unknown, ...] = ()

    @property
    def label(self) -> str:
        """``GPU<index>``, as every other gputopo output names a GPU."""
        return f"GPU{self.index}"

    def to_json(self) -> dict[str, Any]:
        """The values as ``check --json`` shows them under ``health`` (unknown as ``null``)."""
        doc = asdict(self)
        for key in ("index", "pci_bus_id", "uuid", "name"):
            doc.pop(key)
        doc["unknown"] = [asdict(u) for u in self.unknown]
        return doc


@dataclass(frozen=True)
class HealthSample:
    """Every GPU's health at one moment. ``taken_s`` is a monotonic clock reading (seconds), used only to
    measure the window between two samples; ``unknown`` holds what could not be read for the node."""

    gpus: tuple[GpuHealth, ...]
    taken_s: float
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    unknown: tuple[Unknown, ...] = field(default=())

    def gpu(self, index: int) -> GpuHealth | None:
        """The GPU with nvidia-smi index ``index``, or ``None`` when this sample lacks it."""
        for g in self.gpus:
            if g.index == index:
                return g
        return None


# ``Unknown.what`` of a GPU that was not read at all (the time budget ran out first, or its read failed).
NOT_READ = "every health value"
# Why a GPU was not read: the check's time budget was spent first.
BUDGET_SPENT = "the time budget ran out before it was read"

# NVML's clocks event reason bits (pynvml: nvmlClocksEventReason* = nvmlClocksThrottleReason*, same values).
CLOCKS_GPU_IDLE = 0x1
CLOCKS_APPLICATIONS_SETTING = 0x2
CLOCKS_SW_POWER_CAP = 0x4
CLOCKS_HW_SLOWDOWN = 0x8
CLOCKS_SYNC_BOOST = 0x10
CLOCKS_SW_THERMAL = 0x20
CLOCKS_HW_THERMAL = 0x40
CLOCKS_HW_POWER_BRAKE = 0x80
CLOCKS_DISPLAY_SETTING = 0x100

# NVML_GPU_RECOVERY_ACTION_* (field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230, r570+), in the words of
# nvml.h's nvmlDeviceGpuRecoveryAction_t; 5-7 are newer (pynvml 13).
RECOVERY_NONE = 0
RECOVERY_ACTIONS = {
    0: "none",
    1: "GPU reset",
    2: "node reboot",
    3: "drain P2P",
    4: "drain and reset",
    5: "recover IMEX domain",
    6: "bus reset",
    7: "system reboot",
}
FIELD_GPU_RECOVERY_ACTION = 230

# NVML_GPU_FABRIC_STATE_* (nvmlDeviceGetGpuFabricInfo / ...InfoV).
FABRIC_NOT_SUPPORTED = 0
FABRIC_NOT_STARTED = 1
FABRIC_IN_PROGRESS = 2
FABRIC_COMPLETED = 3
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
# nvmlReturn_t (nvml.h), by name: what a fabric registration that completed with an error says.
NVML_RETURN_NAMES = {
    0: "SUCCESS", 1: "ERROR_UNINITIALIZED", 2: "ERROR_INVALID_ARGUMENT", 3: "ERROR_NOT_SUPPORTED",
    4: "ERROR_NO_PERMISSION", 5: "ERROR_ALREADY_INITIALIZED", 6: "ERROR_NOT_FOUND",
    7: "ERROR_INSUFFICIENT_SIZE", 8: "ERROR_INSUFFICIENT_POWER", 9: "ERROR_DRIVER_NOT_LOADED",
    10: "ERROR_TIMEOUT", 11: "ERROR_IRQ_ISSUE", 12: "ERROR_LIBRARY_NOT_FOUND", 13: "ERROR_FUNCTION_NOT_FOUND",
    14: "ERROR_CORRUPTED_INFOROM", 15: "ERROR_GPU_IS_LOST", 16: "ERROR_RESET_REQUIRED",
    17: "ERROR_OPERATING_SYSTEM", 18: "ERROR_LIB_RM_VERSION_MISMATCH", 19: "ERROR_IN_USE", 20: "ERROR_MEMORY",
    21: "ERROR_NO_DATA", 22: "ERROR_VGPU_ECC_NOT_SUPPORTED", 23: "ERROR_INSUFFICIENT_RESOURCES",
    24: "ERROR_FREQ_NOT_SUPPORTED", 25: "ERROR_ARGUMENT_VERSION_MISMATCH", 26: "ERROR_DEPRECATED",
    27: "ERROR_NOT_READY", 28: "ERROR_GPU_NOT_FOUND", 29: "ERROR_INVALID_STATE", 999: "ERROR_UNKNOWN",
}  # fmt: skip


def nvml_return_words(code: int) -> str:
    """``23`` -> ``NVML_ERROR_INSUFFICIENT_RESOURCES (23)``; a code nvml.h does not name stays a number."""
    name = NVML_RETURN_NAMES.get(code)
    return f"NVML_{name} ({code})" if name else f"NVML error {code}"


# NVML_GPU_FABRIC_HEALTH_SUMMARY_* (v3 struct).
FABRIC_SUMMARY_UNHEALTHY = 2
FABRIC_SUMMARY_LIMITED = 3
