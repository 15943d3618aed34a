"""How often does `stagereplay attest` accuse an honest server? The command itself, with the default null of its
claim, run on K disjoint prompt sets per served source; each run is one decision, and the outcomes are counted.

    python bench/attest_fpr.py CLAIMED.gguf OUT --server BUILD/llama-server --quantize BUILD/llama-quantize
    python bench/attest_fpr.py toy.gguf OUT --items toy --runs 10 --n 20 --max-new-tokens 16 ...

The claim is CLAIMED.gguf served by llama.cpp (its default null: our fp32 decode and llama.cpp's own variants in
process, `serving.llamacpp_honest`). The sources, each greedy, one request per prompt:

    llama.cpp           the claimed file served in process (`--engine llama.cpp`)        honest
    llama-server        the claimed file, one slot (`-np 1`)                              honest
    llama-server x4     the claimed file, 4 slots, 3 other requests in flight throughout  honest
    vllm serve          (--vllm PYTHON) the claimed values in f32 as a model folder,     honest
                        fp32, eager, blocks of 32 (vLLM's CPU build, its venv)
    Q4_0                the claimed file requantized to Q4_0 by llama-quantize             substitution

Per source: consistent / inconclusive / flagged over its runs, the flagged fraction with its Wilson interval (a
run is the unit: each run's prompts are its own), the honest responses the runs held, and the median tokens a
flagged run needed. The honest rows' flagged fraction is the false-positive rate the decision holds at its stated
1%; the substitution's is its power at that run size. Each run also decides its held-out honest responses alone (its
report's held-out check: every honest variant's response to each held-out prompt, against the null of the others'
calibration prompts); the line `held-out honest responses flagged alone` sums them over every run of every source.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import start_llama_server, start_vllm_server, stop_server

HONEST = ("llama.cpp", "llama-server", "llama-server x4", "vllm serve")
VLLM_FLAGS = ["--dtype", "float32", "--block-size", "32", "--enforce-eager"]


def toy_data(path: Path, n: int, seed: int) -> Path:
    from stagereplay.tasks.toy import toy_rows

    path.write_text("".join(json.dumps(row) + "\n" for row in toy_rows(n, seed)))
    return path


def chat_data(path: Path, n: int, seed: int) -> Path:
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"id": f"c{seed}-{i:03d}", "messages": [{"role": "user", "content":
                     f"What is {a} plus {b}? Explain briefly."}], "answer": str(a + b)})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def attest(claimed: Path, data: Path, out: Path, n: int, max_new: int, engine: list[str]) -> dict[str, Any]:
    """One `stagereplay attest` run: its exit code, its outcome and the numbers of its decision."""
    cmd = [sys.executable, "-m", "stagereplay.cli", "attest", "--model", str(claimed), "--data", str(data), "--n",
           str(n), "--max-new-tokens", str(max_new), "--out", str(out), "--quiet", *engine]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode not in (0, 1, 3):
        raise SystemExit(f"attest failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    s = json.loads((out / "results.json").read_text())["attest"][0]
    return {"code": done.returncode, "outcome": s["outcome"], "tokens": s["tokens"], "items": s["items"],
            "needed": s["tokens_needed"], "blockers": [b["kind"] for b in s["blockers"]],
            "heldout": s["honest_fpr"]}


def hf_folder(claimed: Path, folder: Path) -> Path:
    """The claimed GGUF's values in f32 as a model folder (transformers' GGUF loader), as vLLM loads a model."""
    if not folder.exists():
        from stagereplay.engine.lm import load

        lm = load(str(claimed), "fp32", "cpu", 1)
        lm.model.save_pretrained(folder)
        lm.tokenizer.save_pretrained(folder)
    return folder


class Traffic:
    """Other requests in flight on a server while a run asks it: `threads` clients, each asking for 16 tokens of one
    of `prompts` in turn until stopped (bounded: at most `limit` requests each)."""

    def __init__(self, url: str, prompts: list[list[int]], threads: int = 3, limit: int = 100_000) -> None:
        self.url, self.prompts, self.limit = url, prompts, limit
        self.stop = threading.Event()
        self.sent = 0
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(threads)]

    def _client(self, k: int) -> None:
        for i in range(self.limit):
            if self.stop.is_set():
                return
            body = json.dumps({"prompt": self.prompts[(i + k) % len(self.prompts)], "n_predict": 16,
                               "temperature": 0, "cache_prompt": False}).encode()
            request = urllib.request.Request(self.url + "/completion", body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as r:
                    r.read()
                self.sent += 1
            except OSError:
                time.sleep(0.1)

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("claimed", type=Path, help="the claimed GGUF file")
    p.add_argument("out", type=Path)
    p.add_argument("--server", required=True, help="llama-server (the build .ci/llamacpp.sh makes)")
    p.add_argument("--quantize", required=True, help="llama-quantize of the same build")
    p.add_argument("--items", choices=("toy", "chat"), default="toy", help="the toy task's prompts, or chat sums")
    p.add_argument("--runs", type=int, default=10, help="runs per source, each on prompts of its own")
    p.add_argument("--n", type=int, default=20, help="prompts per run (half calibrate)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--vllm", default=None, metavar="PYTHON", help="the vLLM venv's interpreter: adds vllm serve")
    args = p.parse_args()

    from stagereplay.experiments.core.stats import wilson_interval

    args.out.mkdir(parents=True, exist_ok=True)
    q40 = args.out / "claimed.Q4_0.gguf"
    if not q40.exists():
        subprocess.run([args.quantize, "--allow-requantize", str(args.claimed), str(q40), "Q4_0"], check=True,
                       capture_output=True)
    make = toy_data if args.items == "toy" else chat_data
    data = [make(args.out / f"prompts-{k}.jsonl", args.n, 1000 + k) for k in range(args.runs)]
    rows: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    rows["llama.cpp"] = [attest(args.claimed, d, args.out / f"llama.cpp-{k}", args.n, args.max_new_tokens,
                                ["--engine", "llama.cpp"]) for k, d in enumerate(data)]
    servers = {"llama-server": (args.claimed, ["-np", "1", "-c", "2048", "-t", "1"], 0),
               "llama-server x4": (args.claimed, ["-np", "4", "-c", "8192", "-t", "1"], 3),
               "Q4_0": (q40, ["-np", "1", "-c", "2048", "-t", "1"], 0)}
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8][: 4 + k] for k in range(4)]
    if args.vllm:
        folder = hf_folder(args.claimed, args.out / "claimed-hf")
        servers = {**dict(list(servers.items())[:2]), "vllm serve": (folder, VLLM_FLAGS, 0), "Q4_0": servers["Q4_0"]}
    for name, (model, flags, others) in servers.items():
        log = args.out / f"{name}.log"
        proc, url = (start_vllm_server(args.vllm, str(model), flags, log, 1) if name == "vllm serve"
                     else start_llama_server(args.server, str(model), flags, log))
        try:
            rows[name] = []
            for k, d in enumerate(data):
                engine = ["--engine", "http", "--url", url]
                if others:
                    with Traffic(url, prompts, others):
                        rows[name].append(attest(args.claimed, d, args.out / f"{name}-{k}", args.n,
                                                 args.max_new_tokens, engine))
                else:
                    rows[name].append(attest(args.claimed, d, args.out / f"{name}-{k}", args.n, args.max_new_tokens,
                                             engine))
        finally:
            stop_server(proc)
    print(f"{'source':<16} {'runs':>4} {'consistent':>10} {'inconclusive':>12} {'flagged':>7}  flagged [95%]"
          f"        responses  tokens needed (median)")
    summary = {}
    for name, runs in rows.items():
        count = {o: sum(r["outcome"] == o for r in runs) for o in ("consistent", "inconclusive", "flagged")}
        lo, hi = wilson_interval(count["flagged"], len(runs))
        needed = sorted(r["needed"] for r in runs if r["needed"] is not None)
        median = needed[len(needed) // 2] if needed else None
        print(f"{name:<16} {len(runs):>4} {count['consistent']:>10} {count['inconclusive']:>12} {count['flagged']:>7}"
              f"  {count['flagged'] / len(runs):.2f} [{lo:.3f}, {hi:.3f}]  {sum(r['items'] for r in runs):>9}  "
              f"{median if median is not None else '-'}")
        summary[name] = {**count, "interval": [lo, hi], "responses": sum(r["items"] for r in runs),
                         "median_tokens_needed": median, "honest": name in HONEST}
    honest = [r for name in HONEST if name in rows for r in rows[name]]
    heldout = [sum(r["heldout"][0] for r in honest), sum(r["heldout"][1] for r in honest)]
    hlo, hhi = wilson_interval(*heldout) if heldout[1] else (0.0, 1.0)
    summary["heldout_alone"] = {"flagged": heldout[0], "decided": heldout[1], "interval": [hlo, hhi]}
    print(f"held-out honest responses flagged alone: {heldout[0]}/{heldout[1]} [{hlo:.4f}, {hhi:.4f}]" if heldout[1]
          else "held-out honest responses flagged alone: none decided (one response reaches the level only against "
               "nulls of more calibration prompts than these runs have)")
    flagged = sum(r["outcome"] == "flagged" for r in honest)
    lo, hi = wilson_interval(flagged, len(honest))
    (args.out / "attest_fpr.json").write_text(json.dumps(summary, indent=1) + "\n")
    caught = sum(r["outcome"] == "flagged" for r in rows["Q4_0"])
    print(f"attest_fpr: honest runs flagged {flagged}/{len(honest)} [{lo:.3f}, {hi:.3f}] over "
          f"{sum(r['items'] for r in honest)} honest responses; Q4_0 flagged {caught}/{len(rows['Q4_0'])}; "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
