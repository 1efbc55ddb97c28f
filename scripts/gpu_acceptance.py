#!/usr/bin/env python3
"""GPU acceptance run: every step gputopo takes on a real NVIDIA machine, in one JSON, in under 8 minutes.

    scripts/gpu-acceptance --out-dir DIR [--budget 440] [--wheels DIR] [--device cpu]

Built for a bare GPU machine: run from a copy of the working tree (gputopo not installed; ``src`` goes on
the steps' ``PYTHONPATH``), with that machine's own Python and whatever versions of gputopo's packages it
has. Where a package is missing or outside gputopo's range (``pyproject.toml``), the wheels carried in
``--wheels`` (default ``.whl`` in the repository root, where it exists) are installed into a throwaway
folder under ``--out-dir`` and put on the path; ``--download-wheels DIR`` fills such a folder here.

This script imports nothing but the standard library (not gputopo, not torch): whatever breaks in a step,
the record is written. Under ``--out-dir`` it keeps two files and nothing else:
``gpu-acceptance-<model>-<UTC time>.json`` (``gputopo/gpu-acceptance/v1``), rewritten (to a temporary
name, then renamed) after every step, and ``gpu-acceptance-<model>-<UTC time>.tar.gz``, the rest (each
step's whole stdout and stderr, the probes' own reports, the wheel install's log), also rewritten after
every step. Its work folder (``.gpu-acceptance-work``: the installed wheels, the steps' ``TMPDIR`` and
caches) lies under ``--out-dir`` too and is deleted at the end, on Ctrl-C and on SIGTERM.

Steps, each as its own process with its own timeout (capped by what is left of the whole budget):
``nvidia-smi --query-gpu`` (driver and models), ``wheels`` (install what the machine lacks), ``import``
(gputopo from the tree, the versions it got), ``check --json``, ``topo --json``, ``bare-matmul`` (a bare
``torch.matmul`` loop on every GPU in turn: the baseline), ``sustained-matmul`` (every GPU at once for up
to ``--sustain-s`` seconds, bounded by the budget: throttling shows only under sustained load),
``probe --mode gpu --precision bf16``, and with two or more GPUs ``probe --mode p2p`` and
``probe --mode allreduce``. A failed or timed-out step is recorded, never fatal. Exit 0 when every step
passed, 1 when one failed or timed out (the file is written either way), 3 when there is no NVIDIA GPU.

``--device cpu`` is the rehearsal: the same steps on CPU stand-ins (no nvidia-smi; ``check`` and
``topo`` answer "no GPU", exit 3, which counts as not applicable there), with every floor not applicable.

The pure part (``assemble``, ``matmul_shares``, ``file_name``, ``step_timeout``, the requirement and
wheel logic) is unit-tested on CPU in tests/test_gpu_acceptance.py, and the whole run is rehearsed there
in a bare venv that has only torch.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA = "gputopo/gpu-acceptance/v1"
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU, EXIT_USAGE = 0, 1, 3, 2
# The whole run from the GPU check on; a timed-out step gets up to 20 s more to stop: under 8 minutes.
BUDGET_S = 440.0
MIN_STEP_S = 5.0  # a step that would get less is not started; it is recorded as timed out
SUSTAIN_S = 90.0  # the sustained matmul's default length (DCGM's GEMM stress runs 180 s by default)
MIN_SUSTAIN_S = 10.0
STDERR_TAIL = 2000
NO_GPU_HINT = (
    "hint: run this on a machine with an NVIDIA GPU, its driver (nvidia-smi) and a CUDA build of torch, "
    "or rehearse it here with --device cpu"
)
WORK = ".gpu-acceptance-work"  # under --out-dir; deleted at the end

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = ROOT / "src"
PYPROJECT = ROOT / "pyproject.toml"
DEFAULT_WHEELS = ROOT / ".whl"
# The bare baseline (scripts/bare_matmul.py, shared with benchmarks/bench_probe_gpu.py): the probe's own
# matmul without the probe, bf16, on each GPU in turn, about 3 s each after a warm-up.
BARE_MATMUL = HERE / "bare_matmul.py"

SMI_FIELDS = "index,name,driver_version,uuid,pci.bus_id"
# What the probe steps need beyond gputopo's own list, at the machine's versions (never carried: torch
# must be the machine's CUDA build; a GPU machine's image has torchvision and numpy to match it).
PROBE_NEEDS = (("torch", ""), ("torchvision", ""), ("numpy", ""))
# The platforms a GPU machine's wheels are fetched for (the device notes' pip download flags).
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


# ---------------------------------------------------------------- pure part (tested on CPU)


def step_timeout(planned: float, started: float, now: float, budget: float) -> float:
    """The timeout a step gets: its own, capped by what is left of the whole run's budget (never < 1 s)."""
    return max(1.0, min(planned, budget - (now - started)))


