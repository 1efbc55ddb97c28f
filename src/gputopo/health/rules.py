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
from gputopo.findings import ACTIONS, DCGM_FAIL, DCGM_NONE, DCGM_WARN, NOTE, PROBLEM, SEVERITIES

# The row and the finding it makes live beside the finding (gputopo.findings); the table is here, and its
# callers know these names here.
from gputopo.findings import DRAIN_ACTIONS as DRAIN_ACTIONS
from gputopo.findings import NOT_DCGM as NOT_DCGM
from gputopo.findings import Rule as Rule
from gputopo.inputs import loads_bounded
from gputopo.topology.pcie_path import NCCL_ACS as NCCL_ACS
from gputopo.topology.pcie_path import RULE_ACS_REDIRECT, RULE_IOMMU_TRANSLATED

DCGM_LIMITS = "DCGM common/DcgmGPUHardwareLimits.h"
DCGM_WATCH = "DCGM modules/health/DcgmHealthWatch.cpp"
XID_CATALOG = "NVIDIA Xid catalog, docs.nvidia.com/deploy/xid-errors"
NVML_DOCS = "NVML API reference (nvml.h)"
NVSENTINEL = "NVSentinel NIC health monitor (docs/nic-health-monitor/link-counter-detection.md)"
NVSENTINEL_STATE = "NVSentinel NIC health monitor (docs/nic-health-monitor/link-state-detection.md)"
DCGM_IMEX = "DCGM dcgmlib/src/DcgmImexManager.cpp"
IMEX_GUIDE = "NVIDIA IMEX guide (docs.nvidia.com/multi-node-nvlink-systems/imex-guide)"
# Where gputopo parts from DCGM on IMEX: DCGM judges every node, and fails one with no daemon at all
# (COMMAND_ERROR, -3: NVIDIA/DCGM #308); gputopo judges only where a daemon is expected.
IMEX_EXPECTED = "judged only where a daemon is expected (node configuration or --expect-imex)"


