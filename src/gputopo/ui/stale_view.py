"""Rendering a ``kill-stale`` run: the holders table, the summary line, and the JSON document."""

from __future__ import annotations

import os

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from gputopo.procs.stale import HolderOutcome, StaleRun, format_duration

_VERDICT_STYLE = {"stale": "bold yellow", "protected": "green", "in use": "dim"}
_RESULT_STYLE = {
    "would stop": "bold yellow",
    "spared": "dim",
    "terminated": "green",
    "killed": "yellow",
    "already gone": "green",
    "access denied": "bold red",
    "failed": "bold red",
}


def verdict(h: HolderOutcome) -> str:
    """``protected``, ``stale`` or ``in use``: the one word shown for a holder."""
    if h.assessment.protected:
        return "protected"
    return "stale" if h.assessment.stale else "in use"


def shown_action(h: HolderOutcome) -> str:
    """What the ACTION column says: ``would stop`` in a dry run, else the stop result or ``spared``."""
    if h.result is not None:
        return h.result.value
    return "would stop" if h.action == "listed" else h.action


def holds(h: HolderOutcome) -> str:
    """Its GPUs (``*`` when they come from the device files held, not NVML's lists), else the files."""
    holder = h.assessment.holder
    if holder.gpus:
        mark = "" if holder.gpu_basis == "nvml" else "*"
        return "GPU " + ",".join(str(g) for g in holder.gpus) + mark
    files = holder.gpu_devices or holder.devices
    return " ".join(os.path.basename(d) for d in files)


def kind(h: HolderOutcome) -> str:
    """The holder's kind in its job: rank, spawn worker, fork worker, detached or process."""
    job = h.assessment.job
    return job.kind if job is not None else "?"


def parent(h: HolderOutcome) -> str:
    """Its launcher or parent, as ``pid (name)``."""
    job = h.assessment.job
    return job.parent if job is not None else str(h.assessment.holder.info.ppid or "?")


def _mib(value: int | None) -> str:
    return "?" if value is None else f"{value} MiB"


def why(h: HolderOutcome) -> list[str]:
    """The reasons shown for a holder: stale reasons, why it is spared, then what happened to it."""
    a = h.assessment
    lines = [f"{a.job.kind}: {a.job.marks}"] if a.job is not None and a.job.marks else []
    lines += list(a.reasons)
    lines += [f"protected: {r}" for r in a.protected_reasons]
    lines += [r for r in a.spared_reasons if r not in a.protected_reasons]
    if a.job is not None and a.job.why and not a.stale and not any(a.job.why in r for r in lines):
        lines.append(a.job.why)
    lines += [f"note: {n}" for n in a.notes]
    if h.detail:
        lines.append(h.detail)
    return lines


_COLUMNS = ("PID", "USER", "AGE", "KIND", "PARENT", "HOLDS", "GPU MEM", "VERDICT", "ACTION", "COMMAND")
# Below this width USER and AGE are left out (the JSON document has them), so that the pid, the verdict
# and the action are never cut: rich shrinks every column alike once the minimum widths do not fit.
_NARROW = 100


