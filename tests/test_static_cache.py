"""The static-cache path (`--cache static`): its identity anchor is generate(cache_implementation="static").

Properties, each with a negative control that fails when the property is switched off, on every CPU:
- the loop's tokens, every step's logits, the final cache and the cache's allocated length equal generate(static)'s
  bit for bit on every tiny architecture (sliding windows shorter than the sequence included); one ulp in a step's
  logits or in the cache is seen, and so is a cache allocated for another length: by its length, which is
  structure. Whether the logits move with the length too is the attention kernel's affair (its blocking over the
  allocated rows), so it is probed on this machine's kernel rather than assumed;
- live generation with a stage boundary equals generate(static) sized for the live loop's longest output, its
  allocated length included;
- fingerprints, comparisons and transplants read only the positions a layer holds: a static cache and a
  dynamic one holding the same values have the same digests, whatever the unwritten rows contain;
- replicas, the bridge and transplants are bit-exact on static caches; a run records its cache kind, and the
  audit re-executes a static run on static caches of the lengths the run allocated.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import attn_for, generated_cache
from nudge import nudged
from tiny import ARCHS, make_config
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.boundary import After
from stagereplay.engine.cache import (
    allocated,
    cache_fingerprints,
    compare_caches,
    held,
    is_static,
    layer_span,
    new_cache,
)
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import LM, load
from stagereplay.engine.transplant import TransplantSpec, transplant
from stagereplay.errors import StageReplayError

PROMPT = "Q: what is 12+7? Think.\n"
STATIC_ARCHS = (*ARCHS, "mistral-sw")  # mistral-sw: every layer a sliding window of 8
EXTRA = 64
"""How many positions more the wrong-length controls allocate."""


@dataclass(frozen=True)
class Decoded:
    """A greedy decode on a static cache: its tokens, every step's logits ([V] each, fp32) and the cache it ran on."""

    tokens: list[int]
    logits: list[torch.Tensor]
    cache: Any


def _generated(out: Any, prompt_len: int, steps: int | None = None) -> Decoded:
    """generate()'s output (return_dict_in_generate, output_logits) as a Decoded, cut to its first `steps` steps."""
    tokens = out.sequences[0, prompt_len:].tolist()[:steps]
    return Decoded(tokens, [t[0] for t in out.logits[:steps]], generated_cache(out))


def _differences(a: Decoded, b: Decoded, contents: bool = True) -> list[str]:
    """What tells two decodes apart, bit for bit: "tokens", "logits", "cache" (the positions its layers hold; only
    with `contents`, for two caches at the same step) and "allocated length" (`engine.cache.allocated`: the rows a
    static forward's shapes follow). Empty: the same decode."""
    same_logits = len(a.logits) == len(b.logits) and all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a.logits, b.logits, strict=True))
    found = {"tokens": a.tokens != b.tokens, "logits": not same_logits,
             "cache": contents and compare_caches(a.cache, b.cache) != [],
             "allocated length": allocated(a.cache) != allocated(b.cache)}
    return [name for name, differs in found.items() if differs]


def _nudged_logits(logits: list[torch.Tensor], step: int = 0) -> list[torch.Tensor]:
    """The same steps' logits, one element of one step moved by one unit in the last place."""
    moved = logits[step].clone()
    moved.view(torch.int32)[0] += 1
    return [moved if k == step else t for k, t in enumerate(logits)]


@contextmanager
def _attention_calls() -> Iterator[list[tuple]]:
    """Within: every SDPA call the model makes is kept as (query, key, value, mask, keywords), its tensors copied (a
    static cache's K/V are the cache's own tensors, written by the next step)."""
    calls: list = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def keep(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.clone(), key.clone(), value.clone(), None if attn_mask is None else attn_mask.clone(),
                      kwargs))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = keep
    try:
        yield calls
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


def _kernel_follows_length(calls: list, length: int) -> bool:
    """Whether this machine's SDPA kernel gives any of a decode's attention calls other bits on a cache allocated
    EXTRA positions longer. Each call over a full-attention static layer (its keys: `length` rows, the unwritten
    ones masked) runs again with EXTRA more key rows, zeros and masked, as a longer cache's unwritten rows are; a
    sliding layer holds its window whatever the length, and is left as it is.

    Whether the padded rows move a bit is the kernel's blocking over the rows it is given, which differs by CPU,
    dtype and length: on an AMD EPYC (Zen 3, AVX2) no call of a bf16 Qwen2 decode of PROMPT moved, nor of a bf16
    Gemma 3, while fp32 ones of both did. Where no call moves, the longer cache's decode is this one bit for bit
    but for its length: SDPA is the only operation that reads the unwritten rows. Where some call moves, the
    logits usually do, not always (a moved attention row can round away before the logits), so nothing is
    claimed of them there."""
    for query, key, value, mask, kwargs in calls:
        if key.shape[-2] != length or mask is None:
            continue
        rows = (*key.shape[:-2], EXTRA, key.shape[-1])
        masked = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        longer = (torch.cat([key, key.new_zeros(rows)], -2), torch.cat([value, value.new_zeros(rows)], -2),
                  torch.cat([mask, mask.new_full((*mask.shape[:-1], EXTRA), masked)], -1))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if not torch.equal(sdpa(query, key, value, attn_mask=mask, **kwargs),
                           sdpa(query, *longer[:2], attn_mask=longer[2], **kwargs)):
            return True
    return False


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


