"""``gputopo check``'s outputs: one table of formats, one renderer function per format.

Adding a format is one function and one row of ``RENDERERS``: the function takes the ``CheckResult`` and
what was done to the Slurm node, and returns the text for stdout and the exit code. Every format starts
from the same verdict and one-line reason.

- ``text``: the reason first (what a scheduler shows), then each finding with its remedy, then what was
  not checked. Exit 0 healthy, 1 problems, 3 could not check.
- ``json``: the ``gputopo/check/v1`` document (with ``slurm`` when ``--drain``/``--resume-if-healthy``),
  built by ``services.check.CheckReport.document()`` and shown by ``cli/finish`` (not a row here).
- ``nagios``: ``GPUTOPO OK|WARNING|CRITICAL|UNKNOWN - reason``, Nagios's codes 0/1/2/3.
- ``npd``: node-problem-detector's custom plugin (pkg/custompluginmonitor/plugin/plugin.go): NPD reads
  all of stdout, trims it and cuts it at ``max_output_length`` bytes (default 80), and maps exit 0 to OK, 1
  to NonOK and anything else to Unknown. So: one line, cut to fit ``--max-output-length``, codes 0/1/3.
- ``prometheus``: the text exposition format for node_exporter's textfile collector: the gauge
  ``gputopo_check_status`` (the exit code) and one ``gputopo_check_finding`` sample per finding with
  dcgm-exporter's label names (``gpu``, ``UUID``, ``pci_bus_id``) plus ``category``, ``rule``,
  ``severity`` and ``action``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from gputopo.errors import UsageError
from gputopo.findings import NOTE, PROBLEM, Finding
from gputopo.health.check import NPD_DEFAULT_MAX_OUTPUT, PROBLEMS, UNKNOWN, CheckResult
from gputopo.health.rules import DCGM_NONE, Rule
from gputopo.health.subsystems import (
    ACCEPT_STATES,
    RECOMMENDED,
    SUBSYSTEMS,
    AcceptStatus,
    SubsystemResult,
    XidCount,
    gpus_read,
    sample_clique,
    subsystem_of,
)
from gputopo.health.subsystems import judge as judge_subsystems


class CheckFormat(str, enum.Enum):
    """``check --format``'s values (``--json`` is ``json``)."""

    TEXT = "text"
    JSON = "json"
    NAGIOS = "nagios"
    NPD = "npd"
    PROMETHEUS = "prometheus"

    @classmethod
    def parse(cls, name: str, json_out: bool = False) -> CheckFormat:
        """``--format NAME`` (``--json``: json); ``UsageError`` (exit 2) for a name not in the table."""
        try:
            return cls("json" if json_out else name)
        except ValueError:
            raise UsageError(
                f"--format {name}: not a format", f"one of {', '.join(f.value for f in cls)}"
            ) from None


@dataclass(frozen=True)
class Rendered:
    """What goes to stdout (ending in a newline) and the exit code."""

    text: str
    exit_code: int


@dataclass(frozen=True)
class RenderContext:
    """What a renderer may need besides the result: the Slurm action (``system.slurm_node.SlurmAction``
    or ``None``), NPD's output limit, and the check's wall-clock time (seconds since the epoch)."""

    slurm: Any = None
    max_output_length: int = NPD_DEFAULT_MAX_OUTPUT
    now: float = 0.0
    state_age_s: float | None = None
    # The acceptance (health.subsystems.accept_status; None: no state read) and the running Xid counts
    # (None: no state, so no counter is reported).
    acceptance: AcceptStatus | None = None
    xid_counts: tuple[XidCount, ...] | None = None
    # ``gputopo accept``'s stored verdict and whether it still holds (``accept.record.status``), or None.
    accept: dict[str, Any] | None = None

    @classmethod
    def of(cls, report: CheckOutcome, max_output_length: int = NPD_DEFAULT_MAX_OUTPUT) -> RenderContext:
        """The context of a check's report (``services.check.CheckReport``, named by its shape here: the
        views never import a service)."""
        return cls(
            slurm=report.slurm,
            max_output_length=max_output_length,
            now=report.now,
            acceptance=report.acceptance,
            xid_counts=report.xid_counts,
            accept=report.accept,
        )


