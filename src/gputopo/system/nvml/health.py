"""Health counter reads of one GPU (system/health_reads.py reads them): ECC, row remapping, retired pages,
clocks event reasons, temperature, power, PCIe replays, NVML fields, NVLink error counters. Each answer
keeps why a value is unknown."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from gputopo.system.nvml.answer import NOT_IN_BINDINGS, Answer, DeviceFailed, DeviceReads, _text

# nvmlValueType_t -> the member of nvmlValue_t that holds the value (nvml.h).
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
_MW_PER_W = 1000.0


class HealthReads(DeviceReads):
    """A GPU's health counters, each an ``Answer``."""

    def vbios(self) -> Answer:
        """The VBIOS version (``96.00.99.00.01``)."""
        return self._a("nvmlDeviceGetVbiosVersion").then(_text)

    def serial(self) -> Answer:
        """The board serial number (``nvidia-smi -q``'s Serial Number; DCGM names GPUs by it)."""
        return self._a("nvmlDeviceGetSerial").then(_text)

    def ecc_mode(self) -> Answer:
        """``(enabled now, enabled after the next reset)``."""
        on = int(self.session._errors.NVML_FEATURE_ENABLED)
        return self._a("nvmlDeviceGetEccMode").then(lambda m: (int(m[0]) == on, int(m[1]) == on))

    def ecc_errors(
        self, error: Literal["corrected", "uncorrected"], counter: Literal["volatile", "aggregate"]
    ) -> Answer:
        """The ECC error count of one kind: since the driver loaded (volatile) or over the GPU's life."""
        s = self.session
        kind = s.code(f"NVML_MEMORY_ERROR_TYPE_{error.upper()}")
        which = s.code("NVML_VOLATILE_ECC" if counter == "volatile" else "NVML_AGGREGATE_ECC")
        return self._a("nvmlDeviceGetTotalEccErrors", kind, which).then(int)

    def remapped_rows(self) -> Answer:
        """``(corrected, uncorrected, pending, failure)`` row remaps (Ampere and later)."""
        return self._a("nvmlDeviceGetRemappedRows").then(
            lambda r: (int(r[0]), int(r[1]), bool(int(r[2])), bool(int(r[3])))
        )

    def retired_pages(self, cause: Literal["sbe", "dbe"]) -> Answer:
        """How many pages were retired for ``cause`` (before Ampere): multiple single-bit or a double-bit
        ECC error."""
        name = {
            "sbe": "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",
            "dbe": "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR",
        }[cause]
        return self._a("nvmlDeviceGetRetiredPages", self.session.code(name)).then(len)

    def retired_pages_pending(self) -> Answer:
        """Whether a page retirement waits for the next reset."""
        on = int(self.session._errors.NVML_FEATURE_ENABLED)
        return self._a("nvmlDeviceGetRetiredPagesPendingStatus").then(lambda v: int(v) == on)

    def clocks_event_reasons(self) -> Answer:
        """NVML's clocks event reasons bitmask; drivers before r535 know the same bits under the older
        ``...ClocksThrottleReasons`` name."""
        answer = self._a("nvmlDeviceGetCurrentClocksEventReasons")
        if self.session.missing(answer):
            answer = self._a("nvmlDeviceGetCurrentClocksThrottleReasons")
        return answer.then(int)

    def temperature_c(self) -> Answer:
        return self._a("nvmlDeviceGetTemperature", self.session._errors.NVML_TEMPERATURE_GPU).then(int)

    def power_w(self) -> Answer:
        """Power draw in W (NVML answers mW)."""
        return self._a("nvmlDeviceGetPowerUsage").then(lambda mw: int(mw) / _MW_PER_W)

    def power_limit_w(self) -> Answer:
        """The enforced power limit in W."""
        return self._a("nvmlDeviceGetEnforcedPowerLimit").then(lambda mw: int(mw) / _MW_PER_W)

    def pcie_value(self, which: Literal["gen_current", "gen_max", "width_current", "width_max"]) -> Answer:
        """One of the PCIe link's generation and width, current or maximum."""
        name = {
            "gen_current": "nvmlDeviceGetCurrPcieLinkGeneration",
            "gen_max": "nvmlDeviceGetMaxPcieLinkGeneration",
            "width_current": "nvmlDeviceGetCurrPcieLinkWidth",
            "width_max": "nvmlDeviceGetMaxPcieLinkWidth",
        }[which]
        return self._a(name).then(int)

    def pcie_replays(self) -> Answer:
        return self._a("nvmlDeviceGetPcieReplayCounter").then(int)

    def utilization(self) -> Answer:
        """GPU utilisation over NVML's last sample period, percent."""
        return self._a("nvmlDeviceGetUtilizationRates").then(lambda rates: int(rates.gpu))

    def unrepairable_memory(self) -> Answer:
        """Whether the driver flags the GPU's memory as unrepairable (newer drivers'
        ``nvmlDeviceGetUnrepairableMemoryFlag_v1``; DCGM 4.6 reads it for DCGM_FI_DEV_MEMORY_UNREPAIRABLE)."""
        return self._a("nvmlDeviceGetUnrepairableMemoryFlag_v1").then(lambda v: bool(int(v)))

    def persistence_mode(self) -> Answer:
        on = int(self.session._errors.NVML_FEATURE_ENABLED)
        return self._a("nvmlDeviceGetPersistenceMode").then(lambda v: int(v) == on)

    def mig_enabled(self) -> Answer:
        """Whether MIG is enabled now."""
        on = int(getattr(self.session._errors, "NVML_DEVICE_MIG_ENABLE", 1))
        return self._a("nvmlDeviceGetMigMode").then(lambda m: int(m[0]) == on)

    def field_value(self, field_id: int) -> Answer:
        """One NVML field value; each field carries its own return code (``nvmlFieldValue_t.nvmlReturn``),
        so one field's NOT_SUPPORTED does not hide the others."""
        answer = self._a("nvmlDeviceGetFieldValues", [field_id])
        if answer.why is not None or answer.value is None:
            return answer
        v = answer.value[0]
        ret = int(v.nvmlReturn)
        if ret != 0:
            why = str(self.session._errors.NVMLError(ret))
            if ret in self.session._gone:
                raise DeviceFailed(f"GPU{self.index}", why)
            return Answer(None, why, ret)
        return Answer(int(getattr(v.value, _VALUE_MEMBERS.get(int(v.valueType), "ullVal"))))

    def link_field_values(self, links: Sequence[int], field_ids: Sequence[int]) -> Answer:
        """NVML field values scoped to NVLinks (``nvmlFieldValue_t.scopeId`` = the link), in one call: a
        dict ``(link, field id) -> value`` of those that answered (a field the GPU lacks, NOT_SUPPORTED in
        its own slot, is left out). The NVLink5 error counters (fields 206-215, 221) are read this way."""
        pairs = [(f, link) for link in links for f in field_ids]
        if not pairs:
            return Answer({})
        try:
            answer = self._a("nvmlDeviceGetFieldValues", pairs)
        except TypeError:  # bindings that take field ids only, no (field, scope) pairs
            return Answer(None, "these bindings cannot scope a field to a link", NOT_IN_BINDINGS)
        if answer.why is not None or answer.value is None:
            return answer
        out: dict[tuple[int, int], int] = {}
        for (field_id, link), v in zip(pairs, answer.value, strict=False):
            if int(v.nvmlReturn) == 0:
                out[(link, field_id)] = int(getattr(v.value, _VALUE_MEMBERS.get(int(v.valueType), "ullVal")))
        return Answer(out)

    def nvlink_errors(
        self, link: int, counter: Literal["replay", "recovery", "crc_flit", "crc_data"]
    ) -> Answer:
        """One NVLink error counter of ``link``."""
        name = {
            "replay": "NVML_NVLINK_ERROR_DL_REPLAY",
            "recovery": "NVML_NVLINK_ERROR_DL_RECOVERY",
            "crc_flit": "NVML_NVLINK_ERROR_DL_CRC_FLIT",
            "crc_data": "NVML_NVLINK_ERROR_DL_CRC_DATA",
        }[counter]
        return self._a("nvmlDeviceGetNvLinkErrorCounter", link, self.session.code(name)).then(int)
