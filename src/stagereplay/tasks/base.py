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


def last_number_answer(output: str) -> str | None:
    """The last number in the output, normalised (commas dropped, `12.0` -> `12`); None if there is none."""
    found = _NUMBER.findall(output)
    value = _as_number(found[-1]) if found else None
    if value is None:
        return None
    return str(int(value)) if value.is_integer() else repr(value)


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


@dataclass(frozen=True)
class PatternScorer:
    """Group 1 (or the whole match) of the first match of `pattern` is the answer; correct when it equals the
    gold answer, stripped."""

    pattern: str

    def extract(self, output: str) -> str | None:
        match = re.search(self.pattern, output)
        if match is None:
            return None
        return (match.group(1) if match.re.groups else match.group(0)).strip()

    def __call__(self, output: str, answer: str) -> bool:
        got = self.extract(output)
        return got is not None and got == answer.strip()


def regex_scorer(pattern: str) -> Scorer:
    """A `PatternScorer` for `pattern` (compiled once here, so a bad pattern fails up front)."""
    re.compile(pattern)
    return PatternScorer(pattern)


@dataclass(frozen=True)
class Item:
    """A prompt as token IDs (after any chat template), its gold answer and the id it is recorded under."""

    id: str
    prompt_ids: tuple[int, ...]
    answer: str
    prompt_text: str = field(default="", compare=False)
