"""``gputopo accept``'s steps judged (pure): what each step's readings mean, and the one verdict.

A step is ``passed``, ``failed`` (with its findings and an action in the words fleets use), ``not checked``
(it could not run: a missing tool, a budget spent, nothing it could judge; the reason said) or ``not run``
(an earlier step failed and ``--keep-going`` was not given). The node's verdict:

- ``accepted`` only when every step asked for ran and passed;
- ``rejected`` when any step failed (exit 1);
- ``not checked`` otherwise, naming each step that could not run and why (exit 3).

A node is accepted whole: a GPU its driver asks to keep out of peer-to-peer work (NVML recovery action
DRAIN_P2P) fails the wiring step, though ``check`` only notes it (other jobs may still run there).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gputopo.accept.floors import PER_GPU_METRICS, FloorTable
from gputopo.errors import EXIT_OK, EXIT_PROBLEM, EXIT_UNAVAILABLE
from gputopo.findings import PROBLEM, Finding
from gputopo.health.readings import FABRIC_COMPLETED, FABRIC_NOT_SUPPORTED, FABRIC_STATES, HealthSample

SCHEMA = "gputopo/accept/v1"
STEPS = ("inventory", "health", "dcgm", "per_gpu", "wiring")
STEP_WORDS = {
    "inventory": "inventory",
    "health": "health (gputopo check)",
    "dcgm": "DCGM diagnostics",
    "per_gpu": "each GPU alone",
    "wiring": "the wiring (P2P, all-reduce)",
}
PASSED, FAILED, NOT_CHECKED, NOT_RUN = "passed", "failed", "not checked", "not run"
ACCEPTED, REJECTED = "accepted", "rejected"
# The node's verdicts and their exit codes (node-problem-detector's convention, as check's).
EXIT_CODES = {ACCEPTED: EXIT_OK, REJECTED: EXIT_PROBLEM, NOT_CHECKED: EXIT_UNAVAILABLE}

# What to do about a failed step, in the words fleets use (NVIDIA's field diagnostic and RMA process,
# DCGM's health-response actions), by the finding's own action (``findings.ACTIONS``).
FLEET_ACTIONS = {
    "reset": "reset the GPU",
    "reboot": "reboot the node",
    "drain": "run the field diagnostic",
    "replace": "replace the GPU",
    "config": "fix the configuration",
    "monitor": "run the field diagnostic",
    "none": "contact support",
}
# From least to most disruptive: a step's action is its most disruptive finding's.
_ORDER = (
    "fix the configuration",
    "reset the GPU",
    "reboot the node",
    "run the field diagnostic",
    "replace the GPU",
    "contact support",
)


@dataclass(frozen=True)
class StepResult:
    """One step: ``name`` (one of ``STEPS``), its ``status``, one line ``summary``, its ``findings``
    (problems fail the step; notes ride along), ``why_not`` for a step that did not run or could not
    judge, ``facts`` (its measurements: the GPUs, floors, figures) and the time it took."""

    name: str
    status: str
    summary: str
    findings: tuple[Finding, ...] = ()
    why_not: str | None = None
    facts: Mapping[str, Any] = field(default_factory=dict, hash=False)
    elapsed_s: float | None = None

    @property
    def action(self) -> str | None:
        """What to do, for a failed step: its most disruptive problem's action in fleet words."""
        if self.status != FAILED:
            return None
        words = {
            FLEET_ACTIONS.get(f.action, "contact support") for f in self.findings if f.severity == PROBLEM
        }
        return max(words, key=_ORDER.index) if words else "contact support"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": STEP_WORDS.get(self.name, self.name),
            "status": self.status,
            "summary": self.summary,
            "action": self.action,
            "why_not": self.why_not,
            "findings": [f.to_json() for f in self.findings],
            "facts": dict(self.facts),
            "elapsed_s": None if self.elapsed_s is None else round(self.elapsed_s, 3),
        }


def from_findings(
    name: str, findings: Sequence[Finding], ok: str, facts: Mapping[str, Any] | None = None
) -> StepResult:
    """``failed`` with the first problem as its summary when any finding is a problem, else ``passed``
    with ``ok``."""
    problems = [f for f in findings if f.severity == PROBLEM]
    ordered = tuple(sorted(findings, key=lambda f: f.severity != PROBLEM))
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return StepResult(name, FAILED, problems[0].what + more, ordered, facts=dict(facts or {}))
    return StepResult(name, PASSED, ok, ordered, facts=dict(facts or {}))


