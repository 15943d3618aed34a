"""Attest's tables, its verdict fact and its figure, from its section of results.json (`AttestSummary`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stagereplay.experiments.attest.summary import LONGEST, POWER, AttestSummary
from stagereplay.experiments.core.figures import ReportFigure, png
from stagereplay.experiments.core.format import NA, Table, as_rows, k_of_n, slug
from stagereplay.experiments.core.verdict import Fact, Question


def _g(x: float) -> str:
    return f"{x:.4g}"


WORDS = {"consistent": "consistent", "flagged": "not consistent", "inconclusive": "inconclusive"}


def decision_line(s: AttestSummary) -> str:
    """The decision in words, with its numbers."""
    needed = f"; flagged from {s.tokens_needed} tokens" if s.tokens_needed is not None else ""
    tests = "; ".join(
        f"mean {t.score} {_g(t.statistic)} [{_g(t.interval[0])}, {_g(t.interval[1])}] vs threshold {_g(t.threshold)}"
        f" (p = {_g(t.p_value)} against honest@{t.nearest.removeprefix('honest@')}, {_distance(t.distance)})"
        for t in s.tests)
    judged = "" if s.logprobs_used or s.source == "generated" else "; judged on tokens alone (no log-probability for " \
                                                                    "every served token)"
    return (f"{s.checkpoint}: {WORDS[s.outcome]} with the claimed model ({s.claim}, served by {s.claim_engine}) at a "
            f"{s.alpha:g} false-positive rate: {tests}, over {s.tokens} tokens of {s.items} responses{needed}"
            f"{judged}; {near_words(s)}")


def _distance(z: float | None) -> str:
    return "beyond a point-mass null" if z is None else f"{z:+.1f} null sd from honest"


def near_words(s: AttestSummary) -> str:
    """The honest variants by the distance of their statistic from the served run's, or that none is near."""
    if s.beyond_honest:
        return f"beyond every honest variant ({_distance(s.tests[0].distance)})"
    if not s.nearest:
        return "no honest variant"
    name, d = s.nearest[0]
    return f"nearest honest variant {name} (its mean {s.score} {_g(d)} away)"


def heldout_words(s: AttestSummary) -> str:
    """The honest false-positive rate by prompt, with its interval (or that the check could not fire)."""
    if not s.heldout_reachable:
        return (f"honest held-out responses not checked: one response against {len(s.calibration)} calibration "
                f"prompts cannot reach the level (pass more prompts)")
    lo, hi = s.heldout_interval
    return (f"honest held-out responses flagged {s.heldout_rate:.1%} by prompt [{lo:.3f}, {hi:.3f}] over "
            f"{s.heldout_prompts} prompts ({k_of_n(*s.honest_fpr)} responses)")


def attest_tables(s: AttestSummary) -> list[Table]:
    """The decision, each test, the evidence behind a "No", and each side's statistic with Token-DiFR's match rate."""
    decision = Table(
        f"table-attest-{slug(s.checkpoint)}", f"Is the server running the claimed model? ({s.checkpoint})",
        ("quantity", "value"), as_rows([
            ["served", s.served], ["claim", f"{s.claim}, served by {s.claim_engine}"],
            ["reference", f"one-shot prefill at {s.reference_precision}"],
            ["decision", {"flagged": "flagged: not the claimed model", "consistent": "consistent with the claimed "
                          "model", "inconclusive": "inconclusive: the null cannot support the level"}[s.outcome]],
            *[["why inconclusive", f"{b.reason}; {b.fix}"] for b in s.blockers],
            ["alpha", f"{s.alpha:g}"], ["tokens (responses)", f"{s.tokens} ({s.items})"],
            ["tokens needed", NA if s.tokens_needed is None else str(s.tokens_needed)],
            [f"tokens for {POWER:.0%} power", power_words(s)],
            ["null", f"{s.null_items} honest responses, {s.null_tokens} tokens ({len(s.calibration)} prompts), on "
                     f"{', '.join(s.null_engines)}"],
            ["log-probabilities", "tested (log-prob gap)" if s.logprobs_used else "not tested: judged on tokens alone"],
            ["honest variants by distance from the served run", near_words(s) if s.beyond_honest else
             ", ".join(f"{n} ({_g(d)})" for n, d in s.nearest[:3]) or NA],
            ["honest held-out flagged, by prompt", heldout_words(s)],
            ["prompts the claimed tokenizer would not make", NA if s.prompts_not_reencoded is None else
             k_of_n(len(s.prompts_not_reencoded), s.items)],
            ["Token-DiFR exact_match_rate", f"{s.difr.get('exact_match_rate', 0.0):.4f}"],
            ["Token-DiFR avg_margin", _g(s.difr.get("avg_margin", 0.0))],
            ["Token-DiFR avg_prob", _g(s.difr.get("avg_prob", 0.0))]]),
        note="Each statistic is a mean per-token score over the served tokens, tested at its share of alpha; the null "
             "is the claimed model's own honest variants on the calibration prompts, resampled by whole responses.")
    tests = Table(
        f"table-attest-tests-{slug(s.checkpoint)}", f"Each statistic against the honest null ({s.checkpoint})",
        ("test", "score", "alpha", "served [95%]", "nearest null", "threshold", "p", "honest median (sd)", "distance",
         "flagged"),
        as_rows([[t.name, t.score, f"{t.alpha:g}", f"{_g(t.statistic)} [{_g(t.interval[0])}, {_g(t.interval[1])}]",
                  t.nearest,
                  _g(t.threshold), _g(t.p_value), f"{_g(t.null_center)} ({_g(t.null_spread)})"
                  + (", a point mass" if t.point_mass else ""), _distance(t.distance), "yes" if t.flagged else "no"]
                 for t in s.tests]))
    sides = Table(
        f"table-attest-sides-{slug(s.checkpoint)}", f"Served and honest responses, scored by the reference "
        f"({s.checkpoint})", ("side", "responses", "tokens", f"mean {s.score} [95%]", "match rate",
                              "held-out flagged"),
        as_rows([[v.name, str(v.items), str(v.tokens), f"{_g(v.statistic)} [{_g(v.interval[0])}, {_g(v.interval[1])}]",
                  f"{v.match_rate:.4f}", NA if v.heldout is None else k_of_n(v.flagged or 0, v.heldout)]
                 for v in s.variants]))
    out = [decision, tests]
    if s.evidence and s.outcome != "consistent":
        out.append(Table(
            f"table-attest-evidence-{slug(s.checkpoint)}", f"The served tokens that weigh most ({s.checkpoint})",
            ("item", "position", "served token", "reference argmax", s.score, "served log-prob",
             "reference log-prob"),
            as_rows([[e.item, str(e.position), str(e.served), NA if e.argmax is None else str(e.argmax), _g(e.score),
                      NA if e.served_logprob is None else _g(e.served_logprob), _g(e.reference_logprob)]
                     for e in s.evidence])))
    return [*out, sides]


