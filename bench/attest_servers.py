"""Is a server running the claimed model? llama-server's (and vLLM's) quantized weights and K/V caches, another
checkpoint and a smaller model, against the null `stagereplay attest` holds for the claim, with its statistics, on
more prompts than a run.

    python bench/attest_servers.py CLAIMED.gguf OUT --server BUILD/llama-server --quantize BUILD/llama-quantize
    python bench/attest_servers.py SmolLM2-135M-Instruct.Q4_1.gguf OUT --items chat --server ... --quantize ...
    python bench/attest_servers.py toy.gguf OUT --items toy --later toy-later.gguf ...     # the toy, and a checkpoint
    python bench/attest_servers.py ... --vllm .venv-vllm-ci/bin/python   # vLLM's CPU build as well (its venv)

The claim is CLAIMED.gguf served by llama.cpp, as `attest --model CLAIMED.gguf` claims it. Its null is the product's,
through the product's code: the claim's default honest variants (`experiments.attest.experiment.honest_of`: our fp32
live decode, and llama.cpp's own variants in process, `serving.llamacpp_honest`), each response decoded as an attest
run decodes it, scored by the reference (our one-shot fp32 prefill of prompt + served tokens) with both of attest's
statistics: the margin per token (the reference's max logit minus the served token's) and the log-prob gap per token
(|served log-probability - the reference's| less `LOGPROB_TOLERANCE`, where the server returns them). Served, greedy,
one request per prompt (token IDs in and out, nothing cached):

    llama-server        the claimed file as it is (`-np 1 -c 2048`)                       honest
    llama-server x4     the same, 4 slots and 4 requests in flight at once, batched        honest
    vllm serve          (--vllm) the claimed values in f32 as a model folder, fp32, eager  honest
    vllm serve x4       the same, 4 requests in flight at once                             honest
    Q8_0, Q4_K_M, Q4_0  the claimed file requantized by llama-quantize (the server's build)
    K/V q8_0, K/V q4_0  the claimed file with its cache quantized (-ctk/-ctv, flash attention on)
    vllm K/V fp8        (--vllm) the cache quantized (`--kv-cache-dtype fp8`)
    later               (--later GGUF) another checkpoint of the model, served by llama-server
    one layer fewer     the claimed model with its decoder layer two thirds of the way down removed (ours, fp32)

The prompts split as attest splits them (`calibration_split`, seed 0): the calibration prompts' honest-variant
responses are the null; the rest are held out. Per honest source, each held-out response is decided alone as attest's
held-out check decides it (both tests, alpha shared between them, against each variant's null: `decision.judged`), and
the flagged count over every honest source is the false-positive rate, with its Wilson interval. Per substitution, its
held-out responses resampled into runs of t tokens against honest runs of t tokens (`stats.curve`, the pooled null):
the AUC and the tokens for 99% power at 1% of the margin alone, of the log-prob gap alone, and of both (either
exceeding its threshold at 0.5%, the same resamples). The last line: `attest_servers: honest responses flagged at 1%
k/n [lo, hi]; Q8_0: AUC a at 300 tokens, 99% power <= t (margin), <= t (both); ...`; a configuration the server
refuses (a quantized cache whose blocks do not divide the model's head size, as the toy's 48) is named with its reason
and left out. OUT keeps the GGUFs and the servers' logs; --json writes the figures, --figure draws each
substitution's AUC by run length, margin alone and both statistics.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from common import ServerDidNotStart, start_llama_server, start_vllm_server, stop_server

ALPHA = 0.01
CONCURRENT = 4
"""Under load: this many requests in flight at once on as many slots."""
GRID = (8, 16, 32, 64, 128, 256, 300, 512, 1024, 2048)
"""Run lengths the AUC is measured at: attest's, and 300 (Token-DiFR's 4-bit figure: AUC > 0.999 within 300 tokens)."""
WEIGHTS = ("Q8_0", "Q4_K_M", "Q4_0")
CACHES = {"K/V q8_0": ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
          "K/V q4_0": ["-ctk", "q4_0", "-ctv", "q4_0", "-fa", "on"]}
VLLM_FLAGS = ["--dtype", "float32", "--block-size", "32", "--enforce-eager"]


@dataclass
class Source:
    """One source's responses, scored: per item the margin and the log-prob gap per token (None: no log-probs)."""

    honest: bool
    margins: list[Any]
    gaps: list[Any] | None