def _longer_is_seen(lm: LM, arch: str, calls: list, length: int, seen: list[str]) -> None:
    """The wrong-length control: what tells a decode on a cache allocated EXTRA positions longer from ours."""
    if arch == "mistral-sw":  # every layer holds its window of 8 whatever the length: the same cache, the same bits
        assert seen == []
        return
    assert "allocated length" in seen, "a wrong max_cache_len must be seen"
    if lm.config.attn_impl == "sdpa" and not _kernel_follows_length(calls, length):
        assert seen == ["allocated length"]  # this machine's kernel does not see the length: only the length can


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_static_loop_equals_generate_static_bitwise(tiny_dir, arch, precision):
    """lm.generate on a static cache: generate(cache_implementation="static")'s tokens, every step's logits, final
    cache and allocated length, bitwise."""
    lm = load(str(tiny_dir(arch)), precision=precision, attn_impl=attn_for(arch), cache="static")
    prompt, n = lm.tokenizer.encode(PROMPT), 24  # prompt + 24 > the sliding window of 8
    length = len(prompt) + n - 1  # what generate() allocates for n new tokens
    ref = _generated(_generate_static(lm, prompt, n), len(prompt))
    logged, caches = _logged(lm)
    with _attention_calls() as calls:
        tokens = lm.generate(prompt, n)
    ours = Decoded(tokens, logged, caches[0])
    assert is_static(ours.cache) and all(c is ours.cache for c in caches)
    assert _differences(ours, ref) == []
    assert allocated(ours.cache) == (8 if arch == "mistral-sw" else length)  # a sliding layer holds min(W, L) rows
    # Negative controls, each seen whatever the kernels: one ulp in one step's logits, one ulp in the cache, and
    # a cache allocated for another length.
    assert _differences(ours, replace(ref, logits=_nudged_logits(ref.logits))) == ["logits"]
    pos = layer_span(ours.cache.layers[0])[1] - 1
    assert _differences(replace(ours, cache=nudged(ours.cache, 0, "k", (0, 0, pos, 0))), ref) == ["cache"]
    wrong = _generated(_generate_static(lm, prompt, n, max_cache_len=length + EXTRA), len(prompt))
    _longer_is_seen(lm, arch, calls, length, _differences(ours, wrong))


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_live_equals_generate_static_and_replicas_bridge_and_transplant_are_exact(tiny_dir, arch):
    lm = load(str(tiny_dir(arch)), precision="bf16", attn_impl=attn_for(arch), cache="static")
    prompt = lm.tokenizer.encode(PROMPT)
    dc = DecodeConfig(max_new_tokens=12, max_stage1_tokens=14)
    logged, _ = _logged(lm)
    with _attention_calls() as calls:
        live = lm.live(prompt, After(10), dc)
    assert live.cache_len == len(prompt) + 14 + 12 - 1 and is_static(live.cache)
    # The live loop's numbers are generate(static)'s for the longest output it may emit (budget + suffix), on a
    # cache of the same allocated length.
    ours = Decoded([*live.stage1, *live.live_suffix.suffix], list(logged), live.cache)
    ref = _generated(_generate_static(lm, prompt, 14 + 12), len(prompt), len(ours.logits))
    assert _differences(ours, ref, contents=False) == [] and allocated(live.cache) == live.cache_len
    # Negative control: sized for another length, the comparison sees it.
    longer = _generate_static(lm, prompt, 14 + 12, max_cache_len=live.cache_len + EXTRA)
    _longer_is_seen(lm, arch, calls, live.cache_len,
                    _differences(ours, _generated(longer, len(prompt), len(ours.logits)), contents=False))
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


def test_cache_kind_is_checked_recorded_and_a_static_run_audits_clean(tmp_path, tiny_dir, items_file, monkeypatch):
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
    records = [json.loads(line) for line in (runs["static"] / "ledger.jsonl").read_text().splitlines()]
    assert all(a["cache_fp"] for r in records if r["kind"] == "item" for a in r["payload"]["arms"])
    lm = load(str(tiny_dir("qwen2")), cache="static")
    dc = DecodeConfig(max_new_tokens=10, max_stage1_tokens=manifest["config"]["stage1"]["budget"])  # the run's
    lengths = {lm.cache_len(len(r["payload"]["prompt_ids"]), dc) for r in records if r["kind"] == "item"}

    # The audit re-executes the static run clean, on static caches of the lengths the run allocated (LM.cache_len
    # of each item's prompt): what each cache an audit makes was allocated for is kept (None: a dynamic one).
    made: list[int | None] = []
    real = LM.new_cache

    def spy(self, length):
        cache = real(self, length)
        made.append(allocated(cache))
        return cache

    monkeypatch.setattr(LM, "new_cache", spy)
    audit = runner.invoke(app, ["audit", str(runs["static"]), "--quiet"])
    assert audit.exit_code == 0, audit.output
    assert "trajectories reproduced" in audit.output
    assert made and set(made) == lengths
    # Negative control: the dynamic run's audit makes dynamic caches, which the same record tells apart on any CPU
    # (the two kinds' fingerprints may or may not differ: SDPA over L masked rows vs over T is the kernel's affair).
    made.clear()
    audit = runner.invoke(app, ["audit", str(runs["dynamic"]), "--quiet"])
    assert audit.exit_code == 0, audit.output
    assert made and set(made) == {None}
    monkeypatch.undo()

    # `plan RUN` prices a static run's caches at what the engine allocated (LM.cache_len of the longest prompt),
    # not at the positions filled; a dynamic run's at the longest sequence (negative control: no static line).
    planned = runner.invoke(app, ["plan", str(runs["static"])])
    assert planned.exit_code == 0, planned.output
    assert f"static caches: each allocated for prompt + stage-1 budget + max new tokens - 1 positions, " \
           f"{max(lengths)} at the longest prompt" in planned.output
    assert "static caches" not in runner.invoke(app, ["plan", str(runs["dynamic"])]).output
