"""Health reads through NVML: every signal of ``health.readings.GpuHealth``, each call optional.

The calls go through the session of ``system.nvml`` (the one pynvml import; its error rule, its
``DeviceFailed``) and, on a real machine, through ``system.nvml_worker``'s worker process, so every GPU's
read has the NVML deadline: a GPU that does not answer in time is marked "not responding" and the others
are still read. Unlike the topology reads, a value that cannot be read is not simply blanked: the reason
(NVML's words: ``Not Supported``, ``Function Not Found``, ``Insufficient Permissions``, ...) is kept in
``GpuHealth.unknown``, so ``check`` lists it as not checked. Only a GPU that is gone (lost, reset
required) fails the GPU.

Driver generations differ in what they offer, and each is handled as the driver says: the clocks event
reasons fall back to the older ``...ClocksThrottleReasons`` name (same bits); field values carry a return
code per field (``nvmlFieldValue_t.nvmlReturn``), so one field's NOT_SUPPORTED does not hide the others;
page retirement (before Ampere) and row remapping (Ampere and later) replace each other, so the one a GPU
does not have is not listed as unknown when the other answered; the fabric state is asked through
``nvmlDeviceGetGpuFabricInfoV`` (v2 struct, with the health mask), else ``nvmlDeviceGetGpuFabricInfo``.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from gputopo.health.readings import (
    BUDGET_SPENT,
    FIELD_GPU_RECOVERY_ACTION,
    NOT_READ,
    GpuHealth,
    HealthSample,
    NvlinkHealth,
    Unknown,
)
from gputopo.model import GPU_FAILING, GPU_NOT_RESPONDING
from gputopo.system import nvml, nvml_worker

_NOT_IN_BINDINGS = -1  # our code for "this nvidia-ml-py has no such function": read as the driver lacking it
_MW_PER_W = 1000.0


class _Reader:
    """Calls on one GPU that keep NVML's reason when a value cannot be read."""

    def __init__(self, dev: nvml.Device) -> None:
        self.dev = dev
        self.s = dev.session
        self.e = self.s._errors
        self.unknown: list[Unknown] = []

    def call(self, fn_name: str, *args: Any) -> tuple[Any, int | None, str | None]:
        """``(value, None, None)``, or ``(None, code, why)`` when NVML could not give it; ``DeviceFailed``
        when the GPU is gone (the rule of ``system.nvml``)."""
        fn = getattr(self.s._lib, fn_name, None)
        if fn is None:
            return None, _NOT_IN_BINDINGS, "Function Not Found (not in these nvidia-ml-py bindings)"
        try:
            return fn(self.dev.handle, *args), None, None
        except self.e.NVMLError as exc:
            if exc.value in self.s._gone:
                raise nvml.DeviceFailed(f"GPU{self.dev.index}", str(exc)) from None
            return None, int(exc.value), str(exc)
        except Exception as exc:
            # Newer bindings' versioned wrappers on a driver without the function.
            if self.s._mismatch is not None and isinstance(exc, self.s._mismatch):
                return None, int(getattr(self.e, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)), "Function Not Found"
            raise

    def get(self, what: str, fn_name: str, *args: Any) -> Any:
        """The value, or ``None`` with ``what`` recorded as unknown and why."""
        value, _, why = self.call(fn_name, *args)
        if why is not None:
            self.note(what, why)
        return value

    def note(self, what: str, why: str) -> None:
        if not any(u.what == what for u in self.unknown):
            self.unknown.append(Unknown(what, why))

    def code(self, name: str) -> int | None:
        value = getattr(self.e, name, None)
        return int(value[0] if isinstance(value, tuple) else value) if value is not None else None


def read_gpu_health(s: nvml.Session, index: int) -> GpuHealth:
    """Every health value of GPU ``index`` on session ``s``; a GPU that cannot be opened or is lost while
    being read comes back with ``error`` and ``state`` set."""
    try:
        dev = s.device(index)
    except nvml.DeviceFailed as exc:
        return GpuHealth(index=index, error=exc.reason, state=exc.state)
    try:
        return _read(dev)
    except nvml.DeviceFailed as exc:
        return GpuHealth(index=index, error=exc.reason, state=GPU_FAILING)


