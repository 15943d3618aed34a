"""The trainer's score reduced a chunk of rows at a time keeps the bits of the whole-tensor formula.

- `chosen` on a few rows at a time gives every log-probability and argmax of `log_softmax(logits.float())`
  gathered and `logits.float().argmax(-1)`, bit for bit, in raw and processed modes, on a tiny model's logits and on
  a one-shot score (control: the same log-probability as target minus log-sum-exp, or a log-sum-exp over vocabulary
  chunks as verl computes it, lies within 1e-5 and is told apart by the same comparison);
- `first_argmax` finds torch's argmax, ties across blocks, NaN and a short last block included (control: the last
  maximal block instead of the first is caught);
- a sequence scored inside a trainer's micro-batch, padded or packed, at any place in it, is its score alone in fp32
  to 1e-5, sliding-window layers included (control: a packed mask that lets a sequence see those before it moves
  the score far beyond that); the micro-batch is a function of the item alone, and its forward's token count is
  the one the plan prices.
"""

from __future__ import annotations

import pytest
import torch

from stagereplay.engine import scoring
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import load
from stagereplay.engine.scoring import chosen, first_argmax, score_in_batch, score_oneshot
from stagereplay.experiments.mismatch.item import MicroBatch

PROMPT = "Q: what is 12+7? Think.\n"
WARPED = DecodeConfig(sample=True, temperature=0.7, top_k=20, top_p=0.9)