def not_checked(name: str, why: str, facts: Mapping[str, Any] | None = None) -> StepResult:
    return StepResult(name, NOT_CHECKED, f"not checked: {why}", why_not=why, facts=dict(facts or {}))


def not_run(name: str, failed: str) -> StepResult:
    why = f"not run: the {STEP_WORDS.get(failed, failed)} step failed (--keep-going runs every step)"
    return StepResult(name, NOT_RUN, why, why_not=why)


def verdict(steps: Sequence[StepResult]) -> str:
    """``rejected`` when a step failed; ``accepted`` when every step passed; else ``not checked``."""
    if any(s.status == FAILED for s in steps):
        return REJECTED
    if steps and all(s.status == PASSED for s in steps):
        return ACCEPTED
    return NOT_CHECKED


def reason(steps: Sequence[StepResult]) -> str:
    """The one line that says why: the first failed step's summary, or each step not checked."""
    v = verdict(steps)
    if v == REJECTED:
        first = next(s for s in steps if s.status == FAILED)
        return f"rejected at {STEP_WORDS[first.name]}: {first.summary}"
    if v == ACCEPTED:
        return f"accepted: {len(steps)} step{'s' if len(steps) != 1 else ''} passed"
    open_ = [s for s in steps if s.status != PASSED]
    if not open_:
        return "not checked: no step ran"
    return "not checked: " + "; ".join(f"{STEP_WORDS[s.name]}: {s.why_not or s.status}" for s in open_)


# --- inventory ---------------------------------------------------------------------------------------------


def judge_inventory(
    sample: HealthSample | None,
    *,
    expect_gpus: int | None,
    expect_model: str | None,
    unavailable: str | None = None,
) -> StepResult:
    """The GPUs the admin expects are there (``expect_gpus``, ``expect_model``, a substring of the device
    name), every GPU answered, one VBIOS per model, and on a rack tray every GPU registered with the
    fabric in one NVLink domain. ``unavailable``: why NVML could not be read (a failure when GPUs were
    expected, else not checked)."""
    if sample is None:
        why = unavailable or "NVML could not be read"
        if expect_gpus:
            f = Finding(
                "node",
                f"no GPU could be listed ({why}); {expect_gpus} expected",
                "reboot the node (a driver/library mismatch clears on reboot); if it stays, reinstall "
                "the driver or contact support",
                gpu=None,
                category="driver",
                action="reboot",
            )
            return from_findings("inventory", [f], "")
        return not_checked("inventory", why)
    gpus = sample.gpus
    out: list[Finding] = []
    if expect_gpus is not None and len(gpus) < expect_gpus:
        out.append(
            Finding(
                "node",
                f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} present, {expect_gpus} expected "
                "(--expect-gpus)",
                "reboot the node; a GPU still missing is off the bus: reseat or "
                "replace it (`dmesg` for 'fallen off the bus', `lspci | grep -i nvidia`)",
                gpu=None,
                category="pcie",
                action="replace",
            )
        )
    for g in gpus:
        if g.error is not None:
            out.append(
                Finding(
                    g.label,
                    f"{g.label} did not answer NVML: {g.error}",
                    "reset the GPU (`nvidia-smi -r -i N`) or reboot; if it stays, replace it",
                    gpu=g.index,
                    category="driver",
                    action="reset",
                )
            )
        elif expect_model and expect_model.lower() not in (g.name or "").lower():
            out.append(
                Finding(
                    g.label,
                    f"{g.label} is a {g.name or 'GPU of unknown model'}, not "
                    f"{expect_model!r} (--expect-model)",
                    "install the GPUs this node is meant to have, or fix --expect-model",
                    gpu=g.index,
                    category="config",
                    action="config",
                )
            )
    by_model: dict[str, dict[str, list[int]]] = {}
    for g in gpus:
        if g.error is None and g.vbios_version:
            by_model.setdefault(g.name or "unknown", {}).setdefault(g.vbios_version, []).append(g.index)
    for model, versions in sorted(by_model.items()):
        if len(versions) > 1:
            said = "; ".join(f"{v} on GPU{','.join(map(str, ix))}" for v, ix in sorted(versions.items()))
            out.append(
                Finding(
                    "node",
                    f"{model}: {len(versions)} VBIOS versions on one node ({said})",
                    "flash every GPU of a model to one VBIOS (nvflash, or NVIDIA's firmware "
                    "update for the system), or contact support",
                    gpu=None,
                    category="config",
                    action="config",
                )
            )
    out += _fabric(gpus)
    facts = {
        "driver": sample.driver_version,
        "cuda_driver": sample.cuda_driver_version,
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "uuid": g.uuid,
                "pci_bus_id": g.pci_bus_id,
                "serial": g.serial,
                "vbios": g.vbios_version,
                "error": g.error,
            }
            for g in gpus
        ],
    }
    names = sorted({g.name or "unknown" for g in gpus})
    ok = (
        f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} ({', '.join(names)}), driver {sample.driver_version}"
    )
    return from_findings("inventory", out, ok, facts)


