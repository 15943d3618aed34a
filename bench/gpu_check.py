"""The GPU check behind `bench/gpu_check.sh`: each step in its own process under its own time budget.

    python bench/gpu_check.py all --device cuda --out gpu-out    # what gpu_check.sh runs (at most 8 minutes)
    python bench/gpu_check.py all --device cpu --out /tmp/gc     # the same steps at a tiny shape, on a CPU
    python bench/gpu_check.py matched --model DIR --cache dynamic --device cpu --out /tmp/gc   # one step

Steps (`all`), each a subprocess killed at its budget, each row appended to `OUT/gpu_check.txt` as soon as
it is measured (a step that runs out of time leaves the rows before it and a row saying so):

1. the gpu-marked tests (`pytest -m gpu`) and the tiny architectures' live == generate() tests of
   `tests/test_engine.py`, on the device (`STAGEREPLAY_TEST_DEVICE`);
2. a random Qwen2 of Qwen2.5-7B's shape (28 layers, hidden 3584, 28/4 heads, the real 152,064-token
   vocabulary), drawn on the device and saved to a local directory (`random_model.py`; nothing downloaded);
3. batch-1 decode on the same shape (bench/gpu_decode.py, its own copy drawn on the device): ours and
   generate(), each on a dynamic and a static cache, tokens/s against the floor, tokens checked against
   generate()'s; one matched item's live arm profiled per cache (bench/step_profile.py: the step, the pick, the
   step record, the rest; host reads and syncs per step); and `stagereplay plan` of the 14B paper
   (docs/how-to/plan.md's command) at ours static's rate scaled to 14B's weight bytes (a step reads every weight
   once: the rate of a bandwidth-bound step goes as 1 / weight bytes);
4. `stagereplay matched` on 2 of its items, with each cache of `--caches` (`--cache static`, `--cache
   dynamic`): both arms and their replicas, cache fingerprints and diagnostics, in bf16. Rows: time (model
   load apart), decode steps per second, peak memory against `stagereplay plan`'s estimate for the run (weights
   + the most caches alive at once, at the run's measured lengths), exact replicas, fingerprints, diagnostics;
5. the fixed-prefix 2x2 (incremental | oneshot x bf16 | fp32) on that run's items, the same rows;
6. `matched --cache dynamic --batch 16` on 16 items, shorter ones (`Profile.batch_tokens`): the same rows, and
   whether a row's bits depend on its batch-mates; its steps/s are the 16 rows' together.

Each step runs under its own budget plus what the steps before it left unused, and the budgets add up to the
profile's total, so `all` ends within it whatever a step does. The model step also measures the bandwidth floor:
the model's weight bytes (`stagereplay plan`'s, from the safetensors headers) over the device's copy bandwidth
(bench/common.py's `copy_bandwidth`), the time a batch-1 step cannot beat. It ends with one line:

    gpu check: K/N steps done in S s; replicas exact: yes|NO|not measured; decode steps/s against a floor of F:
    static X (Tx floor), dynamic Y (Tx floor), dynamic --batch 16 Z (Tx floor)

on one line, T being each time a step over the floor's, as bench/gpu_decode.py says it (a figure not measured says
so). A build without the `--cache` option runs `dynamic` as its only cache (no flag) and says that `static` is not
in it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (
    SHAPES,
    SHORT_NAMES,
    arithmetic_items,
    config_only,
    copy_bandwidth,
    profile_figures,
    save_random_model,
)

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TABLE = "gpu_check.txt"
FLOOR = "floor.json"  # the model step's bandwidth floor, for the summary line


@dataclass(frozen=True)
class Profile:
    """The sizes and time budgets (seconds) of `all` on one kind of device."""

    shape: str
    stage1: int
    suffix: int
    budgets: dict[str, int]  # per step; "matched [c]" falls back to "matched"
    total: int  # what all steps may take together: at least the sum of the budgets of the steps that run
    batch_tokens: tuple[int, int]  # stage-1 and suffix tokens of the --batch 16 step's 16 items
    engine_tests: str  # pytest -k over tests/test_engine.py
    decode_tokens: int  # tokens per call of the batch-1 decode step (and the profiled item's stage 1 + suffix)

    def budget(self, step: str) -> int:
        return self.budgets.get(step, self.budgets["matched"] if step.startswith("matched") else 0)


PROFILES = {
    # One H200, 8 minutes with gpu_check.sh's wheel install and start-up (about 20 s): 450 s of steps. Sized from
    # the one run recorded there (issue 46's closing note, a random Qwen2.5-7B-shaped model, 2 items of 96 + 48
    # tokens): the gpu tests took 23 s in pytest; the engine tests were stopped at 50 s; matched [static] took
    # 43.8 s (18.8 decode steps/s, the proofs and loading apart), matched [dynamic] 98.0 s (8.2 steps/s), the
    # fp32 2x2 54.2 s; each process adds about 10 s of start-up. --batch 16 was stopped at 100 s on 16 items of
    # 96 + 48 tokens: its items here are 32 + 16 tokens, a third of that work, enough for a per-row cost.
    # Steps that finish early leave their time to the later ones (--batch 16 comes last). The batch-1 decode step
    # draws its own 7B (seconds on the device) and makes 4 x 2 calls of 48 tokens and 2 profiled items: at the rates
    # measured there (8 to 19 steps/s for ours, generate() about as fast) about 35 s.
    "cuda": Profile("qwen2.5-7b", 96, 48,
                    {"gpu tests": 35, "engine tests": 40, "model": 45, "decode": 50, "matched [static]": 55,
                     "matched [dynamic]": 85, "matched": 85, "2x2": 55, "batch": 70},
                    450, (32, 16), "live_loop_equals_generate or incremental_is_bit_exact",  # every tiny arch.
                    48),
    "cpu": Profile("tiny", 8, 8, {"gpu tests": 120, "engine tests": 120, "model": 120, "decode": 120, "matched": 120,
                                  "2x2": 120, "batch": 120},
                   960, (8, 8), "live_loop_equals_generate and qwen2-bf16", 8),
}


def row(out: Path, name: str, value: str) -> None:
    """Print a row and append it to the table at once, so a step stopped later still leaves it."""
    line = f"{name:<58}  {value}"
    print(line, flush=True)
    with open(out / TABLE, "a") as f:
        f.write(line + "\n")


def has_cache_option() -> bool:
    from stagereplay.engine.model import ModelConfig

    return "cache" in getattr(ModelConfig, "__dataclass_fields__", {})


def peak_memory(device: str) -> tuple[str, float]:
    """The process's peak: GPU memory allocated by torch on CUDA, resident set size on a CPU (GiB)."""
    import torch

    if device.startswith("cuda"):
        return "GPU", torch.cuda.max_memory_allocated() / 2**30
    import resource

    return "RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def timed_loads(device: str) -> list[float]:
    """Seconds spent in `stagereplay.engine.lm.load` from now on (cached_lm looks it up at each load)."""
    import torch

    import stagereplay.engine.lm as lm_module

    real, spent = lm_module.load, []

    def load(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = real(*args, **kwargs)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        spent.append(time.perf_counter() - t)
        return out

    lm_module.load = load
    return spent


def cli(args: list[str]) -> None:
    """A `stagereplay` command in this process (its peak memory is then this process's)."""
    from stagereplay.cli import app

    app(args=args, prog_name="stagereplay", standalone_mode=False)


def plan_estimate(run: Path, prefix: str) -> tuple[float, str]:
    """`stagereplay plan RUN`'s memory for the stages named `prefix*`: weights + caches alive x one cache at
    the stage's longest sequence, the largest over those stages (GiB), and the stage that sets it."""
    from stagereplay.plan.recorded import plan_run
    from stagereplay.plan.stages import model_shape
    from stagereplay.records.ledger import read_manifest

    shape = model_shape(read_manifest(run).config.model.path)
    best, name = 0.0, "none"
    for s in plan_run(run, audited=False):
        if s.name.startswith(prefix):
            size = (shape.weight_bytes(s.precision) + s.caches * shape.cache_bytes(s.positions, s.precision)) / 2**30
            if size > best:
                best, name = size, f"{s.name} {s.precision}: weights + {s.caches} caches of {s.positions} positions"
    return best, name


def decode_steps(run: Path, prefix: str) -> tuple[int, int]:
    """Decode steps (single-token forwards) and all forwards of the stages named `prefix*`, from the ledger."""
    from stagereplay.plan.recorded import plan_run

    stages = [s for s in plan_run(run, audited=False) if s.name.startswith(prefix)]
    return sum(s.steps for s in stages), sum(s.forwards for s in stages)


def step_matched(a: argparse.Namespace) -> int:
    out, tag = a.out, f"matched [{a.cache}]" if a.batch == 1 else f"matched [{a.cache}, --batch {a.batch}]"
    name = f"matched-{a.cache}" + (f"-b{a.batch}" if a.batch > 1 else "")
    if not has_cache_option() and a.cache != "dynamic":
        row(out, tag, "not in this build (no --cache option): skipped")
        return 0
    run = a.out / name
    args = ["matched", "--model", str(a.model), "--data", str(a.model / "items.jsonl"), "--n", str(max(2, a.batch)),
            "--boundary-after", str(a.stage1), "--max-new-tokens", str(a.suffix), "--max-stage1-tokens",
            str(a.stage1), "--device", a.device, "--quiet", "--out", str(run)]
    if has_cache_option():
        args += ["--cache", a.cache]
    if a.batch > 1:  # items stepping together: each row's bits independent of its batch-mates (engine.batched_step)
        args += ["--batch", str(a.batch)]
    loads = timed_loads(a.device)
    t = time.perf_counter()
    cli(args)
    wall = time.perf_counter() - t
    rate = report(out, tag, run, "matched", wall, sum(loads), a.device)
    results = json.loads((run / "results.json").read_text())["matched"][0]
    exact = results["replica_exact"]
    k, n = sum(v["k"] for v in exact.values()), sum(v["n"] for v in exact.values())
    row(out, f"{tag}: replicas exact (arms)", f"{k}/{n} " + ("yes" if k == n and n else "NO"))
    from stagereplay.records.ledger import items, read_ledger

    records = items(read_ledger(run))
    arms = [arm for r in records for arm in r.payload.get("arms", [])]
    fps = sum(arm.get("cache_fp") is not None for arm in arms)
    equal = [c["cache_equal"] for r in records for c in r.payload.get("comparisons", [])
             if not c["b"].endswith("#replica")]  # live against the fresh construction
    row(out, f"{tag}: cache fingerprints recorded (arms)", f"{fps}/{len(arms)}")
    row(out, f"{tag}: live cache == oneshot cache (items)", f"{sum(e is True for e in equal)}/{len(equal)}")
    logit = max(results["first_step_logit_maxabs"].values(), default=0.0)
    cache = max((b["k_rel_l2"] for b in results["cache_bands"]), default=0.0)
    row(out, f"{tag}: first-step logit max|diff|, K rel L2",
        f"{logit:.3g}, {cache:.3g} ({results['suffix_disagreements']['k']}/{results['n_boundary']} divergent)")
    manifest = json.loads((run / "manifest.json").read_text())
    row(out, f"{tag}: cache kind recorded", str(manifest["config"]["model"].get("cache", "not recorded")))
    if a.batch > 1:
        check = manifest["environment"]["determinism"].get("batch_check", {})
        row(out, f"{tag}: rows independent of batch-mates | equal to batch 1",
            f"{'yes' if check.get('invariant') else 'NO'} | {'yes' if check.get('equals_batch_1') else 'no'}")
    (out / f"{name}.json").write_text(json.dumps({"replicas_exact": [k, n], "steps_per_s": rate}) + "\n")
    return 0


def report(out: Path, tag: str, run: Path, prefix: str, wall: float, load: float, device: str) -> float:
    """The rows of a timed run; returns its decode steps per second (model loads apart)."""
    steps, forwards = decode_steps(run, prefix)
    rate = steps / max(wall - load, 1e-9)
    row(out, f"{tag}: time s (model loads apart)", f"{wall:.1f} ({load:.1f} loading)")
    row(out, f"{tag}: decode steps/s", f"{rate:.1f} ({steps} steps of {forwards} forwards)")
    kind, peak = peak_memory(device)
    estimate, stage = plan_estimate(run, prefix)
    row(out, f"{tag}: peak {kind} GiB | plan's estimate", f"{peak:.3g} | {estimate:.3g} ({stage})")
    return rate


def step_2x2(a: argparse.Namespace) -> int:
    runs = [a.out / f"matched-{c}" for c in a.caches.split(",")]
    done = [r for r in runs if (r / "results.json").exists()]
    if not done:
        row(a.out, "2x2", "no matched run to take the items from: skipped")
        return 0
    run = done[0]
    loads = timed_loads(a.device)
    t = time.perf_counter()
    cli(["precision-2x2", str(run), "--precisions", "bf16,fp32", "--quiet"])
    wall = time.perf_counter() - t
    tag = f"2x2 on {run.name}"
    report(a.out, tag, run, "precision_2x2", wall, sum(loads), a.device)
    results = json.loads((run / "results.json").read_text())
    grids = results["precision_2x2"]
    for g in grids if isinstance(grids, list) else [grids]:
        cells = ", ".join(f"{d['precision']} {d['k']}/{d['n']}" for d in g["disagreements"])
        row(a.out, f"{tag}: incremental vs oneshot disagreements", cells)
    return 0


def step_decode(a: argparse.Namespace) -> int:
    """Batch-1 decode against the floor (bench/gpu_decode.py, run as its own command), a matched item's steps
    profiled, the 14B plan."""
    import contextlib
    import io

    from stagereplay.plan.stages import model_shape

    profile = PROFILES["cuda" if a.device.startswith("cuda") else "cpu"]
    shape = {v: k for k, v in SHORT_NAMES.items()}[a.shape]
    figures = a.out / "decode.json"
    copy = ["--copy-mib", "2048" if a.device.startswith("cuda") else "64"]
    # Its table goes to this step's output; its figures come back in the JSON.
    done = subprocess.run([sys.executable, str(BENCH / "gpu_decode.py"), "--shape", shape, "--device", a.device,
                           "--tokens", str(profile.decode_tokens), "--repeats", "1", *copy, "--profile", "--json",
                           str(figures)], cwd=ROOT)
    if done.returncode != 0:
        return done.returncode
    d = json.loads(figures.read_text())
    floor = d["floor_s_per_token"]
    cells = ", ".join(f"{m} {1 / s:.1f} ({times(s / floor)} floor)" for m, s in d["s_per_token"].items())
    row(a.out, f"batch-1 decode, {shape}: tokens/s", f"{cells}; floor {1 / floor:.1f}")
    row(a.out, "batch-1 decode: tokens == generate()",
        ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in d["tokens_equal"].items()))
    for kind, p in d["profile"].items():
        row(a.out, f"matched item's live steps [{kind}]", profile_figures(p))
    # The 14B paper's plan (docs/how-to/plan.md), at ours static's rate scaled to 14B's weight bytes.
    big = config_only("qwen2.5-14b", a.out / "plan-14b-config")
    scale = d["weight_bytes"] / model_shape(big).weight_bytes("bf16")
    rate = scale / d["s_per_token"]["ours static"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli(["plan", "--model", str(big), "--later-model", str(big), "--n", "200", "--prompt-tokens", "64",
             "--stage1-tokens", "2048", "--suffix-tokens", "512", "--tokens-per-second", f"{rate:.2f}", "--device",
             "cuda", "--divergent", "166", "--audit-sample", "20", "--cache", "static"])
    total = [ln for ln in printed.getvalue().splitlines() if ln.startswith("total:")]
    row(a.out, f"plan of the 14B paper at {rate:.2f} steps/s (ours static x {scale:.3f})",
        total[0] if total else "no total line (see plan's output)")
    return 0


def step_model(a: argparse.Namespace) -> int:
    from stagereplay.plan.stages import model_shape

    t = time.perf_counter()
    save_random_model(a.shape, a.model, a.device)  # what `random_model.py --shape SHAPE --out MODEL` saves
    arithmetic_items(a.model / "items.jsonl")
    s = SHAPES[a.shape]
    row(a.out, f"random {a.shape} ({s.layers} layers, hidden {s.hidden}, {s.heads}/{s.kv_heads} heads, vocab {s.vocab})",
        f"drawn on {a.device} and saved in {time.perf_counter() - t:.1f} s")
    weights = model_shape(a.model).weight_bytes("bf16")
    bandwidth = copy_bandwidth(a.device, 2048 if a.device.startswith("cuda") else 64)
    floor = weights / bandwidth  # seconds a batch-1 step takes at least: every weight read once
    row(a.out, "bandwidth floor: weights / copy bandwidth",
        f"{weights / 1e9:.3g} GB / {bandwidth / 1e9:.1f} GB/s = {1e3 * floor:.3g} ms a step ({1 / floor:.0f} steps/s)")
    (a.out / FLOOR).write_text(json.dumps({"weight_bytes": weights, "copy_bytes_per_s": bandwidth,
                                           "floor_s_per_step": floor}) + "\n")
    return 0


def run_step(out: Path, name: str, cmd: list[str], budget: int, env: dict[str, str] | None = None,
             log: Path | None = None, ok: tuple[int, ...] = (0,)) -> int | None:
    """`cmd` in its own process group, killed with its children at `budget` s; None when it timed out. An exit
    status outside `ok` gets a row."""
    stream = open(log, "w") if log else None  # noqa: SIM115 - closed below, after the process ends
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=stream, stderr=subprocess.STDOUT if
                            stream else None, start_new_session=True, cwd=ROOT)
    t = time.perf_counter()
    try:
        rc: int | None = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
        row(out, f"{name}", f"stopped at its budget of {budget} s")
    finally:
        if stream:
            stream.close()
    if rc is not None and rc not in ok:
        row(out, f"{name}", f"failed (exit {rc}) after {time.perf_counter() - t:.0f} s")
    return rc


