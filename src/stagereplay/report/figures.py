"""The report's figures, drawn from `results.json` and returned as PNG bytes: each registered experiment's own
(`Experiment.figures`) and the figures several of them draw series on (`Experiment.series`), in the registry's
order. How a figure is drawn (`ReportFigure`, `png`, the charts) is `experiments.core.figures`.
"""

from __future__ import annotations

from typing import Any

from stagereplay.experiments.core.figures import ReportFigure, SharedFigure
from stagereplay.experiments.core.registry import all_experiments
from stagereplay.report.results import Results

__all__ = ["ReportFigure", "build_figures"]


def build_figures(results: Results) -> list[ReportFigure]:
    """Every figure the results support; a section that is null or empty draws nothing. A shared figure stands where
    the first experiment with a series for it puts its figures, drawn from every experiment's series."""
    slots: list[ReportFigure | SharedFigure] = []
    series: dict[SharedFigure, list[Any]] = {}
    for e in all_experiments():
        section = results.of(e)
        for figure, own in e.series(section).items():
            if own and figure not in series:
                series[figure] = []
                slots.append(figure)
            series[figure] += own
        slots += e.figures(section)
    return [s.made(series[s]) if isinstance(s, SharedFigure) else s for s in slots]
