"""Where a decode step's time goes: one matched item's live arm under torch.profiler.

    python bench/gpu_decode.py --shape 7b --device cuda --profile     # after its timings, on the same model
    python bench/step_profile.py --shape tiny --device cpu            # on its own (a random model of the shape)

The live arm is what `matched` runs first for every item: the prompt prefilled, stage 1 decoded to a count
boundary with each step recorded (top-k, margin, the logits a diagnostic may need: engine.steps.StepRecord), the
boundary state cloned and fingerprint-ready, then the suffix decoded and recorded the same way. After one warm-up
item (a proof, a graph's capture), the same item runs under the profiler and each decode step's time is split:

- wall: the host's clock over the item, over its decode steps (the prefill and the boundary's clone included:
  one each per item, amortised);
- device: the device's busy time (the kernels' own time), on CUDA; wall >> device means the host bounds the step;
- step: inside `Stepper.forward` for one token (the model's forward, or its graph's replay, and what feeds it);
  pick: `Sampler.pick`; record: `StepRecord.add` (the step's reductions); other: what is left (the loop, the
  boundary rule, the clone);
- host reads per step: `aten::_local_scalar_dense` (an `int()`/`.item()` of a device tensor: each waits for the
  device), syncs (`cuda*Synchronize`) and device-to-host copies per step (CUDA only).

The profile is bench/common.py's `profile_live` (and its line `profile_line`), the same that `gpu_decode.py
--profile` runs on the model it timed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from common import SHAPES, SHORT_NAMES, bare_lm, fixed_prompt, profile_line, profile_live, random_model


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", help="a bench/common.py shape name or 7b | 14b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache", default="dynamic", help="dynamic | static")
    p.add_argument("--stage1", type=int, default=16)
    p.add_argument("--suffix", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    args = p.parse_args(argv)

    from stagereplay.engine.model import set_determinism

    shape = SHORT_NAMES.get(args.shape, args.shape)
    set_determinism(1, args.device)
    model = random_model(shape, args.device, eos_out_of_reach=True)
    lm = bare_lm(model, args.device, args.cache)
    prompt = fixed_prompt(SHAPES[shape].vocab, args.prompt)
    print(profile_line(f"ours {args.cache}", profile_live(lm, prompt, args.stage1, args.suffix)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
