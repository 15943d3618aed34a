"""The verdict's questions, and the facts the experiments give them.

The report opens with the questions a reader of a stage-replay audit asks, each answered with its numbers:

1. Are replicas exact? (if not, nothing below is attributable to the construction)
2. Is replay faithful at the run's precision (bf16 in the paper)?
3. Is it faithful in fp32?
4. Does the cache carry the divergence (transplant)?

and, where the run recorded diagnostics, how close the decisions were where the arms diverged (LayerCast's margins)
and how far apart the two states' first-step logits are per precision. A question the run did not measure says so,
with the command that would.

An experiment raises questions (`Experiment.verdict_questions`) and gives them facts (`Experiment.verdict_facts`),
each from its own section of results.json; `report.verdict` asks every registered experiment, in the registry's
order, and answers each question raised from the facts of all of them. A new experiment gives its facts to these
questions, or asks a question of its own (a `Question` made in its module), with no edit in the report.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from stagereplay.experiments.core.stats import wilson_interval


@dataclass(frozen=True)
class Question:
    """One question of the verdict: its words, and how its answer is said from the facts given it. Two questions
    are the same question when their keys are equal (`faithful("bf16")` made twice is one question)."""

    key: str
    """What the facts name: `replicas exact`, `faithful at <precision>`, `cache carries`, ..."""
    text: str = field(compare=False)
    """How the report asks it."""
    say: Callable[[Sequence[Fact]], str | None] = field(compare=False)
    """Its answer from the facts given it (at least one); None: they do not answer it."""
    unanswered: str | None = field(default=None, compare=False)
    """The answer when no fact answers it: what was not measured, and the command that would measure it (None: the
    question is left out)."""

    alone: bool = field(default=False, compare=False)
    """Whether its answer stands without the replicas' question (a question of what a server serves, not of a
    construction): the verdict is then given even where no experiment asks whether replicas are exact."""

    def answer(self, facts: Sequence[Fact]) -> str | None:
        return (self.say(facts) if facts else None) or self.unanswered


@dataclass(frozen=True)
class Fact:
    """What one experiment's results say towards one question: where (`phrase`) and its numbers."""

    question: Question
    phrase: str
    """Its words as the answer lists them: `primary live 14/14, oneshot 14/14`, `live vs oneshot (primary)`."""
    holds: bool | None = None
    """Its yes or no to the question (None: a number that says neither)."""
    k: int = 0
    n: int = 0
    """Its count, where it has one: k of n (suffixes that differ, continuations that follow the donor)."""
    control: bool = False
    """A negative control's count, said after the findings and never deciding the answer's yes or no."""
    caveat: str = ""
    """What limits what it measured (a serving engine's replicas: caches only where the engine exposes them)."""


# -- the numbers, as the verdict prints them ---------------------------------------------------------------------


def percent_of(k: int, n: int) -> str:
    return f"{k}/{n} ({100 * k / n:.1f}%)" if n else f"{k}/{n}"


def upper_bound(k: int, n: int) -> str:
    """The Wilson 95% upper bound in percent, two decimals: 1.88% for 0/200."""
    return f"{100 * wilson_interval(k, n)[1]:.2f}%" if n else "-"


def lower_bound(k: int, n: int) -> str:
    """The Wilson 95% lower bound in percent, one decimal: 86.2% for 24/24."""
    return f"{100 * wilson_interval(k, n)[0]:.1f}%" if n else "-"


def items(n: int) -> str:
    return f"{n} item" if n == 1 else f"{n} items"


def logit(x: float | None) -> str:
    """A logit-scale number: 3 significant digits, 0 as 0."""
    return "-" if x is None else "0" if x == 0 else f"{x:.3g}"


def median_of(values: Any) -> float | None:
    """The median of a list (or of a dict's values), nulls left out; None when nothing is left."""
    xs = [v for v in (values.values() if isinstance(values, dict) else values or []) if v is not None]
    return float(median(xs)) if xs else None


# -- the protocol's questions ------------------------------------------------------------------------------------


def _replicas(facts: Sequence[Fact]) -> str:
    caveats = [f.caveat for f in facts if f.caveat]
    what = f"tokens ({caveats[0]})" if caveats else "tokens and caches"
    head = "yes" if all(f.holds for f in facts) else "no"
    return f"{head}: runs repeated from scratch were bit-identical in {what} ({'; '.join(f.phrase for f in facts)})."


def _faithful(facts: Sequence[Fact]) -> str:
    """Faithful = no suffix changes: yes when no fact counts one."""
    said = "; ".join(
        f"{percent_of(f.k, f.n)} suffixes differ, {f.phrase}"
        + (f" (Wilson 95% upper bound {upper_bound(f.k, f.n)})" if f.k == 0 else "")
        for f in facts
    )
    return ("yes" if all(f.holds for f in facts) else "no") + f": {said}."


def _carried(facts: Sequence[Fact]) -> str | None:
    rows = [f for f in facts if not f.control]
    if not rows:
        return None
    head = "yes" if all(f.holds for f in rows) else "partly" if any(f.k for f in rows) else "no"
    said = "; ".join(f"{f.phrase}: {f.k}/{f.n} follow the donor (Wilson 95% lower bound {lower_bound(f.k, f.n)})"
                     for f in rows)
    controls = [f for f in facts if f.control]
    if controls:
        said += (f"; with no layers moved, {sum(f.k for f in controls)}/{sum(f.n for f in controls)} follow the "
                 "recipient")
    return f"{head}: swapping the K/V of all layers moves the continuation with the cache: {said}."


REPLICAS = Question("replicas exact", "Are replicas exact?", _replicas)
"""Without exact replicas nothing else is attributable to the construction: the verdict is given only with them."""

CARRIES = Question("cache carries", "Does the cache carry the divergence?", _carried,
                   "not tested (no divergent item was transplanted; run `stagereplay transplant RUN`).")

MARGINS = Question("decision margins", "How close were the decisions where the arms diverged?",
                   lambda facts: "; ".join(f.phrase for f in facts) + ".")
"""LayerCast's observation: margins at the first divergent token against margins over all steps."""

FIRST_STEP = Question("first-step logits", "How far apart are the two states before any token differs?",
                      lambda facts: "median max-abs logit difference at the first suffix step: "
                                    + "; ".join(f.phrase for f in facts) + ".")


def faithful(precision: str) -> Question:
    """Is replay faithful at `precision`: do the suffixes of a fresh construction equal live's?"""
    return Question(f"faithful at {precision}", f"Is replay faithful in {precision}?", _faithful,
                    f"not measured at {precision} (run `stagereplay precision-2x2 RUN --precisions bf16,fp32`).")
