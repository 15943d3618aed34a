"""The embedded toy: task generator, tokenizer, the two packaged checkpoints and the training recipe."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import random
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from stagereplay.tasks.toy import (
    HELDOUT_EXCLUDED,
    HELDOUT_SEED,
    TOY_MARKER,
    TRAIN_SEED,
    ToyExample,
    heldout_prompts,
    toy_examples,
    toy_items,
    toy_scorer,
    training_stream,
)
from stagereplay.toy import TOY_CHECKPOINTS, toy_checkpoint
from stagereplay.toy.tokenizer import build_tokenizer, save_tokenizer, special_token_ids
from stagereplay.toy.train import VALIDATION_SEED, TrainConfig, train

GREEDY_ITEMS = 20
"""Held-out items decoded per checkpoint; the card's 200-item figures come from `stagereplay.toy.evaluate`."""
MIN_CORRECT = 16
"""Loose floor on those 20 (80%): the card measures >= 90% on 200; this only catches a broken model."""


def check_worked_solution(example: ToyExample) -> None:
    """Every step of both stages is a correct addition of an unused term, and the answer is the sum."""
    completion = example.completion
    stages, answer = completion.split("\nA:")
    stage1, stage2 = stages.split(TOY_MARKER)
    assert answer == str(sum(example.terms))
    for stage in (stage1, stage2):
        used = []
        running = None
        for step in stage.split(","):
            left, result = step.split("=")
            a, b = map(int, left.split("+"))
            assert a + b == int(result)
            if running is None:
                used += [a, b]
            else:
                assert a == running
                used.append(b)
            running = int(result)
        assert sorted(used) == sorted(example.terms)
        assert running == sum(example.terms)


def test_examples_are_deterministic_per_seed_and_valid() -> None:
    first, again, other = toy_examples(200, 11), toy_examples(200, 11), toy_examples(200, 12)
    assert first == again
    assert first != other
    assert toy_examples(50, 11) == first[:50]  # a prefix of the stream, whatever n
    for example in first:
        check_worked_solution(example)
        # stage 2 is long enough to diverge in: tens of characters (one token each)
        assert len(example.stage(example.order2)) >= 17  # 1+1=2,2+1=3,3+1=4


def test_orders_are_genuine_free_choices() -> None:
    """The same question gets different worked orders: the order is drawn, not derived from the numbers."""
    completions: dict[str, set[str]] = defaultdict(set)
    for seed in (11, 12, 13):
        for example in toy_examples(1000, seed):
            completions[example.prompt].add(example.stage(example.order1))
    assert any(len(routes) > 1 for routes in completions.values())
    # and within one example the two stages often take different routes
    examples = toy_examples(200, 11)
    assert sum(e.stage(e.order1) != e.stage(e.order2) for e in examples) > 150


def test_heldout_is_disjoint_from_training() -> None:
    assert HELDOUT_SEED not in (TRAIN_SEED, VALIDATION_SEED)
    excluded = heldout_prompts()
    assert len(excluded) > 0.9 * HELDOUT_EXCLUDED
    stream = training_stream(TRAIN_SEED)
    assert not any(next(stream).prompt in excluded for _ in range(5000))
    with pytest.raises(ValueError):
        next(training_stream(HELDOUT_SEED))
    with pytest.raises(ValueError):
        TrainConfig(out=Path("unused"), seed=HELDOUT_SEED)


def test_scorer_reads_the_answer_line() -> None:
    assert toy_scorer("3+4=7,7+1=8|1+3=4,4+4=8\nA:8", "8")
    assert not toy_scorer("3+4=7,7+1=8|1+3=4,4+4=8\nA:9", "8")
    assert not toy_scorer("3+4=7,7+1=8|", "8")


@pytest.mark.parametrize("loaded", ["saved", "packaged"])
def test_tokenizer_round_trips(tmp_path: Path, loaded: str) -> None:
    if loaded == "saved":
        save_tokenizer(tmp_path)
        directory = tmp_path
    else:
        directory = toy_checkpoint("primary")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    raw = build_tokenizer()
    ids = special_token_ids()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        ids["bos"],
        ids["eos"],
        ids["pad"],
    )
    texts = [e.text for e in toy_examples(20, 5)] + ["Q:1+2=?\n", "any text: é ✓\t\r\n  end"]
    for text in texts:
        encoded = tokenizer(text)["input_ids"]
        assert encoded == raw.encode(text).ids  # training's tokenizer and the loaded one agree
        assert encoded[0] == ids["bos"]
        assert len(encoded) == 1 + len(text.encode())  # one token per byte
        decoded = tokenizer.decode(encoded, skip_special_tokens=True)
        assert decoded == text
        assert tokenizer(decoded)["input_ids"] == encoded


