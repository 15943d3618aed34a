"""The resample section's tables: coupled draws, then independent answer distributions and the accuracy bias.

`results["resample"]` has one entry per checkpoint and precision (`report.summaries.summarize_resample`).
"""

from __future__ import annotations

from typing import Any

from stagereplay.report.format import NA, Table, k_of_n, points


def _resample_where(e: dict[str, Any]) -> str:
    return f"{e['checkpoint']} @ {e['precision']}"


def _points_ci(d: dict[str, Any] | None) -> str:
    """'+1.0 [-3.5, +5.5]' in points, or '-'."""
    if not d or d.get("estimate") is None:
        return NA
    return f"{points(d['estimate'])} [{points(d['ci'][0])}, {points(d['ci'][1])}]"


def _mean3(xs: list[float]) -> str:
    return f"{sum(xs) / len(xs):.3f}" if xs else NA


def _tv_ci(d: dict[str, Any] | None) -> str:
    """A difference of TV distances with its CI, three decimals: '+0.012 [-0.004, +0.031]'."""
    if not d or d.get("estimate") is None:
        return NA
    return f"{d['estimate'] + 0.0:+.3f} [{d['ci'][0] + 0.0:+.3f}, {d['ci'][1] + 0.0:+.3f}]"


def resample_tables(entries: list[dict[str, Any]]) -> list[Table]:
    """Coupled draws (shared seeds), then independent answer distributions and the accuracy bias."""
    first = entries[0]
    top_k = first["top_k"] or "off"
    setting = (f"K = {first['k']} draws per state and seed stream, temperature {first['temperature']}, "
               f"top-p {first['top_p']}, top-k {top_k}, seed {first['seed']}.")
    coupled = []
    independent = []
    for e in entries:
        c, ind = e["coupled"], e["independent"]
        coupled.append([_resample_where(e), str(e["n_items"]), k_of_n(c["replica_differ"], c["draws"]),
                        k_of_n(c["fresh_differ"], c["draws"]), k_of_n(c["answer_differ"], c["draws"])])
        n = len(ind["p_values"])
        independent.append([_resample_where(e), _mean3(ind["tv_fresh"]), _mean3(ind["tv_null"]),
                            _tv_ci(ind["excess_tv"]), f"{ind['rejected_bh']}/{n} ({ind['rejected_bh_null']}/{n})",
                            _points_ci(e["accuracy_bias"])])
    fresh = first["construction"]
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
            f"fresh - mean TV null, paired bootstrap over items. Per item, {first['independent']['test']} test "
            f"(exact with two answers, else {first['independent']['monte_carlo_tables']} seeded Monte Carlo "
            f"tables), Benjamini-Hochberg at FDR {first['independent']['fdr']}. Accuracy bias: per item, "
            "accuracy of live draws minus fresh draws (what resampling-importance methods compute), mean "
            "and paired bootstrap CI, in points.",
        ),
    ]
