"""The health rules as data: one table, each rule with its limit, what it means, what to do, and its source.

DCGM keeps its health limits in ``common/DcgmGPUHardwareLimits.h`` and applies them in
``modules/health/DcgmHealthWatch.cpp`` (NVIDIA/DCGM, read at 72fa3fe); the rules here follow it, and say
where they differ. A user overrides any rule with ``--thresholds FILE`` (TOML or JSON)::

    # thresholds.toml
    nvlink_crc_per_s = 200            # a number sets the rule's limit
    [pcie_width_idle]
    severity = "problem"              # or a table: limit, severity, action, enabled
    [persistence_off]
    enabled = false

A name this table does not have, a key a rule does not have, or a value of the wrong kind is refused
(``UsageError``, exit 2): a typo must not silently turn a check off.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gputopo.errors import InputError, UsageError
from gputopo.findings import ACTIONS, NOTE, PROBLEM, SEVERITIES
from gputopo.inputs import loads_bounded

DCGM_LIMITS = "DCGM common/DcgmGPUHardwareLimits.h"
DCGM_WATCH = "DCGM modules/health/DcgmHealthWatch.cpp"
XID_CATALOG = "NVIDIA Xid catalog, docs.nvidia.com/deploy/xid-errors"
NVML_DOCS = "NVML API reference (nvml.h)"


@dataclass(frozen=True)
class Rule:
    """One health rule. ``limit`` is the number the rule compares against (``None`` when the rule is a
    plain yes/no); ``unit`` says what the number counts; ``source`` where the rule comes from."""

    name: str
    category: str
    severity: str
    action: str
    limit: float | None
    unit: str
    meaning: str
    source: str
    enabled: bool = True


# fmt: off
_RULES = (
    # --- memory -------------------------------------------------------------------------------------------
    Rule(
        "ecc_volatile_uncorrected", "memory", PROBLEM, "reset", 0, "errors since the driver loaded (>)",
        "uncorrectable ECC errors since the driver loaded",
        f"{DCGM_WATCH} MonitorMemVolatileDbes: any volatile DBE fails",
    ),
    Rule(
        "ecc_aggregate_uncorrected", "memory", NOTE, "monitor", 0, "errors over the GPU's life (>)",
        "uncorrectable ECC errors in the GPU's history (a note: the volatile count says what is current)",
        "gputopo policy (docs/health-rules.md): totals are history",
    ),
    Rule(
        "row_remap_failure", "memory", PROBLEM, "replace", None, "",
        "a row remapping failed: the memory cannot be repaired",
        f"{DCGM_WATCH} MonitorMemRowRemapFailures (fail)",
    ),
    Rule(
        "row_remap_pending", "memory", PROBLEM, "reset", None, "",
        "a row remapping is pending: a GPU reset applies it",
        "NVML nvmlDeviceGetRemappedRows (isPending); Xid 63 'reset gpu to activate'",
    ),
    Rule(
        "remapped_rows_uncorrected", "memory", PROBLEM, "replace", 512, "rows (>=)",
        "rows remapped for uncorrectable errors reach DCGM's limit",
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_ROW_REMAP_UNCORRECTABLE = 512",
    ),
    Rule(
        "retired_pages_pending", "memory", PROBLEM, "reset", None, "",
        "pages are pending retirement: a GPU reset (or reboot) retires them",
        f"{DCGM_WATCH} MonitorMemRetiredPending",
    ),
    Rule(
        "retired_pages", "memory", PROBLEM, "replace", 63, "pages, SBE + DBE (>=)",
        "retired pages (single- plus double-bit) reach DCGM's limit",
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_RETIRED_PAGES = 63",
    ),
    Rule(
        "ecc_off", "config", NOTE, "config", None, "",
        "ECC is off on a GPU that has it: memory errors go undetected",
        "NVML nvmlDeviceGetEccMode",
    ),
    # --- NVLink -------------------------------------------------------------------------------------------
    Rule(
        "nvlink_down", "nvlink", PROBLEM, "reset", None, "",
        "an NVLink the GPU has is down",
        f"{DCGM_WATCH} MonitorNVLinkStatus (fail; a MIG GPU's links read down: skipped, as DCGM does)",
    ),
    Rule(
        "nvlink_replay_rise", "nvlink", PROBLEM, "reset", 1, "errors in the window (>=)",
        "NVLink replay errors rising",
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_NVLINK_ERROR = 1; replay and recovery fail in MonitorNVLink4Fields",
    ),
    Rule(
        "nvlink_recovery_rise", "nvlink", PROBLEM, "reset", 1, "errors in the window (>=)",
        "NVLink recovery errors rising",
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_NVLINK_ERROR = 1",
    ),
    Rule(
        "nvlink_crc_rise", "nvlink", NOTE, "monitor", 1, "errors in the window (>=)",
        "NVLink CRC errors rising, below the rate that matters",
        f"{DCGM_WATCH} MonitorNVLink4Fields (warn below the rate)",
    ),
    Rule(
        "nvlink_crc_per_s", "nvlink", PROBLEM, "reset", 100, "errors per second (>=)",
        "NVLink CRC errors rising at a rate that matters",
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_NVLINK_CRC_ERROR = 100.0 (CRC errors matter at 100+ per second)",
    ),
    Rule(
        "nvlink_errors_history", "nvlink", NOTE, "monitor", 0, "errors since the counters were reset (>)",
        "NVLink replay/recovery errors in the counters' history (not rising now)",
        "gputopo policy (docs/health-rules.md): totals are history",
    ),
    Rule(
        "fabric_not_ready", "nvlink", PROBLEM, "drain", None, "",
        "the GPU's NVLink fabric registration is not complete: CUDA cannot start on it (error 802)",
        "NVML nvmlDeviceGetGpuFabricInfo (state, status)",
    ),
    Rule(
        "fabric_unhealthy", "nvlink", PROBLEM, "drain", None, "",
        "the fabric reports the GPU unhealthy (degraded bandwidth, bad route, bad config)",
        f"{DCGM_WATCH} MonitorFabricFields (health mask: fail)",
    ),
    # --- PCIe ---------------------------------------------------------------------------------------------
    Rule(
        "pcie_replay_rate", "pcie", PROBLEM, "monitor", 1e-12, "bit error rate per lane",
        "PCIe replays rising faster than a link at this bit error rate would replay",
        f"{DCGM_WATCH} GetExpectedPcieReplayRate: gen speed x 1e-12 x 60 per lane per minute (warn)",
    ),
    Rule(
        "pcie_width_idle", "pcie", NOTE, "monitor", None, "",
        "the PCIe link runs narrower than its maximum (idle GPU)",
        "gputopo policy (docs/health-rules.md): a narrow link is named; idle GPUs keep their width",
    ),
    Rule(
        "pcie_width_busy", "pcie", PROBLEM, "replace", None, "",
        "the PCIe link runs narrower than its maximum while the GPU works",
        "gputopo policy (docs/health-rules.md): narrow while busy is a problem (slot, riser or card)",
    ),
    Rule(
        "pcie_gen_busy", "pcie", PROBLEM, "monitor", None, "",
        "the PCIe link runs below its maximum generation while the GPU works (idle GPUs lower it on purpose)",
        "gputopo's link finding (model.Gpu.pcie_below_max_while_busy)",
    ),
    # --- clocks, thermal, power ---------------------------------------------------------------------------
    Rule(
        "clocks_hw_slowdown", "power", PROBLEM, "drain", None, "",
        "clocks held down by hardware slowdown (temperature, power brake or power draw too high)",
        "NVML nvmlClocksEventReasonHwSlowdown (0x8); DCGM MonitorPower/MonitorThermal violations",
    ),
    Rule(
        "clocks_hw_thermal", "thermal", PROBLEM, "drain", None, "",
        "clocks held down by hardware thermal slowdown",
        "NVML nvmlClocksEventReasonHwThermalSlowdown (0x40)",
    ),
    Rule(
        "clocks_sw_thermal", "thermal", PROBLEM, "monitor", None, "",
        "clocks held down by software thermal slowdown (the GPU is above its maximum operating temperature)",
        "NVML nvmlClocksEventReasonSwThermalSlowdown (0x20); DCGM MonitorThermal (warn)",
    ),
    Rule(
        "clocks_hw_power_brake", "power", PROBLEM, "drain", None, "",
        "clocks held down by the external power brake",
        "NVML nvmlClocksEventReasonHwPowerBrakeSlowdown (0x80)",
    ),
    # --- driver, config, node -----------------------------------------------------------------------------
    Rule(
        "recovery_action", "driver", PROBLEM, "reset", None, "",
        "the driver asks for a recovery action",
        f"NVML field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (r570+); {DCGM_WATCH} MonitorGpuRecoveryAction",
    ),
    Rule(
        "gpu_unreadable", "driver", PROBLEM, "reset", None, "",
        "the GPU does not answer NVML",
        "NVML: GPU is lost / reset required / no answer within the deadline",
    ),
    Rule(
        "persistence_off", "config", NOTE, "config", None, "",
        "persistence mode is off: the driver tears the GPU down between jobs (slow starts, lost state)",
        "NVIDIA driver persistence docs (nvidia-persistenced)",
    ),
    Rule(
        "expect_gpus", "topology", PROBLEM, "drain", None, "GPUs",
        "fewer GPUs than expected (--expect-gpus)",
        "gputopo policy (docs/health-rules.md); aznhc and NHC check the GPU count the same way",
    ),
    # --- Xid ----------------------------------------------------------------------------------------------
    Rule(
        "xid_hardware", "xid", PROBLEM, "reset", None, "",
        "a hardware Xid in the kernel log within the window",
        f"{XID_CATALOG}; {DCGM_WATCH} BuildXidMappings",
    ),
    Rule(
        "xid_application", "xid", NOTE, "none", None, "",
        "an application Xid in the kernel log (a program's fault, not the GPU's)",
        XID_CATALOG,
    ),
    Rule(
        "xid_unknown", "xid", NOTE, "monitor", None, "",
        "an Xid gputopo's table does not classify, or one for a PCI address this machine lacks",
        XID_CATALOG,
    ),
)
# fmt: on

RULES: dict[str, Rule] = {r.name: r for r in _RULES}

_OVERRIDABLE = ("limit", "severity", "action", "enabled")


@dataclass(frozen=True)
class Thresholds:
    """The rule table in force: the defaults with a user's overrides applied. ``source`` names the file."""

    rules: Mapping[str, Rule]
    source: str | None = None

    def __getitem__(self, name: str) -> Rule:
        return self.rules[name]

    def limit(self, name: str) -> float:
        """The rule's numeric limit (every rule asked for one has one)."""
        value = self.rules[name].limit
        assert value is not None, name
        return value


