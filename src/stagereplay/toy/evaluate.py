"""Measure the model card's figures: greedy accuracy, boundary reached, and the near-ties at choice points.

    python -m stagereplay.toy.evaluate [--n 200] [--threads 1] [--root DIR] [--write-items FILE]

Each checkpoint is loaded with `AutoModelForCausalLM.from_pretrained` at each precision (bf16 as stored;
fp32 as an exact upcast of the stored weights) and decoded with `model.generate(do_sample=False)`, one
item at a time (batch size 1, no padding), as the experiments decode. Items are the held-out `messages`
rows, rendered by the checkpoint's chat template.

A **choice point** is a greedy step where the training data hold several single-token continuations of
equal probability (`stagereplay.tasks.toy`): the label of the next term (every unused label) and the
connective between steps (four). At each one the top-1 minus top-2 logit gap is recorded; a gap under
`NEAR_TIE` is a near-tie, small enough for bf16 rounding to break either way. `--write-items` also writes
the rows as JSONL (as `stagereplay toy items` does), for `stagereplay matched --data FILE`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagereplay.tasks.base import Item
from stagereplay.tasks.toy import (
    CONNECTIVES,
    HELDOUT_SEED,
    LABELS,
    TOY_MARKER,
    toy_items,
    toy_jsonl,
    toy_scorer,
)
from stagereplay.toy import TOY_CHECKPOINTS, toy_checkpoint

PRECISIONS = ("fp32", "bf16")
MAX_NEW_TOKENS = 320
"""Outputs run to about 220 tokens at most; the slack lets a wandering output show as wrong."""
NEAR_TIE = 0.1
"""A choice point is near-tied when its top-1 and top-2 logits differ by less than this (nats)."""


@dataclass(frozen=True)
class ChoicePoint:
    stage: int
    """1: the think block; 2: the answer section."""
    kind: str
    """`label` or `connective`."""
    options: int
    """How many continuations the training data make equally likely here."""
    gap: float
    """Top-1 minus top-2 logit at this step."""


def choice_points(pieces: Sequence[str], gaps: Sequence[float], labels: str) -> list[ChoicePoint]:
    """The choice points of one greedy output, given each step's decoded token and logit gap.

    `labels` are the question's labels. A label step is the first token of a stage or the token after a
    connective, with at least two labels unused in that stage; a connective step is a connective token
    between steps of a stage.
    """
    points: list[ChoicePoint] = []
    used: set[str] = set()
    stage, previous = 1, "\n"  # the prompt ends with `<think>\n`: stage 1 starts at step 0
    start_of_stage = True
    for piece, gap in zip(pieces, gaps, strict=True):
        if piece == TOY_MARKER:
            stage, used, start_of_stage = 2, set(), False
            previous = piece
            continue
        if stage == 2 and previous == "\n" and not used and piece != "\n":
            start_of_stage = True
        at_label = start_of_stage or previous in CONNECTIVES
        if at_label and piece in labels:
            remaining = len(set(labels) - used)
            if remaining >= 2:
                points.append(ChoicePoint(stage, "label", remaining, gap))
            used.add(piece)
            start_of_stage = False
        elif piece in CONNECTIVES and used and previous.isdigit():
            points.append(ChoicePoint(stage, "connective", len(CONNECTIVES), gap))
        previous = piece
    return points


@dataclass(frozen=True)
class Measurement:
    checkpoint: str
    precision: str
    outputs: tuple[str, ...]
    correct: int
    reached_boundary: int
    answer_tokens: tuple[int, ...]
    """Tokens after the boundary marker, per item that reached it."""
    points: tuple[ChoicePoint, ...]
    wall_s: float

    def near_ties(self, stage: int) -> tuple[int, int, float]:
        """(near-ties, choice points, median gap) in `stage`."""
        gaps = [p.gap for p in self.points if p.stage == stage]
        return sum(g < NEAR_TIE for g in gaps), len(gaps), statistics.median(gaps) if gaps else float("nan")


def greedy_outputs(
    directory: Path, precision: str, items: Sequence[Item]
) -> tuple[list[list[int]], list[list[float]], Any]:
    """Greedy token ids of `items` at `precision` and the top-1 minus top-2 logit gap at every step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    generated, gaps = [], []
    with torch.no_grad():
        for item in items:
            prompt = torch.tensor([item.prompt_ids])  # (1, T)
            out = model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
            )
            generated.append(out.sequences[0, prompt.shape[1] :].tolist())
            item_gaps = []
            for logits in out.logits:  # one (1, vocab) tensor per decode step
                top = logits[0].float().topk(2).values
                item_gaps.append(float(top[0] - top[1]))
            gaps.append(item_gaps)
    return generated, gaps, tokenizer


