"""Rich rendering for ``gputopo probe``: live progress per set and stage, result tables, the verdict panel."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from gputopo.probe.judge.environment import describe_transports
from gputopo.probe.plan.schedule import Job, Plan
from gputopo.probe.report.document import set_label, set_tables, set_transports

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
    "injected-mnnvl": "injected MNNVL failure (no IMEX channel)",
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
        # A set's checks come from several jobs (the pool runs dp/ddp, allreduce and speed as separate
        # steps): the set is done with the last check of its last job, once.
        self.last_job = {job.gpus: job for job in plan.jobs}
        self.mark: dict[Job, float] = {}  # when the job's previous check ended (or its first row came)
        self.announced: set[tuple[int, ...]] = set()
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
        """The plain form: a line when a set starts and when each of its checks finishes, with how long
        the check took by the rank's own clock (rows are read in batches, so the reading time is not it)."""
        import time

        check, stage = row.get("check", ""), row.get("stage", "")
        t = row.get("t")
        now = float(t) if isinstance(t, (int, float)) else time.time()
        self.mark.setdefault(job, now)
        if job.gpus not in self.announced:
            self.announced.add(job.gpus)
            words = "starting ranks" if check == "setup" and stage == "join" else "started"
            self.console.print(f"{self.labels[job]}: {words}", markup=False, highlight=False, soft_wrap=True)
        if check == "setup" and stage == "join":
            return
        if stage == "done" and check != "setup":
            elapsed = max(0.0, now - self.mark[job])
            self.mark[job] = now
            last = " (set done)" if job == self.last_job.get(job.gpus) and check == job.checks[-1] else ""
            text = f"{self.labels[job]}: {check} done{last} [{elapsed:.1f} s]"
        elif stage.startswith("injected-"):
            text = f"{self.labels[job]}: {check}: {_STAGE_WORDS.get(stage, stage)}"
        else:
            return
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)


def verdict_text(verdict: str) -> Text:
    """``PASS`` / ``FAIL`` / ``SKIPPED`` in its colour."""
    return Text(verdict.upper(), style=_VERDICT_STYLE.get(verdict, ""))


def verdict_panel(doc: dict[str, Any]) -> Panel:
    """Every set's checks with their verdicts, what failed and what to do, and where the report is.

    What the environment took out of the test (``P2P path not tested: NCCL_P2P_DISABLE=1``) is on the
    title line, beside the verdict, and the NCCL transports each set used follow its checks.
    """
    body = Text()
    shown: set[str] = set()
    for s in doc.get("sets") or []:
        body.append(f"set {set_label(s['gpus']):<10} ", style="bold")
        body.append_text(verdict_text(s.get("verdict", "")))
        body.append("\n")
        for chk in s.get("checks") or []:
            body.append(f"  {chk.get('name'):<10} ")
            body.append_text(verdict_text(chk.get("verdict", "")))
            if chk.get("kind"):
                body.append(f" ({chk['kind']})", style="bold red")
            body.append(f"  {chk.get('detail')}\n")
            remedy = chk.get("remedy")
            if remedy:
                # The same cause often fails several checks: say what to do once.
                text = "as above" if remedy in shown else remedy
                shown.add(remedy)
                body.append(f"    what to do: {text}\n", style="yellow")
            tail = (chk.get("metrics") or {}).get("stderr_tail") if chk.get("kind") == "crashed" else None
            if tail:
                body.append("    stderr tail:\n", style="dim")
                for line in tail.splitlines()[-8:]:
                    body.append(f"      {line}\n", style="dim")
        rows = set_transports(s)
        if rows is not None:
            body.append(f"  NCCL transports: {describe_transports(rows)}\n", style="dim")
    for caveat in doc.get("caveats") or []:
        body.append(f"not tested: {caveat}\n", style="bold yellow")
    for note in doc.get("notes") or []:
        body.append(f"note: {note}\n", style="dim")
    report = doc.get("report")
    if report:
        paths = [report[k] for k in ("json", "markdown", "html") if report.get(k)]
        body.append("report: " + "\n        ".join(paths), style="dim")
    verdict = str(doc.get("verdict", ""))
    title = Text.assemble("gputopo probe: ", verdict_text(verdict))
    caveats = doc.get("caveats") or []
    if caveats:
        title.append(f" ({'; '.join(caveats)})", style="yellow")
    title.append(f" ({float(doc.get('wall_s') or 0):.1f} s)")
    body.rstrip()
    return Panel(body if body.plain else Text("nothing ran"), title=title, title_align="left", expand=False)


def render_probe(doc: dict[str, Any]) -> RenderableType:
    """The measurement tables of every set (nccl-tests style, ``#`` header lines), then the verdict panel."""
    parts: list[RenderableType] = [Text("\n".join(lines) + "\n") for _, lines in set_tables(doc)]
    parts.append(verdict_panel(doc))
    return Group(*parts)


def nodes_tables(doc: dict[str, Any]) -> list[RenderableType]:
    """A run across nodes: the inter-node tests, every node's verdict, notes and what to do."""
    from rich.table import Table

    from gputopo.probe.report.nodes import NODE_HEADER, TEST_HEADER, node_rows, test_rows

    if not doc.get("nodes"):
        return []
    parts: list[RenderableType] = []
    section = doc.get("internode") or {}
    tests = test_rows(section)
    if tests:
        table = Table(*TEST_HEADER, title="Between nodes", title_justify="left")
        for row in tests:
            table.add_row(*row)
        parts.append(table)
    table = Table(*NODE_HEADER, title="Nodes", title_justify="left")
    for row in node_rows(doc):
        table.add_row(*row[:3], verdict_text(row[3]), row[4])
    parts.append(table)
    body = Text()
    for note in section.get("notes") or []:
        body.append(f"note: {note}\n", style="dim")
    for f in section.get("findings") or []:
        if f.get("remedy"):
            body.append(f"what to do ({f['kind']}): {f['remedy']}\n", style="yellow")
    parts.append(body)
    return parts


def render_nodes(doc: dict[str, Any]) -> RenderableType:
    """A probe across nodes: this node's own sets (when it had any), then ``nodes_tables``, the report
    and the verdict."""
    parts: list[RenderableType] = [render_probe(doc)] if doc.get("sets") else []
    parts += nodes_tables(doc)
    body = Text()
    report = doc.get("report")
    if report:
        paths = [report[k] for k in ("json", "markdown", "html") if report.get(k)]
        body.append("report: " + "\n        ".join(paths) + "\n", style="dim")
    body.append("verdict: ")
    body.append_text(verdict_text(str(doc.get("verdict", ""))))
    parts.append(body)
    return Group(*parts)


def render_text(doc: dict[str, Any]) -> RenderableType:
    """Whatever ``gputopo probe`` made, for the terminal: the plan (``--dry-run``), a run across nodes,
    or a run on this machine."""
    from gputopo.probe.plan.dryrun import SCHEMA as PLAN_SCHEMA
    from gputopo.probe.plan.dryrun import plan_text

    if doc.get("schema") == PLAN_SCHEMA:
        return plan_text(doc)
    return render_nodes(doc) if "nodes" in doc else render_probe(doc)


def render_markdown(doc: dict[str, Any]) -> str:
    """The Markdown report: the run's sets, then (across nodes) the nodes and the tests between them."""
    from gputopo.probe.report.document import to_markdown
    from gputopo.probe.report.nodes import nodes_markdown

    text = to_markdown(doc)
    if "nodes" not in doc:
        return text
    return text.rstrip("\n") + "\n" + "\n".join(nodes_markdown(doc)) + "\n"
