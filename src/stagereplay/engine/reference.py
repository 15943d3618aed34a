"""The claimed model's verdict on each token a server served: the reference is a one-shot prefill of prompt + served
tokens (teacher-forced, as Token-DiFR's reference is vLLM's prompt log-probabilities), and every served token is
scored on the row of reference logits that predicts it.

    reference_scores(lm, prompt, served, decode, seed, head, chunk, seeded)
                                                                       one response: prefill, then `reduce_rows`
                                                                       chunk by chunk
    logits_scores(logits, served, decode, seed, chunk, seeded)         the same from reference logits in hand [N, V]
    reduce_rows(logits, served, decode, sampler)                       the per-token scores of rows [C, V] of
                                                                       reference logits, on their device
    TokenScores.difr(), difr_summary(scores)                           the same tokens in Token-DiFR's terms
                                                                       (`TokenMetrics`, `compute_metrics_summary`)

Per served token (`TokenScores`, each field [N]):

- `match`, `margin`, `logit_rank`, `logprob`: against the reference's raw fp32 logits. `match`: the served token is
  the argmax (the greedy check); `margin`: max logit minus the served token's logit (Token-DiFR's margin at
  temperature 0, 0 on a match); `logit_rank`: how many tokens have a larger logit (Token-DiFR's `logit_rank`);
  `logprob`: the served token's log-softmax (the model's own distribution, whatever the sampler).
- `argmax`: the reference's own greedy pick at the position (what an honest greedy server would most likely serve).
- `prob`: the served token's probability under the claimed sampler (Token-DiFR's `prob`): the softmax after
  temperature, top-k and top-p when the claim samples; one-hot on the argmax when it is greedy.
- `gumbel_match`, `gumbel_margin`, `gumbel_rank`: where the claim samples with a known per-request seed, the
  server's seeded sampler replayed (`engine.seeded`; `seeded` names it). vLLM's native one is Token-DiFR's
  `_verify_vllm_gumbel_max`: the pick is argmax(probs / E), E ~ Exp(1) [V] drawn row after row from one
  `torch.Generator` seeded with the request's seed on the logits' device (vLLM draws on its own device: a CUDA
  server's noise is reproduced on CUDA); `vllm-cpu` is vLLM's CPU build's. `gumbel_match`: the replayed sampler
  picks the served token; `gumbel_margin`: the largest of logits + T * G (G the sampler's Gumbel noise, tokens the
  sampler removes excluded) minus the served token's, inf where the sampler removed it; `gumbel_rank`: how many
  tokens the sampler ranks above the served one, inf where removed. None when the claim is greedy or has no seed.

Memory: the prefill keeps hidden states [N, H]; the LM head and every reduction run on `chunk` rows at a time, so
what lives is [chunk, V] plus the per-token results [N]: O(tokens), never [N, V].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from stagereplay.engine.decode import DecodeConfig, Sampler
from stagereplay.engine.scoring import HEADS, head_logits
from stagereplay.engine.seeded import DEFAULT, SeededSampler, seeded_sampler
from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from stagereplay.engine.lm import LM

CHUNK = 256
"""Rows of reference logits made and reduced at a time: [CHUNK, V] fp32 is the largest tensor a score holds."""
BLOCK = 32
"""Rows of a chunk a seeded sampler draws noise for at a time: its noise [BLOCK, V] is fp64 on the CPU sampler."""


@dataclass(frozen=True)
class TokenScores:
    """The per-token scores of one served response of N tokens: numpy arrays [N] (module docstring for each)."""

    match: np.ndarray  # [N] bool
    margin: np.ndarray  # [N] fp32, >= 0
    logit_rank: np.ndarray  # [N] int64
    logprob: np.ndarray  # [N] fp32
    prob: np.ndarray  # [N] fp32
    gumbel_match: np.ndarray | None = None  # [N] bool
    gumbel_margin: np.ndarray | None = None  # [N] fp32, inf where the claimed sampler removed the token
    gumbel_rank: np.ndarray | None = None  # [N] fp32, inf where removed
    argmax: np.ndarray | None = None  # [N] int64: the reference's own greedy pick at each position

    def __len__(self) -> int:
        return len(self.match)

    def difr(self) -> dict[str, np.ndarray]:
        """Token-DiFR's `TokenMetrics` fields for these tokens, each [N], as its `verify_outputs` defines them for
        this claim: with the Gumbel-max scores, `exact_match`, `margin` and `gumbel_rank` are theirs; for a greedy
        claim (its temperature 0) they are `match`, `margin` and the rank of 1 / E one-hot on the argmax (0 on a
        match, else 1). Token-DiFR also filters a greedy claim's raw logits with top-p 1.0, which removes tokens whose
        fp32 probability underflows to 0 (their margin inf there); vLLM skips top-p at 1.0, and so does this."""
        import numpy as np

        if self.gumbel_match is not None and self.gumbel_margin is not None and self.gumbel_rank is not None:
            exact, margin, gumbel_rank = self.gumbel_match, self.gumbel_margin, self.gumbel_rank
        else:
            exact, margin, gumbel_rank = self.match, self.margin, (~self.match).astype(np.float32)
        return {"exact_match": exact, "prob": self.prob, "margin": margin,
                "logit_rank": self.logit_rank.astype(np.float64), "gumbel_rank": gumbel_rank}


def difr_summary(scores: Sequence[TokenScores]) -> dict[str, float | int]:
    """Token-DiFR's `compute_metrics_summary` of these responses' tokens, its keys and its arithmetic: every rate
    and average over all tokens pooled (each token one data point), `avg_margin` over the finite margins only."""
    import numpy as np

    fields = [s.difr() for s in scores]
    pooled = {k: np.concatenate([f[k] for f in fields]) if fields else np.zeros(0) for k in
              ("exact_match", "prob", "margin", "logit_rank", "gumbel_rank")}
    total = int(pooled["exact_match"].size)
    if total == 0:
        return {"total_tokens": 0, "exact_match_rate": 0.0, "avg_prob": 0.0, "avg_margin": 0.0,
                "infinite_margin_rate": 0.0, "avg_logit_rank": 0.0, "avg_gumbel_rank": 0.0}
    finite = np.isfinite(pooled["margin"])
    n_finite = int(finite.sum())
    return {
        "total_tokens": total,
        "exact_match_rate": int(np.count_nonzero(pooled["exact_match"])) / total,
        "avg_prob": float(pooled["prob"].astype(np.float64).sum()) / total,
        "avg_margin": float(pooled["margin"][finite].astype(np.float64).sum()) / n_finite if n_finite else float("inf"),
        "infinite_margin_rate": (total - n_finite) / total,
        "avg_logit_rank": float(pooled["logit_rank"].astype(np.float64).sum()) / total,
        "avg_gumbel_rank": float(pooled["gumbel_rank"].astype(np.float64).sum()) / total,
    }


def _count_above(values: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """Per row of `values` [C, V]: how many entries exceed that row's `gold` [C] (a rank from 0), int64 [C]."""
    return (values > gold[:, None]).sum(dim=-1)


