"""NVIDIA Health Validation's verdict (the ``NodeVerdict`` JSON it writes to stdout), read into gputopo's
one finding shape (pure).

What its documentation confirms (docs.nvidia.com/health-validation: "Verdict Schema", "FAQ", "Integrating
into a GPU cluster"; the machine-readable contract, ``catalog/health/node-verdict.schema.json`` in
github.com/dsx-ai-factory/health-validation, could not be read from here):

- one run writes one JSON ``NodeVerdict`` for one node; ``overall_severity`` is one of PASS, INFO, WARNING,
  CRITICAL, UNKNOWN (enums serialize as strings); its CLI exits 0 for PASS/INFO/WARNING, 1 for CRITICAL or
  UNKNOWN ("the node should be removed from service, or its health could not be assessed"), 2 when no
  verdict was produced;
- an ``AffectedComponent`` "summarizes a category with non-Pass results": ``category``, ``max_severity``,
  ``check_ids[]`` and ``entities[]`` (strings).

What is not confirmed, and so read leniently: the key of the list of affected components
(``affected_components``, as the issue and the struct's name give it), the spelling of an entity (a GPU is
taken from ``GPU 3``, ``gpu3``, ``GPU-3`` or ``gpu_3``; anything else stays a name), and the other fields
of the verdict (a ``hostname``/``node`` string is shown where present; nothing else is relied on).

CRITICAL and UNKNOWN are problems (the tool's own exit 1), WARNING and INFO notes, PASS nothing; an
overall CRITICAL or UNKNOWN with no component listed is one problem on the node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputopo.errors import InputError
from gputopo.findings import NOTE, PROBLEM, Finding
from gputopo.health.rules import REPORTED_RULES

TOOL = "health-validation"
SEVERITIES = ("PASS", "INFO", "WARNING", "CRITICAL", "UNKNOWN")
RULE = "health_validation"
_RULE = REPORTED_RULES[RULE]
MAX_VERDICT_BYTES = 4 * 1024 * 1024
_HINT = "give the JSON NodeVerdict that NVIDIA Health Validation wrote to stdout"

# Its check domains (reference/checks/overview) -> gputopo's categories.
_CATEGORIES = {
    "gpu": "compute",
    "nvlink": "nvlink",
    "infiniband": "network",
    "node": "config",
    "xid": "xid",
    "cpu": "config",
}
_GPU = re.compile(r"^gpu[\s_\-:]*(\d+)$", re.IGNORECASE)


@dataclass(frozen=True)
class HealthValidationResult:
    """A NodeVerdict, judged: ``status`` passed (PASS, INFO, WARNING) or failed (CRITICAL, UNKNOWN)."""

    status: str
    overall_severity: str
    findings: tuple[Finding, ...] = ()
    source: str = TOOL
    node: str | None = None
    components: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    @property
    def reason(self) -> str | None:
        if self.status == "passed":
            return None
        return f"Health Validation's verdict is {self.overall_severity}"

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": TOOL,
            "source": self.source,
            "status": self.status,
            "overall_severity": self.overall_severity,
            "node": self.node,
            "findings": [f.to_json() for f in self.findings],
        }


def read_health_validation(path: Path) -> HealthValidationResult:
    """``--health-validation FILE``: a saved NodeVerdict, judged; a file that is not one is an
    ``InputError`` (exit 2) in one line."""
    from gputopo.inputs import parse_json, read_capped

    label = f"--health-validation {path}"
    data = read_capped(path, label, MAX_VERDICT_BYTES, _HINT)
    text = data.decode("utf-8-sig", "replace")
    doc = parse_json(text, label, _HINT)
    return judge_verdict(doc, str(path), label)


def judge_verdict(doc: Any, source: str, label: str) -> HealthValidationResult:
    if not isinstance(doc, dict) or not isinstance(doc.get("overall_severity"), str):
        raise InputError(f"{label}: not a Health Validation NodeVerdict (no overall_severity)", _HINT)
    overall = doc["overall_severity"].strip().upper()
    if overall not in SEVERITIES:
        raise InputError(
            f"{label}: overall_severity {doc['overall_severity']!r} is none of {', '.join(SEVERITIES)}", _HINT
        )
    node = next((doc[k] for k in ("hostname", "node", "node_name") if isinstance(doc.get(k), str)), None)
    components = [c for c in _list(doc.get("affected_components")) if isinstance(c, dict)]
    findings: list[Finding] = []
    for comp in components:
        findings.extend(_component_findings(comp))
    if overall in ("CRITICAL", "UNKNOWN") and not any(f.severity == PROBLEM for f in findings):
        unknown = " (its health could not be assessed)" if overall == "UNKNOWN" else ""
        what = f"{TOOL}: the node's verdict is {overall}{unknown}"
        findings.append(_RULE.finding("node", what, _remedy(overall)))
    status = "failed" if overall in ("CRITICAL", "UNKNOWN") else "passed"
    order = sorted(findings, key=lambda f: (f.severity != PROBLEM, f.gpu is None, f.gpu or 0))
    return HealthValidationResult(status, overall, tuple(order), source, node, tuple(components))


def summary_finding(result: HealthValidationResult) -> Finding:
    """One note that says what the verdict was as a whole, so a reader sees the file was read."""
    node = f" for {result.node}" if result.node else ""
    what = f"{TOOL} ({result.source}): the verdict{node} is {result.overall_severity} ({result.status})"
    remedy = "nothing to do" if result.status == "passed" else "see the problems it found"
    return _RULE.finding(result.source, what, remedy, severity=NOTE, action="none")


def _component_findings(comp: dict[str, Any]) -> list[Finding]:
    severity = str(comp.get("max_severity") or "").strip().upper()
    if severity not in SEVERITIES or severity == "PASS":
        return []
    category = str(comp.get("category") or "").strip()
    checks = [str(c) for c in _list(comp.get("check_ids")) if isinstance(c, (str, int))]
    entities = [str(e) for e in _list(comp.get("entities")) if isinstance(e, (str, int))]
    ours = _CATEGORIES.get(category.lower(), "config")
    problem = severity in ("CRITICAL", "UNKNOWN")
    checked = f" ({', '.join(checks)})" if checks else ""
    what = f"{TOOL}: {category or 'a component'} is {severity}{checked}"
    places = entities or ["node"]
    out = []
    for entity in places:
        m = _GPU.match(entity.strip())
        gpu = int(m.group(1)) if m else None
        where = f"GPU{gpu}" if gpu is not None else entity
        out.append(
            _RULE.finding(
                where,
                what + (f" on {entity}" if entities else ""),
                _remedy(severity),
                gpu=gpu,
                severity=PROBLEM if problem else NOTE,
                action="drain" if problem else "monitor",
                category=ours,
            )
        )
    return out


def _remedy(severity: str) -> str:
    if severity == "CRITICAL":
        return (
            "take the node out of service and follow the check's recommended action (`health-validation` "
            "names it: reset the GPU, reboot, or open a service request)"
        )
    if severity == "UNKNOWN":
        return (
            "Health Validation could not judge the node: fix what kept it from reading it, and run it again"
        )
    return "the node may stay in service; keep an eye on it"


def _list(value: Any) -> list[Any]:
    """``value`` where it is a JSON array, else nothing (a field of the wrong type reads as absent)."""
    return value if isinstance(value, list) else []
