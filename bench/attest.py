"""Is the server running the claimed model? The embedded toy as the claimed model, its honest variants as the null
and substitutions against it, scored by `engine.reference` and decided by `experiments.attest_stats`.

    python bench/attest.py                                    # 160 toy prompts, 48 tokens each, CPU
    python bench/attest.py --n 60 --max-new-tokens 32         # a quicker look
    python bench/attest.py --json OUT                         # the figures as JSON too

The claimed model: the toy's primary checkpoint; its reference: a one-shot prefill of prompt + served tokens in
fp32 (`reference_scores`). Served outputs come from our engine's live decode (a cache, one token per step), as an
honest server decodes: greedy, or vLLM's seeded sampler (argmax of probs / E, E ~ Exp(1) from a generator seeded
per request) for the seeded claim. Two claims:

- greedy: honest variants live decode in bf16, fp16 and fp32; substitutions are the later checkpoint (bf16) and a
  server sampling at temperature 0.5 (seeded). Statistic: the mean margin per token (reference max logit minus the
  served token's), and the mismatch rate beside it.
- seeded, temperature 1 (vLLM's per-request seed known): honest variants as above with that sampler; substitutions
  are the later checkpoint and temperature 0.8 with the same seeds. Statistic: the Gumbel-max mismatch rate.

The prompts split in two: the first half calibrates the null (every honest variant's items pooled), the second is
held out. Per variant: its items, tokens, the statistic with its 95% interval over items; for honest variants the
false-positive rate at 1% of the per-item decision on held-out prompts (Wilson interval); for substitutions the
AUC against the null at runs of t tokens (whole items pooled, the last cut) and the tokens needed to flag them with
99% power at 1%. The last line: `attest: honest FPR at 1% k/n (...); later checkpoint: AUC ... at t tokens, ...`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

ALPHA = 0.01
GRID = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def serve(lm: Any, prompt: list[int], max_new: int, decode: Any, seed: int) -> list[int]:
    """What an honest server running `lm` serves: the experiment's own live decode (`attest_item.serve`), greedy or
    vLLM's seeded pick."""
    from stagereplay.experiments.attest_item import serve as served

    return served(lm, prompt, max_new, decode, seed)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=160, help="toy prompts (half calibrate, half held out)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--draws", type=int, default=999, help="null resamples per decision and per run length")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()

    import numpy as np
    import torch

    from stagereplay.engine.decode import DecodeConfig, derive_seed
    from stagereplay.engine.lm import load
    from stagereplay.engine.reference import reference_scores
    from stagereplay.experiments.attest_stats import (
        Items,
        curve,
        decide,
        item_interval,
        run_statistic,
        tokens_for_power,
    )
    from stagereplay.experiments.stats import wilson_interval
    from stagereplay.tasks.toy import HELDOUT_SEED, toy_items
    from stagereplay.toy import toy_checkpoint

    torch.set_num_threads(args.threads)
    reference = load(str(toy_checkpoint("primary")), "fp32", "cpu", args.threads)
    servers = {name: load(str(toy_checkpoint(ckpt)), precision, "cpu", args.threads)
               for name, ckpt, precision in [("bf16", "primary", "bf16"), ("fp16", "primary", "fp16"),
                                             ("fp32", "primary", "fp32"), ("later", "later", "bf16")]}
    items = toy_items(args.n, HELDOUT_SEED, reference.tokenizer)
    half = len(items) // 2
    greedy = DecodeConfig(max_new_tokens=args.max_new_tokens)
    t1 = DecodeConfig(max_new_tokens=args.max_new_tokens, sample=True, temperature=1.0)
    claims = {
        # claim: (claimed decode, score, {variant: (server, served decode, honest)})
        "greedy": (greedy, "margin", {
            "bf16 live": ("bf16", greedy, True), "fp16 live": ("fp16", greedy, True),
            "fp32 live": ("fp32", greedy, True), "later checkpoint": ("later", greedy, False),
            "temperature 0.5": ("bf16", replace(t1, temperature=0.5), False)}),
        "seeded t=1": (t1, "gumbel mismatch", {
            "bf16 live": ("bf16", t1, True), "fp16 live": ("fp16", t1, True), "fp32 live": ("fp32", t1, True),
            "later checkpoint": ("later", t1, False), "temperature 0.8": ("bf16", replace(t1, temperature=0.8), False)}),
    }
    figures: dict[str, Any] = {}
    summary: dict[str, str] = {}
    honest_flags = [0, 0]
    for claim, (claimed, score, variants) in claims.items():
        per_variant: dict[str, tuple[list[np.ndarray], list[np.ndarray], bool]] = {}
        for variant, (server, decode, honest) in variants.items():
            scores, mismatches = [], []
            for item in items:
                seed = derive_seed(0, item.id)
                served = serve(servers[server], list(item.prompt_ids), args.max_new_tokens, decode, seed)
                ts = reference_scores(reference, item.prompt_ids, served, claimed, seed=seed)
                if ts.gumbel_match is not None:
                    scores.append((~ts.gumbel_match).astype(np.float64))
                else:
                    scores.append(ts.margin.astype(np.float64))
                mismatches.append((~ts.match).astype(np.float64))
            per_variant[variant] = (scores, mismatches, honest)
        null = Items.of([s for scores, _, honest in per_variant.values() if honest for s in scores[:half]])
        rows = []
        print(f"\nclaim: {claim}; statistic: mean {score} per token; null: {len(null)} items, {null.tokens} tokens "
              f"(calibration prompts, honest variants pooled); held out: {len(items) - half} prompts")
        print(f"{'variant':<18} {'items':>5} {'tokens':>6} {'statistic [95% over items]':>30} {'mismatch':>8} "
              f"{'FPR at 1% [95%]':>20} {'AUC at 32/128/512 tok':>22} {'tok for 99% power':>17}")
        for variant, (scores, mismatches, honest) in per_variant.items():
            held = Items.of(scores[half:])
            stat, (lo, hi) = run_statistic(held), item_interval(held)
            mismatch = run_statistic(Items.of(mismatches[half:]))
            row: dict[str, Any] = {"variant": variant, "honest": honest, "items": len(held), "tokens": held.tokens,
                                   "statistic": stat, "interval": [lo, hi], "mismatch_rate": mismatch}
            fpr = auc_text = power_text = ""
            if honest:
                flags = sum(decide(Items.of([s]), null, ALPHA, args.draws, seed=i, needed=False).flagged
                            for i, s in enumerate(scores[half:]))
                w = wilson_interval(flags, len(held))
                row.update(flagged=flags, fpr_interval=list(w))
                fpr = f"{flags}/{len(held)} [{w[0]:.3f}, {w[1]:.3f}]"
                honest_flags[0] += flags
                honest_flags[1] += len(held)
            else:
                c = curve(held, null, GRID, ALPHA, args.draws)
                needed = tokens_for_power(c)
                row.update(auc=dict(zip(map(int, c.tokens), map(float, c.auc), strict=True)),
                           power=dict(zip(map(int, c.tokens), map(float, c.power), strict=True)), tokens_needed=needed)
                auc_text = "/".join(f"{row['auc'][t]:.3f}" for t in (32, 128, 512))
                power_text = f"<= {needed}" if needed is not None else f"> {GRID[-1]}"
                summary[f"{claim} {variant}"] = f"AUC {row['auc'][128]:.3f} at 128 tokens, 99% power {power_text}"
            rows.append(row)
            print(f"{variant:<18} {len(held):>5} {held.tokens:>6} {stat:>10.4f} [{lo:.4f}, {hi:.4f}]   "
                  f"{mismatch:>8.4f} {fpr:>20} {auc_text:>22} {power_text:>17}")
        figures[claim] = {"statistic": score, "null_items": len(null), "null_tokens": null.tokens, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    w = wilson_interval(*honest_flags)
    print(f"attest: honest FPR at 1% {honest_flags[0]}/{honest_flags[1]} [{w[0]:.3f}, {w[1]:.3f}]; "
          f"greedy later checkpoint: {summary['greedy later checkpoint']}; "
          f"seeded later checkpoint: {summary['seeded t=1 later checkpoint']}")


if __name__ == "__main__":
    main()
