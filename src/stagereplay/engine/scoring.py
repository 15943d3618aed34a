"""The log-probability a model gives each token of a fixed response: what an RL rollout engine records while it
samples, and what a trainer recomputes, teacher-forced, on the same token IDs.

    rollout(lm, prompt, max_new, decode, seed, mode)      live decoding from a retained cache, each sampled token's
                                                          log-probability recorded as it is drawn
    score_incremental(lm, prompt, response, ...)           teacher-forced, one token per forward on a growing cache:
                                                          the live loop's operations, so bit-exact with `rollout`
    score_oneshot(lm, prompt, response, ..., head)        teacher-forced in one forward over prompt + response[:-1]
                                                          with no cache: a trainer's `model(input_ids)`; `head` fp32
                                                          computes the LM head in fp32 (MiniMax-M1's fix)
    score_in_batch(lm, prompt, response, batch, at, layout, ...)  `score_oneshot`'s score with the sequence at index
                                                          `at` of a trainer's micro-batch, padded or packed
    score_from(lm, cache, ids, at, ...)                    teacher-forced one token at a time from a cache over
                                                          ids[0:at] (a transplant's continuation)

Each returns a `Scored`: per response token, its log-probability [N] (fp32, from fp32 logits) and the argmax token
of the same row [N]. `mode` says which distribution the log-probability is taken from, as vLLM's `logprobs_mode`
does: `raw` is log_softmax of the model's logits; `processed` is log_softmax after the sampler's temperature,
top-k and top-p (a token they remove has -inf). Both sides of a comparison take the same mode.

Memory and time: a one-shot score holds its sequence's logits [T, V] once (what a trainer's forward holds), reduced
to [N] on the device a few rows at a time (`chosen`: each chunk widened to fp32 and reduced while it is in cache, no
[T, V] fp32 copy), so it costs little more than the forward (bench/mismatch.py throughput); the step-by-step scores
reduce each step's [V] as it is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from stagereplay.engine.decode import DecodeConfig, Sampler

if TYPE_CHECKING:
    import numpy as np
    import torch

    from stagereplay.engine.lm import LM

Mode = Literal["raw", "processed"]
MODES: tuple[Mode, ...] = ("raw", "processed")
HEADS = ("model", "fp32")
Layout = Literal["padded", "packed"]
LAYOUTS: tuple[Layout, ...] = ("padded", "packed")
"""How a trainer lays out a micro-batch: padded (a row per sequence, right padding and an attention mask) or packed
(one row of the sequences end to end, verl's remove-padding: a block-diagonal causal mask, positions per sequence)."""


@dataclass(frozen=True)
class Scored:
    """A response's per-token log-probabilities [N] (fp32) and each row's argmax token [N] (int32; None where the
    source does not say, a rollout file)."""

    logprobs: np.ndarray
    argmax: np.ndarray | None


ROW_CHUNK_BYTES = 1 << 22
"""How many bytes of fp32 rows `chosen` widens at once (4 MiB: a few rows of a 152k vocabulary, so each chunk is
reduced while it sits in the core's cache instead of as a fresh [N, V] fp32 copy)."""
ARGMAX_BLOCK = 1024
"""The block length of `first_argmax`'s two-level search."""


def chosen(logits: torch.Tensor, targets: torch.Tensor, mode: Mode, decode: DecodeConfig,
           chunk_bytes: int = ROW_CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `logits` [N, V]: the log-probability of its target [N] under `mode`, and the row's argmax [N],
    on the logits' device. The rows are widened to fp32 first, as a sampler widens them.

    The bits are those of `log_softmax(logits.float(), -1).gather(1, targets)` and `logits.float().argmax(-1)`,
    computed a chunk of rows at a time (`chunk_bytes` of fp32 each): log_softmax, the sampler's warpers
    (an elementwise division, a per-row top-k, a per-row sort, softmax and cumsum) and the argmax each reduce a row
    from that row's elements alone, with the operation chosen by dtype and row length, never by the number of rows,
    so a row's result does not depend on the rows computed beside it. The argmax is `first_argmax`'s (comparisons
    only). tests/test_scoring.py checks both against the whole-tensor formula bit for bit, with a near miss (the
    same log-probability as target minus log-sum-exp) that it must tell apart."""
    import torch

    n, vocab = logits.shape
    rows = max(1, min(n, chunk_bytes // (4 * max(vocab, 1))))
    targets = targets.to(logits.device)
    warp = (Sampler(replace(decode, sample=False), 0, str(logits.device)).warp  # no generator made
            if mode == "processed" else None)
    # Two buffers [rows, V] reused by every chunk: the widened rows and their log_softmax (fresh ones each chunk
    # would cost a page fault per page where the allocator maps them anew).
    widened = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    logsm = torch.empty_like(widened)
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(n, dtype=torch.long, device=logits.device)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        scores = widened[: b - a]
        scores.copy_(logits[a:b])  # [rows, V] fp32: the exact widening `.float()` makes
        argmax[a:b] = first_argmax(scores)
        torch.log_softmax(warp(scores) if warp is not None else scores, dim=-1, out=logsm[: b - a])
        lp[a:b] = logsm[: b - a].gather(1, targets[a:b, None])[:, 0]
    return lp, argmax


def first_argmax(scores: torch.Tensor, block: int = ARGMAX_BLOCK) -> torch.Tensor:
    """`scores.argmax(-1)` of [R, V] rows, found in two levels: each block of `block` columns' maximum (`amax`, a
    vectorised reduction), the first block holding the row's maximum, then the first maximum inside that block.
    It is the same index by construction, on any CPU: the first block whose maximum is the row's maximum holds the
    row's first maximal element (a NaN counts as the maximum at both levels, as it does for argmax), and only
    comparisons are made, so no rounding enters. torch's argmax keeps an index beside every comparison and runs
    element by element; this reads the row once vectorised and then `block` elements."""
    import torch

    r, vocab = scores.shape
    if vocab <= block:
        return scores.argmax(-1)
    whole = vocab // block * block
    maxima = scores[:, :whole].reshape(r, -1, block).amax(-1)  # [R, V // block]
    if whole < vocab:
        maxima = torch.cat([maxima, scores[:, whole:].amax(-1, keepdim=True)], dim=1)
    # The columns of each row's first maximal block; a short last block repeats its last column, after the originals.
    columns = (maxima.argmax(-1, keepdim=True) * block + torch.arange(block, device=scores.device)).clamp_max(vocab - 1)
    inside = scores.gather(1, columns).argmax(-1, keepdim=True)  # [R, 1]
    return columns.gather(1, inside)[:, 0]


def _scored(lps: list[torch.Tensor] | torch.Tensor, argmax: list[torch.Tensor] | torch.Tensor) -> Scored:
    import torch

    lp = torch.stack(lps) if isinstance(lps, list) else lps
    am = torch.stack(argmax) if isinstance(argmax, list) else argmax
    return Scored(lp.detach().to("cpu", torch.float32).numpy(), am.detach().to("cpu", torch.int32).numpy())


def rollout(lm: LM, prompt: Sequence[int], max_new: int, decode: DecodeConfig, seed: int, mode: Mode
            ) -> tuple[list[int], Scored]:
    """Decode from `prompt` (greedy, or sampled as `decode` says from a generator seeded with `seed`) until EOS or
    `max_new` tokens, recording each drawn token's log-probability under `mode` from the very logits it was drawn
    from. Its tokens are generate()'s for the same settings and seed (`LM.generate`'s loop)."""
    import torch

    prompt = list(prompt)
    cache = lm.new_cache(len(prompt) + max_new - 1)
    logits = lm.stepper.forward(prompt, cache, 0, prompt=prompt)
    sampler = Sampler(decode, seed, lm.config.device)
    tokens: list[int] = []
    lps, argmaxes = [], []
    past = len(prompt)
    while True:
        picked = sampler.pick(logits)
        token = int(picked)
        lp, am = chosen(logits[None], torch.tensor([token]), mode, decode)
        tokens.append(token)
        lps.append(lp[0])
        argmaxes.append(am[0])
        if token in lm.eos or len(tokens) >= max_new:
            return tokens, _scored(lps, argmaxes)
        logits = lm.stepper.forward([token], cache, past, prompt=prompt)
        past += 1


def score_incremental(lm: LM, prompt: Sequence[int], response: Sequence[int], decode: DecodeConfig, mode: Mode
                      ) -> Scored:
    """Teacher-forced, the live loop's way: the prompt prefilled, then each response token fed alone."""
    import torch

    prompt, response = list(prompt), list(response)
    cache = lm.new_cache(len(prompt) + len(response) - 1)
    logits = lm.stepper.forward(prompt, cache, 0, prompt=prompt)
    lps, argmaxes = [], []
    past = len(prompt)
    for i, token in enumerate(response):
        lp, am = chosen(logits[None], torch.tensor([token]), mode, decode)
        lps.append(lp[0])
        argmaxes.append(am[0])
        if i + 1 < len(response):
            logits = lm.stepper.forward([token], cache, past, prompt=prompt)
            past += 1
    return _scored(lps, argmaxes)


