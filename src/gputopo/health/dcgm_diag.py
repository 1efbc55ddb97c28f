"""DCGM's active diagnostic, ``dcgmi diag -r LEVEL -j``, read into gputopo's one finding shape (pure).

Read from DCGM's own writer (NVIDIA/DCGM at 72fa3fe, DCGM 4.6.0, and v3.3.9 for the 3.x shapes):

- **4.x** (``dcgmi/Diag.cpp`` ``HelperJsonBuildOutput``, lines 1238-1289; the keys are
  ``nvvs/include/NvvsJsonStrings.h`` lines 20-53): ``{"DCGM Diagnostic": {"test_categories":
  [{"category", "tests": [{"name", "results": [...], "test_summary": {...}}]}]}, "entity_groups": [...],
  "metadata": {...}}``.
  A result (``HelperJsonAddResult``, lines 1056-1121) names its entity (``entity_group`` "GPU", "Switch",
  "CPU"... from ``DcgmFieldsGetEntityGroupString``, ``entity_group_id``, ``entity_id``; left out for a
  result of no entity), its ``status`` and its ``warnings[]``: ``warning`` (the message), ``error_id`` (the
  number of a ``DCGM_FR_*`` code), ``error_category`` and ``error_severity`` (numbers too,
  ``dcgmlib/dcgm_errors.h`` lines 31-207). A result that did not run is left out. ``test_summary`` carries
  every error of the test, those of no entity included (only there). ``entity_groups[]``
  (``HelperJsonAddEntities``, lines 1149-1181) lists each entity with its ``serial_num`` and ``device_id``;
  ``metadata`` (lines 1183-1214) the DCGM ``version`` and ``Driver Version Detected``.
- **Status words**: ``HelperDisplayDiagResult`` (lines 845-866) writes "Pass", "Skip", "Fail" and
  "Not Run"; a warning result is written "Warn" only where its caller asks, and the JSON writer never does,
  so in 4.x JSON a warning reads "Fail". nvvs's own JSON (3.x, ``nvvs/src/Output.cpp``
  ``resultEnumToString``) writes "PASS", "WARN", "SKIP", "FAIL". Both are read, in any case: Fail is a
  problem, Warn a note, Skip "not checked".
- **3.x** ``dcgmi diag -j`` (v3.3.9 ``dcgmi/Diag.cpp`` lines 1212-1500): the root key is
  ``"DCGM GPU Diagnostic"``; a plugin's result names its GPU as ``"gpu_id": "3"`` (a string), a deployment
  test's as an integer ``gpu_id`` beside its errors, whose message sits under ``"warnings"`` rather than
  ``"warning"`` (sic, line 1260); ``version``, ``Driver Version Detected`` and ``GPU Device Serials``
  (``{"0": serial}``) are at the root. nvvs's own JSON (v3.3.9 ``nvvs/src/JsonOutput.cpp`` lines 285-438)
  has the same root key with ``"gpu_ids"``: an integer, ``"3"``, or ``"0,1,2,3"`` for a test of every GPU,
  and its results array is indexed by GPU, so it may hold nulls.
- **--iterations N** (4.x ``Diag::RunStartDiag``, lines 577-632): ``{"iterations": [run, run...],
  "Overall Result": "Pass" | "Fail", "Warning": "<why it stopped>"}``; each run is one document above.
- **The early-failure document** (``HelperDisplayFailureMessage``, lines 634-653):
  ``{"DCGM Diagnostic": {"version": "...", "runtime_error": "..."}}``, printed when the diagnostic could not
  run or finish (no host engine, a timeout, a GPU lost). Under ``--iterations`` it is printed on its own
  before the iterations' document, so the output may hold two JSON documents one after the other: each is
  read.

The entity id of a GPU is DCGM's GPU id, which is NVML's index on a node without MIG; the serial DCGM gives
for it is kept beside each finding, so a reader can check.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputopo.errors import InputError
from gputopo.findings import PROBLEM, Finding
from gputopo.health.rules import REPORTED_RULES

TOOL = "dcgmi diag"
PASSED = "passed"
FAILED = "failed"
NOT_CHECKED = "not checked"
STATUSES = (PASSED, FAILED, NOT_CHECKED)

# Rules named on the findings (``Finding.rule``), one per kind of answer.
RULE_FAIL = "dcgm_diag_fail"
RULE_WARN = "dcgm_diag_warn"
RULE_SKIP = "dcgm_diag_skip"
RULE_ERROR = "dcgm_diag_error"
_SUMMARY, _FAIL, _WARN, _SKIP, _ERROR = (
    REPORTED_RULES[n] for n in ("dcgm_diag", RULE_FAIL, RULE_WARN, RULE_SKIP, RULE_ERROR)
)

# Real outputs are a few to a few hundred kilobytes (8 GPUs, level 4, --iterations 10: well under 2 MB).
MAX_DIAG_BYTES = 8 * 1024 * 1024
_HINT = "give the output of `dcgmi diag -r LEVEL -j` (its JSON, as DCGM wrote it)"

NAME_4X = "DCGM Diagnostic"  # NvvsJsonStrings.h NVVS_NAME at 72fa3fe
NAME_3X = "DCGM GPU Diagnostic"  # NvvsJsonStrings.h NVVS_NAME at v3.3.9

# dcgmError_t, dcgmlib/dcgm_errors.h lines 31-175 at 72fa3fe: the name of each code, from 0 (OK) to 132
# (two aliases, CLOCK_THROTTLE_THERMAL/_POWER and THROTTLING_VIOLATION, share their successors' numbers).
_FR_NAMES = """
OK UNKNOWN UNRECOGNIZED PCI_REPLAY_RATE VOLATILE_DBE_DETECTED VOLATILE_SBE_DETECTED
PENDING_PAGE_RETIREMENTS RETIRED_PAGES_LIMIT RETIRED_PAGES_DBE_LIMIT CORRUPT_INFOROM
CLOCKS_EVENT_THERMAL POWER_UNREADABLE CLOCKS_EVENT_POWER NVLINK_ERROR_THRESHOLD NVLINK_DOWN
NVSWITCH_FATAL_ERROR NVSWITCH_NON_FATAL_ERROR NVSWITCH_DOWN NO_ACCESS_TO_FILE NVML_API
DEVICE_COUNT_MISMATCH BAD_PARAMETER CANNOT_OPEN_LIB DENYLISTED_DRIVER NVML_LIB_BAD GRAPHICS_PROCESSES
HOSTENGINE_CONN FIELD_QUERY BAD_CUDA_ENV PERSISTENCE_MODE LOW_BANDWIDTH HIGH_LATENCY
CANNOT_GET_FIELD_TAG FIELD_VIOLATION FIELD_THRESHOLD FIELD_VIOLATION_DBL FIELD_THRESHOLD_DBL
UNSUPPORTED_FIELD_TYPE FIELD_THRESHOLD_TS FIELD_THRESHOLD_TS_DBL THERMAL_VIOLATIONS
THERMAL_VIOLATIONS_TS TEMP_VIOLATION CLOCKS_EVENT_VIOLATION INTERNAL PCIE_GENERATION PCIE_WIDTH ABORTED
TEST_DISABLED CANNOT_GET_STAT STRESS_LEVEL CUDA_API FAULTY_MEMORY CANNOT_SET_WATCHES CUDA_UNBOUND
ECC_DISABLED MEMORY_ALLOC CUDA_DBE MEMORY_MISMATCH CUDA_DEVICE ECC_UNSUPPORTED ECC_PENDING
MEMORY_BANDWIDTH TARGET_POWER API_FAIL API_FAIL_GPU CUDA_CONTEXT DCGM_API CONCURRENT_GPUS
TOO_MANY_ERRORS NVLINK_CRC_ERROR_THRESHOLD NVLINK_ERROR_CRITICAL ENFORCED_POWER_LIMIT MEMORY_ALLOC_HOST
GPU_OP_MODE NO_MEMORY_CLOCKS NO_GRAPHICS_CLOCKS HAD_TO_RESTORE_STATE L1TAG_UNSUPPORTED L1TAG_MISCOMPARE
ROW_REMAP_FAILURE UNCONTAINED_ERROR EMPTY_GPU_LIST DBE_PENDING_PAGE_RETIREMENTS UNCORRECTABLE_ROW_REMAP
PENDING_ROW_REMAP BROKEN_P2P_MEMORY_DEVICE BROKEN_P2P_WRITER_DEVICE NVSWITCH_NVLINK_DOWN
EUD_BINARY_PERMISSIONS EUD_NON_ROOT_USER EUD_SPAWN_FAILURE EUD_TIMEOUT EUD_ZOMBIE EUD_NON_ZERO_EXIT_CODE
EUD_TEST_FAILED FILE_CREATE_PERMISSIONS PAUSE_RESUME_FAILED PCIE_H_REPLAY_VIOLATION
GPU_EXPECTED_NVLINKS_UP NVSWITCH_EXPECTED_NVLINKS_UP XID_ERROR SBE_VIOLATION DBE_VIOLATION
PCIE_REPLAY_VIOLATION SBE_THRESHOLD_VIOLATION DBE_THRESHOLD_VIOLATION PCIE_REPLAY_THRESHOLD_VIOLATION
CUDA_FM_NOT_INITIALIZED SXID_ERROR GFLOPS_THRESHOLD_VIOLATION NAN_VALUE FABRIC_MANAGER_TRAINING_ERROR
BROKEN_P2P_PCIE_MEMORY_DEVICE BROKEN_P2P_PCIE_WRITER_DEVICE BROKEN_P2P_NVLINK_MEMORY_DEVICE
BROKEN_P2P_NVLINK_WRITER_DEVICE TEST_SKIPPED SRAM_THRESHOLD NVLINK_EFFECTIVE_BER_THRESHOLD
FALLEN_OFF_BUS NVLINK_SYMBOL_BER_THRESHOLD IMEX_UNHEALTHY FABRIC_PROBE_STATE BINARY_PERMISSIONS
GPU_RECOVERY_RESET GPU_RECOVERY_REBOOT GPU_RECOVERY_DRAIN_P2P GPU_RECOVERY_DRAIN_RESET NCCL_ERROR
RETEST_REQUESTED CONTAINED_ERROR UNCORRECTABLE_ROW_REMAP_LIMIT
""".split()  # noqa: SIM905 (the header's names, as they read)
FR_CODES: dict[int, str] = {code: f"DCGM_FR_{name}" for code, name in enumerate(_FR_NAMES)}

# dcgmErrorCategory_t (dcgm_errors.h lines 188-207): DCGM's name, and gputopo's category for it.
ERROR_CATEGORIES: dict[int, tuple[str, str]] = {
    0: ("NONE", ""),
    1: ("PERF_THRESHOLD", "compute"),
    2: ("PERF_VIOLATION", "compute"),
    3: ("SOFTWARE_CONFIG", "config"),
    4: ("SOFTWARE_LIBRARY", "driver"),
    5: ("SOFTWARE_XID", "xid"),
    6: ("SOFTWARE_CUDA", "driver"),
    7: ("SOFTWARE_EUD", "driver"),
    8: ("SOFTWARE_OTHER", "driver"),
    9: ("HARDWARE_THERMAL", "thermal"),
    10: ("HARDWARE_MEMORY", "memory"),
    11: ("HARDWARE_NVLINK", "nvlink"),
    12: ("HARDWARE_NVSWITCH", "nvlink"),
    13: ("HARDWARE_PCIE", "pcie"),
    14: ("HARDWARE_POWER", "power"),
    15: ("HARDWARE_OTHER", "compute"),
    16: ("INTERNAL_OTHER", "driver"),
}

# dcgmErrorSeverity_t (dcgm_errors.h lines 177-186): DCGM's name, gputopo's action, and the remedy in the
# words fleets use.
_FIELD_DIAG = "run the field diagnostic; replace the GPU if it fails again"
ERROR_SEVERITIES: dict[int, tuple[str, str, str]] = {
    0: ("NONE", "monitor", "run `dcgmi diag` again to see whether it repeats"),
    1: ("MONITOR", "monitor", "the GPU can take work; keep watching it (`gputopo check`)"),
    2: ("ISOLATE", "drain", f"take the GPU out of service; {_FIELD_DIAG}"),
    3: ("UNKNOWN", "drain", f"take the GPU out of service; {_FIELD_DIAG}, or contact NVIDIA support"),
    4: ("TRIAGE", "drain", f"{_FIELD_DIAG}; contact NVIDIA support with an nvidia-bug-report"),
    5: ("CONFIG", "config", "fix the setting DCGM names, then run the diagnostic again"),
    6: ("RESET", "reset", "drain the node's jobs, reset the GPU (or reboot), then run the diagnostic again"),
}
# Codes whose action DCGM's name says outright (the driver's recovery actions, a GPU gone).
_CODE_ACTIONS: dict[str, tuple[str, str]] = {
    "DCGM_FR_GPU_RECOVERY_RESET": (
        "reset",
        "drain the node's jobs and reset the GPU, then run the diagnostic again",
    ),
    "DCGM_FR_GPU_RECOVERY_REBOOT": ("reboot", "drain the node and reboot it, then run the diagnostic again"),
    "DCGM_FR_GPU_RECOVERY_DRAIN_P2P": (
        "drain",
        "keep the GPU out of P2P work: drain the node's jobs, reset the GPU, run the diagnostic again",
    ),
    "DCGM_FR_GPU_RECOVERY_DRAIN_RESET": (
        "reset",
        "the GPU runs at reduced capacity: drain the node's jobs and reset the GPU",
    ),
    "DCGM_FR_FALLEN_OFF_BUS": (
        "reboot",
        "the GPU fell off the bus: drain the node and reboot it; reseat or replace "
        "the GPU if it falls off again",
    ),
}
# Where a result names no category, its test says what it is about.
_TEST_CATEGORIES = {
    "memory": "memory",
    "memtest": "memory",
    "memory_bandwidth": "memory",
    "pcie": "pcie",
    "nvbandwidth": "nvlink",
    "targeted_power": "power",
    "pulse_test": "power",
    "targeted_stress": "compute",
    "diagnostic": "compute",
    "sm_stress": "compute",
}


@dataclass(frozen=True)
class DiagResult:
    """One result line of the diagnostic: a test's outcome on one entity (or on none: the node)."""

    test: str
    status: str  # pass, fail, warn, skip
    where: str  # "GPU3", "Switch0", "node"
    gpu: int | None
    warnings: tuple[Mapping[str, Any], ...] = ()
    info: tuple[str, ...] = ()