def sustain_seconds(wanted: float, left: float, reserve: float, least: float = MIN_SUSTAIN_S) -> float:
    """The sustained matmul's length: ``wanted``, shortened so that ``reserve`` seconds stay for the steps
    after it and 30 s for its own start and warm-up; 0 when not even ``least`` seconds fit."""
    fits = min(wanted, left - reserve - 30.0)
    return fits if fits >= least else 0.0


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


def _bare_rows(doc: Any) -> dict[str | None, dict[str, Any]]:
    if not isinstance(doc, dict):
        return {}
    return {_bus(g.get("pci_bus_id")): g for g in doc.get("gpus", []) if isinstance(g, dict)}


def matmul_shares(
    probe_doc: Any, bare_doc: Any, smi_gpus: list[dict[str, Any]], sustained_doc: Any = None
) -> list[dict[str, Any]]:
    """Per GPU (nvidia-smi's index): the probe's matmul figure (``per_gpu.gpus[].matmul_tflops``, the
    median repetition) over the bare loop's median on the same GPU (median over median, as
    benchmarks/bench_probe_gpu.py divides), matched by PCI bus id (CUDA may number GPUs its own way; the
    probe uses NVML's indices). With a sustained run, its median and its drop from the first window to
    the last beside them. A GPU missing from either side is listed with ``share: null`` and the reason."""
    probe_gpus = {}
    if isinstance(probe_doc, dict) and isinstance(probe_doc.get("per_gpu"), dict):
        probe_gpus = {g.get("gpu"): g for g in probe_doc["per_gpu"].get("gpus", []) if isinstance(g, dict)}
    bare_by_bus, sustained_by_bus = _bare_rows(bare_doc), _bare_rows(sustained_doc)
    indices = [g["index"] for g in smi_gpus] or sorted(i for i in probe_gpus if isinstance(i, int))
    bus_of = {g["index"]: _bus(g.get("pci_bus_id")) for g in smi_gpus}
    rows = []
    for index in indices:
        probe = probe_gpus.get(index, {}).get("matmul_tflops")
        bare_row = bare_by_bus.get(bus_of.get(index))
        bare = bare_row.get("median_tflops", bare_row.get("tflops")) if bare_row else None
        row: dict[str, Any] = {"gpu": index, "probe_tflops": probe, "bare_tflops": bare, "share": None}
        held = sustained_by_bus.get(bus_of.get(index))
        if held is not None:
            row["sustained_tflops"] = held.get("median_tflops")
            row["sustained_drop"] = held.get("drop")
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
    if step.get("skipped"):
        return True
    if step.get("not_applicable"):
        return True
    return not step.get("timed_out") and step.get("rc") == 0


# -- requirements and wheels (no `packaging` here: the bare machine may not have it)


