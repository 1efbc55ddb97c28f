#!/usr/bin/env python3
"""GPU acceptance run: every step gputopo takes on a real NVIDIA machine, in one JSON, in under 8 minutes.

    scripts/gpu-acceptance [--out-dir reports/examples] [--budget 440]

Runs, each as ``python -m gputopo ...`` with its own timeout (capped by what is left of the whole
budget): ``nvidia-smi --query-gpu`` (driver and models), ``check --json``, ``topo --json``, a bare
``torch.matmul`` loop on every GPU (the baseline), ``probe --mode gpu --precision bf16 --json``, and with
two or more GPUs ``probe --mode p2p --json`` and ``probe --mode allreduce --json``. Writes one JSON,
``gpu-acceptance-<model>-<UTC time>.json``, with each step's command, exit code, wall time, stderr tail
and parsed JSON output, and the probe's matmul figure as a share of the bare loop's per GPU. A failed or
timed-out step is recorded, never fatal. Exit 0 when every step passed, 1 when one failed or timed out
(the file is written either way), 3 when there is no NVIDIA GPU to run on.

The pure part (``assemble``, ``matmul_shares``, ``file_name``, ``step_timeout``) is unit-tested on CPU in
tests/test_gpu_acceptance.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA = "gputopo/gpu-acceptance/v1"
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 3
# The whole run from the GPU check on; a timed-out step gets up to 20 s more to stop: under 8 minutes.
BUDGET_S = 440.0
MIN_STEP_S = 5.0  # a step that would get less is not started; it is recorded as timed out
STDERR_TAIL = 2000
NO_GPU_HINT = (
    "hint: run this on a machine with an NVIDIA GPU, its driver (nvidia-smi) and a CUDA build of torch "
    '(pip install "gputopo[probe]")'
)

# The bare baseline (scripts/bare_matmul.py, shared with benchmarks/bench_probe_gpu.py): the probe's own
# matmul without the probe, bf16, on each GPU in turn, about 3 s each after a warm-up.
BARE_MATMUL = Path(__file__).resolve().parent / "bare_matmul.py"

SMI_FIELDS = "index,name,driver_version,uuid,pci.bus_id"


# ---------------------------------------------------------------- pure part (tested on CPU)


def step_timeout(planned: float, started: float, now: float, budget: float) -> float:
    """The timeout a step gets: its own, capped by what is left of the whole run's budget (never < 1 s)."""
    return max(1.0, min(planned, budget - (now - started)))


def parse_json(text: str) -> Any:
    """A step's stdout as JSON, or None when it printed none (a crash, a timeout, a usage error)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


def parse_smi(text: str) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=index,name,driver_version,uuid,pci.bus_id --format=csv,noheader`` rows."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 5 or not cells[0].isdigit():
            continue
        gpus.append(
            {
                "index": int(cells[0]),
                "name": cells[1],
                "driver": cells[2],
                "uuid": cells[3],
                "pci_bus_id": cells[4],
            }
        )
    return gpus


def _bus(bus: str | None) -> str | None:
    """A PCI bus id in one spelling: nvidia-smi says 00000000:18:00.0, torch 0000:18:00.0 (lower case)."""
    if not bus:
        return None
    m = re.match(r"^(?:[0-9a-fA-F]+:)?([0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])$", bus.strip())
    return m.group(1).lower() if m else bus.strip().lower()


def matmul_shares(probe_doc: Any, bare_doc: Any, smi_gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per GPU (nvidia-smi's index): the probe's matmul figure (``per_gpu.gpus[].matmul_tflops``) over the
    bare loop's on the same GPU, matched by PCI bus id (CUDA numbers GPUs its own way; the probe uses
    NVML's indices). A GPU missing from either side is listed with ``share: null`` and the reason."""
    probe_gpus = {}
    if isinstance(probe_doc, dict) and isinstance(probe_doc.get("per_gpu"), dict):
        probe_gpus = {g.get("gpu"): g for g in probe_doc["per_gpu"].get("gpus", []) if isinstance(g, dict)}
    bare_by_bus = {}
    if isinstance(bare_doc, dict):
        bare_by_bus = {_bus(g.get("pci_bus_id")): g for g in bare_doc.get("gpus", []) if isinstance(g, dict)}
    indices = [g["index"] for g in smi_gpus] or sorted(i for i in probe_gpus if isinstance(i, int))
    bus_of = {g["index"]: _bus(g.get("pci_bus_id")) for g in smi_gpus}
    rows = []
    for index in indices:
        probe = probe_gpus.get(index, {}).get("matmul_tflops")
        bare_row = bare_by_bus.get(bus_of.get(index))
        bare = bare_row.get("tflops") if bare_row else None
        row: dict[str, Any] = {"gpu": index, "probe_tflops": probe, "bare_tflops": bare, "share": None}
        if not isinstance(probe, (int, float)):
            row["why"] = "the per-GPU probe gave no matmul figure for this GPU"
        elif not isinstance(bare, (int, float)) or bare <= 0:
            row["why"] = "the bare torch.matmul loop gave no figure for this GPU"
        else:
            row["share"] = round(probe / bare, 4)
        rows.append(row)
    return rows


