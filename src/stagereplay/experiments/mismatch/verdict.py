"""Mismatch's facts for the verdict: whether the trainer sees the probabilities the rollout was sampled from.

Two answers, one after the other. First the bits: "yes, bit for bit" only when every token's two fp32
log-probabilities are the same bits (and no token was left out as not finite). Then the size of the gap, graded
against the bounds RL trainers act on:

    matched        every bit the same
    negligible     no token or sequence weight outside verl's default IS bounds [1/2, 2], and no sequence whose mean
                   k3 passes verl's k3 rejection preset (0.01)
    moderate       some weights outside [1/2, 2] or sequences past k3 0.01, none outside [1/5, 5] at token level
    large          token weights outside [1/5, 5]
    wrong model    a mean |log-ratio| beyond `WRONG_MODEL`, far past any engine or precision gap measured (0.05 at
                   most, a 4-bit quantized engine against an fp32 trainer): the rollouts look scored with another
                   tokenizer or model than the trainer's

A batch whose sequence weights all sit at the exp(+-20) clamp is said to be so (its ESS of 1 means nothing). The
parts (construction, engine) are given in kl, which adds up token by token to the total's; another trainer precision
is an alternative, reported as such.
"""

from __future__ import annotations

from collections.abc import Sequence

from stagereplay.experiments.core.verdict import CARRIES, REPLICAS, Fact, Question
from stagereplay.experiments.mismatch.fields import MismatchMetrics
from stagereplay.experiments.mismatch.summary import PARTS, MismatchSummary, PairSummary
from stagereplay.experiments.mismatch.tables import num

WRONG_MODEL = 0.5
"""A mean |log-ratio| beyond this is not an engine or precision gap (module docstring)."""
K3_SCALE = 0.01
"""verl's k3 rejection preset (`decoupled_k3_rs`): a sequence whose mean k3 passes it is rejected."""


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def grade(m: MismatchMetrics) -> str:
    """The size of the gap in words (module docstring)."""
    k3_rejected = m.rejection.get("rollout_rs_seq_mean_k3_seq_masked_fraction") or 0.0
    if m.bitwise_equal == 1.0 and m.excluded_nan + m.excluded_infinite == 0:
        return "matched: every bit the same"
    if m.abs_mean is not None and m.abs_mean > WRONG_MODEL:
        return (f"wrong model: a mean |log-ratio| of {num(m.abs_mean)} is far beyond any engine or precision gap; "
                "the rollouts look scored with another tokenizer or model than the trainer's")
    outside = (m.token_outside_2 or 0.0) + (m.sequence_outside_2 or 0.0)
    if outside == 0 and k3_rejected == 0:
        return (f"negligible: no token or sequence weight outside [1/2, 2] (verl's IS bounds), no sequence past "
                f"verl's k3 rejection at {K3_SCALE}")
    if not m.token_outside_5:
        return (f"moderate: {_pct(m.token_outside_2)} of token and {_pct(m.sequence_outside_2)} of sequence weights "
                f"outside [1/2, 2], {_pct(k3_rejected)} of sequences past verl's k3 rejection at {K3_SCALE}, none "
                "outside [1/5, 5]")
    return (f"large: {_pct(m.token_outside_5)} of token weights outside [1/5, 5], {_pct(k3_rejected)} of sequences "
            f"past verl's k3 rejection at {K3_SCALE}")


def clamped(m: MismatchMetrics) -> str | None:
    """A line where every sequence weight sits at the clamp, else None."""
    if m.sequences and m.sequence_clamped == 1.0:
        return (f"every one of the {m.sequences} sequence weights is at the clamp exp(+-20), so their std and ESS "
                "say nothing of them")
    return None


def by_part(rows: dict[str, PairSummary], total: PairSummary) -> str | None:
    """kl by part, adding up to the total's (None: no part was measured)."""
    parts = [(label, rows[label].metrics.kl) for label in PARTS if label in rows]
    if not parts or total.metrics.kl is None or any(kl is None for _, kl in parts):
        return None
    said = " + ".join(f"{label} {num(kl)}" for label, kl in parts)
    added = sum(kl for _, kl in parts if kl is not None)
    if len(parts) == len(PARTS) and abs(added - total.metrics.kl) <= 1e-9 * max(1.0, abs(total.metrics.kl)):
        return f"kl by part: {said} = total {num(total.metrics.kl)}"
    return f"kl by part: {said} (total {num(total.metrics.kl)}; the parts measured do not cover it)"


def alternatives(rows: dict[str, PairSummary]) -> str | None:
    """Each other trainer precision's total, as an alternative."""
    alts = [f"trainer at {label.removeprefix('total @ ')}: mean |log-ratio| {num(p.metrics.abs_mean)}, k3_kl "
            f"{num(p.metrics.k3_kl)}" for label, p in rows.items() if label.startswith("total @ ")]
    return f"alternatives (not parts): {'; '.join(alts)}" if alts else None


def _seen(facts: Sequence[Fact]) -> str:
    head = "yes, bit for bit" if all(f.holds for f in facts) else "no, not bit for bit"
    return f"{head}: " + "; ".join(f.phrase for f in facts) + "."


SEEN = Question("trainer sees rollout", "Does the trainer see the probabilities the rollout was sampled from?", _seen)


def mismatch_verdict(s: MismatchSummary) -> list[Fact]:
    """Its facts: to the replicas question, to the cache question (the transplant), and to its own question."""
    rows = {p.row: p for p in s.pairs}
    facts = []
    replicas = [p for label, p in rows.items() if label.startswith("replica")]
    if replicas:
        exact = sum(p.metrics.bitwise_equal == 1.0 for p in replicas)
        facts.append(Fact(REPLICAS, f"{s.checkpoint} mismatch: {exact}/{len(replicas)} sides' log-probabilities",
                          holds=exact == len(replicas), caveat="and log-probabilities"))
    total = rows.get("total")
    if total is not None:
        m = total.metrics
        said = [f"{s.checkpoint}, {total.a} vs {total.b}: {_pct(m.bitwise_equal)} of {m.tokens} token "
                f"log-probabilities are the same bits", f"size {grade(m)}",
                f"mean |log-ratio| {num(m.abs_mean)} (max {num(m.abs_max)}), k3_kl {num(m.k3_kl)}"]
        if m.excluded_nan + m.excluded_infinite:
            said.append(f"{m.excluded_nan + m.excluded_infinite} tokens with a non-finite log-probability left out")
        said += [x for x in (clamped(m), by_part(rows, total), alternatives(rows)) if x]
        facts.append(Fact(SEEN, "; ".join(said),
                          holds=m.bitwise_equal == 1.0 and m.excluded_nan + m.excluded_infinite == 0))
    if s.transplant is not None:
        for d in s.transplant.directions:
            facts.append(Fact(CARRIES, f"{s.checkpoint} mismatch at mid-response {d.direction}",
                              holds=d.follows_donor == d.n, k=d.follows_donor, n=d.n))
        for d in s.transplant.control:
            facts.append(Fact(CARRIES, "", k=d.follows_recipient, n=d.n, control=True))
    return facts
