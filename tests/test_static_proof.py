"""A static cache's fast step is proven at the length it runs at (engine.proof): a static forward's shapes, and a
CUDA graph's recorded kernels, follow the cache's allocated length L, so a proof holds for one L. On a CPU there are
no CUDA graphs; `LengthBound` stands in for them: the eager static step, whose bits are the eager step's at every
length but one (`bad`), as a graph's would be if its kernels at that length differed. A proof on a cache of another
length cannot see it; one at the run's own length must. Each with a control that shows what the old rule (a proof
on a cache of the proof's own length) lets through."""

from __future__ import annotations

import pytest
import torch

from stagereplay.engine import cache as cache_module
from stagereplay.engine import decode as decode_module
from stagereplay.engine import proof as proofs
from stagereplay.engine.cache import allocated
from stagereplay.engine.lm import load
from stagereplay.engine.proof_stores import IN_PROCESS


class LengthBound:
    """engine.graphs.CudaGraphs' seam, on a CPU: `forward(cache, token, past)` -> the step's logits [V]. The eager
    static step, except on a cache allocated for `bad` positions, where each step's pick moves to the next token."""

    def __init__(self, step, device: str, bad: int | None) -> None:
        self.step, self.device, self.bad = step, device, bad
        self.enabled = True
        self.steps: list[tuple[int, int | None]] = []  # (position, allocated) of each step it ran

    def forward(self, cache, token: torch.Tensor, past: int) -> torch.Tensor:
        length = allocated(cache)
        self.steps.append((past, length))
        logits = self.step(token.view(1, 1), torch.full((1, 1), past, dtype=torch.long), cache)
        if length == self.bad:
            logits = logits.clone()
            logits[(int(torch.argmax(logits)) + 1) % logits.shape[-1]] = logits.max() + 1
        return logits


@pytest.fixture(autouse=True)
def fresh_proofs():
    IN_PROCESS.clear()
    yield
    IN_PROCESS.clear()


def _static(tiny_dir, bad: int | None):
    lm = load(str(tiny_dir("qwen2")), precision="fp32", cache="static")
    lm.model.generation_config.eos_token_id = None
    lm.eos = frozenset()  # every generation runs to its length
    lm.stepper.graphs = LengthBound(lm.stepper._step, lm.config.device, bad)
    return lm


def _eager(tiny_dir, prompt, n):
    lm = load(str(tiny_dir("qwen2")), precision="fp32", cache="static")
    lm.eos = frozenset()
    return lm.generate(prompt, n)


PROMPT, N = [3, 14, 15, 92, 6], 40
LENGTH = len(PROMPT) + N - 1  # what generate()'s static cache allocates for N new tokens


def test_a_graphed_step_is_proven_on_a_cache_of_the_length_it_runs_at(tiny_dir):
    lm = _static(tiny_dir, bad=None)
    tokens = lm.generate(PROMPT, N)
    assert tokens == _eager(tiny_dir, PROMPT, N)
    proof = lm.prover.proofs[LENGTH]
    assert proof.equal and proof.allocated == LENGTH and proof.name == f"cuda-graph@{LENGTH}"
    assert proof.covers(len(PROMPT) + 1, LENGTH) and not proof.covers(len(PROMPT) + 1, LENGTH + 1)
    assert not proof.covers(len(PROMPT) + 1, None)  # nor a dynamic cache's step
    graph = lm.stepper.graphs
    assert {length for _, length in graph.steps} == {LENGTH}  # the proof's steps and the run's, one length
    # A second length is proven at that length before its first fast step; the first proof does not cover it.
    longer = [*PROMPT, 7]
    assert lm.generate(longer, N) == _eager(tiny_dir, longer, N)
    assert set(lm.prover.proofs) == {LENGTH, LENGTH + 1} and lm.prover.proofs[LENGTH + 1].allocated == LENGTH + 1


def test_a_step_that_differs_at_the_run_length_is_caught_there_and_the_run_stays_exact(tiny_dir):
    lm = _static(tiny_dir, bad=LENGTH)
    assert lm.generate(PROMPT, N) == _eager(tiny_dir, PROMPT, N)
    proof = lm.prover.proofs[LENGTH]
    assert not proof.equal and proof.allocated == LENGTH and proof.first_difference == len(PROMPT)
    assert lm.stepper.graphs is None  # the fast path is off for the process: every later step eager
    assert lm.determinism["fast_steps"]["equal"] is False


def test_control_a_proof_on_a_cache_of_its_own_length_lets_the_difference_through(tiny_dir, monkeypatch):
    """The old rule, put back: the guard is not told the cache's length, so the proof runs on a cache of the proof's
    own length (64 positions here), where the step is right; the run's steps at its own length are not."""
    monkeypatch.setattr(decode_module, "allocated", lambda cache: None)
    monkeypatch.setattr(cache_module, "allocated", lambda cache: None)
    lm = _static(tiny_dir, bad=LENGTH)
    tokens = lm.generate(PROMPT, N)
    proof = lm.prover.proofs[None]
    assert proof.equal and proof.positions != LENGTH  # proven, at a length the run does not use
    assert tokens != _eager(tiny_dir, PROMPT, N)  # and the run left the eager trajectory unseen


def test_a_proof_made_at_another_length_is_not_reused(tiny_dir):
    """A passing proof in hand for another length (a graph captured at another length) does not let a step at
    the run's length skip its own proof."""
    lm = _static(tiny_dir, bad=LENGTH)
    other = proofs.Proof("cuda-graph", "eager", len(PROMPT), 128, 128 - len(PROMPT), True, None, 0.0,
                         allocated=LENGTH + 8)
    lm.prover.adopt(other)
    assert lm.generate(PROMPT, N) == _eager(tiny_dir, PROMPT, N)
    assert lm.prover.proofs[LENGTH + 8] is other and not lm.prover.proofs[LENGTH].equal


def test_a_graph_run_allocates_one_length_for_every_item_and_plan_prices_its_proof(tiny_dir):
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.limits import static_cache_len
    from stagereplay.plan.paper import proof_stages
    from stagereplay.plan.stages import PlanConfig
    from stagereplay.runs.prepare import shared_static_len
    from stagereplay.tasks import Item

    items = [Item(id=f"q{k}", prompt_ids=tuple(range(1, 4 + 3 * k)), answer="1") for k in range(3)]
    dc = DecodeConfig(max_new_tokens=16, max_stage1_tokens=32)

    def model(**settings):
        from stagereplay.engine.model import ModelConfig

        return ModelConfig(path=str(tiny_dir("qwen2")), **{"cache": "static", **settings})

    gpu = shared_static_len(model(device="cuda"), dc, items, 512).static_len
    assert gpu == static_cache_len(len(items[-1].prompt_ids), 32, 16, 512)  # the longest item's allocation
    assert shared_static_len(model(device="cpu"), dc, items, 512).static_len is None  # eager: nothing proven
    assert shared_static_len(model(device="cuda", static_len=300), dc, items, 512).static_len == 300
    assert shared_static_len(model(device="cuda", precision="fp32-compute"), dc, items, 512).static_len is None

    bf16 = {("primary", "bf16")}
    rows = proof_stages(PlanConfig(cache="static", device="cuda", later=False), 20, 100, 4096, bf16)
    assert [r.name for r in rows] == ["proof@bf16"] and max(r.positions for r in rows) <= 100
    assert proof_stages(PlanConfig(cache="static", device="cpu", later=False), 20, 100, 4096, bf16) == []
