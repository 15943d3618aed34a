"""Why two arms diverged: margins, logits at the first divergent step, cache differences by layer and band.

Unit tests on synthetic tensors (each property with a negative control), then the decode loop's step record
on a tiny model: recording the logits must not change a token or a logit bit.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from stagereplay.engine.diagnostics import (
    cache_difference,
    logit_comparison,
    position_bands,
)
from stagereplay.engine.steps import StepRecord


def _cache(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> SimpleNamespace:
    """A stand-in with the transformers 5.x surface the diagnostics read: `.layers[i].keys / .values`."""
    return SimpleNamespace(layers=[SimpleNamespace(keys=k, values=v) for k, v in layers])


def _kv(n_layers: int, t: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn((1, 2, t, 4), generator=g).to(dtype) for _ in "kv") for _ in range(n_layers)]


def _copy(layers):
    return [tuple(x.clone() for x in pair) for pair in layers]


# --- logits --------------------------------------------------------------------------------------


def _record(logits: torch.Tensor, picks=None, watch=()) -> StepRecord:
    """A StepRecord fed the rows of `logits` [S, V] as steps, picking `picks` (argmax by default)."""
    record = StepRecord(logits.shape[0], watch)
    for i, row in enumerate(logits):
        record.add(row, int(torch.argmax(row)) if picks is None else picks[i])
    return record


def test_step_margins_are_top1_minus_top2_per_step():
    logits = torch.tensor([[1.0, 3.0, 2.5], [0.0, -1.0, 4.0], [2.0, 2.0, 1.0]])  # [S=3, V=3]
    record = _record(logits)
    assert record.margins() == [0.5, 4.0, 0.0]  # a tie is a margin of 0
    assert record.values.tolist() == [[3.0, 2.5, 1.0], [4.0, 0.0, -1.0], [2.0, 2.0, 1.0]]  # k = min(5, V)
    assert record.ids[:2].tolist() == [[1, 2, 0], [2, 0, 1]]


def test_a_step_record_keeps_full_logits_only_at_step_0_and_where_a_watched_suffix_is_left():
    logits = torch.randn((6, 50), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    picks = [int(torch.argmax(row.float())) for row in logits]
    same, off3 = list(picks), [*picks[:3], picks[3] + 1, *picks[4:]]
    record = _record(logits, picks, watch=[same, off3, picks[:2]])
    assert sorted(record.full) == [0, 3]  # the equal suffix and the shorter one are never left
    assert record.full[3] is logits[3] or torch.equal(record.full[3], logits[3])
    # Negative control: without watching, only the first step is kept.
    assert sorted(_record(logits, picks).full) == [0]


def test_logit_comparison_at_the_first_divergent_step():
    a = torch.tensor([[0.0, 1.0, 5.0, 2.0], [0.0, 3.0, 2.9, 1.0]])
    b = torch.tensor([[0.0, 1.0, 5.25, 2.0], [0.0, 2.9, 3.0, 1.0]])
    out = logit_comparison(a[0], b[0], 1, a[1], b[1])
    assert out["first_step_logit_maxabs"] == 0.25
    d = out["divergence"]
    assert d["step"] == 1 and math.isclose(d["logit_maxabs"], 0.1, rel_tol=1e-6)
    assert [t for t, _ in d["a"]["top"]] == [1, 2, 3, 0] and [t for t, _ in d["b"]["top"]] == [2, 1, 3, 0]
    assert math.isclose(d["a"]["margin"], 0.1, rel_tol=1e-5) and math.isclose(d["b"]["margin"], 0.1, rel_tol=1e-5)


def test_tied_logits_list_in_the_order_greedy_picks_them():
    """argmax takes the lowest id among tied maxima; the recorded top-1 must be the token the arm emitted."""
    a = torch.tensor([[0.0, 2.0, 0.0, 2.0, 2.0, 1.0]])
    b = torch.tensor([[0.0, 1.0, 0.0, 2.0, 2.0, 1.0]])
    d = logit_comparison(a[0], b[0], 0, a[0], b[0])["divergence"]
    assert [t for t, _ in d["a"]["top"]] == [1, 3, 4, 5, 0] and d["a"]["top"][0][0] == int(torch.argmax(a[0]))
    assert [t for t, _ in d["b"]["top"]] == [3, 4, 1, 5, 0] and d["a"]["margin"] == 0.0


def test_logit_comparison_of_agreeing_arms_has_no_divergence_block():
    a = torch.zeros((3, 5))
    out = logit_comparison(a[0], a[0].clone(), None)
    assert out == {"first_step_logit_maxabs": 0.0, "divergence": None}
    # Negative control: the same logits with a divergence index do get the block.
    assert logit_comparison(a[0], a[0].clone(), 2, a[2], a[2].clone())["divergence"] is not None
    # An arm with no logits at the divergent step (it stopped before it) gets none.
    assert logit_comparison(a[0], a[0].clone(), 2, a[2], None)["divergence"] is None


# --- caches --------------------------------------------------------------------------------------


def test_identical_caches_differ_nowhere():
    layers = _kv(3, 20)
    diff = cache_difference(_cache(layers), _cache(_copy(layers)), prompt_len=8, n_positions=20)
    assert diff is not None
    for row in diff["layers"] + diff["bands"]:
        assert row["k"] == row["v"] == {"maxabs": 0.0, "rel_l2": 0.0, "n_diff": 0}


def test_one_changed_element_is_found_in_its_layer_tensor_and_band():
    layers = _kv(3, 20)
    other = _copy(layers)
    other[1][1][0, 1, 12, 2] += 0.5  # layer 1, V, head 1, position 12 (stage 1, second quartile), dim 2
    diff = cache_difference(_cache(layers), _cache(other), prompt_len=8, n_positions=20)
    assert diff is not None
    assert [(r["layer"], r["k"]["n_diff"], r["v"]["n_diff"]) for r in diff["layers"]] == [(0, 0, 0), (1, 0, 1),
                                                                                         (2, 0, 0)]
    changed = float(other[1][1][0, 1, 12, 2].float() - layers[1][1][0, 1, 12, 2].float())
    v1 = diff["layers"][1]["v"]
    assert v1["maxabs"] == abs(changed)
    assert math.isclose(v1["rel_l2"], abs(changed) / float(layers[1][1].float().norm()), rel_tol=1e-5)
    bands = {b["band"]: (b["start"], b["end"], b["v"]["n_diff"]) for b in diff["bands"]}
    assert bands == {"prompt": (0, 8, 0), "s1.q1": (8, 11, 0), "s1.q2": (11, 14, 1), "s1.q3": (14, 17, 0),
                     "s1.q4": (17, 20, 0), "last16": (4, 20, 1)}


def test_sliding_window_layers_map_to_absolute_positions():
    """A layer holding only its last 6 positions of 20: its first held slot is absolute position 14, not 0."""
    full = _kv(1, 20, seed=1)
    window = _kv(1, 6, seed=2)
    other = _copy(full) + _copy(window)
    other[1][0][0, 0, 0, 0] += 1.0  # the window layer's first held position
    diff = cache_difference(_cache(full + window), _cache(other), prompt_len=8, n_positions=20)
    assert diff is not None
    hit = {b["band"] for b in diff["bands"] if b["k"]["n_diff"]}
    assert hit == {"s1.q3", "last16"}  # absolute 14 is in the third stage-1 quartile [14, 17)
    # Negative control: read as positions from 0, the same change would land in the prompt band.
    assert not any(lo <= 0 < hi for name, lo, hi in position_bands(8, 20) if name in hit)


def test_caches_of_other_shapes_are_not_compared():
    a, b = _kv(2, 20), _kv(2, 21)
    assert cache_difference(_cache(a), _cache(b), prompt_len=8, n_positions=20) is None


@pytest.mark.parametrize(("prompt_len", "n", "names"), [
    (8, 20, ["prompt", "s1.q1", "s1.q2", "s1.q3", "s1.q4", "last16"]),
    (8, 10, ["prompt", "s1.q2", "s1.q4", "last16"]),  # 2 stage-1 positions: two quartiles are empty
])
def test_position_bands_cover_prompt_and_stage1(prompt_len, n, names):
    bands = position_bands(prompt_len, n)
    assert [b[0] for b in bands] == names
    assert bands[0][1:] == (0, prompt_len) and bands[-1][1:] == (max(n - 16, 0), n)


# --- the decode loop's step record ---------------------------------------------------------------


@pytest.mark.capture
@pytest.mark.parametrize("capture", [False, True])
def test_recording_steps_changes_no_token_and_no_logit(tiny_dir, capture):
    """The loop reduces each step as it goes: the same picks, and each step's record is that of the logits the
    step chose from (every step's logits kept here, by a subclass, to check against)."""
    from stagereplay.engine.cache import new_cache
    from stagereplay.engine.decode import DecodeConfig, Sampler, Stepper, decode
    from stagereplay.engine.model import ModelConfig, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(ModelConfig(path=str(tiny_dir("qwen2")), precision="bf16"))
    prompt = [5, 9, 23, 40, 17, 3, 61]

    class KeepAll(StepRecord):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.all: list[torch.Tensor] = []

        def add(self, logits: torch.Tensor, token: int) -> None:
            self.all.append(logits)
            super().add(logits, token)

    def run(record):
        stepper = Stepper(model, "cpu", capture=capture)
        cache = new_cache(model)
        logits = stepper.forward(prompt, cache, 0)
        sampler = Sampler(DecodeConfig(), 0, "cpu")
        return decode(stepper, cache, logits, len(prompt), sampler, 24, frozenset(), record)

    plain = run(None)
    record = KeepAll(24, watch=[[*plain[:5], plain[5] + 1]])
    assert run(record) == plain
    assert record.n == 24 and sorted(record.full) == [0, 5]
    assert [int(torch.argmax(x.float())) for x in record.all] == plain  # each recorded step is the one picked from
    assert len({x.data_ptr() for x in record.all}) == 24  # distinct tensors: no step overwrote another
    stacked = torch.stack(record.all).float()  # [S, V]: what the diagnostics stacked before
    top2 = torch.topk(stacked, 2, dim=-1).values
    assert record.margins() == (top2[:, 0] - top2[:, 1]).tolist()
    assert torch.equal(record.values, torch.topk(stacked, 5, dim=-1).values)
    assert record.full[5] is record.all[5]