def test_toy_items_ids_and_prompts() -> None:
    tokenizer = AutoTokenizer.from_pretrained(toy_checkpoint("primary"))
    items = toy_items(5, HELDOUT_SEED, tokenizer)
    assert [item.id for item in items] == [f"toy-{HELDOUT_SEED}-{i:04d}" for i in range(5)]
    for item, example in zip(items, toy_examples(5, HELDOUT_SEED), strict=True):
        assert item.prompt_ids == tuple(tokenizer(example.prompt)["input_ids"])
        assert item.answer == str(sum(example.terms))
        assert item.prompt_text == example.prompt


def test_unknown_checkpoint_name() -> None:
    with pytest.raises(ValueError, match="primary"):
        toy_checkpoint("final")


@cache
def load(name: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(toy_checkpoint(name), dtype=torch.float32).eval()


@contextmanager
def one_thread() -> Iterator[None]:
    """Decode steps of a model this small are latency-bound: one thread is fastest, above all on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@cache
def greedy(name: str, n: int) -> tuple[str, ...]:
    """Greedy fp32 completions of the first `n` held-out items, batch size 1."""
    model = load(name)
    tokenizer = AutoTokenizer.from_pretrained(toy_checkpoint(name))
    outputs = []
    with torch.no_grad(), one_thread():
        for item in toy_items(n, HELDOUT_SEED, tokenizer):
            prompt = torch.tensor([item.prompt_ids])
            out = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=128
            )
            outputs.append(tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True))
    return tuple(outputs)


@pytest.mark.parametrize("name", TOY_CHECKPOINTS)
def test_checkpoint_is_a_bf16_qwen2(name: str) -> None:
    directory = toy_checkpoint(name)
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["dtype"] == "bfloat16"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    with safe_open(directory / "model.safetensors", framework="pt") as weights:
        assert {weights.get_slice(key).get_dtype() for key in weights.keys()} == {"BF16"}  # noqa: SIM118
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == special_token_ids()["eos"]
    model = load(name)
    assert isinstance(model, Qwen2ForCausalLM)
    assert config["max_position_embeddings"] >= 2 * 90  # the longest toy sequence is under 90 tokens


def test_checkpoints_differ() -> None:
    primary, later = load("primary").state_dict(), load("later").state_dict()
    assert primary.keys() == later.keys()
    assert any(not torch.equal(primary[key], later[key]) for key in primary)
    assert greedy("primary", GREEDY_ITEMS) != greedy("later", GREEDY_ITEMS)


@pytest.mark.parametrize("name", TOY_CHECKPOINTS)
def test_greedy_fp32_mostly_correct(name: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(toy_checkpoint(name))
    items = toy_items(GREEDY_ITEMS, HELDOUT_SEED, tokenizer)
    outputs = greedy(name, GREEDY_ITEMS)
    assert sum(TOY_MARKER in text for text in outputs) >= GREEDY_ITEMS - 1
    assert (
        sum(toy_scorer(text, item.answer) for text, item in zip(outputs, items, strict=True)) >= MIN_CORRECT
    )


def test_training_is_deterministic_and_saves_loadable_checkpoints(tmp_path: Path) -> None:
    """Two tiny runs with one seed and thread count give bit-identical weights; the caller's RNG is untouched."""
    tiny = dict(steps=4, batch_size=4, warmup_steps=1, layers=1, hidden=32, heads=2, kv_heads=1)
    tiny |= dict(intermediate=64, eval_items=0, log_every=1000, primary_fraction=0.5)
    state = torch.random.get_rng_state()
    python_state = random.getstate()
    first = train(TrainConfig(out=tmp_path / "a", **tiny))  # type: ignore[arg-type]
    second = train(TrainConfig(out=tmp_path / "b", **tiny))  # type: ignore[arg-type]
    assert torch.equal(torch.random.get_rng_state(), state)
    assert random.getstate() == python_state
    for name in TOY_CHECKPOINTS:
        a = (first.checkpoints[name] / "model.safetensors").read_bytes()
        b = (second.checkpoints[name] / "model.safetensors").read_bytes()
        assert a == b
    assert (first.checkpoints["primary"] / "model.safetensors").read_bytes() != (
        first.checkpoints["later"] / "model.safetensors"
    ).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(first.checkpoints["later"])
    assert isinstance(model, Qwen2ForCausalLM)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert (
        AutoTokenizer.from_pretrained(first.checkpoints["later"]).eos_token_id == special_token_ids()["eos"]
    )