def head_logits(lm: LM, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head in fp32 on hidden states [T, H]: the head's weight widened, then the model's final logit
    soft-capping where it has one (Gemma 2 and 3)."""
    import torch

    weight = lm.model.get_output_embeddings().weight
    logits = torch.nn.functional.linear(hidden.float(), weight.float())
    cap = getattr(lm.model.config.get_text_config(), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def score_oneshot(lm: LM, prompt: Sequence[int], response: Sequence[int], decode: DecodeConfig, mode: Mode,
                  head: str = "model") -> Scored:
    """Teacher-forced in one forward over prompt + response[:-1], no cache, as a trainer computes it; the rows that
    predict the response's tokens reduced to their log-probabilities. `head` fp32: the decoder's hidden states
    through an fp32 LM head."""
    import torch

    ids = [*prompt, *response[:-1]]
    rows = slice(len(prompt) - 1, len(ids))
    input_ids = torch.tensor([ids], device=lm.config.device)
    with torch.inference_mode():
        if head == "fp32":
            hidden = lm.model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state[0, rows]
            logits = head_logits(lm, hidden)  # [N, V]
        else:
            logits = lm.model(input_ids=input_ids, use_cache=False).logits[0, rows]  # [N, V]
        lp, am = chosen(logits, torch.tensor(list(response)), mode, decode)
        return _scored(lp, am)


def score_in_batch(lm: LM, prompt: Sequence[int], response: Sequence[int], batch: Sequence[Sequence[int]], at: int,
                   layout: Layout, decode: DecodeConfig, mode: Mode, head: str = "model") -> Scored:
    """`score_oneshot` of prompt + response in one forward over a trainer's micro-batch: `batch` holds each
    sequence's input IDs, `batch[at]` being prompt + response[:-1]. Padded: a row per sequence, right-padded to the
    longest, with an attention mask (positions from 0 in every row). Packed: one row of the sequences end to end,
    positions restarting at each, and a block-diagonal causal mask (`packed_masks`). Only the sequence's own rows are
    reduced; its score differs from the one alone only where the batch's shapes change the arithmetic."""
    import torch

    ids = [*prompt, *response[:-1]]
    if list(batch[at]) != ids:
        raise ValueError("batch[at] is not prompt + response[:-1]")
    device = lm.config.device
    lengths = [len(seq) for seq in batch]
    if layout == "padded":
        pad = lm.model.config.get_text_config().pad_token_id or 0
        width = max(lengths)
        inputs: dict[str, Any] = {
            "input_ids": torch.tensor([[*seq, *[pad] * (width - len(seq))] for seq in batch], device=device),
            "attention_mask": torch.tensor([[1] * n + [0] * (width - n) for n in lengths], device=device)}
        row, first = at, len(prompt) - 1
    else:
        inputs = {"input_ids": torch.tensor([[t for seq in batch for t in seq]], device=device),
                  "position_ids": torch.cat([torch.arange(n) for n in lengths])[None].to(device),
                  "attention_mask": packed_masks(lm, lengths)}
        row, first = 0, sum(lengths[:at]) + len(prompt) - 1
    rows = slice(first, first + len(response))
    with torch.inference_mode():
        if head == "fp32":
            hidden = lm.model.get_decoder()(**inputs, use_cache=False).last_hidden_state[row, rows]
            logits = head_logits(lm, hidden)  # [N, V]
        else:
            logits = lm.model(**inputs, use_cache=False).logits[row, rows]  # [N, V]
        lp, am = chosen(logits, torch.tensor(list(response)), mode, decode)
        return _scored(lp, am)


def packed_masks(lm: LM, lengths: Sequence[int], leak: bool = False) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4-D mask [1, 1, L, L] of sequences of `lengths` packed in one row: a query sees the keys of its own
    sequence up to itself, and within the model's window on a sliding-window layer. transformers uses a prepared 4-D
    mask as it is, so a model with both kinds of layer gets one per kind (`full_attention`, `sliding_attention`,
    the dict its layers look theirs up in), a model with one kind gets that one. Boolean for sdpa (True: seen),
    additive for eager. `leak`: plain causal over the whole row, each sequence seeing those before it (a trainer's
    bug; the tests' negative control)."""
    import torch

    impl = lm.model.config._attn_implementation
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"a packed micro-batch needs sdpa or eager attention, not {impl}")
    text = lm.model.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    kinds = set(getattr(text, "layer_types", None) or ["sliding_attention" if window else "full_attention"])
    n = sum(lengths)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))  # [L]
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    full = (q >= k) & (leak | (seq[:, None] == seq[None, :]))  # [L, L]
    masks = {"full_attention": full, "sliding_attention": full & (q - k < window) if window else full}
    dtype = lm.model.dtype
    prepared = {kind: (m if impl == "sdpa" else torch.zeros(m.shape, dtype=dtype).masked_fill(~m, torch.finfo(dtype).min)
                       )[None, None].to(lm.config.device) for kind, m in masks.items() if kind in kinds}
    return prepared if len(prepared) > 1 else next(iter(prepared.values()))