W = DCGM_WATCH
# fmt: off
_RULES = (
    # --- memory -------------------------------------------------------------------------------------------
    Rule(
        "ecc_volatile_uncorrected", "memory", PROBLEM, "reset", 0, "errors since the driver loaded (>)",
        "uncorrectable ECC errors since the driver loaded",
        f"{W} MonitorMemVolatileDbes: any volatile DBE fails",
        "drain the GPU; a GPU reset (`nvidia-smi -r`) retires or remaps the bad memory; if they "
        "return, open an RMA",
        DCGM_FAIL, f"{W} MonitorMemVolatileDbes",
    ),
    Rule(
        "ecc_aggregate_uncorrected", "memory", NOTE, "monitor", 0, "errors over the GPU's life (>)",
        "uncorrectable ECC errors in the GPU's history (a note: the volatile count says what is current)",
        "gputopo policy (docs/health-rules.md): totals are history",
        "history only; watch the volatile count and the remapped rows",
    ),
    Rule(
        "memory_unrepairable", "memory", PROBLEM, "replace", None, "",
        "the driver flags the GPU's memory as unrepairable (newer drivers)",
        "NVML nvmlDeviceGetUnrepairableMemoryFlag_v1; DCGM 4.6 DCGM_FI_DEV_MEMORY_UNREPAIRABLE",
        "the GPU cannot repair its memory: take it out of service and open an RMA",
        DCGM_FAIL, f"{W} MonitorMemUnrepairableFlag",
    ),
    Rule(
        "row_remap_failure", "memory", PROBLEM, "replace", None, "",
        "a row remapping failed: the memory cannot be repaired",
        f"{W} MonitorMemRowRemapFailures (fail)",
        "the GPU cannot repair its memory any more: take it out of service and open an RMA",
        DCGM_FAIL, f"{W} MonitorMemRowRemapFailures",
    ),
    Rule(
        "row_remap_pending", "memory", NOTE, "reset", None, "",
        "a row remapping is pending: a GPU reset applies it (until then the driver keeps the bad row unused)",
        "NVML nvmlDeviceGetRemappedRows (isPending); NVIDIA Xid catalogue, Xid 63: reset when convenient",
        "drain the GPU and reset it (`nvidia-smi -r -i {i}`) or reboot: the reset applies the remap",
        DCGM_WARN, f"{W} MonitorMemRetiredPending and Xid 63 (warn)",
    ),
    Rule(
        "remapped_rows_uncorrected", "memory", NOTE, "replace", 512, "rows (>=)",
        "rows remapped for uncorrectable errors reach DCGM's limit",
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_ROW_REMAP_UNCORRECTABLE = 512",
        "the memory is wearing out: plan to replace the GPU (RMA)",
        DCGM_WARN, f"{W} MonitorMemRowRemapUncorrectable (warn)",
    ),
    Rule(
        "retired_pages_pending", "memory", NOTE, "reset", None, "",
        "pages are pending retirement: a GPU reset (or reboot) retires them",
        f"{W} MonitorMemRetiredPending (warn)",
        "drain the GPU and reset it (`nvidia-smi -r -i {i}`) or reboot: the reset retires them",
        DCGM_WARN, f"{W} MonitorMemRetiredPending",
    ),
    Rule(
        "retired_pages", "memory", PROBLEM, "replace", 63, "pages, SBE + DBE (>=)",
        "retired pages (single- plus double-bit) reach DCGM's limit",
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_RETIRED_PAGES = 63", "take the GPU out of service and open an RMA",
        DCGM_FAIL, f"{W} MonitorMemSbeDbeRetiredPages",
    ),
    Rule(
        "ecc_off", "config", NOTE, "config", None, "",
        "ECC is off on a GPU that has it: memory errors go undetected",
        "NVML nvmlDeviceGetEccMode",
        "`nvidia-smi -i {i} -e 1` and a GPU reset turn it on, if the workload can spare the memory",
    ),
    # --- NVLink -------------------------------------------------------------------------------------------
    Rule(
        "nvlink_down", "nvlink", PROBLEM, "reset", None, "",
        "an NVLink the GPU has is down (not judged while any GPU of the node is in MIG mode)",
        f"{W} MonitorNVLinkStatus (fail; links to MIG GPUs read down, bug 200682374)",
        "check nvidia-fabricmanager; reset or reseat the GPU",
        DCGM_FAIL, f"{W} MonitorNVLinkStatus",
    ),
    Rule(
        "nvlink_replay_rise", "nvlink", PROBLEM, "reset", 1, "errors in the window (>=)",
        "NVLink replay errors rising",
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_NVLINK_ERROR = 1", "reset the GPU; errors that return need service",
        DCGM_FAIL, f"{W} MonitorNVLink4Fields (replay: fail)",
    ),
    Rule(
        "nvlink_recovery_rise", "nvlink", PROBLEM, "reset", 1, "errors in the window (>=)",
        "NVLink recovery errors rising",
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_NVLINK_ERROR = 1", "reset the GPU; errors that return need service",
        DCGM_FAIL, f"{W} MonitorNVLink4Fields (recovery: fail)",
    ),
    Rule(
        "nvlink_crc_rise", "nvlink", NOTE, "monitor", 1, "errors in the window (>=)",
        "an NVLink CRC counter (flit or data, each on its own) rising below the rate that matters",
        f"{W} MonitorNVLink4Fields (warn below the rate)",
        "CRC errors are retried by the link; watch them, and look at the link if they climb",
        DCGM_WARN, f"{W} MonitorNVLink4Fields (CRC below 100/s: warn)",
    ),
    Rule(
        "nvlink_crc_per_s", "nvlink", PROBLEM, "reset", 100, "errors per second, per counter (>=)",
        "an NVLink CRC counter (flit or data, each on its own) rising at a rate that matters",
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_NVLINK_CRC_ERROR = 100.0 per second, judged per field",
        "reset the GPU; errors that return need service",
        DCGM_FAIL, f"{W} MonitorNVLink4Fields (CRC at 100/s: fail)",
    ),
    Rule(
        "nvlink5_error_rise", "nvlink", PROBLEM, "reset", 1, "errors in the window, per counter (>=)",
        "an NVLink5 (Blackwell) error counter rising: malformed packets, buffer overruns, receive, remote, "
        "general, link integrity, link recovery (failed or not), effective or symbol errors (NVML fields "
        "206-211, 214, 215, 219, 221; the BER levels and the ECC data total are rules of their own)",
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_NVLINK_ERROR = 1; NVML field values scoped to each link",
        "reset the GPU; errors that return need service",
        DCGM_FAIL, f"{W} MonitorNVLink5Fields and MonitorNVLinkErrorFields (fail)",
    ),
    Rule(
        "nvlink_ecc_data_rise", "nvlink", PROBLEM, "reset", 1, "errors in the window (>=)",
        "the GPU's NVLink ECC data error total (every link) rising",
        "NVML field 160 NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_TOTAL (DCGM_FI_DEV_NVLINK_ECC_ERROR_TOTAL); "
        f"{DCGM_LIMITS} DCGM_LIMIT_MAX_NVLINK_ERROR = 1",
        "reset the GPU; errors that return need service",
        DCGM_FAIL, f"{W} MonitorNVLink5Fields, lines 2807-2947 at 72fa3fe (a rise of DCGM_FI_DEV_NVLINK_ECC_"
        "ERROR_TOTAL: fail)",
    ),
    Rule(
        "nvlink_effective_ber", "nvlink", PROBLEM, "reset", 1e-12, "effective BER, every link (>)",
        "the NVLink effective BER of the GPU's links worse than 1e-12: a level, read once, so a bad link is "
        "found even while no error counter moves",
        "NVML field 220 NVML_FI_DEV_NVLINK_COUNT_EFFECTIVE_BER, scopeId UINT_MAX (mantissa bits 8-11, "
        "exponent bits 0-7; 15e-255 is zero); DCGM common/DcgmUtilities.cpp IsEffectiveBerThresholdExceeded "
        "(exponent < 12, 12 with mantissa > 1, 13 with mantissa > 10)",
        "reset the GPU; a BER that stays high needs the link serviced (cable, cartridge, switch tray)",
        DCGM_FAIL, f"{W} MonitorNVLink5Fields, lines 2888-2929 at 72fa3fe (DCGM_FI_DEV_NVLINK_EFFECTIVE_BER_"
        "RAW: fail)",
    ),
    Rule(
        "nvlink_symbol_ber", "nvlink", PROBLEM, "reset", None, "",
        "the NVLink symbol BER of the GPU's links above its floor, 15e-238 on NVLink5: symbol errors are "
        "errors FEC did not correct, and DCGM expects none",
        "NVML field 222 NVML_FI_DEV_NVLINK_COUNT_SYMBOL_BER, scopeId UINT_MAX; DCGM "
        "common/DcgmGPUHardwareLimits.h DCGM_SYMBOL_BER_FLOOR_EXP_AGGREGATED = 238 and DcgmHealthWatch.cpp "
        "IsSymbolBerThresholdExceeded (lines 55-73)",
        "reset the GPU; a symbol BER that stays needs the link serviced",
        DCGM_FAIL,
        f"{W} MonitorNVLink5Fields, lines 2888-2929 at 72fa3fe (DCGM_FI_DEV_NVLINK_SYMBOL_BER_RAW: fail)",
    ),
    Rule(
        "nvlink_errors_history", "nvlink", NOTE, "monitor", 0, "errors since the counters were reset (>)",
        "NVLink replay/recovery errors in the counters' history (not rising now)",
        "gputopo policy (docs/health-rules.md): totals are history",
        "history only; `nvidia-smi nvlink -e` shows them per link",
    ),
    Rule(
        "fabric_not_ready", "nvlink", PROBLEM, "drain", None, "",
        "the GPU's NVLink fabric registration has not started, or completed with an error: CUDA cannot "
        "start on it (error 802)",
        "NVML nvmlDeviceGetGpuFabricInfoV (state, status)",
        "check nvidia-fabricmanager; then reset the GPU or reboot",
        DCGM_FAIL, f"{W} MonitorFabricFields, lines 3676-3735 at 72fa3fe (not started, failed: fail)",
    ),
    Rule(
        "fabric_in_progress", "nvlink", NOTE, "monitor", None, "",
        "the GPU's NVLink fabric registration is still in progress (CUDA waits for it)",
        "NVML nvmlDeviceGetGpuFabricInfoV (state NVML_GPU_FABRIC_STATE_IN_PROGRESS)",
        "wait; a registration that stays in progress: check nvidia-fabricmanager",
        DCGM_WARN, f"{W} MonitorFabricFields, lines 3676-3735 at 72fa3fe (in progress: warn)",
    ),
    Rule(
        "fabric_unhealthy", "nvlink", PROBLEM, "drain", None, "",
        "the fabric's health mask names a fault, in any registration state: one of its 2-bit fields TRUE "
        "(bandwidth degraded, route recovery, route unhealthy, access timeout recovery), an incorrect "
        "configuration other than none (no partition, insufficient NVLinks, ...), or PARTITION_ASSIGNED "
        "FALSE, the one field whose TRUE is good (0xaa, 0x1aa, 0x11aa, 0x80 are healthy)",
        f"{W} MonitorFabricFields (health mask read first, whatever the state: fail); nvml.h "
        "NVML_GPU_FABRIC_HEALTH_MASK_*, PARTITION_ASSIGNED as nvidia-ml-py 13.615 declares it",
        "check nvidia-fabricmanager; reset or reboot",
        DCGM_FAIL, f"{W} MonitorFabricFields, lines 3612-3674 at 72fa3fe (PARTITION_ASSIGNED is not read)",
    ),
    Rule(
        "fabric_summary_unhealthy", "nvlink", PROBLEM, "drain", None, "",
        "the fabric's health summary (fabric info v3) is UNHEALTHY though the mask names no fault",
        "NVML nvmlGpuFabricInfo_v3_t.healthSummary (NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY)",
        "check nvidia-fabricmanager and the switch trays; reset or reboot",
        DCGM_NONE, "", "DCGM 4.6 MonitorFabricFields reads the mask and the state, not the summary",
    ),
    Rule(
        "fabric_limited_capacity", "nvlink", NOTE, "monitor", None, "",
        "the fabric's health summary is LIMITED_CAPACITY: NVLink works with less bandwidth (the finding says "
        "what the mask tells of it)",
        "NVML nvmlGpuFabricInfo_v3_t.healthSummary (NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY)",
        "plan a service window for the switch trays",
        DCGM_NONE, "", "DCGM 4.6 MonitorFabricFields reads the mask and the state, not the summary",
    ),
    Rule(
        "fabric_no_domain", "nvlink", PROBLEM, "drain", None, "",
        "the platform places the tray in a rack (a chassis serial and a tray index) but its completed "
        "registration names no NVLink domain (zero cluster UUID or clique 0); an HGX board (no chassis "
        "serial) is not multi-node NVLink, not a fault",
        "NVML nvmlDeviceGetPlatformInfo and nvmlGpuFabricInfo_v3_t (clusterUuid, cliqueId); the domain "
        "<clusterUuid>.<cliqueId> as GPU feature discovery's nvidia.com/gpu.clique label",
        "check nvidia-fabricmanager / the NVLink subnet manager of the rack",
        DCGM_NONE, "", "DCGM 4.6 does not read the cluster UUID or the platform info",
    ),
    Rule(
        "fabric_domain_split", "nvlink", PROBLEM, "drain", None, "",
        "the GPUs of one tray are on different NVLink domains (cluster UUID or clique)",
        "NVML nvmlGpuFabricInfo_v3_t (clusterUuid, cliqueId) of every GPU of the node",
        "check the rack's fabric manager partitions; reset the GPUs or reboot the tray",
        DCGM_NONE, "", "DCGM 4.6 judges each GPU alone",
    ),
    # --- IMEX (judged in health/imex.py, only where a daemon is expected) ----------------------------------
    Rule(
        "imex_not_configured", "config", PROBLEM, "config", None, "",
        "IMEX is expected here (--expect-imex) but its node configuration is missing or empty, or "
        "nvidia-imex-ctl answers 'Failed to read node configuration file'",
        f"{DCGM_IMEX} (that message: NOT_CONFIGURED); {IMEX_GUIDE}, IMEX_NODE_CONFIG_FILE",
        "write the domain's node addresses into nodes_config.cfg and restart nvidia-imex",
        DCGM_NONE, f"{W} MonitorImex (NOT_CONFIGURED passes)",
        "DCGM cannot tell a node meant to run IMEX from one that is not, so it passes NOT_CONFIGURED; "
        "--expect-imex says this node is meant to",
    ),
    Rule(
        "imex_daemon_not_ready", "nvlink", PROBLEM, "drain", None, "",
        "the node's IMEX daemon is not READY (INITIALIZING, STARTING_AUTH_SERVER, WAITING_FOR_PEERS, "
        "WAITING_FOR_RECOVERY, INIT_GPU, SHUTTING_DOWN, UNAVAILABLE) or does not answer "
        "`nvidia-imex-ctl -q`; " + IMEX_EXPECTED,
        f"{DCGM_IMEX} (DcgmImexDaemonStatus); {IMEX_GUIDE}, nvidia-imex-ctl -q",
        "`systemctl status nvidia-imex` and `journalctl -u nvidia-imex` say why; restart it "
        "(`systemctl restart nvidia-imex`) once the NVLink fabric is complete (`nvidia-smi -q`: Fabric "
        "State Completed) on every tray of the domain",
        DCGM_FAIL, f"{W} MonitorImex (daemon not READY: fail)",
        "DCGM passes UNAVAILABLE (also its value for an answer it cannot read) and fails a node with no "
        "daemon at all (-3, DCGM #308); gputopo fails UNAVAILABLE where a daemon is expected, and leaves a "
        "node where none is expected, or a hung nvidia-imex-ctl, not checked",
    ),
    Rule(
        "imex_domain_unhealthy", "nvlink", PROBLEM, "monitor", None, "",
        "`nvidia-imex-ctl -N -j` reports the IMEX domain DOWN or DEGRADED while no member or link it lists "
        "explains it (when one does, that member's finding carries the domain's state)",
        f"{DCGM_IMEX} (DcgmImexDomainStatus); {IMEX_GUIDE}, nvidia-imex-ctl -N",
        "check nvidia-imex on every node of the domain",
        DCGM_FAIL, f"{W} MonitorImex (domain DOWN or DEGRADED: fail)",
        "every tray of a rack sees the same domain: one bad tray must not drain the other 17, so the "
        "domain's state does not drain this node (its own daemon does: imex_daemon_not_ready)",
    ),
    Rule(
        "imex_member_down", "nvlink", PROBLEM, "monitor", None, "",
        "a member of the IMEX domain is not READY, or two READY members are not CONNECTED "
        "(`nvidia-imex-ctl -N -j`); named by host, one finding per member or pair",
        f"{IMEX_GUIDE}, nvidia-imex-ctl -N -j (nodes: status, host, connections)",
        "on the member named: `nvidia-imex-ctl -q` and `journalctl -u nvidia-imex`; restart nvidia-imex "
        "there (or on every node of the domain when it does not rebuild); check that the node configuration "
        "is the same on every node and that the members reach each other on the IMEX port (50000)",
        DCGM_NONE, "",
        "DCGM reads only the domain's state, not its members; a member names another node, so it does not "
        "drain this one",
    ),
    # --- PCIe ---------------------------------------------------------------------------------------------
    Rule(
        "pcie_replay_rate", "pcie", NOTE, "monitor", 1e-12, "bit error rate per lane",
        "PCIe replays per minute above what a link at this bit error rate would replay",
        f"{W} GetExpectedPcieReplayRate: gen speed x 1e-12 x 60 per lane per minute",
        "replays mean bit errors on the PCIe link: reseat the card or riser, check the slot; "
        "`nvidia-smi -q -d PCIE` shows the counter",
        DCGM_WARN, f"{W} MonitorPcie (replays over a minute above the expected rate: warn)",
    ),
    Rule(
        "pcie_width_idle", "pcie", NOTE, "monitor", None, "",
        "the PCIe link runs narrower than its maximum (idle GPU): a slow link",
        "gputopo policy (docs/health-rules.md): a narrow link is named; idle GPUs keep their width",
        "check the slot and riser",
    ),
    Rule(
        "pcie_width_busy", "pcie", NOTE, "monitor", None, "",
        "the PCIe link runs narrower than its maximum while the GPU works: a slow link (ranked lower); a "
        "problem only when its replays rise too",
        "gputopo policy (docs/health-rules.md): a narrow link that is not erroring carries jobs, slower",
        "check the slot, riser and card at the next maintenance",
    ),
    Rule(
        "pcie_gen_busy", "pcie", NOTE, "monitor", None, "",
        "the PCIe link runs below its maximum generation while the GPU works (idle GPUs lower it on purpose)",
        "gputopo's link finding (model.Gpu.pcie_below_max_while_busy)",
        "check the BIOS PCIe speed setting and the slot; idle GPUs lower their link generation on purpose, "
        "busy ones should not",
    ),
    # --- clocks, thermal, power ---------------------------------------------------------------------------
    Rule(
        "clocks_hw_slowdown", "power", PROBLEM, "drain", None, "",
        "clocks held down by hardware slowdown in both samples (temperature, power brake or draw too high)",
        "NVML nvmlClocksEventReasonHwSlowdown (0x8)", "check cooling and power; service if it persists",
        DCGM_WARN, f"{W} MonitorPower/MonitorThermal (violation time: warn)",
        "held through the whole window, a hardware slowdown halves a GPU's speed and with it every "
        "collective on the node; one read alone is never judged",
    ),
    Rule(
        "clocks_hw_thermal", "thermal", PROBLEM, "drain", None, "",
        "clocks held down by hardware thermal slowdown in both samples",
        "NVML nvmlClocksEventReasonHwThermalSlowdown (0x40)", "check cooling; service if it persists",
        DCGM_WARN, f"{W} MonitorThermal (violation time: warn)",
        "held through the whole window, it slows every collective on the node; one read is never judged",
    ),
    Rule(
        "clocks_sw_thermal", "thermal", NOTE, "monitor", None, "",
        "clocks held down by software thermal slowdown in both samples",
        "NVML nvmlClocksEventReasonSwThermalSlowdown (0x20)", "check cooling",
        DCGM_WARN, f"{W} MonitorThermal (warn)",
    ),
    Rule(
        "clocks_hw_power_brake", "power", PROBLEM, "drain", None, "",
        "clocks held down by the external power brake in both samples",
        "NVML nvmlClocksEventReasonHwPowerBrakeSlowdown (0x80)", "check the power supply and the facility",
        DCGM_WARN, f"{W} MonitorPower (violation time: warn)",
        "held through the whole window, the brake slows every collective on the node",
    ),
    # --- driver, config, node -----------------------------------------------------------------------------
    Rule(
        "recovery_action", "driver", PROBLEM, "reset", None, "",
        "the driver asks for a recovery action (GPU reset, node reboot, drain and reset)",
        "NVML field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (r570+)", "follow the action the driver names",
        DCGM_FAIL, f"{W} MonitorGpuRecoveryAction (reset, reboot, drain-and-reset: fail)",
    ),
    Rule(
        "recovery_drain_p2p", "driver", NOTE, "monitor", None, "",
        "the driver asks to drain peer-to-peer work from the GPU (recovery action DRAIN_P2P, 3); "
        "recommend, run, doctor and probe leave it out of every multi-GPU set",
        "NVML field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (r570+)",
        "keep NVLink/P2P jobs off the GPU until it is reset; other jobs run",
        DCGM_WARN, f"{W} MonitorGpuRecoveryAction (drain P2P: warn)",
    ),
    Rule(
        "gpu_unreadable", "driver", PROBLEM, "reset", None, "",
        "the GPU does not answer NVML", "NVML: GPU is lost / reset required / no answer within the deadline",
        "look for Xid errors in `dmesg`; drain the jobs and reset the GPU (`nvidia-smi -r -i {i}`) or "
        "reboot",
    ),
    Rule(
        "driver_unavailable", "driver", PROBLEM, "drain", None, "",
        "NVML cannot start (or reads no GPU) while NVIDIA GPUs are present (/dev/nvidia*, "
        "/proc/driver/nvidia/gpus, --expect-gpus): the driver is broken",
        "gputopo policy (docs/health-rules.md): unknown is not healthy",
        "a driver/library version mismatch needs a reboot (or reloading the nvidia modules); "
        "otherwise reinstall the driver; `nvidia-smi` shows the same error",
    ),
    Rule(
        "gpus_refused", "driver", PROBLEM, "drain", None, "",
        "every GPU refused NVML access to root: nothing about the node could be judged",
        "gputopo policy (docs/health-rules.md): unknown is not healthy",
        "check the driver (`nvidia-smi`) and the device files' permissions (`ls -l /dev/nvidia*`)",
    ),
    Rule(
        "persistence_off", "config", NOTE, "config", None, "",
        "persistence mode is off: the driver tears the GPU down between jobs (slow starts, lost state)",
        "NVIDIA driver persistence docs (nvidia-persistenced)",
        "run nvidia-persistenced (or `nvidia-smi -pm 1`) so the driver keeps the GPU initialised",
    ),
    Rule(
        "expect_gpus", "topology", PROBLEM, "drain", None, "GPUs",
        "fewer GPUs than expected (--expect-gpus)",
        "gputopo policy (docs/health-rules.md); aznhc and NHC check the GPU count the same way",
        "a GPU fell off the bus or is not bound to the driver: look for Xid 79 in `dmesg` and at "
        "`lspci -d 10de:`; a reboot or reseat brings it back, else hardware service",
    ),
    # --- Xid ----------------------------------------------------------------------------------------------
    Rule(
        "xid_hardware", "xid", PROBLEM, "reset", None, "",
        "a hardware Xid in the kernel log within the window (each code's severity and action from "
        "health.xid.XID_TABLE; NVLink5 Xids 144-150 by the bucket of the catalogue's decode sheet)",
        f"{XID_CATALOG}; {W} BuildXidMappings", "per code: see `gputopo check --list-rules`",
        DCGM_FAIL, f"{W} BuildXidMappings (per code)",
    ),
    Rule(
        "xid_application", "xid", NOTE, "none", None, "",
        "an application Xid in the kernel log (a program's fault, not the GPU's)",
        XID_CATALOG, "check the application", DCGM_WARN, f"{W} BuildXidMappings (31, 43: warn)",
    ),
    Rule(
        "xid_unknown", "xid", NOTE, "monitor", None, "",
        "an Xid past NVIDIA's catalogue (it lists 1-172), which gputopo's table cannot classify", XID_CATALOG,
        "look the code up in NVIDIA's catalogue",
    ),
    Rule(
        "xid_unlisted_gpu", "xid", PROBLEM, "reset", None, "",
        "a hardware Xid for a PCI address NVML no longer lists (79: drain)",
        f"{XID_CATALOG}; {W} BuildXidMappings (79: fail)",
        "compare `nvidia-smi -L` with `lspci -d 10de:`; reboot; reseat or RMA if it returns",
        DCGM_FAIL, f"{W} BuildXidMappings",
    ),
    # --- network ports and the PCIe path (judged in health/network.py and topology/pcie_path.py) ---------
    Rule(
        "port_link_downed", "network", PROBLEM, "drain", 0, "rises between the readings (>)",
        "link_downed rose: the link retrained between the readings",
        f"{NVSENTINEL}: any rise is fatal",
        "check the cable and transceiver (`mlxlink`, `ibstat`); reseat or replace them", why=NOT_DCGM,
    ),
    Rule(
        "port_buffer_overrun", "network", PROBLEM, "drain", 0, "rises between the readings (>)",
        "excessive_buffer_overrun_errors rose: the lossless contract broke",
        f"{NVSENTINEL}: any rise is fatal", "check the cable and transceiver; reseat or replace them",
        why=NOT_DCGM,
    ),
    Rule(
        "port_link_integrity", "network", PROBLEM, "drain", 0, "rises between the readings (>)",
        "local_link_integrity_errors rose", f"{NVSENTINEL}: any rise is fatal",
        "check the cable and transceiver; reseat or replace them", why=NOT_DCGM,
    ),
    Rule(
        "port_rnr_nak_retry", "network", PROBLEM, "drain", 0, "rises between the readings (>)",
        "hw_counters/rnr_nak_retry_err rose: a connection was severed", f"{NVSENTINEL}: any rise is fatal",
        "check the cable and transceiver; reseat or replace them", why=NOT_DCGM,
    ),
    Rule(
        "port_symbol_errors", "network", PROBLEM, "replace", 10, "errors per second, window at least 1 s (>)",
        "symbol_error rising fast: the link degrades before its error correction gives out",
        f"{NVSENTINEL}: non-fatal degradation above 10/s", "check the cable and transceiver; replace them",
        why=NOT_DCGM,
    ),
    Rule(
        "port_symbol_errors_since_last", "network", PROBLEM, "replace", 120, "errors per hour since the last "
        "check (>)",
        "symbol_error over the time since the last check (--state): the IBTA limit (a bit error rate of "
        "1e-12) NVSentinel calls fatal",
        f"{NVSENTINEL}: 120 an hour (BER 1e-12) is fatal", "check the cable and transceiver; replace them",
        why=NOT_DCGM,
    ),
    Rule(
        "port_carrier_flaps", "network", PROBLEM, "replace", 2, "carrier changes in the window (>)",
        "carrier_changes of an Ethernet interface rising: the link flaps",
        f"{NVSENTINEL}: link flap above 2 per interval", "check the cable and transceiver (`ethtool IF`)",
        why=NOT_DCGM,
    ),
    Rule(
        "port_down", "network", PROBLEM, "drain", None, "",
        "a port DOWN, Polling or Disabled while a port of the same kind and NIC model is ACTIVE (INIT/ARMED: "
        "a config problem, the subnet manager; a note for a port with no GPU on its NUMA node or switch, or "
        "when no port of its kind is up)",
        f"{NVSENTINEL_STATE}: card homogeneity", "check the cable and transceiver; reseat or replace them",
        why=NOT_DCGM,
    ),
    Rule(
        "port_slow", "network", PROBLEM, "replace", None, "",
        "an active port slower than the fastest active peer of its kind: a link trained down (200 among "
        "400 Gb/s; a note for a port with no GPU near it)",
        f"{NVSENTINEL_STATE}: link speed degradation",
        "check the cable and transceiver; reseat or replace them", why=NOT_DCGM,
    ),
    Rule(
        "gpudirect_off", "network", NOTE, "config", None, "",
        "RDMA ports but no peer-memory path: no nvidia_peermem, no nv_peer_mem, no DMA-BUF (open kernel "
        "module, Linux 5.12+)",
        "NVIDIA GPU Operator, GPUDirect RDMA and GPUDirect Storage",
        "`sudo modprobe nvidia-peermem` (and at boot), or the open GPU kernel module on Linux 5.12+",
        why=NOT_DCGM,
    ),
    RULE_ACS_REDIRECT,  # the PCIe path's rows live beside their judgement (topology sits below health)
    RULE_IOMMU_TRANSLATED,
)
# fmt: on

