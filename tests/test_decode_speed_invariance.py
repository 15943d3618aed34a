"""The decode loop passes what generate() passes, step by step, and its numbers are generate()'s bit for bit.

The loop's speed-ups (explicit positions and no all-ones attention mask, as generate() itself passes them;
positions sliced from one buffer; a reused (1, 1) token tensor; single-token steps captured by dynamo with
the eager backend) must not move a single bit: checked here on every tiny architecture in bf16 and fp32,
logits and caches, each with a negative control.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import attn_for, generated_cache
from nudge import nudged
from tiny import ARCHS, tiered

from stagereplay.engine.cache import compare_caches, layer_span, new_cache
from stagereplay.engine.decode import DecodeConfig, Sampler, Stepper, capture_available, decode
from stagereplay.engine.lm import load

pytestmark = pytest.mark.capture  # the captured step against generate() and the eager step

PROMPT = "Q: what is 12+7? Think.\n"


def _tensor(t):
    return None if t is None else (t.dtype, t.tolist())


def _spy(model):
    """Wrap model.forward (signature kept: generate() inspects it) to log each call's inputs."""
    calls = []
    forward = model.forward

    @functools.wraps(forward)
    def logged(*args, **kwargs):
        assert not args
        # generate() also passes return_dict=True, the default anyway
        calls.append(
            {
                "keys": sorted(set(kwargs) - {"return_dict"}),
                "input_ids": _tensor(kwargs["input_ids"]),
                "position_ids": _tensor(kwargs.get("position_ids")),
                "attention_mask": _tensor(kwargs.get("attention_mask")),
                "logits_to_keep": kwargs.get("logits_to_keep"),
                "use_cache": kwargs.get("use_cache"),
                "cache": type(kwargs.get("cache")).__name__,
            }
        )
        return forward(*args, **kwargs)

    model.forward = logged
    return calls


def _reference(lm, prompt, n, **kw):
    ids = torch.tensor([prompt])
    return lm.model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **kw
    )


def _without_all_ones_mask(call):
    """generate() drops an all-ones mask before its first forward since transformers 5.2x; earlier 5.x passed it.
    Either way it changes no number (bitwise checks below), and the loop never passes one."""
    mask = call["attention_mask"]
    if mask is None:
        return call
    assert mask[0] == torch.long and all(v == 1 for v in mask[1][0]), "generate() passed a mask with zeros"
    return {**call, "attention_mask": None, "keys": [k for k in call["keys"] if k != "attention_mask"]}


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_each_step_gets_the_inputs_generate_gives(tiny_dir, arch):
    lm = load(str(tiny_dir(arch)), precision="bf16", attn_impl=attn_for(arch))
    # Captured or not, a step calls Stepper._step with the same inputs; the spy logs them eagerly, since its
    # .tolist() inside a captured step would make dynamo recompile for every new position.
    lm.stepper.capture = False
    prompt = lm.tokenizer.encode(PROMPT)
    calls = _spy(lm.model)
    _reference(lm, prompt, 20)
    theirs = [_without_all_ones_mask(c) for c in calls]
    calls.clear()
    lm.generate(prompt, 20)
    assert calls == theirs and len(calls) == 20
    assert all(c["attention_mask"] is None and c["position_ids"] is not None for c in calls)
    # Negative control: the log does see a changed input (here, positions off by one).
    calls.clear()
    lm.stepper.model(
        input_ids=torch.tensor([prompt]),
        position_ids=torch.arange(1, len(prompt) + 1)[None],
        cache=new_cache(lm.model),
        use_cache=True,
        logits_to_keep=1,
    )
    assert calls[0] != theirs[0]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("arch", tiered(ARCHS, quick=("llama", "gemma3")))