def prefill_cache(lm: LM, ids: Sequence[int], prompt_len: int, length: int | None) -> Any:
    """A new cache over `ids` from one forward (the one-shot construction's cache)."""
    return lm.prefill(ids, prompt_len, [(0, len(ids))], length)


def incremental_cache(lm: LM, ids: Sequence[int], prompt_len: int, length: int | None) -> Any:
    """A new cache over `ids` built as live decoding builds it: the prompt in one forward, then one token each."""
    return lm.prefill(ids, prompt_len, [(0, prompt_len), *((i, i + 1) for i in range(prompt_len, len(ids)))],
                      length)


def score_from(lm: LM, cache: Any, ids: Sequence[int], at: int, end: int, decode: DecodeConfig, mode: Mode,
               prompt: Sequence[int] = ()) -> Scored:
    """Teacher-forced from `cache` (over ids[0:at], not changed: a clone is stepped): ids[at] fed, then each next
    one; the log-probabilities of ids[at + 1 : end]."""
    import torch

    from stagereplay.engine.cache import clone_cache

    work = clone_cache(cache)
    lps, argmaxes = [], []
    for past in range(at, end - 1):
        logits = lm.stepper.forward([ids[past]], work, past, prompt=prompt)
        lp, am = chosen(logits[None], torch.tensor([ids[past + 1]]), mode, decode)
        lps.append(lp[0])
        argmaxes.append(am[0])
    return _scored(lps, argmaxes)
