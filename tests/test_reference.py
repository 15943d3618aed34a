"""Scoring served tokens against the claimed model's one-shot reference (engine.reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import load
from stagereplay.engine.reference import reduce_rows, reference_scores
from stagereplay.engine.scoring import rollout, score_oneshot
from stagereplay.engine.seeded import VllmCpu, VllmNative, gumbel_noise
from stagereplay.errors import StageReplayError
from stagereplay.toy import toy_checkpoint

GREEDY = DecodeConfig(max_new_tokens=30)
SAMPLED = DecodeConfig(sample=True, temperature=0.7, top_k=20, top_p=0.9)


@pytest.fixture(scope="module")
def toy():
    return load(str(toy_checkpoint()), precision="fp32")


def vllm_draws(logits: torch.Tensor, decode: DecodeConfig, seed: int) -> torch.Tensor:
    """Tokens [N] vLLM's sampler draws from rows `logits` [N, V] for one request seeded with `seed`, written from its
    definition (argmax of softmax(warped) / E, E ~ Exp(1) a row per step), independently of reduce_rows."""
    g = torch.Generator().manual_seed(seed)
    x = logits / decode.temperature
    kth = x.topk(decode.top_k).values[:, -1:]
    x = x.masked_fill(x < kth, -float("inf"))
    s, order = x.sort(dim=-1)
    drop = s.softmax(-1).cumsum(-1) <= 1 - decode.top_p
    drop[:, -1] = False
    x = x.masked_fill(drop.scatter(1, order, drop), -float("inf"))
    probs = x.softmax(-1)
    return torch.stack([(probs[i] / torch.empty(x.shape[1]).exponential_(generator=g)).argmax()
                        for i in range(len(x))])


def test_the_reference_is_the_one_shot_score_of_the_served_tokens_and_finds_a_planted_token(toy):
    prompt = toy.tokenizer.encode("Q: what is 12+7? Think.\n")
    served, _ = rollout(toy, prompt, 30, GREEDY, 0, "raw")
    ref = reference_scores(toy, prompt, served, GREEDY)
    oneshot = score_oneshot(toy, prompt, served, GREEDY, "raw")
    assert np.allclose(ref.logprob, oneshot.logprobs, atol=1e-5)
    assert np.array_equal(ref.match, oneshot.argmax == np.array(served))
    assert np.array_equal(ref.prob, ref.match.astype(np.float32))  # greedy claim: the sampler's one-hot
    assert np.all((ref.margin == 0) == ref.match) and np.all((ref.logit_rank == 0) == ref.match)
    chunked = reference_scores(toy, prompt, served, GREEDY, chunk=4)
    assert np.allclose(chunked.logprob, ref.logprob, atol=1e-5) and np.array_equal(chunked.match, ref.match)
    # The control: one served token replaced by another is a mismatch there, and the rows before it do not move.
    at = 9
    assert ref.match[at]
    planted = list(served)
    planted[at] = (served[at] + 1) % toy.model.get_output_embeddings().weight.shape[0]
    moved = reference_scores(toy, prompt, planted, GREEDY)
    assert not moved.match[at] and moved.margin[at] > 0 and moved.logit_rank[at] >= 1
    assert np.allclose(moved.logprob[:at], ref.logprob[:at], atol=1e-5)


def test_vllms_seeded_draws_are_replayed_and_another_seed_is_not():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    drawn = vllm_draws(logits, SAMPLED, seed=11)
    out = reduce_rows(logits, drawn, SAMPLED, VllmNative(11, "cpu"))
    assert bool(out["gumbel_match"].all()) and bool((out["gumbel_rank"] == 0).all())
    assert bool((out["gumbel_margin"] == 0).all())
    other = reduce_rows(logits, drawn, SAMPLED, VllmNative(12, "cpu"))
    assert not bool(other["gumbel_match"].all())  # control: the wrong seed
    assert not bool(out["match"].all())  # sampled tokens are not all the argmax


def test_a_token_the_claimed_sampler_removes_has_no_probability_and_an_infinite_gumbel_margin():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0] + [-5.0] * 26])
    dc = DecodeConfig(sample=True, temperature=1.0, top_k=2)
    out = reduce_rows(logits, torch.tensor([2]), dc, VllmNative(0, "cpu"))
    assert out["prob"][0] == 0 and out["gumbel_rank"][0] == float("inf") and out["gumbel_margin"][0] == float("inf")
    assert out["margin"][0] == 2.0 and out["logit_rank"][0] == 2
    kept = reduce_rows(logits, torch.tensor([1]), dc, VllmNative(0, "cpu"))
    assert 0 < kept["prob"][0] < 1 and torch.isfinite(kept["gumbel_margin"][0])  # control: a token top-k keeps


def splitmix64(state: int, n: int) -> list[int]:
    """The first `n` outputs of the SplitMix64 generator seeded with `state` (Steele, Lea and Flood 2014), written as
    the generator is usually written: the state advances by the golden gamma, and each output mixes the state."""
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) % 2**64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        out.append(z ^ (z >> 31))
    return out


def vllm_cpu_draws(logits: torch.Tensor, seed: int) -> list[int]:
    """Tokens vLLM's CPU sampler draws from rows `logits` [N, V] (already warped) for one request seeded with `seed`,
    from its definition, in Python integers and libm: per step a seed s from the request's generator, the key the
    generator's first output from s, token i's noise the key-seeded generator's output i + 1."""
    import math

    g = torch.Generator().manual_seed(seed)
    picks = []
    for row in logits.tolist():
        s = int(torch.randint(0, 2**31, (1,), generator=g, dtype=torch.long))
        key = splitmix64((s - 0x9E3779B97F4A7C15) % 2**64, 1)[0]  # the output of the state s
        noise = [-math.log(-math.log(((b >> 11) + 0.5) * 2.0**-53)) for b in splitmix64(key, len(row))]
        scores = [x + n for x, n in zip(row, noise, strict=True)]
        picks.append(scores.index(max(scores)))
    return picks