def whole(logits: torch.Tensor, targets: torch.Tensor, dc: DecodeConfig, mode: str
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula the chunks must keep: the whole [N, V] widened, warped where processed, log_softmax, gathered."""
    from stagereplay.engine.decode import Sampler

    scores = logits.float()
    argmax = scores.argmax(-1)
    if mode == "processed":
        scores = Sampler(dc, 0, "cpu").warp(scores)
    return torch.log_softmax(scores, dim=-1).gather(1, targets[:, None])[:, 0], argmax


def target_minus_lse(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A near miss: x_target - logsumexp(x), the same number by another reduction."""
    scores = logits.float()
    return scores.gather(1, targets[:, None])[:, 0] - torch.logsumexp(scores, dim=-1)


def chunked_lse(logits: torch.Tensor, targets: torch.Tensor, width: int = 16) -> torch.Tensor:
    """A near miss: the log-sum-exp taken over vocabulary chunks and combined (verl's `logprobs_from_logits` way)."""
    scores = logits.float()
    parts = torch.stack([torch.logsumexp(scores[:, a : a + width], dim=-1) for a in range(0, scores.shape[1], width)])
    return scores.gather(1, targets[:, None])[:, 0] - torch.logsumexp(parts, dim=0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.fixture(scope="module")
def model_logits(tiny_dir):
    """A tiny bf16 model's logits [T, V] over a prompt and 60 sampled tokens, and each row's next token."""
    lm = load(str(tiny_dir("qwen2")), precision="bf16")
    ids = lm.tokenizer.encode(PROMPT)
    ids = ids + lm.generate(ids, 60, DecodeConfig(max_new_tokens=60, sample=True), seed=5)
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
    return lm, ids, logits, torch.tensor(ids[1:])


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("rows", [1, 3, 7, 10**6])
def test_chunks_of_rows_keep_the_whole_tensors_bits(model_logits, mode, rows):
    _, _, logits, targets = model_logits
    expected_lp, expected_argmax = whole(logits, targets, WARPED, mode)
    lp, argmax = chosen(logits, targets, mode, WARPED, chunk_bytes=4 * logits.shape[1] * rows)
    assert same_bits(lp, expected_lp) and torch.equal(argmax, expected_argmax)


def test_a_one_shot_score_is_the_whole_tensor_formula_and_a_near_miss_is_told_apart(model_logits):
    lm, ids, logits, targets = model_logits
    prompt, response = ids[:20], ids[20:]
    for mode in ("raw", "processed"):
        scored = score_oneshot(lm, prompt, response, WARPED, mode)
        expected_lp, expected_argmax = whole(logits[19:], targets[19:], WARPED, mode)
        assert same_bits(torch.from_numpy(scored.logprobs), expected_lp)
        assert torch.equal(torch.from_numpy(scored.argmax).long(), expected_argmax)
    # The controls: the same numbers by other reductions are within 1e-5 and not the same bits.
    expected_lp, _ = whole(logits, targets, WARPED, "raw")
    for near in (target_minus_lse(logits, targets), chunked_lse(logits, targets)):
        assert torch.allclose(near, expected_lp, rtol=0, atol=1e-5)
        assert not same_bits(near, expected_lp)


def test_the_two_level_argmax_is_torchs_first_maximum_and_the_last_block_is_caught():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 50, generator=g)
    rows[1, 3] = rows[1, 47] = 9.0  # a tie across blocks: the first block's
    rows[2, 20] = rows[2, 21] = 9.0  # a tie inside one block
    rows[3, 30] = rows[3, 12] = float("nan")  # NaN counts as the maximum; the first one
    rows[4, 49] = 9.0  # the maximum in the short last block
    rows[5] = -float("inf")
    for block in (4, 7, 16, 50, 64):
        assert torch.equal(first_argmax(rows, block), rows.argmax(-1)), block

    def last_block(scores: torch.Tensor, block: int) -> torch.Tensor:
        maxima = torch.stack([scores[:, a : a + block].amax(-1) for a in range(0, scores.shape[1], block)], 1)
        at = maxima.shape[1] - 1 - maxima.flip(1).argmax(-1)
        return torch.stack([a * block + scores[r, a * block : (a + 1) * block].argmax() for r, a in enumerate(at)])

    assert not torch.equal(last_block(rows, 7), rows.argmax(-1))  # control: the tie row tells them apart


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_a_sequence_in_a_micro_batch_scores_as_alone_and_a_leaking_mask_is_caught(tiny_dir, arch, monkeypatch):
    lm = load(str(tiny_dir(arch)), precision="fp32")
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(4, 90, (n,), generator=g).tolist() for n in (30, 41, 17)]  # longer than the window (8)
    dc = DecodeConfig()
    gaps = {}
    correct = scoring.packed_masks

    def leaking(lm, lengths):
        return correct(lm, lengths, leak=True)

    for at, ids in enumerate(batch):
        prompt, response = ids[:6], [*ids[6:], 5]
        alone = score_oneshot(lm, prompt, response, dc, "raw").logprobs
        for layout in ("padded", "packed"):
            scored = score_in_batch(lm, prompt, response, batch, at, layout, dc, "raw")
            assert scored.logprobs.shape == alone.shape
            assert float(abs(scored.logprobs - alone).max()) < 1e-5, (layout, at)
        monkeypatch.setattr(scoring, "packed_masks", leaking)
        gaps[at] = float(abs(score_in_batch(lm, prompt, response, batch, at, "packed", dc, "raw").logprobs
                             - alone).max())
        monkeypatch.setattr(scoring, "packed_masks", correct)
    assert gaps[0] < 1e-5 and gaps[1] > 1e-2 and gaps[2] > 1e-2  # control: the first sequence has none before it


def test_an_items_micro_batch_is_its_own_and_its_forward_is_priced():
    ids = list(range(10, 50))
    for layout in ("padded", "packed"):
        mb = MicroBatch(4, layout)
        batch, at = mb.around("item-7", 3, ids)
        assert (batch, at) == mb.around("item-7", 3, ids) and len(batch) == 4 and batch[at] == ids
        assert all(20 <= len(seq) <= 60 and set(seq) <= set(ids) for seq in batch)
        width = max(map(len, batch)) * 4 if layout == "padded" else sum(map(len, batch))
        assert mb.forward_tokens("item-7", 3, len(ids)) == width
    assert MicroBatch(4, "padded").around("item-8", 3, ids) != MicroBatch(4, "padded").around("item-7", 3, ids)