RULES: dict[str, Rule] = {r.name: r for r in _RULES}

DCGM_NVVS = "DCGM's diagnostic (NVVS), `dcgmi diag -r LEVEL -j`"
HEALTH_VALIDATION = "NVIDIA Health Validation's NodeVerdict (JSON on stdout)"
# Other tools' verdicts that gputopo carries into its findings: DCGM's diagnostic (health/dcgm_diag.py) and
# NVIDIA Health Validation (health/health_validation.py). Each test's status and DCGM's error code decide
# a finding's severity, action and remedy there, so these rows are not gputopo's to list with
# ``check --list-rules`` or to change with ``--thresholds``; they give each finding its rule name and its
# defaults, and make it, like every other row.
# fmt: off
_REPORTED = (
    Rule(
        "dcgm_diag", "driver", NOTE, "none", None, "",
        "what DCGM's diagnostic said as a whole, or why its result cannot be held against this machine's "
        "GPUs",
        DCGM_NVVS,
    ),
    Rule(
        "dcgm_diag_fail", "compute", PROBLEM, "drain", None, "",
        "a test of DCGM's diagnostic failed on a GPU or the node (the category and action from DCGM's error "
        "category, severity and code)",
        DCGM_NVVS, "follow DCGM's words for the error code",
    ),
    Rule(
        "dcgm_diag_warn", "compute", NOTE, "monitor", None, "",
        "a test of DCGM's diagnostic warned (a warning, not a failure)", DCGM_NVVS,
        "a warning, not a failure: follow DCGM's words for the error code",
    ),
    Rule(
        "dcgm_diag_skip", "compute", NOTE, "none", None, "",
        "a test of DCGM's diagnostic was skipped: not checked", DCGM_NVVS,
        "nothing failed; where the test matters, fix what DCGM says kept it from running and run it again",
    ),
    Rule(
        "dcgm_diag_error", "driver", NOTE, "none", None, "",
        "DCGM's diagnostic stopped early (its runtime_error)", DCGM_NVVS,
        "read DCGM's words above (is nv-hostengine running? is a GPU lost?), fix that, and run `dcgmi diag` "
        "again",
    ),
    Rule(
        "health_validation", "config", PROBLEM, "drain", None, "",
        "NVIDIA Health Validation's verdict on the node or one of its components (CRITICAL and UNKNOWN are "
        "problems, WARNING and INFO notes)",
        HEALTH_VALIDATION,
    ),
)
# fmt: on
REPORTED_RULES: dict[str, Rule] = {r.name: r for r in _REPORTED}

