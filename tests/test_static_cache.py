"""The static-cache path (`--cache static`): its identity anchor is generate(cache_implementation="static").

Properties, each with a negative control that fails when the property is switched off:
- the loop's tokens, every step's logits and the final cache equal generate(static)'s bit for bit on every tiny
  architecture (sliding windows shorter than the sequence included), and a wrong max_cache_len is seen;
- live generation with a stage boundary equals generate(static) sized for the live loop's longest output;
- fingerprints, comparisons and transplants read only the positions a layer holds: a static cache and a
  dynamic one holding the same values have the same digests, whatever the unwritten rows contain;
- replicas, the bridge and transplants are bit-exact on static caches; a run records its cache kind and the
  audit re-executes a static run clean.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import attn_for
from tiny import ARCHS, make_config
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.boundary import After
from stagereplay.engine.cache import (
    cache_fingerprints,
    compare_caches,
    held,
    is_static,
    layer_span,
    new_cache,
    nudged,
)
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import load
from stagereplay.engine.transplant import TransplantSpec, transplant
from stagereplay.errors import StageReplayError

PROMPT = "Q: what is 12+7? Think.\n"
STATIC_ARCHS = (*ARCHS, "mistral-sw")  # mistral-sw: every layer a sliding window of 8
LENGTH_SEEN = ("qwen2", "llama", "qwen3", "mistral", "gemma3")
"""Where a wrong static cache length moves the logits, so the bitwise comparisons see it: the models whose
default attention is SDPA, whose CPU kernel sums a row's keys in blocks over the allocated length L. Not Gemma 2
(eager attention only: in bf16 its masked rows add exact zeros; in fp32 the matmul's blocking may move them, the
BLAS's choice rather than a property to lean on), nor mistral-sw (every layer holds its window of 8, not L)."""


def _length_seen(lm, arch) -> bool:
    """Whether the wrong-length controls apply to this model, checked against LENGTH_SEEN: a change in the
    attention transformers picks fails here rather than silently switching a control off."""
    applies = lm.config.attn_impl == "sdpa" and arch != "mistral-sw"
    assert applies == (arch in LENGTH_SEEN), (arch, lm.config.attn_impl)
    return applies


def _generate_static(lm, prompt, n, max_cache_len=None):
    """generate(cache_implementation="static"), sized as generate() sizes it by default (prompt + n - 1) unless
    `max_cache_len` is given. generate() keeps the largest length it ever allocated on the model
    (`_previous_max_cache_length`) and reuses it; dropped here so that each call sizes from its own arguments."""
    if hasattr(lm.model, "_previous_max_cache_length"):
        del lm.model._previous_max_cache_length
    ids = torch.tensor([prompt])
    extra = {} if max_cache_len is None else {"max_cache_len": max_cache_len}
    return lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             cache_implementation="static", return_dict_in_generate=True, output_logits=True, **extra)


def _logged(lm):
    """Wrap the stepper: every forward's logits (fp32) and the cache it ran on are kept."""
    logged, caches = [], []
    original = lm.stepper.forward

    def keep(ids, c, past, **kwargs):
        caches.append(c)
        logged.append(original(ids, c, past, **kwargs).float())
        return logged[-1]

    lm.stepper.forward = keep
    return logged, caches


