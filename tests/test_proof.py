"""The proof of the fast step costs what a run uses (engine.proof): it reaches as far as the run's items go,
extended by doubling as they go further, never past them to the context; a fast step never runs at a position no
proof compared; a machine keeps its proofs for every process of the same setting (records.proofs). Each with a
negative control."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from stagereplay.engine import proof as proofs
from stagereplay.engine.decode import Stepper, capture_available
from stagereplay.engine.lm import load
from stagereplay.engine.proof import MIN_REACH, next_reach, schedule

pytestmark = pytest.mark.skipif(not capture_available(), reason="dynamo is unsupported or disabled here")


def _window_model(tmp_path: Path, window: int) -> Path:
    """A Gemma 3 text model with SDPA, sliding-window layers of `window` and a context of 512."""
    from tiny import save_window_model

    return save_window_model(tmp_path / f"gemma3-w{window}", window)


def _load(path: Path, precision: str):
    """The model, set to run every generation to its length (a random model may emit EOS early)."""
    lm = load(str(path), precision=precision)
    lm.model.generation_config.eos_token_id = None
    lm.eos = frozenset()
    return lm


def _generate(lm, prompt, n):
    ids = torch.tensor([prompt])
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def fresh_proofs():
    proofs._PROVEN.clear()
    yield
    proofs._PROVEN.clear()


def test_the_reaches_double_and_stay_within_twice_the_furthest_position():
    assert next_reach(20, 0, 1 << 30) == MIN_REACH
    assert next_reach(257, 256, 1 << 30) == 512
    assert next_reach(3000, 512, 1 << 30) == 4096  # a jump past the doubling goes straight to what is needed
    assert next_reach(700, 512, 600) == 700 and next_reach(20, 0, MIN_REACH // 2) == MIN_REACH // 2  # the context
    for furthest in (10, 256, 257, 1000, 5000, 9000):
        reaches = schedule(21, furthest, 1 << 20)
        assert reaches[-1] >= furthest and reaches == sorted(set(reaches))
        assert sum(reaches) < 2 * reaches[-1] and reaches[-1] < 2 * max(furthest, MIN_REACH)


def test_a_run_proves_as_far_as_its_items_go_extending_as_they_go(tmp_path, fresh_proofs):
    """Items of different lengths: the proof starts at MIN_REACH and doubles only when a step passes it."""
    lm = _load(_window_model(tmp_path, 6), "bf16")
    prompt = lm.tokenizer.encode("What is 3+4?")
    lm.generate(prompt, MIN_REACH - len(prompt))
    assert lm.proof is not None and (lm.proof.positions, lm.proof.extensions) == (MIN_REACH, 0)
    assert lm.proof.steps == MIN_REACH - len(prompt)
    lm.generate(prompt, MIN_REACH)  # past the first reach: one extension, to twice it
    assert (lm.proof.positions, lm.proof.extensions) == (2 * MIN_REACH, 1) and lm.proof.equal
    lm.generate(prompt, 6 * MIN_REACH)  # to 4 and then 8 times it
    assert (lm.proof.positions, lm.proof.extensions) == (8 * MIN_REACH, 3) and lm.proof.equal
    assert lm.stepper.capture


def test_no_fast_step_runs_at_a_position_no_proof_compared(tmp_path, fresh_proofs, monkeypatch):
    """Every captured step of a long generation ran at a position that a proof made before it covered; a step
    below the proof's prompt (which the proof prefilled) ran eagerly."""
    lm = _load(_window_model(tmp_path, 6), "bf16")
    fast_positions: list[tuple[int, int | None]] = []  # (position, the reach proven when it ran)
    original = Stepper.fast_at

    def spying(self, past, cache=None):
        fast = original(self, past, cache)
        if fast and not self._proving:
            fast_positions.append((past, lm.proof.positions if lm.proof else None))
        return fast

    monkeypatch.setattr(Stepper, "fast_at", spying)
    long_prompt = lm.tokenizer.encode("What is 3+4? " * 3)
    lm.generate(long_prompt, 3 * MIN_REACH)
    short = lm.tokenizer.encode("Hi")
    lm.generate(short, 20)  # positions 2..21: below the proof's prompt, so eager
    assert fast_positions and all(reach is not None and p < reach for p, reach in fast_positions)
    assert all(p >= len(long_prompt) for p, _ in fast_positions)
    assert max(p for p, _ in fast_positions) >= MIN_REACH  # the extension was used, after it was proven