_OVERRIDABLE = ("limit", "severity", "action", "enabled")


# The Xids DCGM fails on every GPU (BuildXidMappings' m_devastatingXids, DCGM_HEALTH_RESULT_FAIL;
# modules/health/DcgmHealthWatch.cpp lines 3360-3373 at 72fa3fe): an Xid policy may call one of them the
# application's only with ``allow_fatal = true``.
DCGM_FATAL_XIDS = (48, 74, 79, 95, 119, 120, 140)
# The non-fatal list of NVIDIA's k8s-device-plugin and DRA driver health checking (api/config/v1
# GetIgnoredXIDs: "application errors"), one example of an ``application`` list.
DEVICE_PLUGIN_APPLICATION_XIDS = (13, 31, 43, 45, 68, 109)
XID_POLICY_HINT = (
    "an Xid policy is a table with application = [codes] (a note, never a drain), node = [codes] (a "
    "problem) and allow_fatal = true|false, e.g. application = [13, 31, 43, 45, 68, 109] (NVIDIA's device "
    "plugin's list); in a thresholds file, under [xid_policy]"
)


@dataclass(frozen=True)
class XidPolicy:
    """What an admin says an Xid means here: codes that are the ``application``'s (a note, never a drain)
    and codes that are the ``node``'s (a problem); ``source`` names the file it came from."""

    application: frozenset[int] = frozenset()
    node: frozenset[int] = frozenset()
    allow_fatal: bool = False
    source: str = ""

    def says(self, xid: int) -> str | None:
        """``application``, ``node`` or ``None`` (the table decides) for ``xid``."""
        if xid in self.application:
            return "application"
        if xid in self.node:
            return "node"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "application": sorted(self.application),
            "node": sorted(self.node),
            "allow_fatal": self.allow_fatal,
            "source": self.source,
        }


