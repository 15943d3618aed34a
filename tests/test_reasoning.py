"""Reasoning-model workloads: boundary markers on decoded text, the default `</think>` rule, `messages` rows
through a chat template, stage-1 budgets against the context, and length-dependent RoPE.

The R1-shaped fixtures (tiny.save_r1_model) emit the marker token at a known step of their greedy reply:
`</think>\\n` as one merged token (no token for `</think>` alone), or `</think>` as an added token.
"""

from __future__ import annotations

import json
import warnings

import pytest
from tiny import R1_MESSAGES
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.boundary import Detokenizer, Marker, Regex, default_rule
from stagereplay.engine.limits import STAGE1_BUDGET, check_budgets, rope_scaling
from stagereplay.errors import StageReplayError
from stagereplay.tasks.jsonl import Row, parse_row, tokenize_row


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _r1(path):
    return json.loads((path / "r1.json").read_text())


def _boundary_step(rule, tokenizer, ids):
    watch = rule.bind(tokenizer).watch()
    step = next((k for k, t in enumerate(ids) if watch.step(t)), None)
    return step, watch.detail()


def _messages_file(path, n=2):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"m{i}", "messages": R1_MESSAGES, "answer": "19"}) + "\n")
    return path


# -- markers on decoded text -------------------------------------------------------------------------------


def test_detokenizer_pieces_join_to_the_whole_decode(r1_dir, tiny_dir):
    for path in (r1_dir("merged"), r1_dir("added"), tiny_dir("qwen2")):
        tok = _tokenizer(path)
        ids = [*tok.encode("<think>\nab </think>\n12+7=19 an er t\n\n", add_special_tokens=False), 2, 5, 9]
        d = Detokenizer(tok)
        assert "".join(d.push(t) for t in ids) == tok.decode(ids, skip_special_tokens=False)
        # Negative control: the same pieces do not make another sequence's text.
        assert "".join(Detokenizer(tok).push(t) for t in ids[1:]) != tok.decode(ids, skip_special_tokens=False)


def test_marker_ending_inside_a_merged_token_ends_stage1_at_that_token(r1_dir):
    """`</think>` with a token for `</think>\\n` and none for `</think>`: matched on text, at the merged token."""
    path = r1_dir("merged")
    tok, r1 = _tokenizer(path), _r1(path)
    marker = Marker("</think>").bind(tok)
    assert marker.match_kind() == "text" and len(marker.ids) > 1
    step, detail = _boundary_step(Marker("</think>"), tok, r1["reply"])
    assert step == r1["boundary_step"]
    assert detail == {"boundary_match": "text", "marker_inside_token": True}
    # The whole merged token as the marker is one token: matched on its ID, at the same step, nothing inside.
    whole = Marker("</think>\n").bind(tok)
    assert whole.match_kind() == "token"
    assert _boundary_step(Marker("</think>\n"), tok, r1["reply"]) == (r1["boundary_step"], None)


@pytest.mark.parametrize("kind", ["merged", "added"])
def test_text_matching_agrees_with_decoding_the_whole_prefix(r1_dir, kind):
    """On random token streams, the incremental watch stops where a full re-decode first contains the marker
    (a marker that is one token: where that token first appears, as the rule says)."""
    import random

    tok = _tokenizer(r1_dir(kind))
    rng = random.Random(0)
    pieces = [tok.encode(t, add_special_tokens=False) for t in ("</think>\n", "</", "think", ">", "\n", "k>\n",
                                                                 "</think>", "a", " ", "an")]
    hits = 0
    for marker in ("</think>", "think>", "k>\n", "\n\n"):
        bound = Marker(marker).bind(tok)
        for _ in range(40):
            ids = [t for _ in range(30) for t in rng.choice(pieces)]
            if bound.match_kind() == "token":
                whole = ids.index(bound.ids[0]) if bound.ids[0] in ids else None
            else:
                whole = next((k for k in range(len(ids)) if marker in tok.decode(ids[: k + 1])), None)
            assert _boundary_step(Marker(marker), tok, ids)[0] == whole
            hits += whole is not None
    assert hits > 20  # the streams do contain the markers


def test_single_token_marker_matches_on_its_id(r1_dir):
    path = r1_dir("added")
    tok, r1 = _tokenizer(path), _r1(path)
    assert Marker("</think>").bind(tok).match_kind() == "token"
    assert _boundary_step(Marker("</think>"), tok, r1["reply"]) == (r1["boundary_step"], None)
    # A two-token marker is matched on text and ends at its second token, which it fills exactly.
    ids = tok.encode("ab</think>\ncd", add_special_tokens=False)  # a, b, </think>, \n, c, d
    step, detail = _boundary_step(Marker("</think>\n"), tok, ids)
    assert step == 3 and detail == {"boundary_match": "text", "marker_inside_token": False}