def _fabric(gpus: Sequence[Any]) -> list[Finding]:
    """On a rack tray (GPUs that take part in an NVLink fabric): each registered, all in one domain."""
    tray = [g for g in gpus if g.error is None and g.fabric_state not in (None, FABRIC_NOT_SUPPORTED)]
    out = []
    for g in tray:
        if g.fabric_state != FABRIC_COMPLETED or (g.fabric_status not in (None, 0)):
            state = FABRIC_STATES.get(g.fabric_state, f"state {g.fabric_state}")
            out.append(
                Finding(
                    g.label,
                    f"{g.label} is not registered with the NVLink fabric (registration "
                    f"{state}, status {g.fabric_status})",
                    "check the fabric manager / NVLink switch trays, then reboot the node",
                    gpu=g.index,
                    category="nvlink",
                    action="reboot",
                )
            )
    domains = {
        (g.fabric_cluster_uuid, g.fabric_clique_id) for g in tray if g.fabric_state == FABRIC_COMPLETED
    }
    if len(domains) > 1:
        said = ", ".join(f"{u or '?'}/{c}" for u, c in sorted(domains, key=str))
        out.append(
            Finding(
                "node",
                f"the tray's GPUs are in {len(domains)} NVLink domains ({said})",
                "one tray's GPUs belong in one domain: check the fabric manager's partition "
                "and the switch trays, or contact support",
                gpu=None,
                category="nvlink",
                action="none",
            )
        )
    return out


# --- each GPU alone ----------------------------------------------------------------------------------------


def median_of_runs(row: Mapping[str, Any], metric: str) -> float | None:
    """A GPU's figure for a floor: the median of its runs (a lucky best is not what it does)."""
    runs = (row.get("runs") or {}).get(metric)
    if isinstance(runs, list) and runs and all(isinstance(v, (int, float)) for v in runs):
        return float(statistics.median(runs))
    value = row.get(metric)
    return float(value) if isinstance(value, (int, float)) else None