@dataclass(frozen=True)
class DcgmDiagResult:
    """What DCGM's diagnostic said, judged: the API ``accept`` and ``doctor`` use.

    ``status`` is ``passed`` (a test ran and none failed; warnings are notes), ``failed`` (a test failed on
    some entity) or ``not checked`` (``reason`` says why: no ``dcgmi``, a hang past the budget, DCGM's
    early-failure document, every test skipped). ``findings`` are in the one finding shape: a problem per
    failure on the GPU DCGM names, with DCGM's code and category; a note per warning, per skipped test, and
    for an early failure. ``source`` is where it came from (a file, or the command run).
    """

    status: str
    reason: str | None
    findings: tuple[Finding, ...] = ()
    source: str = TOOL
    tool: str = TOOL
    dcgm_version: str | None = None
    driver_version: str | None = None
    serials: Mapping[int, str] = field(default_factory=dict)  # DCGM GPU id -> serial
    counts: Mapping[str, int] = field(default_factory=dict)  # pass/fail/warn/skip -> result lines
    iterations: int = 1
    runtime_error: str | None = None
    level: int | None = None  # the -r level, where gputopo ran it

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def failed_gpus(self) -> tuple[int, ...]:
        """The GPUs (DCGM's ids) with a problem, in order."""
        return tuple(sorted({f.gpu for f in self.findings if f.severity == PROBLEM and f.gpu is not None}))

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "source": self.source,
            "status": self.status,
            "reason": self.reason,
            "dcgm_version": self.dcgm_version,
            "driver_version": self.driver_version,
            "serials": {str(k): v for k, v in sorted(self.serials.items())},
            "counts": dict(self.counts),
            "iterations": self.iterations,
            "runtime_error": self.runtime_error,
            "level": self.level,
            "failed_gpus": list(self.failed_gpus),
            "findings": [f.to_json() for f in self.findings],
        }