DEFAULT_THRESHOLDS = Thresholds(RULES)

_HINT = (
    "a thresholds file maps rule names to a limit (nvlink_crc_per_s = 200) or a table with limit, severity "
    "(problem|note), action and enabled; names: " + ", ".join(RULES)
)


def parse_thresholds(text: str, source: str, fmt: str | None = None) -> Thresholds:
    """Thresholds from the text of a TOML or JSON file (``fmt`` ``toml``/``json``; by default JSON when the
    text starts with ``{``, TOML otherwise). ``UsageError`` (exit 2) for anything it cannot take."""
    fmt = fmt or ("json" if text.lstrip().startswith("{") else "toml")
    try:
        doc = loads_bounded(text, f"--thresholds {source}") if fmt == "json" else _toml_loads(text)
    except (ValueError, TypeError) as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"--thresholds {source}: not valid {fmt.upper()}: {first}", _HINT) from None
    if not isinstance(doc, dict):
        raise UsageError(f"--thresholds {source}: expected a table of rules, got {type(doc).__name__}", _HINT)
    rules = dict(RULES)
    for name, value in doc.items():
        if name not in RULES:
            raise UsageError(f"--thresholds {source}: unknown rule {name!r}", _HINT)
        rules[name] = _override(RULES[name], value, source)
    return Thresholds(rules, source)


