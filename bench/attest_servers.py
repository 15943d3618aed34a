"""Is a server running the claimed model? llama-server's (and vLLM's) quantized weights and K/V caches, and a smaller
model, against the claimed model's honest floor, the way `stagereplay attest --engine http` decides (attest's
statistics, on more prompts).

    python bench/attest_servers.py CLAIMED.gguf OUT --server BUILD/llama-server --quantize BUILD/llama-quantize
    python bench/attest_servers.py SmolLM2-135M-Instruct.Q4_1.gguf OUT --items chat --server ... --quantize ...
    python bench/attest_servers.py toy.gguf OUT --items toy --n 40 --max-new-tokens 24 ...   # a quicker look
    python bench/attest_servers.py ... --vllm .venv-vllm-ci/bin/python   # vLLM's CPU build as well (its venv)

The claimed weights: CLAIMED.gguf's values in f32 (`llama-quantize --allow-requantize ... F32`, OUT/claimed.F32.gguf:
a quantized GGUF such as SmolLM2's Q4_1 is claimed as the values it holds). Our engine loads them (transformers'
GGUF loader) for the reference, a one-shot fp32 prefill of prompt + served tokens, and for its honest variants
(`attest --honest`'s): live decodes at bf16, fp16 and fp32, and at bf16 a chunked prefill, a prefix reused from an
earlier request's cache and a batch of 4 concurrent requests. Served, greedy, one request per prompt (token IDs in and
out, nothing cached), by llama-server (`-np 1 -c 2048`, `--threads`) in these configurations:

    llama-server        the claimed f32 weights as they are: an honest engine (llama.cpp's kernels, its f16 K/V)
    llama-server x4     the same, under load: 4 slots (`-np 4`) and 4 requests in flight at once, batched together
    Q8_0, Q4_K_M, Q4_0  the claimed weights quantized by llama-quantize (the same vendored source as the server)
    K/V q8_0, K/V q4_0  the claimed weights with the cache quantized (-ctk/-ctv, flash attention on)

a smaller model, served by our engine (fp32, live decode):

    one layer fewer     the claimed model with one decoder layer removed (the one two thirds of the way down), as a
                        provider serving a layer-pruned model would

and, with `--vllm PYTHON` (the vLLM venv's interpreter), by `vllm serve` (the CPU build) on the claimed f32 weights
written as a model folder (OUT/claimed-hf), fp32, eager, blocks of 32, its default prefix caching on:

    vllm serve          an honest engine (vLLM's kernels)
    vllm serve x4       the same, 4 requests in flight at once, batched together
    vllm K/V fp8        the cache quantized (`--kv-cache-dtype fp8`; the CPU build runs it with AVX-512 and a head size
                        divisible by 32, and refuses it otherwise)

The prompts split in two: the first half calibrates the null (the responses of the honest configurations the claim
admits, pooled: by default all of ours, llama-server's and vllm serve's, alone and under load; `--null "ours
fp32,llama-server"` claims f32 serving, and the others become rows to flag), the second is held out. Statistic: the mean margin per token (the reference's max
logit minus the served token's), as `attest` decides a greedy claim. Per variant: its statistic with its 95%
interval over items; for honest ones the false-positive rate at 1% of the per-item decision on held-out prompts
(Wilson interval); for substitutions the AUC against the null at runs of t tokens and the tokens needed to flag them
with 99% power at 1%. Items: `toy` (the embedded toy's task, for a GGUF of the toy) or `chat` (a question on an
addition in the model's chat template, for an instruct model). The last line: `attest_servers: honest FPR at 1% k/n (...); Q8_0: AUC ... at 300
tokens, 99% power <= t; ...`; a configuration the server refuses (a quantized cache whose blocks do not divide the
model's head size, as the toy's 48) is named with its reason and left out. OUT keeps the GGUFs and the servers' logs; --json writes the figures, --figure draws each substitution's AUC by run
length (Token-DiFR's figure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from common import (
    AttestVariant,
    ServerDidNotStart,
    attest_figure,
    attest_rows,
    attest_summary,
    start_llama_server,
    start_vllm_server,
    stop_server,
)

from stagereplay.experiments.attest.stage import HONEST as OURS

ALPHA = 0.01
CONCURRENT = 4
"""llama-server under load: this many requests in flight at once on as many slots."""
VLLM_HONEST = ("vllm serve", f"vllm serve x{CONCURRENT}")
HONEST = (*(f"ours {v}" for v in OURS), "llama-server", f"llama-server x{CONCURRENT}", *VLLM_HONEST)
GRID = (8, 16, 32, 64, 128, 256, 300, 512, 1024, 2048)
"""Run lengths the AUC is measured at: attest's, and 300 (Token-DiFR's 4-bit figure: AUC > 0.999 within 300 tokens)."""
WEIGHTS = ("Q8_0", "Q4_K_M", "Q4_0")
CACHES = {"K/V q8_0": ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
          "K/V q4_0": ["-ctk", "q4_0", "-ctv", "q4_0", "-fa", "on"]}
VLLM_FLAGS = ["--dtype", "float32", "--block-size", "32", "--enforce-eager"]


def ask(engine: Any, max_new_tokens: int, prompt: list[int]) -> list[int]:
    """The server's greedy response to `prompt`, token IDs."""
    from stagereplay.serving.seam import Sampling

    return list(engine.sample(prompt, max_new_tokens, Sampling()).tokens)


