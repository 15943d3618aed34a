"""The mismatch experiment at the scale of an RL step: how fast the trainer's side scores rollouts, and what a large
rollout file costs in memory.

    python bench/mismatch.py throughput                      # vocab152k shape, 8 rollouts of 64 + 448 tokens, CPU
    python bench/mismatch.py throughput --shape 50m --rollouts 4 --response 1024
    python bench/mismatch.py memory                          # 200 and 2,000 rollouts of a tiny model's file
    python bench/mismatch.py memory --small 20 --large 200   # a quick look

`throughput`: per rollout, our trainer score (`engine.scoring.score_oneshot`: one forward over prompt +
response[:-1], no cache, the response's rows reduced a few at a time to each token's log-probability and argmax,
the bits of log_softmax over the fp32 logits) against a bare `model(input_ids)` forward over the same tokens (a
trainer's plain forward: every position's logits, as the model returns them), one sequence per forward on both
sides, interleaved rollout by rollout; prints rollouts and tokens per second of each and ours / bare (target: at
most 1.2x). The last line is `scoring: ours X tok/s, bare forward Y tok/s, ours / bare R`. `--clock cpu` times
the process's CPU time instead of the wall's (steadier on a shared CPU).

`memory`: a rollout file of `--small` and of `--large` rollouts (the same tiny random model's own samples, repeated)
audited by `stagereplay mismatch --rollouts FILE` (trainer at bf16, no transplant) in a fresh process each, its peak
RSS sampled every 50 ms; memory should follow the rollouts scored at once, not the file. The last line is
`peak RSS: N rollouts X MiB, M rollouts Y MiB (ratio R)`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import clock, random_prompts, save_random_model


def throughput(args: argparse.Namespace) -> str:
    import torch

    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.lm import load
    from stagereplay.engine.scoring import score_oneshot

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_random_model(args.shape, Path(tmp) / "model")
        lm = load(str(path), args.precision, "cpu", args.threads)
        vocab = int(lm.model.config.vocab_size)
        sequences = random_prompts(vocab, args.rollouts, args.prompt + args.response, seed=1)
        dc = DecodeConfig(max_new_tokens=args.response)
        timer = clock(args.clock)
        ours, bare = [], []

        def score(ids: list[int]) -> None:
            score_oneshot(lm, ids[: args.prompt], ids[args.prompt :], dc, "raw")

        def forward(ids: list[int]) -> None:
            with torch.inference_mode():
                lm.model(input_ids=torch.tensor([ids[:-1]]), use_cache=False)

        score(sequences[0])  # warm-up: first calls allocate
        forward(sequences[0])
        for i, ids in enumerate(sequences):
            order = [(ours, score), (bare, forward)] if i % 2 == 0 else [(bare, forward), (ours, score)]
            for times, fn in order:
                start = timer()
                fn(ids)
                times.append(timer() - start)
    tokens = args.response
    ours_tps, bare_tps = tokens / statistics.median(ours), tokens / statistics.median(bare)
    print(f"{args.shape} {args.precision}: {args.rollouts} rollouts of {args.prompt} + {args.response} tokens, "
          f"one sequence per forward, {args.threads} thread(s)")
    print(f"  ours (score_oneshot): {1 / statistics.median(ours):.2f} rollouts/s, {ours_tps:.0f} scored tok/s")
    print(f"  bare model(input_ids): {1 / statistics.median(bare):.2f} rollouts/s, {bare_tps:.0f} tok/s")
    return (f"scoring: ours {ours_tps:.0f} tok/s, bare forward {bare_tps:.0f} tok/s, "
            f"ours / bare {statistics.median(ours) / statistics.median(bare):.3f}")


def _peak(cmd: list[str]) -> tuple[float, float]:
    """Peak RSS (MiB) of a command's process tree, sampled every 50 ms, and its wall seconds."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0.0
    while proc.poll() is None:
        with contextlib.suppress(OSError):  # the process may end between poll and read
            peak = max(peak, rss_mib_of(proc.pid))
        time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.read() if proc.stderr else ''}")
    return peak, time.perf_counter() - start


def rss_mib_of(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def memory(args: argparse.Namespace) -> str:
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.lm import load
    from stagereplay.engine.scoring import rollout

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_model("tiny", Path(tmp) / "model")
        lm = load(str(model), "bf16", "cpu", 1)
        dc = DecodeConfig(max_new_tokens=args.response, sample=True)
        for k, prompt in enumerate(random_prompts(int(lm.model.config.vocab_size), args.distinct, 16, seed=2)):
            tokens, scored = rollout(lm, prompt, args.response, dc, seed=k, mode="raw")
            rows.append({"prompt_ids": prompt, "response_ids": tokens, "logprobs": [float(x) for x in scored.logprobs]})
        peaks = {}
        for n in (args.small, args.large):
            path = Path(tmp) / f"rollouts-{n}.jsonl"
            with open(path, "w") as f:
                for i in range(n):
                    f.write(json.dumps({**rows[i % len(rows)], "id": f"r{i:05d}"}) + "\n")
            cmd = [sys.executable, "-m", "stagereplay.cli", "mismatch", "--model", str(model), "--rollouts", str(path),
                   "--precisions", "bf16", "--transplant-at", "0", "--quiet", "--out", str(Path(tmp) / f"run-{n}")]
            peak, seconds = _peak(cmd)
            peaks[n] = peak
            print(f"{n} rollouts ({path.stat().st_size / 2**20:.1f} MiB file): peak RSS {peak:.0f} MiB, "
                  f"{seconds:.0f} s, ledger {(Path(tmp) / f'run-{n}' / 'ledger.jsonl').stat().st_size / 2**20:.1f} MiB")
    return (f"peak RSS: {args.small} rollouts {peaks[args.small]:.0f} MiB, {args.large} rollouts "
            f"{peaks[args.large]:.0f} MiB (ratio {peaks[args.large] / peaks[args.small]:.2f})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--shape", default="vocab152k")
    t.add_argument("--rollouts", type=int, default=8)
    t.add_argument("--prompt", type=int, default=64)
    t.add_argument("--response", type=int, default=448)
    t.add_argument("--precision", default="bf16")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    m = sub.add_parser("memory")
    m.add_argument("--small", type=int, default=200)
    m.add_argument("--large", type=int, default=2000)
    m.add_argument("--response", type=int, default=32)
    m.add_argument("--distinct", type=int, default=20, help="distinct rollouts the file repeats")
    args = p.parse_args(argv)
    print(throughput(args) if args.what == "throughput" else memory(args))


if __name__ == "__main__":
    main()