def load_thresholds(path: Path) -> Thresholds:
    """Thresholds from ``path`` (``.json`` is JSON, anything else TOML unless it starts with ``{``)."""
    from gputopo.inputs import read_capped

    label = f"--thresholds {path}"
    try:
        data = read_capped(path, label, cap=1_000_000, hint=_HINT)
    except InputError as exc:
        raise UsageError(f"{label}: cannot read it ({exc.message[len(label) + 2 :]})", _HINT) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--thresholds {path}: not UTF-8 text", _HINT) from None
    fmt = "json" if path.suffix.lower() == ".json" else None
    return parse_thresholds(text, str(path), fmt)


def _toml_loads(text: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        try:
            import tomli as tomllib
        except ImportError:
            raise UsageError(
                "--thresholds: TOML needs Python 3.11 or later (or the tomli package) to read",
                'write the thresholds file as JSON, e.g. {"nvlink_crc_per_s": 200}',
            ) from None
    return tomllib.loads(text)


def _override(rule: Rule, value: Any, source: str) -> Rule:
    where = f"--thresholds {source}: {rule.name}"
    if not isinstance(value, dict):
        value = {"limit": value}
    changes: dict[str, Any] = {}
    for key, v in value.items():
        if key not in _OVERRIDABLE:
            raise UsageError(f"{where}: unknown key {key!r} (one of {', '.join(_OVERRIDABLE)})", _HINT)
        if key == "limit":
            if rule.limit is None:
                raise UsageError(f"{where}: this rule has no limit to set (yes/no rule)", _HINT)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise UsageError(f"{where}: limit must be a number >= 0, got {v!r}", _HINT)
            changes["limit"] = float(v)
        elif key == "severity":
            if v not in SEVERITIES:
                raise UsageError(f"{where}: severity must be problem or note, got {v!r}", _HINT)
            changes["severity"] = v
        elif key == "action":
            if v not in ACTIONS:
                raise UsageError(f"{where}: action must be one of {', '.join(ACTIONS)}, got {v!r}", _HINT)
            changes["action"] = v
        else:
            if not isinstance(v, bool):
                raise UsageError(f"{where}: enabled must be true or false, got {v!r}", _HINT)
            changes["enabled"] = v
    return replace(rule, **changes)
