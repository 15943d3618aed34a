"""Memory of `matched` at a real vocabulary: what a long suffix costs besides the model and its caches.

    python bench/scale.py                 # vocab 151,936, 4 layers, hidden 256, stage 1 of 1024, suffix 512, 2 items
    python bench/scale.py --tiny          # the same path at a toy size, in seconds (a smoke run)
    python bench/scale.py --batch 8       # 8 items stepping together (16 items): C times one item's caches

A random Qwen2 with the Qwen2.5 vocabulary (151,936), 4 layers, hidden 256, 4 query and 2 KV heads of 64, MLP
512, context 8192, bf16, runs `stagereplay.runs.matched --n 2 --boundary-after 1024 --max-new-tokens 512` on the
CPU (one thread). EOS is out of reach, so every suffix runs its full length. The forwards are cheap and the
caches small; the vocabulary is full size, which is the worst case for anything kept per step x vocabulary.

Printed:

- the process floor: RSS once torch and transformers are imported, the model is loaded and its captured step
  made (a short `generate`), before the first item;
- the peak RSS of the run (the high-water mark is reset after the floor, where the kernel allows);
- the weights, one boundary cache at the longest prefix + suffix, and the most K/V caches the engine made that
  were alive at once (counted by weak references over every cache `new_cache` and `clone_cache` return);
- the full logits the continuations kept (the largest sum over one item's continuations, each read as it
  returns), from what each continuation holds, so the same script measures any version of the engine (the
  diagnostics' replay of a divergent step adds one [V] per divergent pair while the item's record is made).

With `--batch C` (items: 2C unless given), up to C items run at once (engine.batcher): the most caches alive are
at most C times one item's (matched: 4 per item), and the logits kept are counted per item thread.

The target is peak <= 1.15 x (floor + weights + the most caches alive x one cache). The last line is
`peak RSS N MiB, floor F MiB, caches C MiB, logits kept L MiB`.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import SCALE_RUNS, SHAPES, rss_mib, save_random_model, think_items

PER_ITEM = 4  # the most K/V caches one matched item holds at once (tests/test_cache_count.py)


def workload(kind: str) -> dict[str, int]:
    """The shape and the lengths of a run (`full` or `tiny`, bench/common.py's SCALE_RUNS), as the figures say them."""
    run = SCALE_RUNS[kind]
    s = SHAPES[run.shape]
    return {"vocab": s.vocab, "layers": s.layers, "hidden": s.hidden, "heads": s.heads, "kv_heads": s.kv_heads,
            "mlp": s.intermediate, "context": s.context, "stage1": run.stage1, "suffix": run.suffix,
            "items": run.items}


class CacheCount:
    """Weak references to every cache the engine makes; `peak` is the most alive right after any was made."""

    def __init__(self) -> None:
        self.alive: weakref.WeakSet[Any] = weakref.WeakSet()
        self.peak = 0

    def wrap(self, owner: Any, attr: str) -> None:
        fn = getattr(owner, attr)

        def counted(*args: Any, **kwargs: Any) -> Any:
            cache = fn(*args, **kwargs)
            self.alive.add(cache)
            self.peak = max(self.peak, len(self.alive))
            return cache

        setattr(owner, attr, counted)


class LogitsKept:
    """Bytes of full [V] logits held by the continuations of the item being run (max over items; an item is a
    thread under `--batch`)."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.peak = 0

    @property
    def item(self) -> int:
        return getattr(self.local, "item", 0)

    @item.setter
    def item(self, value: int) -> None:
        self.local.item = value

    def wrap_continue(self, lm_class: Any) -> None:
        fn = lm_class._continue

        def counted(*args: Any, **kwargs: Any) -> Any:
            cont = fn(*args, **kwargs)
            self.item += kept_bytes(cont)
            self.peak = max(self.peak, self.item)
            return cont

        lm_class._continue = counted

    def wrap_item(self, module: Any, attr: str) -> None:
        fn = getattr(module, attr)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.item = 0
            return fn(*args, **kwargs)

        setattr(module, attr, counted)


def kept_bytes(cont: Any) -> int:
    """Full-vocabulary logits a continuation holds: every step's (older engines) or the few it keeps."""
    tensors = list(getattr(cont, "steps", ()) or ())
    record = getattr(cont, "record", None)
    if record is not None:
        tensors += list(record.full.values())
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if hasattr(t, "untyped_storage") and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS; False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a toy-sized shape that runs in seconds (smoke run)")
    p.add_argument("--items", type=int, default=None, help="items (default 2)")
    p.add_argument("--batch", type=int, default=1, help="items stepping together (--batch C)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    kind = "tiny" if args.tiny else "full"
    shape = workload(kind)
    shape["items"] = args.items or (2 * args.batch if args.batch > 1 else shape["items"])

    import torch

    torch.set_num_threads(1)
    from stagereplay.engine import lm as lm_module
    from stagereplay.engine.boundary import After
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.model import ModelConfig
    from stagereplay.execution.local import cached_lm
    from stagereplay.experiments.protocol import matched as matched_module
    from stagereplay.runs import Inputs, matched

    caches, logits = CacheCount(), LogitsKept()
    caches.wrap(lm_module, "new_cache")  # lm.py binds both names at import: wrap them where they are called
    caches.wrap(lm_module, "clone_cache")
    logits.wrap_continue(lm_module.LM)
    logits.wrap_item(matched_module, "matched_item")
    with tempfile.TemporaryDirectory() as tmp:
        # EOS's logit 0 stays below the largest random one: every suffix runs its full length.
        model = save_random_model(SCALE_RUNS[kind].shape, Path(tmp) / "model", eos_out_of_reach=True)
        data = think_items(Path(tmp) / "items.jsonl", shape["items"])
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
        # The floor: the model the run will reuse (one per process), loaded, its decode step captured.
        lm = cached_lm(ModelConfig(path=str(model.resolve()), precision="bf16", device="cpu", threads=1))
        lm.generate(lm.tokenizer.encode("Q: 1+1=? Think.\n"), 8)
        del lm  # the cache count runs on: a cache the captured step kept alive stays counted
        floor = rss_mib()
        resettable = reset_peak()
        start = time.perf_counter()
        results = matched(Path(tmp) / "run", Inputs.of(
            model=str(model), data=str(data), boundary=After(shape["stage1"]),
            decode=DecodeConfig(max_new_tokens=shape["suffix"], max_stage1_tokens=shape["stage1"]), precision="bf16",
            device="cpu", threads=1, batch=args.batch), quiet=True)
        seconds = time.perf_counter() - start
        ledger = [json.loads(line) for line in (Path(tmp) / "run" / "ledger.jsonl").read_text().splitlines()]
    peak = peak_mib()
    payloads = [r["payload"] for r in ledger if r.get("kind", "item") == "item" and "payload" in r]
    lengths = [(q["boundary"], max(len(a["suffix_ids"]) for a in q["arms"])) for q in payloads if q["arms"]]
    positions = max(b + n for b, n in lengths)
    head_dim = shape["hidden"] // shape["heads"]
    cache_mib = shape["layers"] * 2 * shape["kv_heads"] * head_dim * 2 * positions / 2**20  # K and V, bf16
    caches_mib = caches.peak * cache_mib
    logits_mib = logits.peak / 2**20
    target = 1.15 * (floor + weights + caches_mib)
    m = results.sections["matched"][0]
    print(f"model: random Qwen2, vocab {shape['vocab']:,}, {shape['layers']} layers, hidden {shape['hidden']}, "
          f"{shape['kv_heads']} KV heads of {head_dim}, context {shape['context']}; weights {weights:.0f} MiB; "
          f"bf16, cpu, {torch.get_num_threads()} thread(s)")
    print(f"matched --n {shape['items']} --boundary-after {shape['stage1']} --max-new-tokens {shape['suffix']}: "
          f"{seconds:.1f} s; prefixes {[b for b, _ in lengths]}, suffixes {[n for _, n in lengths]}; "
          f"suffix disagreements {m.suffix_disagreements.k}/{m.n_boundary}")
    print(f"process floor (torch, transformers, the model, its captured step): {floor:.0f} MiB")
    print(f"one cache of {positions} positions {cache_mib:.2f} MiB; most caches alive at once {caches.peak} "
          f"= {caches_mib:.2f} MiB (--batch {args.batch}: at most {args.batch} x {PER_ITEM} = "
          f"{args.batch * PER_ITEM}: {'met' if caches.peak <= args.batch * PER_ITEM else 'NOT met'})")
    print(f"full logits kept by one item's continuations: {logits_mib:.1f} MiB")
    print(f"peak RSS {peak:.0f} MiB{'' if resettable else ' (since the process started)'}; target <= 1.15 x "
          f"(floor + weights + caches) = {target:.0f} MiB: {'met' if peak <= target else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"shape": shape, "batch": args.batch, "seconds": seconds, "floor_mib": floor,
                                         "peak_rss_mib": peak, "weights_mib": weights, "cache_mib": cache_mib,
                                         "caches_alive": caches.peak, "caches_mib": caches_mib,
                                         "logits_kept_mib": logits_mib, "target_mib": target}, indent=2) + "\n")
    print(f"peak RSS {peak:.0f} MiB, floor {floor:.0f} MiB, caches {caches_mib:.1f} MiB, "
          f"logits kept {logits_mib:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