def pytest_summary(log: Path) -> str:
    found = re.findall(r"(\d+(?:/\d+)? (?:passed|failed|skipped|deselected|error|tests collected)[^=\n]*) in [0-9.]+s",
                       log.read_text())
    return found[-1] if found else "no summary (see the log)"


def times(x: float) -> str:
    return f"{x:.1f}x" if x >= 1 else f"{x:.2f}x"


def summary(out: Path, caches: list[str]) -> str:
    """`decode steps/s against a floor of F: static X (Tx floor), ...`: each matched run's rate, and its time a step
    over the floor's (as bench/gpu_decode.py says it: 1x is the floor; --batch 16's 16 rows may go under it)."""
    runs = {c: f"matched-{c}" for c in caches} | {"dynamic --batch 16": "matched-dynamic-b16"}
    rates = {label: json.loads((out / f"{name}.json").read_text()).get("steps_per_s")
             if (out / f"{name}.json").exists() else None for label, name in runs.items()}
    floor = json.loads((out / FLOOR).read_text())["floor_s_per_step"] if (out / FLOOR).exists() else None
    cells = [f"{label} not measured" if rate is None else
             f"{label} {rate:.1f}" + (f" ({times(1 / (rate * floor))} floor)" if floor else "")
             for label, rate in rates.items()]
    return (f"decode steps/s against a floor of {1 / floor:.0f}: " if floor else
            "decode steps/s (floor not measured): ") + ", ".join(cells)


