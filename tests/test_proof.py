"""The proof of the fast step costs what a run uses (engine.proof): it reaches as far as the run's items go,
extended by doubling as they go further, never past them to the context; a fast step never runs at a position no
proof compared; a model keeps its proofs in the store it is given, this process's memory before this machine's
folder, which keeps them for every process of the same setting (records.proofs). Each with a negative control."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from stagereplay.engine import prover
from stagereplay.engine.decode import Stepper, capture_available
from stagereplay.engine.lm import load
from stagereplay.engine.model import ModelConfig
from stagereplay.engine.proof import MIN_REACH, Proof, next_reach, schedule
from stagereplay.engine.proof_stores import IN_PROCESS, FastStep, Layered, MemoryStore, layered

pytestmark = [pytest.mark.capture,
              pytest.mark.skipif(not capture_available(), reason="dynamo is unsupported or disabled here")]


def _window_model(tmp_path: Path, window: int) -> Path:
    """A Gemma 3 text model with SDPA, sliding-window layers of `window` and a context of 512."""
    from tiny import save_window_model

    return save_window_model(tmp_path / f"gemma3-w{window}", window)


def _load(path: Path, precision: str, **kwargs):
    """The model, set to run every generation to its length (a random model may emit EOS early)."""
    lm = load(str(path), precision=precision, **kwargs)
    lm.model.generation_config.eos_token_id = None
    lm.eos = frozenset()
    return lm


def _generate(lm, prompt, n):
    ids = torch.tensor([prompt])
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def fresh_proofs():
    IN_PROCESS.clear()
    yield
    IN_PROCESS.clear()


@pytest.fixture
def counted_proofs(monkeypatch) -> list[int]:
    """The reach of every proof made (engine.proof.prove_steps's `reach`), in order."""
    calls: list[int] = []
    prove = prover.prove_steps

    def counted(*args, **kwargs):
        calls.append(args[5])
        return prove(*args, **kwargs)

    monkeypatch.setattr(prover, "prove_steps", counted)
    return calls


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
    assert lm.prover.proof is not None and (lm.prover.proof.positions, lm.prover.proof.extensions) == (MIN_REACH, 0)
    assert lm.prover.proof.steps == MIN_REACH - len(prompt)
    lm.generate(prompt, MIN_REACH)  # past the first reach: one extension, to twice it
    assert (lm.prover.proof.positions, lm.prover.proof.extensions) == (2 * MIN_REACH, 1) and lm.prover.proof.equal
    lm.generate(prompt, 6 * MIN_REACH)  # to 4 and then 8 times it
    assert (lm.prover.proof.positions, lm.prover.proof.extensions) == (8 * MIN_REACH, 3) and lm.prover.proof.equal
    assert lm.stepper.capture


def test_no_fast_step_runs_at_a_position_no_proof_compared(tmp_path, fresh_proofs, monkeypatch):
    """Every captured step of a long generation ran at a position that a proof made before it covered; a step
    below the proof's prompt (which the proof prefilled) ran eagerly."""
    lm = _load(_window_model(tmp_path, 6), "bf16")
    fast_positions: list[tuple[int, int | None]] = []  # (position, the reach proven when it ran)
    original = Stepper.fast_at

    def spying(self, past, cache=None, prompt=()):
        fast = original(self, past, cache, prompt)
        if fast and not self._proving:
            fast_positions.append((past, lm.prover.proof.positions if lm.prover.proof else None))
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
        assert lm.prover.proof.equal and lm.prover.proof.positions == MIN_REACH and lm.stepper.capture
        tokens = lm.generate(prompt, 2 * MIN_REACH - len(prompt))
    assert not lm.prover.proof.equal and lm.prover.proof.extensions == 1
    assert MIN_REACH <= lm.prover.proof.first_difference < 2 * MIN_REACH
    assert not lm.stepper.capture
    assert lm.determinism["fast_steps"]["first_difference"] == lm.prover.proof.first_difference
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
    from stagereplay.experiments.protocol.matched import Matched
    from stagereplay.experiments.protocol.matched_stage import MatchedOptions
    from stagereplay.runs.inputs import Inputs
    from stagereplay.runs.prepare import prepare, prove_reach

    inputs = Inputs.of(model=str(tiny_dir("qwen2")), data=str(items_file), n=4, boundary=After(6),
                       decode=DecodeConfig(max_new_tokens=8))
    prepared = prepare("matched", inputs, Matched(), MatchedOptions(), ex=ExecConfig(1, "local"), quiet=True)
    lm, items = cached_lm(prepared.model), list(prepared.items)
    assert lm.prover.proof is not None
    shortest, reach = prove_reach(prepared.settings, items)
    assert len(shortest) == min(len(i.prompt_ids) for i in items)
    assert reach == max(len(i.prompt_ids) for i in items) + 6 + 8
    assert lm.prover.proof.positions == max(reach, MIN_REACH) < lm.context
    budget = prepared.stage1.budget
    assert max(len(i.prompt_ids) for i in items) + budget + 8 == lm.context  # what the old rule proved to


@pytest.mark.slow  # three models loaded, each capturing its step afresh: the slow tier (CI runs it)
def test_a_machine_proves_a_setting_once_and_every_process_reuses_it(tmp_path, fresh_proofs, monkeypatch,
                                                                    counted_proofs):
    """A second process (here: a model loaded again with a memory of its own, before the same folder) takes the
    stored proof and proves nothing; a setting that differs (switches not held eager, as a bug would) is proven
    afresh."""
    from stagereplay.records.proofs import DirectoryStore, machine_store

    monkeypatch.setenv("STAGEREPLAY_PROOFS", str(tmp_path / "proofs"))
    path = _window_model(tmp_path, 6)
    calls = counted_proofs

    def fresh_lm():
        lm = _load(path, "bf16", proofs=layered(MemoryStore(), machine_store()))
        assert isinstance(lm.prover.store, Layered) and isinstance(lm.prover.store.stores[1], DirectoryStore)
        return lm

    first = fresh_lm()
    prompt = first.tokenizer.encode("What is 3+4?")
    first.generate(prompt, MIN_REACH)
    assert calls == [MIN_REACH, 2 * MIN_REACH] and not first.prover.proof.reused
    stored = list((tmp_path / "proofs").glob("*.json"))
    assert len(stored) == 1 and first.prover.proof.key == stored[0].stem

    second = fresh_lm()
    tokens = second.generate(prompt, MIN_REACH)
    assert calls == [MIN_REACH, 2 * MIN_REACH]  # nothing proven again
    assert second.prover.proof.reused and second.prover.proof.positions == 2 * MIN_REACH
    assert second.determinism["fast_steps"] == first.determinism["fast_steps"]  # records the same bytes
    assert tokens == first.generate(prompt, MIN_REACH)

    third = fresh_lm()
    third.stepper.eager_branches = False  # another step: another key
    third.generate(prompt, MIN_REACH - len(prompt))
    assert calls == [MIN_REACH, 2 * MIN_REACH, MIN_REACH] and not third.prover.proof.reused
    assert len(list((tmp_path / "proofs").glob("*.json"))) == 2


class SpyStore:
    """A stand-in store (engine.proof_stores.ProofStore): keeps proofs in a dict, stamps them with its own key and
    notes every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.kept: dict[FastStep, Proof] = {}

    def lock(self, step):
        self.calls.append(("lock", step.name))
        return nullcontext()

    def get(self, step):
        self.calls.append(("get", step.name))
        return self.kept.get(step)

    def put(self, step, proof):
        self.calls.append(("put", step.name))
        self.kept[step] = replace(proof, key="spy")
        return self.kept[step]

    def where(self, step):
        return "the spy"


@pytest.mark.slow  # three models loaded, each capturing its step afresh: the slow tier (CI runs it)
def test_a_model_keeps_its_proofs_in_the_store_it_is_given(tmp_path, fresh_proofs, counted_proofs):
    """The store passed to `load` is asked before a proof and keeps it, and what it kept is the model's proof; a
    second model given the same store takes it and proves nothing. This process's memory is not asked: it is the
    store of a model given none."""
    path, spy = _window_model(tmp_path, 6), SpyStore()
    lm = _load(path, "bf16", proofs=spy)
    assert lm.prover.store is spy
    prompt = lm.tokenizer.encode("What is 3+4?")
    lm.generate(prompt, MIN_REACH - len(prompt))
    assert spy.calls == [("get", "captured"), ("lock", "captured"), ("get", "captured"), ("put", "captured")]
    (step,) = spy.kept
    assert step.model == lm.config and step.eager_branches and dict(step.settings) == lm.settings
    assert lm.prover.proof is spy.kept[step] and lm.prover.proof.key == "spy"
    assert IN_PROCESS.get(step) is None
    again = _load(path, "bf16", proofs=spy)
    again.generate(prompt, MIN_REACH - len(prompt))
    assert counted_proofs == [MIN_REACH] and again.prover.proof is spy.kept[step]
    # The control: a model given no store keeps its proof in this process's memory, and the spy hears nothing.
    heard = len(spy.calls)
    _load(path, "bf16").generate(prompt, MIN_REACH - len(prompt))
    assert counted_proofs == [MIN_REACH, MIN_REACH] and len(spy.calls) == heard and IN_PROCESS.get(step) is not None


@pytest.mark.slow  # three models loaded, each capturing its step afresh: the slow tier (CI runs it)
def test_this_process_memory_is_a_store_layered_before_the_machine_one(tmp_path, fresh_proofs, counted_proofs):
    """A model the process loads (execution.models.cached_lm) keeps its proofs in this process's memory, layered
    before the store found for the machine: loaded again, with nothing on the machine, it proves nothing; the
    negative control forgets the memory, as a fresh process starts, and proves again."""
    from stagereplay.execution.models import cached_lm, release_models

    config = ModelConfig(path=str(_window_model(tmp_path, 6)), precision="bf16")
    machine = SpyStore()

    def loaded(store: SpyStore):
        release_models()
        lm = cached_lm(config, machine_store=lambda: store)
        lm.eos = frozenset()  # every generation runs to its length
        return lm

    lm = loaded(machine)
    assert isinstance(lm.prover.store, Layered) and lm.prover.store.stores == (IN_PROCESS, machine)
    prompt = lm.tokenizer.encode("What is 3+4?")
    lm.generate(prompt, MIN_REACH - len(prompt))
    (step,) = machine.kept
    assert IN_PROCESS.get(step) is lm.prover.proof and lm.prover.proof.key == "spy"  # kept in both, the machine's key
    empty = SpyStore()
    again = loaded(empty)
    again.generate(prompt, MIN_REACH - len(prompt))
    assert counted_proofs == [MIN_REACH] and again.prover.proof is lm.prover.proof
    assert ("get", "captured") in empty.calls and not empty.kept  # the machine's store was asked, and had nothing
    IN_PROCESS.clear()
    loaded(SpyStore()).generate(prompt, MIN_REACH - len(prompt))
    assert counted_proofs == [MIN_REACH, MIN_REACH]
    release_models()


def test_layered_stores_take_the_furthest_proof_and_keep_it_in_front():
    """Another process may have proven further than this one's memory holds: a lookup takes the furthest proof of
    the layers (a failed one before any) and keeps it in the layers before the one that had it; a proof is kept in
    every layer, the outermost first, and carries what that layer made of it (its key)."""
    step = FastStep.of(ModelConfig(path="nowhere"), {"threads": 1}, "captured", True)
    short, long = (Proof("captured", "eager", 4, n, n - 4, True, None, 0.0) for n in (64, 128))
    front, back = MemoryStore(), SpyStore()
    both = Layered(front, back)
    assert both.get(step) is None
    front.put(step, short)
    back.kept[step] = long
    assert both.get(step) is long and front.get(step) is long
    failed = replace(short, positions=70, equal=False, first_difference=66)
    back.kept[step] = failed
    assert both.get(step) is failed and front.get(step) is failed  # a difference anywhere ends the fast path
    kept = both.put(step, short)
    assert kept.key == "spy" and front.get(step) is kept and back.kept[step] == kept
    assert layered(front, None) is front  # no machine store (STAGEREPLAY_PROOFS=off): the memory alone
