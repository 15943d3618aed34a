"""The report's figures, drawn from `results.json` and returned as PNG bytes.

matplotlib is imported inside each function, and only through `Figure` + the Agg canvas (never pyplot):
drawing a report must not switch the backend of a notebook that imported us, nor be paid for by
`stagereplay --help`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stagereplay.experiments.format import slug

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# One colour per transplant outcome, shared by every figure and the legend.
OUTCOME_COLOURS = {"follows_donor": "#2b6cb0", "follows_recipient": "#dd6b20", "neither": "#a0aec0"}
OUTCOME_LABELS = {
    "follows_donor": "follows donor",
    "follows_recipient": "follows recipient",
    "neither": "neither",
}
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


def build_figures(results: dict[str, Any]) -> list[ReportFigure]:
    """Every figure the results support; a section that is null or empty draws nothing."""
    figures: list[ReportFigure] = []
    series = divergence_series(results)
    if series:
        figures.append(
            ReportFigure(
                "fig-divergence",
                "First divergence index",
                "Position in the suffix of the first token where the two constructions differ, one point per "
                "disagreeing item (grey bar: quartiles; black tick: median). Matched pairs per checkpoint; fixed-prefix 2x2 pairs "
                "(incremental vs oneshot) per precision.",
                _png(divergence_figure(series)),
                after=("table-matched", "table-2x2", "table-2x2-disagreements"),
            )
        )
    transplants = [t for t in results.get("transplant") or [] if t.get("directions")]
    if transplants:
        figures.append(
            ReportFigure(
                "fig-transplant",
                "Transplant outcomes",
                "Share of transplanted continuations that follow the cache donor, the recipient, or neither, "
                "per checkpoint and direction (donor->recipient); control rows move no layers.",
                _png(transplant_figure(transplants)),
                after=("table-transplant-",),
            )
        )
    for t in transplants:
        if t.get("sweep") and t["sweep"].get("rows"):
            ckpt = str(t["checkpoint"])
            figures.append(
                ReportFigure(
                    f"fig-sweep-{slug(ckpt)}",
                    f"Layer sweep ({ckpt})",
                    "Fraction of continuations that follow the donor when only the listed layers' K/V are "
                    "transplanted: single layers, bands growing from the bottom, bands growing from the top.",
                    _png(sweep_figure(t["sweep"], ckpt)),
                    after=(f"table-sweep-{slug(ckpt)}",),
                )
            )
    resample = results.get("resample") or []
    if resample:
        figures.append(
            ReportFigure(
                "fig-resample",
                "Resample: per-item answer distributions",
                "Per item, total-variation distance between the answer distributions of live draws and fresh "
                "draws (y) against that of live draws and more live draws (x: the null, sampling noise alone). "
                "Points on the diagonal: replay keeps the distribution as well as live does itself.",
                _png(resample_figure(resample)),
                after=("table-resample-independent",),
            )
        )
    return figures


def divergence_series(results: dict[str, Any]) -> list[tuple[str, list[int], int]]:
    """(label, first divergence indices, number of pairs compared) per matched checkpoint and 2x2 precision."""
    series: list[tuple[str, list[int], int]] = []
    for m in results.get("matched") or []:
        label = f"matched {m['checkpoint']}: live vs {m['construction']} @ {m['precision']}"
        series.append((label, list(m.get("first_divergence") or []), int(m["suffix_disagreements"]["n"])))
    grid = results.get("precision_2x2")
    if grid:
        a, b = [*(grid.get("constructions") or []), "incremental", "oneshot"][:2]
        for d in grid.get("disagreements") or []:
            label = f"2x2 {grid['checkpoint']}: {a} vs {b} @ {d['precision']}"
            series.append((label, list(d.get("first_divergence") or []), int(d["n"])))
    return series


def divergence_figure(series: list[tuple[str, list[int], int]]) -> Figure:
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
            ax.scatter(values, y + jitter, s=12, alpha=0.6, color=OUTCOME_COLOURS["follows_donor"], zorder=3)
            ax.text(top * 1.02 + 0.5, y, f"{len(values)}/{n}", va="center", fontsize=8)
        else:
            ax.text(0, y, f"no disagreements (0/{n})", va="center", fontsize=9, color="#4a5568")
    ax.set_yticks(range(len(series)), [label for label, _, _ in reversed(series)], fontsize=8)
    ax.set_ylim(-0.6, len(series) - 0.4)
    ax.set_xlim(-0.5, top * 1.12 + 2)
    ax.set_xlabel("first divergence index (suffix token position)")
    ax.grid(axis="x", alpha=0.3)
    return fig


def transplant_figure(transplants: list[dict[str, Any]]) -> Figure:
    """Stacked horizontal bars of outcome shares, one bar per checkpoint x direction (controls included)."""
    from matplotlib.figure import Figure

    bars: list[tuple[str, dict[str, Any]]] = []
    for t in transplants:
        for d in t["directions"]:
            bars.append((f"{t['checkpoint']}: {d['direction']} (n={d['n']})", d))
        for d in (t.get("control") or {}).get("directions") or []:
            bars.append((f"{t['checkpoint']}: {d['direction']} control (n={d['n']})", d))
    fig = Figure(figsize=(8.0, 1.4 + 0.45 * len(bars)), layout="constrained")
    ax = fig.add_subplot()
    for row, (_, d) in enumerate(bars):
        y = len(bars) - 1 - row
        left = 0.0
        for key, colour in OUTCOME_COLOURS.items():
            share = d[key] / d["n"] if d["n"] else 0.0
            ax.barh(y, share, left=left, color=colour, label=OUTCOME_LABELS[key] if row == 0 else None)
            if share >= 0.08:
                ax.text(left + share / 2, y, str(d[key]), ha="center", va="center", color="white", fontsize=8)
            left += share
    ax.set_yticks(range(len(bars)), [label for label, _ in reversed(bars)], fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of transplanted continuations")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 / (1 + 0.3 * len(bars))), ncol=3, frameon=False)
    return fig


def sweep_figure(sweep: dict[str, Any], checkpoint: str) -> Figure:
    """Heatmap: rows are layer bands (in the order run), columns directions, colour the donor-following share."""
    import numpy as np
    from matplotlib.figure import Figure

    bands: list[tuple[str, str]] = []
    directions: list[str] = []
    for r in sweep["rows"]:
        if (r["kind"], r["band"]) not in bands:
            bands.append((r["kind"], r["band"]))
        if r["direction"] not in directions:
            directions.append(r["direction"])
    share = np.full((len(bands), len(directions)), np.nan)  # (bands, directions)
    counts: dict[tuple[int, int], str] = {}
    for r in sweep["rows"]:
        i, j = bands.index((r["kind"], r["band"])), directions.index(r["direction"])
        share[i, j] = r["follows_donor"] / r["n"] if r["n"] else np.nan
        counts[i, j] = f"{r['follows_donor']}/{r['n']}"
    annotate = len(bands) <= 60  # a 48-layer model sweeps 144 bands: then colour only, thinner rows
    row_height, tick_size = (0.28, 7) if annotate else (0.12, 5)
    fig = Figure(figsize=(2.2 + 1.6 * len(directions), 1.2 + row_height * len(bands)), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(share, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    if annotate:
        for (i, j), text in counts.items():
            dark = not np.isnan(share[i, j]) and share[i, j] > 0.6
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="black" if dark else "white")
    ax.set_xticks(range(len(directions)), directions, fontsize=8)
    ax.set_yticks(range(len(bands)), [f"{kind} {band}" for kind, band in bands], fontsize=tick_size)
    ax.set_title(f"{checkpoint}: K/V layers transplanted ({sweep.get('n_layers', '?')} layers)", fontsize=9)
    fig.colorbar(image, ax=ax, label="share following donor", shrink=0.8)
    return fig


def resample_figure(entries: list[dict[str, Any]]) -> Figure:
    """Per item, TV(live, fresh) against TV(live, live): points above the diagonal move the distribution."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.4 * len(entries), 3.4), layout="constrained")
    for i, e in enumerate(entries):
        ax = fig.add_subplot(1, len(entries), i + 1)
        ind = e["independent"]
        ax.plot([0, 1], [0, 1], color="#a0aec0", linewidth=1, zorder=1)
        ax.scatter(ind["tv_null"], ind["tv_fresh"], s=14, alpha=0.7, color="#2b6cb0", zorder=2)
        ax.set_xlim(-0.03, 1.03)
        ax.set_ylim(-0.03, 1.03)
        ax.set_aspect("equal")
        ax.set_title(f"{e['checkpoint']} @ {e['precision']}", fontsize=9)
        ax.set_xlabel("TV live vs live (null)", fontsize=8)
        ax.set_ylabel(f"TV live vs {e['construction']}", fontsize=8)
        ax.grid(alpha=0.3)
    return fig


def _png(fig: Figure) -> bytes:
    """Render through the Agg canvas; no Software/date metadata so the bytes depend only on the data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return buf.getvalue()