def holders_table(run: StaleRun, width: int | None = None) -> Table:
    """One row per holder: pid, user, age, kind, launcher or parent, what it holds, GPU memory, verdict,
    action, command (USER and AGE only from ``_NARROW`` columns on, when ``width`` is given).

    The command comes last and is cut to the width left (the JSON document has it whole); the reasons
    follow in ``reasons_list``, so that a narrow terminal still shows them in full.
    """
    shown = [c for c in _COLUMNS if width is None or width >= _NARROW or c not in ("USER", "AGE")]
    # expand + ratio: the command takes the width the other columns leave, and no more.
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold", expand=True)
    pid_width = max([3, *(len(str(h.assessment.holder.pid)) for h in run.holders)])
    fixed = {"PID": pid_width, "VERDICT": 9, "ACTION": 10, "GPU MEM": 7}
    widest = {"USER": 10, "AGE": 6, "KIND": 12, "PARENT": 18, "HOLDS": 14}
    for name in shown:
        table.add_column(
            name,
            no_wrap=True,
            overflow="ellipsis",
            ratio=1 if name == "COMMAND" else None,
            min_width=fixed.get(name),
            max_width=widest.get(name),
        )
    for h in run.holders:
        info = h.assessment.holder.info
        word = verdict(h)
        action = shown_action(h)
        cells = {
            "PID": str(info.pid),
            "USER": info.user or (f"uid {info.uid}" if info.uid is not None else "?"),
            "AGE": format_duration(h.assessment.holder.age_s),
            "KIND": kind(h),
            "PARENT": parent(h),
            "HOLDS": holds(h),
            "GPU MEM": _mib(h.assessment.holder.gpu_memory_mib),
            "VERDICT": Text(word, style=_VERDICT_STYLE[word]),
            "ACTION": Text(action, style=_RESULT_STYLE.get(action, "")),
            "COMMAND": info.command or "?",
        }
        table.add_row(*(cells[c] for c in shown))
    return table


class _HoldersTable:
    """The holders table laid out for the width it is printed at."""

    def __init__(self, run: StaleRun) -> None:
        self.run = run

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield holders_table(self.run, options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        """Its natural width: the table not stretched (output that is not a terminal is laid out at
        this width, so its lines are not padded to the bound)."""
        table = holders_table(self.run, options.max_width)
        table.expand = False
        return Measurement.get(console, options, table)


def reasons_list(run: StaleRun) -> Table:
    """Per holder, why it is stale, protected or spared, and what happened to it."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    for h in run.holders:
        lines = why(h)
        if lines:
            grid.add_row(str(h.assessment.holder.pid), "\n".join(lines))
    return grid


def summary(run: StaleRun) -> Text:
    """The closing sentence: what ``--yes`` would do, or what was done."""
    targeted = run.targeted
    if not run.holders:
        return Text(f"No process holds {_files_phrase(run)}.")
    if not targeted:
        return Text(f"Nothing to stop: {_count(len(run.holders), 'holder')}, none targeted.")
    if run.dry_run:
        return Text(
            f"Dry run: --yes would stop {_count(len(targeted), 'process', 'processes')} "
            f"(SIGTERM, up to {run.grace_s:g} s grace, then SIGKILL). Nothing was signalled.",
            style="bold",
        )
    counts: dict[str, int] = {}
    for h in targeted:
        key = h.result.value if h.result is not None else h.action
        counts[key] = counts.get(key, 0) + 1
    parts = ", ".join(f"{n} {k}" for k, n in counts.items())
    stopped = len(targeted) - len(run.not_stopped)
    text = Text(f"Stopped {stopped} of {len(targeted)}: {parts}.", style="bold")
    freed = run.memory_freed_mib
    if freed is not None:
        text.append(f" GPU memory freed: {freed} MiB.")
    return text


def render_run(run: StaleRun) -> RenderableType:
    """Everything ``kill-stale`` prints on stdout for ``run``."""
    if not run.device_files:
        return Text(f"No file matches {run.device_glob}: no process holds a GPU device.")
    header = Text(f"GPU holders of {_files_phrase(run)} (from {run.source})", style="bold")
    if not run.holders:
        return Group(header, summary(run))
    parts: list[RenderableType] = [header, _HoldersTable(run)]
    if any(h.assessment.holder.gpus and h.assessment.holder.gpu_basis != "nvml" for h in run.holders):
        parts.append(Text("* GPUs from the device files held, not from NVML's process lists", style="dim"))
    return Group(*parts, Text("Why:", style="bold"), reasons_list(run), summary(run))


def _files_phrase(run: StaleRun) -> str:
    n = len(run.device_files)
    return f"{_count(n, 'device file')}" if n != 1 else run.device_files[0]


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"
