"""The serving-engine seam without a serving engine: the boundary found on a whole generation is the one the live
loop finds, and what cannot run is refused before any run directory exists. (The vLLM tests proper are
`test_vllm.py`, in vLLM's own venv.)"""

from __future__ import annotations

import importlib.util

import pytest
from servers import free_port
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
    assert result.stderr.strip() == ("error: --cross replays a serving engine's prefixes in ours; pass it with "
                                     "--engine vllm or --engine llama.cpp or --engine http")
    assert not out.exists()


@pytest.mark.parametrize(("args", "says"), [
    (["--engine", "http", "--url", "http://127.0.0.1:9", "--n-ctx", "64"],
     "error: --n-ctx is not an option of --engine http; --engine http takes --api, --api-key-env, --concurrency, "
     "--retries, --server-args, --slot-restore, --timeout, --url"),
    (["--engine", "llama.cpp", "--url", "http://127.0.0.1:9"], "error: --url is not an option of --engine llama.cpp"),
    (["--engine", "vllm", "--repack"], "error: --repack is not an option of --engine vllm"),
    (["--concurrency", "4"], "error: --concurrency is an option of a serving engine, and --engine hf is ours"),
])
def test_an_option_the_engine_does_not_take_is_refused_not_dropped(tmp_path, args, says):
    """Each engine takes its own options (serving.seam.options_of): one given under another engine is refused in
    one line before anything loads. The control: the same option under its own engine is taken (the run then stops
    at what that engine needs: a GGUF file, a server)."""
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", *args, "--n", "1", "--out", str(out)])
    assert result.exit_code == 2 and result.stderr.strip().startswith(says), result.stderr
    assert not out.exists()
    taken = runner.invoke(app, ["matched", "--engine", "http", "--url", f"http://127.0.0.1:{free_port()}",
                                "--concurrency", "2", "--retries", "0", "--n", "1", "--out", str(out)])
    assert taken.exit_code == 2 and "not an option" not in taken.stderr and "did not answer" in taken.stderr, (
        taken.stderr)


def test_an_unknown_engine_is_refused(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--engine", "sglang-x", "--n", "1", "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: unknown engine 'sglang-x'; use hf (ours) or one of vllm")
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
