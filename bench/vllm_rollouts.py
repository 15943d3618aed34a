"""A rollout file as an RL framework dumps it, written from vLLM's own outputs: what `stagereplay mismatch --rollouts`
audits against our engine (the trainer). Runs in vLLM's venv (docs/how-to/vllm.md).

    python bench/vllm_rollouts.py OUT.jsonl                         the toy's prompts, 200 rollouts at temperature 1
    python bench/vllm_rollouts.py OUT.jsonl --model DIR --data ITEMS.jsonl --n 64 --temperature 0.7 --top-p 0.95

Every prompt is sent in one `LLM.generate` call, as a rollout worker sends its batch: vLLM schedules them together.
Each request carries its own seed (`--seed` + its row), `SamplingParams(logprobs=0)`: vLLM's log-probability of
each token it drew, in its `logprobs_mode` (raw_logprobs unless `--logprobs-mode` says processed_logprobs). A row:
prompt_ids, response_ids, logprobs, id, temperature, top_p, top_k, seed. The last line says where the file is and
the command that audits it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def prompts(model: str, data: str | None, n: int) -> list[tuple[str, list[int]]]:
    """(id, prompt token IDs) of the first `n` items: the toy task's, or a data file's, through stagereplay's item
    sources (the model's chat template where it has one)."""
    from stagereplay.engine.model import load_config_and_tokenizer
    from stagereplay.tasks import DataConfig, load_items

    _, tokenizer = load_config_and_tokenizer(model)
    items, _ = load_items(DataConfig(path=data, n=n), tokenizer)
    return [(item.id, list(item.prompt_ids)) for item in items]


def rollouts(model: str, rows: list[tuple[str, list[int]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """vLLM's sampled responses and its log-probability of each drawn token, one request per row."""
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                       ("OMP_NUM_THREADS", str(args.threads)), ("VLLM_CPU_KVCACHE_SPACE", "1")):
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # A step's token budget that holds every prompt whole: a prefill split across steps makes vLLM rewind a seeded
    # request's generator, which its CPU build cannot (RuntimeError: CPU Generator does not use offset).
    budget = max(2048, sum(len(p) for _, p in rows) + len(rows))
    llm = LLM(model=model, tokenizer=model, dtype=args.dtype, enforce_eager=True, seed=args.seed,
              logprobs_mode=args.logprobs_mode, max_num_batched_tokens=budget)
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed + i,
                             max_tokens=args.max_new_tokens, logprobs=0, detokenize=False)
              for i in range(len(rows))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for _, p in rows], params, use_tqdm=False)
    written = []
    for (rid, prompt), sampling, out in zip(rows, params, outs, strict=True):
        (choice,) = out.outputs
        response = [int(t) for t in choice.token_ids]
        logprobs = [float(step[t].logprob) for step, t in zip(choice.logprobs or [], response, strict=True)]
        written.append({"id": rid, "prompt_ids": prompt, "response_ids": response, "logprobs": logprobs,
                        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                        "seed": sampling.seed})
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the rollout file to write (JSONL)")
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded toy)")
    parser.add_argument("--data", default=None, help="items (JSONL, ...; default: the toy task)")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="row i's request is seeded with SEED + i")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's dtype: bfloat16 | float16 | float32")
    parser.add_argument("--logprobs-mode", default="raw_logprobs", help="raw_logprobs | processed_logprobs")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.model is None:
        from stagereplay.toy import toy_checkpoint

        args.model = str(toy_checkpoint("primary"))
    start = time.perf_counter()
    rows = rollouts(args.model, prompts(args.model, args.data, args.n), args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = sum(len(r["response_ids"]) for r in rows)
    print(f"wrote {len(rows)} rollouts ({tokens} tokens) to {args.out} in {time.perf_counter() - start:.1f} s; "
          f"audit: stagereplay mismatch --rollouts {args.out} --model {args.model} --out RUN")


if __name__ == "__main__":
    main()