def ask(engine: Any, max_new_tokens: int, prompt: list[int]) -> tuple[list[int], list[float] | None]:
    """The server's greedy response to `prompt` and its log-probability of each token (None: not one for each)."""
    from stagereplay.serving.seam import Sampling

    g = engine.sample(prompt, max_new_tokens, Sampling())
    chosen = list(g.chosen) if g.chosen is not None and len(g.chosen) == len(g.tokens) else None
    return list(g.tokens), chosen


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


def quantize(binary: str, source: Path, out: Path, kind: str) -> Path:
    """`source` as `kind` at `out`, by llama-quantize (made once: an existing file is kept)."""
    if not out.exists():
        done = subprocess.run([binary, "--allow-requantize", str(source), str(out), kind], capture_output=True,
                              text=True)
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


def both_power(margin: Any, gap: Any, null_margin: Any, null_gap: Any, draws: int) -> dict[int, float]:
    """Per run length, the power of both statistics at once: a run of t tokens flagged where either exceeds its null's
    threshold at alpha / 2 (the margins and gaps of one run drawn from the same responses: one seed, one offsets)."""
    from stagereplay.experiments.attest.stats import pooled_statistics, threshold

    out = {}
    for i, t in enumerate(GRID):
        m_thr = threshold(pooled_statistics(null_margin, t, draws, 2 * i), ALPHA / 2)
        g_thr = threshold(pooled_statistics(null_gap, t, draws, 2 * i), ALPHA / 2)
        flagged = ((pooled_statistics(margin, t, draws, 2 * i + 1) > m_thr)
                   | (pooled_statistics(gap, t, draws, 2 * i + 1) > g_thr))
        out[t] = float(flagged.mean())
    return out


def needed(power: dict[int, float]) -> int | None:
    """The fewest tokens on the grid from which the power holds at 99% at every longer length."""
    ok = [t for t in GRID if all(power[u] >= 0.99 for u in GRID if u >= t)]
    return ok[0] if ok else None


