"""A running server audited over HTTP (`matched --engine http`), per named server configuration, slot count and load.

    python bench/server.py MODEL.gguf ITEMS.jsonl OUT --server BUILD/llama-server \\
        --config f16= --config q8_0="-ctk q8_0 -ctv q8_0 -fa on" --config ub16="-ub 16" \\
        --config ngram="--spec-type ngram-simple" [--slots 1] [--loads 0]
    python bench/server.py MODEL.gguf ITEMS.jsonl OUT --server BUILD/llama-server [--slots 1,4] [--loads 0,4,8]
    python bench/server.py MODEL-FOLDER toy OUT --vllm VLLM-VENV/bin/python [--config fp8="--kv-cache-dtype fp8"]

A configuration is NAME=FLAGS: flags added to the server's command line (none without --config: one configuration,
`plain`). Per configuration and slot count a server is started on 127.0.0.1: llama-server with `-np` = slots,
`-c` = slots x 2048, `--threads` (1 by default), a --slot-save-path, and `--no-repack` unless its flags ask for
`--repack` (repacked weights run other kernels); with `--vllm PYTHON`, `vllm serve` from the CPU build's venv
(through its module, as tests/servers.py starts it), fp32, prefix caching on, `--max-num-seqs` = slots, no
slot-restore arm. `stagereplay matched --engine http` runs the items once per load (`--concurrency`: other items'
requests in flight around each under-load replica; 0 runs the quiet arms only, with the slot-restore arm where a
llama-server has two slots or more) into OUT/<name>-s<slots>-c<load>, declaring the server's flags with
`--server-args` (all but its address, model and slot folder), so that the runs' manifests differ where the servers
did. Each run of a later configuration is compared with the first configuration's at the same slots and load
(`stagereplay compare`, into OUT/compare-<name>-s<slots>-c<load>).

Then one line per run (and OUT/table.md, one row each): live's replicas exact; live vs each arm with the median
logit margin at the first divergence, the prefix cache's hits, the load findings, what speculation drafted and
accepted in live's requests; and against the first configuration: live trajectories equal, where they first diverge
(stage 1, suffix, or at the boundary), both sides' median margin there, live's label disagreements with McNemar's p,
and the fields `compare` found different between the manifests (the declared flags, what the server reports).
ITEMS: `python bench/llamacpp.py data ITEMS.jsonl --n 30` (SmolLM2 is no reasoning model, so stage 1 is a token
count, as in bench/llamacpp.py); `toy`: the model's own task and boundary (the embedded toy's folder).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import draft_totals, free_port, start_llama_server, wait_up


@dataclass(frozen=True)
class Config:
    """One server configuration: its name and the flags added to the server's command line."""

    name: str
    flags: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Config:
        name, sep, flags = text.partition("=")
        if not sep or not name:
            sys.exit(f"error: --config {text!r} is not NAME=FLAGS (e.g. q8_0=\"-ctk q8_0 -ctv q8_0 -fa on\")")
        return cls(name, tuple(shlex.split(flags)))

    def llama_server_flags(self) -> tuple[str, ...]:
        """Its flags, with `--no-repack` unless they choose repacking themselves."""
        chosen = {"--repack", "--no-repack", "-nr"} & set(self.flags)
        return self.flags if chosen else (*self.flags, "--no-repack")


def start_vllm(python: str, model: str, flags: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port",
           str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
    return proc, wait_up(proc, f"http://127.0.0.1:{port}", "/v1/models", log, 1800)


def server_flags(a: argparse.Namespace, config: Config, slots: int) -> list[str]:
    """The server's command line but its address, model and slot folder: what `--server-args` declares."""
    if a.vllm:
        return ["--dtype", "float32", "--block-size", "32", "--enforce-eager", "--enable-prefix-caching",
                "--max-logprobs", "5", "--enable-prompt-tokens-details", "--seed", "0", "--max-num-seqs", str(slots),
                *config.flags]
    return ["-np", str(slots), "-c", str(slots * 2048), "-t", str(a.threads), *config.llama_server_flags()]


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}" if values else "-"


def row(run: Path) -> tuple[str, dict[str, str]]:
    """The run's line, and its cells for the table: replicas, live vs each arm, speculation."""
    results = json.loads((run / "results.json").read_text())
    parts = []
    cells: dict[str, str] = {}
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
        if arm == "oneshot":
            labels = m["label_disagreements"]
            cells["live vs oneshot"] = (f"{d['k']}/{d['n']} suffixes, {labels['k']}/{labels['n']} labels, margin "
                                        f"{at['median']:.3f}" if at.get("n") else
                                        f"{d['k']}/{d['n']} suffixes, {labels['k']}/{labels['n']} labels")
    live = results["matched"][0]["replica_exact"]["live"]
    cells["live replica exact"] = f"{live['k']}/{live['n']}"
    drafted = draft_totals(run)
    if drafted is not None:
        parts.append(f"live drafted {drafted[0]}, accepted {drafted[1]}")
    cells["live drafted / accepted"] = "-" if drafted is None else f"{drafted[0]} / {drafted[1]}"
    return f"live replica exact {live['k']}/{live['n']}; " + "; ".join(parts), cells


