"""Batched exact replay: items and tokens per second against the batch's row count C, with the invariance
check's answer for each C.

    python bench/batch.py [--models toy,50m,vocab152k] [--rows 1,4,16,64] [--items 64] [--tokens 32]
                          [--precision bf16] [--threads 1] [--json OUT]

Each model decodes `--items` greedy continuations of `--tokens` tokens from distinct prompts, as the experiments'
item functions do (a prefill per item, then single-token steps):

- C = 1: the batch-1 engine (`LM.generate`: captured single-token steps), one item after another;
- C > 1: item threads whose steps a `Batcher` gathers into forwards of C rows (engine.batcher), items joining as
  others finish; before they start, `LM.prove_batch` checks on the model's own shapes that a row's bits do not
  depend on its batch-mates, and says whether they equal batch 1's (the `check` column).

The script asserts that every C's tokens are the batch-1 tokens wherever the check says batching changes no bit.
Models: `toy` (the embedded checkpoint), `50m` and `vocab152k` (random Qwen2s of bench/common.py's shapes,
EOS out of reach so every item decodes its full length).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import save_random_model


def load_model(name: str, precision: str, threads: int, scratch: Path) -> Any:
    from stagereplay.engine.lm import load

    if name == "toy":
        from stagereplay.toy import toy_checkpoint

        return load(str(toy_checkpoint("primary")), precision=precision, threads=threads)
    path = scratch / name
    if not path.exists():
        save_random_model(name, path, "cpu", eos_out_of_reach=True)
    return load(str(path), precision=precision, threads=threads)


def prompts(lm: Any, n: int) -> list[list[int]]:
    return [lm.tokenizer.encode(f"Q: {10 + i % 90}+{11 + (7 * i) % 89}=? Show your steps.\n") for i in range(n)]


def run(lm: Any, items: list[list[int]], tokens: int, rows: int) -> tuple[float, list[list[int]], str]:
    """(seconds, each item's tokens, the check's answer) for one row count."""
    from stagereplay.engine.batcher import batched

    if rows == 1:
        lm.prove(items[0], max(len(p) for p in items) + tokens)  # as a run proves its captured step first
        start = time.perf_counter()
        out = [lm.generate(p, tokens) for p in items]
        return time.perf_counter() - start, out, "batch 1"
    from stagereplay.engine.proof import prove_batched

    check = prove_batched(lm.model, rows, "cpu", items[:3])
    answer = ("invariant, = batch 1" if check.equals_batch_1 else "invariant, != batch 1") if check.invariant \
        else "NOT invariant"
    with batched(lm, rows) as batcher, ThreadPoolExecutor(max_workers=rows) as threads:
        start = time.perf_counter()
        futures = [threads.submit(batcher.run, lm.generate, p, tokens) for p in items]
        out = [f.result() for f in futures]
        seconds = time.perf_counter() - start
    return seconds, out, answer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="toy,50m,vocab152k")
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    table: list[dict[str, Any]] = []
    print(f"{'model':10} {'C':>3} {'items/s':>8} {'tokens/s':>9} {'speed-up':>8}  check")
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            lm = load_model(name, args.precision, args.threads, Path(scratch))
            items = prompts(lm, args.items)
            base: tuple[float, list[list[int]]] | None = None
            for rows in (int(r) for r in args.rows.split(",")):
                seconds, out, answer = run(lm, items, args.tokens, rows)
                if base is None:
                    base = (seconds, out)
                if answer.endswith("= batch 1") and not answer.endswith("!= batch 1"):
                    assert out == base[1], f"{name} C={rows}: tokens differ from batch 1's though the check said equal"
                emitted = sum(len(o) for o in out)
                row = {"model": name, "rows": rows, "items_per_s": len(items) / seconds, "tokens_per_s": emitted / seconds,
                       "speedup": base[0] / seconds, "check": answer}
                table.append(row)
                print(f"{name:10} {rows:>3} {row['items_per_s']:8.2f} {row['tokens_per_s']:9.1f} {row['speedup']:7.2f}x  "
                      f"{answer}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    best = max(table, key=lambda r: r["speedup"])
    print(f"best: {best['model']} at C={best['rows']}, {best['speedup']:.2f}x batch 1's tokens/s")


if __name__ == "__main__":
    main()
