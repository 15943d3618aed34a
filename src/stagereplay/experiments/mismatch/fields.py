"""The mismatch metrics of one pair of sides, one typed field each: verl's under verl's names (its name in each
field's `verl`), ours beside them (no `verl`). lr = log pi_train - log pi_rollout per token; every pooled mean
is over the tokens both sides give a finite log-probability (`mismatch_stats`).
docs/reference/mismatch-metrics.md is this model as a table."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


def _metric(verl: str, description: str, default: Any = None) -> Any:
    return Field(default, description=description, json_schema_extra={"verl": verl} if verl else None)


class MismatchMetrics(BaseModel):
    """Every metric of one pair of sides (None: no token to read it from)."""

    model_config = ConfigDict(frozen=True)

    tokens: int = _metric('', "tokens every metric reads: both log-probabilities finite", 0)
    sequences: int = _metric('', "sequences with at least one such token", 0)
    excluded_nan: int = _metric('', "tokens left out: NaN on either side", 0)
    excluded_infinite: int = _metric('', "tokens left out: +-inf on one side, or +inf on both", 0)
    both_neg_inf: int = _metric(
        '', "tokens left out where both sides are -inf (a processed distribution removed the token on both "
        "sides: they agree)", 0)
    kl: float | None = _metric(
        'rollout_corr/kl',
        "mean(log pi_rollout - log pi_train) over every token pooled: k1, KL(rollout || train)")
    k3_kl: float | None = _metric(
        'rollout_corr/k3_kl', "mean(exp(lr) - lr - 1) over every token pooled (unclamped): k3")
    training_ppl: float | None = _metric(
        'rollout_corr/training_ppl', "mean over sequences of exp(-mean log pi_train of the sequence)")
    training_log_ppl: float | None = _metric(
        'rollout_corr/training_log_ppl', "mean over sequences of -mean log pi_train of the sequence")
    rollout_ppl: float | None = _metric(
        'rollout_corr/rollout_ppl', "mean over sequences of exp(-mean log pi_rollout of the sequence)")
    rollout_log_ppl: float | None = _metric(
        'rollout_corr/rollout_log_ppl', "mean over sequences of -mean log pi_rollout of the sequence")
    log_ppl_diff: float | None = _metric(
        'rollout_corr/log_ppl_diff',
        "mean over sequences of d_i = mean log pi_rollout - mean log pi_train of sequence i")
    log_ppl_abs_diff: float | None = _metric('rollout_corr/log_ppl_abs_diff', "mean over sequences of |d_i|")
    log_ppl_diff_max: float | None = _metric('rollout_corr/log_ppl_diff_max', "max over sequences of d_i")
    log_ppl_diff_min: float | None = _metric('rollout_corr/log_ppl_diff_min', "min over sequences of d_i")
    ppl_ratio: float | None = _metric('rollout_corr/ppl_ratio', "mean over sequences of exp(d_i)")
    chi2_token: float | None = _metric(
        'rollout_corr/chi2_token', "mean(w^2) - 1 over every token pooled, w = exp(clamp(lr, +-20))")
    chi2_seq: float | None = _metric(
        'rollout_corr/chi2_seq', "mean over sequences of exp(2 clamp(sum_i lr, +-20)) - 1")
    rollout_is_mean: float | None = _metric(
        'rollout_corr/rollout_is_mean (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): mean of the truncated weights over every token")
    rollout_is_std: float | None = _metric(
        'rollout_corr/rollout_is_std (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): sqrt(mean(c^2) - mean(c)^2), c = truncated weights clamped to [0, upper], over every "
        "token")
    rollout_is_min: float | None = _metric(
        'rollout_corr/rollout_is_min (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): min of the truncated weights")
    rollout_is_max: float | None = _metric(
        'rollout_corr/rollout_is_max (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): max of the truncated weights")
    rollout_is_eff_sample_size: float | None = _metric(
        'rollout_corr/rollout_is_eff_sample_size (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): 1 / mean((c / (mean c + 1e-8))^2) over every token: a fraction of the tokens")
    rollout_is_ratio_fraction_high: float | None = _metric(
        'rollout_corr/rollout_is_ratio_fraction_high (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): fraction of tokens whose raw weight exp(clamp(lr)) > upper")
    rollout_is_ratio_fraction_low: float | None = _metric(
        'rollout_corr/rollout_is_ratio_fraction_low (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): fraction of tokens whose raw weight < lower (1/upper by default)")
    rollout_is_seq_mean: float | None = _metric(
        'rollout_corr/rollout_is_seq_mean (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): mean over sequences of each one's mean truncated weight")
    rollout_is_seq_std: float | None = _metric(
        'rollout_corr/rollout_is_seq_std (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): standard deviation (n - 1) over sequences of each one's mean truncated weight")
    rollout_is_seq_min: float | None = _metric(
        'rollout_corr/rollout_is_seq_min (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): min over sequences of each one's mean truncated weight")
    rollout_is_seq_max: float | None = _metric(
        'rollout_corr/rollout_is_seq_max (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): max over sequences of each one's mean truncated weight")
    rollout_is_seq_max_deviation: float | None = _metric(
        'rollout_corr/rollout_is_seq_max_deviation (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): max over sequences of |mean truncated weight - 1|")
    rollout_is_seq_fraction_high: float | None = _metric(
        'rollout_corr/rollout_is_seq_fraction_high (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): fraction of sequences whose mean raw token weight > upper")
    rollout_is_seq_fraction_low: float | None = _metric(
        'rollout_corr/rollout_is_seq_fraction_low (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): fraction of sequences whose mean raw token weight < lower")
    rollout_is_oob_ratio: float | None = _metric(
        'rollout_corr/rollout_is_oob_ratio (rollout_is=token)',
        "token weights w = exp(clamp(lr, +-20)), truncated at upper (TIS; IcePop: zeroed outside [lower, "
        "upper]): IcePop only (a lower bound given): fraction of tokens whose raw weight is outside [lower,"
        " upper]")
    sequence_is_mean: float | None = _metric(
        'rollout_corr/rollout_is_mean (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: mean "
        "of the truncated sequence weights over every token (length-weighted)")
    sequence_is_std: float | None = _metric(
        'rollout_corr/rollout_is_std (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: the "
        "same over every token (length-weighted)")
    sequence_is_min: float | None = _metric(
        'rollout_corr/rollout_is_min (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: "
        "exp(min_i sum_i lr), unclamped")
    sequence_is_max: float | None = _metric(
        'rollout_corr/rollout_is_max (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: "
        "exp(min(max_i sum_i lr, 20))")
    sequence_is_eff_sample_size: float | None = _metric(
        'rollout_corr/rollout_is_eff_sample_size (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: the "
        "same over every token (length-weighted)")
    sequence_is_ratio_fraction_high: float | None = _metric(
        'rollout_corr/rollout_is_ratio_fraction_high (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: "
        "fraction of sequences with sum_i lr > log(upper)")
    sequence_is_ratio_fraction_low: float | None = _metric(
        'rollout_corr/rollout_is_ratio_fraction_low (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: "
        "fraction of sequences with sum_i lr < log(lower)")
    sequence_is_seq_mean: float | None = _metric(
        'rollout_corr/rollout_is_seq_mean (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: mean "
        "over sequences of the truncated sequence weight")
    sequence_is_seq_std: float | None = _metric(
        'rollout_corr/rollout_is_seq_std (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: "
        "standard deviation (n - 1) of the truncated sequence weights")
    sequence_is_seq_min: float | None = _metric(
        'rollout_corr/rollout_is_seq_min (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: min "
        "of the truncated sequence weights")
    sequence_is_seq_max: float | None = _metric(
        'rollout_corr/rollout_is_seq_max (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: max "
        "of the truncated sequence weights")
    sequence_is_seq_max_deviation: float | None = _metric(
        'rollout_corr/rollout_is_seq_max_deviation (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: max "
        "over sequences of |truncated weight - 1|")
    sequence_is_seq_fraction_high: float | None = _metric(
        'rollout_corr/rollout_is_seq_fraction_high (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: "
        "fraction of sequences whose raw weight exp(clamp(sum_i lr)) > upper")
    sequence_is_seq_fraction_low: float | None = _metric(
        'rollout_corr/rollout_is_seq_fraction_low (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: "
        "fraction of sequences whose raw weight < lower")
    sequence_is_oob_ratio: float | None = _metric(
        'rollout_corr/rollout_is_oob_ratio (rollout_is=sequence)',
        "sequence weights exp(clamp(sum_i lr, +-20)) on each token of sequence i, truncated at upper: "
        "IcePop only: fraction of tokens whose sequence's raw weight is outside [lower, upper] (length-"
        "weighted)")
    rollout_probs_diff_max: float | None = _metric(
        'training/rollout_probs_diff_max',
        "max |exp(log pi_train) - exp(log pi_rollout)| over every token (probabilities, not log-"
        "probabilities)")
    rollout_probs_diff_mean: float | None = _metric(
        'training/rollout_probs_diff_mean', "mean of |p_train - p_rollout| over every token")
    rollout_probs_diff_std: float | None = _metric(
        'training/rollout_probs_diff_std',
        "standard deviation (n - 1) of |p_train - p_rollout| over every token")
    rollout_actor_probs_pearson_corr: float | None = _metric(
        'training/rollout_actor_probs_pearson_corr',
        "Pearson correlation of p_train and p_rollout over every token")
    abs_mean: float | None = _metric('', "mean |lr| over every token pooled, uncapped")
    abs_p50: float | None = _metric('', "median |lr| over every token")
    abs_p90: float | None = _metric('', "90th percentile of |lr|")
    abs_p99: float | None = _metric('', "99th percentile of |lr|")
    abs_max: float | None = _metric('', "max |lr|, uncapped")
    k2: float | None = _metric(
        '', "mean(lr^2 / 2) over every token pooled (unclamped; verl's token_k2 is clamped, and only a "
        "rejection statistic)")
    chi2_centred: float | None = _metric(
        '',
        "mean((w - 1)^2) over every token pooled, w = exp(clamp(lr, +-20)): the centred chi-square (verl's "
        "chi2_token is mean(w^2) - 1)")
    training_ppl_pooled: float | None = _metric(
        '', "exp(-mean log pi_train over every token pooled) (verl's training_ppl averages per-sequence "
        "perplexities)")
    rollout_ppl_pooled: float | None = _metric('', "exp(-mean log pi_rollout over every token pooled)")
    token_outside_2: float | None = _metric(
        '', "fraction of raw token weights exp(clamp(lr)) outside [1/2, 2]")
    token_outside_5: float | None = _metric('', "fraction of raw token weights outside [1/5, 5]")
    sequence_outside_2: float | None = _metric(
        '', "fraction of raw sequence weights exp(clamp(sum_i lr)) outside [1/2, 2]")
    sequence_outside_5: float | None = _metric('', "fraction of raw sequence weights outside [1/5, 5]")
    token_clamped: float | None = _metric(
        '', "fraction of tokens with |lr| >= 20: their weight is the clamp's, not theirs")
    sequence_clamped: float | None = _metric(
        '', "fraction of sequences with |sum_i lr| >= 20: their weight is the clamp's (all of them: every "
        "sequence weight e^+-20, an ESS that means nothing)")
    geo_mean: float | None = _metric('', "mean over sequences of the geometric weight exp(mean_i lr)")
    geo_min: float | None = _metric('', "min over sequences of exp(mean_i lr)")
    geo_max: float | None = _metric('', "max over sequences of exp(mean_i lr)")
    geo_outside_2: float | None = _metric(
        '', "fraction of sequences whose geometric weight is outside [1/2, 2]")
    geo_outside_5: float | None = _metric(
        '', "fraction of sequences whose geometric weight is outside [1/5, 5]")
    bitwise_equal: float | None = _metric(
        '', "fraction of tokens whose two fp32 log-probabilities are the same bits")
    argmax_agree: float | None = _metric(
        '', "fraction of tokens whose two rows' argmax is the same token (None: a side does not say)")
    rejection: dict[str, float | None] = Field(default_factory=dict, description=(
        "verl's rejection statistics, each under its name without `rollout_corr/`: "
        "rollout_rs_<option>_<statistic> per option, rollout_rs_masked_fraction and rollout_rs_seq_masked_fraction "
        "of all options together"))

    @classmethod
    def of(cls, flat: dict[str, float | int | None]) -> MismatchMetrics:
        """The model of `mismatch_metrics`' flat dict."""
        return cls.model_validate({**{k: v for k, v in flat.items() if not k.startswith("rollout_rs_")},
                                   "rejection": {k: v for k, v in flat.items() if k.startswith("rollout_rs_")}})

    def flat(self) -> dict[str, float | int | None]:
        """The flat dict `mismatch_metrics` returns."""
        return {**self.model_dump(exclude={"rejection"}), **self.rejection}
