"""Mismatch's tables and figure, read from its typed section (`mismatch_summary.MismatchSummary`): the attribution,
verl's importance weights and off-policy metrics, its rejection statistics, the position bands and the transplant.
Every name a column shows is the metric's own (docs/reference/mismatch-metrics.md)."""

from __future__ import annotations

from typing import Any

import numpy as np

from stagereplay.experiments.core.figures import ReportFigure, png
from stagereplay.experiments.core.format import NA, Table, as_rows, k_of_n, slug
from stagereplay.experiments.mismatch.fields import MismatchMetrics
from stagereplay.experiments.mismatch.summary import MismatchSummary, PairSummary
from stagereplay.experiments.mismatch.verl import RS_OPTIONS, RS_THRESHOLDS


def num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return NA
    x = float(x)
    return "0" if x == 0 else f"{x:.{digits}g}"


def _ci(ci: tuple[float, float] | None) -> str:
    return "" if ci is None else f" [{num(ci[0])}, {num(ci[1])}]"


def _sum(*xs: float | None) -> float | None:
    return None if any(x is None for x in xs) else sum(x for x in xs if x is not None)


def left_out(m: MismatchMetrics) -> str:
    """The tokens left out as not finite: `0`, or `k (NaN a, inf b, both -inf c)`."""
    k = m.excluded_nan + m.excluded_infinite + m.both_neg_inf
    return "0" if k == 0 else f"{k} (NaN {m.excluded_nan}, inf {m.excluded_infinite}, both -inf {m.both_neg_inf})"


def _attribution(s: MismatchSummary) -> Table:
    where = f"{s.source} rollouts, {s.engine} engine, {s.mode} log-probabilities"
    rows = [[p.row, f"{p.b} / {p.a}", str(p.metrics.tokens), num(p.metrics.bitwise_equal, 4),
             num(p.metrics.abs_mean) + _ci(p.ci.abs_mean), num(p.metrics.abs_max), num(p.metrics.kl) + _ci(p.ci.kl),
             num(p.metrics.k3_kl) + _ci(p.ci.k3_kl), num(p.metrics.chi2_token), num(p.metrics.token_outside_2),
             num(p.metrics.token_outside_5), num(p.metrics.argmax_agree, 4), left_out(p.metrics)] for p in s.pairs]
    return Table(f"table-mismatch-{s.checkpoint}", f"Mismatch, {where}: where the gap comes from",
                 ("row", "pair (b / a)", "tokens", "bitwise equal", "mean |log-ratio| [95% CI]", "max |log-ratio|",
                  "kl [95% CI]", "k3_kl [95% CI]", "chi2_token", "token w outside [1/2,2]", "outside [1/5,5]",
                  "argmax agree", "non-finite, left out"), as_rows(rows),
                 "log-ratio lr = log pi_b - log pi_a per response token, on the same token IDs; kl = mean(-lr), k3_kl = "
                 "mean(exp(lr) - lr - 1) and chi2_token = mean(w^2) - 1 (w = exp(clamp(lr, +-20))) are verl's, pooled "
                 "over tokens. Intervals: 95% percentile bootstrap of the same pooled statistic, resampling whole "
                 "sequences (10,000 resamples, seed 0). construction + engine add up to total (in kl, token by token); "
                 "a precision row is an alternative to the total, not a part of it.")


