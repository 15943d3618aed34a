"""A running llama-server audited over HTTP (`matched --engine http`), per server slot count and client load.

    python bench/server.py MODEL.gguf ITEMS.jsonl OUT --server BUILD/llama-server [--slots 1,4] [--loads 0,4,8]
    python bench/server.py MODEL-FOLDER toy OUT --vllm VLLM-VENV/bin/python [--slots 4] [--loads 0,4,8]

For each slot count a llama-server is started on 127.0.0.1 (`--threads`, 1 by default; `-c` = slots x 2048, a --slot-save-path)
and `stagereplay matched --engine http` runs the items once per load (`--concurrency`: other items' requests in
flight around each under-load replica; 0 runs the quiet arms only, with the slot-restore arm where the server has
two slots or more), each into OUT/s<slots>-c<load>. Then one line per run: replicas exact, live vs each arm with
the median logit margin at the first divergence, the prefix cache's hits and cached tokens, and the load findings
per item.
ITEMS: `python bench/llamacpp.py data ITEMS.jsonl --n 30` (SmolLM2 is no reasoning model, so stage 1 is a
token count, as in bench/llamacpp.py); `toy`: the model's own task and boundary (the embedded toy's folder).
With `--vllm PYTHON` the server is `vllm serve` (the CPU build's venv, started through its module as
tests/servers.py does), fp32, prefix caching on, `--max-num-seqs` = the slot count; no slot-restore arm.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(binary: str, model: str, slots: int, log: Path, saves: Path, threads: int
          ) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    saves.mkdir(parents=True, exist_ok=True)
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * 2048), "-t", str(threads), "--no-webui", "--slot-save-path", str(saves)]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    return proc, wait_up(proc, f"http://127.0.0.1:{port}", "/health", log, 600)


def start_vllm(python: str, model: str, slots: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--block-size", "32", "--enforce-eager",
           "--enable-prefix-caching", "--max-logprobs", "5", "--enable-prompt-tokens-details", "--seed", "0",
           "--max-num-seqs", str(slots)]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
    return proc, wait_up(proc, f"http://127.0.0.1:{port}", "/v1/models", log, 1800)


def wait_up(proc: subprocess.Popen[bytes], url: str, path: str, log: Path, tries: int) -> str:
    for _ in range(tries):
        try:
            with urllib.request.urlopen(url + path, timeout=2):
                return url
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.kill()
    sys.exit(f"error: the server did not start; its log: {log}")


def row(run: Path) -> str:
    results = json.loads((run / "results.json").read_text())
    parts = []
    for m in results["matched"]:
        arm = m["construction"]
        d = m["suffix_disagreements"]
        rep = m["replica_exact"].get(arm)
        text = f"{arm} {d['k']}/{d['n']} differ"
        built = m.get("built")
        if built and built["not_built"]:  # the engine's counts: these items were not this arm (left out above)
            text += f" [not built as named on {built['not_built']}/{built['n']}: counted apart]"
        at = (m.get("margins") or {}).get("at_divergence") or {}
        if at.get("n"):
            text += f" (margin at divergence, median {at['median']:.3f})"
        if rep is not None:
            text += f" (replica exact {rep['k']}/{rep['n']})"
        if arm == "prefix-cache" and m.get("prefix_cache"):
            pc = m["prefix_cache"]
            text += f" [hits {pc['hits']}/{pc['n']}, {pc['cached_from_decode']} of {pc['num_cached_tokens']} cached from decode]"
        for request, counts in (m.get("load") or {}).items():
            text += f" [{request} per item: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + "]"
        parts.append(text)
    live = results["matched"][0]["replica_exact"]["live"]
    return f"live replica exact {live['k']}/{live['n']}; " + "; ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("items")
    p.add_argument("out", type=Path)
    server = p.add_mutually_exclusive_group(required=True)
    server.add_argument("--server", help="the llama-server binary")
    server.add_argument("--vllm", help="the Python of a venv with vLLM's CPU build")
    p.add_argument("--slots", default="1,4")
    p.add_argument("--loads", default="0,4,8")
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--boundary-after", type=int, default=48, help="stage-1 tokens (SmolLM2 is no reasoning model)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="suffix tokens per arm")
    p.add_argument("--threads", type=int, default=1, help="llama-server's threads")
    a = p.parse_args()
    stage = ["--max-new-tokens", str(a.max_new_tokens)]
    if a.items != "toy":
        stage += ["--data", a.items, "--boundary-after", str(a.boundary_after), "--max-stage1-tokens",
                  str(a.boundary_after), "--scorer", "last-number"]
    a.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    lines = []
    for slots in (int(s) for s in a.slots.split(",")):
        log = a.out / f"server-s{slots}.log"
        proc, url = (start_vllm(a.vllm, a.model, slots, log) if a.vllm
                     else start(a.server, a.model, slots, log, a.out / "slots", a.threads))
        try:
            for load in (int(c) for c in a.loads.split(",")):
                run = a.out / f"s{slots}-c{load}"
                t0 = time.perf_counter()
                cmd = [sys.executable, "-m", "stagereplay.cli", "matched", "--engine", "http", "--url", url,
                       "--model", a.model, "--n", str(a.n), "--precision", "fp32", *stage,
                       "--concurrency", str(load), "--out", str(run), "--quiet",
                       *(["--slot-restore"] if load == 0 and slots > 1 and not a.vllm else [])]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"error: {' '.join(cmd)} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
                line = f"slots {slots}, load {load} ({time.perf_counter() - t0:.0f} s): {row(run)}"
                print(line, flush=True)
                lines.append(line)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    (a.out / "table.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