def test_logits_and_cache_equal_generate_bitwise(tiny_dir, arch, precision):
    """Every step's logits and the final cache of the live loop are generate()'s, bit for bit."""
    lm = load(str(tiny_dir(arch)), precision=precision, attn_impl=attn_for(arch))
    prompt, n = lm.tokenizer.encode(PROMPT), 24
    lm.generate(prompt, n)  # the fast step's proof, made before the forwards below are logged
    ref = _reference(lm, prompt, n, return_dict_in_generate=True, output_logits=True)
    cache, logged = new_cache(lm.model), []
    stepper = lm.stepper
    original = stepper.forward

    def keep(ids, c, past, **kwargs):
        logged.append(original(ids, c, past, **kwargs).float())
        return logged[-1]

    stepper.forward = keep  # type: ignore[method-assign]
    logits = stepper.forward(prompt, cache, 0)
    tokens = decode(stepper, cache, logits, len(prompt), Sampler(DecodeConfig(), 0, "cpu"), n, lm.eos)
    assert tokens == ref.sequences[0, len(prompt) :].tolist()
    assert len(logged) == len(ref.logits) == len(tokens)
    for ours, theirs in zip(logged, ref.logits, strict=True):
        assert torch.equal(ours.view(torch.int32), theirs[0].view(torch.int32))
    assert compare_caches(cache, generated_cache(ref)) == []
    # Negative control: one ulp in one element of one layer is seen.
    pos = layer_span(cache.layers[0])[0] + 3  # absolute: a sliding layer 0 no longer holds position 3
    assert compare_caches(nudged(cache, 0, "k", (0, 0, pos, 0)), generated_cache(ref)) != []


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_tokens_unchanged_when_the_positions_buffer_regrows(tiny_dir, precision):
    """A positions buffer of 4 regrows many times within one sequence; the tokens stay generate()'s."""
    lm = load(str(tiny_dir("llama")), precision=precision)
    prompt = lm.tokenizer.encode(PROMPT)
    reference = _reference(lm, prompt, 40)[0, len(prompt) :].tolist()
    small = Stepper(lm.model, "cpu")
    small.MIN_POSITIONS = 4
    lm.stepper = small
    assert lm.generate(prompt, 40) == reference
    assert small._positions is not None and small._positions.shape[1] >= len(prompt) + 39


def test_positions_are_a_view_of_the_requested_range():
    stepper = Stepper(None, "cpu")
    assert stepper.positions(3, 2).tolist() == [[3, 4]]
    assert stepper.positions(2000, 3).tolist() == [[2000, 2001, 2002]]  # outgrows the first buffer
    assert stepper.positions(0, 1).dtype == torch.long


@pytest.mark.parametrize("arch", tiered(ARCHS, quick=("qwen2", "gemma2")))
def test_captured_steps_are_the_eager_steps_bit_for_bit(tiny_dir, arch):
    """Single-token steps captured by dynamo (eager backend) give the eager forward's logits and cache bits."""
    import torch._dynamo

    if not capture_available():
        pytest.skip("dynamo is unsupported or disabled (TORCHDYNAMO_DISABLE) here")
    lm = load(str(tiny_dir(arch)), precision="bf16", attn_impl=attn_for(arch))
    assert lm.stepper.capture  # on by default wherever dynamo runs
    prompt = lm.tokenizer.encode(PROMPT)
    lm.generate(prompt, 30)  # the captured step's proof, to the positions below, before they are counted

    def run(capture):
        lm.stepper.capture = capture
        cache, logged = new_cache(lm.model), []
        logits = lm.stepper.forward(prompt, cache, 0)
        for pos in range(len(prompt), len(prompt) + 30):  # past gemma2's sliding window of 8
            logged.append(logits)
            logits = lm.stepper.forward([int(torch.argmax(logits.float()))], cache, pos)
        return logged, cache

    torch._dynamo.reset()  # the proof's compiled step goes: the steps below compile their own
    torch._dynamo.utils.counters.clear()
    captured, captured_cache = run(True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the steps really went through dynamo
    eager, eager_cache = run(False)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(captured, eager, strict=True))
    assert compare_caches(captured_cache, eager_cache) == []
    # Negative control: the same shapes, one element one ulp off, is told apart by value (not by shape).
    last = layer_span(eager_cache.layers[0])[1] - 1  # a position layer 0 holds, sliding or not
    differences = compare_caches(captured_cache, nudged(eager_cache, 0, "k", (0, 0, last, 0)))
    assert differences and all(d.reason == "value" for d in differences)


def test_fp32_compute_steps_stay_eager(tiny_dir):
    """fp32-compute recasts weights in forward hooks, which dynamo cannot capture: its steps run eagerly."""
    if not capture_available():
        pytest.skip("dynamo is unsupported or disabled (TORCHDYNAMO_DISABLE) here")
    assert not load(str(tiny_dir("qwen2")), precision="fp32-compute").stepper.capture
    assert load(str(tiny_dir("qwen2")), precision="fp32").stepper.capture
