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
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

LABELS = {  # label: (module, class, method) whose calls it times
    "step": ("stagereplay.engine.decode", "Stepper", "forward"),
    "pick": ("stagereplay.engine.decode", "Sampler", "pick"),
    "record": ("stagereplay.engine.steps", "StepRecord", "add"),
}
PREFIX = "stagereplay::"


@contextmanager
def labelled() -> Iterator[None]:
    """Within: each LABELS method runs inside a profiler range of its label (a multi-token forward is `prefill`)."""
    import torch

    saved = []
    for label, (module, cls, name) in LABELS.items():
        klass = getattr(importlib.import_module(module), cls)
        original = getattr(klass, name)

        def wrapped(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            if _label == "step" and len(args[1]) > 1:  # Stepper.forward(self, ids, ...): a prefill
                _label = "prefill"
            with torch.profiler.record_function(PREFIX + _label):
                return _original(*args, **kwargs)

        setattr(klass, name, wrapped)
        saved.append((klass, name, original))
    try:
        yield
    finally:
        for klass, name, original in saved:
            setattr(klass, name, original)


def profile_live(lm: Any, prompt: Sequence[int], stage1: int, suffix: int) -> dict[str, Any]:
    """One live arm of `stage1` + `suffix` steps on `lm`, warmed up once, then profiled: per-step figures."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from stagereplay.engine.boundary import After
    from stagereplay.engine.decode import DecodeConfig

    dc = DecodeConfig(max_new_tokens=suffix, max_stage1_tokens=stage1)
    cuda = lm.config.device.startswith("cuda")

    def item() -> int:
        state = lm.live(list(prompt), After(stage1), dc)
        if cuda:
            torch.cuda.synchronize()
        return len(state.prefix) - len(prompt) + len(state.live_suffix.suffix) - 1  # decode steps made

    item()  # the warm-up: proofs, captures and graphs, allocator pools
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with labelled(), profile(activities=activities) as prof:
        started = time.perf_counter()
        steps = item()
        wall = time.perf_counter() - started
    rows = prof.key_averages()

    def host(label: str) -> float:
        return sum(e.cpu_time_total for e in rows if e.key == PREFIX + label) / 1e6

    def count(*keys: str) -> int:
        return sum(e.count for e in rows if any(k in e.key for k in keys))

    device = (sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in rows)
              / 1e6 if cuda else None)
    labels = {label: host(label) for label in ("step", "pick", "record", "prefill")}
    other = wall - sum(labels.values())
    per = 1e3 / steps
    return {
        "steps": steps, "wall_ms": wall * per, "device_ms": None if device is None else device * per,
        **{f"{label}_ms": seconds * per for label, seconds in labels.items() if label != "prefill"},
        "other_ms": other * per,
        "host_reads": count("aten::_local_scalar_dense") / steps,
        "syncs": count("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize") / steps,
        "dtoh_copies": count("DtoH", "Device -> Pageable", "Device -> Pinned") / steps if cuda else None,
    }


def line(name: str, p: dict[str, Any]) -> str:
    """`profile NAME: S steps; per step wall W ms, device D ms (P% of wall); step ...; host reads R, syncs Y, ...`."""
    return f"profile {name}: {p['steps']} steps; {figures(p)}"


def figures(p: dict[str, Any]) -> str:
    """A profile's per-step figures (`profile_live`), as one line says them."""
    device = ("" if p["device_ms"] is None else
              f", device {p['device_ms']:.3f} ms ({100 * p['device_ms'] / p['wall_ms']:.0f}% of wall)")
    tail = "" if p["dtoh_copies"] is None else f", syncs {p['syncs']:.2f}, DtoH copies {p['dtoh_copies']:.2f}"
    return (f"per step wall {p['wall_ms']:.3f} ms{device}; step {p['step_ms']:.3f}, pick {p['pick_ms']:.3f}, record "
            f"{p['record_ms']:.3f}, other {p['other_ms']:.3f} ms; host reads {p['host_reads']:.2f}{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", help="a bench/random_model.py shape name or 7b | 14b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache", default="dynamic", help="dynamic | static")
    p.add_argument("--stage1", type=int, default=16)
    p.add_argument("--suffix", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    args = p.parse_args(argv)

    from types import SimpleNamespace

    from gpu_decode import SHAPE_NAMES  # bench/ is on sys.path when this runs as a script
    from random_model import SHAPES, make

    from stagereplay.engine.lm import LM
    from stagereplay.engine.model import ModelConfig, set_determinism

    shape = SHAPE_NAMES.get(args.shape, args.shape)
    set_determinism(1, args.device)
    model = make(shape, args.device, eos_out_of_reach=True)
    lm = LM(model, SimpleNamespace(eos_token_id=None), ModelConfig(path="random", device=args.device,
                                                                    cache=args.cache))
    vocab = SHAPES[shape][5]
    prompt = [(7 * i + 11) % (vocab - 3) + 3 for i in range(args.prompt)]
    print(line(f"ours {args.cache}", profile_live(lm, prompt, args.stage1, args.suffix)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
