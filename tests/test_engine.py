"""The engine's numerics properties on tiny random models of several architectures, each with a negative control."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import attn_for
from nudge import nudged
from tiny import ARCHS, tiered

from stagereplay.engine.boundary import After
from stagereplay.engine.cache import cache_fingerprint, clone_cache, compare_caches, layer_span
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import NoBoundary, load

# The same properties on a GPU: STAGEREPLAY_TEST_DEVICE=cuda python -m pytest tests/test_engine.py
DEVICE = os.environ.get("STAGEREPLAY_TEST_DEVICE", "cpu")
PROMPTS = ["Q: what is 12+7? Think.\n", "Hello, world! 3*4=", "abc def ghi\n"]


def _generate(lm, prompt, n):
    ids = torch.tensor([prompt], device=lm.model.device)
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", tiered(ARCHS, quick=("qwen2", "gemma2")))
def test_live_loop_equals_generate(tiny_dir, arch, precision):
    """Live generation (stage 1, snapshot, then on) emits exactly what generate(do_sample=False) emits."""
    lm = load(str(tiny_dir(arch)), precision=precision, attn_impl=attn_for(arch), device=DEVICE)
    snapshots = 0
    for text in PROMPTS:
        prompt = lm.tokenizer.encode(text)
        reference = _generate(lm, prompt, 42)
        assert lm.generate(prompt, 42) == reference
        try:
            state = lm.live(prompt, After(12), DecodeConfig(max_new_tokens=30))
        except NoBoundary as early:  # EOS inside stage 1: generate() stopped there too
            assert list(early.generated) == reference
            continue
        snapshots += 1
        assert [*state.stage1, *state.live_suffix.suffix] == reference
    assert snapshots >= 1


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_is_bit_exact_with_live(tiny_dir, arch):
    """The bridge: token-by-token incremental prefill equals the live cache in every layer, K and V, bitwise."""
    lm = load(str(tiny_dir(arch)), precision="bf16", attn_impl=attn_for(arch), device=DEVICE)
    prompt = lm.tokenizer.encode(PROMPTS[0])
    live = lm.live(prompt, After(20), keep_going=False)
    inc = lm.construct(live, "incremental")
    assert compare_caches(live.cache, inc.cache) == []
    assert cache_fingerprint(live.cache) == cache_fingerprint(inc.cache)
    # Negative control: one ulp in one element of one layer must be found, at that layer and absolute position.
    for layer, tensor in [(0, "k"), (lm.n_layers - 1, "v")]:
        pos = layer_span(inc.cache.layers[layer])[1] - 3  # inside a sliding window too
        diffs = compare_caches(live.cache, nudged(inc.cache, layer, tensor, (0, 1, pos, 3)))
        assert [(d.layer, d.tensor, d.position) for d in diffs] == [(layer, tensor, pos)]


@pytest.mark.parametrize("construction", ["incremental", "oneshot", "chunked:4", "retokenized"])
def test_replica_of_each_construction_is_bit_exact(tiny_dir, construction):
    lm = load(str(tiny_dir("qwen2")), precision="bf16", device=DEVICE)
    live = lm.live(lm.tokenizer.encode(PROMPTS[1]), After(16))
    a, b = lm.construct(live, construction), lm.construct(live, construction)
    assert compare_caches(a.cache, b.cache) == []
    assert lm.continue_from(a) == lm.continue_from(b)
    replica = lm.live(lm.tokenizer.encode(PROMPTS[1]), After(16))
    assert compare_caches(live.cache, replica.cache) == [] and live.live_suffix == replica.live_suffix


@pytest.mark.skipif(DEVICE != "cpu", reason="an observation about CPU kernels: on an H200 (torch 2.11, "
                    "transformers 5.17) this tiny model's one-shot and live bf16 caches were bit-equal")
def test_oneshot_differs_bitwise_from_live_in_bf16(tiny_dir):
    """On this CPU a one-shot prefill reaches the same token IDs by different arithmetic: bf16 bits differ.

    This is not a guarantee of the method (which kernels run decides it), so it is checked where it was seen.
    """
    lm = load(str(tiny_dir("qwen2")), precision="bf16", device=DEVICE)
    live = lm.live(lm.tokenizer.encode(PROMPTS[0]), After(16), keep_going=False)
    diffs = compare_caches(live.cache, lm.construct(live, "oneshot").cache)
    assert diffs, "oneshot bf16 cache should differ from live somewhere"
    # ... while its token IDs are exactly the live prefix.
    assert lm.construct(live, "oneshot").prefix == live.prefix


def test_snapshot_is_not_touched_by_later_forwards(tiny_dir):
    """The live snapshot is a deep copy: continuing the original cache leaves it alone; a shallow copy would not."""
    import copy

    lm = load(str(tiny_dir("qwen2")), precision="bf16", device=DEVICE)
    state = lm.live(lm.tokenizer.encode(PROMPTS[2]), After(8), keep_going=False)
    before = cache_fingerprint(state.cache)
    lm.continue_from(state)
    assert cache_fingerprint(state.cache) == before
    # Negative control: a shallow copy shares layer objects, so continuing it changes the "snapshot".
    shallow = copy.copy(state.cache)
    shallow.layers = list(state.cache.layers)
    lm.stepper.forward([state.prefix[-1]], shallow, len(state.prefix) - 1)
    assert cache_fingerprint(state.cache) != before


def test_continue_from_live_snapshot_equals_retained_live_suffix(tiny_dir):
    lm = load(str(tiny_dir("llama")), precision="bf16", device=DEVICE)
    state = lm.live(lm.tokenizer.encode(PROMPTS[0]), After(10), DecodeConfig(max_new_tokens=24))
    assert lm.continue_from(state, DecodeConfig(max_new_tokens=24)) == state.live_suffix
    assert clone_cache(state.cache) is not state.cache


def test_fp32_compute_matches_fp32_bitwise(tiny_dir):
    """Weights kept in bf16 and upcast on use give the same numbers as an fp32 model of a bf16 checkpoint."""
    a = load(str(tiny_dir("qwen2")), precision="fp32", device=DEVICE)
    b = load(str(tiny_dir("qwen2")), precision="fp32-compute", device=DEVICE)
    assert next(b.model.parameters()).dtype == torch.bfloat16
    prompt = a.tokenizer.encode(PROMPTS[0])
    sa, sb = a.live(prompt, After(10)), b.live(prompt, After(10))
    assert compare_caches(sa.cache, sb.cache) == []
    assert sa.live_suffix == sb.live_suffix
    # Negative control: plain bf16 does not give those numbers. Compared in fp32, so that the values differ,
    # not only the dtype.
    c = load(str(tiny_dir("qwen2")), precision="bf16", device=DEVICE)
    bf16 = c.live(prompt, After(10)).cache
    as_fp32 = clone_cache(bf16)
    for layer in as_fp32.layers:
        layer.keys, layer.values = layer.keys.float(), layer.values.float()
    differences = compare_caches(sa.cache, as_fp32)
    assert differences and all(d.reason == "value" for d in differences)


def test_sampling_is_seeded_and_shared_across_constructions(tiny_dir):
    lm = load(str(tiny_dir("qwen2")), precision="fp32", device=DEVICE)
    dc = DecodeConfig(max_new_tokens=20, sample=True, seed=3)
    prompt = lm.tokenizer.encode(PROMPTS[1])
    s1, s2 = lm.live(prompt, After(8), dc), lm.live(prompt, After(8), dc)
    assert s1.live_suffix == s2.live_suffix
    # A construction draws from the same seeded stream: incremental is bit-exact with live, so its sampled
    # continuation is the live one token for token.
    incremental = lm.construct(s1, "incremental")
    assert compare_caches(s1.cache, incremental.cache) == []
    assert lm.continue_from(incremental, dc) == s1.live_suffix
    other = lm.live(prompt, After(8), DecodeConfig(max_new_tokens=20, sample=True, seed=4))
    assert (s1.stage1, s1.live_suffix) != (other.stage1, other.live_suffix)
