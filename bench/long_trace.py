"""Cost of a long reasoning trace: `matched` with a 2,048-token stage 1 on R1-Distill-1.5B's cache shape.

    python bench/long_trace.py                          # 4 items, stage 1 of 2048, suffix 256, CPU, 1 thread
    python bench/long_trace.py --stage1 256 --items 2   # a quick look
    python bench/long_trace.py --device cuda
    python bench/long_trace.py --cache static           # a preallocated cache, written in place

A random Qwen2 with DeepSeek-R1-Distill-Qwen-1.5B's cache (28 layers, 2 KV heads of 128) but a narrow hidden
size (256, 2 query heads, MLP 512, vocabulary 1024) so that a CPU runs it: the forwards are cheap, the caches
full size, which is the worst case for the work outside the forwards. Each item runs the whole `matched`
protocol through `stagereplay.runs.matched` (live + replica, one-shot + replica, ledger, report). Stage 1 ends
after exactly `--stage1` tokens (`after:N`); EOS is made unreachable so every suffix runs to `--suffix`.

Printed: wall time in forwards (`Stepper.forward`), time outside them in the item loop, split into
fingerprints, clones, ledger writes and the rest (sampling, boundary watch, records), bytes streamed to the
host for fingerprints, and peak RSS against the weights and one cache. The last line is
`overhead X.XX% of forward time, peak RSS N MiB`.

`--cache static` runs the same protocol on a static cache (`stagereplay matched --cache static`): each cache is
allocated once for prompt + stage 1 + suffix - 1 positions and written in place, where the dynamic cache
concatenates its K/V at every step (quadratic copying in the trace length), but each step attends over all the
allocated rows (masked).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import SHAPES, rss_mib, save_random_model, think_items

SHAPE = SHAPES["r1-cache"]  # DeepSeek-R1-Distill-Qwen-1.5B's cache shape on a narrow decoder
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN = SHAPE.layers, SHAPE.kv_heads, SHAPE.head_dim, SHAPE.hidden


class Clock:
    """Wall time and calls of wrapped functions, by name; those made while a proof runs (`apart`) by that name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.apart: str | None = None  # set while a proof runs: its forwards are its own, not the items'

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            key = f"{self.apart} {name}" if self.apart and self.apart != name else name
            if name == "proof":
                self.apart = name
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if name == "proof":
                    self.apart = None
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t
                self.calls[key] = self.calls.get(key, 0) + 1

        setattr(owner, attr, timed)


def instrument(clock: Clock, streamed: list[int]) -> None:
    """Time forwards, fingerprints, clones, ledger writes and the item loop; count bytes sent to the hasher."""
    from stagereplay.engine import cache, decode, lm, prover
    from stagereplay.experiments.core import experiment
    from stagereplay.records import ledger

    clock.wrap(decode.Stepper, "forward", "forwards")
    clock.wrap(prover, "prove_steps", "proof")  # before the items, and apart from them (engine.proof)
    clock.wrap(cache, "cache_fingerprint", "fingerprints")
    clock.wrap(lm, "cache_fingerprint", "fingerprints")  # lm.py binds the name at import
    clock.wrap(lm, "clone_cache", "clones")
    clock.wrap(ledger.Run, "append", "ledger")
    clock.wrap(experiment, "append_jobs", "item loop")  # every stage's jobs, run and recorded
    chunks: Callable[..., Any] = cache._host_chunks

    def counted(t: Any) -> Any:
        for c in chunks(t):
            streamed[0] += c.nbytes
            yield c

    cache._host_chunks = counted  # type: ignore[assignment]  # a counting wrapper of the same generator


