"""Save a randomly initialised Qwen2 of a real model's shape (with a full-vocabulary tokenizer and items).

    python bench/random_model.py --shape qwen2.5-14b --out /tmp/q14b --device cuda

The weights are bf16 safetensors drawn on `--device` (a 14B model initialises in seconds on a GPU), the
tokenizer covers every embedding row (so decoding never meets an unknown ID), and `items.jsonl` beside the
model holds prompts for `stagereplay matched --data`. The shapes and the builder are bench/common.py's, the
ones every benchmark draws its random models with.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import SHAPES, arithmetic_items, save_random_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="50m")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t = time.perf_counter()
    save_random_model(args.shape, args.out, args.device, args.seed)
    arithmetic_items(args.out / "items.jsonl", seed=args.seed)
    print(f"saved a random {args.shape} to {args.out} in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