def _bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=False))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_static_loop_equals_generate_static_bitwise(tiny_dir, arch, precision):
    """lm.generate on a static cache: generate(cache_implementation="static")'s tokens, logits and cache, bitwise."""
    lm = load(str(tiny_dir(arch)), precision=precision, attn_impl=attn_for(arch), cache="static")
    prompt, n = lm.tokenizer.encode(PROMPT), 24  # prompt + 24 > the sliding window of 8
    ref = _generate_static(lm, prompt, n)
    logged, caches = _logged(lm)
    tokens = lm.generate(prompt, n)
    assert tokens == ref.sequences[0, len(prompt):].tolist()
    assert _bitwise(logged, [t[0] for t in ref.logits])
    cache = caches[0]
    assert is_static(cache) and all(c is cache for c in caches)
    assert compare_caches(cache, ref.cache) == []
    # Negative controls: one ulp in the cache is seen; so is a cache allocated for another length, where the
    # attention kernel depends on the allocated length (LENGTH_SEEN).
    pos = layer_span(cache.layers[0])[1] - 1
    assert compare_caches(nudged(cache, 0, "k", (0, 0, pos, 0)), ref.cache) != []
    if _length_seen(lm, arch):
        wrong = _generate_static(lm, prompt, n, max_cache_len=len(prompt) + n - 1 + 64)
        assert not _bitwise(logged, [t[0] for t in wrong.logits]), "a wrong max_cache_len must move the logits"


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_live_equals_generate_static_and_replicas_bridge_and_transplant_are_exact(tiny_dir, arch):
    lm = load(str(tiny_dir(arch)), precision="bf16", attn_impl=attn_for(arch), cache="static")
    prompt = lm.tokenizer.encode(PROMPT)
    dc = DecodeConfig(max_new_tokens=12, max_stage1_tokens=14)
    logged, _ = _logged(lm)
    live = lm.live(prompt, After(10), dc)
    live_logits = list(logged)
    assert live.cache_len == len(prompt) + 14 + 12 - 1 and is_static(live.cache)
    # The live loop's numbers are generate(static)'s for the longest output it may emit (budget + suffix).
    ref = _generate_static(lm, prompt, 14 + 12)
    emitted = [*live.stage1, *live.live_suffix.suffix]
    assert emitted == ref.sequences[0, len(prompt):len(prompt) + len(emitted)].tolist()
    assert _bitwise(live_logits, [t[0] for t in ref.logits[: len(live_logits)]])
    if _length_seen(lm, arch):  # negative control: sized for another length, the numbers move
        longer = _generate_static(lm, prompt, 14 + 12, max_cache_len=live.cache_len + 64)
        assert not _bitwise(live_logits, [t[0] for t in longer.logits[: len(live_logits)]])
    # Replica and bridge: the same operations on a fresh static cache of the same length, bit for bit.
    replica = lm.live(prompt, After(10), dc)
    assert compare_caches(live.cache, replica.cache) == [] and replica.live_suffix.suffix == live.live_suffix.suffix
    inc = lm.construct(live, "incremental")
    assert inc.cache_len == live.cache_len and compare_caches(inc.cache, live.cache) == []
    assert inc.fingerprint() == live.fingerprint()
    assert lm.continue_from(inc, dc).suffix == live.live_suffix.suffix
    one = lm.construct(live, "oneshot")
    assert lm.continue_from(one, dc).suffix == lm.continue_from(one, dc).suffix
    # A transplant of every layer makes the recipient the donor, bit for bit; of none, it stays itself.
    full = transplant(one.cache, live.cache, TransplantSpec(layers=tuple(range(lm.n_layers))))
    assert compare_caches(full, live.cache) == [] and is_static(full)
    assert compare_caches(transplant(one.cache, live.cache, TransplantSpec(layers=())), one.cache) == []
    nudge = nudged(live.cache, 1, "v", (0, 1, layer_span(live.cache.layers[1])[1] - 1, 2))
    assert compare_caches(transplant(one.cache, nudge, TransplantSpec(layers=(1,), kv="v")), live.cache) != []
    # A continuation longer than the cache was allocated for is refused, not written past the end.
    with pytest.raises(StageReplayError, match="static cache of"):
        lm.continue_from(live, DecodeConfig(max_new_tokens=40))