def figure(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if r["honest"]:
            continue
        line, = ax.plot(GRID, [r["auc"][t] for t in GRID], label=f"{r['source']} (margin)")
        if r.get("auc_gap"):
            ax.plot(GRID, [r["auc_gap"][t] for t in GRID], ls="--", color=line.get_color(), label=f"{r['source']} (log-prob gap)")
    ax.set_xscale("log")
    ax.set_xlabel("served tokens in the run")
    ax.set_ylabel("AUC against honest runs")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("claimed", type=Path, help="the claimed GGUF (served by llama.cpp, as attest claims a GGUF)")
    p.add_argument("out", type=Path)
    p.add_argument("--server", required=True, help="llama-server (the folder .ci/llamacpp.sh prints)")
    p.add_argument("--quantize", required=True, help="llama-quantize from the same build")
    p.add_argument("--items", choices=("toy", "chat"), default="chat")
    p.add_argument("--n", type=int, default=80, help="prompts (about half calibrate, half held out)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--vllm", default=None, metavar="PYTHON",
                   help="the vLLM venv's interpreter: adds vllm serve's configurations")
    p.add_argument("--later", type=Path, default=None, help="another checkpoint's GGUF, served as a substitution")
    p.add_argument("--draws", type=int, default=999, help="null resamples per decision and per run length")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--figure", type=Path, default=None, help="draw each substitution's AUC by run length here (PNG)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import numpy as np
    import torch

    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.lm import load
    from stagereplay.engine.reference import reference_scores
    from stagereplay.experiments.attest.decision import LOGPROB, PRIMARY, judged, share
    from stagereplay.experiments.attest.experiment import AttestOptions, calibration_split, honest_of
    from stagereplay.experiments.attest.item import serve
    from stagereplay.experiments.attest.stats import Items, curve, tokens_for_power
    from stagereplay.experiments.attest.summary import LOGPROB_TOLERANCE
    from stagereplay.experiments.attest.variants import EngineVariant, variant_of
    from stagereplay.experiments.core.stats import wilson_interval
    from stagereplay.serving.http import HttpOptions
    from stagereplay.serving.http import load as http_engine
    from stagereplay.serving.seam import EngineConfig

    torch.set_num_threads(args.threads)
    claimed = args.claimed.resolve()
    reference = load(str(claimed), "fp32", "cpu", args.threads)
    items = prompts(args.items, args.n, reference.tokenizer)
    calibration = set(calibration_split([i for i, _ in items], 0))
    greedy = DecodeConfig(max_new_tokens=args.max_new_tokens)

    def scored(served: list[tuple[list[int], list[float] | None]], honest: bool) -> Source:
        margins, gaps = [], []
        for (_, prompt), (tokens, logprobs) in zip(items, served, strict=True):
            ts = reference_scores(reference, prompt, tokens, greedy)
            margins.append(ts.margin.astype(np.float64))
            if logprobs is not None:
                ref = ts.logprob.astype(np.float64)
                gaps.append(np.maximum(np.abs(np.asarray(logprobs, dtype=np.float64) - ref) - LOGPROB_TOLERANCE, 0.0))
        return Source(honest, margins, gaps if len(gaps) == len(items) else None)

    null_variants = honest_of(reference.config, AttestOptions())
    sources: dict[str, Source] = {}
    models = {"fp32": reference}
    for name in null_variants:
        v = variant_of(name)
        if isinstance(v, EngineVariant):
            served = [tuple(v.honesty().serve(reference, v.settings, prompt, args.max_new_tokens, True)[::2])
                      for _, prompt in items]
        else:
            if v.precision not in models:
                models[v.precision] = load(str(claimed), v.precision, "cpu", args.threads)
            served = [tuple(serve(models[v.precision], prompt, args.max_new_tokens, greedy, 0, v)[::2])
                      for _, prompt in items]
        sources[name] = scored(served, True)  # type: ignore[arg-type]
        print(f"honest@{name}: {sum(len(s[0]) for s in served)} tokens", flush=True)

    def llama(path: Path, flags: list[str], slots: int) -> Any:
        return partial(start_llama_server, args.server, str(path),
                       ["-np", str(slots), "-c", str(2048 * slots), "-t", str(args.threads), *flags])

    smaller = load(str(one_layer_fewer(reference, args.out / "smaller-hf")), "fp32", "cpu", args.threads)
    served = [tuple(serve(smaller, prompt, args.max_new_tokens, greedy, 0)[::2]) for _, prompt in items]
    sources["one layer fewer"] = scored(served, False)  # type: ignore[arg-type]
    del smaller

    configs = [("llama-server", "llama-server", llama(claimed, [], 1), 1, True),
               (f"llama-server x{CONCURRENT}", "llama-server", llama(claimed, [], CONCURRENT), CONCURRENT, True)]
    if args.vllm:
        folder = args.out / "claimed-hf"  # the claimed values in f32 as vLLM loads them
        if not folder.exists():
            reference.model.save_pretrained(folder)
            reference.tokenizer.save_pretrained(folder)

        def vllm(flags: list[str]) -> Any:
            return lambda log: start_vllm_server(args.vllm, str(folder), [*VLLM_FLAGS, *flags], log, args.threads)

        configs += [("vllm serve", "vllm serve", vllm([]), 1, True),
                    (f"vllm serve x{CONCURRENT}", "vllm serve", vllm([]), CONCURRENT, True),
                    ("vllm K/V fp8", "vllm serve", vllm(["--kv-cache-dtype", "fp8"]), 1, False)]
    configs += [(w, "llama-server", llama(quantize(args.quantize, claimed, args.out / f"claimed.{w}.gguf", w), [], 1),
                 1, False) for w in WEIGHTS if w.lower() not in claimed.name.lower()]
    configs += [(name, "llama-server", llama(claimed, flags, 1), 1, False) for name, flags in CACHES.items()]
    if args.later:
        configs.append(("later", "llama-server", llama(args.later.resolve(), [], 1), 1, False))
    refused: dict[str, str] = {}
    for name, server, start, slots, honest in configs:
        log = args.out / f"server-{name.replace('/', '').replace(' ', '-')}.log"
        try:
            proc, url = start(log)
        except ServerDidNotStart as e:  # e.g. a quantized cache whose blocks do not divide the model's head size
            refused[name] = f"{server}: {e.reason()}"
            print(f"{name}: refused by {refused[name]}", flush=True)
            continue
        try:
            engine = http_engine(EngineConfig("http", HttpOptions(url=url)), str(claimed), "fp32", args.threads, "cpu")
            with ThreadPoolExecutor(slots) as pool:  # in flight together where the server has the slots
                served = list(pool.map(partial(ask, engine, args.max_new_tokens), [p for _, p in items]))
        finally:
            stop_server(proc)
        sources[name] = scored(served, honest)  # type: ignore[arg-type]
        print(f"{name}: {sum(len(s[0]) for s in served)} tokens served", flush=True)

    cal = [k for k, (i, _) in enumerate(items) if i in calibration]
    held = [k for k, (i, _) in enumerate(items) if i not in calibration]
    nulls = {n: Items.of([sources[n].margins[k] for k in cal]) for n in null_variants}
    gap_nulls = {n: Items.of([sources[n].gaps[k] for k in cal]) for n in null_variants  # type: ignore[index]
                 if sources[n].gaps is not None}
    pooled = Items.of([sources[n].margins[k] for n in null_variants for k in cal])
    pooled_gap = Items.of([sources[n].gaps[k] for n in gap_nulls for k in cal])  # type: ignore[index]
    print(f"\nclaimed: {claimed.name}, served by llama.cpp; null: {', '.join(null_variants)} on {len(cal)} calibration "
          f"prompts ({pooled.tokens} tokens each statistic); held out: {len(held)} prompts")
    print(f"{'source':<18} {'honest':>6} {'margin':>8} {'gap':>8} {'flagged alone':>14} "
          f"{'AUC@300 m/gap':>14} {'99% power: margin':>18} {'gap':>6} {'both':>6}")
    rows, flags, decided = [], 0, 0
    for name, s in sources.items():
        m = Items.of([s.margins[k] for k in held])
        g = Items.of([s.gaps[k] for k in held]) if s.gaps is not None else None
        row: dict[str, Any] = {"source": name, "honest": s.honest, "tokens": m.tokens,
                               "margin": float(m.values.mean()), "gap": float(g.values.mean()) if g else None}
        alone = auc = power = ""
        if s.honest:
            use_gap = g is not None and len(gap_nulls) == len(nulls)
            level = share(ALPHA, 2 if use_gap else 1)
            mine = 0
            for j, k in enumerate(held):
                one = judged(PRIMARY, Items.of([s.margins[k]]), nulls, level, seed=j, needed=False).flagged
                if not one and use_gap:
                    one = judged(LOGPROB, Items.of([s.gaps[k]]), gap_nulls, level, seed=j,  # type: ignore[index]
                                 needed=False).flagged
                mine += one
            flags, decided = flags + mine, decided + len(held)
            row["flagged"] = [mine, len(held)]
            alone = f"{mine}/{len(held)}"
        else:
            c = curve(m, pooled, GRID, ALPHA, args.draws)
            row.update(auc={int(t): float(a) for t, a in zip(c.tokens, c.auc, strict=True)},
                       tokens_margin=tokens_for_power(c))
            auc = f"{row['auc'][300]:.3f}"
            if g is not None and pooled_gap.tokens:
                cg = curve(g, pooled_gap, GRID, ALPHA, args.draws)
                both = both_power(m, g, pooled, pooled_gap, args.draws)
                row.update(auc_gap={int(t): float(a) for t, a in zip(cg.tokens, cg.auc, strict=True)},
                           tokens_gap=tokens_for_power(cg), power_both=both, tokens_both=needed(both))
                auc += f"/{row['auc_gap'][300]:.3f}"
            power = " ".join(f"{'<= ' + str(row.get(k)) if row.get(k) else '-':>6}"
                             for k in ("tokens_margin", "tokens_gap", "tokens_both"))
        rows.append(row)
        gap_text = f"{row['gap']:.4f}" if row["gap"] is not None else "-"
        print(f"{name:<18} {s.honest!s:>6} {row['margin']:>8.4f} {gap_text:>8} {alone:>14} {auc:>14} {power:>26}")
    if args.json:
        args.json.write_text(json.dumps({"claimed": claimed.name, "null": list(null_variants), "calibration": len(cal),
                                         "held_out": len(held), "rows": rows, "refused": refused}, indent=1))
    if args.figure:
        figure(rows, args.figure, f"{claimed.name} claimed, served by llama.cpp: AUC by run length")
    w = wilson_interval(flags, decided) if decided else (0.0, 1.0)

    def told(r: dict[str, Any]) -> str:
        def at(key: str) -> str:
            return f"<= {r[key]}" if r.get(key) else f"> {GRID[-1]}"
        text = f"{r['source']}: AUC {r['auc'][300]:.3f} at 300 tokens, 99% power {at('tokens_margin')} (margin)"
        return text + (f", {at('tokens_both')} (both)" if "tokens_both" in r else "")

    subs = "; ".join([*(told(r) for r in rows if not r["honest"]), *(f"{n}: refused by {why.split(':')[0]}"
                                                                      for n, why in refused.items())])
    print(f"attest_servers: honest responses flagged at 1% {flags}/{decided} [{w[0]:.3f}, {w[1]:.3f}]; {subs}")


if __name__ == "__main__":
    main()
