"""DCGM's health watches and Xid mappings as data, transcribed from NVIDIA/DCGM at 72fa3fe
(modules/health/DcgmHealthWatch.cpp): each Monitor* function with the severities its SetResponse calls
give (DCGM_HEALTH_RESULT_WARN / _FAIL), and BuildXidMappings' devastating and per-subsystem Xids.
tests/test_check_rules.py walks gputopo's rule and Xid tables against these, and checks this transcription
against the DCGM source where a copy of it is at hand."""

from __future__ import annotations

DCGM_COMMIT = "72fa3feaa67d716a75323a8f47c34ff3ee73f824"

# Monitor function -> the severities it reports.
WATCHES: dict[str, frozenset[str]] = {
    "MonitorPcie": frozenset({"warn"}),
    "MonitorMemVolatileDbes": frozenset({"fail"}),
    "MonitorMemRetiredPending": frozenset({"warn"}),
    "MonitorMemSbeDbeRetiredPages": frozenset({"fail"}),
    "MonitorMemRowRemapFailures": frozenset({"fail"}),
    "MonitorMemRowRemapUncorrectable": frozenset({"warn"}),
    "MonitorMemUnrepairableFlag": frozenset({"fail"}),
    "MonitorGpuRecoveryAction": frozenset({"warn", "fail"}),
    "MonitorThermal": frozenset({"warn"}),
    "MonitorPower": frozenset({"warn"}),
    "MonitorNVLink4Fields": frozenset({"warn", "fail"}),
    "MonitorNVLink5Fields": frozenset({"fail"}),
    "MonitorNVLinkStatus": frozenset({"fail"}),
    "MonitorFabricFields": frozenset({"warn", "fail"}),
    "MonitorImex": frozenset({"fail"}),  # global: domain DOWN/DEGRADED, daemon not READY/UNAVAILABLE/-1/-2
}

# Watches gputopo has no rule for, and why (each must stay explained).
NOT_COVERED = {}

# Xid -> DCGM's severity (BuildXidMappings: m_devastatingXids and m_subsystemXids).
XIDS: dict[int, str] = {
    48: "fail", 74: "fail", 79: "fail", 94: "warn", 95: "fail", 119: "fail", 120: "fail", 140: "fail",
    31: "warn", 32: "warn", 43: "warn", 63: "warn", 64: "fail",
    38: "warn", 39: "warn", 42: "warn",
    60: "warn", 61: "warn", 62: "warn",
    54: "warn", 56: "warn", 57: "warn", 58: "warn", 78: "warn",
    67: "warn", 73: "warn", 121: "warn", 137: "warn",
    93: "warn",
}  # fmt: skip
