"""The embedded toy task: add six to eight labelled two-digit numbers, in a think block and again after it.

One example as the model sees it, the first of the training stream (the chat template renders the user
message; the model writes the rest)::

    <|bos|><|user|>Add a=82, b=18, c=42, d=25, e=73, f=67.<|assistant|><think>
    d=25 f:25+67=92 b:92+18=110,a:110+82=192 e:192+73=265&c:265+42=307
    </think>

    b=18,e:18+73=91,a:91+82=173 f:173+67=240;d:240+25=265 c:265+42=307
    Answer: 307

- Stage 1, the think block, adds the numbers as running sums in a random order of their labels and ends
  with `</think>` (the stage boundary marker, one token).
- Stage 2, the answer section, adds them again in its own, independently drawn order, then gives the
  answer: the last number of the output, so the `last-number` scorer that users' data take reads it.

Two kinds of genuine free choice, each a single token of equal training probability, give a trained model
many near-tied next tokens (the near-ties that bf16 numerics can break either way):

- the **label** of the next term: every unused label is equally likely (`b`, `d`, `a`, ... above);
- the **connective** between steps: one of `,` `;` `&` and a space, drawn uniformly.

Errors are meant to depend on the path. Each step adds a two-digit term to a running sum of up to three
digits, written most significant digit first, so a small model's mistakes are carries and copies it gets
wrong; the running sums a route meets depend on its order, so an addition got wrong on one route may come
out right on another. The think block of 30% of the training examples holds one arithmetic slip (a
running sum off by 1 or 10, carried on to its end, as reasoning models' think blocks sometimes are), while
the answer section is always right, so copying the think block's route or total is wrong on those examples:
the data reward adding again along the new order. (How far a trained checkpoint follows this is measured in
the model card.)

All randomness flows through an explicit `random.Random(seed)`; nothing here seeds a global generator.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stagereplay.tasks.base import Item, Scorer, last_number

TOY_MARKER = "</think>"
"""The stage boundary marker: one token of the toy tokenizer, as in DeepSeek-R1-style models."""
TOY_SCORER_NAME = "last-number"
"""The toy's answer is the last number of its output, so it is scored as users' data are by default."""
toy_scorer: Scorer = last_number

HELDOUT_SEED = 20_250_917
"""Seed of the held-out evaluation set (`stagereplay matched` with no data, the model card figures)."""
TRAIN_SEED = 1
"""Default seed of the training stream; must differ from `HELDOUT_SEED`."""
HELDOUT_EXCLUDED = 1000
"""Training skips any question among the first this many held-out questions, so held-out items are unseen."""

MIN_TERMS, MAX_TERMS = 6, 8
MIN_VALUE, MAX_VALUE = 10, 99
LABELS = "abcdefgh"
"""One label per term, in prompt order; each is one token."""
CONNECTIVES = (",", ";", "&", " ")
"""Interchangeable one-token joins between steps, drawn uniformly."""
SLIP_RATE = 0.3
"""Fraction of training think blocks holding one arithmetic slip (never the answer section)."""
SLIPS = (-10, -1, 1, 10)
ANSWER_PREFIX = "Answer: "


@dataclass(frozen=True)
class Route:
    """One stage's worked sum: the order of term positions and the connective before each later step."""

    order: tuple[int, ...]
    joins: tuple[str, ...]
    slip: tuple[int, int] | None = None
    """`(step, delta)`: the running sum after `step` (>= 1) is off by `delta`, and the error carries on."""


