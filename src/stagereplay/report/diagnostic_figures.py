"""The diagnostics figures: margins at divergence against all steps, and cache differences by layer and band.

Drawn from `results.json` like every figure (`experiments.core.figures`: matplotlib through `Figure` and the Agg canvas
only). A run recorded before diagnostics existed draws none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stagereplay.experiments.core.diagnostics_summary import Diagnosed
from stagereplay.experiments.core.figures import ReportFigure, png
from stagereplay.report.results import Results

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_COLOURS = ("#2b6cb0", "#dd6b20", "#38a169", "#805ad5", "#d53f8c", "#718096")
_AFTER = ("table-diagnostics",)


def diagnostic_series(results: Results) -> list[tuple[str, Diagnosed]]:
    """(label, summary) per compared pair that carries diagnostics (`report.tables.diagnosed_pairs`)."""
    from stagereplay.report.tables import diagnosed_pairs

    return [(label, summary) for label, summary, _ in diagnosed_pairs(results)]


def diagnostic_figures(results: Results) -> list[ReportFigure]:
    series = diagnostic_series(results)
    figures = []
    margins = [(label, s) for label, s in series if s.margins and s.margins.steps]
    if margins:
        figures.append(ReportFigure(
            "fig-margins", "Margins at the first divergent token",
            "Cumulative share of steps whose top-1 minus top-2 fp32 logit is at most x: over all steps of the "
            "reference arm (line) and at the first divergent token of each disagreeing item (dots, one per item, "
            "on their own cumulative curve). LayerCast's observation is that flips happen where the margin is small: "
            "the dots sit left of the line.",
            png(margin_figure(margins)), after=_AFTER))
    caches = [(label, s) for label, s in series if s.cache_diff]
    if caches:
        figures.append(ReportFigure(
            "fig-cache-layers", "Cache difference by layer",
            "Median over items of the relative L2 difference ||a-b||/||a|| of the boundary caches, per layer, K and "
            "V: live vs fresh in the matched run, incremental vs oneshot per precision in the 2x2. A log scale; "
            "a bit-exact series has nothing to draw and says so in the legend.",
            png(cache_figure(caches, "layer")), after=_AFTER))
        figures.append(ReportFigure(
            "fig-cache-bands", "Cache difference by position band",
            "The same relative L2 difference per band of absolute positions, over all layers: the prompt, the "
            "quartiles of stage 1, and the last 16 positions before the boundary.",
            png(cache_figure(caches, "band")), after=_AFTER))
    return figures


def _ecdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def margin_figure(series: list[tuple[str, Diagnosed]]) -> Figure:
    from matplotlib.figure import Figure

    from stagereplay.experiments.core.diagnostics_summary import PERCENTILES

    fig = Figure(figsize=(8.0, 4.2 + 0.18 * len(series)), layout="constrained")
    ax = fig.add_subplot()
    for i, (label, s) in enumerate(series):
        colour = _COLOURS[i % len(_COLOURS)]
        assert s.margins is not None and s.margins.steps is not None  # only series with step margins are drawn
        steps, arm = s.margins.steps, s.margins.arm
        ax.plot(steps.percentiles, [p / 100 for p in PERCENTILES], color=colour,
                label=f"{label}: all steps (median {steps.median:.3g})")
        at = [x for x in (d.margin[arm] for d in s.divergences or []) if x is not None]
        if at:
            xs, ys = _ecdf(at)
            ax.plot(xs, ys, "o", color=colour, markersize=4, alpha=0.8,
                    label=f"{label}: first divergent token (n={len(at)})")
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlabel("top-1 minus top-2 logit (fp32)")
    ax.set_ylabel("cumulative share")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    fig.legend(fontsize=7, loc="outside lower center", ncol=2, frameon=False)
    return fig


def _cache_rows(summary: Diagnosed, axis: str) -> list[tuple[str, dict[str, float | None]]]:
    """(layer or band, its median relative L2 per tensor k, v) of a summary's cache differences along `axis`."""
    if axis == "layer":
        return [(str(r.layer), {"k": r.k_rel_l2, "v": r.v_rel_l2}) for r in summary.cache_diff or []]
    return [(r.band, {"k": r.k_rel_l2, "v": r.v_rel_l2}) for r in summary.cache_bands or []]


def cache_figure(series: list[tuple[str, Diagnosed]], axis: str) -> Figure:
    """Two panels (K, V): median relative L2 per layer or band, one line per series."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 3.6 + 0.15 * len(series)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    names: list[str] = []
    for _, summary in series:
        names += [name for name, _ in _cache_rows(summary, axis) if name not in names]
    for ax, tensor in zip(axes, ("k", "v"), strict=True):
        drawn = False
        for i, (label, summary) in enumerate(series):
            points = [(names.index(name), rel[tensor]) for name, rel in _cache_rows(summary, axis)]
            shown = [(x, y) for x, y in points if y]
            exact = all(y == 0 for _, y in points)
            ax.plot([x for x, _ in shown], [y for _, y in shown], "o-", color=_COLOURS[i % len(_COLOURS)],
                    markersize=3, label=label + (" (bit-exact)" if exact else ""))
            drawn |= bool(shown)
        if drawn:
            ax.set_yscale("log")
        ax.set_title(f"{tensor.upper()}", fontsize=9)
        step = max(1, len(names) // 16)  # a 48-layer model labels every third layer
        ax.set_xticks(range(0, len(names), step), names[::step], fontsize=7, rotation=45 if axis == "band" else 0)
        ax.set_xlabel(axis)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("median ||a-b|| / ||a||")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="outside lower center", ncol=2, frameon=False)
    return fig
