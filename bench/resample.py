"""Cost of one sampled draw from a boundary-state snapshot against a plain decode and a re-prefilled draw.

    python bench/resample.py [--model DIR | --shape 50m --prefix 1024] [--items 8] [--k 8] [--new-tokens 128]
                             [--precision bf16] [--device cpu] [--repeats 3]

Per item the live boundary state is built once, then three ways of producing the same K sampled continuations
(seeds 0..K-1, temperature 0.6, top-p 0.95) are timed. The model: the embedded toy (its marker boundary, short
prefixes), a checkpoint (`--model`), or a random Qwen2 of bench/common.py's shapes (`--shape`, as
`random_model.py` saves it) whose boundary comes `--prefix` tokens after a random 32-token prompt, as a long
reasoning trace would:

- `draw`: `lm.continue_from(state, dc, seed)`, what `stagereplay resample` does: clone the snapshot's cache,
  feed the pending token, decode. K decodes from one snapshot, no prefill.
- `decode`: the same decode steps with no clone: a continuation from a state built for the purpose, the
  floor a draw could reach.
- `reprefill`: one-shot prefill of the prefix for every draw, then the same decode: what a tool that
  rebuilds the state per sample pays.

The three are interleaved draw by draw, in rotating order, so that drift in the machine's speed hits them
alike. The script reports time per draw and per emitted token (the three emit the same tokens on the toy; a
fresh prefill may round differently in bf16, so the counts are printed), `draw / decode` (what the snapshot
copy costs) and `reprefill / draw` (what a draw from one snapshot saves).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from common import random_prompts, save_random_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded toy)")
    ap.add_argument("--shape", default=None, help="a random model of bench/common.py's shapes, e.g. 50m")
    ap.add_argument("--prefix", type=int, default=1024, help="stage-1 tokens with --shape")
    ap.add_argument("--new-tokens", type=int, default=128, help="suffix limit per draw")
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import tempfile
    from pathlib import Path

    from stagereplay.engine.boundary import After, default_rule
    from stagereplay.engine.cache import clone_cache
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.lm import load
    from stagereplay.runs.inputs import Inputs
    from stagereplay.runs.prepare import data_config, resolve_model
    from stagereplay.tasks import load_items

    tmp = tempfile.TemporaryDirectory()
    if args.shape:
        lm = load(str(save_random_model(args.shape, Path(tmp.name) / args.shape, args.device)), args.precision,
                  args.device, args.threads)
        prompts: list[Any] = random_prompts(int(lm.model.config.vocab_size), args.items)
        rule: Any = After(args.prefix)
        stage1 = DecodeConfig(max_stage1_tokens=args.prefix)
    else:
        inputs = Inputs.of(model=args.model, n=args.items, precision=args.precision, device=args.device,
                           threads=args.threads, attn_impl="sdpa")
        lm = load(resolve_model(inputs).path, args.precision, args.device, args.threads)
        prompts = load_items(data_config(inputs), lm.tokenizer)[0]
        # The rule a run resolves for this model (`</think>` for the toy's reasoning tokenizer) when none is given.
        rule = default_rule(lm.tokenizer)
        stage1 = DecodeConfig()
    # A random model rarely emits EOS, so its draws run to the limit; min tokens keep the toy's EOS honest.
    dc = DecodeConfig(max_new_tokens=args.new_tokens, sample=True, temperature=0.6, top_p=0.95)
    states = [lm.live(p, rule, stage1, keep_going=False) for p in prompts]

    def draw(state: Any, j: int) -> int:
        return len(lm.continue_from(state, dc, seed=j).suffix)

    def decode(state: Any, j: int) -> int:  # the same steps on a cache cloned before the clock starts
        cache = clone_cache(state.cache)
        start[0] = time.perf_counter()
        return len(lm._continue(cache, state, dc, j).suffix)

    def reprefill(state: Any, j: int) -> int:
        return len(lm.continue_from(lm.construct(state, "oneshot"), dc, seed=j).suffix)

    lm.continue_from(states[0], dc, seed=0)  # warm-up: the captured step's first call compiles it
    start = [0.0]
    methods = [("draw", draw), ("decode", decode), ("reprefill", reprefill)]
    timings: dict[str, list[float]] = {name: [] for name, _ in methods}
    tokens: dict[str, int] = {}
    for r in range(args.repeats):
        spent = dict.fromkeys(timings, 0.0)
        count = dict.fromkeys(timings, 0)
        # Interleaved draw by draw, in rotating order, so that drift in the machine's speed hits all three alike.
        for i, (state, j) in enumerate((s, j) for s in states for j in range(args.k)):
            k = (i + r) % 3
            for name, fn in methods[k:] + methods[:k]:
                start[0] = time.perf_counter()
                count[name] += fn(state, j)
                spent[name] += time.perf_counter() - start[0]
        for name in timings:
            timings[name].append(spent[name])
            tokens[name] = count[name]
    draws = len(states) * args.k
    med: dict[str, Any] = {k: statistics.median(v) for k, v in timings.items()}
    prefix = statistics.mean(len(s.prefix) for s in states)
    print(f"{draws} draws ({len(states)} items x K={args.k}), prefix {prefix:.0f} tokens on average, "
          f"{args.precision}, {args.device}, {args.threads} thread(s), median of {args.repeats}")
    for name in ("draw", "decode", "reprefill"):
        print(f"{name:10s} {1000 * med[name] / draws:8.2f} ms/draw  {1e6 * med[name] / tokens[name]:9.1f} us/token"
              f"  ({tokens[name]} tokens)")
    print(f"draw / decode {med['draw'] / med['decode']:.3f}   reprefill / draw {med['reprefill'] / med['draw']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