def judge_per_gpu(per_gpu: Mapping[str, Any] | None, table: FloorTable, device: str) -> StepResult:
    """The per-GPU check's rows (``probe.judge.pergpu.per_gpu_section``) against their peers (the probe's
    own verdicts: corrupt, slow, crashed) and against the floors of their model. On CPU stand-ins every
    floor is "not applicable"; a model with no row is judged against its peers only, and says so."""
    if per_gpu is None or not per_gpu.get("gpus"):
        return not_checked("per_gpu", "the per-GPU check produced no rows")
    precision = str(per_gpu.get("precision") or "fp32")
    out: list[Finding] = []
    rows = []
    relative: set[str] = set()
    for r in per_gpu["gpus"]:
        gpu = r.get("gpu")
        label = f"GPU{gpu}"
        verdict = r.get("verdict")
        if verdict in ("slow", "corrupt", "crashed", "hung") or (
            verdict == "undecided" and r.get("undecided_about") == "bits"
        ):
            corrupt = verdict == "corrupt" or r.get("undecided_about") == "bits"
            out.append(
                Finding(
                    label,
                    f"{label} {verdict}: {r.get('why') or 'see the probe report'}",
                    "take it out of service and run the field diagnostic (`dcgmi diag -r 3`); "
                    "a GPU that repeats it is an RMA case"
                    if corrupt
                    else "look at its clocks, power and PCIe link (`nvidia-smi -q -d PERFORMANCE,PCIE "
                    f"-i {gpu}`); run the field diagnostic",
                    gpu=gpu,
                    category="compute",
                    action="replace" if corrupt else "drain",
                )
            )
        judged: dict[str, Any] = {}
        model = table.for_name(r.get("name")) if device == "cuda" else None
        if device != "cuda":
            judged = {
                m: {"value": median_of_runs(r, m), "floor": None, "status": "not applicable"}
                for m in PER_GPU_METRICS
            }
        elif model is None:
            relative.add(str(r.get("name")))
            judged = {
                m: {"value": median_of_runs(r, m), "floor": None, "status": "no floor"}
                for m in PER_GPU_METRICS
            }
        else:
            for m in PER_GPU_METRICS:
                floor = model.floor(m, precision if m == "matmul_tflops" else "")
                value = median_of_runs(r, m)
                status = (
                    "no floor"
                    if floor is None
                    else "unknown"
                    if value is None
                    else ("pass" if value >= floor.floor else "below")
                )
                judged[m] = {
                    "value": value,
                    "floor": None if floor is None else floor.to_json(),
                    "status": status,
                }
                if status == "below" and floor is not None and value is not None:
                    out.append(
                        Finding(
                            label,
                            f"{label} ({model.model}): {m} {value:.4g} (median of its runs), "
                            f"below the floor {floor.floor:g} ({floor.source}; {floor.derived})",
                            "look at its clocks, power and PCIe link (`nvidia-smi -q -d "
                            f"PERFORMANCE,PCIE -i {gpu}`), then run the field diagnostic; "
                            "a GPU that stays below is an RMA case",
                            gpu=gpu,
                            category="compute",
                            action="drain",
                        )
                    )
        rows.append(
            {
                "gpu": gpu,
                "name": r.get("name"),
                "verdict": verdict,
                "model": model.model if model else None,
                "figures": judged,
            }
        )
    facts: dict[str, Any] = {
        "device": device,
        "precision": precision,
        "floors": "not applicable (CPU stand-ins)" if device != "cuda" else table.source,
        "relative_only": sorted(relative),
        "gpus": rows,
    }
    n = len(rows)
    if device != "cuda":
        ok = f"{n} CPU stand-in(s): results bit-identical, none slow against its peers; floors not applicable"
    elif relative:
        ok = (
            f"{n} GPU(s) at or above their floors; no floors for {', '.join(sorted(relative))}: judged "
            "against its peers only (no GPU below the others by more than the noise allows)"
        )
    else:
        ok = f"{n} GPU(s) at or above their floors ({precision} matmul, memory, host copies both ways)"
    return from_findings("per_gpu", out, ok, facts)


# --- the wiring --------------------------------------------------------------------------------------------


def drain_p2p_findings(drained: Mapping[int, str]) -> list[Finding]:
    """A GPU whose driver asks to keep P2P work off it fails the wiring: a node is accepted whole."""
    return [
        Finding(
            f"GPU{g}",
            f"GPU{g}: the driver asks to keep peer-to-peer work off it ({why}); a node is accepted whole",
            "drain the node and reset the GPU (`nvidia-smi -r -i N`), then run `gputopo accept` again",
            gpu=g,
            category="nvlink",
            action="reset",
        )
        for g, why in sorted(drained.items())
    ]


def judge_wiring(
    *,
    drained: Mapping[int, str],
    p2p: Mapping[str, Any] | None,
    allreduce: Mapping[str, Any] | None,
    table: FloorTable,
    device: str,
    names: Mapping[int, str | None],
    why_not: Sequence[str] = (),
) -> StepResult:
    """The wiring: no GPU drained of P2P; the P2P data check on every pair (exact bytes; GB/s against the
    model's NVLink pair floor where the pair is on NVLink); an all-reduce over every GPU with no wrong
    element, its peak busbw against the model's floor for that GPU count. ``p2p``/``allreduce`` are probe
    documents (``gputopo/probe/v1``), ``None`` when not run (``why_not`` says why)."""
    out = drain_p2p_findings(drained)
    facts: dict[str, Any] = {"device": device, "drained": {str(g): w for g, w in sorted(drained.items())}}
    ran = False
    for doc, name in ((p2p, "p2p"), (allreduce, "allreduce")):
        for s in (doc or {}).get("sets") or []:
            for c in s.get("checks") or []:
                if c.get("verdict") == "fail":
                    ran = True
                    where = "GPU" + "-GPU".join(map(str, s.get("gpus") or []))
                    out.append(
                        Finding(
                            where,
                            f"{name} on {where}: {c.get('kind')}: {c.get('detail')}",
                            c.get("remedy") or "see the probe report",
                            gpu=None,
                            category="nvlink",
                            action="drain",
                        )
                    )
                elif c.get("verdict") == "pass":
                    ran = True
    pairs = _pair_floors(p2p, table, device, names, out)
    facts["pairs"] = pairs
    facts["allreduce"] = _allreduce_floor(allreduce, table, device, names, out)
    if not ran and not out:
        return not_checked("wiring", "; ".join(why_not) or "no wiring check ran", facts)
    n = len(names)
    words = [f"all-reduce over {n} GPU(s): no wrong element"]
    if device == "cuda":
        words.append(f"P2P data check on {len(pairs)} pair(s): exact")
    else:
        words.append("P2P copies not applicable on CPU stand-ins; floors not applicable")
    return from_findings("wiring", out, "; ".join(words), facts)


