"""resample's section of results.json (`ResampleSummary`, one per precision), summarised from its records, and its
tables and figure: coupled differences (shared seeds), independent answer distributions against a null, and the
accuracy bias with its paired bootstrap CI.
"""

from __future__ import annotations

import zlib
from typing import Protocol

from pydantic import Field

from stagereplay.experiments.core.figures import ReportFigure, diagonal_panels, png
from stagereplay.experiments.core.format import NA, Table, k_of_n, points
from stagereplay.experiments.core.stats import (
    MONTE_CARLO_TABLES,
    TWO_SAMPLE_TEST,
    benjamini_hochberg,
    paired_bootstrap_ci,
    total_variation,
    two_sample_answer_test,
)
from stagereplay.experiments.protocol.payloads import ResamplePayload
from stagereplay.records.ledger import Record
from stagereplay.records.payloads import Draw
from stagereplay.records.summary import SummaryModel

FDR = 0.05
"""False-discovery rate of the Benjamini-Hochberg procedure over the items' answer-distribution tests."""


class Coupled(SummaryModel):
    """Draws seeded alike on both sides (stream A), over items x K draws."""

    draws: int = Field(description="live draws")
    replica_differ: int = Field(description="draws whose suffix differs from the live replica's (the negative "
                                            "control: must be 0)")
    fresh_differ: int = Field(description="draws whose suffix differs from the fresh state's")
    answer_differ: int = Field(description="draws whose answer differs from the fresh state's")
    label_differ: int = Field(description="draws whose correctness label differs from the fresh state's")


class MeanCI(SummaryModel):
    """mean(a - b) over items with its paired percentile bootstrap 95% CI."""

    estimate: float | None = Field(description="the mean difference (null: no item)")
    ci: list[float] | None = Field(description="[low, high] (null: no item)")


class AccuracyBias(MeanCI):
    """Per item, the accuracy of live draws minus that of fresh draws, and its mean."""

    per_item: list[float] = Field(description="per item, accuracy of live draws minus fresh draws")


class Independent(SummaryModel):
    """Answer distributions of live draws (seeds A) against fresh draws (B) and more live draws (C: the null)."""

    test: str = Field(description="the per-item two-sample test")
    monte_carlo_tables: int = Field(description="its seeded Monte Carlo tables where there are over two answers")
    fdr: float = Field(description="the Benjamini-Hochberg false-discovery rate")
    tv_fresh: list[float] = Field(description="per item, total-variation distance live vs fresh")
    tv_null: list[float] = Field(description="per item, total-variation distance live vs live")
    excess_tv: MeanCI = Field(description="mean TV fresh minus mean TV null")
    p_values: list[float] = Field(description="per item, the test's p live vs fresh")
    p_values_null: list[float] = Field(description="per item, the test's p live vs live")
    rejected_bh: int = Field(description="items Benjamini-Hochberg rejects, live vs fresh")
    rejected_bh_null: int = Field(description="items Benjamini-Hochberg rejects, live vs live")


class ResampleSummary(SummaryModel):
    """Resample at one checkpoint and precision: resample's section of results.json (a list of them)."""

    checkpoint: str = Field(description="the stage's checkpoint")
    precision: str = Field(description="the precision")
    construction: str = Field(description="the fresh construction drawn from")
    k: int = Field(description="draws per state and seed stream")
    temperature: int | float = Field(description="sampling temperature")
    top_p: int | float = Field(description="nucleus mass (1: off)")
    top_k: int | None = Field(description="top-k cut (0: off)")
    seed: int = Field(description="base seed of the seed streams")
    n_items: int = Field(description="items drawn from")
    n_not_reproduced: int = Field(description="items whose boundary state was not reproduced")
    live_source: str | None = Field(description="what stood in for live (null: no item)")
    items: list[str] = Field(description="the items drawn from")
    coupled: Coupled = Field(description="the coupled design")
    independent: Independent = Field(description="the independent design")
    accuracy: dict[str, float | None] = Field(description="per state (live, the construction), mean accuracy of "
                                                          "its draws")
    accuracy_bias: AccuracyBias = Field(description="live minus fresh accuracy")
    accuracy_bias_null: MeanCI = Field(description="live minus more live draws' accuracy (the null)")


