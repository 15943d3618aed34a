"""Every cache kind handled or refused: absolute positions on sliding-window layers, transplants of position
ranges, refusals of caches that are not plain K/V, and fingerprints streamed in bounded chunks.

The sliding configurations (tiny.SLIDING) have windows of 8, so after ~50 positions a sliding layer holds
only the last 7: its row 0 is not position 0.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from conftest import attn_for
from nudge import nudged
from tiny import REFUSED, SLIDING
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine import cache as cache_mod
from stagereplay.engine.boundary import After
from stagereplay.engine.cache import (
    bits,
    cache_fingerprint,
    check_cache_kinds,
    clone_cache,
    compare_caches,
    layer_span,
)
from stagereplay.engine.lm import load
from stagereplay.engine.transplant import TransplantSpec, transplant
from stagereplay.errors import StageReplayError

PROMPT = "Q: what is 12+7? Think.\n"


def _state(tiny_dir, arch):
    lm = load(str(tiny_dir(arch)), precision="bf16", attn_impl=attn_for(arch))
    state = lm.live(lm.tokenizer.encode(PROMPT), After(30), keep_going=False)
    return lm, state


def _changed(a, b, layer: int, tensor: str = "k") -> set[int]:
    """Absolute positions at which one layer's K (or V) differs bitwise between two caches."""
    la, lb = a.layers[layer], b.layers[layer]
    x, y = (la.keys, lb.keys) if tensor == "k" else (la.values, lb.values)
    rows = (bits(x) != bits(y)).flatten(0, 1).any(dim=(0, 2)).nonzero()[:, 0].tolist()
    return {layer_span(la)[0] + r for r in rows}


def _everywhere_nudged(cache):
    """A clone with every element moved by one unit in the last place: a donor that differs at every position."""
    out = clone_cache(cache)
    with torch.inference_mode():
        for layer in out.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name).clone()
                bits(t).add_(1)
                setattr(layer, name, t)
    return out


@pytest.mark.parametrize("arch", SLIDING)
def test_differences_are_reported_at_absolute_positions(tiny_dir, arch):
    _lm, state = _state(tiny_dir, arch)
    cache = state.cache
    length = len(state.prefix) - 1
    sliding = [i for i, layer in enumerate(cache.layers) if layer_span(layer)[0] > 0]
    assert sliding, "the window must be shorter than the sequence"
    for i, layer in enumerate(cache.layers):
        start, stop = layer_span(layer)
        assert stop == length and (start > 0) == (i in sliding)
        planted = stop - 3  # e.g. 50 in a window holding 46..52, reported as 50, not as row 4
        diffs = compare_caches(cache, nudged(cache, i, "v", (0, 1, planted, 2)))
        assert [(d.layer, d.tensor, d.position) for d in diffs] == [(i, "v", planted)]
    # Negative control: a position a sliding window no longer holds cannot be planted there at all.
    with pytest.raises(ValueError, match="not in layer"):
        nudged(cache, sliding[0], "k", (0, 0, 2, 0))


@pytest.mark.parametrize("arch", SLIDING)
def test_transplant_moves_exactly_the_positions_given(tiny_dir, arch):
    """Positions A:B change exactly A..B-1; on a sliding layer only those still inside its window."""
    lm, state = _state(tiny_dir, arch)
    recipient = state.cache
    donor = _everywhere_nudged(recipient)
    length = len(state.prefix) - 1
    a, b = length - 10, length - 2  # straddles the start of every window of 7
    out = transplant(recipient, donor, TransplantSpec(tuple(range(lm.n_layers)), "kv", (a, b)))
    for i, layer in enumerate(recipient.layers):
        start, stop = layer_span(layer)
        expected = set(range(max(a, start), min(b, stop)))
        assert _changed(out, recipient, i, "k") == expected == _changed(out, recipient, i, "v")
        assert expected and (len(expected) < b - a) == (start > a)
    # K only: V untouched.
    k_only = transplant(recipient, donor, TransplantSpec((0,), "k", (a, b)))
    assert _changed(k_only, recipient, 0, "v") == set() and _changed(k_only, recipient, 0, "k")
    # Neither input was modified.
    assert compare_caches(recipient, state.cache) == [] and compare_caches(donor, _everywhere_nudged(state.cache)) == []


