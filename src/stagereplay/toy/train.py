"""Train the embedded toy reasoning model on CPU and save its two checkpoints.

    python -m stagereplay.toy.train --out DIR [--steps N] [--seed S] [--threads T]

A small Qwen2 (GQA, RoPE, RMSNorm, tied embeddings, as in Qwen2.5) learns the toy task of
`stagereplay.tasks.toy` from an endless seeded stream: each example is the chat template's prompt for the
question, then the think block, `</think>`, the answer section and EOS, with the loss on the written part
only (the prompt's numbers are random, so predicting them teaches nothing). AdamW with linear warmup and
cosine decay. `DIR/primary` is saved at step `primary_step`, while the model is still imperfect on purpose
(its errors are what lets two continuations of one prefix end in different answers), and `DIR/later` at
the end: two points of one trajectory, each stored in bf16 so that loading it in fp32 is an exact upcast.
`--snapshot-every N` also saves `DIR/snapshots/step-XXXXX` every N steps, to choose `primary_step` by.

The run is deterministic for a given seed and thread count: the data come from `random.Random(seed)`,
initialisation runs under a forked, seeded torch RNG (the caller's global RNG is untouched), the model has
no dropout, and deterministic algorithms are on.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from stagereplay.tasks.toy import HELDOUT_SEED, TRAIN_SEED, ToyExample, toy_examples, training_stream
from stagereplay.toy.tokenizer import (
    build_tokenizer,
    render_prompt,
    save_tokenizer,
    special_token_ids,
    vocabulary,
)

VALIDATION_SEED = 7
"""Seed of the small set logged during training: neither the training nor the held-out seed."""
IGNORE = -100
"""Label value that `torch.nn.functional.cross_entropy` skips."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (with the thread count, it fixes the weights)."""

    out: Path = field(metadata={"help": "Directory that receives primary/ and later/."})
    steps: int = field(default=900, metadata={"help": "Optimizer steps; the later checkpoint is the last."})
    schedule_steps: int = field(
        default=2500, metadata={"help": "Length of the warmup + cosine schedule (0: steps); may exceed steps."}
    )
    seed: int = field(default=TRAIN_SEED, metadata={"help": "Seed of the data stream and the init."})
    threads: int = field(default=2, metadata={"help": "torch intra-op threads (part of determinism)."})
    batch_size: int = field(default=64, metadata={"help": "Sequences per step."})
    lr: float = field(default=2e-3, metadata={"help": "Peak AdamW learning rate."})
    min_lr_ratio: float = field(default=0.05, metadata={"help": "Cosine floor, as a fraction of lr."})
    warmup_steps: int = field(default=150, metadata={"help": "Linear warmup steps."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW decay on weight matrices."})
    grad_clip: float = field(default=1.0, metadata={"help": "Global gradient-norm clip."})
    primary_step: int = field(default=800, metadata={"help": "Step at which the primary checkpoint is saved."})
    snapshot_every: int = field(default=0, metadata={"help": "Also save snapshots/step-N every N steps (0: none)."})
    layers: int = field(default=4, metadata={"help": "Decoder layers."})
    hidden: int = field(default=192, metadata={"help": "Hidden size."})
    heads: int = field(default=4, metadata={"help": "Query heads."})
    kv_heads: int = field(default=2, metadata={"help": "Key/value heads (GQA)."})
    intermediate: int = field(default=512, metadata={"help": "SwiGLU MLP width."})
    max_positions: int = field(default=512, metadata={"help": "RoPE positions (training sequences are under 300 tokens)."})
    log_every: int = field(default=50, metadata={"help": "Steps between log lines."})
    eval_every: int = field(default=100, metadata={"help": "Steps between validation accuracy checks."})
    eval_items: int = field(default=50, metadata={"help": "Validation items per check (0: none)."})

    def __post_init__(self) -> None:
        if self.seed == HELDOUT_SEED:
            raise ValueError("the training seed must differ from the held-out seed")
        if not 0 < self.primary_step < self.steps:
            raise ValueError("primary_step must lie strictly between 0 and steps")
        if self.schedule_steps and self.schedule_steps < self.steps:
            raise ValueError("schedule_steps must be 0 or at least steps")

    @property
    def horizon(self) -> int:
        """The step at which the cosine decay reaches its floor."""
        return self.schedule_steps or self.steps


@dataclass(frozen=True)
class TrainResult:
    checkpoints: dict[str, Path]
    wall_s: float
    log: list[dict[str, float]]


def model_config(config: TrainConfig) -> Any:
    from transformers import Qwen2Config

    ids = special_token_ids()
    return Qwen2Config(
        vocab_size=len(vocabulary()),
        hidden_size=config.hidden,
        intermediate_size=config.intermediate,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )


def encode_batch(examples: Sequence[ToyExample], tokenizer: Any) -> tuple[Any, Any]:
    """Right-padded `input_ids` and `labels`, both (B, T); labels are IGNORE on the prompt and padding.

    Right padding needs no attention mask: under the causal mask no real token sees a pad after it.
    """
    import torch

    ids = special_token_ids()
    rows, prompt_lengths = [], []
    for example in examples:
        prompt = tokenizer.encode(render_prompt(example.messages), add_special_tokens=False).ids
        completion = tokenizer.encode(example.completion, add_special_tokens=False).ids
        rows.append([*prompt, *completion, ids["eos"]])
        prompt_lengths.append(len(prompt))
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), ids["pad"], dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (row, start) in enumerate(zip(rows, prompt_lengths, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, start : len(row)] = torch.tensor(row[start:])
    return input_ids, labels


def batches(config: TrainConfig, tokenizer: Any) -> Iterator[tuple[Any, Any]]:
    stream = training_stream(config.seed)
    while True:
        yield encode_batch([next(stream) for _ in range(config.batch_size)], tokenizer)


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at `config.horizon`."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.horizon - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def validation_accuracy(model: Any, examples: Sequence[ToyExample], tokenizer: Any) -> float:
    """Greedy accuracy on `examples`, batched with left padding (a training-time gauge, not the card)."""
    import torch

    from stagereplay.tasks.toy import toy_scorer

    ids = special_token_ids()
    prompts = [tokenizer.encode(render_prompt(e.messages), add_special_tokens=False).ids for e in examples]
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), ids["pad"], dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(prompts):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=320)
    model.train(was_training)
    texts = [tokenizer.decode(row[width:].tolist(), skip_special_tokens=True) for row in out]
    return sum(toy_scorer(t, e.answer) for t, e in zip(texts, examples, strict=True)) / len(examples)