def _fill(cache, chunks, seed=0):
    """Write the same random K/V (chunks of the given lengths) into every layer; [B=1, H=2, T, D=16]."""
    g = torch.Generator().manual_seed(seed)
    for n in chunks:
        for i in range(len(cache.layers)):
            k, v = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
            cache.update(k.to(torch.bfloat16), v.to(torch.bfloat16), i)
    return cache


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "mistral-sw"])
@pytest.mark.parametrize("chunks", [(5, 1, 1), (5, 1, 1, 1, 1, 3, 1, 1), (11, 1, 2)])
def test_static_and_dynamic_caches_of_the_same_values_have_the_same_digests(arch, chunks):
    """Only the positions a layer holds are read: a static cache (rows beyond them: zeros, or junk) and a dynamic
    cache holding the same values fingerprint, compare and span alike (sliding windows of 8 included)."""
    config = make_config(arch, layers=2, hidden=32)
    config.head_dim = 16
    model = SimpleNamespace(config=config)
    dynamic = _fill(new_cache(model), chunks)
    static = _fill(new_cache(model, "static", 24), chunks)
    assert cache_fingerprints(static) == cache_fingerprints(dynamic)
    assert compare_caches(static, dynamic) == []
    assert [layer_span(s) for s in static.layers] == [layer_span(d) for d in dynamic.layers]
    # Junk in the rows no step reads again (unwritten ones; a full sliding layer's oldest) changes nothing.
    with torch.inference_mode():
        for layer in static.layers:
            k, _, _ = held(layer)  # a view of rows [first, first + T) of the layer's [1, H, L, D] tensor
            first = (k.storage_offset() - layer.keys.storage_offset()) // layer.keys.stride(2)
            layer.keys[:, :, :first] = 7.0
            layer.keys[:, :, first + k.shape[2]:] = 7.0
    assert cache_fingerprints(static) == cache_fingerprints(dynamic)
    # Negative control: one ulp in a held position is seen by both the fingerprint and the comparison.
    moved = nudged(static, 1, "k", (0, 1, layer_span(static.layers[1])[1] - 1, 3))
    assert cache_fingerprints(moved)[0] != cache_fingerprints(dynamic)[0] and compare_caches(moved, dynamic) != []


def test_cache_kind_is_checked_recorded_and_a_static_run_audits_clean(tmp_path, tiny_dir, items_file):
    runner = CliRunner()
    bad = runner.invoke(app, ["matched", "--model", str(tiny_dir("qwen2")), "--data", str(items_file), "--out",
                              str(tmp_path / "bad"), "--quiet", "--cache", "paged"])
    assert bad.exit_code == 2 and "unknown cache 'paged'" in bad.output and not (tmp_path / "bad").exists()
    runs = {}
    for kind in ("static", "dynamic"):
        out = tmp_path / kind
        args = ["matched", "--model", str(tiny_dir("qwen2")), "--data", str(items_file), "--out", str(out),
                "--quiet", "--n", "2", "--boundary-after", "8", "--max-new-tokens", "10", "--cache", kind]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        runs[kind] = out
    manifest = json.loads((runs["static"] / "manifest.json").read_text())
    assert manifest["config"]["model"]["cache"] == "static"
    audit = runner.invoke(app, ["audit", str(runs["static"]), "--quiet"])
    assert audit.exit_code == 0, audit.output
    assert "trajectories reproduced" in audit.output

    def fingerprints(run):
        records = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
        return [a["cache_fp"] for r in records if r["kind"] == "item" for a in r["payload"]["arms"]]

    # Negative control: the two kinds give different caches here (SDPA over L padded rows vs over T), so a clean
    # audit of the static run is one that re-executed it on a static cache.
    assert all(fingerprints(runs["static"])) and fingerprints(runs["static"]) != fingerprints(runs["dynamic"])

    # `plan RUN` prices a static run's caches at what the engine allocated (LM.cache_len of the longest prompt),
    # not at the positions filled; a dynamic run's at the longest sequence (negative control: no static line).
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.lm import load

    lm = load(str(tiny_dir("qwen2")), cache="static")
    prompts = [len(r["payload"]["prompt_ids"]) for r in map(json.loads, (runs["static"] / "ledger.jsonl").open())
               if r["kind"] == "item"]
    allocated = max(lm.cache_len(p, DecodeConfig(max_new_tokens=10)) for p in prompts)
    planned = runner.invoke(app, ["plan", str(runs["static"])])
    assert planned.exit_code == 0, planned.output
    assert f"static caches: each allocated for prompt + stage-1 budget + max new tokens - 1 positions, {allocated} " \
           "at the longest prompt" in planned.output
    assert "static caches" not in runner.invoke(app, ["plan", str(runs["dynamic"])]).output
