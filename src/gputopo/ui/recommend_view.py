"""Rich rendering of a Recommendation: the ranked table, what was left out and assumed, the export line."""

from __future__ import annotations

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from gputopo.recommend import Candidate, Recommendation

NONE = "-"


def render_recommendation(rec: Recommendation) -> RenderableType:
    """Everything ``gputopo recommend`` prints above the export line(s) (``export_lines``)."""
    best = rec.best
    parts: list[RenderableType] = [
        Text(f"Best {rec.n}-GPU set on {rec.source}: {_gpus(best.gpus)}", style="bold"),
        Text(_summary(best)),
        Text(""),
        _Fitted(rec.candidates, f"Ranked {rec.n}-GPU sets (estimated ring all-reduce busbw)"),
    ]
    if rec.sets is not None:
        parts.append(_Fitted(rec.sets, f"{len(rec.sets)} disjoint {rec.n}-GPU sets", packed=True))
    context = context_lines(rec)
    if context:
        parts.append(Text("\n".join(context)))
    return Group(*parts)


def _gpus(gpus: tuple[int, ...]) -> str:
    return ("GPU " if len(gpus) == 1 else "GPUs ") + ",".join(str(g) for g in gpus)


def _summary(c: Candidate) -> str:
    if c.bottleneck is None:
        return (
            "one GPU: no inter-GPU traffic, so no bandwidth to estimate"
            if len(c.gpus) == 1
            else "no estimate: the links this set would need are not in the input"
        )
    at_least = "at least " if c.lower_bound else ""
    return (
        f"estimated all-reduce busbw {at_least}{c.bottleneck.gbps:.1f} GB/s, limited by {c.bottleneck.label}"
    )


def busbw_cell(c: Candidate) -> str:
    """``48.0``, ``>=120.0`` for a lower bound, ``-`` when there is nothing to estimate."""
    if c.est_busbw_gbps is None:
        return NONE
    return (">=" if c.lower_bound else "") + f"{c.est_busbw_gbps:.1f}"


def bottleneck_cell(c: Candidate) -> str:
    """``NV4 between GPU0 and GPU1``, marked when the figure was measured."""
    if c.bottleneck is None:
        return NONE
    return c.bottleneck.label + (" (measured)" if c.bottleneck.measured else "")


def numa_cell(c: Candidate) -> str:
    """NUMA nodes spanned (``0``, ``0+1``), or the CPU sets when the input shows no NUMA column."""
    if not c.numa_nodes:
        return "?"
    return "+".join(label.removeprefix("NUMA ") for label in c.numa_nodes)


# Below this width the table drops its NUMA column and its vertical lines (the reasons still say which
# NUMA nodes a set spans), so every column that is left keeps room to wrap instead of being cut.
NARROW = 72


def candidates_table(
    candidates: tuple[Candidate, ...], title: str, packed: bool = False, width: int | None = None
) -> Table:
    """One row per set: rank, GPUs, estimate, bottleneck, NUMA nodes, reasons (laid out for ``width``)."""
    narrow = width is not None and width < NARROW
    table = Table(
        title=title,
        title_justify="left",
        show_lines=True,
        expand=False,
        box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD,
    )
    table.add_column("set" if packed else "#", justify="right", no_wrap=True)
    # The answer: on a narrow terminal it folds onto more lines, never cut to `0...`.
    widest = max((len(",".join(str(g) for g in c.gpus)) for c in candidates), default=4)
    table.add_column("GPUs", overflow="fold", min_width=min(widest, 7 if narrow else 11))
    table.add_column("busbw GB/s", justify="right", no_wrap=not narrow)
    table.add_column("bottleneck", max_width=16, overflow="fold")
    if not narrow:
        table.add_column("NUMA", max_width=10)
    table.add_column("why", ratio=1, min_width=8 if narrow else 12, overflow="fold")
    for c in candidates:
        cells = [str(c.rank), ",".join(str(g) for g in c.gpus), busbw_cell(c), bottleneck_cell(c)]
        cells += [] if narrow else [numa_cell(c)]
        table.add_row(*cells, "\n".join(c.reasons))
    return table


class _Fitted:
    """``candidates_table`` laid out for the width it is printed at."""

    def __init__(self, candidates: tuple[Candidate, ...], title: str, packed: bool = False) -> None:
        self.args = (candidates, title, packed)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield candidates_table(*self.args, width=options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, candidates_table(*self.args, width=options.max_width))


def context_lines(rec: Recommendation) -> list[str]:
    """What was left out, kept apart, and assumed: the lines a reader needs to trust the ranking."""
    lines = [f"excluded: GPU{e.gpu}: {e.why}" for e in rec.excluded]
    lines += [f"kept apart: {' + '.join(f'GPU{g}' for g in f.gpus)}: {f.why}" for f in rec.kept_apart]
    lines += [str(note) for note in rec.notes]
    if rec.merged_note:
        lines.append(rec.merged_note)
    return lines


def export_lines(rec: Recommendation, id_format: str = "index") -> list[str]:
    """The shell line(s) to paste, one per set; print them unwrapped so a copy is exact."""
    if rec.sets is None:
        return [rec.best.export_line(id_format)]
    lines = []
    for c in rec.sets:
        estimate = f": {busbw_cell(c)} GB/s" if c.est_busbw_gbps is not None else ""
        lines += [f"# set {c.rank}{estimate}", c.export_line(id_format)]
    return lines
