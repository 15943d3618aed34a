"""`stagereplay plan` beside a real run: the forwards it counts against the forwards the run made, and its
calibrated time against the run's wall time.

    python bench/plan.py --n 4                           # `paper` on the embedded toy, one process
    python bench/plan.py --n 2 --max-new-tokens 16       # a quick look
    python bench/plan.py --n 4 --clock cpu               # CPU time of this process: steadier on a shared CPU
    python bench/plan.py --scale --clock cpu             # the 152k-vocabulary shape of bench/scale.py, 2 items

Runs `stagereplay.runs.paper` in this process (`--workers 1`) with every model forward counted by its token
count (`Stepper.forward` wrapped), then `plan` of that run (its measured lengths, the full audit included)
and `--calibrate` (a prefill and a few decode steps on the same model). Prints both side by side; the last
line is `forwards plan N run M (equal: yes|NO), time plan X s run Y s (ratio R)`.

`--scale` runs `paper` on bench/scale.py's random Qwen2 with the real Qwen2.5 vocabulary (151,936; 4 layers,
hidden 256), one checkpoint, `--boundary-after 1024 --max-new-tokens 512`, 2 items (`--n`), EOS out of reach;
`--scale tiny` is its smoke size. Before the table of the run it prints the plan made before it, from the
lengths the options fix (stage 1, suffix) and the divergence the run then found, which counts the diagnostics'
replays of a divergent step as the whole suffix (a bound).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from common import SCALE_RUNS, clock, save_random_model, think_items


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=None, help="items (default 4; with --scale 2)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="suffix length limit")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: this process's CPU time for the run and the calibration (steadier on a shared CPU)")
    p.add_argument("--scale", nargs="?", const="full", choices=("full", "tiny"), default=None,
                   help="bench/scale.py's 152k-vocabulary model instead of the toy (tiny: its smoke size)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def scale_workload(kind: str, tmp: Path, n: int) -> tuple[str, dict[str, Any], Any]:
    """bench/scale.py's model and items: (the model path, paper's options, the PlanConfig of a plan before
    the run, whose divergence is filled in afterwards)."""
    from stagereplay.engine.boundary import After
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.plan.stages import PlanConfig

    run = SCALE_RUNS[kind]
    model = save_random_model(run.shape, tmp / "model", eos_out_of_reach=True)
    data = think_items(tmp / "items.jsonl", n)
    options = {"model": str(model), "data": str(data), "boundary": After(run.stage1),
               "decode": DecodeConfig(max_new_tokens=run.suffix, max_stage1_tokens=run.stage1)}
    before = PlanConfig(n=n, suffix_tokens=run.suffix, stage1_tokens=run.stage1, later=False)
    return str(model), options, before


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from stagereplay.engine import decode
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.plan.paper import plan_paper, prompt_lengths, render
    from stagereplay.plan.rates import calibrate
    from stagereplay.plan.recorded import plan_run
    from stagereplay.plan.stages import model_shape
    from stagereplay.runs import Inputs, paper
    from stagereplay.toy import toy_checkpoint

    args.n = args.n or (2 if args.scale else 4)
    from stagereplay.engine import prover

    sizes: Counter[int] = Counter()
    proofs: Counter[int] = Counter()  # the forwards proving the captured step: a process's set-up, not a unit's
    proving = [False]
    forward, prove = decode.Stepper.forward, prover.prove_steps

    def counted(self: Any, ids: Sequence[int], cache: Any, past: int, **kwargs: Any) -> Any:
        (proofs if proving[0] else sizes)[len(ids)] += 1
        return forward(self, ids, cache, past, **kwargs)

    def counted_proof(*a: Any, **k: Any) -> Any:
        proving[0] = True
        try:
            return prove(*a, **k)
        finally:
            proving[0] = False

    decode.Stepper.forward = counted  # type: ignore[method-assign]  # a counting wrapper of the same method
    prover.prove_steps = counted_proof  # type: ignore[assignment]  # the same function, its forwards counted apart
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        if args.scale:
            model, options, before = scale_workload(args.scale, Path(tmp), args.n)
        else:
            model = str(toy_checkpoint("primary"))
            options, before = {"decode": DecodeConfig(max_new_tokens=args.max_new_tokens)}, None
        timer = clock(args.clock)
        start = timer()
        results = paper(out, Inputs.of(n=args.n, threads=args.threads, batch=1, **options), workers=1, quiet=True)
        wall = timer() - start
        decode.Stepper.forward = forward  # type: ignore[method-assign]
        prover.prove_steps = prove
        stages = plan_run(out)
        shape = model_shape(model)
        rates = calibrate(model, sorted({s.precision for s in stages}), threads=args.threads, clock=timer)
        if before is not None:
            divergent = results.sections["matched"][0].suffix_disagreements.k
            before = replace(before, divergent=divergent)
            prompts = prompt_lengths(model, options["data"], args.n, None)
            ahead = plan_paper(before, shape, prompts, before.stage1_tokens)
            print(f"before the run (stage 1 {before.stage1_tokens}, suffix {before.suffix_tokens}, divergent "
                  f"{divergent}: the run's):")
            print(render(ahead, shape, rates))
            print(f"forwards before the run {sum(s.forwards for s in ahead)}; of the run as it ran:")
        print(render(stages, shape, rates))
    planned: Counter[int] = Counter()
    for s in stages:
        planned.update(s.sizes)
    estimate = sum(rates.seconds(s) for s in stages)
    same = +planned == +sizes
    print(f"run: {sum(sizes.values())} forwards ({sizes[1]} single-token), {wall:.1f} s {args.clock} (paper --n {args.n} "
          f"--workers 1, load, report and audit included; {sum(proofs.values())} more proving the captured step); rates: "
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