def one_layer_fewer(lm: Any, folder: Path) -> Path:
    """The model of `lm` without its decoder layer two thirds of the way down, saved at `folder` with its tokenizer
    (made once: an existing folder is kept)."""
    if folder.exists():
        return folder
    import copy

    model = copy.deepcopy(lm.model)
    layers = model.model.layers
    drop = len(layers) * 2 // 3
    model.model.layers = type(layers)([layer for k, layer in enumerate(layers) if k != drop])
    for k, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = k
    config = model.config
    config.num_hidden_layers = len(model.model.layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [t for k, t in enumerate(config.layer_types) if k != drop]
    model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    return folder


def quantize(binary: str, source: Path, out: Path, kind: str, requantize: bool = False) -> Path:
    """`source` as `kind` at `out`, by llama-quantize (made once: an existing file is kept)."""
    if not out.exists():
        cmd = [binary, *(["--allow-requantize"] if requantize else []), str(source), str(out), kind]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"error: llama-quantize {kind} failed: {done.stderr.strip().splitlines()[-1:]}")
    return out


def prompts(kind: str, n: int, tokenizer: Any) -> list[tuple[str, list[int]]]:
    """(id, prompt token IDs) per item: the toy's own task, or a question on an addition in the model's chat
    template (plain text where it has none), which an instruct model answers at some length."""
    if kind == "toy":
        from stagereplay.tasks.toy import HELDOUT_SEED, toy_items

        return [(i.id, list(i.prompt_ids)) for i in toy_items(n, HELDOUT_SEED, tokenizer)]
    import random

    rng = random.Random(0)
    out = []
    for k in range(n):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        question = f"Explain, step by step, how to add {a} and {b}, and check the result."
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer.encode(question + "\n")
        out.append((f"q{k:04d}", [int(t) for t in ids]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("claimed", type=Path, help="the claimed model's GGUF (any type: it is claimed as its f32 values)")
    p.add_argument("out", type=Path)
    p.add_argument("--server", required=True, help="llama-server (the folder .ci/llamacpp.sh prints)")
    p.add_argument("--quantize", required=True, help="llama-quantize from the same build")
    p.add_argument("--items", choices=("toy", "chat"), default="chat")
    p.add_argument("--n", type=int, default=80, help="prompts (half calibrate, half held out)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--vllm", default=None, metavar="PYTHON",
                   help="the vLLM venv's interpreter: adds vllm serve's configurations")
    p.add_argument("--null", default=None,
                   help="the honest configurations the claim admits, which make the null (the others are rows to "
                        "flag, as a server claiming f32 and running bf16 would be); default: every honest one run")
    p.add_argument("--draws", type=int, default=999, help="null resamples per decision and per run length")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--figure", type=Path, default=None, help="draw each substitution's AUC by run length here (PNG)")
    args = p.parse_args()
    honest = [h for h in HONEST if args.vllm or h not in VLLM_HONEST]
    null_names = {n.strip() for n in (args.null or ",".join(honest)).split(",") if n.strip()}
    if not null_names or null_names - set(honest):
        sys.exit(f"error: --null {args.null!r} names no honest configuration or others; use some of {', '.join(honest)}")
    args.out.mkdir(parents=True, exist_ok=True)

    import numpy as np
    import torch

    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.lm import load
    from stagereplay.engine.reference import reference_scores
    from stagereplay.experiments.attest.item import serve
    from stagereplay.experiments.attest.variants import HonestVariant
    from stagereplay.experiments.core.stats import wilson_interval
    from stagereplay.serving.http import HttpOptions
    from stagereplay.serving.http import load as http_engine
    from stagereplay.serving.seam import EngineConfig

    torch.set_num_threads(args.threads)
    claimed = quantize(args.quantize, args.claimed, args.out / "claimed.F32.gguf", "F32", requantize=True)
    served_files = {"llama-server": claimed} | {
        w: quantize(args.quantize, claimed, args.out / f"claimed.{w}.gguf", w) for w in WEIGHTS}
    reference = load(str(claimed), "fp32", "cpu", args.threads)
    items = prompts(args.items, args.n, reference.tokenizer)
    half = len(items) // 2
    greedy = DecodeConfig(max_new_tokens=args.max_new_tokens)

    def scored(served: list[list[int]]) -> tuple[list[Any], list[Any]]:
        scores, mismatches = [], []
        for (_, prompt), tokens in zip(items, served, strict=True):
            ts = reference_scores(reference, prompt, tokens, greedy)
            scores.append(ts.margin.astype(np.float64))
            mismatches.append((~ts.match).astype(np.float64))
        return scores, mismatches

    variants: dict[str, AttestVariant] = {}
    models = {"fp32": reference}
    for name in OURS:
        variant = HonestVariant.parse(name)
        if variant.precision not in models:
            models[variant.precision] = load(str(claimed), variant.precision, "cpu", args.threads)
        served = [serve(models[variant.precision], prompt, args.max_new_tokens, greedy, 0, variant)[0]
                  for _, prompt in items]
        variants[f"ours {name}"] = AttestVariant(*scored(served), honest=f"ours {name}" in null_names)
        print(f"ours {name}: {sum(map(len, served))} tokens served", flush=True)
    def llama(path: Path, flags: list[str], slots: int) -> Any:
        return partial(start_llama_server, args.server, str(path),
                       ["-np", str(slots), "-c", str(2048 * slots), "-t", str(args.threads), *flags])

    smaller = load(str(one_layer_fewer(reference, args.out / "smaller-hf")), "fp32", "cpu", args.threads)
    served = [serve(smaller, prompt, args.max_new_tokens, greedy, 0)[0] for _, prompt in items]
    variants["one layer fewer"] = AttestVariant(*scored(served), honest=False)
    print(f"one layer fewer ({smaller.model.config.num_hidden_layers} layers): {sum(map(len, served))} tokens served",
          flush=True)
    del smaller

    configs = [("llama-server", "llama-server", llama(claimed, [], 1), 1),
               (f"llama-server x{CONCURRENT}", "llama-server", llama(claimed, [], CONCURRENT), CONCURRENT)]
    if args.vllm:
        folder = args.out / "claimed-hf"  # the claimed f32 weights as vLLM loads them
        if not folder.exists():
            reference.model.save_pretrained(folder)
            reference.tokenizer.save_pretrained(folder)

        def vllm(flags: list[str]) -> Any:
            return lambda log: start_vllm_server(args.vllm, str(folder), [*VLLM_FLAGS, *flags], log, args.threads)

        configs += [("vllm serve", "vllm serve", vllm([]), 1),
                    (f"vllm serve x{CONCURRENT}", "vllm serve", vllm([]), CONCURRENT),
                    ("vllm K/V fp8", "vllm serve", vllm(["--kv-cache-dtype", "fp8"]), 1)]
    configs += [(name, "llama-server", llama(path, [], 1), 1) for name, path in served_files.items()
                if name != "llama-server"]
    configs += [(name, "llama-server", llama(claimed, flags, 1), 1) for name, flags in CACHES.items()]
    refused: dict[str, tuple[str, str]] = {}  # name: (server, its reason)
    for name, server, start, slots in configs:
        log = args.out / f"server-{name.replace('/', '').replace(' ', '-')}.log"
        try:
            proc, url = start(log)
        except ServerDidNotStart as e:  # e.g. a quantized cache whose blocks do not divide the model's head size
            refused[name] = (server, e.reason())
            print(f"{name}: refused by {server}: {refused[name][1]}", flush=True)
            continue
        try:
            engine = http_engine(EngineConfig("http", HttpOptions(url=url)), str(claimed), "fp32", args.threads, "cpu")
            with ThreadPoolExecutor(slots) as pool:  # in flight together where the server has the slots
                served = list(pool.map(partial(ask, engine, args.max_new_tokens), [p for _, p in items]))
        finally:
            stop_server(proc)
        variants[name] = AttestVariant(*scored(served), honest=name in null_names)
        print(f"{name}: {sum(map(len, served))} tokens served", flush=True)

    rows, flagged, null = attest_rows(variants, half, args.draws, ALPHA, GRID,
                                      title=f"claimed: {args.claimed.name} as f32; the null: {', '.join(sorted(null_names))}; "
                                            "statistic: mean margin per token; ")
    if args.json:
        args.json.write_text(json.dumps({"claimed": args.claimed.name, **null, "rows": rows,
                                               "refused": {n: f"{srv}: {why}" for n, (srv, why) in refused.items()}},
                                              indent=1))
    if args.figure:
        servers = "llama-server and vllm serve" if args.vllm else "llama-server"
        attest_figure(rows, args.figure, f"{args.claimed.name} claimed (f32), served by {servers}")
    w = wilson_interval(*flagged)
    subs = "; ".join([*(f"{r['variant']}: {attest_summary(r, GRID, 300)}" for r in rows if not r["honest"]),
                      *(f"{name}: refused by {server}" for name, (server, _) in refused.items())])
    print(f"attest_servers: honest FPR at 1% {flagged[0]}/{flagged[1]} [{w[0]:.3f}, {w[1]:.3f}]; {subs}")


if __name__ == "__main__":
    main()
