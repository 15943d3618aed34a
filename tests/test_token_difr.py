"""Our per-token scores against token-difr 0.1.2's own functions, on the same served tokens and reference logits.

token-difr's package `__init__` imports its API clients (openai, tinker); its verification arithmetic lives in
`token_difr/common.py`, which needs torch only, so that file is loaded by path and its functions run unmodified.
`difr_tokens` is the per-token body of its `verify_outputs` (token_difr/local.py), with the logits that vLLM's
prompt log-probabilities would give replaced by ours. Opt-in: `-m token_difr` in a venv with token-difr installed
(.ci/run makes one).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from stagereplay.engine import reference
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import load
from stagereplay.engine.reference import difr_summary, logits_scores
from stagereplay.engine.scoring import rollout
from stagereplay.toy import toy_checkpoint

pytestmark = pytest.mark.token_difr

VERSION = "0.1.2"
CLAIMS = {
    "greedy": (DecodeConfig(), None),
    "t1": (DecodeConfig(sample=True, temperature=1.0), 7),
    "t07-k20-p09": (DecodeConfig(sample=True, temperature=0.7, top_k=20, top_p=0.9), 123),
}


@pytest.fixture(scope="module")
def common():
    """token_difr/common.py of the installed token-difr, loaded by path."""
    spec = importlib.util.find_spec("token_difr")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"token-difr is not installed: pip install --no-deps token-difr=={VERSION}")
    assert importlib.metadata.version("token-difr") == VERSION
    path = Path(next(iter(spec.submodule_search_locations))) / "common.py"
    module_spec = importlib.util.spec_from_file_location("token_difr_common", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["token_difr_common"] = module  # dataclasses look their module up while building TokenMetrics
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served():
    """Reference logits [N, V] of the toy's primary checkpoint (one-shot prefill) for responses the later checkpoint
    served (greedy and sampled), so that matches and mismatches both occur: [(logits, tokens)]."""
    claimed = load(str(toy_checkpoint("primary")), precision="fp32")
    server = load(str(toy_checkpoint("later")), precision="fp32")
    out = []
    for i, text in enumerate(["Q: what is 12+7? Think.\n", "Q: what is 48+35? Think, then answer.\n"]):
        prompt = claimed.tokenizer.encode(text)
        for dc in (DecodeConfig(), DecodeConfig(sample=True, temperature=1.0)):
            tokens, _ = rollout(server, prompt, 40, dc, seed=i, mode="raw")
            with torch.inference_mode():
                logits = claimed.model(input_ids=torch.tensor([[*prompt, *tokens[:-1]]])).logits[0]
            out.append((logits[len(prompt) - 1 :].float(), tokens))
    return out


def difr_tokens(common, logits_JV: torch.Tensor, gen_ids: list[int], temperature: float, top_k: int, top_p: float,
                seed: int) -> list:
    """token-difr's `verify_outputs` for one sequence, from the line after `_prompt_logprobs_to_tensor` on."""
    J = logits_JV.shape[0]
    gold_col_idx_J = torch.as_tensor(gen_ids, dtype=torch.long)
    top_k_tensor_J = torch.full((J,), top_k, dtype=torch.long)
    top_p_tensor_J = torch.full((J,), top_p, dtype=logits_JV.dtype)
    logits_JV = logits_JV.float()
    probs_JV = common._get_probs(logits_JV, temperature, top_k_tensor_J, top_p_tensor_J)
    row_idx_J = torch.arange(J)
    gold_logits_J = logits_JV[row_idx_J, gold_col_idx_J]
    logit_ranks_J = (logits_JV > gold_logits_J.unsqueeze(1)).sum(dim=1).float()
    probs_gold_J = probs_JV.gather(1, gold_col_idx_J.view(-1, 1)).squeeze(1)
    pred_ids_J, gumbel_ranks_J, margins_J = common._verify_vllm_gumbel_max(
        temperature=temperature, seed=seed, logits_JV=logits_JV, probs_JV=probs_JV, gold_col_idx_J=gold_col_idx_J,
        top_k_tensor_J=top_k_tensor_J, top_p_tensor_J=top_p_tensor_J)
    return [common.TokenMetrics(exact_match=bool(int(pred_ids_J[j]) == int(gen_ids[j])),
                                prob=float(probs_gold_J[j].item()), margin=float(margins_J[j].item()),
                                logit_rank=float(logit_ranks_J[j].item()), gumbel_rank=float(gumbel_ranks_J[j].item()))
            for j in range(J)]


