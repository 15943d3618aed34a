"""`stagereplay plan` beside a real run: the forwards it counts against the forwards the run made, and its
calibrated time against the run's wall time.

    python bench/plan.py --n 4                           # `paper` on the embedded toy, one process
    python bench/plan.py --n 2 --max-new-tokens 16       # a quick look
    python bench/plan.py --n 4 --clock cpu               # CPU time of this process: steadier on a shared CPU

Runs `stagereplay.runs.paper` in this process (`--workers 1`) with every model forward counted by its token
count (`Stepper.forward` wrapped), then `plan` of that run (its measured lengths, the full audit included)
and `--calibrate` (a prefill and a few decode steps on the same model). Prints both side by side; the last
line is `forwards plan N run M (equal: yes|NO), time plan X s run Y s (ratio R)`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4, help="items")
    p.add_argument("--max-new-tokens", type=int, default=128, help="suffix length limit")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: this process's CPU time for the run and the calibration (steadier on a shared CPU)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from stagereplay.engine import decode
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.experiments.plan import calibrate, model_shape, plan_run, render
    from stagereplay.runs import paper
    from stagereplay.toy import toy_checkpoint

    sizes: Counter[int] = Counter()
    forward = decode.Stepper.forward

    def counted(self: Any, ids: Sequence[int], cache: Any, past: int) -> Any:
        sizes[len(ids)] += 1
        return forward(self, ids, cache, past)

    decode.Stepper.forward = counted  # type: ignore[method-assign]  # a counting wrapper of the same method
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        start = clock()
        paper(out, n=args.n, decode=DecodeConfig(max_new_tokens=args.max_new_tokens), workers=1,
              threads=args.threads, quiet=True)
        wall = clock() - start
        decode.Stepper.forward = forward  # type: ignore[method-assign]
        stages = plan_run(out)
        model = str(toy_checkpoint("primary"))
        rates = calibrate(model, sorted({s.precision for s in stages}), threads=args.threads, clock=clock)
        print(render(stages, model_shape(model), rates))
    planned: Counter[int] = Counter()
    for s in stages:
        planned.update(s.sizes)
    estimate = sum(rates.seconds(s) for s in stages)
    same = +planned == +sizes
    print(f"run: {sum(sizes.values())} forwards ({sizes[1]} single-token), {wall:.1f} s {args.clock} (paper --n {args.n} "
          f"--workers 1, load, report and audit included); rates: "
          + ", ".join(f"{p} {x:.0f} steps/s" for p, x in rates.steps.items()))
    if args.json:
        args.json.write_text(json.dumps({"run_forwards": sum(sizes.values()), "plan_forwards": sum(planned.values()),
                                         "equal": same, "run_s": wall, "plan_s": estimate,
                                         "rates": rates.steps, "prefill_rates": rates.prefill_tokens}, indent=2))
    print(f"forwards plan {sum(planned.values())} run {sum(sizes.values())} (equal: {'yes' if same else 'NO'}), "
          f"time plan {estimate:.1f} s run {wall:.1f} s (ratio {estimate / wall:.2f})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
