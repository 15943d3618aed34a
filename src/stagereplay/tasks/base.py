"""Items and scorers: what an experiment runs on and how its output is judged."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

Scorer = Callable[[str, str], bool]
"""`scorer(output_text, gold_answer) -> correct?`"""

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def last_number(output: str, answer: str) -> bool:
    """The last number in the output equals the gold number (commas ignored, 12 == 12.0)."""
    found = _NUMBER.findall(output)
    if not found:
        return False
    got, gold = _as_number(found[-1]), _as_number(answer.strip())
    return got is not None and gold is not None and got == gold


def exact_match(output: str, answer: str) -> bool:
    """The output, stripped, equals the gold answer, stripped."""
    return output.strip() == answer.strip()


def regex_scorer(pattern: str) -> Scorer:
    """Group 1 (or the whole match) of the first match of `pattern` equals the gold answer, stripped."""
    compiled = re.compile(pattern)

    def score(output: str, answer: str) -> bool:
        match = compiled.search(output)
        if match is None:
            return False
        got = match.group(1) if compiled.groups else match.group(0)
        return got.strip() == answer.strip()

    return score


@dataclass(frozen=True)
class Item:
    """A prompt as token IDs (after any chat template), its gold answer and the id it is recorded under."""

    id: str
    prompt_ids: tuple[int, ...]
    answer: str
    prompt_text: str = field(default="", compare=False)