def theirs_and_ours(common, served, claim: str, seed_shift: int = 0):
    decode, seed = CLAIMS[claim]
    temperature = decode.temperature if decode.sample else 0.0
    theirs, ours = [], []
    for logits, tokens in served:
        width = logits.shape[1]
        theirs.append(difr_tokens(common, logits, tokens, temperature, decode.top_k or width, decode.top_p,
                                  seed or 0))
        ours.append(logits_scores(logits, tokens, decode, None if seed is None else seed + seed_shift, chunk=16))
    return theirs, ours


def disagreements(theirs, ours) -> list[str]:
    """The per-token fields and summary keys on which the two differ (floats to 1e-6 relative, inf with inf)."""
    bad = set()
    for seq, scores in zip(theirs, ours, strict=True):
        fields = scores.difr()
        for name in ("exact_match", "prob", "margin", "logit_rank", "gumbel_rank"):
            a = np.array([getattr(m, name) for m in seq], dtype=np.float64)
            b = fields[name].astype(np.float64)
            if not np.allclose(a, b, rtol=1e-6, atol=1e-6, equal_nan=False):
                bad.add(name)
    summary_theirs = common_summary(theirs)
    summary_ours = difr_summary(ours)
    for key, value in summary_theirs.items():
        if not math.isclose(value, summary_ours[key], rel_tol=1e-9, abs_tol=1e-12):
            bad.add(f"summary.{key}")
    return sorted(bad)


def common_summary(theirs):
    module = sys.modules["token_difr_common"]
    return module.compute_metrics_summary(theirs)


@pytest.mark.parametrize("claim", list(CLAIMS))
def test_our_scores_are_token_difrs_on_the_same_tokens_and_logits(common, served, claim):
    theirs, ours = theirs_and_ours(common, served, claim)
    assert disagreements(theirs, ours) == []
    rates = [m.exact_match for seq in theirs for m in seq]
    assert 0 < sum(rates) < len(rates)  # both matches and mismatches were compared


def test_a_seed_off_by_one_disagrees(common, served):
    theirs, ours = theirs_and_ours(common, served, "t1", seed_shift=1)
    assert "exact_match" in disagreements(theirs, ours)


def test_a_rank_counting_ties_disagrees(common, served, monkeypatch):
    # Logits rounded to a coarse grid make ties, where counting `>=` instead of `>` moves the rank.
    coarse = [((logits * 4).round() / 4, tokens) for logits, tokens in served]
    monkeypatch.setattr(reference, "_count_above", lambda values, gold: (values >= gold[:, None]).sum(dim=-1))
    theirs, ours = theirs_and_ours(common, coarse, "greedy")
    assert "logit_rank" in disagreements(theirs, ours)


def test_where_token_difr_removes_underflowing_tokens_at_temperature_0_and_vllm_does_not(common):
    """Its greedy check filters raw logits with top-p 1.0, which drops tokens whose fp32 probability is 0; a served
    token there gets an infinite margin from it and a finite one from us (TokenScores.difr says so)."""
    logits = torch.tensor([[200.0, 0.0, 1.0, 2.0]])
    (metrics,) = difr_tokens(common, logits, [1], 0.0, 4, 1.0, 0)
    ours = logits_scores(logits, [1], DecodeConfig()).difr()
    assert math.isinf(metrics.margin) and ours["margin"][0] == 200.0
