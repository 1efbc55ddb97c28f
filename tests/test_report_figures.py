"""The report's pictures say only what they draw, and their labels don't collide."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from gputopo.ui import figures  # noqa: E402


@pytest.fixture
def captured(monkeypatch):
    """The matplotlib figures the report functions build, kept open for inspection."""
    seen = []
    real = figures._png

    def keep(fig):
        fig.canvas.draw()
        seen.append((fig, fig.canvas.get_renderer()))  # closing the figure detaches its canvas
        return real(fig)

    monkeypatch.setattr(figures, "_png", keep)
    return seen


def test_busbw_chart_promises_dashed_model_lines_only_when_it_draws_them(captured):
    points = [(1 << 16, 0.1), (1 << 20, 0.9)]
    figures.busbw_curves([("GPUs 0,1", points, None), ("GPUs 2,3", points, None)])
    figures.busbw_curves([("GPUs 0,1", points, 48.0)])
    without, with_model = (fig.axes[0] for fig, _ in captured)
    assert "dashed" not in without.get_title()
    assert not [line for line in without.get_lines() if line.get_linestyle() == "--"]
    assert "dashed: model estimate" in with_model.get_title()
    labels = [t.get_text() for t in with_model.get_legend().get_texts()]
    assert labels == ["GPUs 0,1", "GPUs 0,1: model"]


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_heatmap_colour_bar_labels_clear_the_other_panel(captured):
    # The simulated sample's doctor report: 4 GPUs, CPU stand-ins measured on their own scale.
    gpus = [0, 1, 2, 3]
    measured = {(0, 1): 1.79, (0, 2): 1.22, (0, 3): 1.2, (1, 2): 1.3, (1, 3): 1.25, (2, 3): 1.8}
    estimated = {(0, 1): 48.0, (0, 2): 8.33, (0, 3): 8.33, (1, 2): 8.33, (1, 3): 8.33, (2, 3): 48.0}
    figures.pair_heatmaps(gpus, measured, estimated, set(), "measured busbw, CPU stand-ins", False)
    fig, renderer = captured[0]
    left_bar = fig.axes[2]  # the axes are: left map, right map, left bar, right bar
    right_map = fig.axes[1]
    # A colour bar labels its ticks on its right side (each tick's second label).
    bar_labels = [
        t.label2.get_window_extent(renderer)
        for t in left_bar.yaxis.get_major_ticks()
        if t.label2.get_visible() and t.label2.get_text()
    ]
    map_labels = [t.get_window_extent(renderer) for t in right_map.get_yticklabels() if t.get_text()]
    assert bar_labels and map_labels
    assert not any(_overlap(a, b) for a in bar_labels for b in map_labels)
    # Not just apart at these values: the bar's labels and the next panel's GPU labels have columns of
    # their own, so no other value can bring them together.
    assert max(a.x1 for a in bar_labels) < min(b.x0 for b in map_labels)