def _decoded_tokens(tokenizer):
    """Wrap tokenizer.decode to count the token IDs it is given."""
    count = [0]
    decode = tokenizer.decode

    def counting(ids, *args, **kwargs):
        count[0] += len(ids)
        return decode(ids, *args, **kwargs)

    tokenizer.decode = counting
    return count


@pytest.mark.parametrize("rule", [Marker("</think>"), Regex(r"Final answer: \d+")])
def test_matching_work_per_token_is_bounded_not_a_re_decode(r1_dir, rule):
    """Text rules decode a window of a few tokens per step: work linear in the trace, not quadratic."""
    tok = _tokenizer(r1_dir("merged"))
    n = 3000
    ids = tok.encode("x" * n + "Final answer: 42 </think>", add_special_tokens=False)
    count = _decoded_tokens(tok)
    step, _ = _boundary_step(rule, tok, ids)
    assert step is not None and step >= n
    assert count[0] <= 4 * len(ids), count[0]
    # Negative control: decoding the whole of stage 1 at every step (what a naive rule does) is quadratic.
    count[0] = 0
    for k in range(1, len(ids) + 1):
        tok.decode(ids[:k], skip_special_tokens=False)
    assert count[0] > 100 * len(ids)


def test_regex_searches_a_tail_window_without_false_starts(r1_dir):
    tok = _tokenizer(r1_dir("merged"))
    ids = tok.encode("y" + "x" * (Regex.WINDOW + 500) + "\nAnswer: 7", add_special_tokens=False)
    # `^` and `\A` are the start of the text (which is "y"): a window that has dropped text must not offer a
    # new start of text, where `^x+` would match ...
    assert _boundary_step(Regex(r"^x+\nAnswer"), tok, ids)[0] is None
    assert _boundary_step(Regex(r"\Ax+\n"), tok, ids)[0] is None
    # ... while a line start after a newline still is one, and a match is found at the token completing it.
    assert _boundary_step(Regex(r"(?m)^Answer: \d"), tok, ids)[0] == len(ids) - 1
    completes = next(k for k in range(len(ids)) if "x\nAnswer" in tok.decode(ids[: k + 1]))
    assert _boundary_step(Regex(r"x\nAnswer"), tok, ids)[0] == completes
    assert _boundary_step(Regex(r"^yx"), tok, ids)[0] == 1  # the true start, before anything is dropped


def test_default_rule_is_think_for_a_reasoning_model(r1_dir, tiny_dir):
    assert default_rule(_tokenizer(r1_dir("added"))).describe() == "marker:</think>"
    # Negative controls: no `</think>` token, or no chat template opening a think block, gives no default.
    assert default_rule(_tokenizer(r1_dir("merged"))) is None
    assert default_rule(_tokenizer(tiny_dir("qwen2"))) is None


# -- the CLI on an R1-shaped model ---------------------------------------------------------------------------


