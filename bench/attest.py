"""Is the server running the claimed model? The embedded toy as the claimed model, its honest variants as the null
and substitutions against it, scored by `engine.reference` and decided by `experiments.attest.stats`.

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
  are the later checkpoint, temperature 0.8 and top-p 0.9 with the same seeds. Statistic: the Gumbel-max mismatch
  rate.

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

from common import AttestVariant, attest_rows, attest_summary

ALPHA = 0.01


def serve(lm: Any, prompt: list[int], max_new: int, decode: Any, seed: int) -> list[int]:
    """What an honest server running `lm` serves: the experiment's own live decode (`attest_item.serve`), greedy or
    vLLM's seeded pick."""
    from stagereplay.experiments.attest.item import serve as served

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
    from stagereplay.experiments.core.stats import wilson_interval
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
            "later checkpoint": ("later", t1, False), "temperature 0.8": ("bf16", replace(t1, temperature=0.8), False),
            "top-p 0.9": ("bf16", replace(t1, top_p=0.9), False)}),
    }
    figures: dict[str, Any] = {}
    summary: dict[str, str] = {}
    honest_flags = [0, 0]
    for claim, (claimed, score, variants) in claims.items():
        per_variant: dict[str, AttestVariant] = {}
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
            per_variant[variant] = AttestVariant(scores, mismatches, honest)
        rows, flagged, null = attest_rows(per_variant, half, args.draws, ALPHA,
                                          title=f"claim: {claim}; statistic: mean {score} per token; ")
        honest_flags = [honest_flags[0] + flagged[0], honest_flags[1] + flagged[1]]
        summary |= {f"{claim} {r['variant']}": attest_summary(r) for r in rows if not r["honest"]}
        figures[claim] = {"statistic": score, **null, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    w = wilson_interval(*honest_flags)
    print(f"attest: honest FPR at 1% {honest_flags[0]}/{honest_flags[1]} [{w[0]:.3f}, {w[1]:.3f}]; "
          f"greedy later checkpoint: {summary['greedy later checkpoint']}; "
          f"seeded later checkpoint: {summary['seeded t=1 later checkpoint']}")


if __name__ == "__main__":
    main()