class CheckOutcome(Protocol):
    """What a check's report carries for the views besides its result."""

    slurm: Any
    now: float
    acceptance: AcceptStatus | None
    xid_counts: tuple[XidCount, ...] | None
    accept: dict[str, Any] | None


def first_line(result: CheckResult) -> str:
    """The verdict and the reason: ``problems: ...``, ``healthy: 8 GPUs, no problems``, ``unknown: ...``."""
    if result.reason.startswith(result.verdict):
        return result.reason
    return f"{result.verdict}: {result.reason}"


def render_text(result: CheckResult, ctx: RenderContext) -> Rendered:
    lines = [first_line(result)]
    for f in result.findings:
        lines.append(f"{f.severity.upper():8} {f.where:<10} {f.category}/{f.action}: {f.what}")
        lines.append(f"{'':8} {'':<10} -> {f.remedy}")
    for n in result.not_checked:
        lines.append(f"not checked: {n.what} ({n.why})")
    return Rendered("\n".join(lines) + "\n", result.exit_code)


def render_nagios(result: CheckResult, ctx: RenderContext) -> Rendered:
    if result.verdict == PROBLEMS:
        return Rendered(f"GPUTOPO CRITICAL - {result.reason}\n", 2)
    if result.verdict == UNKNOWN:
        return Rendered(f"GPUTOPO UNKNOWN - {result.reason}\n", 3)
    if any(f.severity == NOTE for f in result.findings):
        return Rendered(f"GPUTOPO WARNING - {result.reason}\n", 1)
    return Rendered(f"GPUTOPO OK - {result.reason}\n", 0)


def fit_bytes(text: str, limit: int) -> str:
    """``text`` on one line in at most ``limit`` UTF-8 bytes (cut with ``...`` when longer): NPD cuts its
    plugin's output at ``max_output_length`` bytes, possibly inside a character."""
    flat = " ".join(text.split())
    if len(flat.encode()) <= limit:
        return flat
    cut = flat.encode()[: max(0, limit - 3)].decode("utf-8", errors="ignore").rstrip()
    return cut + "..."


def render_npd(result: CheckResult, ctx: RenderContext) -> Rendered:
    return Rendered(fit_bytes(first_line(result), ctx.max_output_length) + "\n", result.exit_code)


def npd_message(res: SubsystemResult, limit: int) -> str:
    """One subsystem's NPD message, ``[rule] what - RecommendedAction: ACTION`` (NVSentinel's form), in at
    most ``limit`` bytes: the words are cut, the rule and the action kept whole where they fit."""
    head = f"[{res.rule}] "
    tail = f" - RecommendedAction: {RECOMMENDED.get(res.action, res.action.upper())}"
    room = limit - len(head.encode()) - len(tail.encode())
    if room < 8:  # too short for words and the action: the words alone, cut
        return fit_bytes(head + res.what, limit)
    return head + fit_bytes(res.what, room) + tail


def render_npd_subsystem(res: SubsystemResult, limit: int) -> Rendered:
    """A ``check --subsystem NAME --format npd`` answer: the message and NPD's exit code."""
    return Rendered(npd_message(res, limit) + "\n", res.status)


def _label(value: object) -> str:
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, object]]) -> str:
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in pairs) + "}"


def _finding_labels(f: Finding, result: CheckResult) -> tuple[tuple[str, object], ...]:
    gpu = result.sample.gpu(f.gpu) if result.sample is not None and f.gpu is not None else None
    bus = gpu.pci_bus_id if gpu is not None else (f.where[4:] if f.where.startswith("PCI:") else "")
    return (
        ("gpu", "" if f.gpu is None else f.gpu),
        ("UUID", gpu.uuid if gpu is not None else ""),
        ("pci_bus_id", bus),
        ("category", f.category),
        ("rule", f.rule or ""),
        ("severity", f.severity),
        ("action", f.action),
    )