def step_all(a: argparse.Namespace) -> int:
    profile = PROFILES["cuda" if a.device.startswith("cuda") else "cpu"]
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    (out / TABLE).write_text("")
    for stale in [out / FLOOR, *out.glob("matched-*.json")]:  # an earlier check's figures in the same OUT
        stale.unlink(missing_ok=True)
    t0 = time.perf_counter()
    import torch

    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    row(out, "device", f"{name}; torch {torch.__version__}, Python {sys.version.split()[0]}")
    caches = [c for c in a.caches.split(",") if c]
    if not has_cache_option():
        row(out, "caches", f"this build has no --cache option: runs {a.caches!r} as dynamic only")
    test_env = {"STAGEREPLAY_TEST_DEVICE": a.device, "HF_HUB_OFFLINE": "1"}
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    done, total = 0, 0
    gpu_tests = [*pytest, "-m", "gpu", "tests"]
    if not a.device.startswith("cuda"):  # they need CUDA: on a CPU, only check that they import and collect
        gpu_tests.insert(-1, "--collect-only")
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--device", a.device, "--out", str(out), "--model", str(a.model), "--shape", profile.shape,
              "--caches", a.caches]
    lengths = ["--stage1", str(profile.stage1), "--suffix", str(profile.suffix)]
    batch_lengths = ["--stage1", str(profile.batch_tokens[0]), "--suffix", str(profile.batch_tokens[1])]
    tests: list[tuple[str, list[str]]] = [
        ("gpu tests", gpu_tests), ("engine tests", [*pytest, "tests/test_engine.py", "-k", profile.engine_tests])]
    steps = [("model", [*me, "model", *common]), ("decode", [*me, "decode", *common])]
    steps += [(f"matched [{c}]", [*me, "matched", *common, *lengths, "--cache", c]) for c in caches]
    steps += [("2x2", [*me, "2x2", *common, *lengths])]
    steps += [("matched [dynamic, --batch 16]",
               [*me, "matched", *common, *batch_lengths, "--cache", "dynamic", "--batch", "16"])]
    budgets = {name: profile.budget("batch" if "--batch" in name else name) for name, _ in [*tests, *steps]}
    if sum(budgets.values()) > profile.total:
        raise SystemExit(f"error: the steps' budgets add up to {sum(budgets.values())} s, more than the "
                         f"{profile.total} s all of them may take; run fewer --caches")
    spare = 0.0  # what the steps so far left of their budgets: the next step may use it
    for name, cmd in [*tests, *steps]:
        total += 1
        budget = budgets[name] + int(spare)
        started = time.perf_counter()
        if name in dict(tests):
            log = out / f"{name.replace(' ', '_')}.txt"
            rc = run_step(out, name, cmd, budget, test_env, log, ok=(0, 1, 5))
            if rc is not None:  # 1: some failed (the summary says which); 5: collected nothing (none marked gpu)
                row(out, f"{name} on {a.device}", "none marked gpu in this build" if rc == 5 else pytest_summary(log))
                done += rc in (0, 5)
        else:
            rc = run_step(out, name, cmd, budget)
            done += rc == 0
        spare = max(0.0, budget - (time.perf_counter() - started))
    exact = [json.loads((out / f"{c}.json").read_text())["replicas_exact"]
             for c in [f"matched-{c}" for c in caches] + ["matched-dynamic-b16"] if (out / f"{c}.json").exists()]
    verdict = ("not measured" if not exact else
               "yes" if all(k == n and n for k, n in exact) else "NO")
    rates = summary(out, caches)
    row(out, "gpu check", f"{done}/{total} steps done in {time.perf_counter() - t0:.0f} s")
    row(out, "gpu check: rates", rates)
    print(f"gpu check: {done}/{total} steps done in {time.perf_counter() - t0:.0f} s; replicas exact: {verdict}; "
          f"{rates}")
    return 0 if done == total else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=("all", "model", "decode", "matched", "2x2"))
    p.add_argument("--device", default="cuda", help="cuda | cpu (a tiny shape)")
    p.add_argument("--out", type=Path, default=Path("gpu-out"), help="the table and the runs go here")
    p.add_argument("--model", type=Path, default=None,
                   help="the random model's directory (default: gpu-check-SHAPE in the temporary directory)")
    p.add_argument("--shape", default=None, help="a random_model.py shape (default: the device's profile)")
    p.add_argument("--stage1", type=int, default=None, help="stage-1 tokens (the boundary comes after them)")
    p.add_argument("--suffix", type=int, default=None, help="suffix tokens per arm")
    p.add_argument("--cache", default="dynamic", help="matched: the --cache to run")
    p.add_argument("--caches", default="static,dynamic", help="all: comma list of --cache values")
    p.add_argument("--batch", type=int, default=1, help="matched: items stepping together (--batch)")
    a = p.parse_args(argv)
    profile = PROFILES["cuda" if a.device.startswith("cuda") else "cpu"]
    a.shape = a.shape or profile.shape
    a.stage1 = a.stage1 or profile.stage1
    a.suffix = a.suffix or profile.suffix
    a.out = a.out.resolve()
    # Not under OUT: OUT comes back from the GPU machine, 15 GB of weights must not.
    a.model = (a.model or Path(tempfile.gettempdir()) / f"gpu-check-{a.shape}").resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    step = {"all": step_all, "model": step_model, "decode": step_decode, "matched": step_matched,
            "2x2": step_2x2}[a.step]
    return step(a)


if __name__ == "__main__":
    sys.exit(main())
