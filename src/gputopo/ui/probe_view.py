"""Rich rendering for ``gputopo probe``: live progress per set and stage, result tables, the verdict panel."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from gputopo.probe.document import check_table, set_label
from gputopo.probe.plan import Job, Plan
from gputopo.probe.runner import ProbeRun

_VERDICT_STYLE = {"pass": "bold green", "fail": "bold red", "skipped": "yellow"}

# What a rank's progress rows mean, in words for the bar.
_STAGE_WORDS = {
    "join": "starting ranks",
    "start": "starting",
    "done": "done",
    "step": "step",
    "size": "size",
    "pair": "pair",
    "injected-hang": "injected hang",
    "injected-crash": "injected crash",
}


class ProbeProgress:
    """One bar per launch (a set, or a pair's round in ``--each-pair``), showing its current stage.

    Rank 0's rows drive the bar (it runs every check); the other ranks' rows only fill in before rank 0
    has said anything. Draws on ``console`` (stderr), so stdout keeps only the results.
    """

    def __init__(self, console: Console, plan: Plan) -> None:
        # Not a terminal (a log, CI): no bar can be drawn, so one plain line per finished stage instead.
        self.plain = not console.is_terminal
        self.console = console
        self.started: dict[Job, float] = {}
        self.progress = Progress(
            TextColumn("{task.fields[label]:<12}"),
            TextColumn("{task.description:<28}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.tasks: dict[Job, TaskID] = {}
        self.labels: dict[Job, str] = {}
        for job in plan.jobs:
            label = f"set {set_label(job.gpus)}"
            self.labels[job] = label
            self.tasks[job] = self.progress.add_task("waiting", total=None, label=label, start=False)

    def __enter__(self) -> ProbeProgress:
        if not self.plain:
            self.progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.plain:
            self.progress.stop()

    def update(self, job: Job, row: dict[str, Any]) -> None:
        """Show a rank's progress row on its launch's bar."""
        task = self.tasks.get(job)
        if task is None or (row.get("rank") != 0 and row.get("stage") not in ("join",)):
            return
        if self.plain:
            self._line(job, row)
            return
        self.progress.start_task(task)
        check, stage = row.get("check", ""), row.get("stage", "")
        words = _STAGE_WORDS.get(stage, stage)
        description = words if check == "setup" else f"{check}: {words}"
        total = row.get("total") or None
        self.progress.update(task, description=description, total=total, completed=row.get("done", 0))
        if check == job.checks[-1] and stage == "done":
            self.progress.update(task, description="done", total=1, completed=1)

    def _line(self, job: Job, row: dict[str, Any]) -> None:
        """The plain form: a line when a set's ranks start and when each of its checks finishes."""
        import time

        check, stage = row.get("check", ""), row.get("stage", "")
        now = time.monotonic()
        if check == "setup" and stage == "join":
            if job in self.started:
                return
            self.started[job] = now
            text = f"{self.labels[job]}: starting ranks"
        elif stage == "done" and check != "setup":
            elapsed = now - self.started.get(job, now)
            last = " (set done)" if check == job.checks[-1] else ""
            text = f"{self.labels[job]}: {check} done{last} [{elapsed:.1f} s]"
        elif stage.startswith("injected-"):
            text = f"{self.labels[job]}: {check}: {_STAGE_WORDS.get(stage, stage)}"
        else:
            return
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)


def verdict_text(verdict: str) -> Text:
    """``PASS`` / ``FAIL`` / ``SKIPPED`` in its colour."""
    return Text(verdict.upper(), style=_VERDICT_STYLE.get(verdict, ""))


def verdict_panel(run: ProbeRun, report: dict[str, str] | None) -> Panel:
    """Every set's checks with their verdicts, what failed and what to do, and where the report is."""
    body = Text()
    shown: set[str] = set()
    for s in run.sets:
        body.append(f"set {set_label(s.gpus):<10} ", style="bold")
        body.append_text(verdict_text(s.verdict))
        body.append("\n")
        for chk in s.checks:
            body.append(f"  {chk.name:<10} ")
            body.append_text(verdict_text(chk.verdict))
            if chk.kind:
                body.append(f" ({chk.kind})", style="bold red")
            body.append(f"  {chk.detail}\n")
            if chk.remedy:
                # The same cause often fails several checks: say what to do once.
                remedy = "as above" if chk.remedy in shown else chk.remedy
                shown.add(chk.remedy)
                body.append(f"    what to do: {remedy}\n", style="yellow")
            tail = chk.metrics.get("stderr_tail") if chk.kind == "crashed" else None
            if tail:
                body.append("    stderr tail:\n", style="dim")
                for line in tail.splitlines()[-8:]:
                    body.append(f"      {line}\n", style="dim")
    for note in run.notes:
        body.append(f"note: {note}\n", style="dim")
    if report:
        body.append(f"report: {report['json']}\n        {report['markdown']}", style="dim")
    title = Text.assemble("gputopo probe: ", verdict_text(run.verdict), f" ({run.wall_s:.1f} s)")
    body.rstrip()
    return Panel(body if body.plain else Text("nothing ran"), title=title, title_align="left", expand=False)


def render_probe(run: ProbeRun, report: dict[str, str] | None) -> RenderableType:
    """The measurement tables of every set (nccl-tests style, ``#`` header lines), then the verdict panel."""
    parts: list[RenderableType] = []
    for s in run.sets:
        for chk in s.checks:
            lines = check_table(run, s.gpus, chk)
            if lines:
                parts.append(Text("\n".join(lines) + "\n"))
    parts.append(verdict_panel(run, report))
    return Group(*parts)
