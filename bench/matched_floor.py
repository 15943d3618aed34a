"""A whole `stagereplay matched` run against the floor made of its own forward passes, timed bare.

    python bench/matched_floor.py [--model DIR] [--data FILE] [--n 50] [--boundary-after N] [--repeats 1]
                                  [--max-new-tokens 128] [--threads 1] [--device cpu] [--json OUT]

Per item, matched makes these forwards (P = prompt + stage 1 through the boundary, S = a suffix):

- live, and its replica from scratch: the prompt in one forward, then one token per forward through
  P[T-1] and on through the suffix but its last token: 1 + (T - |prompt|) + |S| - 1;
- two one-shot constructions: one forward over P[0:T-1] each;
- two continuations: P[T-1], then the suffix but its last token: |S| each;
- an item that never reaches the boundary: the prompt, then every generated token but the last.

The floor replays exactly those forwards from the ledger's token IDs on a bare DynamicCache (model call +
argmax, nothing else). The ratio matched / floor counts everything else matched does: snapshots, cache
fingerprints, scoring, the ledger, the report. Both sides include one model load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def item_forwards(payload: dict[str, Any]) -> list[tuple[list[int], list[int]]]:
    """The forwards matched made for one item, as (first forward's ids, single tokens fed after it) per pass."""
    prompt = payload["prompt_ids"]
    if payload["status"] != "ok":
        return [(prompt, payload["generated_ids"][:-1])]
    prefix = payload["prefix_ids"]
    arms = {a["name"]: a for a in payload["arms"]}
    passes = []
    for name in ("live", "live#replica"):
        if name in arms:  # the live pass feeds stage 1 (pending token included) and its suffix but the last
            passes.append((prompt, prefix[len(prompt) :] + arms[name]["suffix_ids"][:-1]))
    for name, arm in arms.items():
        if not name.startswith("live"):  # a fresh construction: one forward, then the continuation
            passes.append((prefix[:-1], [prefix[-1], *arm["suffix_ids"][:-1]]))
    return passes


def floor_seconds(lm: Any, passes: list[tuple[list[int], list[int]]]) -> float:
    import torch
    from transformers import DynamicCache

    model, device = lm.model, lm.config.device
    t0 = time.perf_counter()
    with torch.inference_mode():
        for first, tokens in passes:
            cache = DynamicCache(config=model.config)
            ids = torch.tensor([first], device=device)  # (1, n)
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax()
            for t in tokens:
                ids = torch.tensor([[t]], device=device)  # (1, 1)
                model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded toy)")
    p.add_argument("--data", default=None, help="JSONL items (default: the toy task)")
    p.add_argument("--n", type=int, default=50, help="items")
    p.add_argument("--boundary-after", type=int, default=None, help="stage 1 is the first N generated tokens")
    p.add_argument("--max-new-tokens", type=int, default=128, help="suffix length limit")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--precision", default="bf16", help="bf16 | fp16 | fp32 | fp32-compute")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:<i>")
    p.add_argument(
        "--repeats", type=int, default=1, help="alternated repeats of both sides; medians reported"
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from stagereplay.engine.boundary import After
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.lm import load
    from stagereplay.records.ledger import items, read_ledger
    from stagereplay.runs import Inputs, matched

    model = args.model
    if model is None:
        from stagereplay.toy import toy_checkpoint

        model = str(toy_checkpoint("primary"))
        if not (Path(model) / "config.json").is_file():
            print("the embedded toy checkpoint is missing: pass --model DIR (and --data/--boundary-after)")
            return 2
    # Untimed warm-up, so that neither side pays for first imports and first-use kernel setup.
    warm = load(model, args.precision, args.device, args.threads)
    warm.generate([1, 2, 3], 4)
    del warm
    boundary = After(args.boundary_after) if args.boundary_after else None
    matched_times, load_times, forward_times, ledgers = [], [], [], set()
    for _ in range(args.repeats):  # alternated, so drift hits both sides alike
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            matched(Path(tmp) / "run", Inputs.of(
                model=model, data=args.data, n=args.n, boundary=boundary,
                decode=DecodeConfig(max_new_tokens=args.max_new_tokens), precision=args.precision, device=args.device,
                threads=args.threads), quiet=True)
            matched_times.append(time.perf_counter() - t0)
            records = items(read_ledger(Path(tmp) / "run"))  # the item records, not the stage and environment ones
            ledgers.add(records[-1].hash)
        t0 = time.perf_counter()
        lm = load(model, args.precision, args.device, args.threads)
        load_times.append(time.perf_counter() - t0)
        passes = [p for r in records for p in item_forwards(r.payload)]
        forward_times.append(floor_seconds(lm, passes))
        del lm
    assert len(ledgers) == 1, "repeated matched runs wrote different ledgers"
    matched_s, load_s = statistics.median(matched_times), statistics.median(load_times)
    forwards_s = statistics.median(forward_times)
    n_forwards = sum(1 + len(tokens) for _, tokens in passes)
    floor_s = load_s + forwards_s
    ok = sum(r.payload["status"] == "ok" for r in records)
    print(
        f"matched on {len(records)} items ({ok} reached the boundary), {args.precision}, {args.device}, "
        f"{args.threads} thread(s): {n_forwards} forwards in {len(passes)} passes; median of {args.repeats}"
    )
    print(f"matched run (load, items, ledger, report)  {matched_s:8.2f} s")
    print(f"floor: load {load_s:.2f} s + bare forwards {forwards_s:.2f} s  {floor_s:8.2f} s")
    print(f"matched / floor                            {matched_s / floor_s:8.3f}x   (target <= 1.15x)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "items": len(records),
                    "boundary_items": ok,
                    "forwards": n_forwards,
                    "passes": len(passes),
                    "matched_s": matched_s,
                    "load_s": load_s,
                    "forwards_s": forwards_s,
                    "floor_s": floor_s,
                    "ratio": matched_s / floor_s,
                    "threads": args.threads,
                    "precision": args.precision,
                    "device": args.device,
                    "repeats": {
                        "matched_s": matched_times,
                        "load_s": load_times,
                        "forwards_s": forward_times,
                    },
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