def warm_up(model: Path, args: argparse.Namespace, clock: Clock) -> None:
    """Load the model the run will reuse (one per process) and capture its decode step, then zero the clock:
    dynamo's one-time capture is a cost of the process, not of the items."""
    from stagereplay.engine.model import ModelConfig
    from stagereplay.execution.local import cached_lm

    config = ModelConfig(path=str(model.resolve()), precision=args.precision, device=args.device,
                         threads=args.threads, cache=args.cache)
    lm = cached_lm(config)
    lm.generate(lm.tokenizer.encode("Q: 1+1=? Think.\n"), 8)
    clock.seconds.clear()
    clock.calls.clear()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=4)
    p.add_argument("--stage1", type=int, default=2048)
    p.add_argument("--suffix", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from stagereplay.engine.boundary import After
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.records.ledger import items, read_ledger
    from stagereplay.runs import Inputs, matched

    clock, streamed = Clock(), [0]
    instrument(clock, streamed)
    with tempfile.TemporaryDirectory() as tmp:
        # EOS's logit 0 stays below the largest of 1023 random ones: every suffix runs its full length.
        model = save_random_model("r1-cache", Path(tmp) / "model", eos_out_of_reach=True)
        data = think_items(Path(tmp) / "items.jsonl", args.items)
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
        warm_up(model, args, clock)
        start = time.perf_counter()
        results = matched(Path(tmp) / "run", Inputs.of(
            model=str(model), data=str(data), boundary=After(args.stage1),
            decode=DecodeConfig(max_new_tokens=args.suffix, max_stage1_tokens=args.stage1), precision=args.precision,
            device=args.device, threads=args.threads, cache=args.cache), quiet=True)
        total = time.perf_counter() - start
        # The library's own reader: the chain also holds stage and environment records, which are not items.
        ledger = [r.payload for r in items(read_ledger(Path(tmp) / "run"))]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    s = clock.seconds
    forwards, loop = s.get("forwards", 0.0), s.get("item loop", 0.0)
    outside = loop - forwards
    named = {k: s.get(k, 0.0) for k in ("fingerprints", "clones", "ledger")}
    rest = outside - sum(named.values())
    lengths = [(p["boundary"], len(p["arms"][0]["suffix_ids"])) for p in ledger]
    positions = max(b + n for b, n in lengths)
    cache_mib = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2 * positions / 2**20  # K and V, bf16, every position
    m = results.sections["matched"][0]
    print(f"model: random Qwen2, {LAYERS} layers, {KV_HEADS} KV heads of {HEAD_DIM}, hidden {HIDDEN}; "
          f"weights {weights:.0f} MiB; {args.precision}, {args.device}, {torch.get_num_threads()} thread(s), "
          f"{args.cache} cache")
    print(f"items {len(ledger)}: prefix lengths (prompt + stage 1) {[b for b, _ in lengths]}, "
          f"suffixes {[n for _, n in lengths]}; one cache of {positions} positions = {cache_mib:.1f} MiB")
    print(f"matched: live replica exact {m.replica_exact['live'].k}/{m.n_boundary}, "
          f"suffix disagreements {m.suffix_disagreements.k}/{m.n_boundary}")
    print(f"{'':24}{'seconds':>10}{'calls':>9}")
    print(f"{'command total':24}{total:10.2f}")
    print(f"{'item loop':24}{loop:10.2f}")
    print(f"{'  in forwards':24}{forwards:10.2f}{clock.calls.get('forwards', 0):9d}"
          f"  ({1e3 * forwards / max(1, clock.calls.get('forwards', 0)):.2f} ms per forward)")
    print(f"{'  outside forwards':24}{outside:10.2f}")
    print(f"{'proving the fast step':24}{s.get('proof', 0.0):10.2f}{clock.calls.get('proof forwards', 0):9d}"
          "  (before the item loop; forwards counted here, not above)")
    for k, v in named.items():
        print(f"{'    ' + k:24}{v:10.2f}{clock.calls.get(k, 0):9d}")
    print(f"{'    rest':24}{rest:10.2f}")
    print(f"bytes streamed to the host for fingerprints: {streamed[0] / 2**20:.1f} MiB "
          f"({streamed[0] / max(1, clock.calls.get('fingerprints', 1)) / 2**20:.1f} MiB per fingerprint)")
    print(f"peak RSS {peak:.0f} MiB (now {rss_mib():.0f} MiB); weights {weights:.0f} MiB, one cache "
          f"{cache_mib:.1f} MiB")
    overhead = 100 * outside / forwards if forwards else float("nan")
    figures = {"cache": args.cache, "total_s": total, "loop_s": loop, "forward_s": forwards, "outside_s": outside, **named,
               "rest_s": rest, "proof_s": s.get("proof", 0.0), "streamed_bytes": streamed[0], "peak_rss_mib": peak, "weights_mib": weights,
               "cache_mib": cache_mib, "overhead_pct": overhead, "lengths": lengths}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"overhead {overhead:.2f}% of forward time, peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