def reduce_rows(logits: torch.Tensor, served: torch.Tensor, decode: DecodeConfig,
                sampler: SeededSampler | None = None) -> dict[str, torch.Tensor]:
    """The scores of served tokens `served` [C] (int64) on the reference logits that predict them, `logits` [C, V]
    (any float dtype; widened to fp32 first, as a sampler widens them). Returns [C] tensors on the logits' device,
    keyed by `TokenScores`' field names; the Gumbel-max ones only with `sampler` (the request's seeded sampler,
    `engine.seeded`, advanced by C steps here, `BLOCK` rows of noise at a time), which needs a sampling `decode`."""
    import torch

    if sampler is not None and not decode.sample:
        raise StageReplayError("a Gumbel-max check needs a sampled claim",
                               "pass the claimed sampler (sample=True, its temperature) or no seeded sampler")
    x = logits.float()  # [C, V]
    served = served.to(x.device)
    gold = x.gather(1, served[:, None])[:, 0]  # [C]
    top = x.argmax(dim=-1)  # [C] the first of tied maxima, as the greedy pick takes it
    out = {
        "argmax": top,
        "match": top == served,
        "margin": x.max(dim=-1).values - gold,
        "logit_rank": _count_above(x, gold),
        "logprob": torch.log_softmax(x, dim=-1).gather(1, served[:, None])[:, 0],
    }
    if not decode.sample:
        out["prob"] = out["match"].float()
        return out
    warped = Sampler(replace(decode, sample=False), 0, str(x.device)).warp(x)  # [C, V], -inf where removed
    probs = torch.softmax(warped, dim=-1)  # [C, V]
    out["prob"] = probs.gather(1, served[:, None])[:, 0]
    if sampler is None:
        return out
    parts = [_gumbel_rows(x[a : a + BLOCK], warped[a : a + BLOCK], probs[a : a + BLOCK], served[a : a + BLOCK], decode,
                          sampler) for a in range(0, x.shape[0], BLOCK)]
    out.update({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    return out


def _gumbel_rows(x: torch.Tensor, warped: torch.Tensor, probs: torch.Tensor, served: torch.Tensor,
                 decode: DecodeConfig, sampler: SeededSampler) -> dict[str, torch.Tensor]:
    """The Gumbel-max scores of rows [B, V]: raw fp32 logits `x`, the claimed sampler's `warped` ones and their
    softmax `probs`."""
    import torch

    drawn = sampler.draw(warped, probs)
    removed = ~torch.isfinite(warped.gather(1, served[:, None])[:, 0])  # [B]
    gold_order = drawn.order.gather(1, served[:, None])[:, 0]
    noised = (x + drawn.gumbel * decode.temperature).masked_fill(~torch.isfinite(warped), float("-inf"))
    inf = torch.full(served.shape, float("inf"), device=x.device)
    return {"gumbel_match": drawn.pick == served,
            "gumbel_margin": (noised.max(dim=-1).values - noised.gather(1, served[:, None])[:, 0]).float(),
            "gumbel_rank": torch.where(removed, inf, _count_above(drawn.order, gold_order).float())}


def _check_served(served: Sequence[int], width: int) -> None:
    """A one-line error for a response without tokens or with a token outside the vocabulary of `width`."""
    if not served:
        raise StageReplayError("a served response has no tokens", "drop empty responses before scoring")
    bad = [t for t in served if not 0 <= t < width]
    if bad:
        raise StageReplayError(f"served token {bad[0]} lies outside the claimed model's vocabulary of {width}",
                               "check that the served outputs came from a model with this tokenizer")


def _model_head(lm: LM, hidden: torch.Tensor) -> torch.Tensor:
    """The model's own LM head on hidden states [C, H] in the model's dtype, then its final logit soft-capping
    where it has one (Gemma 2 and 3), as its forward applies them: logits [C, V]."""
    import torch

    logits = lm.model.get_output_embeddings()(hidden)
    cap = getattr(lm.model.config.get_text_config(), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def reference_scores(lm: LM, prompt: Sequence[int], served: Sequence[int], decode: DecodeConfig,
                     seed: int | None = None, head: str = "model", chunk: int = CHUNK,
                     seeded: str = DEFAULT) -> TokenScores:
    """Score the N tokens `served` after `prompt` against `lm`, the claimed model: one forward over
    prompt + served[:-1] with no cache (hidden states [N, H] of the rows that predict the served tokens), then the
    LM head (`head` "model", or "fp32": engine.scoring.head_logits) and `reduce_rows` on `chunk` rows at a time.
    `decode` is the claimed sampler (greedy, or sampling with its temperature, top-k and top-p); `seed`, where
    the server drew with a per-request seed, adds the Gumbel-max scores of the seeded sampler `seeded`
    (`engine.seeded.SAMPLERS`)."""
    import torch

    if head not in HEADS:
        raise StageReplayError(f"unknown LM head {head!r}", f"use one of {', '.join(HEADS)}")
    if chunk < 1:
        raise StageReplayError(f"chunk must be at least 1, got {chunk}", "pass a positive chunk")
    prompt, served = [int(t) for t in prompt], [int(t) for t in served]
    lm.check_prompt(prompt)
    width = int(lm.model.get_output_embeddings().weight.shape[0])
    _check_served(served, width)
    if len(prompt) + len(served) > lm.context:
        raise StageReplayError(f"prompt + served tokens ({len(prompt) + len(served)}) exceed the claimed model's "
                               f"context of {lm.context}", "drop or truncate the response")
    sampler = seeded_sampler(seeded, seed, lm.config.device) if seed is not None and decode.sample else None
    ids = [*prompt, *served[:-1]]
    rows = slice(len(prompt) - 1, len(ids))
    targets = torch.tensor(served, device=lm.config.device)
    parts: list[dict[str, torch.Tensor]] = []
    with torch.inference_mode():
        input_ids = torch.tensor([ids], device=lm.config.device)
        hidden = lm.model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state[0, rows]  # [N, H]
        for start in range(0, len(served), chunk):
            h = hidden[start : start + chunk]  # [C, H]
            logits = head_logits(lm, h) if head == "fp32" else _model_head(lm, h)  # [C, V]
            parts.append(reduce_rows(logits, targets[start : start + chunk], decode, sampler))
    return _collected(parts)


def _collected(parts: Sequence[dict[str, torch.Tensor]]) -> TokenScores:
    """`reduce_rows`' chunks, in order, joined into one response's `TokenScores` on the host."""
    import numpy as np

    fields = {k: np.concatenate([p[k].cpu().numpy() for p in parts]) for k in parts[0]}
    for k in ("margin", "logprob", "prob"):
        fields[k] = fields[k].astype(np.float32)
    return TokenScores(**fields)


def logits_scores(logits: torch.Tensor, served: Sequence[int], decode: DecodeConfig, seed: int | None = None,
                  chunk: int = CHUNK, seeded: str = DEFAULT) -> TokenScores:
    """`TokenScores` of served tokens [N] from reference logits already in hand, [N, V] (row i predicts served[i]),
    reduced `chunk` rows at a time with one seeded sampler `seeded` seeded with `seed` (sampled claims only) across
    them."""
    import torch

    if len(served) != logits.shape[0]:
        raise StageReplayError(f"{len(served)} served tokens for {logits.shape[0]} rows of logits",
                               "give one row of reference logits per served token")
    if chunk < 1:
        raise StageReplayError(f"chunk must be at least 1, got {chunk}", "pass a positive chunk")
    served = [int(t) for t in served]
    _check_served(served, int(logits.shape[1]))
    sampler = seeded_sampler(seeded, seed, str(logits.device)) if seed is not None and decode.sample else None
    targets = torch.tensor(served, device=logits.device)
    return _collected([reduce_rows(logits[a : a + chunk], targets[a : a + chunk], decode, sampler)
                       for a in range(0, len(served), chunk)])
