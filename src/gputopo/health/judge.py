"""Health readings -> findings (pure): the rules of ``health.rules`` applied to two samples.

Counters are judged by how they move between the two samples (``window_s`` apart), not by their totals:
a total since the driver loaded is history, a note at most. States (a pending row remap, a link down, the
clocks event reasons, the recovery action) are judged on the second sample. What could not be read is
listed in ``not_checked`` with the reason, never taken as healthy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from gputopo.findings import PROBLEM, Finding
from gputopo.health.readings import (
    CLOCKS_HW_POWER_BRAKE,
    CLOCKS_HW_SLOWDOWN,
    CLOCKS_HW_THERMAL,
    CLOCKS_SW_THERMAL,
    FABRIC_COMPLETED,
    FABRIC_IN_PROGRESS,
    FABRIC_NOT_SUPPORTED,
    FABRIC_STATES,
    FABRIC_SUMMARY_LIMITED,
    FABRIC_SUMMARY_UNHEALTHY,
    NOT_READ,
    NVLINK5_COUNTERS,
    RECOVERY_ACTIONS,
    RECOVERY_NONE,
    GpuHealth,
    HealthSample,
    NvlinkHealth,
    ber_parts,
    ber_words,
    nvml_return_words,
)
from gputopo.health.rules import DEFAULT_THRESHOLDS, Rule, Thresholds
from gputopo.model import BUSY_UTILIZATION_PCT, GPU_NOT_ACCESSIBLE
from gputopo.topology.nvlink_domain import domain_id


@dataclass(frozen=True)
class NotChecked:
    """A check that did not run: ``what`` (``GPU3: remapped rows``), ``why`` (NVML's words or ours)."""

    what: str
    why: str

    def to_json(self) -> dict[str, str]:
        return {"what": self.what, "why": self.why}


@dataclass(frozen=True)
class Judgement:
    """The findings (problems first) and the checks that could not run."""

    findings: tuple[Finding, ...]
    not_checked: tuple[NotChecked, ...]

    @property
    def problems(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == PROBLEM)

    def unhealthy_gpus(self) -> dict[int, str]:
        """GPU index -> the first problem found on it (what recommend/run put in ``excluded``)."""
        out: dict[int, str] = {}
        for f in self.problems:
            if f.gpu is not None and f.gpu not in out:
                out[f.gpu] = f.what
        return out

    def p2p_drained_gpus(self) -> dict[int, str]:
        """GPU index -> the finding, for GPUs whose driver asks to keep peer-to-peer work off them (NVML
        recovery action DRAIN_P2P, 3: a note for ``check``, but no multi-GPU set may hold them)."""
        return p2p_drained(self.findings)

    def to_json(self) -> dict[str, object]:
        """The health section every command's JSON carries: findings, not checked, unhealthy GPUs."""
        return {
            "findings": [f.to_json() for f in self.findings],
            "not_checked": [n.to_json() for n in self.not_checked],
            "unhealthy": [{"gpu": g, "why": why} for g, why in sorted(self.unhealthy_gpus().items())],
        }


# PCIe signalling rate per lane in GT/s by generation (PCI-SIG; DCGM's table in GetExpectedPcieReplayRate).
PCIE_GT_PER_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


def expected_pcie_replays_per_min(gen: int, width: int, ber: float = 1e-12) -> int:
    """Replays a healthy link may show per minute: one per bit error, at ``ber`` errors per bit, over every
    lane, ceiled as DCGM does (Gen4 x16: 16/min, Gen5 x16: 31/min). Generations past the table are capped
    at the fastest known, as DCGM caps them."""
    gt = PCIE_GT_PER_S[min(max(gen, 1), max(PCIE_GT_PER_S))]
    return math.ceil(gt * 1e9 * ber * 60 * width - 1e-9)


class _Judge:
    def __init__(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self.found: list[Finding] = []
        self.not_checked: dict[tuple[str, str], list[str]] = {}

    def add(
        self, rule_name: str, where: str, gpu: int | None, what: str, remedy: str | None = None, **kw: str
    ) -> None:
        """The rule's finding, unless ``--thresholds`` turned the rule off; ``remedy`` ``None``: the row's."""
        rule: Rule = self.t[rule_name]
        if not rule.enabled:
            return
        self.found.append(
            rule.finding(where, what, remedy, gpu=gpu, severity=kw.get("severity"), action=kw.get("action"))
        )

    def skip(self, where: str, what: str, why: str) -> None:
        self.not_checked.setdefault((what, why), []).append(where)

    def result(self, gpu_count: int = 0) -> Judgement:
        found = sorted(
            _node_level(self.found, gpu_count),
            key=lambda f: (f.severity != PROBLEM, f.gpu if f.gpu is not None else -1),
        )
        skipped = tuple(
            NotChecked(f"{', '.join(wheres)}: {what}", why)
            for (what, why), wheres in self.not_checked.items()
        )
        return Judgement(tuple(found), skipped)


def judge(
    sample0: HealthSample | None,
    sample1: HealthSample,
    window_s: float | None = None,
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
    expect_gpus: int | None = None,
    busy: Mapping[int, bool] | None = None,
) -> Judgement:
    """Judge ``sample1`` (states) and the rise from ``sample0`` to ``sample1`` (counters).

    ``window_s`` is the time between the samples (default: their ``taken_s`` difference); without
    ``sample0`` the counter rules are listed as not checked. ``busy`` says per GPU index whether it works
    (default: NVML utilisation >= ``model.BUSY_UTILIZATION_PCT``). ``expect_gpus`` is the count the node
    should have.
    """
    j = _Judge(thresholds)
    if window_s is None and sample0 is not None:
        window_s = sample1.taken_s - sample0.taken_s
    if expect_gpus is not None and len(sample1.gpus) < expect_gpus:
        j.add(
            "expect_gpus",
            "node",
            None,
            f"NVML sees {len(sample1.gpus)} GPUs, {expect_gpus} expected",
        )
    for u in sample1.unknown:
        j.skip("node", u.what, u.why)
    # DCGM MonitorNVLinkStatus skips links reported down while MIG is on (bug 200682374: NVML reports the
    # links to a MIG GPU as down); the peers' links to it read down too, so no GPU's link status is judged
    # while any GPU of the node is in MIG mode.
    mig = [g.label for g in sample1.gpus if g.mig_enabled]
    if mig:
        j.skip(
            "node", "NVLink status", f"{', '.join(mig)} in MIG mode (links to it read down, as DCGM knows)"
        )
    for g1 in sample1.gpus:
        g0 = sample0.gpu(g1.index) if sample0 is not None else None
        if g1.error is not None and g1.state == GPU_NOT_ACCESSIBLE:
            # Refused for permission (another job's or container's GPU): unknown, never a fault
            # (docs/health-rules.md).
            j.skip(g1.label, NOT_READ, f"not accessible from here ({g1.error})")
            continue
        if g1.error is not None:
            j.add(
                "gpu_unreadable",
                g1.label,
                g1.index,
                f"{g1.label} could not be read ({g1.state + ': ' if g1.state else ''}{g1.error})",
            )
            continue
        for u in g1.unknown:
            j.skip(g1.label, u.what, u.why)
        is_busy = busy.get(g1.index) if busy is not None else None
        if is_busy is None:
            is_busy = g1.utilization_pct is not None and g1.utilization_pct >= BUSY_UTILIZATION_PCT
        usable = g0 is not None and g0.error is None and window_s is not None and window_s > 0
        _memory(j, g1, g0 if usable else None, window_s)
        _nvlink(j, g1, g0 if usable else None, window_s, judge_status=not mig)
        _pcie(j, g1, g0 if usable else None, window_s, is_busy)
        _clocks(j, g1, g0 if g0 is not None and g0.error is None else None)
        _driver(j, g1)
        if not usable:
            why = "one sample only" if g0 is None else "no time between the samples"
            if g0 is not None and g0.error is not None:
                why = f"the first sample could not read it ({g0.error})"
            j.skip(g1.label, "error counters' rise", why)
    _fabric_domains(j, sample1.gpus)
    return j.result(len(sample1.gpus))


# Rules that, found on every GPU of a node alike, are one node fault (Fabric Manager down, the driver), said
# once: a scheduler's reason then names the fault, not GPU0.
_NODE_LEVEL = {
    "fabric_not_ready": "the NVLink fabric is not ready on every GPU: nvidia-fabricmanager (or the NVLink "
    "subnet manager) is not running or failed",
    "fabric_unhealthy": "the NVLink fabric reports every GPU unhealthy",
    "fabric_summary_unhealthy": "the NVLink fabric's health summary is UNHEALTHY on every GPU",
    "fabric_no_domain": "the tray sits in a rack but no GPU of it is in an NVLink domain",
    "gpu_unreadable": "no GPU answers NVML: the driver is failing",
}


def _node_level(found: list[Finding], gpu_count: int) -> list[Finding]:
    """One node finding for a rule found on all ``gpu_count`` (2 or more) GPUs, in place of one per GPU."""
    if gpu_count < 2:
        return found
    out: list[Finding] = []
    for f in found:
        if f.rule not in _NODE_LEVEL:
            out.append(f)
            continue
        same = [x for x in found if x.rule == f.rule]
        if len({x.gpu for x in same}) < gpu_count:
            out.append(f)
        elif f is same[0]:
            first = f.what.split(": ", 1)[-1] if f.what.startswith(f"{f.where}: ") else f.what
            out.append(
                replace(
                    f,
                    where="node",
                    what=f"{_NODE_LEVEL[f.rule]} (all {gpu_count} GPUs; {f.where}: {first})",
                    gpu=None,
                )
            )
    return out


def _secs(window_s: float | None) -> str:
    """A window as a reader wants it: ``2.0 s``, not ``2.00413 s``."""
    return f"{window_s or 0:.1f} s"


def _rise(a: int | None, b: int | None) -> int | None:
    """How much a counter rose; ``None`` if either value is unknown. A counter that went down was reset
    (``nvidia-smi -p 0``, a driver reload): its new value is the rise, as DCGM reads a reset counter."""
    if a is None or b is None:
        return None
    return b - a if b >= a else b


def _memory(j: _Judge, g: GpuHealth, g0: GpuHealth | None, window_s: float | None) -> None:
    label, i = g.label, g.index
    if g.ecc_enabled is False:
        j.add(
            "ecc_off",
            label,
            i,
            f"ECC is off on {label}" + (" (on after the next reset)" if g.ecc_pending_enabled else ""),
        )
    vol = g.ecc_volatile_uncorrected
    if vol is not None and vol > j.t.limit("ecc_volatile_uncorrected"):
        rise = _rise(g0.ecc_volatile_uncorrected, vol) if g0 is not None else None
        moving = f", {rise} of them in the last {_secs(window_s)}" if rise else ""
        j.add(
            "ecc_volatile_uncorrected",
            label,
            i,
            f"{vol} uncorrectable ECC errors on {label} since the driver loaded{moving}",
        )
    agg = g.ecc_aggregate_uncorrected
    if agg is not None and agg > j.t.limit("ecc_aggregate_uncorrected") and not (vol or 0):
        j.add(
            "ecc_aggregate_uncorrected",
            label,
            i,
            f"{agg} uncorrectable ECC errors in {label}'s history (none since the driver loaded)",
        )
    if g.memory_unrepairable:
        j.add(
            "memory_unrepairable",
            label,
            i,
            f"the driver flags the memory of {label} as unrepairable",
        )
    if g.remapped_rows_failure:
        j.add(
            "row_remap_failure",
            label,
            i,
            f"a row remapping failed on {label} ({g.remapped_rows_uncorrected} rows remapped for "
            "uncorrectable errors)",
        )
    if g.remapped_rows_pending:
        j.add(
            "row_remap_pending",
            label,
            i,
            f"a row remapping is pending on {label}",
        )
    unc = g.remapped_rows_uncorrected
    if unc is not None and unc >= j.t.limit("remapped_rows_uncorrected"):
        j.add(
            "remapped_rows_uncorrected",
            label,
            i,
            f"{unc} rows remapped for uncorrectable errors on {label} (limit "
            f"{j.t.limit('remapped_rows_uncorrected'):g})",
        )
    if g.retired_pages_pending:
        j.add(
            "retired_pages_pending",
            label,
            i,
            f"pages are pending retirement on {label}",
        )
    if g.retired_pages_sbe is not None or g.retired_pages_dbe is not None:
        total = (g.retired_pages_sbe or 0) + (g.retired_pages_dbe or 0)
        if total >= j.t.limit("retired_pages"):
            j.add(
                "retired_pages",
                label,
                i,
                f"{total} retired pages on {label} ({g.retired_pages_sbe} single-bit, {g.retired_pages_dbe} "
                f"double-bit; limit {j.t.limit('retired_pages'):g})",
            )


_SWITCH_REMEDY = (
    "`nvidia-smi nvlink -s -i {i}` and `nvidia-smi nvlink -e -i {i}` show the links; on NVSwitch systems "
    "check nvidia-fabricmanager; a GPU reset or reseat usually brings a link back, errors that return mean "
    "hardware service"
)


def _nvlink(
    j: _Judge, g: GpuHealth, g0: GpuHealth | None, window_s: float | None, judge_status: bool = True
) -> None:
    label, i = g.label, g.index
    remedy = _SWITCH_REMEDY.format(i=i)
    if g.nvlinks:
        # Links of a MIG GPU read down (DCGM MonitorNVLinkStatus, bug 200682374): not judged then.
        # A GPU whose links are all down and name no far end has no bridge fitted: how it was built.
        links = g.nvlinks
        down = [n for n in links if n.up is False]
        bridged = any(n.up for n in links) or any(n.remote_bus_id for n in links)
        if down and judge_status and bridged:
            far = _far_ends(down)
            j.add(
                "nvlink_down",
                label,
                i,
                f"{label}: {len(down)} of its {len(links)} NVLinks are down (link "
                f"{', '.join(str(n.link) for n in down)}{far})",
                remedy,
            )
        _nvlink_counters(j, g, g0, window_s, remedy)
        _nvlink_totals(j, g, g0, window_s, remedy)
    _fabric(j, g)


def effective_ber_exceeded(raw: int) -> bool:
    """DCGM's effective BER threshold, 1e-12, on NVML's encoding as DCGM compares it (common/DcgmUtilities.cpp
    IsEffectiveBerThresholdExceeded at 72fa3fe): 15e-255 is a zero BER; worse than the threshold is an
    exponent below 12, 12 with a mantissa above 1, or 13 with a mantissa above 10."""
    mantissa, exponent = ber_parts(raw)
    if (mantissa, exponent) == (15, 255):
        return False
    return exponent < 12 or (exponent == 12 and mantissa > 1) or (exponent == 13 and mantissa > 10)


# DCGM_SYMBOL_BER_FLOOR_EXP_AGGREGATED (common/DcgmGPUHardwareLimits.h at 72fa3fe): the floor exponent of
# the aggregated symbol BER of a Blackwell (NVLink5) GPU, with a floor mantissa of 15.
SYMBOL_BER_FLOOR_EXP = 238


def symbol_ber_exceeded(raw: int) -> bool:
    """DCGM's symbol BER test (modules/health/DcgmHealthWatch.cpp IsSymbolBerThresholdExceeded, lines
    55-73 at 72fa3fe): a zero mantissa is healthy; otherwise worse than 15e-238 (the aggregated floor) is
    exceeded. "Symbol means FEC didn't succeed to fix the error": DCGM expects none at all."""
    mantissa, exponent = ber_parts(raw)
    if mantissa == 0:
        return False
    if exponent == SYMBOL_BER_FLOOR_EXP:
        return mantissa > 15
    return exponent < SYMBOL_BER_FLOOR_EXP


def _nvlink_totals(
    j: _Judge, g: GpuHealth, g0: GpuHealth | None, window_s: float | None, remedy: str
) -> None:
    """The GPU-wide NVLink signals DCGM 4.6 MonitorNVLink5Fields judges (DcgmHealthWatch.cpp lines
    2807-2947 at 72fa3fe): a rise of the NVLink ECC data error total (field 160) by
    DCGM_LIMIT_MAX_NVLINK_ERROR, and the effective and symbol BER, which are levels: read once, in the
    second sample, a bad link is flagged even when no counter moves in the window."""
    label, i = g.label, g.index
    if g0 is not None:
        rise = _rise(g0.nvlink_ecc_data_errors, g.nvlink_ecc_data_errors)
        if rise and rise >= j.t.limit("nvlink_ecc_data_rise"):
            w = _secs(window_s) if window_s else "the window"
            j.add(
                "nvlink_ecc_data_rise",
                label,
                i,
                f"{label}: NVLink ECC data errors rose by {rise} in {w} (NVML field 160, every link; "
                f"{g.nvlink_ecc_data_errors} in all)",
                remedy,
            )
    levels = (
        (
            "nvlink_effective_ber",
            g.nvlink_effective_ber_raw,
            effective_ber_exceeded,
            "effective BER {} is worse than 1e-12 (NVML field 220, every link; a level: the links are bad "
            "even while no error counter moves)",
        ),
        (
            "nvlink_symbol_ber",
            g.nvlink_symbol_ber_raw,
            symbol_ber_exceeded,
            "symbol BER {} is above its floor (15e-238; NVML field 222, every link): errors FEC did not "
            "correct",
        ),
    )
    for rule, raw, exceeded, words in levels:
        if raw is not None and exceeded(raw):
            j.add(rule, label, i, f"{label}: NVLink " + words.format(ber_words(raw)), remedy)


def _far_ends(links: Sequence[NvlinkHealth]) -> str:
    kinds = {n.remote_kind for n in links if n.remote_kind}
    if kinds == {"switch"}:
        return ", to NVSwitches"
    return ""


def _nvlink_counters(
    j: _Judge, g: GpuHealth, g0: GpuHealth | None, window_s: float | None, remedy: str
) -> None:
    label, i = g.label, g.index
    before = {n.link: n for n in (g0.nvlinks or ())} if g0 is not None else {}
    rises: dict[str, dict[int, int]] = {"replay": {}, "recovery": {}, "CRC flit": {}, "CRC data": {}}
    history = 0
    for n in g.nvlinks or ():
        history += (n.replay_errors or 0) + (n.recovery_errors or 0)
        prev = before.get(n.link)
        if prev is None:
            continue
        for kind, attr in (
            ("replay", "replay_errors"),
            ("recovery", "recovery_errors"),
            ("CRC flit", "crc_flit_errors"),
            ("CRC data", "crc_data_errors"),
        ):
            value = _rise(getattr(prev, attr), getattr(n, attr))
            if value:
                rises[kind][n.link] = value
    w = _secs(window_s) if window_s else "the window"
    _nvlink5(j, g, before, w)
    for kind, rule in (("replay", "nvlink_replay_rise"), ("recovery", "nvlink_recovery_rise")):
        total = sum(rises[kind].values())
        if total and total >= j.t.limit(rule):
            what = f"{label}: NVLink {kind} errors rose by {total} in {w} ({_per_link(rises[kind])})"
            j.add(rule, label, i, what, remedy)
    # DCGM MonitorNVLink4Fields judges each counter (flit and data) against the rate on its own: 60/s of
    # each is two counters below 100/s, not 120/s.
    for kind in ("CRC flit", "CRC data"):
        crc = sum(rises[kind].values())
        if not crc or not window_s:
            continue
        per_s = crc / window_s
        if per_s >= j.t.limit("nvlink_crc_per_s"):
            j.add(
                "nvlink_crc_per_s",
                label,
                i,
                f"{label}: NVLink {kind} errors rose by {crc} in {w} ({per_s:.0f}/s; limit "
                f"{j.t.limit('nvlink_crc_per_s'):g}/s per counter; {_per_link(rises[kind])})",
                remedy,
            )
        elif crc >= j.t.limit("nvlink_crc_rise"):
            j.add(
                "nvlink_crc_rise",
                label,
                i,
                f"{label}: NVLink {kind} errors rose by {crc} in {w} ({per_s:.1f}/s, below "
                f"{j.t.limit('nvlink_crc_per_s'):g}/s; {_per_link(rises[kind])})",
            )
    if history > j.t.limit("nvlink_errors_history") and not rises["replay"] and not rises["recovery"]:
        j.add(
            "nvlink_errors_history",
            label,
            i,
            f"{label}: {history} NVLink replay/recovery errors in the counters' history, none in {w}",
        )


def _nvlink5(j: _Judge, g: GpuHealth, before: Mapping[int, NvlinkHealth], w: str) -> None:
    """NVLink5 error counters (Blackwell): any rise of one fails in DCGM (MonitorNVLink5Fields,
    MonitorNVLinkErrorFields, DCGM_LIMIT_MAX_NVLINK_ERROR = 1); each counter judged on its own."""
    rises: dict[int, dict[int, int]] = {}
    for n in g.nvlinks or ():
        prev = before.get(n.link)
        if n.nvl5 is None or prev is None or prev.nvl5 is None:
            continue
        old = dict(prev.nvl5)
        for field_id, total in n.nvl5:
            rise = _rise(old.get(field_id), total)
            if rise:
                rises.setdefault(field_id, {})[n.link] = rise
    for field_id, by_link in sorted(rises.items()):
        total = sum(by_link.values())
        if total >= j.t.limit("nvlink5_error_rise"):
            j.add(
                "nvlink5_error_rise",
                g.label,
                g.index,
                f"{g.label}: NVLink5 {NVLINK5_COUNTERS.get(field_id, f'field {field_id}')} errors rose by "
                f"{total} in {w} (NVML field {field_id}; {_per_link(by_link)})",
                _SWITCH_REMEDY.format(i=g.index),
            )


def _per_link(rises: Mapping[int, int], shown: int = 6) -> str:
    parts = [f"link {k}: +{v}" for k, v in sorted(rises.items())]
    more = f" and {len(parts) - shown} more links" if len(parts) > shown else ""
    return ", ".join(parts[:shown]) + more


_FABRIC_HEALTH = (
    # (shift, words) of the 2-bit NVML_GPU_FABRIC_HEALTH_MASK_* fields where 1 (TRUE) is the fault; 0 is
    # "not supported" and 2 (FALSE) fine, so 0xaa, 0x1aa and 0x80 are healthy masks (nvml.h).
    (0, "bandwidth degraded"),
    (2, "route recovery in progress"),
    (4, "route unhealthy"),
    (6, "access timeout recovery in progress"),
)
# NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_* (4 bits at shift 8): 0 not supported, 1 none.
_FABRIC_CONFIG = {
    2: "incorrect system GUID",
    3: "incorrect chassis serial number",
    4: "no partition",
    5: "insufficient NVLinks",
    6: "incompatible GPU firmware",
    7: "invalid location",
    8: "GPU state invalid",
}
# NVML_GPU_FABRIC_HEALTH_MASK_PARTITION_ASSIGNED_* (2 bits at shift 12; nvidia-ml-py 13.615's pynvml.py,
# nvml.h r580): the one field whose 1 (TRUE) is the good value; 2 (FALSE) says the GPU is in no partition.
# DCGM 4.6 MonitorFabricFields does not read it.
_PARTITION_SHIFT, _PARTITION_FALSE = 12, 2
_FABRIC_REMEDY = (
    "check that nvidia-fabricmanager (or the NVLink subnet manager on NVL systems) runs and its log "
    "(`systemctl status nvidia-fabricmanager`); then reset GPU {i} or reboot"
)


def fabric_mask_faults(mask: int) -> list[str]:
    """The faults a fabric health mask names, as DCGM 4.6 MonitorFabricFields reads it
    (modules/health/DcgmHealthWatch.cpp at 72fa3fe, lines 3612-3674: each 2-bit field TRUE, and an
    incorrect configuration other than NOT_SUPPORTED or NONE, fail), and PARTITION_ASSIGNED FALSE, which
    DCGM does not read, by its own polarity."""
    bad = [words for shift, words in _FABRIC_HEALTH if (mask >> shift) & 0x3 == 1]
    config = (mask >> 8) & 0xF
    if config not in (0, 1):
        bad.append(_FABRIC_CONFIG.get(config, f"incorrect configuration (code {config})"))
    if (mask >> _PARTITION_SHIFT) & 0x3 == _PARTITION_FALSE:
        bad.append("partition not assigned (PARTITION_ASSIGNED FALSE)")
    return bad


def _fabric(j: _Judge, g: GpuHealth) -> None:
    """The fabric as DCGM 4.6 MonitorFabricFields judges it: the health mask first, whatever the
    registration's state (any 2-bit field TRUE, an incorrect configuration other than none: fail), then
    the registration (DCGM_FI_DEV_FABRIC_MANAGER_STATUS, lines 3676-3735: in progress warns; not started,
    failed: fail), then the summary and rack checks beside it. One fault is one finding per GPU: a mask
    fault names the registration's state in its words, not in a second finding."""
    label, i = g.label, g.index
    if g.fabric_state is None:
        return
    remedy = _FABRIC_REMEDY.format(i=i)
    state = FABRIC_STATES.get(g.fabric_state, f"state {g.fabric_state}")
    mask = g.fabric_health_mask or 0
    summary = g.fabric_health_summary
    bad = fabric_mask_faults(mask)
    said = " (health summary UNHEALTHY)" if summary == FABRIC_SUMMARY_UNHEALTHY else ""
    failed = g.fabric_state == FABRIC_COMPLETED and g.fabric_status not in (None, 0)
    clique = f" (clique {g.fabric_clique_id})" if g.fabric_clique_id is not None else ""
    if failed:
        registration = f"registration completed with {nvml_return_words(g.fabric_status or 0)}{clique}"
    else:
        registration = f"registration {state}"
    if bad:
        settled = g.fabric_state == FABRIC_COMPLETED and not failed
        during = "" if settled else f"; NVLink fabric {registration}"
        j.add(
            "fabric_unhealthy",
            label,
            i,
            f"{label}: fabric health: {', '.join(bad)} (mask 0x{mask:x}){said}{during}",
            remedy,
        )
        return
    if g.fabric_state == FABRIC_NOT_SUPPORTED:
        return
    if g.fabric_state == FABRIC_IN_PROGRESS:
        j.add(
            "fabric_in_progress",
            label,
            i,
            f"{label}: NVLink fabric registration in progress: CUDA cannot start on it (error 802, 'system "
            "not yet initialized') until it completes",
            remedy,
        )
        return
    if g.fabric_state != FABRIC_COMPLETED:
        j.add(
            "fabric_not_ready",
            label,
            i,
            f"{label}: NVLink fabric {registration}: CUDA cannot start on it (error 802, 'system not "
            "yet initialized') even while its NVLinks read up",
            remedy,
        )
        return
    if failed:
        j.add("fabric_not_ready", label, i, f"{label}: NVLink fabric {registration}", remedy)
        return
    if summary == FABRIC_SUMMARY_UNHEALTHY:
        j.add(
            "fabric_summary_unhealthy",
            label,
            i,
            f"{label}: the fabric's health summary is UNHEALTHY though its health mask (0x{mask:x}) names no "
            f"fault ({_bandwidth_words(mask)})",
            remedy,
        )
    elif summary == FABRIC_SUMMARY_LIMITED:
        j.add(
            "fabric_limited_capacity",
            label,
            i,
            f"{label}: the fabric runs at limited capacity: {_bandwidth_words(mask)}; NCCL still runs over "
            "it, slower",
            remedy,
        )
    elif not mask and not summary:
        j.skip(label, "fabric health", "the driver answers every fabric health field not supported")
    if (
        g.platform_chassis_serial
        and g.platform_tray_index is not None
        and not domain_id(g.fabric_cluster_uuid, g.fabric_clique_id)
    ):
        if g.fabric_cluster_uuid is None:  # a v1-only driver: no UUID to judge
            return
        j.add(
            "fabric_no_domain",
            label,
            i,
            f"{label}: the platform places it in rack {g.platform_chassis_serial} tray "
            f"{g.platform_tray_index}, but its completed registration names no NVLink domain (cluster UUID "
            f"{g.fabric_cluster_uuid}, clique {g.fabric_clique_id}): multi-node NVLink cannot reach it",
            remedy,
        )


def _bandwidth_words(mask: int) -> str:
    """What the mask says of the NVLink bandwidth left."""
    field = mask & 0x3
    return {1: "bandwidth degraded", 2: "bandwidth full"}.get(field, "bandwidth not reported")


def _fabric_domains(j: _Judge, gpus: Sequence[GpuHealth]) -> None:
    """The GPUs of one tray on different NVLink domains: each GPU off the domain most of them share (the
    lowest GPU's among equals) is a problem, once, unless a fabric rule already found it."""
    faulted = {f.gpu for f in j.found if f.rule and f.rule.startswith("fabric_")}
    named = [
        (g, d)
        for g in gpus
        if g.error is None
        and g.fabric_state == FABRIC_COMPLETED
        and g.fabric_status in (None, 0)
        and (d := domain_id(g.fabric_cluster_uuid, g.fabric_clique_id)) is not None
    ]
    counts: dict[str, int] = {}
    for _, d in named:
        counts[d] = counts.get(d, 0) + 1
    if len(counts) < 2:
        return
    top = max(counts.values())
    main = next(d for _, d in named if counts[d] == top)
    for g, d in named:
        if d != main and g.index not in faulted:
            j.add(
                "fabric_domain_split",
                g.label,
                g.index,
                f"{g.label}: on NVLink domain {d}, while the other GPUs of this node are on {main}: one tray "
                "is split across two domains",
                _FABRIC_REMEDY.format(i=g.index),
            )


def _pcie(j: _Judge, g: GpuHealth, g0: GpuHealth | None, window_s: float | None, busy: bool) -> None:
    label, i = g.label, g.index
    wc, wm, gc, gm = g.pcie_width_current, g.pcie_width_max, g.pcie_gen_current, g.pcie_gen_max
    link_remedy = (
        "check the slot and riser (reseat the card), and the BIOS PCIe settings; `nvidia-smi -q -d PCIE` "
        "shows the link and `lspci -vv` the slot; bandwidth estimates count this GPU at its current width"
    )
    replay_rise = _rise(g0.pcie_replays, g.pcie_replays) if g0 is not None and window_s else None
    if wc is not None and wm is not None and wc < wm:
        rule = "pcie_width_busy" if busy else "pcie_width_idle"
        state = "while busy" if busy else "(idle)"
        if replay_rise:
            # A narrow link that also replays is failing, not just slow.
            j.add(
                rule,
                label,
                i,
                f"{label}: PCIe link trained at x{wc} of x{wm} {state}, and its replays rose by "
                f"{replay_rise} in {_secs(window_s)}",
                link_remedy,
                severity=PROBLEM,
                action="replace",
            )
        else:
            j.add(
                rule,
                label,
                i,
                f"{label}: PCIe link trained at x{wc} of x{wm} {state}: a slow link, ranked lower",
                link_remedy,
            )
    if busy and gc is not None and gm is not None and gc < gm:
        j.add(
            "pcie_gen_busy",
            label,
            i,
            f"{label}: PCIe link at Gen{gc} of Gen{gm} while busy",
        )
    if g0 is None or window_s is None:
        return
    rise = _rise(g0.pcie_replays, g.pcie_replays)
    gen = gc or gm
    width = wc or wm
    if rise is None or not rise:
        return
    if gen is None or width is None:
        j.skip(label, "PCIe replay rate", "the link generation or width is unknown")
        return
    per_min = expected_pcie_replays_per_min(gen, width, j.t.limit("pcie_replay_rate"))
    # DCGM MonitorPcie counts the replays over a minute (startTime = now - 60 s) against the per-minute
    # rate: a window shorter than a minute is judged as if the minute had no other replay, never scaled up
    # (one replay in 2 s is not 30 a minute); a longer window (since the last run) as its rate per minute.
    rate = rise * 60 / max(window_s, 60.0)
    if rate > per_min:
        j.add(
            "pcie_replay_rate",
            label,
            i,
            f"{label}: PCIe replays rose by {rise} in {_secs(window_s)} ({rate:.0f}/min; a Gen{gen} x{width} "
            f"link at BER {j.t.limit('pcie_replay_rate'):g} allows {per_min}/min)",
        )


_CLOCK_RULES: tuple[tuple[int, str, str], ...] = (
    (CLOCKS_HW_SLOWDOWN, "clocks_hw_slowdown", "hardware slowdown"),
    (CLOCKS_HW_THERMAL, "clocks_hw_thermal", "hardware thermal slowdown"),
    (CLOCKS_SW_THERMAL, "clocks_sw_thermal", "software thermal slowdown"),
    (CLOCKS_HW_POWER_BRAKE, "clocks_hw_power_brake", "hardware power brake"),
)


def _clocks(j: _Judge, g: GpuHealth, g0: GpuHealth | None) -> None:
    """A clocks event bit counts only when both samples show it: one read catches transients (a power
    brake pulse, a boost step) that no job notices."""
    reasons = g.clocks_event_reasons
    if reasons is None:
        return
    label, i = g.label, g.index
    before = g0.clocks_event_reasons if g0 is not None else None
    if before is None:
        if any(reasons & bit for bit, _, _ in _CLOCK_RULES):
            j.skip(label, "clocks event reasons", "seen in one sample only (a bit must hold in both)")
        return
    held = reasons & before
    if any((reasons & ~before) & bit for bit, _, _ in _CLOCK_RULES):
        j.skip(label, "clocks event reasons", "seen in one sample only (a bit must hold in both)")
    evidence = _thermal_evidence(g)
    for bit, rule, words in _CLOCK_RULES:
        if held & bit:
            j.add(
                rule,
                label,
                i,
                f"{label}: clocks held down by {words} (clocks event reasons 0x{reasons:x}{evidence})",
                "check the cooling (fans, airflow, inlet temperature) and the power supply; "
                f"`nvidia-smi -q -d PERFORMANCE -i {i}` shows the reasons; if it persists at normal "
                "temperature, the GPU needs service",
            )


def _thermal_evidence(g: GpuHealth) -> str:
    parts = []
    if g.temperature_c is not None:
        parts.append(f"{g.temperature_c} C")
    if g.power_w is not None and g.power_limit_w is not None:
        parts.append(f"{g.power_w:.0f} W of {g.power_limit_w:.0f} W")
    return "; " + ", ".join(parts) if parts else ""


_RECOVERY_FINDING: dict[int, tuple[str, str]] = {
    # action: (finding action, remedy)
    1: ("reset", "drain the GPU and reset it (`nvidia-smi -r -i {i}`)"),
    2: ("reboot", "drain the node and reboot it"),
    3: ("monitor", "keep peer-to-peer work (NVLink/P2P jobs) off the GPU until it is reset; other jobs run"),
    4: ("drain", "drain the GPU, then reset it (`nvidia-smi -r -i {i}`)"),
    5: ("drain", "recover the IMEX domain (restart nvidia-imex on its nodes)"),
    6: ("reset", "drain the GPU and reset its PCIe bus (a node reboot does it too)"),
    7: ("reboot", "drain the node and reboot it (a full power cycle)"),
}
# NVML_GPU_RECOVERY_ACTION_DRAIN_P2P: the one action with its own rule (a note; DCGM warns).
_DRAIN_P2P = 3


def drains_p2p(f: Finding) -> bool:
    """True for the finding of a GPU whose driver asks to drain P2P (recovery action DRAIN_P2P, 3): the one
    test every command (recommend, run, doctor, probe) uses to keep it out of multi-GPU sets."""
    return f.rule == "recovery_drain_p2p" and f.gpu is not None


def p2p_drained(findings: Iterable[Finding]) -> dict[int, str]:
    """GPU index -> the finding's words, for each GPU whose driver asks to drain P2P (``drains_p2p``)."""
    return {f.gpu: f.what for f in findings if f.gpu is not None and drains_p2p(f)}


def _driver(j: _Judge, g: GpuHealth) -> None:
    label, i = g.label, g.index
    action = g.recovery_action
    if action is not None and action != RECOVERY_NONE:
        words = RECOVERY_ACTIONS.get(action, f"action {action}")
        what_to_do, remedy = _RECOVERY_FINDING.get(action, ("drain", "drain the GPU and see `nvidia-smi -q`"))
        what = f"{label}: the driver asks for recovery: {words} (NVML recovery action {action})"
        if action == _DRAIN_P2P:
            j.add("recovery_drain_p2p", label, i, what, remedy.format(i=i))
        else:
            j.add("recovery_action", label, i, what, remedy.format(i=i), action=what_to_do)
    if g.persistence_mode is False:
        j.add(
            "persistence_off",
            label,
            i,
            f"persistence mode is off on {label}",
        )


def judge_one(sample: HealthSample, **kw: object) -> Judgement:
    """``judge`` on a single sample: states only; the counter rules are listed as not checked."""
    return judge(None, sample, None, **kw)  # type: ignore[arg-type]