def _read(dev: nvml.Device) -> GpuHealth:
    r = _Reader(dev)
    e = r.e
    values: dict[str, Any] = {
        "index": dev.index,
        "name": dev.name(),
        "uuid": dev.uuid(),
        "pci_bus_id": dev.pci_bus_id(),
    }
    vbios, _, _ = r.call("nvmlDeviceGetVbiosVersion")  # for baselines; not a health check
    values["vbios_version"] = vbios.decode() if isinstance(vbios, bytes) else vbios
    values.update(_memory(r))
    values.update(_clocks_power(r))
    values.update(_pcie(r))
    util = r.get("utilisation", "nvmlDeviceGetUtilizationRates")
    values["utilization_pct"] = int(util.gpu) if util is not None else None
    mode = r.get("persistence mode", "nvmlDeviceGetPersistenceMode")
    values["persistence_mode"] = int(mode) == int(e.NVML_FEATURE_ENABLED) if mode is not None else None
    mig, _, _ = r.call("nvmlDeviceGetMigMode")
    values["mig_enabled"] = int(mig[0]) == int(getattr(e, "NVML_DEVICE_MIG_ENABLE", 1)) if mig else None
    values["recovery_action"] = _field(r, "driver recovery action", FIELD_GPU_RECOVERY_ACTION)
    ends = dev.nvlink_ends()
    values["nvlinks"] = tuple(_nvlink(r, end) for end in ends)
    # Fabric registration matters on NVSwitch systems: links to a switch, or links whose far end an older
    # driver cannot name (it may be one).
    values.update(_fabric(r, any(end.up and end.remote_kind in ("switch", None) for end in ends)))
    return GpuHealth(**values, unknown=tuple(r.unknown))


