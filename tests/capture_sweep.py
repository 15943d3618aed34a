"""A property-based sweep of random tiny models: the captured decode step is the eager step, bit for bit.

Each case is a random configuration of an architecture we support (Qwen2, Llama, Qwen3, Mistral, Gemma 2,
Gemma 3): layers, GQA ratio, head size, a sliding window below, at or above the sequence, a random pattern of
sliding and global layers, logit softcapping on or off, a prompt length and a precision (bf16, fp32). On each,
the captured step (engine.decode.Stepper with capture) runs beside the eager step over every position
(engine.proof.prove_steps: logits bit for bit at every step, then the caches), and the live loop's greedy tokens
are compared with `generate(do_sample=False)`'s. Seeded and bounded (hypothesis, derandomized), so a run is the
same sweep on every machine; which kernels it meets is the machine's (tests/test_capture_sweep.py runs it under
this CPU's native kernels and under portable ones).

`python tests/capture_sweep.py N [--bug] [--planted]` runs N cases and prints one line per case and a summary
line (`--bug` reintroduces the bug the sweep exists for: library switches not held at their eager values;
`--planted` adds a switch of the same kind that moves values, `planted_switch`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

ARCHS = ("qwen2", "llama", "qwen3", "mistral", "gemma2", "gemma3")
VOCAB = 64


@dataclass(frozen=True)
class Case:
    arch: str
    precision: str
    layers: int
    kv_heads: int
    groups: int  # query heads per K/V head (GQA ratio)
    head_dim: int
    window: int | None  # sliding window, None for none
    sliding: tuple[bool, ...]  # per layer (Gemma 3's pattern; Mistral slides on all, Gemma 2 alternates)
    softcap: bool
    prompt: int
    new: int  # decoded tokens
    seed: int

    @property
    def length(self) -> int:
        return self.prompt + self.new

    def triggers(self) -> bool:
        """Whether the case reaches the switch the sweep exists for: SDPA attention, a single query token with a
        mask (a sliding window the sequence fills) and grouped K/V heads."""
        eager_only = self.arch == "gemma2" or (self.arch == "gemma3" and self.softcap)
        windowed = self.window is not None and any(self.sliding) and self.window <= self.length - 1
        return not eager_only and windowed and self.groups > 1


def cases() -> Any:
    """The hypothesis strategy of `Case`s."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw: Any) -> Case:
        # Weighted toward what can break: SDPA with sliding windows (Gemma 3, Mistral) twice as often.
        arch = draw(st.sampled_from(("gemma3", "mistral", "qwen2", "llama", "qwen3", "gemma2", "gemma3", "mistral")))
        layers = draw(st.integers(1, 3))
        prompt = draw(st.integers(1, 20))
        new = draw(st.integers(8, 28))
        length = prompt + new
        # The first value of each sampled_from is the one hypothesis tries first and shrinks toward: the
        # interesting one (a window the sequence fills, sliding layers, grouped heads).
        windowed = arch in ("gemma2", "gemma3") or (arch == "mistral" and draw(st.sampled_from((True, False))))
        window = None
        if windowed:  # below, at or above the sequence
            where = draw(st.sampled_from(("below", "below", "at", "above")))
            window = {"below": draw(st.integers(2, max(2, length - 2))), "at": length,
                      "above": length + draw(st.integers(1, 16))}[where]
        if arch == "gemma3":
            sliding = tuple(draw(st.lists(st.sampled_from((True, False)), min_size=layers, max_size=layers)))
        elif arch == "gemma2":
            sliding = tuple(i % 2 == 0 for i in range(layers))
        else:
            sliding = (window is not None,) * layers
        return Case(arch=arch, precision=draw(st.sampled_from(("bf16", "fp32"))), layers=layers,
                    kv_heads=draw(st.sampled_from((1, 2))), groups=draw(st.sampled_from((2, 4, 1))),
                    head_dim=draw(st.sampled_from((8, 16))), window=window, sliding=sliding,
                    softcap=arch in ("gemma2", "gemma3") and draw(st.sampled_from((False, True))), prompt=prompt, new=new,
                    seed=draw(st.integers(0, 2**16)))

    return build()