def test_matched_on_a_marker_inside_a_merged_token(r1_dir, tmp_path):
    """Was: every item `no_boundary` and "no item reached the boundary". Now each item ends at the merged token."""
    path = r1_dir("merged")
    data = _messages_file(tmp_path / "items.jsonl")
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["matched", "--model", str(path), "--data", str(data), "--boundary-marker",
                                   "</think>", "--max-new-tokens", "16", "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    results = json.loads((out / "results.json").read_text())["matched"][0]
    assert (results["n"], results["n_boundary"], results["n_marker_inside_token"]) == (2, 2, 2)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["stage1"]["match"] == "text"
    record = next(r for r in map(json.loads, (out / "ledger.jsonl").read_text().splitlines())
                  if r["kind"] == "item")["payload"]
    r1 = _r1(path)
    assert record["prefix_ids"] == r1["prompt_ids"] + r1["reply"][: r1["boundary_step"] + 1]
    assert record["marker_inside_token"] is True
    # The audit re-derives the new fields like every other.
    audit = CliRunner().invoke(app, ["audit", str(out), "--quiet"])
    assert audit.exit_code == 0, audit.output


def test_default_think_rule_is_printed_and_recorded(r1_dir, tmp_path):
    path = r1_dir("added")
    data = _messages_file(tmp_path / "items.jsonl", n=1)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["matched", "--model", str(path), "--data", str(data), "--max-new-tokens", "8",
                                   "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    stage1 = json.loads((out / "manifest.json").read_text())["config"]["stage1"]
    assert (stage1["rule"], stage1["rule_source"], stage1["match"]) == ("marker:</think>", "default", "token")
    loud = CliRunner().invoke(app, ["matched", "--model", str(path), "--data", str(data), "--max-new-tokens", "8",
                                    "--out", str(tmp_path / "loud")])
    assert loud.exit_code == 0, loud.output
    assert "stage 1: marker:</think> (default, matched on token)" in loud.output
    # Negative control: without a `</think>` token there is no default, and the command says what to pass.
    refused = CliRunner().invoke(app, ["matched", "--model", str(r1_dir("merged")), "--data", str(data),
                                       "--out", str(tmp_path / "none"), "--quiet"])
    assert refused.exit_code == 2 and "pass --boundary-marker" in refused.output
    assert not (tmp_path / "none").exists()


# -- messages rows and chat templates ----------------------------------------------------------------------


def test_messages_rows_go_through_the_chat_template(r1_dir):
    tok = _tokenizer(r1_dir("added"))
    row = parse_row({"id": "a", "messages": R1_MESSAGES, "answer": "19"}, 0, "x")
    item = tokenize_row(row, tok)
    expected = tok.apply_chat_template(R1_MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert list(item.prompt_ids) == list(expected)
    assert item.prompt_text.startswith("<bos><|User|>What is 12+7?") and item.prompt_text.endswith("<think>\n")
    # The generation prompt opens the think block: stage 1 is the model's own reasoning.
    assert tok.decode(item.prompt_ids[-2:]) == "<think>\n"


def test_messages_rows_need_a_template_and_well_formed_messages(tiny_dir):
    tok = _tokenizer(tiny_dir("qwen2"))  # no chat template
    with pytest.raises(StageReplayError, match="no chat template"):
        tokenize_row(Row("a", "1", messages=({"role": "user", "content": "hi"},)), tok)
    for bad in ("hi", [{"role": "user"}], [["user", "hi"]]):
        with pytest.raises(StageReplayError, match=r"list of \{role, content\}"):
            parse_row({"messages": bad, "answer": "1"}, 0, "line 1")


# -- budgets and context -----------------------------------------------------------------------------------


def test_stage1_budget_defaults_to_what_the_context_leaves():
    assert check_budgets(30, None, 128, 512) == 512 - 30 - 128
    assert check_budgets(30, None, 128, 1 << 20) == STAGE1_BUDGET
    assert check_budgets(30, 354, 128, 512) == 354  # exactly fits
    with pytest.raises(StageReplayError, match=r"30 \+ stage-1 budget 355 \+ suffix budget 128 = 513 tokens exceed"):
        check_budgets(30, 355, 128, 512)
    with pytest.raises(StageReplayError, match="leave no stage-1 tokens"):
        check_budgets(400, None, 112, 512)


def test_a_budget_that_does_not_fit_is_refused_before_any_run(tiny_dir, items_file, tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["matched", "--model", str(tiny_dir("qwen2")), "--data", str(items_file),
                                   "--boundary-after", "4", "--max-stage1-tokens", "600", "--max-new-tokens", "100",
                                   "--out", str(out)])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "stage-1 budget 600 + suffix budget 100" in lines[0] and "context of 512" in lines[0]
    assert not out.exists()


def test_default_budget_is_recorded(tiny_dir, items_file, tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["matched", "--model", str(tiny_dir("qwen2")), "--data", str(items_file),
                                   "--n", "1", "--boundary-after", "3", "--max-new-tokens", "4", "--out", str(out),
                                   "--quiet"])
    assert res.exit_code == 0, res.output
    config = json.loads((out / "manifest.json").read_text())["config"]
    stage1 = config["stage1"]
    assert stage1["budget"] == 512 - stage1["longest_prompt"] - 4 and stage1["budget_source"] == "default"
    assert config["settings"]["decode"]["max_stage1_tokens"] == stage1["budget"]
    assert stage1["rope"] == {"type": "default", "original_context": None, "length_dependent": False,
                              "may_change": False}


def test_length_dependent_rope_is_warned_about_and_recorded(tiny_dir):
    from dataclasses import replace

    from transformers import AutoConfig

    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.experiments.core.jobs import ReplaySettings
    from stagereplay.runs.prepare import fit_stage1
    from stagereplay.tasks import Item

    path = tiny_dir("llama")
    config = AutoConfig.from_pretrained(path)
    tok = _tokenizer(path)
    items = [Item("a", tuple(range(5, 45)), "1")]
    settings = ReplaySettings("after:3", DecodeConfig(max_new_tokens=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default RoPE warns about nothing
        _, plain = fit_stage1(settings, config, tok, items)
    assert plain.rope.type == "default"
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                              "long_factor": [2.0] * 8, "original_max_position_embeddings": 256}
    with pytest.warns(UserWarning, match="RoPE scaling 'longrope' changes its frequencies past 256 positions"):
        _, scaled = fit_stage1(settings, config, tok, items)
    assert scaled.rope.as_json() == {"type": "longrope", "original_context": 256, "length_dependent": True,
                                     "may_change": True}
    # A budget that keeps every sequence within the original context: recorded, no warning.
    short = replace(settings, decode=DecodeConfig(max_new_tokens=8, max_stage1_tokens=100))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit_stage1(short, config, tok, items)[1].rope.may_change is False
    assert rope_scaling(config).length_dependent