def _weights(s: MismatchSummary) -> Table:
    rows = []
    for p in s.pairs:
        m = p.metrics
        if not m.tokens or m.bitwise_equal == 1.0:
            continue
        rows.append([p.row, "token", num(m.rollout_is_mean), num(m.rollout_is_min), num(m.rollout_is_max),
                     num(m.rollout_is_std), num(m.rollout_is_eff_sample_size),
                     num(_sum(m.rollout_is_ratio_fraction_high, m.rollout_is_ratio_fraction_low)),
                     num(m.token_outside_5), num(m.token_clamped)])
        rows.append([p.row, "sequence", num(m.sequence_is_mean), num(m.sequence_is_min), num(m.sequence_is_max),
                     num(m.sequence_is_std), num(m.sequence_is_eff_sample_size),
                     num(_sum(m.sequence_is_ratio_fraction_high, m.sequence_is_ratio_fraction_low)),
                     num(m.sequence_outside_5), num(m.sequence_clamped)])
        rows.append([p.row, "geometric", num(m.geo_mean), num(m.geo_min), num(m.geo_max), NA, NA,
                     num(m.geo_outside_2), num(m.geo_outside_5), NA])
    return Table(f"table-mismatch-weights-{s.checkpoint}", "Importance weights pi_b / pi_a",
                 ("row", "level", "mean", "min", "max", "std", "ESS (fraction)", "outside [1/2,2]", "outside [1/5,5]",
                  "at the clamp e^+-20"), as_rows(rows),
                 "token and sequence: verl's rollout_is_* with rollout_is=token and =sequence (TIS at 2: mean, min, "
                 "max, std and ESS of the weights truncated at 2, the sequence level's weighted by length; outside "
                 "[1/2,2] of the raw weights); geometric (ours): exp of each sequence's mean log-ratio. At the clamp: "
                 "the fraction of log-ratios (sequence sums) at or beyond 20, whose weight is the clamp's, not theirs. "
                 "Rows whose bits all match (every weight 1) are left out, here and in the two tables below.")


def _offpolicy(s: MismatchSummary) -> Table:
    rows = [[p.row, num(p.metrics.training_ppl, 6), num(p.metrics.rollout_ppl, 6), num(p.metrics.log_ppl_diff),
             num(p.metrics.log_ppl_abs_diff) + _ci(p.ci.log_ppl_abs_diff), num(p.metrics.ppl_ratio, 6),
             num(p.metrics.chi2_seq), num(p.metrics.chi2_centred), num(p.metrics.rollout_probs_diff_max),
             num(p.metrics.rollout_probs_diff_mean), num(p.metrics.rollout_actor_probs_pearson_corr, 6)]
            for p in s.pairs if p.metrics.tokens and p.metrics.bitwise_equal != 1.0]
    return Table(f"table-mismatch-offpolicy-{s.checkpoint}", "verl's off-policy diagnostics (b as the trainer, a as "
                 "the rollout)", ("row", "training_ppl", "rollout_ppl", "log_ppl_diff", "log_ppl_abs_diff [95% CI]",
                                  "ppl_ratio", "chi2_seq", "chi2_centred (ours)", "probs_diff_max", "probs_diff_mean",
                                  "probs pearson"), as_rows(rows),
                 "Perplexities and log-PPL differences per sequence, then averaged over sequences (verl's); the "
                 "interval resamples sequences. chi2_centred = mean((w - 1)^2) pooled (ours). probs_diff: "
                 "|p_b - p_a| of the probabilities (verl's training/rollout_probs_diff_*).")


def _rejection(s: MismatchSummary) -> Table:
    rows = []
    for p in s.pairs:
        if p.metrics.bitwise_equal == 1.0:
            continue
        r = p.metrics.rejection
        for option, threshold in zip(RS_OPTIONS, RS_THRESHOLDS, strict=True):
            if f"rollout_rs_{option}_mean" in r:
                rows.append([p.row, f"{option} {threshold}", num(r[f"rollout_rs_{option}_seq_mean"]),
                             num(r[f"rollout_rs_{option}_seq_min"]), num(r[f"rollout_rs_{option}_seq_max"]),
                             num(r[f"rollout_rs_{option}_masked_fraction"]),
                             num(r[f"rollout_rs_{option}_seq_masked_fraction"])])
    return Table(f"table-mismatch-rejection-{s.checkpoint}", "verl's rejection sampling, at its presets' thresholds",
                 ("row", "option threshold", "per-sequence statistic: mean", "min", "max", "tokens rejected",
                  "sequences rejected"), as_rows(rows),
                 "seq_sum_k1 and seq_mean_k1: the sequence's summed and mean -log-ratio against log of the ratio bounds "
                 "(decoupled_seq_is_rs, decoupled_geo_rs); seq_mean_k3: its mean k3 against 0.01 (decoupled_k3_rs).")


