"""The embedded toy: task generator, tokenizer and chat template, the two packaged checkpoints, the recipe."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import random
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from stagereplay.tasks.base import last_number
from stagereplay.tasks.jsonl import parse_row, tokenize_row
from stagereplay.tasks.scoring import scorer_by_name
from stagereplay.tasks.toy import (
    ANSWER_PREFIX,
    CONNECTIVES,
    HELDOUT_EXCLUDED,
    HELDOUT_SEED,
    LABELS,
    TOY_MARKER,
    TOY_SCORER_NAME,
    TRAIN_SEED,
    ToyExample,
    heldout_questions,
    toy_examples,
    toy_items,
    toy_rows,
    toy_scorer,
    training_stream,
)
from stagereplay.toy import TOY_CHECKPOINTS, toy_checkpoint
from stagereplay.toy.evaluate import choice_points
from stagereplay.toy.tokenizer import (
    ADDED_TOKENS,
    THINK_TOKENS,
    build_tokenizer,
    render_prompt,
    save_tokenizer,
    special_token_ids,
)
from stagereplay.toy.train import VALIDATION_SEED, TrainConfig, train

GREEDY_ITEMS = 40
"""Held-out items decoded per checkpoint here; the card's 200-item figures come from `stagereplay.toy.evaluate`."""
STEP = re.compile(r"([a-h]):(\d+)\+(\d+)=(\d+)")


def parse_stage(example: ToyExample, text: str) -> tuple[list[str], list[int]]:
    """Labels in the order a stage adds them, and its running sums; checks each step's form on the way."""
    first, *rest = re.split("[" + re.escape("".join(CONNECTIVES)) + "]", text)
    label, value = first.split("=")
    labels, sums = [label], [int(value)]
    assert int(value) == example.terms[LABELS.index(label)]
    for step in rest:
        match = STEP.fullmatch(step)
        assert match is not None, step
        label, running, term, _ = match.groups()
        assert int(running) == sums[-1]  # each step continues from the previous running sum
        assert int(term) == example.terms[LABELS.index(label)]  # and adds the labelled term
        labels.append(label)
        sums.append(int(match.group(4)))
    return labels, sums


def split_completion(completion: str) -> tuple[str, str, str]:
    think, after = completion.split(f"\n{TOY_MARKER}\n\n")
    answer_section, answer = after.split(f"\n{ANSWER_PREFIX}")
    return think, answer_section, answer


def test_examples_are_deterministic_per_seed_and_valid() -> None:
    first, again, other = toy_examples(300, 11), toy_examples(300, 11), toy_examples(300, 12)
    assert first == again
    assert first != other
    assert toy_examples(50, 11) == first[:50]  # a prefix of the stream, whatever n
    slipped = 0
    for example in first:
        think, answer_section, answer = split_completion(example.completion)
        assert answer == example.answer == str(sum(example.terms))
        labels = LABELS[: len(example.terms)]
        for text in (think, answer_section):
            order, sums = parse_stage(example, text)
            assert sorted(order) == list(labels)  # every term exactly once
        order, sums = parse_stage(example, answer_section)
        added = [example.terms[LABELS.index(label)] for label in order]
        assert sums == [sum(added[: i + 1]) for i in range(len(added))]  # the answer section never slips
        slipped += parse_stage(example, think)[1][-1] != sum(example.terms)
        assert last_number(example.completion, example.answer)
    assert 0.15 * len(first) < slipped < 0.45 * len(first)  # some think blocks slip, so copying them fails


def test_choices_are_uniform_single_tokens() -> None:
    """The next label and the connective are drawn uniformly: the equal-probability near-ties the task needs."""
    examples = toy_examples(3000, 11)
    first_labels = Counter(e.answer_route.order[0] for e in examples if len(e.terms) == 6)
    assert len(first_labels) == 6 and max(first_labels.values()) < 1.3 * min(first_labels.values())
    joins = Counter(j for e in examples for j in e.answer_route.joins)
    assert set(joins) == set(CONNECTIVES) and max(joins.values()) < 1.1 * min(joins.values())
    assert sum(e.think.order != e.answer_route.order for e in examples) > 0.99 * len(examples)
    tokenizer = build_tokenizer()
    for token in (*LABELS, *CONNECTIVES):
        assert len(tokenizer.encode(token, add_special_tokens=False).ids) == 1


def test_answer_section_is_40_to_200_tokens() -> None:
    tokenizer = build_tokenizer()
    lengths = [
        len(tokenizer.encode(e.completion.split(TOY_MARKER)[1], add_special_tokens=False).ids) + 1  # + EOS
        for e in toy_examples(2000, 11)
    ]
    assert min(lengths) >= 40 and max(lengths) <= 200