def parse_xid_policy(doc: Any, label: str, source: str) -> XidPolicy:
    """An Xid policy from a parsed table; ``UsageError`` (exit 2, one line) for anything it cannot take: an
    unknown key, a code that is not a whole number from 1 to 65535, a code in both lists, or a code DCGM
    fails in ``application`` without ``allow_fatal = true``."""
    if not isinstance(doc, dict):
        raise UsageError(f"{label}: expected a table, got {type(doc).__name__}", XID_POLICY_HINT)
    unknown = sorted(set(doc) - {"application", "node", "allow_fatal"})
    if unknown:
        raise UsageError(f"{label}: unknown key {unknown[0]!r}", XID_POLICY_HINT)
    allow = doc.get("allow_fatal", False)
    if not isinstance(allow, bool):
        raise UsageError(f"{label}: allow_fatal must be true or false, not {allow!r}", XID_POLICY_HINT)
    lists: dict[str, frozenset[int]] = {}
    for key in ("application", "node"):
        codes = doc.get(key, [])
        if not isinstance(codes, list) or any(
            isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 65535 for c in codes
        ):
            raise UsageError(f"{label}: {key} must be a list of Xid codes (whole numbers)", XID_POLICY_HINT)
        lists[key] = frozenset(codes)
    both = sorted(lists["application"] & lists["node"])
    if both:
        raise UsageError(f"{label}: Xid {both[0]} is in both application and node", XID_POLICY_HINT)
    fatal = sorted(lists["application"] & set(DCGM_FATAL_XIDS))
    if fatal and not allow:
        raise UsageError(
            f"{label}: Xid {fatal[0]} is one DCGM fails ({', '.join(map(str, DCGM_FATAL_XIDS))}); calling "
            "it the application's needs allow_fatal = true",
            "add allow_fatal = true to the policy if you mean it, or take the code out of application",
        )
    return XidPolicy(lists["application"], lists["node"], allow, source)


