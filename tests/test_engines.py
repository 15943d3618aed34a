"""The serving-engine seam without a serving engine: the boundary found on a whole generation is the one the live
loop finds, and what cannot run is refused before any run directory exists. (The vLLM tests proper are
`test_vllm.py`, in vLLM's own venv.)"""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from stagereplay.cli import app

runner = CliRunner()


def test_stage1_end_on_a_whole_generation_is_where_the_live_loop_stops():
    """A serving engine's live request is one uninterrupted generation; the boundary found on it afterwards
    (`stage1_end`) must be the one `LM.live` finds token by token, for every toy item tried."""
    from stagereplay.engine.boundary import Marker, stage1_end
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.lm import load
    from stagereplay.tasks import DataConfig, load_items
    from stagereplay.toy import toy_checkpoint

    lm = load(str(toy_checkpoint("primary")), "fp32")
    rule = Marker("</think>").bind(lm.tokenizer)
    items, _ = load_items(DataConfig(n=3), lm.tokenizer)
    budget = 328
    for item in items:
        state = lm.live(item, rule, DecodeConfig(max_new_tokens=8, max_stage1_tokens=budget), keep_going=False)
        tokens = lm.generate(item.prompt_ids, budget + 8)
        end = stage1_end(tokens, rule.watch(), lm.eos, budget)
        assert end is not None
        assert (*item.prompt_ids, *tokens[: end + 1]) == state.prefix
        # Negative control: a budget that ends before the marker finds no boundary.
        assert stage1_end(tokens, rule.watch(), lm.eos, end) is None


def test_cross_without_a_serving_engine_is_refused(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--cross", "hf", "--n", "1", "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: --cross replays a serving engine's prefixes; pass it with --engine vllm "
                                     "or --engine llama.cpp")
    assert not out.exists()


def test_an_unknown_engine_is_refused(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--engine", "sglang-x", "--n", "1", "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: unknown engine 'sglang-x'; use hf or one of vllm")
    assert not out.exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this venv")
def test_vllm_missing_is_one_line_and_no_run(tmp_path):
    """The main venv has no vLLM (it lives in its own): the command says how to get it, and leaves nothing."""
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--engine", "vllm", "--n", "1", "--out", str(out)])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: --engine vllm needs vLLM installed; pip install 'stagereplay[vllm]'")
    assert not out.exists()
