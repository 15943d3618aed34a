"""Wall time and peak memory of the whole protocol: `stagereplay paper` with 1 and 2 worker processes.

    python bench/paper.py [--n 200] [--workers 1,2[,ray:2]] [--batch 1[,16]] [--executor local|ray]
                          [--model DIR --later-model DIR --data FILE
                          --boundary-after N] [--kernels auto|native|portable] [--json OUT] [--keep DIR]

Each run is a fresh subprocess (`stagereplay paper --quiet --out <tmp> ...`). A `--workers` entry `ray:N` runs
`--executor ray --workers N` (a bare `N` runs `--executor`'s default, local unless given; Ray's start-up, a
local instance per run, is part of the wall time). Peak RSS is that of the whole
process tree (the command and its worker processes), sampled every 50 ms and summed over the tree; the
largest single process is reported beside it. With no model options it runs on the embedded toy checkpoints.
`--keep DIR` keeps the run directory of the last `--workers` value (its report holds the tables of the run
that was timed). `--batch` runs each `--workers` value at each batch row count (`paper --batch C`), and the summary
says which item payloads are byte-identical between the runs (a batched run's ledger records its C and its
invariance check, so only the payloads can be equal).

A shared CPU's pace moves under a run: on the 2-core machine of docs/reference/performance.md the same toy
step took 2.8 ms at one time and 7.7 ms 25 minutes later, with nothing else running in the machine. So each
run is bracketed by the library's own calibration (`plan.rates.calibrate`: a captured decode step and a
prefill on the primary model, per precision, in as many fresh processes at once as the run has workers, since
workers sharing the CPU each step slower than one alone), and the plan of the run as it ran
(`plan_run`: its forwards, counted from its ledger) is priced at the pace measured before it. `wall / plan`
near 1 says the machine kept that pace; a run is comparable with another only at a similar pace.

bf16 results depend on the CPU's kernels (AVX2, AVX-512, AVX-512 with AMX tiles route bf16 matmuls and
attention differently), so the benchmark ends with the kernels that ran and the run's paper figures.
`--kernels` is passed to `paper` (`execution.kernels`): `auto`, its default, runs the embedded toy on portable
kernels (ATen and oneDNN held to their AVX2 code paths, MKL to its COMPATIBLE branch: the same figures on any
x86-64 CPU with AVX2, Intel or AMD) and a
model of your own on this CPU's; `native` runs this CPU's own kernels. The pace bracket runs on the same.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _tree_rss(root: int) -> list[int]:
    """RSS in bytes of `root` and every descendant (psutil if installed, else /proc on Linux)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            proc = psutil.Process(root)
            procs = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                out.append(p.memory_info().rss)
        return out
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            statm = Path(f"/proc/{entry}/statm").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; fields[1] is the parent pid
        parents[int(entry)] = int(fields[1])
        rss[int(entry)] = int(statm.split()[1]) * PAGE
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in tree:
                tree.add(child)
                frontier.append(child)
    return [rss[p] for p in tree if p in rss]


class PeakRSS:
    """Samples a process tree's memory in a background thread until stopped."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid, self.interval = pid, interval
        self.total = self.single = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            sizes = _tree_rss(self.pid)
            if sizes:
                self.total = max(self.total, sum(sizes))
                self.single = max(self.single, max(sizes))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def parse_runs(spec: str, executor: str) -> list[tuple[str, int]]:
    """`1,2,ray:2` -> [(executor, 1), (executor, 2), ("ray", 2)]."""
    runs = []
    for entry in spec.split(","):
        name, _, count = entry.rpartition(":")
        runs.append((name or executor, int(count)))
    return runs


def run_paper(args: argparse.Namespace, executor: str, workers: int, out: Path, batch: int = 1) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "stagereplay.cli",
        "paper",
        "--n",
        str(args.n),
        "--quiet",
        "--out",
        str(out),
        "--workers",
        str(workers),
        "--executor",
        executor,
        "--threads",
        str(args.threads),
        "--kernels",
        args.kernels,
        "--batch",
        str(batch),
    ]
    for flag, value in (
        ("--model", args.model),
        ("--later-model", args.later_model),
        ("--data", args.data),
        ("--boundary-after", args.boundary_after),
        ("--max-new-tokens", args.max_new_tokens),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    before = pace(args, workers)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = PeakRSS(proc.pid)
    output, _ = proc.communicate()
    peak.stop()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(map(str, cmd))}` failed ({proc.returncode}):\n{output[-3000:]}")
    after = pace(args, workers)
    forwards, planned = plan_seconds(out, before, workers)
    from stagereplay.records.ledger import items, read_ledger

    ledger = (out / "ledger.jsonl").read_bytes()
    return {
        "executor": executor,
        "workers": workers,
        "batch": batch,
        "payloads": payloads(out),
        "wall_s": wall,
        "forwards": forwards,
        "plan_s": planned,
        "step_ms": {p: (1e3 / before[p][0], 1e3 / after[p][0]) for p in before},
        "peak_rss_tree_mb": peak.total / 2**20,
        "peak_rss_single_mb": peak.single / 2**20,
        "records": len(items(read_ledger(out))),  # item records, not the chain's stage and environment ones
        "kernels": kernels_line(out),
        "figures": figures(json.loads((out / "results.json").read_text())),
        "ledger_sha256": hashlib.sha256(ledger).hexdigest(),
        "command": cmd,
    }


def payloads(run: Path) -> dict[str, str]:
    """Each item record's payload (its unit as the key), as canonical JSON."""
    from stagereplay.records.ledger import items, read_ledger

    return {f"{r.experiment}/{r.checkpoint}/{r.item_id}/{r.part}": json.dumps(r.payload, sort_keys=True)
            for r in items(read_ledger(run))}


