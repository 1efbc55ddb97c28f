"""``dcgmi diag -j`` documents of DCGM's real shapes, and a fake ``dcgmi`` that answers with them.

Each builder writes what DCGM's writer would (NVIDIA/DCGM at 72fa3fe, DCGM 4.6.0; v3.3.9 for 3.x):

- ``doc_4x``: ``dcgmi/Diag.cpp`` ``HelperJsonBuildOutput`` (lines 1238-1289): ``"DCGM Diagnostic"`` ->
  ``test_categories[]`` (``category``, ``tests[]``: ``name``, ``results[]``, ``test_summary``), root
  ``entity_groups[]`` (``HelperJsonAddEntities``, 1149-1181) and ``metadata`` (1183-1214). A result
  (``HelperJsonAddResult``, 1056-1121): ``entity_group_id`` then ``entity_group`` ("GPU",
  ``DcgmFieldsGetEntityGroupString``) then ``entity_id``, ``status`` (``HelperDisplayDiagResult``, 845-866,
  with no "Warn": a warning reads "Fail"), ``warnings[]`` of ``warning``, ``error_id``, ``error_category``,
  ``error_severity`` (numbers, ``dcgmlib/dcgm_errors.h``), ``info[]``.
- ``doc_3x``: v3.3.9 ``dcgmi/Diag.cpp`` ``HelperJsonBuildOutput`` (1404-1500) and ``HelperJsonAddResult``
  (1333-1375): ``"DCGM GPU Diagnostic"``, ``"gpu_id": "3"`` as a string, root ``version``,
  ``Driver Version Detected`` and ``GPU Device Serials``.
- ``doc_nvvs``: v3.3.9 ``nvvs/src/JsonOutput.cpp`` (``Result`` 285-420, ``print`` 430-438) and
  ``Output.cpp`` ``resultEnumToString`` (121-141): ``gpu_ids``, "PASS"/"WARN"/"SKIP"/"FAIL"; its sample is
  DCGM's own ``testing/TestDiagManagerStrings.h``.
- ``iterations``: ``Diag::RunStartDiag`` (577-632): ``{"iterations": [...], "Overall Result": ...}``.
- ``runtime_error``: ``HelperDisplayFailureMessage`` (634-653): ``{"DCGM Diagnostic": {"version",
  "runtime_error"}}``.

``fake_dcgmi(bin_dir, answers)`` writes an executable ``dcgmi`` whose answer to ``diag -r LEVEL -j`` is
``answers[LEVEL]``: ``{"stdout": text, "rc": code, "hang_s": seconds}``; it logs each call (argv) to
``calls.log`` beside it and, while hanging, ignores nothing: SIGTERM ends it (as the real one ends after
stopping the diagnostic), unless ``"ignore_term": true`` (a dcgmi stuck in the host engine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

VERSION = "4.6.0"
DRIVER = "580.159.03"
SERIALS = {i: f"165012345{i:04d}" for i in range(8)}
DEVICE_ID = "2330"  # H100 SXM5's PCI device id, as DCGM's skuDeviceId

# The tests of a level-3 run, by category (nvvs/include/PluginStrings.h PLUGIN_CATEGORY_*).
LEVEL_TESTS: dict[int, list[tuple[str, str]]] = {
    1: [("Deployment", "software")],
    2: [("Deployment", "software"), ("Integration", "pcie"), ("Hardware", "memory")],
    3: [
        ("Deployment", "software"),
        ("Integration", "pcie"),
        ("Hardware", "memory"),
        ("Hardware", "diagnostic"),
        ("Stress", "targeted_stress"),
        ("Stress", "targeted_power"),
        ("Stress", "memory_bandwidth"),
    ],
    4: [
        ("Deployment", "software"),
        ("Integration", "pcie"),
        ("Hardware", "memory"),
        ("Hardware", "diagnostic"),
        ("Hardware", "pulse_test"),
        ("Stress", "targeted_stress"),
        ("Stress", "targeted_power"),
        ("Stress", "memory_bandwidth"),
        ("Stress", "memtest"),
    ],
}


def warning(code: int, category: int, severity: int, message: str) -> dict[str, Any]:
    return {"warning": message, "error_id": code, "error_category": category, "error_severity": severity}


FAULTY_MEMORY_GPU3 = warning(
    52, 10, 2, "A memory mismatch was detected on GPU 3, but no error was reported by CUDA or NVML."
)
ECC_OFF = warning(
    55,
    3,
    5,
    'ECC memory on GPU 0 is not currently active. Please use "nvidia-smi -i 0 -e 1" to enable and reboot.',
)
SKIPPED = warning(117, 0, 0, "The test memtest was skipped: no CUDA device is free")
POWER_LOW = warning(63, 14, 1, "Target power 700 W could not be reached on GPU 5: 640 W")


def result_4x(
    gpu: int, status: str, warnings: list[dict[str, Any]] | None = None, info: list[str] | None = None
) -> dict:
    entry: dict[str, Any] = {"entity_group_id": 1, "entity_group": "GPU", "entity_id": gpu, "status": status}
    if warnings:
        entry["warnings"] = warnings
    if info:
        entry["info"] = info
    return entry


def doc_4x(
    level: int = 3,
    gpus: int = 8,
    outcome: dict[tuple[str, int], tuple[str, list[dict[str, Any]]]] | None = None,
    global_errors: dict[str, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """A 4.x document: every test of ``level`` on every GPU passes, but where ``outcome[(test, gpu)]`` says
    (status, warnings); ``global_errors[test]`` are errors of no entity (only in the test's summary)."""
    outcome = outcome or {}
    global_errors = global_errors or {}
    categories: dict[str, list[dict[str, Any]]] = {}
    for category, test in LEVEL_TESTS[level]:
        results = []
        for gpu in range(gpus):
            status, warns = outcome.get((test, gpu), ("Pass", []))
            results.append(result_4x(gpu, status, warns))
        every = [w for r in results for w in r.get("warnings", [])] + global_errors.get(test, [])
        statuses = {r["status"] for r in results}
        overall = (
            "Fail"
            if "Fail" in statuses or global_errors.get(test)
            else ("Skip" if statuses == {"Skip"} else "Pass")
        )
        summary: dict[str, Any] = {"status": overall}
        if every:
            summary["warnings"] = every
        categories.setdefault(category, []).append(
            {"name": test, "results": results, "test_summary": summary}
        )
    return {
        "DCGM Diagnostic": {
            "test_categories": [{"category": c, "tests": tests} for c, tests in categories.items()],
        },
        "entity_groups": [
            {
                "entities": [
                    {"entity_id": g, "serial_num": SERIALS[g], "device_id": DEVICE_ID} for g in range(gpus)
                ],
                "entity_group_id": 1,
                "entity_group": "GPU",
            }
        ],
        "metadata": {"version": VERSION, "Driver Version Detected": DRIVER},
    }


def doc_3x(fail_gpu: int | None = None, gpus: int = 4) -> dict[str, Any]:
    """A 3.x ``dcgmi diag -r 2 -j``: the deployment tests as one result, the plugins per GPU."""
    memory = []
    for gpu in range(gpus):
        entry: dict[str, Any] = {"gpu_id": str(gpu), "status": "Pass"}
        if gpu == fail_gpu:
            entry = {"gpu_id": str(gpu), "status": "Fail", "warnings": [FAULTY_MEMORY_GPU3]}
        memory.append(entry)
    return {
        "DCGM GPU Diagnostic": {
            "test_categories": [
                {
                    "category": "Deployment",
                    "tests": [
                        {"name": "Denylist", "results": [{"status": "Pass"}]},
                        {"name": "Persistence Mode", "results": [{"status": "Pass"}]},
                    ],
                },
                {"category": "Hardware", "tests": [{"name": "GPU Memory", "results": memory}]},
            ]
        },
        "version": "3.3.9",
        "Driver Version Detected": "550.90.07",
        "GPU Device IDs": [DEVICE_ID] * gpus,
        "GPU Device Serials": {str(g): SERIALS[g] for g in range(gpus)},
    }


def doc_nvvs() -> dict[str, Any]:
    """nvvs's own JSON, as DCGM's testing/TestDiagManagerStrings.h shows it (abridged): ``gpu_ids``, upper
    case statuses, a skip with its warning on GPU 0, a warning on GPU 2, results indexed by GPU."""
    return {
        "DCGM GPU Diagnostic": {
            "version": "3.3.9",
            "test_categories": [
                {
                    "category": "Deployment",
                    "tests": [{"name": "Denylist", "results": [{"gpu_ids": "0,1,2,3", "status": "PASS"}]}],
                },
                {
                    "category": "Hardware",
                    "tests": [
                        {
                            "name": "memory",
                            "results": [
                                {"gpu_ids": "0", "status": "SKIP", "warnings": [ECC_OFF]},
                                {
                                    "gpu_ids": "1",
                                    "info": ["Allocated 16583361795 bytes (97.2%)"],
                                    "status": "PASS",
                                },
                                {"gpu_ids": 2, "status": "WARN", "warnings": [POWER_LOW]},
                                None,
                            ],
                        }
                    ],
                },
            ],
        }
    }


def iterations(runs: list[dict[str, Any]], failed: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"iterations": runs, "Overall Result": "Fail" if failed else "Pass"}
    if failed:
        doc["Warning"] = failed
    return doc


LOST_HOST_ENGINE = (
    "Error: Unable to complete diagnostic for group 0. Return: (-33) : Host engine connection "
    "invalid/disconnected\n"
)


def runtime_error(message: str = LOST_HOST_ENGINE) -> dict[str, Any]:
    return {"DCGM Diagnostic": {"version": VERSION, "runtime_error": message}}


def styled(doc: Any) -> str:
    """As jsoncpp's toStyledString writes it: three-space indent."""
    return json.dumps(doc, indent=3) + "\n"


_SCRIPT = """#!{python}
import json, os, signal, sys, time
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "calls.log"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
answers = json.load(open(os.path.join(here, "answers.json")))
args = sys.argv[1:]
level = args[args.index("-r") + 1] if "-r" in args else "1"
answer = answers.get(level) or answers.get("*") or {{"stdout": "", "rc": 0}}
if answer.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if answer.get("hang_s"):
    if answer.get("child"):
        import subprocess
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(answer["hang_s"])
sys.stdout.write(answer.get("stdout", ""))
sys.stderr.write(answer.get("stderr", ""))
sys.exit(answer.get("rc", 0))
"""


def answer(kind: str, level: int = 3, gpus: int = 8) -> dict[str, Any]:
    """One ready answer of the fake ``dcgmi`` (for ``fake_dcgmi``'s ``answers``), by what it should say:
    ``pass``, ``fail_gpu3`` (DCGM_FR_FAULTY_MEMORY on GPU 3; exit 226, as dcgmi returns DCGM_ST_NVVS_ERROR,
    -30 in dcgm_structs.h),
    ``warn`` (nvvs's WARN shape), ``skips`` (every test skipped), ``runtime_error`` (no host engine, exit
    255), ``text`` (no JSON at all), ``hang`` (sleeps, with a child, until stopped)."""
    if kind == "pass":
        return {"stdout": styled(doc_4x(level=level, gpus=gpus)), "rc": 0}
    if kind == "fail_gpu3":
        bad = doc_4x(level=level, gpus=gpus, outcome={("software", 3): ("Fail", [FAULTY_MEMORY_GPU3])})
        return {"stdout": styled(bad), "rc": 226}
    if kind == "warn":
        return {"stdout": styled(doc_nvvs()), "rc": 0}
    if kind == "skips":
        every = {(t, g): ("Skip", [SKIPPED]) for _, t in LEVEL_TESTS[level] for g in range(gpus)}
        return {"stdout": styled(doc_4x(level=level, gpus=gpus, outcome=every)), "rc": 0}
    if kind == "runtime_error":
        return {"stdout": styled(runtime_error()), "rc": 255}
    if kind == "text":
        return {
            "stdout": "Error: unable to establish a connection to the specified host: localhost\n",
            "rc": 255,
        }
    if kind == "hang":
        return {"hang_s": 600, "child": True, "stdout": "{}"}
    raise ValueError(f"no fake dcgmi answer {kind!r}")


def fake_dcgmi(bin_dir: Path, answers: dict[str, dict[str, Any]]) -> Path:
    """Write ``bin_dir/dcgmi`` answering ``answers`` (by level, "*" for any) and return its path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "answers.json").write_text(json.dumps(answers))
    exe = bin_dir / "dcgmi"
    exe.write_text(_SCRIPT.format(python=sys.executable))
    exe.chmod(0o755)
    return exe


def calls(bin_dir: Path) -> list[list[str]]:
    log = bin_dir / "calls.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
