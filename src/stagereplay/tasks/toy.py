"""The embedded toy task: add a few one-digit numbers twice, along two freely chosen routes.

One example, as text (the prompt is the first line; the model writes the rest)::

    Q:3+7+2+5=?
    7+3=10,10+5=15,15+2=17|2+5=7,7+3=10,10+7=17
    A:17

Stage 1 adds the numbers as running sums in a random order, the marker `|` ends it, stage 2 adds them
again in a second, independently drawn order (a check along another route), and `A:` gives the sum.
The orders are genuine free choices: every remaining number is an equally good next step, so a trained
model has near-tied next tokens at each step, as reasoning models do when they pick among independent
steps. The answer is fully determined by the prompt.

All randomness flows through an explicit `random.Random(seed)`; nothing here seeds a global generator.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from stagereplay.tasks.base import Item, Scorer, regex_scorer

TOY_MARKER = "|"
"""Text of the stage boundary marker (one token in the toy tokenizer)."""

TOY_ANSWER_PATTERN = r"A:(\d+)"
toy_scorer: Scorer = regex_scorer(TOY_ANSWER_PATTERN)
"""Correct when the number after the first `A:` equals the gold sum."""
TOY_SCORER = toy_scorer

HELDOUT_SEED = 20_250_917
"""Seed of the held-out evaluation set (`stagereplay matched` with no data, the model card figures)."""
TRAIN_SEED = 1
"""Default seed of the training stream; must differ from `HELDOUT_SEED`."""
HELDOUT_EXCLUDED = 1000
"""Training skips any prompt among the first this many held-out prompts, so held-out items are unseen."""

MIN_TERMS, MAX_TERMS = 4, 5
"""How many numbers a question adds: enough that stage 2 runs to 20-30 characters."""
MIN_DIGIT, MAX_DIGIT = 1, 9


class _Encoder(Protocol):
    """The one tokenizer method used here (any `transformers` tokenizer has it)."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class ToyExample:
    """One question and a worked solution along two routes."""

    terms: tuple[int, ...]
    order1: tuple[int, ...]
    """Stage 1 adds `terms[i]` for `i` in this order (a permutation of positions)."""
    order2: tuple[int, ...]
    """Stage 2's order, drawn independently of stage 1's."""

    @property
    def answer(self) -> str:
        return str(sum(self.terms))

    @property
    def prompt(self) -> str:
        return "Q:" + "+".join(map(str, self.terms)) + "=?\n"

    def stage(self, order: tuple[int, ...]) -> str:
        """Running sums in `order`: `7+3=10,10+5=15,15+2=17`."""
        values = [self.terms[i] for i in order]
        total = values[0] + values[1]
        steps = [f"{values[0]}+{values[1]}={total}"]
        for value in values[2:]:
            steps.append(f"{total}+{value}={total + value}")
            total += value
        return ",".join(steps)

    @property
    def completion(self) -> str:
        """What the model writes after the prompt, without EOS."""
        return self.stage(self.order1) + TOY_MARKER + self.stage(self.order2) + "\nA:" + self.answer

    @property
    def text(self) -> str:
        return self.prompt + self.completion


def sample_terms(rng: random.Random) -> tuple[int, ...]:
    count = rng.randint(MIN_TERMS, MAX_TERMS)
    return tuple(rng.randint(MIN_DIGIT, MAX_DIGIT) for _ in range(count))


def sample_example(rng: random.Random) -> ToyExample:
    """Draw the numbers, then two independent orders; every draw comes from `rng`."""
    terms = sample_terms(rng)
    positions = list(range(len(terms)))
    order1 = tuple(rng.sample(positions, len(positions)))
    order2 = tuple(rng.sample(positions, len(positions)))
    return ToyExample(terms, order1, order2)


def toy_examples(n: int, seed: int) -> list[ToyExample]:
    """The first `n` examples of the stream for `seed`: a prefix of the stream for any larger `n`."""
    rng = random.Random(seed)
    return [sample_example(rng) for _ in range(n)]


def heldout_prompts(count: int = HELDOUT_EXCLUDED) -> frozenset[str]:
    """Prompts of the first `count` held-out items."""
    return frozenset(example.prompt for example in toy_examples(count, HELDOUT_SEED))


def training_stream(seed: int = TRAIN_SEED) -> Iterator[ToyExample]:
    """Endless training examples for `seed`, skipping every prompt of the held-out set."""
    if seed == HELDOUT_SEED:
        raise ValueError(f"training seed {seed} is the held-out seed")
    excluded = heldout_prompts()
    rng = random.Random(seed)
    while True:
        example = sample_example(rng)
        if example.prompt not in excluded:
            yield example


def toy_items(n: int, seed: int, tokenizer: _Encoder) -> list[Item]:
    """`n` items of the toy task; `prompt_ids` are the tokenizer's ids of the prompt, BOS included."""
    return [
        Item(
            id=f"toy-{seed}-{index:04d}",
            prompt_ids=tuple(tokenizer.encode(example.prompt)),
            answer=example.answer,
            prompt_text=example.prompt,
        )
        for index, example in enumerate(toy_examples(n, seed))
    ]