class _Families:
    """The exposition text, one family at a time (``# HELP``, ``# TYPE``, its samples)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[str, float]]) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        self.lines += [f"{name}{labels} {_number(value)}" for labels, value in samples]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3f}"


# Problems of the node (not one GPU's) that make every GPU unfit: all GPUs' rule (``node``), a broken
# fabric or driver. IMEX, the network and settings do not make a GPU unhealthy.
_GPU_WIDE = frozenset({"memory", "nvlink", "pcie", "driver"})


def _gpu_series(g: Any) -> tuple[tuple[str, object], ...]:
    return (("uuid", g.uuid or ""), ("index", g.index), ("pci_bus_id", g.pci_bus_id or ""))


def render_prometheus(result: CheckResult, ctx: RenderContext) -> Rendered:
    """The text exposition format (version 0.0.4), by Prometheus' naming conventions (``gputopo_``
    prefix, base units, ``_total`` counters, ``_info`` for a value that is a label):

    - ``gputopo_check_up``: 1 when at least one GPU was read; 0 otherwise, and then no GPU is reported
      healthy (dcgm-exporter PR #744: "/health says 200 with no GPUs");
    - ``gputopo_gpu_healthy{uuid,index,pci_bus_id}``: 1 healthy, 0 not (a problem of its own, a problem
      on every GPU, or not read);
    - ``gputopo_gpu_problems{uuid,index,pci_bus_id,rule}`` and ``gputopo_node_problems{rule}``: problems
      by rule;
    - ``gputopo_gpu_xid_events_total{uuid,index,pci_bus_id,xid}``: Xid lines counted once each across
      checks (only with ``--state``, which keeps the running count; without it the series is left out);
    - ``gputopo_subsystem_status{subsystem,condition}``: each subsystem's NPD exit code (0, 1, 3);
    - ``gputopo_node_accepted`` and ``gputopo_node_accept_state{state}``: the acceptance;
    - ``gputopo_nvlink_domain_info{gpu_clique}``: the NVLink domain as nvidia.com/gpu.clique names it;
    - the check's own ``gputopo_check_status`` (exit code), ``_gpus``, ``_duration_seconds``,
      ``_timestamp_seconds`` and ``gputopo_check_finding`` (one sample per finding, dcgm-exporter's label
      names). Findings with the same labels are one sample whose value counts them."""
    out = _Families()
    sample = result.sample
    read = gpus_read(sample)
    up = bool(read)
    out.family(
        "gputopo_check_status",
        "gauge",
        "gputopo check's exit code: 0 healthy, 1 problems, 3 could not check.",
        [("", result.exit_code)],
    )
    out.family(
        "gputopo_check_up",
        "gauge",
        "1 when the check read at least one GPU, 0 when it read none (then no GPU is reported healthy).",
        [("", 1 if up else 0)],
    )
    out.family(
        "gputopo_check_gpus", "gauge", "GPUs the check read.", [("", len(sample.gpus) if sample else 0)]
    )
    out.family(
        "gputopo_check_duration_seconds",
        "gauge",
        "How long the check took.",
        [("", round(result.elapsed_s, 3))],
    )
    if ctx.now:
        out.family(
            "gputopo_check_timestamp_seconds",
            "gauge",
            "When the check ran (seconds since the epoch).",
            [("", round(ctx.now, 3))],
        )
    problems = [f for f in result.findings if f.severity == PROBLEM]
    gpu_wide = any(f.gpu is None and f.where == "node" and subsystem_of(f) in _GPU_WIDE for f in problems)
    read_ids = {g.index for g in read}
    if up and sample is not None:
        out.family(
            "gputopo_gpu_healthy",
            "gauge",
            "1 when the GPU was read and has no problem, 0 otherwise.",
            [
                (
                    _labels(_gpu_series(g)),
                    int(g.index in read_ids and not gpu_wide and not any(f.gpu == g.index for f in problems)),
                )
                for g in sample.gpus
            ],
        )
    per_gpu: dict[tuple[tuple[str, object], ...], int] = {}
    per_node: dict[str, int] = {}
    for f in problems:
        g = sample.gpu(f.gpu) if sample is not None and f.gpu is not None else None
        if g is not None:
            key = (*_gpu_series(g), ("rule", f.rule or f.category))
            per_gpu[key] = per_gpu.get(key, 0) + 1
        else:
            per_node[f.rule or f.category] = per_node.get(f.rule or f.category, 0) + 1
    out.family(
        "gputopo_gpu_problems",
        "gauge",
        "Problems found on one GPU, by rule.",
        [(_labels(k), n) for k, n in per_gpu.items()],
    )
    out.family(
        "gputopo_node_problems",
        "gauge",
        "Problems found on the node, not on one GPU (all GPUs, the fabric, IMEX, the network), by rule.",
        [(_labels((("rule", r),)), n) for r, n in per_node.items()],
    )
    if ctx.xid_counts is not None:
        out.family(
            "gputopo_gpu_xid_events_total",
            "counter",
            "Xid lines in the kernel log, each counted once across checks, by GPU and code.",
            [
                (
                    _labels(
                        (
                            ("uuid", c.uuid or ""),
                            ("index", "" if c.index is None else c.index),
                            ("pci_bus_id", c.pci_bus_id),
                            ("xid", c.xid),
                        )
                    ),
                    c.count,
                )
                for c in ctx.xid_counts
            ],
        )
    subsystems = judge_subsystems(result, ctx.acceptance)
    out.family(
        "gputopo_subsystem_status",
        "gauge",
        "Each subsystem's node-problem-detector exit code: 0 OK, 1 problem, 3 could not check.",
        [
            (_labels((("subsystem", s.name), ("condition", s.condition))), subsystems[s.name].status)
            for s in SUBSYSTEMS
        ],
    )
    accept_state = ctx.acceptance.state if ctx.acceptance is not None else "unknown"
    out.family(
        "gputopo_node_accepted",
        "gauge",
        "1 while the node holds a gputopo accept verdict for these GPUs and this driver, 0 otherwise.",
        [("", int(accept_state == "accepted"))],
    )
    out.family(
        "gputopo_node_accept_state",
        "gauge",
        "The acceptance: 1 for the node's state (accepted, rejected, stale, none, unknown), 0 else.",
        [(_labels((("state", st),)), int(st == accept_state)) for st in ACCEPT_STATES],
    )
    clique = sample_clique(sample)
    out.family(
        "gputopo_nvlink_domain_info",
        "gauge",
        "The NVLink domain, as the node label nvidia.com/gpu.clique names it (<ClusterUUID>.<CliqueID>).",
        [(_labels((("gpu_clique", clique),)), 1)] if clique else [],
    )
    counts: dict[tuple[tuple[str, object], ...], int] = {}
    for f in result.findings:
        key = _finding_labels(f, result)
        counts[key] = counts.get(key, 0) + 1
    out.family(
        "gputopo_check_finding",
        "gauge",
        "A finding of gputopo check (the value counts those with these labels).",
        [(_labels(k), n) for k, n in counts.items()],
    )
    return Rendered("\n".join(out.lines) + "\n", result.exit_code)


Renderer = Callable[[CheckResult, RenderContext], Rendered]

# The format table: one row per format.
RENDERERS: dict[CheckFormat, Renderer] = {
    CheckFormat.TEXT: render_text,
    CheckFormat.NAGIOS: render_nagios,
    CheckFormat.NPD: render_npd,
    CheckFormat.PROMETHEUS: render_prometheus,
}


def render(fmt: CheckFormat, result: CheckResult, ctx: RenderContext) -> Rendered:
    """``fmt``'s text and exit code; ``json`` is not in the table: it is the service's report's
    ``document()``, shown as every command's document is (``cli/finish``)."""
    return RENDERERS[fmt](result, ctx)


def slurm_lines(slurm: Any) -> list[str]:
    """What was done to the Slurm node, or held back and why, as warning lines (stderr)."""
    if slurm is None:
        return []
    lines = []
    if slurm.held_back is not None:
        lines.append(f"slurm: {slurm.held_back}")
    if slurm.error is not None:
        verb = slurm.action if slurm.action in ("drain", "resume") else "act on"
        lines.append(f"slurm: could not {verb} this node: {slurm.error}")
    elif slurm.done:
        lines.append(f"slurm: {slurm.command}")
    return lines


# --- the rule table -----------------------------------------------------------------------------------------

RULE_COLUMNS = ("name", "category", "limit", "severity", "action", "dcgm", "remedy", "source")


def _limit(rule: Rule) -> str:
    if rule.limit is None:
        return "-"
    return f"{rule.limit:g} {rule.unit}".strip()


def rules_text(rules: Iterable[Rule]) -> str:
    """``check --list-rules``: one block per rule, from the table itself."""
    lines = []
    for r in rules:
        state = "" if r.enabled else " (disabled)"
        drains = "drains" if r.drains else "does not drain"
        head = f"{r.name}{state}  [{r.category}] {r.severity}/{r.action}, {drains}"
        lines.append(f"{head}; limit {_limit(r)}")
        lines.append(f"    {r.meaning}")
        lines.append(f"    remedy: {r.remedy or '-'}")
        if r.dcgm == DCGM_NONE and r.why:  # DCGM has no verdict for it, and the table says why
            lines.append(f"    DCGM: n/a ({r.why})")
        else:
            dcgm = f"{r.dcgm} ({r.dcgm_source})" if r.dcgm_source else r.dcgm
            lines.append(f"    DCGM: {dcgm}" + (f"; ours differs: {r.why}" if r.why else ""))
        lines.append(f"    source: {r.source}")
    return "\n".join(lines) + "\n"


def xids_text(xids: Iterable[dict[str, Any]], policy: Any = None) -> str:
    """The Xid catalogue under ``check --list-rules``: one line per code, NVIDIA's buckets and ours, after
    the admin's Xid policy in force (``rules.XidPolicy``) where there is one."""
    lines = [
        "",
        "Xid catalogue (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html): code, NVIDIA's "
        "immediate/investigatory buckets -> ours (rules xid_hardware, xid_application)",
    ]
    if policy is not None:
        lines.append(
            f"Xid policy in force ({policy.source}): application (a note) {_codes(policy.application)}; "
            f"node (a problem) {_codes(policy.node)}; allow_fatal {str(policy.allow_fatal).lower()}"
        )
    for x in xids:
        nvidia = f"{x['immediate'] or '-'}/{x['investigatory'] or '-'}"
        ours = f"{x['severity']}/{x['action']}" + (", decided per line" if x["per_line"] else "")
        if x.get("policy"):
            ours += f" (Xid policy: {x['policy']})"
        name = x["mnemonic"] or "-"
        lines.append(f"  Xid {x['xid']:>3} {name}: {x['description']}; NVIDIA {nvidia} -> {ours}")
        if x.get("dcgm") != "none" or x.get("why"):
            why = f"; ours differs: {x['why']}" if x.get("why") else ""
            lines.append(f"          DCGM {x['dcgm']} ({x['dcgm_source']}){why}")
        if x["catalogue_note"]:
            lines.append(f"          {x['catalogue_note']}")
    return "\n".join(lines) + "\n"


def _codes(codes: Iterable[int]) -> str:
    return ", ".join(map(str, sorted(codes))) or "none"


def rules_json(rules: Iterable[Rule], xids: Iterable[dict[str, Any]] = (), policy: Any = None) -> str:
    doc: dict[str, Any] = {"schema": "gputopo/rules/v1", "rules": [r.to_json() for r in rules]}
    doc["xids"] = list(xids)
    doc["xid_policy"] = policy.to_json() if policy is not None else None
    return json.dumps(doc, indent=2) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rules_markdown(rules: Iterable[Rule], xids: Iterable[tuple[int, Any]] = ()) -> str:
    """The rule reference of docs/health-rules.md, generated from the table (a test keeps them equal)."""
    lines = [
        "| rule | category | limit | ours | DCGM | remedy | source |",
        "|------|----------|-------|------|------|--------|--------|",
    ]
    for r in rules:
        ours = f"{r.severity}, {r.action}" + (" (drains)" if r.drains else "")
        dcgm = ("n/a" if r.dcgm == DCGM_NONE and r.why else r.dcgm) + (f": {r.why}" if r.why else "")
        lines.append(
            f"| `{r.name}` | {r.category} | {_cell(_limit(r))} | {ours} | {_cell(dcgm)} | "
            f"{_cell(r.remedy)} | {_cell(r.source)} |"
        )
    xid_rows = list(xids)
    if xid_rows:
        from gputopo.health.xid import DCGM_XID_LINES
        from gputopo.health.xid_catalog import catalog

        cat = catalog()
        lines += ["", "| Xid | what | NVIDIA | ours | DCGM |", "|-----|------|--------|------|------|"]
        for code, c in xid_rows:
            line = DCGM_XID_LINES.get(code)
            dcgm = (
                c.dcgm
                + (f" (BuildXidMappings line {line})" if line else "")
                + (f": {c.why}" if c.why else "")
            )
            e = cat.get(code)
            nvidia = f"{e.immediate or '-'} / {e.investigatory or '-'}" if e else "not in the catalogue"
            ours = f"{c.severity}, {c.action}"
            lines.append(f"| {code} | {_cell(c.description)} | {_cell(nvidia)} | {ours} | {_cell(dcgm)} |")
    return "\n".join(lines) + "\n"