def against(first: str, comparison: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """A run against the first configuration's (compare.json): live trajectories, their first divergence and both
    sides' margins there, live's label disagreements, and what differs between the manifests."""
    t = comparison["trajectories"]
    where = ", ".join(f"{k} {v}" for k, v in t["first_divergence_in"].items() if v) or "none"
    diverged = [i["first_divergence"] for i in comparison["items"] if i.get("first_divergence")]
    ma = [abs(d["a"]["margin"]) for d in diverged if d["a"]["margin"] is not None]
    mb = [abs(d["b"]["margin"]) for d in diverged if d["b"]["margin"] is not None]
    live = next((a for a in comparison["arms"] if a["arm"] == "live"), None)
    labels = "-" if live is None else f"{live['label_disagreements']['k']}/{live['label_disagreements']['n']}"
    p = None if live is None else live["mcnemar_p"]
    fields = []
    for group in ("settings", "server"):
        for d in comparison["differences"][group]:
            short = d["field"].split(".engine.", 1)[-1]
            if short not in fields:
                fields.append(short)
    differs = ", ".join(fields) or "nothing"
    cells = {f"trajectories = {first}": f"{t['equal']['k']}/{t['equal']['n']}", "first divergence in": where,
             "margin there (median, first / this)": f"{_median(ma)} / {_median(mb)}",
             "live labels differ (McNemar p)": f"{labels} ({'-' if p is None else f'{p:.3g}'})",
             "manifests differ in": differs}
    text = (f"vs {first}: trajectories equal {t['equal']['k']}/{t['equal']['n']} (first divergence: {where}; margin "
            f"there, median {_median(ma)} / {_median(mb)}), live labels differ {labels}"
            f"{'' if p is None else f' (McNemar p {p:.3g})'}; manifests differ in {differs}")
    return text, cells


def table(rows: list[dict[str, str]]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(r.get(c, "") for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("items")
    p.add_argument("out", type=Path)
    server = p.add_mutually_exclusive_group(required=True)
    server.add_argument("--server", help="the llama-server binary")
    server.add_argument("--vllm", help="the Python of a venv with vLLM's CPU build")
    p.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                   help="a server configuration: its name and the flags added to the server's command (repeatable; "
                        "each later one is compared with the first)")
    p.add_argument("--slots", default=None, help="server slot counts (default 1,4; 1 with --config)")
    p.add_argument("--loads", default=None, help="client loads (default 0,4,8; 0 with --config)")
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--boundary-after", type=int, default=48, help="stage-1 tokens (SmolLM2 is no reasoning model)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="suffix tokens per arm")
    p.add_argument("--threads", type=int, default=1, help="llama-server's threads")
    a = p.parse_args()
    configs = [Config.parse(c) for c in a.config] or [Config("plain", ())]
    if len({c.name for c in configs}) != len(configs):
        sys.exit("error: two --config share a name")
    slot_counts = [int(s) for s in (a.slots or ("1" if a.config else "1,4")).split(",")]
    loads = [int(c) for c in (a.loads or ("0" if a.config else "0,4,8")).split(",")]
    stage = ["--max-new-tokens", str(a.max_new_tokens)]
    if a.items != "toy":
        stage += ["--data", a.items, "--boundary-after", str(a.boundary_after), "--max-stage1-tokens",
                  str(a.boundary_after), "--scorer", "last-number"]
    a.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    lines, rows = [], []
    cli = [sys.executable, "-m", "stagereplay.cli"]

    def call(cmd: list[str]) -> None:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"error: {' '.join(cmd)} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")

    for config in configs:
        for slots in slot_counts:
            flags = server_flags(a, config, slots)
            log = a.out / f"server-{config.name}-s{slots}.log"
            proc, url = (start_vllm(a.vllm, a.model, flags, log) if a.vllm
                         else start_llama_server(a.server, a.model, flags, log, a.out / "slots"))
            try:
                for load in loads:
                    name = f"{config.name}-s{slots}-c{load}"
                    run = a.out / name
                    t0 = time.perf_counter()
                    call([*cli, "matched", "--engine", "http", "--url", url, "--model", a.model, "--n", str(a.n),
                          "--precision", "fp32", *stage, "--concurrency", str(load), "--out", str(run), "--quiet",
                          "--server-args", shlex.join(flags),
                          *(["--slot-restore"] if load == 0 and slots > 1 and not a.vllm else [])])
                    text, cells = row(run)
                    cells = {"configuration": config.name, "slots": str(slots), "load": str(load), **cells}
                    if config is not configs[0]:
                        out = a.out / f"compare-{name}"
                        call([*cli, "compare", str(a.out / f"{configs[0].name}-s{slots}-c{load}"), str(run),
                              "--out", str(out), "--quiet"])
                        vs, more = against(configs[0].name, json.loads((out / "compare.json").read_text()))
                        text += f"; {vs}"
                        cells.update(more)
                    line = f"{config.name}, slots {slots}, load {load} ({time.perf_counter() - t0:.0f} s): {text}"
                    print(line, flush=True)
                    lines.append(line)
                    rows.append(cells)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    (a.out / "table.txt").write_text("\n".join(lines) + "\n")
    (a.out / "table.md").write_text(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
