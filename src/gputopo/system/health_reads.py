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
``nvmlDeviceGetGpuFabricInfoV`` (the v3 struct with the health summary, else v2 with the health mask), else
``nvmlDeviceGetGpuFabricInfo``, and the platform's rack and tray through ``nvmlDeviceGetPlatformInfo``
(system/nvml/fabric.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from gputopo.health.readings import (
    BUDGET_SPENT,
    FIELD_GPU_RECOVERY_ACTION,
    FIELD_NVLINK_ECC_DATA_TOTAL,
    FIELD_NVLINK_EFFECTIVE_BER,
    FIELD_NVLINK_SYMBOL_BER,
    NOT_READ,
    NVLINK5_COUNTERS,
    SCOPE_ALL_LINKS,
    GpuHealth,
    HealthSample,
    NvlinkHealth,
    Unknown,
)
from gputopo.model import GPU_FAILING, GPU_NOT_RESPONDING
from gputopo.system import nvml, nvml_worker


class _Reader:
    """One GPU's answers, keeping NVML's reason for each value that cannot be read."""

    def __init__(self, dev: nvml.Device) -> None:
        self.dev = dev
        self.unknown: list[Unknown] = []

    def get(self, what: str, answer: nvml.Answer) -> Any:
        """The answer's value, or ``None`` with ``what`` recorded as unknown and why."""
        if answer.why is not None:
            self.note(what, answer.why)
        return answer.value

    def note(self, what: str, why: str) -> None:
        if not any(u.what == what for u in self.unknown):
            self.unknown.append(Unknown(what, why))


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
    values: dict[str, Any] = {
        "index": dev.index,
        "name": dev.name(),
        "uuid": dev.uuid(),
        "pci_bus_id": dev.pci_bus_id(),
        "vbios_version": dev.vbios().value,  # for baselines; not a health check
        "serial": dev.serial().value,  # what accept's verdict is kept for, and DCGM names GPUs by
    }
    values.update(_memory(r))
    values.update(_clocks_power(r))
    values.update(_pcie(r))
    values["utilization_pct"] = r.get("utilisation", dev.utilization())
    values["persistence_mode"] = r.get("persistence mode", dev.persistence_mode())
    values["mig_enabled"] = dev.mig_enabled().value
    # Newer drivers only (DCGM 4.6 reads it): where the driver or GPU lacks it, no gap is listed.
    values["memory_unrepairable"] = dev.unrepairable_memory().value
    values["recovery_action"] = r.get("driver recovery action", dev.field_value(FIELD_GPU_RECOVERY_ACTION))
    ends = dev.nvlink_ends()
    values["nvlinks"] = _with_nvlink5(dev, tuple(_nvlink(r, end) for end in ends))
    values.update(_nvlink_totals(r, values["nvlinks"]))
    # Fabric registration matters on NVSwitch systems: links to a switch, or links whose far end an older
    # driver cannot name (it may be one).
    values.update(_fabric(r, any(end.up and end.remote_kind in ("switch", None) for end in ends)))
    return GpuHealth(**values, unknown=tuple(r.unknown))


def _memory(r: _Reader) -> dict[str, Any]:
    dev = r.dev
    out: dict[str, Any] = {}
    mode = dev.ecc_mode()
    if mode.ok and mode.value is not None:
        out["ecc_enabled"], out["ecc_pending_enabled"] = mode.value
    else:
        r.note("ECC mode", mode.why or "")
    # The counts are asked where ECC mode answered, or where these bindings lack the mode call only.
    if mode.ok or mode.code == nvml.NOT_IN_BINDINGS:
        for key, error, counter in (
            ("ecc_volatile_corrected", "corrected", "volatile"),
            ("ecc_volatile_uncorrected", "uncorrected", "volatile"),
            ("ecc_aggregate_corrected", "corrected", "aggregate"),
            ("ecc_aggregate_uncorrected", "uncorrected", "aggregate"),
        ):
            out[key] = r.get("ECC error counts", dev.ecc_errors(error, counter))
    else:
        r.note("ECC error counts", mode.why or "")
    rows = dev.remapped_rows()
    if rows.ok and rows.value is not None:
        corr, unc, pending, failure = rows.value
        out.update(
            remapped_rows_corrected=corr,
            remapped_rows_uncorrected=unc,
            remapped_rows_pending=pending,
            remapped_rows_failure=failure,
        )
    sbe, dbe, pending = dev.retired_pages("sbe"), dev.retired_pages("dbe"), dev.retired_pages_pending()
    out.update(retired_pages_sbe=sbe.value, retired_pages_dbe=dbe.value, retired_pages_pending=pending.value)
    # Page retirement (pre-Ampere) and row remapping (Ampere+) replace each other: the one a GPU lacks is
    # not a gap when the other answered.
    has_rows = rows.value is not None
    has_pages = sbe.value is not None or pending.value is not None
    if not has_rows and not has_pages:
        r.note("remapped rows", rows.why or "")
        r.note("retired pages", sbe.why or dbe.why or pending.why or "")
    return out


def _clocks_power(r: _Reader) -> dict[str, Any]:
    dev = r.dev
    return {
        "clocks_event_reasons": r.get("clocks event reasons", dev.clocks_event_reasons()),
        "temperature_c": r.get("temperature", dev.temperature_c()),
        "power_w": r.get("power draw", dev.power_w()),
        "power_limit_w": r.get("power limit", dev.power_limit_w()),
    }


def _pcie(r: _Reader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for which in ("gen_current", "gen_max", "width_current", "width_max"):
        out[f"pcie_{which}"] = r.get("PCIe link", r.dev.pcie_value(which))
    out["pcie_replays"] = r.get("PCIe replay counter", r.dev.pcie_replays())
    return out


def _nvlink(r: _Reader, end: nvml.NvlinkEnd) -> NvlinkHealth:
    counts: dict[str, int | None] = {}
    for counter in ("replay", "recovery", "crc_flit", "crc_data"):
        key = f"{counter}_errors"
        counts[key] = r.get("NVLink error counters", r.dev.nvlink_errors(end.link, counter))
    return NvlinkHealth(
        link=end.link, up=end.up, remote_kind=end.remote_kind, remote_bus_id=end.remote_bus_id, **counts
    )


def _with_nvlink5(dev: nvml.Device, links: tuple[NvlinkHealth, ...]) -> tuple[NvlinkHealth, ...]:
    """The links with their NVLink5 error counters, where the GPU has them (one field-values call for
    every link). Before NVLink5 each answers NOT_SUPPORTED: that is no gap, so nothing is listed."""
    if not links:
        return links
    answer = dev.link_field_values([n.link for n in links], list(NVLINK5_COUNTERS))
    found = answer.value if answer.ok and answer.value else {}
    if not found:
        return links
    out = []
    for n in links:
        pairs = tuple((f, found[(n.link, f)]) for f in NVLINK5_COUNTERS if (n.link, f) in found)
        out.append(replace(n, nvl5=pairs or None))
    return tuple(out)


def _nvlink_totals(r: _Reader, links: tuple[NvlinkHealth, ...]) -> dict[str, Any]:
    """The GPU's NVLink ECC data error total (field 160) and, on NVLink5, the effective and symbol BER of
    its links together (fields 220 and 222 with scopeId UINT_MAX, as DCGM 4.6's cache manager reads them
    for MonitorNVLink5Fields). A GPU without NVLinks reads none. On an NVLink5 GPU a field the driver
    lacks is listed as not checked; before NVLink5 a missing one is no gap."""
    if not links:
        return {}
    nvl5 = any(n.nvl5 for n in links)
    out: dict[str, Any] = {}
    ecc = r.dev.field_value(FIELD_NVLINK_ECC_DATA_TOTAL)
    if ecc.ok:
        out["nvlink_ecc_data_errors"] = ecc.value
    elif nvl5:
        r.note("NVLink ECC data error total (NVML field 160)", ecc.why or "Not Supported")
    if not nvl5:
        return out
    ids = (FIELD_NVLINK_EFFECTIVE_BER, FIELD_NVLINK_SYMBOL_BER)
    answer = r.dev.link_field_values([SCOPE_ALL_LINKS], list(ids))
    found = answer.value if answer.ok and answer.value else {}
    for field_id, key, what in (
        (FIELD_NVLINK_EFFECTIVE_BER, "nvlink_effective_ber_raw", "NVLink effective BER (NVML field 220)"),
        (FIELD_NVLINK_SYMBOL_BER, "nvlink_symbol_ber_raw", "NVLink symbol BER (NVML field 222)"),
    ):
        if (SCOPE_ALL_LINKS, field_id) in found:
            out[key] = found[(SCOPE_ALL_LINKS, field_id)]
        else:
            r.note(what, answer.why or "Not Supported")
    return out


def _fabric(r: _Reader, on_switch: bool) -> dict[str, Any]:
    """The GPU's NVLink fabric registration (NVSwitch and NVL systems) and the platform's place for it (a
    rack's chassis serial and tray). Elsewhere the driver answers NOT_SUPPORTED (or lacks the call): that
    is no gap, so it is listed only for a GPU with switch links."""
    answer = r.dev.fabric_info()
    out: dict[str, Any] = {}
    if answer.ok and answer.value is not None:
        info: nvml.FabricInfo = answer.value
        out = {
            "fabric_state": info.state,
            "fabric_status": info.status,
            "fabric_clique_id": info.clique_id,
            "fabric_health_mask": info.health_mask,
            "fabric_health_summary": info.health_summary,
            "fabric_cluster_uuid": info.cluster_uuid,
        }
        platform = r.dev.platform_info()
        if platform.ok and platform.value is not None:
            place: nvml.PlatformInfo = platform.value
            if place.chassis_serial:  # an HGX board answers with none: no rack, no tray
                out["platform_chassis_serial"] = place.chassis_serial
                out["platform_tray_index"] = place.tray_index
    elif on_switch:
        r.note("NVLink fabric state", answer.why or "Function Not Found")
    return out


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


def sample_health(
    window_s: float | None = None,
    gpus: Sequence[int] | None = None,
    timeout_s: float = nvml_worker.DEFAULT_TIMEOUT_S,
    deadline: float | None = None,
) -> tuple[HealthSample | None, HealthSample]:
    """The one door into this machine's health, for every command: one sample of ``gpus`` (every GPU when
    ``None``; indices NVML does not have are left out) when ``window_s`` is ``None`` (states only:
    ``topo``, ``recommend``, ``run``, ``probe``), or two samples of every GPU ``window_s`` apart, so rising
    counters are judged too (``check``, ``doctor``). Returns ``(first or None, last)``. ``NvmlUnavailable``
    when NVML cannot start."""
    if window_s is not None:
        return read_two_samples(window_s, timeout_s=timeout_s, deadline=deadline)
    with HealthReader(timeout_s) as reader:
        wanted = None if gpus is None else [g for g in gpus if g < reader.count]
        return None, reader.sample(wanted, deadline=deadline)


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