def test_heldout_is_disjoint_from_training() -> None:
    assert HELDOUT_SEED not in (TRAIN_SEED, VALIDATION_SEED)
    excluded = heldout_questions()
    assert len(excluded) > 0.9 * HELDOUT_EXCLUDED
    stream = training_stream(TRAIN_SEED)
    assert not any(next(stream).question in excluded for _ in range(5000))
    with pytest.raises(ValueError):
        next(training_stream(HELDOUT_SEED))
    with pytest.raises(ValueError):
        TrainConfig(out=Path("unused"), seed=HELDOUT_SEED)


def test_scorer_reads_the_answer_line() -> None:
    assert scorer_by_name(TOY_SCORER_NAME) is toy_scorer
    text = "a=31;b:31+46=77\n</think>\n\nb=46,a:46+31=77\nAnswer: 77"
    assert toy_scorer(text, "77")
    assert not toy_scorer(text.replace("Answer: 77", "Answer: 78"), "77")


@pytest.mark.parametrize("loaded", ["saved", "packaged"])
def test_tokenizer_and_chat_template(tmp_path: Path, loaded: str) -> None:
    if loaded == "saved":
        save_tokenizer(tmp_path)
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        directory = tmp_path
    else:
        directory = toy_checkpoint("primary")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    raw = build_tokenizer()
    ids = special_token_ids()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        ids["bos"], ids["eos"], ids["pad"],
    )
    for token in ADDED_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    for example in toy_examples(20, 5):
        prompt = tokenizer.apply_chat_template(example.messages, add_generation_prompt=True, tokenize=False)
        assert prompt == render_prompt(example.messages)  # what training encodes
        assert prompt.endswith("<|assistant|><think>\n")
        text = prompt + example.completion
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert encoded == raw.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(encoded, skip_special_tokens=False) == text  # lossless: retokenized round-trips
        kept = tokenizer.decode(encoded, skip_special_tokens=True)
        assert all(token in kept for token in THINK_TOKENS) and "<|user|>" not in kept
    for text in ["Q:1+2=?\n", "any text: é ✓\t\r\n  end"]:
        encoded = tokenizer(text)["input_ids"]
        assert encoded[0] == ids["bos"] and len(encoded) == 1 + len(text.encode())  # one token per byte


def test_toy_items_are_messages_rows_through_the_chat_template() -> None:
    tokenizer = AutoTokenizer.from_pretrained(toy_checkpoint("primary"))
    rows = toy_rows(5, HELDOUT_SEED)
    items = toy_items(5, HELDOUT_SEED, tokenizer)
    assert [item.id for item in items] == [f"toy-{HELDOUT_SEED}-{i:04d}" for i in range(5)]
    for index, (item, row, example) in enumerate(zip(items, rows, toy_examples(5, HELDOUT_SEED), strict=True)):
        assert item == tokenize_row(parse_row(json.loads(json.dumps(row)), index, "test"), tokenizer)
        assert item.prompt_ids == tuple(tokenizer.encode(render_prompt(example.messages), add_special_tokens=False))
        assert item.answer == example.answer


def test_choice_points_are_found_in_both_stages() -> None:
    example = toy_examples(1, 3)[0]
    think, answer_section = example.completion.split(TOY_MARKER)
    pieces = [*think, TOY_MARKER, *answer_section]
    points = choice_points(pieces, [0.0] * len(pieces), LABELS[: len(example.terms)])
    n = len(example.terms)
    for stage in (1, 2):
        labels = [p for p in points if p.stage == stage and p.kind == "label"]
        connectives = [p for p in points if p.stage == stage and p.kind == "connective"]
        assert [p.options for p in labels] == list(range(n, 1, -1))  # the last label is forced
        assert len(connectives) == n - 1 and {p.options for p in connectives} == {len(CONNECTIVES)}


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
    """Greedy fp32 completions of the first `n` held-out items, batch size 1, think tokens kept."""
    model = load(name)
    tokenizer = AutoTokenizer.from_pretrained(toy_checkpoint(name))
    outputs = []
    with torch.no_grad(), one_thread():
        for item in toy_items(n, HELDOUT_SEED, tokenizer):
            prompt = torch.tensor([item.prompt_ids])
            out = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=320
            )
            outputs.append(tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True))
    return tuple(outputs)


def test_checkpoints_are_small_bf16_qwen2() -> None:
    total = 0
    for name in TOY_CHECKPOINTS:
        directory = toy_checkpoint(name)
        config = json.loads((directory / "config.json").read_text())
        assert config["model_type"] == "qwen2"
        assert config["dtype"] == "bfloat16"
        assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
        with safe_open(directory / "model.safetensors", framework="pt") as weights:
            assert {weights.get_slice(key).get_dtype() for key in weights.keys()} == {"BF16"}  # noqa: SIM118
        generation = json.loads((directory / "generation_config.json").read_text())
        assert generation["eos_token_id"] == special_token_ids()["eos"]
        assert isinstance(load(name), Qwen2ForCausalLM)
        # room for a 64-token prompt, a 256-token think block and the default 128-token suffix budget
        assert config["max_position_embeddings"] >= 64 + 256 + 128
        total += (directory / "model.safetensors").stat().st_size
    assert total <= 20_000_000


