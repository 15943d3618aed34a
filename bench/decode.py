"""Decode speed at batch size 1, greedy: stagereplay's live loop vs `model.generate()` vs a bare forward loop.

    python bench/decode.py [--models toy,50m] [--model DIR] [--tokens 64] [--prompts 4] [--threads 1]
                           [--precision bf16] [--device cpu|cuda] [--repeats 5] [--json OUT]

Three ways to emit the same tokens from the same prompts, timed in one process:

- `ours`: `LM.generate`, the live loop of `stagereplay.engine.decode` (Stepper + decode) that every experiment uses,
  its single-token steps captured by `torch.compile(backend="eager")`;
- `eager`: the same loop with capture off, every step through the model's Python forward;
- `generate`: `model.generate(do_sample=False, max_new_tokens=N)`;
- `floor`: `model(input_ids, cache, use_cache=True, logits_to_keep=1)` + argmax on a DynamicCache, nothing
  else: what the forwards alone cost.

The loop and generate() stop at EOS or after N tokens, as in use; the script asserts that they emit the
same tokens, and the floor then makes exactly as many forwards per prompt. (`min_new_tokens=N` is not
used: generate() enforces it by masking EOS out of the logits, which changes its picks wherever the model
would end, as a trained model does, so no loop that stops at EOS could match it.)

Models: `toy` is the embedded toy checkpoint (or `--model DIR`), skipped with a message when missing;
`50m` is a randomly initialised Qwen2 of about 50M parameters (hidden 512, 8 layers, 8 query / 2 KV heads,
SwiGLU 1536, vocab 28k, bf16 weights), the `50m` shape of bench/common.py (what `random_model.py --shape 50m`
saves), built in a temporary directory.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import clock, random_prompts, save_random_model, sync

METHODS = ("ours", "eager", "generate", "floor")


def toy_prompts(lm: Any, n: int) -> list[list[int]]:
    from stagereplay.tasks.toy import HELDOUT_SEED, toy_items

    return [list(item.prompt_ids) for item in toy_items(n, HELDOUT_SEED, lm.tokenizer)]


def run_ours(lm: Any, prompt: Sequence[int], n: int) -> list[int]:
    return lm.generate(prompt, n)


def run_eager(lm: Any, prompt: Sequence[int], n: int) -> list[int]:
    capture, lm.stepper.capture = lm.stepper.capture, False
    try:
        return lm.generate(prompt, n)
    finally:
        lm.stepper.capture = capture


def run_generate(lm: Any, prompt: Sequence[int], n: int) -> list[int]:
    import torch

    ids = torch.tensor([list(prompt)], device=lm.config.device)
    config = lm.bench_gen_config  # greedy, the model's EOS, max_new_tokens=n
    if config.max_new_tokens != n:
        config = copy.deepcopy(config)
        config.max_new_tokens = n
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


def run_floor(lm: Any, prompt: Sequence[int], n: int) -> list[int]:
    import torch
    from transformers import DynamicCache

    model = lm.model
    cache = DynamicCache(config=model.config)
    picks = []
    with torch.inference_mode():
        ids = torch.tensor([list(prompt)], device=lm.config.device)  # (1, T)
        token = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax()
        picks.append(token)
        for _ in range(n - 1):
            token = (
                model(input_ids=token.view(1, 1), cache=cache, use_cache=True, logits_to_keep=1)
                .logits[0, -1]
                .argmax()
            )
            picks.append(token)
        return torch.stack(picks).tolist()


RUNNERS: dict[str, Callable[[Any, Sequence[int], int], list[int]]] = {
    "ours": run_ours,
    "eager": run_eager,
    "generate": run_generate,
    "floor": run_floor,
}


def bench_model(name: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch._dynamo

    from stagereplay.engine.lm import load

    torch._dynamo.utils.counters.clear()
    lm = load(str(path), precision=args.precision, device=args.device, threads=args.threads)
    gen_config = copy.deepcopy(lm.model.generation_config)
    gen_config.do_sample = False
    gen_config.max_new_tokens = args.tokens
    if gen_config.pad_token_id is None:
        gen_config.pad_token_id = lm.tokenizer.pad_token_id
    lm.bench_gen_config = gen_config
    prompts = (toy_prompts(lm, args.prompts) if name == "toy" else
               random_prompts(int(lm.model.config.vocab_size), args.prompts))
    n = args.tokens
    # Warm-up, and the tokens of each method; the floor makes as many forwards as the loop made per prompt.
    outputs = {m: [run_ours(lm, p, n) for p in prompts] for m in ("ours",)}
    counts = [len(t) for t in outputs["ours"]]
    budget = {"ours": [n] * len(prompts), "eager": [n] * len(prompts), "generate": [n] * len(prompts), "floor": counts}
    outputs["eager"] = [run_eager(lm, p, n) for p in prompts]
    outputs["generate"] = [run_generate(lm, p, n) for p in prompts]
    outputs["floor"] = [run_floor(lm, p, c) for p, c in zip(prompts, counts, strict=True)]
    for p_ours, p_eager, p_gen in zip(outputs["ours"], outputs["eager"], outputs["generate"], strict=True):
        assert p_ours == p_gen == p_eager, f"{name}: our tokens differ from generate()'s"
    # Wall time by default; `--clock cpu` counts this process's CPU time, steadier on a shared machine
    # (meaningful with one thread on CPU only).
    timer = clock(args.clock)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(args.repeats):
        for method, runner in RUNNERS.items():  # interleaved, so drift hits every method alike
            sync(args.device)
            t0 = timer()
            for p, limit in zip(prompts, budget[method], strict=True):
                runner(lm, p, limit)
            sync(args.device)
            times[method].append(timer() - t0)
    total = sum(counts)
    tps = {m: total / statistics.median(ts) for m, ts in times.items()}
    params = sum(p.numel() for p in lm.model.parameters())
    return {
        "model": name,
        "path": str(path),
        "params": params,
        "max_new_tokens": n,
        "tokens_per_prompt": counts,
        "prompts": len(prompts),
        "prompt_lens": [len(p) for p in prompts],
        "repeats": args.repeats,
        "threads": args.threads,
        "precision": args.precision,
        "device": args.device,
        "clock": args.clock,
        "seconds": times,
        "tokens_per_s": tps,
        "ours_over_generate": tps["ours"] / tps["generate"],
        "eager_over_generate": tps["eager"] / tps["generate"],
        "ours_over_floor": tps["ours"] / tps["floor"],
        "tokens_equal_generate": True,
        "floor_equal_generate": outputs["floor"] == outputs["generate"],
        "eos_ids": sorted(lm.eos),
        # graphs dynamo built for the captured steps: 1 (or a few, with sliding windows) when capture worked,
        # and none when it is off; many would mean recompiles.
        "captured_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
    }


def print_row(r: dict[str, Any]) -> None:
    t = r["tokens_per_s"]
    print(
        f"{r['model']:<5} {r['params'] / 1e6:5.1f}M {sum(r['tokens_per_prompt']):4d} tok  ours {t['ours']:6.1f}  "
        f"eager {t['eager']:6.1f}  generate {t['generate']:6.1f}  floor {t['floor']:6.1f} tok/s  "
        f"ours/generate {r['ours_over_generate']:.3f}  eager/generate {r['eager_over_generate']:.3f}  "
        f"ours/floor {r['ours_over_floor']:.3f}  tokens == generate(): yes  graphs {r['captured_graphs']}"
        f"{'' if r['floor_equal_generate'] else ' (floor tokens differ)'}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="toy,50m", help="comma list of toy, 50m")
    p.add_argument("--model", type=Path, default=None, help="checkpoint directory to use as `toy`")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per prompt at most (EOS stops sooner)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per timed repeat")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--precision", default="bf16", help="bf16 | fp16 | fp32 | fp32-compute")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:<i>")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or this process's CPU time (steadier on a busy machine; CPU, 1 thread)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(wanted) - {"toy", "50m"}
    if unknown:
        print(f"unknown --models {', '.join(sorted(unknown))}: use toy, 50m", file=sys.stderr)
        return 2
    print(
        f"batch 1, greedy, up to {args.tokens} new tokens x {args.prompts} prompts, {args.precision}, "
        f"{args.device}, {args.threads} thread(s), median of {args.repeats}, {args.clock} clock"
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in wanted:
            if name == "toy":
                from stagereplay.toy import toy_checkpoint

                path = args.model or toy_checkpoint("primary")
                if not (path / "config.json").is_file():
                    print(f"toy   skipped: no checkpoint at {path} (train it, or pass --model DIR)")
                    continue
            else:
                path = save_random_model("50m", Path(tmp) / "qwen2-50m", args.device)
            results.append(bench_model(name, path, args))
            print_row(results[-1])
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
