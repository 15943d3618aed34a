"""Named configurations of our engine's `matched`, each a run, each `compare`d against the first: one table of what
the constructions engines call lossless do to a model's trajectories (docs/how-to/lossless.md).

    python bench/constructions.py MODEL ITEMS OUT --n 30 --boundary-after 48 --max-new-tokens 64 --precision bf16 \\
        --config plain="--construction oneshot,chunked:16,chunked:64,roundtrip:fp8-e4m3,roundtrip:int8" \\
        --config prompt-lookup="--speculate prompt-lookup:10" --config self-draft="--speculate self" \\
        --config quanto-4="--quantized-cache quanto:4"

MODEL: a model folder or a GGUF file (`toy`: the embedded toy, its own items and boundary). ITEMS: a JSONL file
(`toy`: the toy task's). Each configuration runs `stagereplay matched ... <its flags> --out OUT/<name>` (resumed if
there), then `stagereplay compare OUT/<first> OUT/<name> --out OUT/compare-<name>`. One line per configuration
(printed, and written to OUT/table.md): within the run, live against each fresh construction (suffixes that differ,
the median margin at the first divergence), its replicas, what generate() did where it built live (tokens per
step: above 1 where speculation accepted candidates), and against the first configuration: live trajectories
equal, where the first divergences fall (stage 1, suffix, boundary), the median margin there on each side, live's
correctness labels that differ, each side's accuracy and McNemar's p.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import draft_totals


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3g}" if values else "-"


def within(run: Path) -> str:
    """Live against each fresh construction of the run, and its replicas."""
    results = json.loads((run / "results.json").read_text())
    parts = []
    for m in results["matched"]:
        d = m["suffix_disagreements"]
        at = (m.get("margins") or {}).get("at_divergence") or {}
        margin = f", margin {at['median']:.3g}" if at.get("n") else ""
        parts.append(f"vs {m['construction']} {d['k']}/{d['n']}{margin}")
    live = results["matched"][0]["replica_exact"]["live"]
    return f"replicas {live['k']}/{live['n']}; " + "; ".join(parts) + generated(run)


def generated(run: Path) -> str:
    """What speculation did for live over all items, from the records: where generate() built it (--speculate,
    --quantized-cache), its tokens and steps (each step one forward; a step that accepted candidates added more than
    one); where a serving engine speculated (vLLM's --speculative-config), what its live requests drafted and
    accepted."""
    tokens = steps = 0
    for line in (run / "ledger.jsonl").read_text().splitlines():
        record = json.loads(line)
        arms = record["payload"].get("arms", []) if record["kind"] == "item" else []
        added = next(((a.get("generated") or {}).get("added") for a in arms if a["name"] == "live"), None)
        if added:
            tokens, steps = tokens + sum(added), steps + len(added)
    said = f"; live by generate(): {tokens} tokens in {steps} steps ({tokens / steps:.2f} a step)" if steps else ""
    drafts = draft_totals(run)
    return said + (f"; live drafted {drafts[0]}, accepted {drafts[1]}" if drafts else "")


def against(compare: Path) -> str:
    """The run against the first configuration, from compare.json."""
    c = json.loads((compare / "compare.json").read_text())
    t = c["trajectories"]
    where = ", ".join(f"{w} {k}" for w, k in t["first_divergence_in"].items() if k)
    margins: dict[str, list[float]] = {"a": [], "b": []}
    for item in c["items"]:
        d = item.get("first_divergence")
        for side in ("a", "b"):
            if d and d[side].get("margin") is not None:
                margins[side].append(float(d[side]["margin"]))
    live = next((a for a in c["arms"] if a["arm"] == "live"), None)
    labels = ""
    if live is not None:
        acc, p = live.get("accuracy") or {}, live.get("mcnemar_p")
        labels = (f"; live labels differ {live['label_disagreements']['k']}/{live['label_disagreements']['n']}"
                  + (f", accuracy {acc.get('a', 0):.1%} vs {acc.get('b', 0):.1%}" if acc else "")
                  + (f", McNemar p {p:.3f}" if p is not None else ""))
    return (f"trajectories equal {t['equal']['k']}/{t['equal']['n']}"
            + (f" (first divergence: {where}; margin there {_median(margins['a'])} first, "
               f"{_median(margins['b'])} this)" if where else "") + labels)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("items")
    p.add_argument("out", type=Path)
    p.add_argument("--config", action="append", required=True, help="NAME=\"matched flags\" (the first is the reference)")
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--boundary-after", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--precision", default="bf16")
    a = p.parse_args()
    configs: list[tuple[str, list[str]]] = []
    for given in a.config:
        name, _, flags = given.partition("=")
        configs.append((name, shlex.split(flags)))
    common = ["--n", str(a.n), "--precision", a.precision, "--max-new-tokens", str(a.max_new_tokens), "--quiet"]
    if a.model != "toy":
        common += ["--model", a.model]
    if a.items != "toy":
        common += ["--data", a.items, "--boundary-after", str(a.boundary_after), "--max-stage1-tokens",
                   str(a.boundary_after), "--scorer", "last-number"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    a.out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    first = a.out / configs[0][0]
    for name, flags in configs:
        run = a.out / name
        t0 = time.perf_counter()
        _cli(["matched", *common, *flags, "--out", str(run)], env)
        line = f"{name} ({time.perf_counter() - t0:.0f} s): {within(run)}"
        if run != first:
            _cli(["compare", str(first), str(run), "--out", str(a.out / f"compare-{name}"), "--quiet"], env)
            line += f" | against {configs[0][0]}: {against(a.out / f'compare-{name}')}"
        print(line, flush=True)
        lines.append(line)
    (a.out / "table.md").write_text("\n".join(f"- {line}" for line in lines) + "\n")
    return 0


def _cli(args: list[str], env: dict[str, Any]) -> None:
    done = subprocess.run([sys.executable, "-m", "stagereplay.cli", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: stagereplay {' '.join(args)} failed: {done.stderr[-2000:]}")


if __name__ == "__main__":
    sys.exit(main())