@pytest.mark.slow  # 80 greedy decodes of the toy with generate(): the slow tier
def test_checkpoints_differ() -> None:
    primary, later = load("primary").state_dict(), load("later").state_dict()
    assert primary.keys() == later.keys()
    assert any(not torch.equal(primary[key], later[key]) for key in primary)
    assert greedy("primary", GREEDY_ITEMS) != greedy("later", GREEDY_ITEMS)


@pytest.mark.slow  # shares test_checkpoints_differ's 80 greedy decodes: the slow tier
@pytest.mark.parametrize("name", TOY_CHECKPOINTS)
def test_greedy_fp32_reaches_the_boundary_and_is_often_right(name: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(toy_checkpoint(name))
    items = toy_items(GREEDY_ITEMS, HELDOUT_SEED, tokenizer)
    outputs = greedy(name, GREEDY_ITEMS)
    assert sum(TOY_MARKER in text for text in outputs) >= GREEDY_ITEMS - 1
    correct = sum(toy_scorer(text, item.answer) for text, item in zip(outputs, items, strict=True))
    assert correct >= GREEDY_ITEMS // 2  # the card measures 55-90% for the primary on 200 items
    if name == "primary":
        assert correct < GREEDY_ITEMS  # imperfect on purpose: errors let two trajectories end differently


def test_training_is_deterministic_and_saves_loadable_checkpoints(tmp_path: Path) -> None:
    """Two tiny runs with one seed and thread count give bit-identical weights; the caller's RNG is untouched."""
    tiny = dict(steps=4, batch_size=4, warmup_steps=1, layers=1, hidden=32, heads=2, kv_heads=1)
    tiny |= dict(intermediate=64, eval_items=0, log_every=1000, primary_step=2, threads=1)
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
    tokenizer = AutoTokenizer.from_pretrained(first.checkpoints["later"])
    assert tokenizer.eos_token_id == special_token_ids()["eos"]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Add a=1, b=2."}],
                                         add_generation_prompt=True, tokenize=False).endswith("<think>\n")


def _item_records(run: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("item_id", "payload")} for r in records if r["kind"] == "item"]


def test_default_run_takes_a_reasoning_models_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no arguments `matched` runs the toy as a user's R1 model runs: `messages` rows through the chat
    template, `</think>` defaulted from the tokenizer, the `last-number` scorer and the generic stage-1
    budget; and `--data` of the file `stagereplay toy items` writes is the same run, with the same data hash."""
    from typer.testing import CliRunner

    from stagereplay.cli import app

    runner = CliRunner()
    common = ["--n", "2", "--workers", "1", "--quiet"]
    default = runner.invoke(app, ["matched", *common, "--out", str(tmp_path / "default")])
    assert default.exit_code == 0, default.output
    config = json.loads((tmp_path / "default" / "manifest.json").read_text())["config"]
    stage1 = config["stage1"]
    assert (stage1["rule"], stage1["rule_source"], stage1["match"]) == (f"marker:{TOY_MARKER}", "default", "token")
    assert stage1["budget_source"] == "default"
    assert stage1["budget"] == stage1["context"] - stage1["longest_prompt"] - stage1["suffix_budget"]
    assert config["settings"]["scorer"] == "last-number"

    items = tmp_path / "items.jsonl"
    written = runner.invoke(app, ["toy", "items", "--n", "2", "--out", str(items)])
    assert written.exit_code == 0, written.output
    again = runner.invoke(app, ["toy", "items", "--n", "2", "--out", str(items)])
    assert again.exit_code != 0 and "already exists" in again.output
    from_file = runner.invoke(app, ["matched", "--data", str(items), *common, "--out", str(tmp_path / "file")])
    assert from_file.exit_code == 0, from_file.output
    file_config = json.loads((tmp_path / "file" / "manifest.json").read_text())["config"]
    assert file_config["dataset_hash"] == config["dataset_hash"]
    assert file_config["stage1"] == stage1 and file_config["settings"] == config["settings"]
    assert _item_records(tmp_path / "file") == _item_records(tmp_path / "default")

    # Without a model, the audit checks the toy's items by the same hash: other rows are another dataset.
    from stagereplay.audit.verify import dataset_findings
    from stagereplay.records.ledger import read_manifest
    from stagereplay.tasks import toy

    manifest = read_manifest(tmp_path / "default")
    assert dataset_findings(manifest) == []
    real = toy.toy_jsonl
    monkeypatch.setattr(toy, "toy_jsonl", lambda n, seed: real(n, seed + 1))
    assert [f.what for f in dataset_findings(manifest) if "dataset_hash differs" in f.what]