def test_the_cpu_samplers_noise_is_splitmix64_as_published():
    """SplitMix64 seeded with 0 begins 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F (the reference
    implementation's known outputs): the oracle below is that generator."""
    assert splitmix64(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_vllms_cpu_sampler_is_replayed_and_is_not_the_native_one():
    """The CPU build's draws, written from the definition, are what `VllmCpu` picks, rank first, margin 0; the
    controls: another seed, and vLLM's native sampler on the same seed, pick other tokens."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    dc = DecodeConfig(sample=True, temperature=1.0)
    drawn = torch.tensor(vllm_cpu_draws(logits, seed=11))
    out = reduce_rows(logits, drawn, dc, VllmCpu(11, "cpu"))
    assert bool(out["gumbel_match"].all()) and bool((out["gumbel_rank"] == 0).all())
    assert bool((out["gumbel_margin"] == 0).all())
    assert not bool(reduce_rows(logits, drawn, dc, VllmCpu(12, "cpu"))["gumbel_match"].all())
    assert not bool(reduce_rows(logits, drawn, dc, VllmNative(11, "cpu"))["gumbel_match"].all())
    assert not bool(out["match"].all())  # sampled tokens are not all the argmax


def test_noise_rows_are_drawn_one_after_another_from_one_generator():
    a = gumbel_noise(3, 10, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    rows = [torch.empty(10).exponential_(generator=g) for _ in range(3)]
    assert torch.equal(a, torch.stack(rows))
    assert not torch.equal(gumbel_noise(3, 10, torch.Generator().manual_seed(6)), a)


def test_bad_served_tokens_are_refused_in_one_line(toy):
    prompt = toy.tokenizer.encode("Q: 1+1?\n")
    with pytest.raises(StageReplayError, match="outside the claimed model's vocabulary"):
        reference_scores(toy, prompt, [1, 5000], GREEDY)
    with pytest.raises(StageReplayError, match="no tokens"):
        reference_scores(toy, prompt, [], GREEDY)
    with pytest.raises(StageReplayError, match="Gumbel-max check needs a sampled claim"):
        reduce_rows(torch.zeros(1, 4), torch.tensor([0]), GREEDY, VllmNative(0, "cpu"))