class Sampling(Protocol):
    """The settings of a resample stage a summary repeats (`experiments.protocol.resample.ResampleConfig`)."""

    @property
    def construction(self) -> str: ...
    @property
    def k(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def seed(self) -> int: ...


def _draws(payload: ResamplePayload, state: str, stream: str) -> list[Draw]:
    return sorted((a for a in payload.arms if a.state == state and a.stream == stream), key=lambda a: a.draw)


def _mean_ci(a: list[float], b: list[float], seed: int = 0) -> MeanCI:
    """mean(a - b) with its paired percentile bootstrap 95% CI over items."""
    if not a:
        return MeanCI(estimate=None, ci=None)
    lo, hi = paired_bootstrap_ci(a, b, seed=seed)
    return MeanCI(estimate=sum(a) / len(a) - sum(b) / len(b), ci=[lo, hi])


def summarize_resample(records: list[Record], precisions: list[str], sampling: Sampling,
                       checkpoint: str) -> list[ResampleSummary]:
    """One entry per precision: coupled differences, independent answer distributions, the accuracy bias."""
    fresh = sampling.construction
    out = []
    for precision in precisions:
        mine = [(r.item_id, ResamplePayload.model_validate(r.payload)) for r in records if r.part == precision]
        ok = [(i, p) for i, p in mine if p.status == "ok"]
        coupled = {"draws": 0, "replica_differ": 0, "fresh_differ": 0, "answer_differ": 0, "label_differ": 0}
        tv_fresh, tv_null, p_fresh, p_null = [], [], [], []
        acc_live, acc_fresh, acc_null = [], [], []
        for item_id, p in ok:
            live, rep, fa = _draws(p, "live", "A"), _draws(p, "live#replica", "A"), _draws(p, fresh, "A")
            fb, lc = _draws(p, fresh, "B"), _draws(p, "live", "C")
            coupled["draws"] += len(live)
            coupled["replica_differ"] += sum(x.suffix_fp != y.suffix_fp for x, y in zip(live, rep, strict=True))
            coupled["fresh_differ"] += sum(x.suffix_fp != y.suffix_fp for x, y in zip(live, fa, strict=True))
            coupled["answer_differ"] += sum(x.answer != y.answer for x, y in zip(live, fa, strict=True))
            coupled["label_differ"] += sum(x.correct != y.correct for x, y in zip(live, fa, strict=True))
            answers = {name: [d.answer for d in draws] for name, draws in (("A", live), ("B", fb), ("C", lc))}
            test_seed = zlib.crc32(item_id.encode())  # per item, so a resumed or merged run gets the same p
            tv_fresh.append(total_variation(answers["A"], answers["B"]))
            tv_null.append(total_variation(answers["A"], answers["C"]))
            p_fresh.append(two_sample_answer_test(answers["A"], answers["B"], test_seed))
            p_null.append(two_sample_answer_test(answers["A"], answers["C"], test_seed))
            acc_live.append(sum(d.correct for d in live) / len(live))
            acc_fresh.append(sum(d.correct for d in fb) / len(fb))
            acc_null.append(sum(d.correct for d in lc) / len(lc))
        out.append(ResampleSummary(
            checkpoint=checkpoint, precision=precision, construction=fresh,
            k=sampling.k, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            seed=sampling.seed, n_items=len(ok), n_not_reproduced=len(mine) - len(ok),
            live_source=ok[0][1].live_source if ok else None,
            items=[i for i, _ in ok],
            coupled=Coupled(**coupled),
            independent=Independent(
                test=TWO_SAMPLE_TEST, monte_carlo_tables=MONTE_CARLO_TABLES, fdr=FDR,
                tv_fresh=tv_fresh, tv_null=tv_null, excess_tv=_mean_ci(tv_fresh, tv_null),
                p_values=p_fresh, p_values_null=p_null,
                rejected_bh=sum(benjamini_hochberg(p_fresh, FDR)),
                rejected_bh_null=sum(benjamini_hochberg(p_null, FDR)),
            ),
            accuracy={"live": _mean(acc_live), fresh: _mean(acc_fresh)},
            accuracy_bias=AccuracyBias(**dict(_mean_ci(acc_live, acc_fresh)),
                                       per_item=[a - b for a, b in zip(acc_live, acc_fresh, strict=True)]),
            accuracy_bias_null=_mean_ci(acc_live, acc_null),
        ))
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _resample_where(e: ResampleSummary) -> str:
    return f"{e.checkpoint} @ {e.precision}"


def _points_ci(d: MeanCI) -> str:
    """'+1.0 [-3.5, +5.5]' in points, or '-'."""
    if d.estimate is None or d.ci is None:
        return NA
    return f"{points(d.estimate)} [{points(d.ci[0])}, {points(d.ci[1])}]"


def _mean3(xs: list[float]) -> str:
    return f"{sum(xs) / len(xs):.3f}" if xs else NA


def _tv_ci(d: MeanCI) -> str:
    """A difference of TV distances with its CI, three decimals: '+0.012 [-0.004, +0.031]'."""
    if d.estimate is None or d.ci is None:
        return NA
    return f"{d.estimate + 0.0:+.3f} [{d.ci[0] + 0.0:+.3f}, {d.ci[1] + 0.0:+.3f}]"


def resample_tables(entries: list[ResampleSummary]) -> list[Table]:
    """Coupled draws (shared seeds), then independent answer distributions and the accuracy bias."""
    first = entries[0]
    top_k = first.top_k or "off"
    setting = (f"K = {first.k} draws per state and seed stream, temperature {first.temperature}, "
               f"top-p {first.top_p}, top-k {top_k}, seed {first.seed}.")
    coupled = []
    independent = []
    for e in entries:
        c, ind = e.coupled, e.independent
        coupled.append([_resample_where(e), str(e.n_items), k_of_n(c.replica_differ, c.draws),
                        k_of_n(c.fresh_differ, c.draws), k_of_n(c.answer_differ, c.draws)])
        n = len(ind.p_values)
        independent.append([_resample_where(e), _mean3(ind.tv_fresh), _mean3(ind.tv_null),
                            _tv_ci(ind.excess_tv), f"{ind.rejected_bh}/{n} ({ind.rejected_bh_null}/{n})",
                            _points_ci(e.accuracy_bias)])
    fresh = first.construction
    return [
        Table(
            "table-resample-coupled",
            f"Resample, coupled: live vs {fresh}, draw j seeded alike on both sides",
            ("where", "items", "replica differs", "fresh differs", "answer differs"),
            tuple(tuple(r) for r in coupled),
            f"{setting} Counts are over items x K draws. 'replica differs': live vs a live replica, the "
            "negative control (must be 0). A differing draw is the cache's doing: the seed is shared.",
        ),
        Table(
            "table-resample-independent",
            f"Resample, independent: answer distributions, live vs {fresh}",
            ("where", "TV fresh", "TV null", "excess TV [95% CI]", "BH rejects (null)", "acc. bias pts [CI]"),
            tuple(tuple(r) for r in independent),
            f"Mean total-variation distance between the answer distributions of live draws (seeds A) and fresh "
            f"draws (seeds B), and of live against more live draws (seeds C: the null). Excess TV = mean TV "
            f"fresh - mean TV null, paired bootstrap over items. Per item, {first.independent.test} test "
            f"(exact with two answers, else {first.independent.monte_carlo_tables} seeded Monte Carlo "
            f"tables), Benjamini-Hochberg at FDR {first.independent.fdr}. Accuracy bias: per item, "
            "accuracy of live draws minus fresh draws (what resampling-importance methods compute), mean "
            "and paired bootstrap CI, in points.",
        ),
    ]


def resample_figures(entries: list[ResampleSummary]) -> list[ReportFigure]:
    """Per item, TV(live, fresh) against TV(live, live), one panel per precision: points above the diagonal move the
    distribution."""
    if not entries:
        return []
    panels = [(_resample_where(e), e.independent.tv_null, e.independent.tv_fresh, "TV live vs live (null)",
               f"TV live vs {e.construction}") for e in entries]
    return [ReportFigure(
        "fig-resample", "Resample: per-item answer distributions",
        "Per item, total-variation distance between the answer distributions of live draws and fresh draws (y) "
        "against that of live draws and more live draws (x: the null, sampling noise alone). Points on the diagonal: "
        "replay keeps the distribution as well as live does itself.",
        png(diagonal_panels(panels)), after=("table-resample-independent",))]