@contextmanager
def torch_settings(threads: int) -> Iterator[None]:
    """Fix the thread count and turn deterministic algorithms on, restoring both afterwards."""
    import torch

    old_threads, old_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_deterministic)


def save_checkpoint(model: Any, directory: Path, config: TrainConfig, step: int) -> None:
    """Write a bf16 copy of `model`, its generation config, the tokenizer and the training recipe."""
    import copy

    import torch
    from transformers import GenerationConfig

    ids = special_token_ids()
    half = copy.deepcopy(model).to(torch.bfloat16)
    half.config.dtype = torch.bfloat16
    half.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], do_sample=False
    )
    half.save_pretrained(directory)
    save_tokenizer(directory)
    recipe = {"step": step, **{k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()}}
    recipe["out"] = None  # where it was written says nothing about the weights
    (directory / "training.json").write_text(json.dumps(recipe, indent=2) + "\n")


def train(config: TrainConfig) -> TrainResult:
    """Run the training described by `config`; return the checkpoint paths and the log."""
    import torch
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    validation = toy_examples(config.eval_items, VALIDATION_SEED)
    checkpoints = {"primary": config.out / "primary", "later": config.out / "later"}
    log: list[dict[str, float]] = []
    start = time.perf_counter()
    with torch_settings(config.threads):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)  # only the init draws from it; the fork restores the caller's RNG
            model = Qwen2ForCausalLM._from_config(model_config(config), attn_implementation="sdpa")
        model.train()
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=config.lr,
            betas=(0.9, 0.98),
            eps=1e-8,
        )
        data = batches(config, tokenizer)
        running, counted = 0.0, 0
        for step in range(config.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, config)
            input_ids, labels = next(data)
            loss = model(input_ids=input_ids, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            running, counted = running + loss.item(), counted + 1
            done = step + 1
            if done % config.log_every == 0 or done == config.steps:
                entry = {"step": done, "loss": running / counted, "lr": learning_rate(step, config)}
                running, counted = 0.0, 0
                if config.eval_items and (done % config.eval_every == 0 or done == config.steps):
                    entry["val_acc"] = validation_accuracy(model, validation, tokenizer)
                entry["wall_s"] = time.perf_counter() - start
                log.append(entry)
                print(json.dumps(entry), flush=True)
            if done == config.primary_step:
                save_checkpoint(model, checkpoints["primary"], config, done)
            if config.snapshot_every and done % config.snapshot_every == 0:
                save_checkpoint(model, config.out / "snapshots" / f"step-{done:05d}", config, done)
        save_checkpoint(model, checkpoints["later"], config, config.steps)
    return TrainResult(checkpoints=checkpoints, wall_s=time.perf_counter() - start, log=log)


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for item in fields(TrainConfig):
        flag = "--" + item.name.replace("_", "-")
        kind = Path if item.name == "out" else type(item.default)
        if item.name == "out":
            parser.add_argument(flag, type=Path, required=True, help=item.metadata["help"])
        else:
            parser.add_argument(flag, type=kind, default=item.default, help=item.metadata["help"])
    return TrainConfig(**vars(parser.parse_args(argv)))


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    result = train(config)
    print(
        json.dumps({"wall_s": round(result.wall_s, 1), **{k: str(v) for k, v in result.checkpoints.items()}})
    )


if __name__ == "__main__":
    main()
