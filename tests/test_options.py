"""Options that had no test: transplant's `--kv` and `--positions`, and `messages` rows in JSONL data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.boundary import After
from stagereplay.engine.cache import clone_cache, layer_tensors
from stagereplay.engine.lm import load
from stagereplay.engine.transplant import TransplantSpec, transplant
from stagereplay.errors import StageReplayError
from stagereplay.tasks import DataConfig, load_items

runner = CliRunner()


@pytest.fixture(scope="module")
def caches(tiny_dir):
    """A live boundary cache and a donor that differs from it in every K and V element (same shapes)."""
    lm = load(str(tiny_dir("qwen2")), precision="fp32")
    recipient = lm.live(lm.tokenizer.encode("Q: what is 12+7? Think.\n"), After(10)).cache
    donor = clone_cache(recipient)
    for layer in donor.layers:
        layer.keys, layer.values = layer.keys + 1.0, layer.values - 1.0
    return recipient, donor


@pytest.mark.parametrize("kv", ["k", "v", "kv"])
def test_kv_moves_only_the_named_tensors(caches, kv):
    recipient, donor = caches
    out = layer_tensors(transplant(recipient, donor, TransplantSpec((0, 2), kv)))
    mine, theirs = layer_tensors(recipient), layer_tensors(donor)
    for i in range(len(mine)):
        for j, name in enumerate("kv"):
            source = theirs if (i in (0, 2) and name in kv) else mine
            assert torch.equal(out[i][j], source[i][j]), (i, name)


def test_positions_move_only_that_band(caches):
    recipient, donor = caches
    out = layer_tensors(transplant(recipient, donor, TransplantSpec((1,), "kv", (3, 7))))
    mine, theirs = layer_tensors(recipient), layer_tensors(donor)
    for j in range(2):
        got, a, b = out[1][j], mine[1][j], theirs[1][j]  # [B, H_kv, T, D]
        assert torch.equal(got[:, :, 3:7], b[:, :, 3:7])
        assert torch.equal(got[:, :, :3], a[:, :, :3]) and torch.equal(got[:, :, 7:], a[:, :, 7:])
    assert torch.equal(out[0][0], mine[0][0])  # other layers untouched


def test_kv_and_positions_reach_the_run_and_its_audit(tmp_path, bf16_run):
    out = Path(shutil.copytree(bf16_run, tmp_path / "run"))  # its divergent items: what a transplant selects
    result = runner.invoke(app, ["transplant", str(out), "--kv", "k", "--positions", "0:8", "--select", "first:1",
                                 "--quiet"])
    assert result.exit_code == 0, result.stderr
    t = json.loads((out / "results.json").read_text())["transplant"][0]
    assert (t["kv"], t["positions"], t["n_items"]) == ("k", "0:8", 1)
    assert runner.invoke(app, ["audit", str(out), "--verify-only"]).exit_code == 0


def _with_chat_template(src, dst):
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_messages_rows_go_through_the_chat_template(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    model = _with_chat_template(tiny_dir("qwen2"), tmp_path / "chat")
    tokenizer = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps({"id": "m1", "messages": messages, "answer": "4"}) + "\n"
                    + json.dumps({"id": "p1", "prompt": "2+2?", "answer": "4"}) + "\n")
    items, _ = load_items(DataConfig(str(data)), tokenizer)
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert list(items[0].prompt_ids) == list(want)
    assert len(items[0].prompt_ids) > len(tokenizer.encode("2+2?"))  # the roles and the template's text
    assert list(items[1].prompt_ids) == tokenizer.encode("2+2?")  # a prompt row is not templated
    # Negative control: the same row with a tokenizer that has no template is refused, not guessed at.
    with pytest.raises(StageReplayError, match="has 'messages' but the tokenizer has no chat template"):
        load_items(DataConfig(str(data)), AutoTokenizer.from_pretrained(tiny_dir("qwen2")))
