"""Save a randomly initialised Qwen2 of a real model's shape (with a full-vocabulary tokenizer and items).

    python bench/random_model.py --shape qwen2.5-14b --out /tmp/q14b --device cuda

The weights are bf16 safetensors drawn on `--device` (a 14B model initialises in seconds on a GPU), the
tokenizer covers every embedding row (so decoding never meets an unknown ID), and `items.jsonl` beside the
model holds prompts for `stagereplay matched --data`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

SHAPES = {
    # name: (layers, hidden, heads, kv heads, intermediate, vocab)
    "qwen2.5-14b": (48, 5120, 40, 8, 13824, 152064),
    "qwen2.5-7b": (28, 3584, 28, 4, 18944, 152064),
    "50m": (8, 512, 8, 2, 1536, 28000),
    "vocab152k": (4, 256, 4, 2, 512, 151936),  # bench/scale.py's: Qwen2.5's vocabulary on a small decoder
    "tiny": (2, 64, 4, 2, 128, 256),  # the benchmarks' smoke runs (tests/test_bench.py)
}
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def save_tokenizer(path: Path, vocab_size: int) -> None:
    """Characters first, then filler tokens `<tN>` up to `vocab_size`, so every ID decodes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = SPECIALS + CHARS
    names += [f"<t{i}>" for i in range(vocab_size - len(names))]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)


def make(shape: str, device: str, seed: int = 0, eos_out_of_reach: bool = False) -> Any:
    """The random bf16 Qwen2 of `shape`, its weights drawn on `device` (in memory, nothing saved).

    `eos_out_of_reach`: EOS's output row is zero, so its logit (0) stays below the largest of the vocabulary's
    random ones and greedy decoding runs to its length limit (what a speed benchmark needs)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = config_of(shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if eos_out_of_reach:
        with torch.no_grad():
            model.lm_head.weight[config.eos_token_id] = 0.0
    return model.eval()


def config_of(shape: str) -> Any:
    """The Qwen2Config of `shape`."""
    from transformers import Qwen2Config

    layers, hidden, heads, kv, inter, vocab = SHAPES[shape]
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def config_only(shape: str, out: Path) -> Path:
    """A directory holding only `shape`'s config.json: what `stagereplay plan` reads (no weights)."""
    out.mkdir(parents=True, exist_ok=True)
    config_of(shape).save_pretrained(out)
    return out


def build(shape: str, out: Path, device: str, seed: int = 0) -> Path:
    _, _, _, _, _, vocab = SHAPES[shape]
    model = make(shape, device, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(out, vocab)
    rng = random.Random(seed)
    with open(out / "items.jsonl", "w") as f:
        for i in range(200):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"id": f"r{i:03d}", "prompt": f"Q: {a}+{b}=? Show your steps.\n",
                                "answer": str(a + b)}) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="50m")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t = time.perf_counter()
    build(args.shape, args.out, args.device, args.seed)
    print(f"saved a random {args.shape} to {args.out} in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