@dataclass(frozen=True)
class ToyExample:
    """One question and a worked solution along two routes."""

    terms: tuple[int, ...]
    think: Route
    answer_route: Route

    @property
    def answer(self) -> str:
        return str(sum(self.terms))

    @property
    def question(self) -> str:
        """The user message: `Add a=3, b=7, c=2.`"""
        return "Add " + ", ".join(f"{LABELS[i]}={t}" for i, t in enumerate(self.terms)) + "."

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.question}]

    def stage(self, route: Route) -> str:
        """Running sums along `route`: `b=7;d:7+9=16&a:16+3=19`."""
        first = route.order[0]
        total = self.terms[first]
        parts = [f"{LABELS[first]}={total}"]
        for step, (index, join) in enumerate(zip(route.order[1:], route.joins, strict=True), start=1):
            value = self.terms[index]
            new = total + value
            if route.slip is not None and route.slip[0] == step:
                new += route.slip[1]
            parts.append(f"{join}{LABELS[index]}:{total}+{value}={new}")
            total = new
        return "".join(parts)

    @property
    def completion(self) -> str:
        """What the model writes after the prompt's opening `<think>\\n`, without EOS."""
        return (
            f"{self.stage(self.think)}\n{TOY_MARKER}\n\n{self.stage(self.answer_route)}\n{ANSWER_PREFIX}{self.answer}"
        )


def sample_route(rng: random.Random, terms: tuple[int, ...], slip_rate: float) -> Route:
    """A uniform order and uniform connectives; with probability `slip_rate`, one slipped running sum."""
    count = len(terms)
    order = tuple(rng.sample(range(count), count))
    joins = tuple(rng.choice(CONNECTIVES) for _ in range(count - 1))
    slip = None
    if rng.random() < slip_rate:
        step, delta = rng.randint(1, count - 1), rng.choice(SLIPS)
        if sum(terms[i] for i in order[: step + 1]) + delta < 0:
            delta = -delta  # a slip never makes a running sum negative
        slip = (step, delta)
    return Route(order, joins, slip)


def sample_example(rng: random.Random) -> ToyExample:
    """Draw the numbers, then two independent routes; every draw comes from `rng`."""
    count = rng.randint(MIN_TERMS, MAX_TERMS)
    terms = tuple(rng.randint(MIN_VALUE, MAX_VALUE) for _ in range(count))
    return ToyExample(terms, sample_route(rng, terms, SLIP_RATE), sample_route(rng, terms, 0.0))


def toy_examples(n: int, seed: int) -> list[ToyExample]:
    """The first `n` examples of the stream for `seed`: a prefix of the stream for any larger `n`."""
    rng = random.Random(seed)
    return [sample_example(rng) for _ in range(n)]


def heldout_questions(count: int = HELDOUT_EXCLUDED) -> frozenset[str]:
    """Questions of the first `count` held-out items."""
    return frozenset(example.question for example in toy_examples(count, HELDOUT_SEED))


def training_stream(seed: int = TRAIN_SEED) -> Iterator[ToyExample]:
    """Endless training examples for `seed`, skipping every question of the held-out set."""
    if seed == HELDOUT_SEED:
        raise ValueError(f"training seed {seed} is the held-out seed")
    excluded = heldout_questions()
    rng = random.Random(seed)
    while True:
        example = sample_example(rng)
        if example.question not in excluded:
            yield example


def toy_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` items as `messages` rows, the JSONL shape users' chat data take (`id`, `messages`, `answer`)."""
    return [
        {"id": f"toy-{seed}-{index:04d}", "messages": example.messages, "answer": example.answer}
        for index, example in enumerate(toy_examples(n, seed))
    ]


def toy_jsonl(n: int, seed: int) -> str:
    """The rows of `toy_rows` as JSONL text: the bytes whose SHA-256 is a toy run's data hash, so a file holding
    this text (`stagereplay toy items`) run with `--data` gives the same items and the same hash."""
    return "".join(json.dumps(row) + "\n" for row in toy_rows(n, seed))


def toy_data_hash(n: int, seed: int) -> str:
    """A toy run's dataset hash: the SHA-256 of `toy_jsonl`, as a data file's is of its bytes."""
    return hashlib.sha256(toy_jsonl(n, seed).encode()).hexdigest()


def toy_items(n: int, seed: int, tokenizer: Any) -> list[Item]:
    """`n` items of the toy task, tokenised by the tokenizer's chat template exactly as `messages` rows are."""
    from stagereplay.tasks.jsonl import parse_row, tokenize_row

    return [tokenize_row(parse_row(row, index, "toy"), tokenizer) for index, row in enumerate(toy_rows(n, seed))]