def _bands(total: PairSummary, checkpoint: str) -> Table:
    rows = [[b.band, str(b.tokens), num(b.bitwise_equal, 4), num(b.abs_mean), num(b.abs_max), num(b.k3_kl),
             num(b.token_outside_2)] for b in total.bands]
    return Table(f"table-mismatch-bands-{checkpoint}", "Total gap by response position",
                 ("positions", "tokens", "bitwise equal", "mean |log-ratio|", "max |log-ratio|", "k3_kl",
                  "token w outside [1/2,2]"), as_rows(rows))


def mismatch_tables(s: MismatchSummary) -> list[Table]:
    tables = [_attribution(s), _weights(s), _offpolicy(s), _rejection(s)]
    total = s.row("total")
    if total is not None and total.bands:
        tables.append(_bands(total, s.checkpoint))
    if s.transplant is not None:
        t = s.transplant
        trows = [[("control (no layer): " if control else "") + d.direction, k_of_n(d.follows_donor, d.n),
                  str(d.follows_recipient), str(d.neither)]
                 for control, ds in ((False, t.directions), (True, t.control)) for d in ds]
        tables.append(Table(f"table-mismatch-transplant-{s.checkpoint}",
                            "K/V transplant at mid-response: do the log-probabilities after it follow the cache donor?",
                            ("direction (donor->recipient)", "follows donor", "follows recipient", "neither"),
                            as_rows(trows), "A continuation follows a side when its log-probabilities are that side's "
                                            "own continuation's, bit for bit."))
    return tables


def ratio_figure(s: MismatchSummary) -> Any:
    """The total row's per-token ratio pi_trainer / pi_rollout on a log axis against the position in the response,
    with the 2x and 5x bands RL frameworks clip at (left), and its distribution (right). matplotlib through the Agg
    canvas only (never pyplot), imported here so that nothing else pays for it."""
    from matplotlib.figure import Figure

    ratio = np.exp(np.asarray(s.figure.log_ratio, dtype=np.float64))
    fig = Figure(figsize=(9.0, 3.2), layout="constrained")
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    left.scatter(s.figure.position, ratio, s=4, alpha=0.5, color="#2b6cb0", linewidths=0)
    for band, style in ((2.0, "--"), (5.0, ":")):
        for y in (band, 1 / band):
            left.axhline(y, color="#718096", linestyle=style, linewidth=0.8)
    left.axhline(1.0, color="#1a202c", linewidth=0.6)
    left.set_yscale("log")
    left.set_xlabel("position in the response")
    left.set_ylabel("pi_trainer / pi_rollout")
    total = s.row("total")
    left.set_title(f"{s.checkpoint}: rollout vs {total.b if total is not None else 'trainer'}", fontsize=9)
    nonzero = np.abs(np.log10(ratio[ratio != 1.0])) if ratio.size else np.zeros(0)
    right.hist(np.log10(ratio) if ratio.size else [], bins=60, color="#2b6cb0")
    right.set_xlabel("log10 ratio")
    right.set_ylabel("tokens")
    right.set_title(f"{int((ratio == 1.0).sum())} of {ratio.size} sampled tokens at exactly 1"
                    + (f"; max |log10| {nonzero.max():.2g}" if nonzero.size else ""), fontsize=9)
    return fig


def mismatch_figures(s: MismatchSummary) -> list[ReportFigure]:
    """The section's figure (none where the total row has no token)."""
    if not s.figure.position:
        return []
    return [ReportFigure(f"fig-mismatch-{slug(s.checkpoint)}", f"Rollout vs trainer, per token ({s.checkpoint})",
                         "The total row's per-token ratio pi_trainer / pi_rollout on a log axis against the position in "
                         "the response (a sample of at most 4,000 tokens, evenly spaced), with the 2x (dashed) and 5x "
                         "(dotted) bands RL frameworks clip at; right: its distribution.",
                         png(ratio_figure(s)), after=(f"table-mismatch-bands-{s.checkpoint}",
                                                      f"table-mismatch-{s.checkpoint}"))]