def test_a_difference_past_the_first_reach_is_caught_by_the_extension(tmp_path, fresh_proofs, caplog):
    """Negative control: a library switch of the bug's kind that moves values where a sliding window is full
    (`planted_switch`, seen on any CPU), on a model whose window fills only past the first reach: the first proof
    passes, the extension sees the difference at its first differing position, capture goes off in one line, and
    the tokens are still generate()'s."""
    from capture_sweep import planted_switch

    window = MIN_REACH + MIN_REACH // 2
    lm = _load(_window_model(tmp_path, window), "fp32")
    prompt = lm.tokenizer.encode("What is 3+4?")
    caplog.set_level(logging.WARNING, logger="stagereplay")
    with planted_switch():
        lm.generate(prompt, MIN_REACH - len(prompt))
        assert lm.proof.equal and lm.proof.positions == MIN_REACH and lm.stepper.capture
        tokens = lm.generate(prompt, 2 * MIN_REACH - len(prompt))
    assert not lm.proof.equal and lm.proof.extensions == 1
    assert MIN_REACH <= lm.proof.first_difference < 2 * MIN_REACH
    assert not lm.stepper.capture
    assert lm.determinism["fast_steps"]["first_difference"] == lm.proof.first_difference
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "captured steps differ from the eager steps" in said[0], said
    assert tokens == _generate(lm, prompt, 2 * MIN_REACH - len(prompt))


def test_a_count_boundary_proves_to_its_reach_not_the_context(tiny_dir, items_file, fresh_proofs):
    """`prepare` with --boundary-after: exactly prompt + N + the suffix budget (at least MIN_REACH), not the
    stage-1 budget that the context leaves (a negative control: the budget's reach is the context here)."""
    from stagereplay.engine.boundary import After
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.execution.config import ExecConfig
    from stagereplay.execution.models import cached_lm
    from stagereplay.experiments.matched import Matched, MatchedOptions
    from stagereplay.runs.inputs import Inputs
    from stagereplay.runs.prepare import prepare, prove_reach

    inputs = Inputs.of(model=str(tiny_dir("qwen2")), data=str(items_file), n=4, boundary=After(6),
                       decode=DecodeConfig(max_new_tokens=8))
    prepared = prepare("matched", inputs, Matched(), MatchedOptions(), ex=ExecConfig(1, "local"), quiet=True)
    lm, items = cached_lm(prepared.model), list(prepared.items)
    assert lm.proof is not None
    shortest, reach = prove_reach(prepared.settings, items)
    assert len(shortest) == min(len(i.prompt_ids) for i in items)
    assert reach == max(len(i.prompt_ids) for i in items) + 6 + 8
    assert lm.proof.positions == max(reach, MIN_REACH) < lm.context
    budget = prepared.stage1.budget
    assert max(len(i.prompt_ids) for i in items) + budget + 8 == lm.context  # what the old rule proved to


def test_a_machine_proves_a_setting_once_and_every_process_reuses_it(tmp_path, fresh_proofs, monkeypatch):
    """A second process (here: the in-process memo cleared, the model loaded again) takes the stored proof and
    proves nothing; a setting that differs (switches not held eager, as a bug would) is proven afresh."""
    from stagereplay.records.proofs import DirectoryStore, attach_store

    monkeypatch.setenv("STAGEREPLAY_PROOFS", str(tmp_path / "proofs"))
    path = _window_model(tmp_path, 6)
    calls: list[int] = []
    prove = proofs.prove_steps

    def counted(*args, **kwargs):
        calls.append(args[5])
        return prove(*args, **kwargs)

    from stagereplay.engine import lm as lm_module

    monkeypatch.setattr(lm_module, "prove_steps", counted)

    def fresh_lm():
        proofs._PROVEN.clear()
        lm = _load(path, "bf16")
        attach_store(lm)
        assert isinstance(lm.proof_store, DirectoryStore)
        return lm

    first = fresh_lm()
    prompt = first.tokenizer.encode("What is 3+4?")
    first.generate(prompt, MIN_REACH)
    assert calls == [MIN_REACH, 2 * MIN_REACH] and not first.proof.reused
    stored = list((tmp_path / "proofs").glob("*.json"))
    assert len(stored) == 1 and first.proof.key == stored[0].stem

    second = fresh_lm()
    tokens = second.generate(prompt, MIN_REACH)
    assert calls == [MIN_REACH, 2 * MIN_REACH]  # nothing proven again
    assert second.proof.reused and second.proof.positions == 2 * MIN_REACH
    assert second.determinism["fast_steps"] == first.determinism["fast_steps"]  # records the same bytes
    assert tokens == first.generate(prompt, MIN_REACH)

    third = fresh_lm()
    third.stepper.eager_branches = False  # another step: another key
    third.generate(prompt, MIN_REACH - len(prompt))
    assert calls == [MIN_REACH, 2 * MIN_REACH, MIN_REACH] and not third.proof.reused
    assert len(list((tmp_path / "proofs").glob("*.json"))) == 2
