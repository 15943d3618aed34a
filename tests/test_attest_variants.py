"""Attest's honest variants (experiments.attest.variants): each name parses to itself and no other spelling is taken;
each variant's server makes exactly the forwards it says (spans, positions, rows) and `forwards` counts them; a
reused prefix takes the earlier request's K/V rows where its cache still holds them; a run records each variant as a
part and scores it as a side with its construction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.decode import DecodeConfig
from stagereplay.errors import StageReplayError
from stagereplay.experiments.attest.item import serve
from stagereplay.experiments.attest.variants import HonestVariant, _reuse, parse_variants
from stagereplay.records.ledger import items, read_ledger
from stagereplay.toy import toy_checkpoint
from tests.tiny import save_window_model

GREEDY = DecodeConfig(max_new_tokens=5)


@pytest.mark.parametrize("name", ["bf16", "fp32", "bf16/chunked:16", "fp16/prefix:8", "bf16/batched:4"])
def test_a_variant_name_parses_to_itself(name: str):
    assert HonestVariant.parse(name).name == name


@pytest.mark.parametrize("name", ["int8", "bf16/live", "bf16/chunked", "bf16/chunked:0", "bf16/chunked:08",
                                  "bf16/prefix:-1", "bf16/batched:1", "bf16/batched:65", "bf16/paged:4", "bf16/"])
def test_a_name_no_variant_spells_is_refused(name: str):
    with pytest.raises(StageReplayError):
        HonestVariant.parse(name)


def test_a_variant_given_twice_is_refused():
    with pytest.raises(StageReplayError, match="twice"):
        parse_variants(["bf16", "bf16/chunked:4", "bf16"])


@pytest.fixture(scope="module")
def toy_lm():
    from stagereplay.engine.decode import Stepper
    from stagereplay.engine.lm import load

    lm = load(str(toy_checkpoint("primary")), "bf16")
    lm.stepper = Stepper(lm.model, "cpu")  # eager: a captured step first proves itself with forwards of its own
    return lm


def _forwards_seen(lm, variant: HonestVariant, prompt: list[int]) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Every model forward a served response makes, as (rows, tokens, first position), and the response."""
    seen: list[tuple[int, int, int]] = []

    def hook(module, args, kwargs):
        ids, positions = kwargs["input_ids"], kwargs.get("position_ids")
        seen.append((int(ids.shape[0]), int(ids.shape[1]), int(positions[0, 0]) if positions is not None else -1))

    handle = lm.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        response, _, _ = serve(lm, prompt, GREEDY.max_new_tokens, GREEDY, None, variant)
    finally:
        handle.remove()
    return seen, response


@pytest.mark.parametrize(("name", "expected"), [
    ("bf16", [(1, 21, 0)]),
    ("bf16/chunked:8", [(1, 8, 0), (1, 8, 8), (1, 5, 16)]),
    ("bf16/prefix:8", [(1, 21, 0), (1, 16, 0), (1, 5, 16)]),  # the earlier request, the rows reuse fills, the rest
    ("bf16/prefix:32", [(1, 21, 0)]),  # no whole block below the last token: nothing to reuse
    ("bf16/batched:3", [(3, 21, 0)]),
])
def test_each_variant_makes_the_forwards_it_counts(toy_lm, name: str, expected: list[tuple[int, int, int]]):
    variant = HonestVariant.parse(name)
    prompt = [(7 * i + 3) % 40 + 4 for i in range(21)]
    seen, response = _forwards_seen(toy_lm, variant, prompt)
    rows = variant.rows
    steps = [(rows, 1, 21 + i) for i in range(len(response) - 1)]
    assert seen == [*expected, *steps]
    assert variant.forwards(21, len(response)) == [r * n for r, n, _ in seen]


