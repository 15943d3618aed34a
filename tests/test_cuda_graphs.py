"""CUDA-graph replayed steps on a static cache are the eager static steps bit for bit (opt-in: `pytest -m gpu`).

On a GPU, `--cache static` replays each single-token step as a CUDA graph (engine.graphs), the pick copied into
the graph's token buffer on the device. The graph records the eager step's kernels, so logits and cache must
equal those of the same loop with graphs off, bit for bit; and live with graphs must still equal
generate(cache_implementation="static", disable_compile=True) (generate() otherwise compiles with inductor on
CUDA, which fuses kernels). Each property has a negative control.
"""

from __future__ import annotations

import pytest
import torch
from conftest import attn_for, generated_cache
from nudge import nudged

from stagereplay.engine.cache import compare_caches, layer_span
from stagereplay.engine.decode import DecodeConfig, Sampler, decode
from stagereplay.engine.lm import load

pytestmark = pytest.mark.gpu
PROMPT = "Q: what is 12+7? Think.\n"


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device (they run only with -m gpu)")


def _proven(lm, prompt, n, length=None):
    """The graphed step's proof (engine.proof) on a static cache of `length` positions (None: generate()'s for n
    new tokens), made before the steps below are logged: a proof made inside `_run` (the stepper's guard asks for
    one at the first graphed step on a cache of a length no proof ran on) would log its own steps as the run's."""
    proof = lm.prove(prompt, len(prompt) + n, length or len(prompt) + n - 1)
    assert proof is None or proof.equal, proof


def _run(lm, prompt, n, graphs, length=None):
    """Greedy decode of n tokens on a fresh static cache of `length` positions (None: generate()'s); every step's
    logits (fp32 copies) and the cache."""
    saved = lm.stepper.graphs
    if not graphs:
        lm.stepper.graphs = None
    try:
        cache = lm.new_cache(length or len(prompt) + n - 1)
        logged = []
        original = lm.stepper.forward

        def keep(ids, c, past, device_token=None, prompt=()):
            logged.append(original(ids, c, past, device_token=device_token, prompt=prompt).float().clone())
            return logged[-1]

        lm.stepper.forward = keep
        logits = lm.stepper.forward(prompt, cache, 0)
        tokens = decode(lm.stepper, cache, logits, len(prompt), Sampler(DecodeConfig(), 0, lm.config.device), n,
                        lm.eos)
        return tokens, logged, cache
    finally:
        lm.stepper.__dict__.pop("forward", None)  # the class's method again
        lm.stepper.graphs = saved


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_graphed_static_steps_are_the_eager_static_steps_bitwise(tiny_dir, arch, precision):
    lm = load(str(tiny_dir(arch)), precision=precision, device="cuda", attn_impl=attn_for(arch), cache="static")
    assert lm.stepper.graphs is not None
    prompt, n = lm.tokenizer.encode(PROMPT), 32
    _proven(lm, prompt, n)
    graphed_tokens, graphed, graphed_cache = _run(lm, prompt, n, graphs=True)
    assert lm.stepper.graphs.enabled and len(lm.stepper.graphs._graphs) >= 1  # really replayed, not refused
    eager_tokens, eager, eager_cache = _run(lm, prompt, n, graphs=False)
    assert graphed_tokens == eager_tokens
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(graphed, eager, strict=True))
    assert compare_caches(graphed_cache, eager_cache) == []
    # Negative control: one ulp in the cache is seen.
    last = layer_span(eager_cache.layers[0])[1] - 1
    assert compare_caches(graphed_cache, nudged(eager_cache, 0, "k", (0, 0, last, 0))) != []


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_graphed_live_equals_generate_static(tiny_dir, arch):
    """On CUDA the anchor is generate(static) with its compile off; a sliding-window model runs eagerly."""
    lm = load(str(tiny_dir(arch)), precision="bf16", device="cuda", attn_impl=attn_for(arch), cache="static")
    prompt, n = lm.tokenizer.encode(PROMPT), 24
    _proven(lm, prompt, n)
    ids = torch.tensor([prompt], device="cuda")
    if hasattr(lm.model, "_previous_max_cache_length"):
        del lm.model._previous_max_cache_length
    ref = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                            cache_implementation="static", disable_compile=True, return_dict_in_generate=True,
                            output_logits=True)
    tokens, logged, cache = _run(lm, prompt, n, graphs=True)
    assert tokens == ref.sequences[0, len(prompt):].tolist()
    assert all(torch.equal(a.view(torch.int32), b[0].float().view(torch.int32))
               for a, b in zip(logged, ref.logits, strict=True))
    assert compare_caches(cache, generated_cache(ref)) == []
    # Negative control: the same comparison sees a nudged cache.
    last = layer_span(cache.layers[0])[1] - 1
    assert compare_caches(nudged(cache, 0, "v", (0, 0, last, 0)), generated_cache(ref)) != []


def test_a_graph_is_proven_at_the_length_it_replays_at(tiny_dir):
    """A graph replays the kernels recorded for its cache's length L, and a static forward's shapes follow L: a proof
    at one length does not cover a graph on a cache of another. Control: the proof at the first length is asked
    about the second and says no."""
    lm = load(str(tiny_dir("qwen2")), precision="bf16", device="cuda", cache="static")
    prompt, n = lm.tokenizer.encode(PROMPT), 24
    short, longer = len(prompt) + n - 1, len(prompt) + n + 63
    _proven(lm, prompt, n)
    assert set(lm.prover.proofs) == {short} and lm.prover.proofs[short].allocated == short
    assert not lm.prover.proofs[short].covers(len(prompt) + 1, longer)  # the control: another length is not covered
    _proven(lm, prompt, n, longer)
    assert set(lm.prover.proofs) == {short, longer} and lm.prover.proofs[longer].equal
    graphed_tokens, graphed, graphed_cache = _run(lm, prompt, n, graphs=True, length=longer)
    eager_tokens, eager, eager_cache = _run(lm, prompt, n, graphs=False, length=longer)
    assert graphed_tokens == eager_tokens and compare_caches(graphed_cache, eager_cache) == []
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(graphed, eager, strict=True))