def pace(args: argparse.Namespace, workers: int) -> dict[str, tuple[float, float]]:
    """Per precision, (decode steps per second, prefill tokens per second) on the primary model, measured in
    `workers` fresh processes at once with the run's kernels (`plan.rates.calibrate`, `together`): the
    pace of each of a run's workers, which share the CPU."""
    model = args.model
    if model is None:
        from stagereplay.toy import toy_checkpoint

        model = str(toy_checkpoint("primary"))
    code = ("import json, sys; from stagereplay.plan.rates import calibrate; "
            "r = calibrate(sys.argv[1], ('bf16', 'fp32'), threads=int(sys.argv[2]), steps=64, rounds=5, "
            "together=int(sys.argv[3])); "
            "print(json.dumps({p: [r.steps[p], r.prefill_tokens.get(p, 0.0)] for p in r.steps}))")
    env = {**os.environ, **kernel_env(args)}
    done = subprocess.run([sys.executable, "-c", code, model, str(args.threads), str(workers)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"calibrating {model} failed:\n{done.stderr[-2000:]}")
    return {k: (v[0], v[1]) for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


def kernel_env(args: argparse.Namespace) -> dict[str, str]:
    """The kernel variables `paper --kernels` sets in its own fresh process, for the pace bracket's process."""
    from stagereplay.execution.kernels import choose

    return choose(args.kernels, toy=args.model is None, device="cpu")


def plan_seconds(run: Path, rates: dict[str, tuple[float, float]], workers: int) -> tuple[int, float]:
    """The run's forwards as it ran (`plan_run`, its audit sample included) and their time at `rates`, each
    stage spread over `workers` processes."""
    from stagereplay.plan.rates import Rates
    from stagereplay.plan.recorded import plan_run

    stages = plan_run(run)
    priced = Rates({p: r[0] for p, r in rates.items()}, {p: r[1] for p, r in rates.items() if r[1] > 0})
    seconds = sum(priced.wall(s, workers) for s in stages)
    return sum(s.forwards for s in stages), seconds


def kernels_line(run: Path) -> str:
    """The kernels the run's items were computed under, from the environments its ledger records."""
    envs = [json.loads(line)["payload"] for line in (run / "ledger.jsonl").read_text().splitlines()
            if '"kind":"environment"' in line]
    seen = []
    for env in envs:
        cpu = env.get("kernels", {}).get("cpu", {})
        features = "+".join(k for k, v in (cpu.get("features") or {}).items() if v) or "not recorded"
        caps = " ".join(f"{k}={v}" for k, v in (cpu.get("env") or {}).items() if v) or "none"
        line = (f"ISA {cpu.get('capability')}, CPU features {features}, caps {caps}, "
                f"{env.get('determinism', {}).get('threads')} thread(s)")
        if line not in seen:
            seen.append(line)
    return "; ".join(seen)


def _count(c: dict[str, Any]) -> str:
    return f"{c['k']}/{c['n']}"


def figures(results: dict[str, Any]) -> list[str]:
    """The README's toy table, per checkpoint, from results.json."""
    out = []
    for m in results.get("matched", []):
        ci = m["accuracy_diff"]["ci"]
        out.append(
            f"{m['checkpoint']}: boundary {m['n_boundary']}/{m['n']}, accuracy live/{m['construction']} "
            f"{100 * m['accuracy']['live']:.1f}%/{100 * m['accuracy'][m['construction']]:.1f}%, suffix "
            f"disagreements {_count(m['suffix_disagreements'])}, label disagreements "
            f"{_count(m['label_disagreements'])} ({m['discordant']['live_only']} live only / "
            f"{m['discordant']['other_only']} {m['construction']} only), accuracy difference "
            f"{100 * m['accuracy_diff']['estimate']:+.1f} [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}], "
            f"McNemar p {m['mcnemar_p']:.3f}")
    def listed(x: Any) -> list[dict[str, Any]]:
        return [x] if isinstance(x, dict) else list(x or [])

    for g in listed(results.get("precision_2x2")):
        cells = ", ".join(f"{d['precision']} {d['k']}/{d['n']}" for d in g["disagreements"])
        out.append(f"{g['checkpoint']}: fixed-prefix disagreements {cells}")
    for b in listed(results.get("bridge")):
        out.append(f"{b['checkpoint']}: bridge bit-exact {b['cache_bit_exact']}/{b['rows']}")
    for t in listed(results.get("transplant")):
        dirs = ", ".join(f"{d['direction']} {d['follows_donor']}/{d['n']}" for d in t["directions"])
        out.append(f"{t['checkpoint']}: transplants follow the donor ({t['selection']}): {dirs}")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="items (fewer for a quick run)")
    p.add_argument("--workers", default="1,2", help="comma list of --workers values to run (ray:N: on Ray)")
    p.add_argument("--executor", choices=("local", "ray"), default="local", help="for the bare --workers values")
    p.add_argument("--batch", default="1", help="comma list of --batch values to run each --workers value at")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--model", default=None, help="primary checkpoint (default: the embedded toy)")
    p.add_argument("--later-model", default=None, help="second checkpoint")
    p.add_argument("--data", default=None, help="JSONL items (default: the toy task)")
    p.add_argument("--boundary-after", type=int, default=None, help="stage 1 is the first N generated tokens")
    p.add_argument("--max-new-tokens", type=int, default=None, help="suffix length limit")
    p.add_argument("--kernels", choices=("auto", "native", "portable"), default="auto",
                   help="paper's --kernels: portable (the same bits on any x86-64 CPU with AVX2), "
                        "this CPU's own (native), or auto (portable for the embedded toy)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--keep", type=Path, default=None, help="keep the last run's directory here (a new path)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        from stagereplay.toy import toy_checkpoint

        missing = [n for n in ("primary", "later") if not (toy_checkpoint(n) / "config.json").is_file()]
        if missing:
            print(
                f"the embedded toy checkpoint(s) {', '.join(missing)} are missing: pass --model/--later-model"
            )
            return 2
    if args.keep is not None and args.keep.exists():
        print(f"--keep {args.keep} already exists: pass a new path")
        return 2
    rows = []
    runs = parse_runs(args.workers, args.executor)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(executor, w, int(b)) for executor, w in runs for b in args.batch.split(",")]
        for i, (executor, w, b) in enumerate(runs):
            out = Path(tmp) / f"paper-{executor}-w{w}-b{b}"
            rows.append(run_paper(args, executor, w, out, b))
            if args.keep is not None and i == len(runs) - 1:
                shutil.move(str(out), args.keep)
            else:
                shutil.rmtree(out)
    same = len({r["ledger_sha256"] for r in rows}) == 1
    print(
        f"stagereplay paper --n {args.n} ({args.model or 'embedded toy'}), {args.threads} thread(s) per process"
    )
    print(
        f"{'executor':>8}  {'workers':>7}  {'batch':>5}  {'wall s':>8}  {'speed-up':>8}  {'peak RSS tree MiB':>17}  "
        f"{'largest process MiB':>19}"
    )
    for r in rows:
        print(
            f"{r['executor']:>8}  {r['workers']:>7}  {r['batch']:>5}  {r['wall_s']:8.1f}  "
            f"{rows[0]['wall_s'] / r['wall_s']:8.2f}  {r['peak_rss_tree_mb']:17.0f}  {r['peak_rss_single_mb']:19.0f}"
        )
    first = rows[0]["payloads"]
    for r in rows[1:]:
        equal = sum(first.get(k) == v for k, v in r["payloads"].items())
        print(f"item payloads of --workers {r['workers']} --batch {r['batch']} equal to the first run's: {equal} of "
              f"{len(first)}")
    print("machine pace, a captured decode step before / after each run, as many processes at once as it has "
          "workers (plan.rates.calibrate):")
    for r in rows:
        steps = ", ".join(f"{p} {a:.2f} / {b:.2f} ms" for p, (a, b) in r["step_ms"].items())
        print(f"{r['executor']:>8}  {r['workers']:>7}  {steps}; plan of the run at the pace before it: "
              f"{r['forwards']} forwards, {r['plan_s']:.1f} s (wall / plan {r['wall_s'] / r['plan_s']:.2f})")
    print(
        f"ledgers ({rows[0]['records']} records) byte-identical across the runs: {'yes' if same else 'NO'}"
    )
    print(f"kernels: {rows[-1]['kernels']}")
    for line in rows[-1]["figures"]:
        print(line)
    if args.json:
        kept = [{k: v for k, v in r.items() if k != "payloads"} for r in rows]
        args.json.write_text(json.dumps({"n": args.n, "rows": kept}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