def _slug(name: str) -> str:
    name = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def file_name(models: list[str], when: datetime) -> str:
    """``gpu-acceptance-<model>-<UTC time>.json``; several models joined by ``+`` in first-seen order."""
    unique = list(dict.fromkeys(_slug(m) for m in models)) or ["unknown"]
    return f"gpu-acceptance-{'+'.join(unique)}-{when.astimezone(timezone.utc):%Y%m%dT%H%M%SZ}.json"


def step_passed(step: dict[str, Any]) -> bool:
    return not step.get("timed_out") and step.get("rc") == 0


def assemble(steps: list[dict[str, Any]], when: datetime, budget: float, wall_s: float) -> dict[str, Any]:
    """The one document: machine (driver, models), each step as run, and the matmul shares."""
    by_name = {s["name"]: s for s in steps}
    smi = by_name.get("nvidia-smi", {})
    gpus = parse_smi(smi.get("stdout", "")) if smi else []
    drivers = sorted({g["driver"] for g in gpus})
    recorded = []
    for s in steps:
        recorded.append(
            {
                "name": s["name"],
                "command": s["command"],
                "rc": s.get("rc"),
                "timed_out": bool(s.get("timed_out")),
                "timeout_s": s.get("timeout_s"),
                "wall_s": round(s.get("wall_s", 0.0), 2),
                "stderr_tail": (s.get("stderr") or "")[-STDERR_TAIL:],
                "output": parse_json(s.get("stdout", "")) if s["name"] != "nvidia-smi" else gpus,
                **({"skipped": s["skipped"]} if s.get("skipped") else {}),
            }
        )
    probe = parse_json(by_name.get("probe-gpu", {}).get("stdout", ""))
    bare = parse_json(by_name.get("bare-matmul", {}).get("stdout", ""))
    ran = [s for s in steps if not s.get("skipped")]
    return {
        "schema": SCHEMA,
        "when": when.astimezone(timezone.utc).isoformat(timespec="seconds"),
        "driver": drivers[0] if len(drivers) == 1 else (drivers or None),
        "gpu_models": list(dict.fromkeys(g["name"] for g in gpus)),
        "gpus": gpus,
        "matmul_share": {
            "what": "probe --mode gpu --precision bf16 matmul TFLOP/s over a bare torch.matmul bf16 loop "
            "(8192-square, best repetition) on the same GPU",
            "gpus": matmul_shares(probe, bare, gpus),
        },
        "steps": recorded,
        "passed": all(step_passed(s) for s in ran),
        "budget_s": budget,
        "wall_s": round(wall_s, 2),
    }


# ---------------------------------------------------------------- the machine