def _said(facts: Sequence[Fact]) -> str:
    return "; ".join(f.phrase for f in facts) + "."


def _answer(s: AttestSummary) -> str:
    return {"consistent": "yes, consistent with it", "flagged": "no, not as claimed",
            "inconclusive": "inconclusive, neither consistent nor flagged"}[s.outcome]


ATTESTED = Question("server runs the claimed model", "Is the server running the claimed model?", _said, alone=True)


def attest_verdict(s: AttestSummary) -> list[Fact]:
    why = "".join(f"; inconclusive because {b.reason} ({b.fix})" for b in s.blockers)
    facts = [Fact(ATTESTED, f"{_answer(s)}: {decision_line(s)}; {heldout_words(s)}{why}",
                  holds=None if s.outcome == "inconclusive" else s.outcome == "consistent")]
    if s.prompts_not_reencoded:
        facts.append(Fact(ATTESTED, f"{k_of_n(len(s.prompts_not_reencoded), s.items)} served prompts are not what the "
                                    "claimed model's tokenizer makes of their text (first: item "
                                    f"{s.prompts_not_reencoded[0]}): the server may tokenize otherwise; check that "
                                    "--model is the claimed model, and the prompts as the server got them"))
    return facts


def power_words(s: AttestSummary) -> str:
    """How many tokens flag runs like the served one with `POWER` power, in words."""
    if s.tokens_for_power is not None:
        return f"{s.tokens_for_power} (runs like the served one)"
    return f"- (not within {LONGEST} tokens)" if s.power_by_tokens else NA


def attest_figures(s: AttestSummary) -> list[ReportFigure]:
    """The null's statistic at the served run's length against the served run's, with the threshold; then AUC and
    power by run length."""
    out = [ReportFigure(f"fig-attest-{slug(s.checkpoint)}", f"Served run vs the honest null ({s.checkpoint})",
                        f"The distribution of the mean {s.score} of honest runs of {s.tokens} tokens (whole responses "
                        "resampled from the null) with the threshold at the false-positive rate (dashed) and the "
                        "served run's statistic with its interval over responses (solid).",
                        png(_figure(s)), after=(f"table-attest-sides-{slug(s.checkpoint)}",))]
    if s.power_by_tokens:
        out.append(ReportFigure(
            f"fig-attest-power-{slug(s.checkpoint)}", f"Tokens to tell this server from honest serving ({s.checkpoint})",
            "Runs of each length made of the served responses (resampled whole) against honest runs of that length: "
            f"the AUC, and the fraction flagged at the {s.alpha:g} false-positive rate (power). An honest server stays "
            "near 0.5 and the rate; a substitution climbs to 1. The dotted line is the served run's length.",
            png(_power_figure(s)), after=(f"table-attest-sides-{slug(s.checkpoint)}",)))
    return out


def _power_figure(s: AttestSummary) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.0), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    t = [p.tokens for p in s.power_by_tokens]
    ax.plot(t, [p.auc for p in s.power_by_tokens], marker="o", color="#2b6cb0", label="AUC")
    ax.plot(t, [p.power for p in s.power_by_tokens], marker="s", color="#c53030", label=f"power at {s.alpha:g}")
    ax.axhline(POWER, color="#718096", linestyle="--", linewidth=0.8, label=f"{POWER:.0%}")
    ax.axvline(s.tokens, color="#2d3748", linestyle=":", label="served run")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("tokens in a run", fontsize=8)
    ax.legend(fontsize=7)
    return fig


def _figure(s: AttestSummary) -> Any:
    """matplotlib through the Agg canvas only (never pyplot), imported here so that nothing else pays for it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.0), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    q = np.asarray(s.null_quantiles, dtype=np.float64)
    ax.hist(q, bins=20, color="#a0aec0", label="honest null")
    ax.axvline(s.threshold, color="#2d3748", linestyle="--", label=f"threshold at {s.alpha:g}")
    ax.axvline(s.statistic, color="#c53030" if s.flagged else "#2f855a", label="served")
    ax.axvspan(s.interval[0], s.interval[1], color="#c53030" if s.flagged else "#2f855a", alpha=0.15)
    ax.set_xlabel(f"mean {s.score} per token", fontsize=8)
    ax.set_ylabel("null quantiles", fontsize=8)
    ax.legend(fontsize=7)
    return fig
