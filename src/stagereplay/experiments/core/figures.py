"""The report's figures as experiments draw them: `ReportFigure` (one figure, its PNG bytes), `png` (a figure's bytes),
the charts they are drawn with, and the figures several experiments draw series on (`SharedFigure`).

An experiment returns its own figures from its section of results.json (`Experiment.figures`) and its series on a
shared figure (`Experiment.series`); `report.figures` asks every registered experiment.

matplotlib is imported inside each function, and only through `Figure` + the Agg canvas (never pyplot): drawing a
report must not switch the backend of a notebook that imported us, nor be paid for by `stagereplay --help`.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure

BLUE, ORANGE, GREY = "#2b6cb0", "#dd6b20", "#a0aec0"
_JITTER_SEED = 0  # the strip plot's vertical jitter; fixed so a regenerated report draws the same image


@dataclass(frozen=True)
class ReportFigure:
    """One figure of the report: `id` becomes the HTML element id, `png` the inline image."""

    id: str
    title: str
    caption: str
    png: bytes
    after: tuple[str, ...] = ()
    """Table ids (an entry ending in `-` matches as a prefix): the page shows the figure after the last
    table they match, or at the end."""


@dataclass(frozen=True)
class SharedFigure:
    """A figure that several experiments draw series on, each from its own results (`Experiment.series`): drawn
    once, where the first experiment that has a series for it puts its figures."""

    id: str
    title: str
    caption: str
    draw: Callable[[list[Any]], Figure] = field(compare=False)
    """The figure from every experiment's series, in the registry's order."""
    after: tuple[str, ...] = ()

    def made(self, series: list[Any]) -> ReportFigure:
        return ReportFigure(self.id, self.title, self.caption, png(self.draw(series)), self.after)


Strip = tuple[str, list[int], int]
"""One row of the first-divergence figure: (label, the first divergence index of each disagreeing pair, the number
of pairs compared)."""


def divergence_figure(series: list[Strip]) -> Figure:
    """Horizontal strip + box plot, one row per series; an empty row says so instead of vanishing."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 1.0 + 0.6 * len(series)), layout="constrained")
    ax = fig.add_subplot()
    rng = np.random.default_rng(_JITTER_SEED)
    top = max((max(v) for _, v, _ in series if v), default=1)
    for row, (_, values, n) in enumerate(series):
        y = len(series) - 1 - row  # first series on top
        if values:
            q1, median, q3 = np.percentile(values, [25, 50, 75])
            ax.hlines(y, q1, q3, colors="#cbd5e0", linewidth=10, zorder=1)  # interquartile range
            ax.plot([median], [y], marker="|", markersize=16, color="#1a202c", zorder=2)
            jitter = rng.uniform(-0.18, 0.18, size=len(values))
            ax.scatter(values, y + jitter, s=12, alpha=0.6, color=BLUE, zorder=3)
            ax.text(top * 1.02 + 0.5, y, f"{len(values)}/{n}", va="center", fontsize=8)
        else:
            ax.text(0, y, f"no disagreements (0/{n})", va="center", fontsize=9, color="#4a5568")
    ax.set_yticks(range(len(series)), [label for label, _, _ in reversed(series)], fontsize=8)
    ax.set_ylim(-0.6, len(series) - 0.4)
    ax.set_xlim(-0.5, top * 1.12 + 2)
    ax.set_xlabel("first divergence index (suffix token position)")
    ax.grid(axis="x", alpha=0.3)
    return fig


DIVERGENCE = SharedFigure(
    "fig-divergence",
    "First divergence index",
    "Position in the suffix of the first token where the two constructions differ, one point per "
    "disagreeing item (grey bar: quartiles; black tick: median). Matched pairs per checkpoint; fixed-prefix 2x2 pairs "
    "(incremental vs oneshot) per precision.",
    divergence_figure,
    after=("table-matched", "table-2x2", "table-2x2-disagreements"),
)
"""Where each compared pair first diverged: matched's pairs per checkpoint, the 2x2's per precision."""


def share_bars(bars: Sequence[tuple[str, Mapping[str, int], int]], categories: Mapping[str, tuple[str, str]],
               xlabel: str) -> Figure:
    """Stacked horizontal bars of shares, one bar per (label, count per category, n), first on top; `categories`:
    key -> (colour, legend label), in stacking order. A share of 8% or more prints its count."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 1.4 + 0.45 * len(bars)), layout="constrained")
    ax = fig.add_subplot()
    for row, (_, counts, n) in enumerate(bars):
        y = len(bars) - 1 - row
        left = 0.0
        for key, (colour, legend) in categories.items():
            share = counts[key] / n if n else 0.0
            ax.barh(y, share, left=left, color=colour, label=legend if row == 0 else None)
            if share >= 0.08:
                ax.text(left + share / 2, y, str(counts[key]), ha="center", va="center", color="white", fontsize=8)
            left += share
    ax.set_yticks(range(len(bars)), [label for label, _, _ in reversed(bars)], fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel(xlabel)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 / (1 + 0.3 * len(bars))), ncol=3, frameon=False)
    return fig


def share_heatmap(share: np.ndarray, counts: Mapping[tuple[int, int], str], rows: Sequence[str],
                  columns: Sequence[str], title: str, colour_label: str) -> Figure:
    """A heatmap of shares in [0, 1] (`share`: (rows, columns), NaN where nothing was counted), each cell annotated
    with its count where there are at most 60 rows (more: colour only, thinner rows)."""
    import numpy as np
    from matplotlib.figure import Figure

    annotate = len(rows) <= 60  # a 48-layer model sweeps 144 bands
    row_height, tick_size = (0.28, 7) if annotate else (0.12, 5)
    fig = Figure(figsize=(2.2 + 1.6 * len(columns), 1.2 + row_height * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(share, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    if annotate:
        for (i, j), text in counts.items():
            dark = not np.isnan(share[i, j]) and share[i, j] > 0.6
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="black" if dark else "white")
    ax.set_xticks(range(len(columns)), columns, fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=tick_size)
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label=colour_label, shrink=0.8)
    return fig


def diagonal_panels(panels: Sequence[tuple[str, list[float], list[float], str, str]]) -> Figure:
    """One square panel per (title, x, y, x label, y label): points against the diagonal y = x on [0, 1]."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.4 * len(panels), 3.4), layout="constrained")
    for i, (title, xs, ys, xlabel, ylabel) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        ax.plot([0, 1], [0, 1], color=GREY, linewidth=1, zorder=1)
        ax.scatter(xs, ys, s=14, alpha=0.7, color=BLUE, zorder=2)
        ax.set_xlim(-0.03, 1.03)
        ax.set_ylim(-0.03, 1.03)
        ax.set_aspect("equal")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    return fig


def png(fig: Figure) -> bytes:
    """Render through the Agg canvas; no Software/date metadata so the bytes depend only on the data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return buf.getvalue()