def load_xid_policy(path: Path) -> XidPolicy:
    """``--xid-policy FILE``: JSON (``.json``, or text starting with ``{``) or TOML."""
    from gputopo.inputs import read_capped

    label = f"--xid-policy {path}"
    try:
        data = read_capped(path, label, cap=1_000_000, hint=XID_POLICY_HINT)
    except InputError as exc:
        raise UsageError(
            f"{label}: cannot read it ({exc.message[len(label) + 2 :]})", XID_POLICY_HINT
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{label}: not UTF-8 text", XID_POLICY_HINT) from None
    fmt = "json" if path.suffix.lower() == ".json" or text.lstrip().startswith("{") else "toml"
    try:
        doc = loads_bounded(text, label) if fmt == "json" else _toml_loads(text)
    except (ValueError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"{label}: not valid {fmt.upper()}: {first}", XID_POLICY_HINT) from None
    return parse_xid_policy(doc, label, str(path))


@dataclass(frozen=True)
class Thresholds:
    """The rule table in force: the defaults with a user's overrides applied. ``source`` names the file.
    ``xid_policy``: the admin's Xid policy (``--xid-policy``, or ``xid_policy`` in the thresholds file)."""

    rules: Mapping[str, Rule]
    source: str | None = None
    xid_policy: XidPolicy | None = None

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
    "(problem|note), action and enabled, and [xid_policy] an Xid policy; names: " + ", ".join(RULES)
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
    policy = None
    if "xid_policy" in doc:
        policy = parse_xid_policy(doc.pop("xid_policy"), f"--thresholds {source}: xid_policy", source)
    for name, value in doc.items():
        if name not in RULES:
            raise UsageError(f"--thresholds {source}: unknown rule {name!r}", _HINT)
        rules[name] = _override(RULES[name], value, source)
    return Thresholds(rules, source, policy)


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