def run_step(name: str, command: list[str], timeout: float) -> dict[str, Any]:
    """Run one step in its own process group; on timeout SIGINT the group (the probe stops its ranks on
    Ctrl-C), then SIGKILL it 15 s later. Never raises for the step's own failure."""
    start = time.monotonic()
    step: dict[str, Any] = {
        "name": name,
        "command": command,
        "timeout_s": round(timeout, 1),
        "timed_out": False,
    }
    try:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    except OSError as exc:
        return {**step, "rc": None, "stdout": "", "stderr": f"could not start: {exc}", "wall_s": 0.0}
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        step["timed_out"] = True
        for sig, grace in ((signal.SIGINT, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, err = proc.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            out, err = "", ""
    step.update(rc=proc.returncode, stdout=out or "", stderr=err or "", wall_s=time.monotonic() - start)
    print(
        f"{name}: rc {step['rc']}{' (timed out)' if step['timed_out'] else ''}, {step['wall_s']:.1f} s",
        file=sys.stderr,
    )
    return step


def no_gpu_reason(python: str) -> str | None:
    """Why this machine cannot be accepted (no nvidia-smi, no GPU listed, torch without CUDA), or None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no NVIDIA GPU here: nvidia-smi is not on PATH"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no NVIDIA GPU here: nvidia-smi -L failed ({exc})"
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        return f"no NVIDIA GPU here: nvidia-smi -L listed none (exit {listed.returncode})"
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        cuda = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"torch cannot reach the GPUs: {exc}"
    if cuda.returncode != 0:
        return "torch has no CUDA here (torch.cuda.is_available() is False, or torch is missing)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default="reports/examples", help="where the JSON goes")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--python", default=sys.executable, help="the Python that has gputopo and torch")
    args = parser.parse_args(argv)
    started = time.monotonic()
    why = no_gpu_reason(args.python)
    if why is not None:
        print(f"gpu-acceptance: {why}\n{NO_GPU_HINT}", file=sys.stderr)
        return EXIT_NO_GPU
    when = datetime.now(timezone.utc)
    gt = [args.python, "-m", "gputopo"]
    steps: list[dict[str, Any]] = []

    def step(name: str, command: list[str], planned: float) -> dict[str, Any]:
        timeout = step_timeout(planned, started, time.monotonic(), args.budget)
        if timeout < MIN_STEP_S:
            why = f"not run: the run's {args.budget:g} s budget was spent"
            s = {"name": name, "command": command, "rc": None, "timed_out": True, "stdout": "", "stderr": why}
            print(f"{name}: {why}", file=sys.stderr)
        else:
            s = run_step(name, command, timeout)
        steps.append(s)
        return s

    with tempfile.TemporaryDirectory(prefix="gpu-acceptance-") as report_dir:
        smi = step("nvidia-smi", ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"], 20)
        count = len(parse_smi(smi["stdout"]))
        step("check", [*gt, "check", "--json"], 45)
        step("topo", [*gt, "topo", "--json"], 45)
        step("bare-matmul", [args.python, str(BARE_MATMUL), "3"], 30 + 6 * max(count, 1))
        probe = [*gt, "probe", "--report-dir", report_dir, "--timeout", "60", "--json"]
        step("probe-gpu", [*probe, "--mode", "gpu", "--precision", "bf16"], 120)
        for name, extra, planned in (
            ("probe-p2p", ["--mode", "p2p"], 75),
            ("probe-allreduce", ["--mode", "allreduce", "-b", "1M", "-e", "1G", "-f", "4", "-n", "20"], 100),
        ):
            if count >= 2 or not step_passed(smi):  # without nvidia-smi's list, let the probe decide
                step(name, [*probe, *extra], planned)
            else:
                steps.append(
                    {"name": name, "command": [*probe, *extra], "skipped": f"{count} GPU: needs two or more"}
                )
    doc = assemble(steps, when, args.budget, time.monotonic() - started)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / file_name(doc["gpu_models"], when)
    from gputopo.outputs import atomic_write

    atomic_write(path, json.dumps(doc, indent=2) + "\n")
    for row in doc["matmul_share"]["gpus"]:
        share = f"{row['share']:.0%}" if row["share"] is not None else row.get("why")
        print(f"GPU{row['gpu']}: probe {row['probe_tflops']} / bare {row['bare_tflops']} TFLOP/s: {share}")
    print(f"wrote {path} ({'every step passed' if doc['passed'] else 'a step failed: see steps[]'})")
    return EXIT_OK if doc["passed"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