def measure(directory: Path, name: str, precision: str, items: Sequence[Item]) -> Measurement:
    start = time.perf_counter()
    generated, gaps, tokenizer = greedy_outputs(directory, precision, items)
    marker_id = tokenizer.convert_tokens_to_ids(TOY_MARKER)
    outputs, points, answer_tokens = [], [], []
    for ids, item_gaps, item in zip(generated, gaps, items, strict=True):
        outputs.append(str(tokenizer.decode(ids, skip_special_tokens=True)))
        pieces = [str(tokenizer.decode([t])) for t in ids]
        question = item.prompt_text
        labels = "".join(label for label in LABELS if f"{label}=" in question)
        points += choice_points(pieces, item_gaps, labels)
        if marker_id in ids:
            answer_tokens.append(len(ids) - ids.index(marker_id) - 1)
    return Measurement(
        checkpoint=name,
        precision=precision,
        outputs=tuple(outputs),
        correct=sum(toy_scorer(text, item.answer) for text, item in zip(outputs, items, strict=True)),
        reached_boundary=len(answer_tokens),
        answer_tokens=tuple(answer_tokens),
        points=tuple(points),
        wall_s=time.perf_counter() - start,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="Held-out items.")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (decoding this model is latency-bound)."
    )
    parser.add_argument("--root", type=Path, default=None, help="Folder holding primary/ and later/.")
    parser.add_argument("--write-items", type=Path, default=None, help="Also write the rows as JSONL here.")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    if args.write_items:
        args.write_items.write_text(toy_jsonl(args.n, HELDOUT_SEED))
    directories = {name: (args.root / name if args.root else toy_checkpoint(name)) for name in TOY_CHECKPOINTS}
    tokenizer = AutoTokenizer.from_pretrained(directories["primary"])
    items = toy_items(args.n, HELDOUT_SEED, tokenizer)
    print(f"held-out items: {len(items)} (seed {HELDOUT_SEED}), greedy, batch size 1, threads: {args.threads}")
    print(
        f"{'checkpoint':<10} {'precision':<9} {'accuracy':>14} {'boundary':>14} {'answer tokens':>13} "
        f"{'think ties':>16} {'answer ties':>16} {'median gap':>10} {'wall_s':>7}"
    )
    results = {}
    for name, directory in directories.items():
        for precision in PRECISIONS:
            m = measure(directory, name, precision, items)
            results[name, precision] = m
            n = len(items)
            acc = f"{m.correct}/{n} {100 * m.correct / n:5.1f}%"
            reached = f"{m.reached_boundary}/{n} {100 * m.reached_boundary / n:5.1f}%"
            lengths = f"{min(m.answer_tokens, default=0)}-{max(m.answer_tokens, default=0)}"
            (t1, c1, _), (t2, c2, median2) = m.near_ties(1), m.near_ties(2)
            print(
                f"{name:<10} {precision:<9} {acc:>14} {reached:>14} {lengths:>13} {f'{t1}/{c1}':>16} "
                f"{f'{t2}/{c2}':>16} {median2:10.3f} {m.wall_s:7.1f}",
                flush=True,
            )
    for precision in PRECISIONS:
        first, second = (results[name, precision].outputs for name in TOY_CHECKPOINTS)
        differ = sum(a != b for a, b in zip(first, second, strict=True))
        print(f"{precision}: primary and later outputs differ on {differ}/{len(items)} items")
    example = results["primary", "bf16"]
    print(f"example ({items[0].id}): {items[0].prompt_text!r} -> {example.outputs[0]!r}")


if __name__ == "__main__":
    main()
