"""The CUDA checks behind `bench/gpu_check.sh`, printing one table (no downloads; not yet run on a GPU).

    python bench/gpu_check.py --tests-summary "56 passed" --toy-run /tmp/toy-cuda --out gpu-out

Rows: the tiny-architecture tests' summary (run by the shell script); the toy's `matched` in bf16 on all 200
held-out items with its divergence count beside the CPU's (as measured for the README); a random Qwen2 of
DeepSeek-R1-Distill-Qwen-14B's shape (48 layers, hidden 5120, 40 heads, 8 KV heads) on 8 prompts with a
1,024-token stage 1: our loop's tokens/s against `generate()`'s, whether their tokens are equal, the live
boundary snapshot's fingerprint time, and peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

TOY_CPU_DIVERGENT = "10/200"  # README, "The embedded toy model": primary, bf16, CPU


def big_model(tmp: Path, shape: str = "qwen2.5-14b", device: str = "cuda") -> Any:
    """An `LM` over a random Qwen2 of R1-Distill-Qwen-14B's shape (Qwen2.5-14B's), bf16, drawn on the GPU and
    kept in memory (saving and reloading 28 GB would cost minutes)."""
    import torch
    from random_model import SHAPES, save_tokenizer  # bench/ is on sys.path when this runs as a script
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from stagereplay.engine.lm import LM
    from stagereplay.engine.model import ModelConfig, set_determinism

    layers, hidden, heads, kv, inter, vocab = SHAPES[shape]  # qwen2.5-14b: 48, 5120, 40, 8, 13824, 152064
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    determinism = set_determinism(1, device)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    save_tokenizer(tmp, vocab)
    settings = ModelConfig(path=str(tmp), precision="bf16", device=device)
    return LM(model.eval(), AutoTokenizer.from_pretrained(tmp), settings, determinism)


def throughput(lm: Any, prompts: int, stage1: int, row: Any) -> None:
    """Our loop and generate() on each prompt, greedy, up to `stage1` tokens; rows as they are measured."""
    import torch

    from stagereplay.engine.boundary import After
    from stagereplay.engine.cache import cache_fingerprint
    from stagereplay.engine.lm import NoBoundary

    texts = [f"Q: {10 + i}+{30 + 2 * i}=? Show your steps.\n" for i in range(prompts)]
    cuda = lm.config.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    lm.generate(lm.tokenizer.encode(texts[0]), 8)  # capture the step once, outside the timing
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    prompt = lm.tokenizer.encode(texts[0])
    try:  # the boundary state a matched run would fingerprint: the live cache at the end of stage 1
        state = lm.live(prompt, After(stage1), keep_going=False)
        t = time.perf_counter()
        cache_fingerprint(state.cache)
        row(f"14B-shape: fingerprint of a {len(state.prefix) - 1}-position cache (s)", f"{time.perf_counter() - t:.2f}")
        del state
    except NoBoundary as nb:
        row("14B-shape: fingerprint", f"skipped (EOS after {len(nb.generated)} tokens)")
    ours = theirs = 0.0
    n_ours = n_theirs = equal = 0
    for i, text in enumerate(texts):
        prompt = lm.tokenizer.encode(text)
        sync()
        t = time.perf_counter()
        mine = lm.generate(prompt, stage1)
        sync()
        ours += time.perf_counter() - t
        ids = torch.tensor([prompt], device=lm.config.device)
        t = time.perf_counter()
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=stage1)
        sync()
        theirs += time.perf_counter() - t
        reference = out[0, len(prompt) :].tolist()
        n_ours, n_theirs, equal = n_ours + len(mine), n_theirs + len(reference), equal + (mine == reference)
        print(f"   prompt {i}: {len(mine)} tokens, ours {n_ours / ours:.1f} tok/s, generate() {n_theirs / theirs:.1f}"
              f" tok/s so far", flush=True)
    row(f"14B-shape, {prompts} prompts x up to {stage1} tokens: our loop tok/s", f"{n_ours / ours:.1f}")
    row("14B-shape: generate() tok/s", f"{n_theirs / theirs:.1f}")
    row("14B-shape: our tokens == generate()'s", f"{equal}/{prompts}")
    if cuda:
        row("14B-shape: peak GPU memory (GiB)", f"{torch.cuda.max_memory_allocated() / 2**30:.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tests-summary", default="not run")
    p.add_argument("--toy-run", type=Path, help="a `stagereplay matched --device cuda` run of the toy")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--stage1", type=int, default=1024)
    p.add_argument("--out", type=Path, default=Path("gpu-out"))
    p.add_argument("--shape", default="qwen2.5-14b", help="a random_model.py shape (50m: a CPU smoke test)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    table = args.out / "gpu_check.txt"
    table.write_text("")

    def row(name: str, value: str) -> None:  # printed as measured, so a timeout still leaves the rows so far
        line = f"{name:<64}  {value}"
        print(line, flush=True)
        with open(table, "a") as f:
            f.write(line + "\n")

    row("device", torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device)
    row("tiny architectures, live == generate() bitwise on CUDA", args.tests_summary)
    if args.toy_run and (args.toy_run / "results.json").exists():
        m = json.loads((args.toy_run / "results.json").read_text())["matched"][0]
        row("toy matched bf16, live vs one-shot divergent: CUDA | CPU",
            f"{m['suffix_disagreements']['k']}/{m['n_boundary']} | {TOY_CPU_DIVERGENT}")
    else:
        row("toy matched bf16", "no run")
    import tempfile

    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        lm = big_model(Path(tmp), args.shape, args.device)
        row("14B-shape random model built on the GPU (s)", f"{time.perf_counter() - t:.0f}")
        throughput(lm, args.prompts, args.stage1, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