@pytest.mark.parametrize("arch", SLIDING)
def test_positions_0_to_4_move_positions_0_to_4_or_are_refused(tiny_dir, arch):
    lm, state = _state(tiny_dir, arch)
    recipient = state.cache
    donor = _everywhere_nudged(recipient)
    full = [i for i, layer in enumerate(recipient.layers) if layer_span(layer)[0] == 0]
    spec = TransplantSpec(tuple(range(lm.n_layers)), "kv", (0, 4))
    if not full:  # every layer slides (Mistral): positions 0-3 are in no cache, so nothing can move them
        with pytest.raises(StageReplayError, match=r"--positions 0:4 lie outside every selected layer's cache"):
            transplant(recipient, donor, spec)
        return
    out = transplant(recipient, donor, spec)
    for i in range(lm.n_layers):
        assert _changed(out, recipient, i) == ({0, 1, 2, 3} if i in full else set())
    sliding_only = tuple(i for i in range(lm.n_layers) if i not in full)
    with pytest.raises(StageReplayError, match="outside every selected layer's cache"):
        transplant(recipient, donor, TransplantSpec(sliding_only, "kv", (0, 4)))


@pytest.mark.parametrize("arch", REFUSED)
def test_caches_that_are_not_plain_kv_are_refused_before_any_run(tiny_dir, items_file, tmp_path, arch):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["matched", "--model", str(tiny_dir(arch)), "--data", str(items_file), "--n", "1",
                                   "--boundary-after", "4", "--max-new-tokens", "4", "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: model type {arch} has a ") and "in layer 0" in lines[0]
    assert not out.exists()
    with pytest.raises(StageReplayError, match=f"model type {arch}"):
        load(str(tiny_dir(arch)))


def test_a_cache_implementation_is_refused(tiny_dir, items_file, tmp_path):
    model = tmp_path / "static-qwen2"
    shutil.copytree(tiny_dir("qwen2"), model)
    generation = model / "generation_config.json"
    config = json.loads(generation.read_text()) if generation.exists() else {}
    generation.write_text(json.dumps({**config, "cache_implementation": "static"}))
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["matched", "--model", str(model), "--data", str(items_file), "--n", "1",
                                   "--boundary-after", "4", "--out", str(out)])
    assert res.exit_code == 2 and "cache_implementation='static'" in res.output, res.output
    assert not out.exists()
    # Negative control: the same model without it loads.
    generation.write_text(json.dumps(config))
    assert load(str(model)).n_layers == 4


def test_shared_kv_layers_are_refused(tiny_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_dir("qwen2"))
    check_cache_kinds(config)  # plain K/V passes
    config.kv_sharing_modes = ["none", "none", "reuse", "reuse"]  # layers 2-3 read layers 0-1's K/V
    with pytest.raises(StageReplayError, match=r"model type qwen2 has a layer without K/V of its own .* layer 2"):
        check_cache_kinds(config)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_fingerprints_stream_bounded_chunks_with_the_same_digest(tiny_dir, arch, monkeypatch):
    """Streaming changes no byte: the digest is sha256 over each layer's K then V as whole tensors."""
    _lm, state = _state(tiny_dir, arch)
    whole = hashlib.sha256()
    for layer in state.cache.layers:
        for t in (layer.keys, layer.values):
            whole.update(f"{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}\n".encode())
            whole.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    sizes: list[int] = []
    chunks = cache_mod._host_chunks

    def spy(t):
        for c in chunks(t):
            sizes.append(c.nbytes)
            yield c

    monkeypatch.setattr(cache_mod, "CHUNK_BYTES", 256)
    monkeypatch.setattr(cache_mod, "_host_chunks", spy)
    assert cache_fingerprint(state.cache) == whole.hexdigest()
    assert sizes and max(sizes) <= 256 and len(sizes) > 2 * len(state.cache.layers)
    # Negative control: one ulp anywhere changes the digest.
    assert cache_fingerprint(nudged(state.cache, 1, "v", (0, 0, len(state.prefix) - 2, 0))) != whole.hexdigest()


