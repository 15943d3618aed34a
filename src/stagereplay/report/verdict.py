"""The verdict at the top of the report: the questions a reader of a stage-replay audit asks (are replicas exact? is
replay faithful at the run's precision, and in fp32? does the cache carry the divergence? ...), each answered with its
numbers from `results.json` (`experiments.core.verdict` holds the questions and how each answer is said).

Every registered experiment, in the registry's order, raises the questions its section of the results asks and gives
them its facts; the questions are asked in the order first raised, each answered from the facts of all of them. A
question nobody answers says so, with the command that would; the verdict is given only where the replicas' question
is asked, since without replicas nothing is attributable to a construction, or where a question that stands alone
is asked (`Question.alone`).
"""

from __future__ import annotations

from stagereplay.experiments.core.registry import all_experiments
from stagereplay.experiments.core.verdict import REPLICAS, Fact, Question
from stagereplay.report.results import Results


def verdict(results: Results) -> list[tuple[str, str]]:
    """(question, answer) pairs, in the order the report prints them; empty when no experiment asks whether
    replicas are exact, nor a question that stands alone."""
    asked: dict[Question, list[Fact]] = {}
    facts: list[Fact] = []
    for e in all_experiments():
        section = results.of(e)
        for question in e.verdict_questions(section):
            asked.setdefault(question, [])
        facts += e.verdict_facts(section)
    if REPLICAS not in asked and not any(q.alone for q in asked):
        return []
    for fact in facts:
        if fact.question in asked:  # not a fact of a question nobody raised (a precision the run does not ask about)
            asked[fact.question].append(fact)
    answers = [(question.text, question.answer(given)) for question, given in asked.items()]
    return [(text, answer) for text, answer in answers if answer is not None]


def verdict_text(results: Results) -> str:
    """The verdict as one paragraph of plain text."""
    return " ".join(f"{q} {a[0].upper()}{a[1:]}" for q, a in verdict(results))