def _pair_floors(
    p2p: Mapping[str, Any] | None,
    table: FloorTable,
    device: str,
    names: Mapping[int, str | None],
    out: list[Finding],
) -> list[dict[str, Any]]:
    rows = []
    for s in (p2p or {}).get("sets") or []:
        for c in s.get("checks") or []:
            for p in (c.get("metrics") or {}).get("pairs") or []:
                src, dst = p.get("src"), p.get("dst")
                value = p.get("unidir_gbps")
                model = table.for_name(names.get(src)) if device == "cuda" else None
                floor = model.floor("nvlink_pair_gbps") if model is not None else None
                on_nvlink = str(p.get("path") or "").upper().startswith("NV")
                status = (
                    "not applicable"
                    if device != "cuda"
                    else "no floor"
                    if floor is None or not on_nvlink
                    else ("pass" if isinstance(value, (int, float)) and value >= floor.floor else "below")
                )
                if status == "below" and floor is not None:
                    out.append(
                        Finding(
                            f"GPU{src}-GPU{dst}",
                            f"GPU{src}->GPU{dst} copies at {value} GB/s over "
                            f"{p.get('path')}, below the floor {floor.floor:g} ({floor.source})",
                            "check the NVLink links (`nvidia-smi nvlink -s`, `gputopo check`) "
                            "and run the field diagnostic",
                            gpu=None,
                            category="nvlink",
                            action="drain",
                        )
                    )
                rows.append(
                    {"src": src, "dst": dst, "unidir_gbps": value, "path": p.get("path"), "status": status}
                )
    return rows


def _allreduce_floor(
    doc: Mapping[str, Any] | None,
    table: FloorTable,
    device: str,
    names: Mapping[int, str | None],
    out: list[Finding],
) -> dict[str, Any] | None:
    for s in (doc or {}).get("sets") or []:
        for c in s.get("checks") or []:
            if c.get("name") != "allreduce":
                continue
            gpus = list(s.get("gpus") or [])
            peak = (c.get("metrics") or {}).get("peak_busbw_gbps")
            model_names = {names.get(g) for g in gpus}
            model = (
                table.for_name(next(iter(model_names)))
                if device == "cuda" and len(model_names) == 1
                else None
            )
            floor = model.floor("allreduce_busbw_gbps", str(len(gpus))) if model is not None else None
            status = (
                "not applicable"
                if device != "cuda"
                else "no floor"
                if floor is None
                else ("pass" if isinstance(peak, (int, float)) and peak >= floor.floor else "below")
            )
            if status == "below" and floor is not None:
                out.append(
                    Finding(
                        "GPU" + "-GPU".join(map(str, gpus)),
                        f"all-reduce over {len(gpus)} GPUs peaks "
                        f"at {peak} GB/s busbw, below the floor {floor.floor:g} ({floor.source})",
                        "check the links (`gputopo topo`, `gputopo check`), NCCL_P2P_DISABLE / "
                        "NCCL_NVLS_ENABLE in the environment, and run the field diagnostic",
                        gpu=None,
                        category="nvlink",
                        action="drain",
                    )
                )
            return {
                "gpus": gpus,
                "peak_busbw_gbps": peak,
                "floor": None if floor is None else floor.to_json(),
                "status": status,
            }
    return None