def make_model(case: Case) -> Any:
    """A random model for `case`, weights drawn with a larger spread (near-ties in few layers), in its precision."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    heads = case.kv_heads * case.groups
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=heads * case.head_dim, intermediate_size=64,
                                  num_hidden_layers=case.layers, num_attention_heads=heads,
                                  num_key_value_heads=case.kv_heads, max_position_embeddings=256, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if case.arch in ("qwen2", "llama", "mistral"):
        common["head_dim"] = case.head_dim
    if case.arch == "qwen2":
        config: Any = Qwen2Config(**common)
    elif case.arch == "llama":
        config = LlamaConfig(**common)
    elif case.arch == "qwen3":
        config = Qwen3Config(**common, head_dim=case.head_dim)
    elif case.arch == "mistral":
        config = MistralConfig(**common, sliding_window=case.window)
    else:
        caps = {"attn_logit_softcapping": 50.0 if case.softcap else None,
                "final_logit_softcapping": 30.0 if case.softcap else None}
        if case.arch == "gemma2":
            config = Gemma2Config(**common, head_dim=case.head_dim, sliding_window=case.window or 4096, **caps)
        else:
            config = Gemma3TextConfig(**common, head_dim=case.head_dim, sliding_window=case.window or 4096,
                                      layer_types=["sliding_attention" if s else "full_attention"
                                                   for s in case.sliding], **caps)
    config._attn_implementation = "eager" if not case_sdpa(case) else "sdpa"
    torch.manual_seed(case.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model = model.to(torch.bfloat16).to(torch.bfloat16 if case.precision == "bf16" else torch.float32)
    return model.eval()


def case_sdpa(case: Case) -> bool:
    """Whether the case runs SDPA: what `--attn-impl auto` picks (eager where logits are softcapped)."""
    return not (case.arch == "gemma2" or (case.arch == "gemma3" and case.softcap))


@contextmanager
def planted_switch() -> Iterator[None]:
    """Within: a library switch of the kind the sweep exists for, planted in the models' SDPA attention. While dynamo
    traces it, where transformers' own switch acts (a single query token with a mask, grouped K/V heads), it returns
    the attention doubled; eagerly it is the library's own attention.

    The real switch (the query's heads packed eagerly, the K/V heads repeated when traced) computes the same numbers
    through other kernels, whose bits differ on some CPUs and dtypes and not on others. This one moves the values,
    so whatever compares the captured step with the eager one must see it on any CPU: the negative controls of the
    sweep and of the proof use it."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    real = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def switched(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        out, weights = real(module, query, key, value, attention_mask, **kwargs)
        grouped = getattr(module, "num_key_value_groups", 1) > 1
        if torch.compiler.is_compiling() and query.shape[2] == 1 and attention_mask is not None and grouped:
            out = out * 2
        return out, weights

    ALL_ATTENTION_FUNCTIONS["sdpa"] = switched  # this mapping's own entry, read by every model's attention
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = real


def check(case: Case, bug: bool = False, planted: bool = False) -> dict[str, Any]:
    """Run one case: the proof (captured vs eager at every position) and live tokens vs generate(); with `bug`, the
    library switches not held; with `planted`, within `planted_switch`."""
    if planted:
        with planted_switch():
            return check(case, bug)
    import torch

    from stagereplay.engine.cache import new_cache
    from stagereplay.engine.decode import DecodeConfig, Sampler, Stepper, decode
    from stagereplay.engine.proof import prove_steps

    model = make_model(case)
    prompt = [1, *torch.randint(3, VOCAB, (case.prompt - 1,), generator=torch.Generator().manual_seed(case.seed))
              .tolist()]
    fast, eager = Stepper(model, "cpu", capture=True), Stepper(model, "cpu")
    fast.eager_branches = not bug
    proof = prove_steps("captured", fast, eager, lambda: new_cache(model), prompt, case.length)
    cache = new_cache(model)
    logits = fast.forward(prompt, cache, 0)
    live = decode(fast, cache, logits, len(prompt), Sampler(DecodeConfig(), 0, "cpu"), case.new, frozenset())
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None  # no stop: both decode `new` tokens
    with torch.inference_mode():
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=case.new)[0, len(prompt):].tolist()
    return {"equal": proof.equal, "first_difference": proof.first_difference, "steps": proof.steps,
            "live_equals_generate": live == reference, "triggers": case.triggers()}


def sweep(n: int, bug: bool = False, seed: int = 0, only_switch: bool = False, planted: bool = False
          ) -> list[tuple[Case, dict[str, Any]]]:
    """`n` cases drawn by hypothesis from a fixed seed, each checked (`check`); every outcome returned (none
    raised). `only_switch`: only fp32 cases that reach the switch (`Case.triggers`)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    out: list[tuple[Case, dict[str, Any]]] = []

    @hseed(seed)
    @settings(max_examples=n, deadline=None, database=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(cases().filter(lambda c: c.triggers() and c.precision == "fp32") if only_switch else cases())
    def run(case: Case) -> None:
        out.append((case, check(case, bug, planted)))

    run()
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    bug = "--bug" in sys.argv
    started = time.perf_counter()
    results = sweep(n, bug, planted="--planted" in sys.argv)
    for case, result in results:
        print(json.dumps({**asdict(case), **result}))
    bad = sum(not r["equal"] or not r["live_equals_generate"] for _, r in results)
    print(f"sweep: {len(results)} cases, {sum(r['triggers'] for _, r in results)} reach the switch, {bad} differ, "
          f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