@pytest.mark.parametrize("window", [None, 4])
def test_a_reused_prefix_holds_the_earlier_requests_rows(tmp_path: Path, toy_lm, window: int | None):
    """Rows [0, k) come from the earlier request's cache where it still holds them (a sliding-window layer keeps its
    last window - 1); every other row is the new cache's own. The two caches are made from different tokens, so
    the rows differ before the reuse (the control: a reuse that moved nothing fails)."""
    from stagereplay.engine.cache import held
    from stagereplay.engine.lm import load

    lm = toy_lm if window is None else load(str(save_window_model(tmp_path / "w", window)), "bf16")
    k, length = 8, 12
    earlier, mine = lm.new_cache(None), lm.new_cache(None)
    lm.stepper.forward(list(range(4, 4 + length)), earlier, 0)
    lm.stepper.forward(list(range(20, 20 + k)), mine, 0)
    before = [tuple(t.clone() for t in held(layer)[:2]) for layer in mine.layers]
    _reuse(mine, earlier, k)
    moved = 0
    for layer_before, layer, theirs in zip(before, mine.layers, earlier.layers, strict=True):
        k_mine, v_mine, at = held(layer)
        k_theirs, v_theirs, their_at = held(theirs)
        for pos in range(at, at + int(k_mine.shape[-2])):
            row = pos - at
            kept = their_at <= pos < their_at + int(k_theirs.shape[-2])
            want_k = k_theirs[:, :, pos - their_at] if kept else layer_before[0][:, :, row]
            want_v = v_theirs[:, :, pos - their_at] if kept else layer_before[1][:, :, row]
            assert torch.equal(k_mine[:, :, row], want_k) and torch.equal(v_mine[:, :, row], want_v)
            assert not kept or not torch.equal(layer_before[0][:, :, row], k_theirs[:, :, pos - their_at])
            moved += kept
    assert moved > 0


def test_a_run_records_each_variant_and_scores_it_with_its_construction(tmp_path: Path):
    honest = "bf16,fp32/chunked:4,bf16/prefix:4,bf16/batched:3"
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["attest", "--n", "4", "--max-new-tokens", "6", "--honest", honest, "--quiet",
                                      "--out", str(run)], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    records = [r for r in items(read_ledger(run)) if r.experiment == "attest"]
    assert {r.part for r in records} == {"", *honest.split(","), "reference"}
    for r in records:
        if r.part not in ("", "reference"):
            assert r.payload["precision"] == HonestVariant.parse(r.part).precision
    arms = next(r for r in records if r.part == "reference").payload["arms"]
    assert [(a["name"], a["construction"], a["precision"]) for a in arms] == [
        ("served", "live", "bf16"), ("honest@bf16", "live", "bf16"), ("honest@fp32/chunked:4", "chunked:4", "fp32"),
        ("honest@bf16/prefix:4", "prefix:4", "bf16"), ("honest@bf16/batched:3", "batched:3", "bf16")]
    section = json.loads((run / "results.json").read_text())["attest"][0]
    assert [v["name"] for v in section["variants"]][1:] == [f"honest@{n}" for n in honest.split(",")]


@pytest.mark.parametrize("name", ["bf16/prefix:4", "bf16/chunked:4", "bf16/batched:2"])
def test_each_variant_serves_a_sliding_window_model_past_its_window(tmp_path: Path, name: str):
    """Gemma 3 with a window of 4, a prompt of 13 and 5 new tokens: every variant serves a whole response, making the
    forwards it counts, on a cache whose window layers have dropped positions."""
    from stagereplay.engine.decode import Stepper
    from stagereplay.engine.lm import load

    lm = load(str(save_window_model(tmp_path / "w", 4)), "bf16")
    lm.stepper = Stepper(lm.model, "cpu")
    variant = HonestVariant.parse(name)
    prompt = [(5 * i + 1) % 30 + 4 for i in range(13)]
    seen, response = _forwards_seen(lm, variant, prompt)
    assert len(response) == GREEDY.max_new_tokens or response[-1] in lm.eos
    assert variant.forwards(13, len(response)) == [r * n for r, n, _ in seen]