def norm(name: str) -> str:
    """A distribution name as PEP 503 compares them: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version (``2.11.0+cu130`` -> (2, 11, 0)); a pre-release counts as it."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def _cmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return (a > b) - (a < b)


def satisfies(version: str | None, spec: str) -> bool:
    """Whether ``version`` meets a comma-separated specifier (``>=0.28,<0.29``); None never does."""
    if version is None:
        return False
    have = release(version)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.match(r"^(==|!=|>=|<=|~=|>|<)\s*(.+)$", part)
        if not m:
            continue
        op, want = m.group(1), release(m.group(2).rstrip(".*"))
        c = _cmp(have, want)
        ok = {
            "==": c == 0,
            "!=": c != 0,
            ">=": c >= 0,
            "<=": c <= 0,
            ">": c > 0,
            "<": c < 0,
            "~=": c >= 0 and have[: max(1, len(want) - 1)] == want[: max(1, len(want) - 1)],
        }[op]
        if not ok:
            return False
    return True


def parse_requirement(text: str, python: tuple[int, int]) -> tuple[str, str] | None:
    """(name, specifier) of one ``dependencies`` entry, or None when its marker leaves it out for
    ``python`` (only ``python_version`` markers occur in gputopo's list)."""
    body, _, marker = text.partition(";")
    m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$", body)
    if not m:
        return None
    marker = marker.strip()
    if marker:
        mk = re.match(r"""^python_version\s*(<=|>=|==|!=|<|>)\s*["']([\d.]+)["']$""", marker)
        if mk and not satisfies(".".join(map(str, python)), mk.group(1) + mk.group(2)):
            return None
    return m.group(1), m.group(2).strip()


def requirements(pyproject: str, python: tuple[int, int]) -> list[tuple[str, str]]:
    """gputopo's own needs (``[project] dependencies``) that apply to ``python``."""
    m = re.search(r"(?ms)^dependencies\s*=\s*\[(.*?)^\]", pyproject)
    found = re.findall(r"""^\s*(?:"([^"]+)"|'([^']+)')""", m.group(1), re.MULTILINE) if m else []
    entries = [a or b for a, b in found]
    return [r for r in (parse_requirement(e, python) for e in entries) if r is not None]


def wheel_dist(filename: str) -> tuple[str, str] | None:
    """(normalised name, version) from a wheel's file name (PEP 427), or None for another file."""
    if not filename.endswith(".whl"):
        return None
    parts = filename[:-4].split("-")
    if len(parts) < 5:
        return None
    return norm(parts[0]), parts[1]


def plan_wheels(
    needs: list[tuple[str, str]], installed: dict[str, str | None], wheels: list[str]
) -> tuple[list[str], list[dict[str, Any]]]:
    """Which carried wheels to install, and each need that stays unmet.

    A wheel goes in when its package is missing from the machine, or is there at another version than the
    one carried while gputopo's range rules the machine's out (the wheel must then meet it). A wheel for a
    package the machine has at a good version stays out: the machine's own build wins (torch's
    dependencies, for one, are pinned to it). ``installed`` maps normalised names to versions (None:
    missing)."""
    by_name: dict[str, list[tuple[str, str]]] = {}
    for w in wheels:
        dist = wheel_dist(Path(w).name)
        if dist is not None:
            by_name.setdefault(dist[0], []).append((dist[1], w))
    need_spec = {norm(n): s for n, s in needs}
    chosen: list[str] = []
    for name, carried in sorted(by_name.items()):
        have = installed.get(name)
        spec = need_spec.get(name, "")
        if have is not None and satisfies(have, spec or ">=0"):
            continue
        fitting = sorted((c for c in carried if satisfies(c[0], spec or ">=0")), key=lambda c: release(c[0]))
        if fitting:
            chosen.append(fitting[-1][1])
    unmet = []
    chosen_versions = {wheel_dist(Path(w).name)[0]: wheel_dist(Path(w).name)[1] for w in chosen}  # type: ignore[index]
    for name, spec in needs:
        got = chosen_versions.get(norm(name), installed.get(norm(name)))
        if not satisfies(got, spec or ">=0"):
            unmet.append(
                {"package": name, "wants": spec or "any", "found": installed.get(norm(name)), "carried": None}
            )
    return chosen, unmet


def assemble(
    steps: list[dict[str, Any]],
    when: datetime,
    budget: float,
    wall_s: float,
    *,
    device: str = "cuda",
    environment: dict[str, Any] | None = None,
    archive: str | None = None,
    finished: bool = True,
) -> dict[str, Any]:
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
                **({"not_applicable": s["not_applicable"]} if s.get("not_applicable") else {}),
            }
        )
    probe = parse_json(by_name.get("probe-gpu", {}).get("stdout", ""))
    bare = parse_json(by_name.get("bare-matmul", {}).get("stdout", ""))
    sustained = parse_json(by_name.get("sustained-matmul", {}).get("stdout", ""))
    return {
        "schema": SCHEMA,
        "when": when.astimezone(timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "floors": "not applicable: CPU stand-ins (a rehearsal)" if device == "cpu" else "judged by the probe",
        "finished": finished,
        "driver": drivers[0] if len(drivers) == 1 else (drivers or None),
        "gpu_models": list(dict.fromkeys(g["name"] for g in gpus)),
        "gpus": gpus,
        "environment": environment,
        "matmul_share": {
            "what": "probe --mode gpu --precision bf16 matmul TFLOP/s (median repetition) over a bare "
            "torch.matmul bf16 loop's median (8192-square) on the same GPU; the sustained run's median "
            "and its drop from the first window to the last beside them",
            "gpus": matmul_shares(probe, bare, gpus, sustained),
        },
        "steps": recorded,
        "archive": archive,
        "passed": finished and all(step_passed(s) for s in steps),
        "budget_s": budget,
        "wall_s": round(wall_s, 2),
    }


# ---------------------------------------------------------------- the machine


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name beside ``path``, then rename it over ``path``: whole or absent."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_archive(path: Path, folders: list[tuple[Path, str]]) -> list[str]:
    """One ``.tar.gz`` of every file under ``folders`` (each with its name in the archive); the names."""
    buf = io.BytesIO()
    names = []
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for folder, arcname in folders:
            if not folder.is_dir():
                continue
            for f in sorted(p for p in folder.rglob("*") if p.is_file()):
                name = f"{arcname}/{f.relative_to(folder)}"
                tar.add(f, arcname=name)
                names.append(name)
    atomic_write(path, buf.getvalue())
    return names


class Stopped(Exception):
    """SIGTERM or SIGINT reached the run: record what there is, clean up, exit."""


def _stop(signum: int, _frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def _end_group(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGINT the step's process group (the probe stops its ranks on Ctrl-C), SIGKILL it 15 s later."""
    out, err = "", ""
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
    return out or "", err or ""


def run_step(
    name: str, command: list[str], timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one step in its own process group; on timeout stop the group. Never raises for the step's own
    failure."""
    start = time.monotonic()
    step: dict[str, Any] = {
        "name": name,
        "command": command,
        "timeout_s": round(timeout, 1),
        "timed_out": False,
    }
    try:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
    except OSError as exc:
        return {**step, "rc": None, "stdout": "", "stderr": f"could not start: {exc}", "wall_s": 0.0}
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        step["timed_out"] = True
        out, err = _end_group(proc)
    except Stopped:
        _end_group(proc)
        raise
    step.update(rc=proc.returncode, stdout=out or "", stderr=err or "", wall_s=time.monotonic() - start)
    print(
        f"{name}: rc {step['rc']}{' (timed out)' if step['timed_out'] else ''}, {step['wall_s']:.1f} s",
        file=sys.stderr,
        flush=True,
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


# What the step's Python has (run in it: the machine's Python, not this script's): its version and each
# named distribution's version (None: missing), and with "--import" gputopo's and torch's too.
VERSIONS = """
import json, sys
from importlib import metadata
names = json.loads(sys.argv[1])
out = {"python": list(sys.version_info[:3]), "executable": sys.executable, "versions": {}}
for n in names:
    try:
        out["versions"][n] = metadata.version(n)
    except metadata.PackageNotFoundError:
        out["versions"][n] = None
if "--import" in sys.argv:
    import gputopo, gputopo.cli, torch
    out["gputopo"] = {"version": gputopo.__version__, "file": gputopo.__file__}
    out["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                    "cuda_available": torch.cuda.is_available()}
print(json.dumps(out))
"""


def machine_versions(python: str, names: list[str], env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [python, "-c", VERSIONS, json.dumps(names)], capture_output=True, text=True, timeout=60, env=env
    )
    doc = parse_json(done.stdout)
    if done.returncode != 0 or not isinstance(doc, dict) or not isinstance(doc.get("versions"), dict):
        raise RuntimeError(f"{python} could not list its packages: {done.stderr.strip()[-500:]}")
    return doc


def download_wheels(folder: Path, python_version: str, also: list[str]) -> int:
    """``pip download`` gputopo's needs (and theirs) as wheels for a GPU machine's Python into ``folder``;
    then ``also`` (packages that must match the machine's torch, e.g. ``torchvision==0.26.*``) without
    their dependencies, which would pull a torch in."""
    major, minor = (int(p) for p in python_version.split(".")[:2])
    needs = requirements(PYPROJECT.read_text(), (major, minor))
    base = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "-d", str(folder)]
    base += ["--python-version", f"{major}.{minor}", "--implementation", "cp"]
    for p in PLATFORMS:
        base += ["--platform", p]
    for command in ([*base, *(f"{n}{s}" for n, s in needs)], [*base, "--no-deps", *also] if also else []):
        if command:
            print(" ".join(command), file=sys.stderr)
            done = subprocess.run(command)
            if done.returncode != 0:
                return done.returncode
    return 0


def _fig(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default="reports/examples", help="the one folder it writes under")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--python", default=sys.executable, help="the Python that has torch")
    parser.add_argument(
        "--wheels", default=None, help="wheels to install where the machine lacks a package (default .whl)"
    )
    parser.add_argument("--sustain-s", type=float, default=SUSTAIN_S, help="the sustained matmul's seconds")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the rehearsal")
    parser.add_argument("--download-wheels", metavar="DIR", help="fetch the wheels here, then exit")
    parser.add_argument("--wheels-python", default="3.12", help="the GPU machine's Python (3.12)")
    parser.add_argument("--also", action="append", default=[], help="with --download-wheels: more specs")
    args = parser.parse_args(argv)
    if args.download_wheels:
        return download_wheels(Path(args.download_wheels), args.wheels_python, args.also)
    cpu = args.device == "cpu"
    started = time.monotonic()
    if not cpu:
        why = no_gpu_reason(args.python)
        if why is not None:
            print(f"gpu-acceptance: {why}\n{NO_GPU_HINT}", file=sys.stderr)
            return EXIT_NO_GPU
    wheels_dir = Path(args.wheels) if args.wheels else DEFAULT_WHEELS
    if args.wheels and not wheels_dir.is_dir():
        print(
            f"gpu-acceptance: --wheels {args.wheels}: no such folder\n"
            "hint: fill one with scripts/gpu-acceptance --download-wheels DIR",
            file=sys.stderr,
        )
        return EXIT_USAGE
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / WORK
    shutil.rmtree(work, ignore_errors=True)
    # Every file three folders down or more: where only a few files of --out-dir come back, and only those
    # at most two folders down (the device machine's $OUT), a run killed before its clean-up leaves
    # nothing there that could crowd out the JSON and the archive.
    run = work / "run"
    site, tmp, reports, logs, cache = (run / d for d in ("site", "tmp", "reports", "logs", "cache"))
    for d in (site, tmp, reports, logs, cache):
        d.mkdir(parents=True)
    # The steps' environment: gputopo from the tree, carried wheels after it, both before the machine's
    # site-packages; no bytecode written into the tree; temporary files and caches in the work folder.
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(SRC), str(site)]),
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONUNBUFFERED="1",
        TMPDIR=str(tmp),
        XDG_CACHE_HOME=str(cache),
        TRITON_CACHE_DIR=str(cache / "triton"),
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
        CUDA_CACHE_PATH=str(cache / "nv"),
        MPLCONFIGDIR=str(cache / "matplotlib"),
        GPUTOPO_CHECK_STATE="",  # check keeps no state file on this machine
        CUDA_DEVICE_ORDER=os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
    )
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")
    when = datetime.now(timezone.utc)
    steps: list[dict[str, Any]] = []
    environment: dict[str, Any] = {"wheels_dir": str(wheels_dir) if wheels_dir.is_dir() else None}
    names: dict[str, str] = {}
    state = {"archive_members": []}

    def record(finished: bool = False) -> dict[str, Any]:
        """Rewrite the JSON and the archive: after every step, and once more at the end."""
        if "json" not in names:
            models = ["cpu stand-in"] if cpu else parse_smi(steps[0].get("stdout", "")) if steps else []
            models = [m if isinstance(m, str) else m["name"] for m in models]
            names["json"] = file_name(models, when)
            names["archive"] = names["json"].removesuffix(".json") + ".tar.gz"
        for s in steps:
            log = logs / f"{s['name']}.log"
            if not log.exists() and "rc" in s:
                log.write_text(
                    f"$ {' '.join(map(str, s['command']))}\n"
                    f"# rc {s.get('rc')}, timed out {s.get('timed_out')}"
                    f"\n--- stdout\n{s.get('stdout', '')}\n--- stderr\n{s.get('stderr', '')}\n"
                )
        state["archive_members"] = write_archive(
            out_dir / names["archive"], [(logs, "logs"), (reports, "reports")]
        )
        doc = assemble(
            steps,
            when,
            args.budget,
            time.monotonic() - started,
            device=args.device,
            environment=environment,
            archive=names["archive"],
            finished=finished,
        )
        doc["archive_members"] = state["archive_members"]
        atomic_write(out_dir / names["json"], (json.dumps(doc, indent=2) + "\n").encode())
        return doc

    def step(
        name: str, command: list[str], planned: float, ok_rcs: tuple[int, ...] = (0,), why_ok: str = ""
    ) -> dict[str, Any]:
        timeout = step_timeout(planned, started, time.monotonic(), args.budget)
        if timeout < MIN_STEP_S:
            why = f"not run: the run's {args.budget:g} s budget was spent"
            s = {"name": name, "command": command, "rc": None, "timed_out": True, "timeout_s": 0.0}
            s.update(stdout="", stderr=why)
            print(f"{name}: {why}", file=sys.stderr)
        else:
            s = run_step(name, command, timeout, env)
            if cpu and s.get("rc") in ok_rcs and s.get("rc") != 0:
                s["not_applicable"] = why_ok
        steps.append(s)
        record()
        return s

    def skip(name: str, command: list[str], why: str) -> None:
        steps.append({"name": name, "command": command, "skipped": why})
        print(f"{name}: skipped ({why})", file=sys.stderr)
        record()

    old = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    py, gt = args.python, [args.python, "-m", "gputopo"]
    dev = ["--device", "cpu"] if cpu else []
    no_gpu = (3,), "no NVIDIA GPU on a CPU rehearsal (exit 3)"
    try:
        smi_cmd = ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"]
        if cpu:
            skip("nvidia-smi", smi_cmd, "--device cpu: no GPU to list")
            count = 2  # two stand-ins, so that the pair steps run too
        else:
            smi = step("nvidia-smi", smi_cmd, 20)
            count = len(parse_smi(smi["stdout"]))
        # What the machine's Python has, and the carried wheels it lacks.
        pyver = sys.version_info[:2]
        needs = [*requirements(PYPROJECT.read_text(), pyver), *PROBE_NEEDS]
        names_wanted = sorted({norm(n) for n, _ in needs})
        carried = sorted(str(p) for p in wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
        names_wanted = sorted(set(names_wanted) | {wheel_dist(Path(w).name)[0] for w in carried})  # type: ignore[index]
        base_env = {**env, "PYTHONPATH": ""}
        try:
            before = machine_versions(py, names_wanted, base_env)
            pyver = tuple(before["python"][:2])
            needs = [*requirements(PYPROJECT.read_text(), pyver), *PROBE_NEEDS]  # type: ignore[arg-type]
            chosen, unmet = plan_wheels(needs, before["versions"], carried)
            environment.update(python=before["python"], before=before["versions"], needs=dict(needs))
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            chosen, unmet = [], []
            environment["error"] = str(exc)
        environment.update(installed=[Path(w).name for w in chosen], unmet_before_install=unmet)
        pip = [py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
        pip += ["--disable-pip-version-check", "--target", str(site), *chosen]
        if chosen:
            step("wheels", pip, 120)
        elif not unmet:
            skip("wheels", pip, "nothing to install: every package gputopo needs is there, in range")
        else:
            missing = ", ".join(f"{u['package']}{u['wants']} (found {u['found']})" for u in unmet)
            held = f"none in {wheels_dir} fits" if carried else f"no wheels carried ({wheels_dir})"
            skip("wheels", pip, f"missing or out of range: {missing}; {held}")
        imp = step("import", [py, "-c", VERSIONS, json.dumps(names_wanted), "--import"], 90)
        after = parse_json(imp.get("stdout", ""))
        if isinstance(after, dict):
            environment.update(after=after.get("versions"), gputopo=after.get("gputopo"))
            environment["torch"] = after.get("torch")
            environment["unmet"] = [
                {"package": n, "wants": s or "any", "found": after["versions"].get(norm(n))}
                for n, s in needs
                if not satisfies(after["versions"].get(norm(n)), s or ">=0")
            ]
        step("check", [*gt, "check", "--json"], 45, *no_gpu)
        step("topo", [*gt, "topo", "--json"], 45, *no_gpu)
        bare_dev = ["--device", "cpu"] if cpu else []
        step("bare-matmul", [py, str(BARE_MATMUL), *bare_dev, "3"], 30 + 6 * max(count, 1))
        # The sustained run: as long as asked, but leaving the probes their planned time.
        reserve = 120 + (175 if count >= 2 else 0)
        left = args.budget - (time.monotonic() - started)
        if cpu:  # a rehearsal needs no minutes
            seconds = sustain_seconds(min(args.sustain_s, 4.0), left, 0.0, least=1.0)
        else:
            seconds = sustain_seconds(args.sustain_s, left, reserve)
        held = [py, str(BARE_MATMUL), *bare_dev, "--sustain", f"{seconds:g}"]
        if seconds > 0:
            step("sustained-matmul", held, seconds + 30 + 6 * max(count, 1))
        else:
            skip("sustained-matmul", held, f"the budget left ({left:.0f} s) leaves no {MIN_SUSTAIN_S:g} s")
        probe = [*gt, "probe", "--report-dir", str(reports), "--timeout", "60", "--json", *dev]
        if cpu:
            probe += ["--gpus", ",".join(str(i) for i in range(count))]
        step("probe-gpu", [*probe, "--mode", "gpu", "--precision", "bf16"], 120)
        for name, extra, planned in (
            ("probe-p2p", ["--mode", "p2p"], 75),
            ("probe-allreduce", ["--mode", "allreduce", "-b", "1M", "-e", "1G", "-f", "4", "-n", "20"], 100),
        ):
            if count >= 2 or not steps or not step_passed(steps[0]):  # no nvidia-smi list: let it decide
                if cpu:
                    extra = [e if e != "1G" else "16M" for e in extra]
                # CPU stand-ins have no peer-to-peer path: the probe says "nothing was tested" (exit 2).
                rehearsal = ((2,), "no peer-to-peer copies between CPU stand-ins (exit 2)")
                step(name, [*probe, *extra], planned, *(rehearsal if name == "probe-p2p" else ((0,), "")))
            else:
                skip(name, [*probe, *extra], f"{count} GPU: needs two or more")
        doc = record(finished=True)
    except Stopped as exc:
        print(f"gpu-acceptance: stopped by {exc}; the record so far is kept", file=sys.stderr)
        record(finished=False)
        return 130
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        shutil.rmtree(work, ignore_errors=True)
    for row in doc["matmul_share"]["gpus"]:
        share = f"{row['share']:.0%}" if row["share"] is not None else row.get("why")
        held_words = ""
        if row.get("sustained_tflops") is not None:
            drop = row.get("sustained_drop")
            held_words = f"; sustained {row['sustained_tflops']:.3g}" + (
                f" (drop {drop:.0%})" if isinstance(drop, (int, float)) else ""
            )
        print(
            f"GPU{row['gpu']}: probe {_fig(row['probe_tflops'])} / bare {_fig(row['bare_tflops'])} TFLOP/s: "
            f"{share}{held_words}"
        )
    path = out_dir / names["json"]
    verdict = "every step passed" if doc["passed"] else "a step failed: see steps[]"
    print(f"wrote {path} and {names['archive']} ({verdict})")
    return EXIT_OK if doc["passed"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
