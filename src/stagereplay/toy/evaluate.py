"""Measure the model card's figures: greedy accuracy and boundary-reached rate on the held-out set.

    python -m stagereplay.toy.evaluate [--n 200] [--threads 1] [--root DIR]

Each checkpoint is loaded with `AutoModelForCausalLM.from_pretrained` at each precision (bf16 as stored;
fp32 as an exact upcast of the stored weights) and decoded with `model.generate(do_sample=False)`, one
item at a time (batch size 1, no padding), as the experiments decode.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stagereplay.tasks.base import Item
from stagereplay.tasks.toy import HELDOUT_SEED, TOY_MARKER, toy_items, toy_scorer
from stagereplay.toy import TOY_CHECKPOINTS, toy_checkpoint

PRECISIONS = ("fp32", "bf16")
MAX_NEW_TOKENS = 128
"""The longest completion is under 80 tokens; the slack lets a wandering output show as wrong."""
NEAR_TIE = 0.1
"""A greedy step is near-tied when its top-1 and top-2 logits differ by less than this."""


@dataclass(frozen=True)
class Measurement:
    checkpoint: str
    precision: str
    outputs: tuple[str, ...]
    steps: int
    """Greedy decode steps, all items together."""
    near_ties: int
    """Steps whose top-2 logit gap is under `NEAR_TIE`: the free choices among the remaining numbers."""
    correct: int
    reached_boundary: int
    wall_s: float


def greedy_outputs(
    directory: Path, precision: str, items: Sequence[Item]
) -> tuple[tuple[str, ...], list[float]]:
    """Greedy completions (decoded, special tokens dropped) of `items` at `precision`, and the top-1 minus
    top-2 logit gap at every decode step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    outputs, gaps = [], []
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
            generated = out.sequences[0, prompt.shape[1] :].tolist()
            outputs.append(str(tokenizer.decode(generated, skip_special_tokens=True)))
            for logits in out.logits:  # one (1, vocab) tensor per decode step
                top = logits[0].float().topk(2).values
                gaps.append(float(top[0] - top[1]))
    return tuple(outputs), gaps


def measure(directory: Path, name: str, precision: str, items: Sequence[Item]) -> Measurement:
    start = time.perf_counter()
    outputs, gaps = greedy_outputs(directory, precision, items)
    return Measurement(
        checkpoint=name,
        precision=precision,
        outputs=outputs,
        steps=len(gaps),
        near_ties=sum(gap < NEAR_TIE for gap in gaps),
        correct=sum(toy_scorer(text, item.answer) for text, item in zip(outputs, items, strict=True)),
        reached_boundary=sum(TOY_MARKER in text for text in outputs),
        wall_s=time.perf_counter() - start,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="Held-out items.")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (decoding this model is latency-bound).",
    )
    parser.add_argument("--root", type=Path, default=None, help="Folder holding primary/ and later/.")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    directories = {
        name: (args.root / name if args.root else toy_checkpoint(name)) for name in TOY_CHECKPOINTS
    }
    tokenizer = AutoTokenizer.from_pretrained(directories["primary"])
    items = toy_items(args.n, HELDOUT_SEED, tokenizer)
    print(
        f"held-out items: {len(items)} (seed {HELDOUT_SEED}), greedy, batch size 1, threads: {args.threads}"
    )
    header = f"{'checkpoint':<10} {'precision':<9} {'accuracy':>14} {'boundary':>14}"
    print(f"{header} {f'gap<{NEAR_TIE} steps':>17} {'wall_s':>7}")
    results = {}
    for name, directory in directories.items():
        for precision in PRECISIONS:
            m = measure(directory, name, precision, items)
            results[name, precision] = m
            acc = f"{m.correct}/{len(items)} {100 * m.correct / len(items):5.1f}%"
            reached = f"{m.reached_boundary}/{len(items)} {100 * m.reached_boundary / len(items):5.1f}%"
            ties = f"{m.near_ties}/{m.steps}"
            print(f"{name:<10} {precision:<9} {acc:>14} {reached:>14} {ties:>17} {m.wall_s:7.1f}", flush=True)
    for precision in PRECISIONS:
        first, second = (results[name, precision].outputs for name in TOY_CHECKPOINTS)
        differ = sum(a != b for a, b in zip(first, second, strict=True))
        print(f"{precision}: primary and later outputs differ on {differ}/{len(items)} items")
    example = results["primary", "fp32"]
    print(f"example ({items[0].id}): {items[0].prompt_text!r} -> {example.outputs[0]!r}")


if __name__ == "__main__":
    main()