def _memory(r: _Reader) -> dict[str, Any]:
    e = r.e
    out: dict[str, Any] = {}
    mode, code, why = r.call("nvmlDeviceGetEccMode")
    if mode is not None:
        on = int(e.NVML_FEATURE_ENABLED)
        out["ecc_enabled"], out["ecc_pending_enabled"] = int(mode[0]) == on, int(mode[1]) == on
    else:
        r.note("ECC mode", why or "")
    if mode is not None or code == _NOT_IN_BINDINGS:
        for key, err, counter in (
            ("ecc_volatile_corrected", "CORRECTED", e.NVML_VOLATILE_ECC),
            ("ecc_volatile_uncorrected", "UNCORRECTED", e.NVML_VOLATILE_ECC),
            ("ecc_aggregate_corrected", "CORRECTED", e.NVML_AGGREGATE_ECC),
            ("ecc_aggregate_uncorrected", "UNCORRECTED", e.NVML_AGGREGATE_ECC),
        ):
            kind = r.code(f"NVML_MEMORY_ERROR_TYPE_{err}")
            value = r.get("ECC error counts", "nvmlDeviceGetTotalEccErrors", kind, counter)
            out[key] = int(value) if value is not None else None
    else:
        r.note("ECC error counts", why or "")
    rows, _, rows_why = r.call("nvmlDeviceGetRemappedRows")
    if rows is not None:
        corr, unc, pending, failure = (int(v) for v in rows)
        out.update(
            remapped_rows_corrected=corr,
            remapped_rows_uncorrected=unc,
            remapped_rows_pending=bool(pending),
            remapped_rows_failure=bool(failure),
        )
    retired = {}
    retired_why = None
    for key, cause in (
        ("retired_pages_sbe", "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"),
        ("retired_pages_dbe", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"),
    ):
        pages, _, why = r.call("nvmlDeviceGetRetiredPages", r.code(cause))
        retired[key] = len(pages) if pages is not None else None
        retired_why = retired_why or why
    pending, _, pending_why = r.call("nvmlDeviceGetRetiredPagesPendingStatus")
    retired["retired_pages_pending"] = (
        int(pending) == int(e.NVML_FEATURE_ENABLED) if pending is not None else None
    )
    out.update(retired)
    # Page retirement (pre-Ampere) and row remapping (Ampere+) replace each other: the one a GPU lacks is
    # not a gap when the other answered.
    has_rows = rows is not None
    has_pages = retired["retired_pages_sbe"] is not None or retired["retired_pages_pending"] is not None
    if not has_rows and not has_pages:
        r.note("remapped rows", rows_why or "")
        r.note("retired pages", retired_why or pending_why or "")
    return out


def _clocks_power(r: _Reader) -> dict[str, Any]:
    e = r.e
    reasons, code, why = r.call("nvmlDeviceGetCurrentClocksEventReasons")
    if reasons is None and code in (_NOT_IN_BINDINGS, r.code("NVML_ERROR_FUNCTION_NOT_FOUND")):
        # Drivers before r535 know the same bits under the older name.
        reasons, code, why = r.call("nvmlDeviceGetCurrentClocksThrottleReasons")
    if reasons is None:
        r.note("clocks event reasons", why or "")
    temp = r.get("temperature", "nvmlDeviceGetTemperature", e.NVML_TEMPERATURE_GPU)
    power = r.get("power draw", "nvmlDeviceGetPowerUsage")
    limit = r.get("power limit", "nvmlDeviceGetEnforcedPowerLimit")
    return {
        "clocks_event_reasons": int(reasons) if reasons is not None else None,
        "temperature_c": int(temp) if temp is not None else None,
        "power_w": int(power) / _MW_PER_W if power is not None else None,
        "power_limit_w": int(limit) / _MW_PER_W if limit is not None else None,
    }


def _pcie(r: _Reader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, fn in (
        ("pcie_gen_current", "nvmlDeviceGetCurrPcieLinkGeneration"),
        ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
        ("pcie_width_current", "nvmlDeviceGetCurrPcieLinkWidth"),
        ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth"),
    ):
        value = r.get("PCIe link", fn)
        out[key] = int(value) if value is not None else None
    replays = r.get("PCIe replay counter", "nvmlDeviceGetPcieReplayCounter")
    out["pcie_replays"] = int(replays) if replays is not None else None
    return out


# nvmlValueType_t -> the member of nvmlValue_t that holds the value (nvml.h).
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _field(r: _Reader, what: str, field_id: int) -> int | None:
    """One NVML field value; each field has its own return code (``nvmlFieldValue_t.nvmlReturn``)."""
    values = r.get(what, "nvmlDeviceGetFieldValues", [field_id])
    if values is None:
        return None
    v = values[0]
    ret = int(v.nvmlReturn)
    if ret != 0:
        if ret in r.s._gone:
            raise nvml.DeviceFailed(f"GPU{r.dev.index}", str(r.e.NVMLError(ret)))
        r.note(what, str(r.e.NVMLError(ret)))
        return None
    raw = getattr(v.value, _VALUE_MEMBERS.get(int(v.valueType), "ullVal"))
    return int(raw)


def _nvlink(r: _Reader, end: nvml.NvlinkEnd) -> NvlinkHealth:
    e = r.e
    counts: dict[str, int | None] = {}
    for key, name in (
        ("replay_errors", "NVML_NVLINK_ERROR_DL_REPLAY"),
        ("recovery_errors", "NVML_NVLINK_ERROR_DL_RECOVERY"),
        ("crc_flit_errors", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
        ("crc_data_errors", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
    ):
        value = r.get("NVLink error counters", "nvmlDeviceGetNvLinkErrorCounter", end.link, getattr(e, name))
        counts[key] = int(value) if value is not None else None
    return NvlinkHealth(
        link=end.link, up=end.up, remote_kind=end.remote_kind, remote_bus_id=end.remote_bus_id, **counts
    )


# The fabric info structs as nvml.h lays them out, ours rather than the bindings': nvidia-ml-py 12.535
# declares the v1 struct with an 80-byte clusterUuid (the device UUID buffer size), where nvml.h has 16
# (NVML_GPU_FABRIC_UUID_LEN), so every field after it would be read from the wrong place.
class _FabricInfoV1(ctypes.Structure):
    _fields_ = [
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint32),  # "partitionId" in r525-r535's nvml.h: the same field
        ("state", ctypes.c_uint32),
    ]


class _FabricInfoV2(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint32),
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint32),
        ("healthMask", ctypes.c_uint32),
    ]


# nvmlGpuFabricInfo_v2 = NVML_STRUCT_VERSION(GpuFabricInfo, 2): the struct's size | 2 << 24 (nvml.h).
_FABRIC_INFO_V2 = ctypes.sizeof(_FabricInfoV2) | 2 << 24


def _fabric(r: _Reader, on_switch: bool) -> dict[str, Any]:
    """The GPU's NVLink fabric registration (NVSwitch and NVL systems). Elsewhere the driver answers
    NOT_SUPPORTED (or lacks the call): that is no gap, so it is listed only for a GPU with switch links."""
    v2 = _FabricInfoV2(version=_FABRIC_INFO_V2)
    _, code, why = r.call("nvmlDeviceGetGpuFabricInfoV", ctypes.byref(v2))
    if code is None:
        return _fabric_values(v2, v2.healthMask)
    if code in (_NOT_IN_BINDINGS, r.code("NVML_ERROR_FUNCTION_NOT_FOUND")):
        v1 = _FabricInfoV1()
        _, code, why = r.call("nvmlDeviceGetGpuFabricInfo", ctypes.byref(v1))
        if code is None:
            return _fabric_values(v1, None)
    if on_switch:
        r.note("NVLink fabric state", why or "Function Not Found")
    return {}


def _fabric_values(info: Any, mask: Any) -> dict[str, Any]:
    return {
        "fabric_state": int(info.state),
        "fabric_status": int(info.status),
        "fabric_clique_id": int(info.cliqueId),
        "fabric_health_mask": int(mask) if mask is not None else None,
    }


# --- Samples: in this process (test backends), or in the NVML worker with a deadline per GPU ---------------

# The worker process keeps one session for these reads, opened on the first request (nvmlInit is
# reference-counted by NVML, so this sits beside the worker's own session).
_worker_session: tuple[AbstractContextManager[nvml.Session], nvml.Session] | None = None


def worker_read_gpu(index: int) -> GpuHealth:
    """Run inside ``nvml_worker``'s process (``("call", ...)`` request): one GPU's health."""
    global _worker_session
    if _worker_session is None:
        ctx = nvml.session()
        _worker_session = (ctx, ctx.__enter__())
    return read_gpu_health(_worker_session[1], index)


class HealthReader:
    """Reads health samples of every GPU. On a real machine each GPU's read runs in the NVML worker with
    ``timeout_s``; with a test backend (``nvml.use_backend``) or without the NVML library, here.

    Use as a context manager; ``NvmlUnavailable`` (exit 3) from ``__enter__`` when NVML cannot start.
    """

    def __init__(self, timeout_s: float = nvml_worker.DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.count = 0
        self.driver_version: str | None = None
        self.cuda_driver_version: str | None = None
        self._worker: nvml_worker.Worker | None = None
        self._local: AbstractContextManager[nvml.Session] | None = None
        self._session: nvml.Session | None = None
        self._hung: dict[int, str] = {}

    def __enter__(self) -> HealthReader:
        if nvml.backend_overridden() or not nvml.library_present():
            self._local = nvml.session()
            self._session = self._local.__enter__()
            self.count = self._session.device_count()
            self.driver_version = self._session.driver_version()
            self.cuda_driver_version = self._session.cuda_driver_version()
            return self
        self._worker = nvml_worker.Worker(self.timeout_s)
        try:
            header = self._worker.call(("header",), "the GPU count")
        except nvml_worker.NoAnswer as exc:
            started = self._worker.header
            self._worker.close()
            if started is not None and started[0] == "unavailable":
                raise nvml.NvmlUnavailable(started[1], started[2], not_installed=started[3]) from None
            raise nvml.NvmlUnavailable(
                exc.what, "the driver may be hung; check `dmesg` for Xid errors", hung=True
            ) from None
        if header[0] == "unavailable":
            self._worker.close()
            raise nvml.NvmlUnavailable(header[1], header[2], not_installed=header[3])
        _, self.count, self.driver_version, self.cuda_driver_version = header
        return self

    def __exit__(self, *exc: object) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._local is not None:
            self._local.__exit__(None, None, None)

    def gpu(self, index: int, left_s: float | None = None) -> GpuHealth:
        """One GPU's health now; a GPU that did not answer in time before is not asked again.

        ``left_s`` is what is left of the caller's budget: when it is less than the NVML deadline, the GPU
        gets only that, and one that has not answered by then is not read (budget spent), not "not
        responding": a slow answer cut short by the budget is no sign of a sick GPU."""
        if index in self._hung:
            return GpuHealth(index=index, error=self._hung[index], state=GPU_NOT_RESPONDING)
        if self._session is not None:
            try:
                return read_gpu_health(self._session, index)
            except Exception as exc:  # a surprise in one GPU's answer must not end the whole check
                return _read_failed(index, exc)
        assert self._worker is not None
        cut = left_s is not None and left_s < self.timeout_s
        self._worker.timeout_s = max(0.05, left_s) if cut and left_s is not None else self.timeout_s
        try:
            answer = self._worker.call(("call", __name__, "worker_read_gpu", (index,), {}), f"GPU{index}")
        except nvml_worker.NoAnswer as exc:
            if cut:
                return GpuHealth(index=index, unknown=(Unknown(NOT_READ, BUDGET_SPENT),))
            self._hung[index] = exc.what
            return GpuHealth(index=index, error=exc.what, state=GPU_NOT_RESPONDING)
        finally:
            self._worker.timeout_s = self.timeout_s
        if answer[0] == "raise":
            return _read_failed(index, answer[1])
        return answer[1]  # type: ignore[no-any-return]

    def sample(
        self,
        indices: Sequence[int] | None = None,
        deadline: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> HealthSample:
        """Every GPU's health now (or those in ``indices``). GPUs not reached before ``deadline`` (a
        ``clock`` reading) are listed as not read, never as healthy."""
        taken = clock()
        gpus = []
        for i in indices if indices is not None else range(self.count):
            if deadline is not None and clock() >= deadline and i not in self._hung:
                gpus.append(GpuHealth(index=i, unknown=(Unknown(NOT_READ, BUDGET_SPENT),)))
                continue
            gpus.append(self.gpu(i, deadline - clock() if deadline is not None else None))
        return HealthSample(tuple(gpus), taken, self.driver_version, self.cuda_driver_version)


def _read_failed(index: int, exc: BaseException) -> GpuHealth:
    """A GPU whose read raised something NVML's error rule does not cover (an answer the bindings could
    not decode, a bug): every value unknown, with what happened, so the other GPUs are still judged."""
    why = f"reading it failed: {type(exc).__name__}: {exc}"
    return GpuHealth(index=index, unknown=(Unknown(NOT_READ, " ".join(why.split())[:200]),))


def read_two_samples(
    window_s: float,
    timeout_s: float = nvml_worker.DEFAULT_TIMEOUT_S,
    deadline: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[HealthSample, HealthSample]:
    """Two samples of every GPU, ``window_s`` apart (the window is cut short when ``deadline`` is near).
    ``NvmlUnavailable`` (exit 3) when NVML cannot start."""
    with HealthReader(timeout_s) as reader:
        first = reader.sample(deadline=deadline, clock=clock)
        wait = window_s
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - clock()))
        if wait > 0:
            sleep(wait)
        second = reader.sample(deadline=deadline, clock=clock)
    return _keep_first_reads(first, second)


def _keep_first_reads(first: HealthSample, second: HealthSample) -> tuple[HealthSample, HealthSample]:
    """A GPU the budget left unread in the second sample keeps its first reading: its states are still
    judged, and its counters' rise is not checked (it is taken out of the first sample, so the judge
    sees one sample of it), never read as "no rise"."""
    late = {
        g.index
        for g in second.gpus
        if any(u.why == BUDGET_SPENT for u in g.unknown)
        and (f := first.gpu(g.index)) is not None
        and not any(u.why == BUDGET_SPENT for u in f.unknown)
    }
    if not late:
        return first, second
    kept = tuple((first.gpu(g.index) or g) if g.index in late else g for g in second.gpus)
    once = tuple(g for g in first.gpus if g.index not in late)
    return replace(first, gpus=once), replace(second, gpus=kept)