def test_one_pass_gives_both_fingerprints_streaming_each_byte_once(tiny_dir, monkeypatch):
    """The bridge hashes each cache once: `cache_fingerprints` equals the whole and the per-layer digests made
    apart, and sends each byte of the cache to the host once (the two apart send it twice)."""
    from stagereplay.engine.cache import cache_fingerprints, layer_fingerprints

    _lm, state = _state(tiny_dir, "qwen2")
    sent = [0]
    chunks = cache_mod._host_chunks

    def spy(t):
        for c in chunks(t):
            sent[0] += c.nbytes
            yield c

    monkeypatch.setattr(cache_mod, "_host_chunks", spy)
    size = sum(t.numel() * t.element_size() for layer in state.cache.layers for t in (layer.keys, layer.values))
    whole, layers = cache_fingerprints(state.cache)
    assert sent[0] == size
    sent[0] = 0
    assert (whole, layers) == (cache_fingerprint(state.cache), layer_fingerprints(state.cache))
    assert sent[0] == 2 * size
    # Negative control: one ulp in one layer's V changes the whole digest and that layer's only.
    other_whole, other_layers = cache_fingerprints(nudged(state.cache, 1, "v", (0, 0, 0, 0)))
    assert other_whole != whole
    assert [i for i, (a, b) in enumerate(zip(layers, other_layers, strict=True)) if a != b] == [1]
    assert other_layers[1]["k"] == layers[1]["k"] and other_layers[1]["v"] != layers[1]["v"]


@pytest.mark.parametrize(("name", "kind"), [
    ("FalconH1Config", "hybrid layer"),
    ("Qwen3NextConfig", "recurrent or linear-attention state"),
    ("Mamba2Config", "recurrent or linear-attention state"),
    ("Gemma3nTextConfig", "layer without K/V of its own"),
])
def test_other_hybrid_and_shared_kv_configs_are_refused(name, kind):
    """The same rule on the configs of other architectures (their default shapes; no weights are built)."""
    import transformers

    with pytest.raises(StageReplayError, match=kind):
        check_cache_kinds(getattr(transformers, name)())


def test_lfm2_conv_layers_are_refused():
    from transformers import Lfm2Config

    with pytest.raises(StageReplayError, match="model type lfm2 has a recurrent or linear-attention state"):
        check_cache_kinds(Lfm2Config(num_hidden_layers=6, full_attn_idxs=[2, 5]))
    check_cache_kinds(Lfm2Config(num_hidden_layers=6))  # negative control: all attention layers pass


@pytest.mark.parametrize("arch", SLIDING)
def test_spans_from_the_config_are_the_spans_the_cache_holds(tiny_dir, arch):
    """What `transplant` checks up front from the config (before a stage is frozen) is what a live cache holds."""
    from transformers import AutoConfig

    from stagereplay.engine.cache import layer_windows
    from stagereplay.engine.transplant import held_spans

    _lm, state = _state(tiny_dir, arch)
    windows = layer_windows(AutoConfig.from_pretrained(tiny_dir(arch)))
    length = len(state.prefix) - 1
    assert held_spans(windows, length) == [layer_span(layer) for layer in state.cache.layers]
    # Negative control: a window one larger predicts other spans.
    assert held_spans([w + 1 if w else w for w in windows], length) != held_spans(windows, length)


def test_transplant_positions_outside_every_window_are_refused_before_the_stage(tiny_dir):
    from stagereplay.engine.model import ModelConfig
    from stagereplay.experiments.protocol.transplant import TransplantConfig, check_selection

    prefixes = [list(range(60)), list(range(45))]
    mistral, gemma = ModelConfig(str(tiny_dir("mistral-sw"))), ModelConfig(str(tiny_dir("gemma2")))
    with pytest.raises(StageReplayError, match="--positions 0:4 lie outside every selected layer's cache"):
        check_selection(mistral, TransplantConfig(positions="0:4"), prefixes)
    check_selection(mistral, TransplantConfig(positions="40:"), prefixes)  # inside both items' windows
    check_selection(gemma, TransplantConfig(positions="0:4"), prefixes)  # gemma2's global layers hold them
    with pytest.raises(StageReplayError, match="outside every selected layer"):
        check_selection(gemma, TransplantConfig(layers="0,2", positions="0:4"), prefixes)  # its sliding layers
    with pytest.raises(StageReplayError, match="out of range"):
        check_selection(gemma, TransplantConfig(layers="0-9"), prefixes)
