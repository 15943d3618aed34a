"""Decode speed at batch 1 against the bandwidth floor: our loop and generate(), each on a dynamic and a static cache.

    python bench/gpu_decode.py --shape 14b --device cuda      # the 14B shape, random weights made on the GPU
    python bench/gpu_decode.py --shape 7b --device cuda
    python bench/gpu_decode.py --shape tiny --device cpu      # the smoke run (tests/test_bench.py)

A random bf16 Qwen2 of the shape (bench/common.py's builder: Qwen2.5-7B's or -14B's layers, widths and 152k
vocabulary) is made on `--device`; nothing is downloaded or saved. From one prompt of `--prompt` tokens each
method emits `--tokens` greedy tokens (EOS is out of reach, so every run is that long), `--repeats` times after
one warm-up run (which captures what is captured); the median is reported:

- `ours dynamic`: `LM.generate`, the live loop every experiment uses, on a DynamicCache (`--cache dynamic`);
- `ours static`: the same loop on a StaticCache (`--cache static`), its steps replayed as CUDA graphs on a GPU;
- `generate dynamic`: `model.generate(do_sample=False)`;
- `generate static`: `model.generate(do_sample=False, cache_implementation="static", disable_compile=True)`
  (on CUDA generate() would otherwise compile the forward with inductor: fused kernels, other numbers).

Tokens/s counts the emitted tokens over the whole call, prefill included. The floor is the time a step cannot
beat at batch 1: reading every weight once, at the device's measured copy bandwidth (bytes read + written per
second by a large `copy_`). `x floor` is each method's time per token over the floor's; the target on a GPU is
within 2x. Each loop's tokens are checked against its generate() counterpart's. The last line is
`ours static: X.XXx floor, tokens == generate(): yes|no`. `--profile` then splits a matched item's steps on each
cache into the forward, the pick, the step record and the rest, with host reads and syncs per step
(bench/step_profile.py's figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import (
    SHAPES,
    SHORT_NAMES,
    bare_lm,
    copy_bandwidth,
    device_seconds,
    fixed_prompt,
    profile_line,
    profile_live,
    random_model,
    sync,
)


def timed(fn: Callable[[], list[int]], device: str, repeats: int) -> tuple[float, list[int]]:
    """Median seconds of `repeats` calls after one warm-up call, and the tokens the last call emitted."""
    fn()
    times, tokens = device_seconds(fn, device, repeats)
    return statistics.median(times), tokens


def our_lms(model: Any, device: str) -> dict[str, Any]:
    """Our engine on `model`, one LM per cache kind."""
    return {kind: bare_lm(model, device, kind) for kind in ("dynamic", "static")}


def methods(model: Any, ours: dict[str, Any], prompt: list[int], n: int, device: str
            ) -> dict[str, Callable[[], list[int]]]:
    import torch

    ids = torch.tensor([prompt], device=device)

    def generate(**kw: Any) -> list[int]:
        if hasattr(model, "_previous_max_cache_length"):  # generate() would reuse its largest static cache size
            del model._previous_max_cache_length
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **kw)
        return [int(t) for t in out[0, len(prompt):]]

    return {
        "ours dynamic": lambda: ours["dynamic"].generate(prompt, n),
        "ours static": lambda: ours["static"].generate(prompt, n),
        "generate dynamic": lambda: generate(),
        "generate static": lambda: generate(cache_implementation="static", disable_compile=True),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHORT_NAMES), default="14b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--copy-mib", type=int, default=0, help="copy size for the bandwidth (default: 2048 on CUDA, 256)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--profile", action="store_true",
                   help="then profile a matched item's live arm on each cache (bench/step_profile.py): where a step's "
                        "time goes, --tokens split between stage 1 and the suffix")
    args = p.parse_args(argv)

    import torch

    from stagereplay.engine.model import set_determinism

    set_determinism(args.threads, args.device)
    t = time.perf_counter()
    model = random_model(SHORT_NAMES[args.shape], args.device, eos_out_of_reach=True)
    sync(args.device)
    built = time.perf_counter() - t
    weight_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
    bandwidth = copy_bandwidth(args.device, args.copy_mib or (2048 if args.device.startswith("cuda") else 256))
    floor = weight_bytes / bandwidth  # seconds per token
    prompt = fixed_prompt(SHAPES[SHORT_NAMES[args.shape]].vocab, args.prompt)
    rows, tokens = {}, {}
    ours = our_lms(model, args.device)
    for name, fn in methods(model, ours, prompt, args.tokens, args.device).items():
        seconds, tokens[name] = timed(fn, args.device, args.repeats)
        rows[name] = seconds / len(tokens[name])
    same = {kind: tokens[f"ours {kind}"] == tokens[f"generate {kind}"] for kind in ("dynamic", "static")}
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"{args.shape} shape: random bf16 Qwen2, {weight_bytes / 2**30:.2f} GiB of weights (made in {built:.1f} s); "
          f"{name}, {torch.get_num_threads()} thread(s); prompt {args.prompt}, {args.tokens} tokens, "
          f"median of {args.repeats}")
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s -> floor {1e3 * floor:.3f} ms/token "
          f"({1 / floor:.1f} tokens/s)")
    print(f"{'method':18}{'tokens/s':>12}{'ms/token':>11}{'x floor':>9}")
    for method, per in rows.items():
        print(f"{method:18}{1 / per:12.1f}{1e3 * per:11.3f}{per / floor:9.2f}")
    print(f"{'floor':18}{1 / floor:12.1f}{1e3 * floor:11.3f}{1.0:9.2f}")
    print(f"tokens == generate(): dynamic {'yes' if same['dynamic'] else 'no'}, static {'yes' if same['static'] else 'no'}")
    profiles = {}
    if args.profile:
        for kind, lm in ours.items():
            profiles[kind] = profile_live(lm, prompt, args.tokens // 2, args.tokens - args.tokens // 2)
            print(profile_line(f"ours {kind}", profiles[kind]))
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "device": name, "weight_bytes": weight_bytes,
                                         "copy_bytes_per_s": bandwidth, "floor_s_per_token": floor,
                                         "s_per_token": rows, "tokens_equal": same, "profile": profiles},
                                        indent=2) + "\n")
    print(f"ours static: {rows['ours static'] / floor:.2f}x floor, tokens == generate(): "
          f"{'yes' if all(same.values()) else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