def not_checked(reason: str, source: str = TOOL) -> DcgmDiagResult:
    """The diagnostic could not be asked or did not answer (no ``dcgmi``, a hang, a spent budget)."""
    return DcgmDiagResult(NOT_CHECKED, reason, source=source)


# --- reading ---------------------------------------------------------------------------------------------


def read_dcgm_diag(path: Path) -> DcgmDiagResult:
    """``doctor --dcgm-diag FILE`` / ``accept --dcgm-diag FILE``: a saved ``dcgmi diag -j`` output, judged.

    Read through the one capped reader; a file that is not such an output (not JSON, cut short, another
    document) is an ``InputError`` (exit 2) in one line.
    """
    from gputopo.inputs import read_capped

    label = f"--dcgm-diag {path}"
    data = read_capped(path, label, MAX_DIAG_BYTES, _HINT)
    docs = split_documents(data.decode("utf-8-sig", "replace"), label)
    return judge_documents(docs, str(path), label)


def split_documents(text: str, label: str) -> list[Any]:
    """The JSON documents in ``text``, one after another (``--iterations`` may print two); text before the
    first ``{`` (a line a wrapper printed) is passed over. ``InputError`` for no JSON or a cut-short one."""
    from gputopo.inputs import MAX_JSON_DEPTH, depth_exceeds

    decoder = json.JSONDecoder()
    start = text.find("{")
    if start < 0:
        raise InputError(f"{label}: not a dcgmi diag -j output (no JSON in it)", _HINT)
    docs: list[Any] = []
    pos = start
    while pos < len(text):
        try:
            doc, end = decoder.raw_decode(text, pos)
        except RecursionError:
            raise InputError(f"{label}: JSON nested deeper than {MAX_JSON_DEPTH} levels", _HINT) from None
        except json.JSONDecodeError as exc:
            raise InputError(
                f"{label}: not a whole dcgmi diag -j output (line {exc.lineno}: {exc.msg}; cut short?)", _HINT
            ) from None
        if depth_exceeds(doc, MAX_JSON_DEPTH):
            raise InputError(f"{label}: JSON nested deeper than {MAX_JSON_DEPTH} levels", _HINT)
        docs.append(doc)
        rest = text[end:].lstrip()
        if not rest:
            break
        if not rest.startswith("{"):
            raise InputError(f"{label}: text after the JSON ({rest[:40]!r})", _HINT)
        pos = len(text) - len(rest)
    return docs


def judge_documents(docs: list[Any], source: str, label: str | None = None) -> DcgmDiagResult:
    """The documents of one ``dcgmi diag -j`` output, judged (``label``: raise ``InputError`` for a
    document of another shape; ``None``: the runner's case, where it is "not checked" instead)."""
    runs: list[Mapping[str, Any]] = []
    overall: tuple[str, str | None] | None = None
    for doc in docs:
        if isinstance(doc, dict) and isinstance(doc.get("iterations"), list):
            runs.extend(r for r in doc["iterations"] if isinstance(r, dict))
            word = doc.get("Overall Result")
            overall = (str(word), _text(doc.get("Warning"))) if isinstance(word, str) else None
        elif isinstance(doc, dict) and _body(doc) is not None:
            runs.append(doc)
        else:
            what = f"{label or source}: not a dcgmi diag -j output (no {NAME_4X!r} or {NAME_3X!r} in it)"
            if label is None:
                return not_checked(what, source)
            raise InputError(what, _HINT)
    if not runs:
        what = f"{label or source}: the --iterations output holds no run"
        if label is None:
            return not_checked(what, source)
        raise InputError(what, _HINT)
    return judge_runs(runs, source, overall)


def _body(doc: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for name in (NAME_4X, NAME_3X):
        body = doc.get(name)
        if isinstance(body, dict):
            return body
    return None


def judge_runs(
    runs: list[Mapping[str, Any]], source: str, overall: tuple[str, str | None] | None = None
) -> DcgmDiagResult:
    """One or more runs (``--iterations``), judged as one: a failure in any run is a failure."""
    results: list[DiagResult] = []
    serials: dict[int, str] = {}
    version = driver = runtime_error = None
    for run in runs:
        body = _body(run) or {}
        version = version or _text(_first(run, body, "version", ("metadata", "version")))
        driver = driver or _text(
            _first(run, body, "Driver Version Detected", ("metadata", "Driver Version Detected"))
        )
        serials.update(_serials(run, body))
        if isinstance(body.get("runtime_error"), str):
            runtime_error = runtime_error or body["runtime_error"].strip()
        results.extend(_results(body))
    counts = {s: sum(1 for r in results if r.status == s) for s in ("pass", "fail", "warn", "skip")}
    findings = _findings(results, serials, len(runs))
    if runtime_error:
        stopped = f"{TOOL}: DCGM's diagnostic stopped early: {_one_line(runtime_error)}"
        findings.append(_ERROR.finding("node", stopped))
    overall_fail = overall is not None and overall[0].lower() == "fail"
    why = (overall[1] if overall else None) or "DCGM gave no reason"
    if overall_fail and not counts["fail"] and not runtime_error:
        findings.append(
            _FAIL.finding(
                "node",
                f"{TOOL}: the --iterations run stopped on a failure ({why})",
                "run `dcgmi diag` once more without --iterations to see which test and GPU failed",
                category="driver",
            )
        )
    status, reason = _verdict(counts, runtime_error, overall_fail, findings)
    order = sorted(findings, key=lambda f: (f.severity != PROBLEM, f.gpu is None, f.gpu or 0))
    return DcgmDiagResult(
        status,
        reason,
        tuple(order),
        source=source,
        dcgm_version=version,
        driver_version=driver,
        serials=serials,
        counts=counts,
        iterations=len(runs),
        runtime_error=runtime_error,
    )


def _verdict(
    counts: Mapping[str, int], runtime_error: str | None, overall_fail: bool, findings: list[Finding]
) -> tuple[str, str | None]:
    problems = [f for f in findings if f.severity == PROBLEM]
    if counts["fail"] or problems or (overall_fail and not runtime_error):
        shown = "; ".join(f"{f.where}: {_code_of(f)}" for f in problems[:4])
        more = f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""
        return FAILED, f"DCGM's diagnostic failed: {shown}{more}" if shown else "DCGM's diagnostic failed"
    if runtime_error:  # what ran before it passed, but not everything ran
        return NOT_CHECKED, f"DCGM's diagnostic stopped early: {_one_line(runtime_error)}"
    if counts["pass"] or counts["warn"]:
        warned = f" with {counts['warn']} warning(s)" if counts["warn"] else ""
        return PASSED, f"DCGM's diagnostic passed{warned}" if warned else None
    if counts["skip"]:
        return NOT_CHECKED, "DCGM skipped every test it was asked to run"
    return NOT_CHECKED, "DCGM's output holds no test result"


def _code_of(f: Finding) -> str:
    found = re.search(r"DCGM_FR_[A-Z0-9_]+", f.what)
    return found.group(0) if found else f.what.split(":", 1)[-1].strip()[:60]


def _first(run: Mapping[str, Any], body: Mapping[str, Any], key: str, nested: tuple[str, str]) -> Any:
    meta = run.get(nested[0])
    if isinstance(meta, dict) and nested[1] in meta:
        return meta[nested[1]]
    return run.get(key, body.get(key))


def _serials(run: Mapping[str, Any], body: Mapping[str, Any]) -> dict[int, str]:
    out: dict[int, str] = {}
    for group in _list(run.get("entity_groups")):  # 4.x: entity_groups[].entities[].serial_num
        if not isinstance(group, dict) or str(group.get("entity_group", "")).upper() != "GPU":
            continue
        for entity in _list(group.get("entities")):
            if not isinstance(entity, dict):
                continue
            ident, serial = _int(entity.get("entity_id")), _text(entity.get("serial_num"))
            if ident is not None and serial:
                out[ident] = serial
    for where in (run, body):  # 3.x: "GPU Device Serials": {"0": serial}
        table = where.get("GPU Device Serials")
        if isinstance(table, dict):
            for key, value in table.items():
                ident, serial = _int(key), _text(value)
                if ident is not None and serial:
                    out[ident] = serial
    return out


def _results(body: Mapping[str, Any]) -> list[DiagResult]:
    out: list[DiagResult] = []
    for category in _list(body.get("test_categories")):
        if not isinstance(category, dict):
            continue
        for test in _list(category.get("tests")):
            if isinstance(test, dict):
                out.extend(_test_results(test))
    return out


def _test_results(test: Mapping[str, Any]) -> list[DiagResult]:
    name = _text(test.get("name")) or "test"
    out: list[DiagResult] = []
    seen: set[tuple[Any, str]] = set()
    for entry in _list(test.get("results")):
        if not isinstance(entry, dict):
            continue  # nvvs indexes its results by GPU: the gaps are nulls
        status = _status(entry.get("status"))
        if status is None:
            continue
        warnings = tuple(w for w in _list(entry.get("warnings")) if isinstance(w, dict))
        info = tuple(str(i) for i in _list(entry.get("info")) if isinstance(i, str))
        for where, gpu in _entities(entry):
            out.append(DiagResult(name, status, where, gpu, warnings, info))
        seen.update((_code(w), _message(w)) for w in warnings)
    summary = test.get("test_summary")
    if isinstance(summary, dict):
        # Errors of no entity appear only in the summary (HelperJsonAddResult's includeAllErrors).
        extra = tuple(
            w
            for w in _list(summary.get("warnings"))
            if isinstance(w, dict) and (_code(w), _message(w)) not in seen
        )
        status = _status(summary.get("status"))
        failed_alone = status == "fail" and not any(r.status == "fail" for r in out)
        if extra or failed_alone:
            out.append(DiagResult(name, status or "fail", "node", None, extra))
    return out


def _entities(entry: Mapping[str, Any]) -> list[tuple[str, int | None]]:
    """Where a result belongs: its entity (4.x), its GPU (3.x ``gpu_id``), its GPUs (nvvs ``gpu_ids``)."""
    group = entry.get("entity_group")
    if group is not None:
        ident = _int(entry.get("entity_id"))
        if str(group).upper() == "GPU" and ident is not None:
            return [(f"GPU{ident}", ident)]
        return [(f"{group}{'' if ident is None else ident}", None)]
    for key in ("gpu_id", "gpu_ids"):
        if key in entry:
            ids = [_int(part) for part in str(entry[key]).split(",") if part.strip()]
            if len(ids) == 1 and ids[0] is not None:
                return [(f"GPU{ids[0]}", ids[0])]
            return [("node", None)]  # a test of every GPU (the software checks): the node's
    return [("node", None)]


_STATUS_WORDS = {"pass": "pass", "fail": "fail", "warn": "warn", "warning": "warn", "skip": "skip"}


def _status(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    return _STATUS_WORDS.get(value.strip().lower())  # "Not Run" and anything unknown: left out


def _code(w: Mapping[str, Any]) -> int | None:
    return _int(w.get("error_id"))


def _message(w: Mapping[str, Any]) -> str:
    # 3.x deployment tests put the message under "warnings" (Diag.cpp v3.3.9 line 1260).
    for key in ("warning", "warnings", "message"):
        if isinstance(w.get(key), str):
            return _one_line(w[key])
    return ""


def _findings(results: list[DiagResult], serials: Mapping[int, str], runs: int) -> list[Finding]:
    found: dict[tuple[str, str, str, int | None, str], tuple[Finding, int]] = {}

    def add(key: tuple[str, str, str, int | None, str], finding: Finding) -> None:
        seen = found.get(key)
        found[key] = (seen[0] if seen else finding, (seen[1] if seen else 0) + 1)

    skipped: dict[str, list[DiagResult]] = {}
    for r in results:
        if r.status in ("fail", "warn"):
            for w in r.warnings or ({},):
                add((r.status, r.test, r.where, _code(w), _message(w)), _diag_finding(r, w, serials))
        elif r.status == "skip":
            skipped.setdefault(r.test, []).append(r)
    out = []
    for (status, *_), (f, times) in found.items():
        if runs > 1 and status in ("fail", "warn"):
            f = dataclasses.replace(f, what=f"{f.what} (in {min(times, runs)} of {runs} runs)")
        out.append(f)
    for test, rows in skipped.items():
        out.append(_skip_finding(test, rows))
    return out


def _diag_finding(r: DiagResult, w: Mapping[str, Any], serials: Mapping[int, str]) -> Finding:
    code = _code(w)
    code_name = FR_CODES.get(code, f"DCGM error {code}") if code is not None else None
    category_id, severity_id = _int(w.get("error_category")), _int(w.get("error_severity"))
    dcgm_category, ours = ERROR_CATEGORIES.get(category_id, ("", "")) if category_id is not None else ("", "")
    sev_name, action, remedy = ERROR_SEVERITIES.get(
        severity_id, ERROR_SEVERITIES[2 if r.status == "fail" else 1]
    )
    if code_name is not None and code_name in _CODE_ACTIONS:
        action, remedy = _CODE_ACTIONS[code_name]
    if severity_id not in ERROR_SEVERITIES:  # none given, or one this table does not know: shown as given
        sev_name = "" if severity_id is None else str(severity_id)
    if r.status == "warn":
        action = "monitor" if action in ("drain", "replace") else action
    serial = serials.get(r.gpu) if r.gpu is not None else None
    place = f"{r.where} (serial {serial})" if serial else ("the node" if r.where == "node" else r.where)
    verb = "failed" if r.status == "fail" else "warned"
    details = [
        f"category {dcgm_category}" if dcgm_category else "",
        f"severity {sev_name}" if sev_name else "",
    ]
    coded = (
        f"{code_name} ({code}{', ' if any(details) else ''}{', '.join(d for d in details if d)})"
        if code_name
        else ""
    )
    message = _message(w)
    what = f"{TOOL}: {r.test} {verb} on {place}"
    if coded:
        what += f": {coded}"
    if message:
        what += f": {message}"
    elif not coded and r.info:
        what += f": {_one_line(r.info[0])}"
    return (_FAIL if r.status == "fail" else _WARN).finding(
        r.where,
        what,
        remedy if r.status == "fail" else f"a warning, not a failure: {remedy}",
        gpu=r.gpu,
        category=ours or _TEST_CATEGORIES.get(r.test.lower().replace(" ", "_"), "compute"),
        action=action,
    )


def _skip_finding(test: str, rows: list[DiagResult]) -> Finding:
    places = sorted({r.where for r in rows}, key=_place_order)
    why = next((_message(w) for r in rows for w in r.warnings if _message(w)), "") or next(
        (_one_line(i) for r in rows for i in r.info), ""
    )
    where = places[0] if len(places) == 1 else ", ".join(places)
    gpu = rows[0].gpu if len(places) == 1 else None
    return _SKIP.finding(
        where,
        f"{TOOL}: {test} was skipped on {', '.join(places)}: not checked" + (f" ({why})" if why else ""),
        gpu=gpu,
        category=_TEST_CATEGORIES.get(test.lower().replace(" ", "_"), "compute"),
    )


def _place_order(where: str) -> tuple[int, str]:
    m = re.fullmatch(r"GPU(\d+)", where)
    return (int(m.group(1)), "") if m else (1 << 30, where)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _text(value: Any) -> str | None:
    return value.strip() or None if isinstance(value, str) else None


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def summary_finding(result: DcgmDiagResult) -> Finding:
    """One note that says what the diagnostic said as a whole (its status, what ran, which DCGM and
    driver), so a reader sees the file or run was read even when it holds no finding."""
    counts = ", ".join(f"{n} {word}" for word, n in result.counts.items() if n) or "no test result"
    made = ", ".join(
        part
        for part in (
            f"DCGM {result.dcgm_version}" if result.dcgm_version else "",
            f"driver {result.driver_version}" if result.driver_version else "",
            f"{result.iterations} runs" if result.iterations > 1 else "",
        )
        if part
    )
    what = f"{TOOL} ({result.source}): {result.status}" + (f": {result.reason}" if result.reason else "")
    what += f" [{counts}{'; ' + made if made else ''}]"
    remedy = {
        PASSED: "nothing to do",
        FAILED: "see the problems DCGM found, each on its GPU",
        NOT_CHECKED: "it says nothing about the GPUs: fix what kept DCGM from running, run it again",
    }[result.status]
    return _SUMMARY.finding(result.source, what, remedy)


def match_serials(result: DcgmDiagResult, serials_by_index: Mapping[int, str]) -> DcgmDiagResult:
    """``result`` held against this machine's GPUs (NVML index -> serial), for a saved file or a run:

    - a GPU DCGM names by an id that is another NVML index (the same serial) is renamed to that index;
    - a GPU of this machine whose serial the result does not hold was not diagnosed (swapped in since, or
      the file is another node's): the result is "not checked", saying which;
    - a result without serials (an early failure, an old nvvs file) cannot be matched: a note says so.

    ``accept`` calls this; ``doctor`` shows a file as it is.
    """
    if not result.serials:
        if result.status == NOT_CHECKED or not serials_by_index:
            return result
        note = _SUMMARY.finding(
            result.source,
            f"{TOOL} ({result.source}): the result names no GPU serial, so it cannot be matched to this "
            "machine's GPUs",
            "run `dcgmi diag -r LEVEL -j` on this node with DCGM 3.x or later (its JSON names the serials)",
        )
        return dataclasses.replace(result, findings=(*result.findings, note))
    index_of = {serial: index for index, serial in serials_by_index.items() if serial}
    moved = {dcgm_id: index_of[s] for dcgm_id, s in result.serials.items() if s in index_of}
    findings = tuple(_renamed(f, moved) for f in result.findings)
    missing = sorted(i for i, s in serials_by_index.items() if s and s not in result.serials.values())
    if not missing:
        return dataclasses.replace(result, findings=findings)
    shown = ", ".join(f"GPU{i} (serial {serials_by_index[i]})" for i in missing[:4])
    shown += f" and {len(missing) - 4} more" if len(missing) > 4 else ""
    reason = f"the DCGM result does not cover {shown}: another node's result, or a GPU swapped in since"
    again = "run `dcgmi diag` again on this node as it is now"
    note = _SUMMARY.finding(result.source, f"{TOOL} ({result.source}): {reason}", again)
    status = NOT_CHECKED if result.status != FAILED else FAILED  # a failure found stays a failure
    return dataclasses.replace(
        result,
        status=status,
        reason=reason if status == NOT_CHECKED else result.reason,
        findings=(*findings, note),
    )


def _renamed(f: Finding, moved: Mapping[int, int]) -> Finding:
    if f.gpu is None or moved.get(f.gpu, f.gpu) == f.gpu:
        return f
    index = moved[f.gpu]
    what = f.what.replace(f"on GPU{f.gpu} ", f"on GPU{index} (DCGM's GPU{f.gpu}) ", 1)
    return dataclasses.replace(
        f, gpu=index, where=f"GPU{index}" if f.where == f"GPU{f.gpu}" else f.where, what=what
    )


def findings_of(results: Iterable[DcgmDiagResult]) -> list[Finding]:
    """Every finding of these results, in order (doctor's and accept's one call)."""
    return [f for r in results for f in r.findings]


def _list(value: Any) -> list[Any]:
    """``value`` where it is a JSON array, else nothing (a field of the wrong type reads as absent)."""
    return value if isinstance(value, list) else []
