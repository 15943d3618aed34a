"""What a server replies, and what it is, as `--engine http` reads them: each reply checked where it arrives
(`serving.replies`), a server that is not one spoken to here named in one line, a base URL as an OpenAI client takes
it, and the server asked before any model loads. Each refusal is one line and exit 2 (never attest's "flagged"), no
record is made from a reply a run cannot use, and the run resumes; each has the well-behaved fake as its control.
The fakes are tests/fake_server.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_server import fake_server, plain_server
from typer.testing import CliRunner, Result

from stagereplay.cli import app
from stagereplay.engine.model import load_config_and_tokenizer
from stagereplay.errors import REFUSED, StageReplayError
from stagereplay.serving import http
from stagereplay.serving.client import Client, gist
from stagereplay.serving.engines import engine_config
from stagereplay.serving.seam import Sampling
from stagereplay.toy import toy_checkpoint

runner = CliRunner()
CHECKED = 4
"""Completions the check before a run's first item sends (`HttpEngine.check`): a fault after them reaches the items."""


@pytest.fixture(scope="module")
def tokenizer():
    return load_config_and_tokenizer(str(toy_checkpoint("primary")))[1]


def _checked(url: str, tokenizer: Any, mode: str = "raw") -> http.HttpEngine:
    engine = http.load(engine_config("http", {"url": url, "retries": 0}, logprobs_mode=mode), "", "fp32", 1, "cpu")
    engine.check(tokenizer)
    return engine


def _one_line(result: Result) -> str:
    """The refusal's line: exit 2, one line on stderr, no traceback."""
    assert result.exit_code == REFUSED, (result.exit_code, result.output)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in result.output, result.output
    return line


def _items(run: Path) -> list[tuple[str, str]]:
    lines = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    return [(r["item_id"], r["part"]) for r in lines if r["kind"] == "item"]


# -- a reply a run cannot use ------------------------------------------------------------------------------------

REPLY_FAULTS = [
    ("llama-server", "short-logprobs", "7 steps of completion_probabilities for its 8 tokens"),
    ("openai", "short-logprobs", "7 token_logprobs for its 8 tokens"),
    ("llama-server", "stop-word", "stopped at a stop word"),
    ("llama-server", "empty-top", "no candidates at step 1"),
    ("openai", "empty-top", "no candidates at step 7"),
    ("llama-server", "null-logprob", "no log-probability for its token at step 1"),
    ("openai", "null-logprob", "no log-probability for its token at step 7"),
    ("llama-server", "positive-logprob", "0.7 as step 1's token's log-probability, which is not one"),
    ("openai", "positive-logprob", "0.7 as step 7's token's log-probability, which is not one"),
    ("llama-server", "nan-logprob", "nan as step 1's token's log-probability"),
    ("openai", "nan-logprob", "nan as step 7's token's log-probability"),
    ("llama-server", "token-out-of-range", "not a token ID of the run's tokenizer"),
    ("openai", "token-out-of-range", "not a token ID of the run's tokenizer"),
    ("llama-server", "token-as-float", "does not read (tokens.0: Input should be a valid integer"),
    ("openai", "token-as-float", "the token 'token_id:"),
]


@pytest.mark.parametrize(("api", "fault", "says"), REPLY_FAULTS, ids=[f"{a}-{f}" for a, f, _ in REPLY_FAULTS])
def test_a_reply_a_run_cannot_use_is_refused_where_it_arrives(tokenizer, api, fault, says):
    """A rollout's reply (`sample`: mismatch's and attest's request) and a greedy one (`generate`: matched's), each
    refused in one line naming the server and the path, before anything reads it. The control: the same server
    without the fault, whose replies are read as they are."""
    with fake_server(tokenizer, api=api, fault=fault, fault_after=CHECKED) as (url, _):
        engine = _checked(url, tokenizer)
        path = "/completion" if api == "llama-server" else "/v1/completions"
        for ask in (lambda: engine.sample([1, 2, 3], 8, Sampling(temperature=1.0, seed=3)),
                    lambda: engine.generate([1, 2, 3], 8)):
            with pytest.raises(StageReplayError) as refused:
                ask()
            line = str(refused.value)
            assert f"the server at {url} answered {path} with " in line and says in line, line
            assert "\n" not in line and refused.value.fix
    with fake_server(tokenizer, api=api) as (url, _):
        engine = _checked(url, tokenizer)
        drawn = engine.sample([1, 2, 3], 8, Sampling(temperature=1.0, seed=3))
        assert len(drawn.tokens) == 8 and drawn.chosen == (-0.1,) * 8 and all(len(s) == 1 for s in drawn.top)
        assert [len(step) for step in engine.generate([1, 2, 3], 8).top] == [2] * 8


def test_a_speculating_servers_steps_without_candidates_are_read_as_speculated(tokenizer, tmp_path):
    """llama-server emits the tokens its verification accepts with no candidates and a placeholder log-probability
    of 0: a greedy reply keeps its tokens (those steps without candidates), a rollout's log-probabilities are not
    read (unknown, never zeros), and mismatch, which needs them, refuses in one line. The control is the same
    reply without `timings.draft_n`, whose empty steps are refused (above)."""
    with fake_server(tokenizer, draft=(8, 6)) as (url, _):
        engine = _checked(url, tokenizer)
        greedy = engine.generate([1, 2, 3], 8)
        assert len(greedy.tokens) == 8 and [len(s) for s in greedy.top] == [2] + [0] * 7
        assert greedy.draft is not None and greedy.draft.drafted == 8
        drawn = engine.sample([1, 2, 3], 8, Sampling(temperature=1.0, seed=3))
        assert len(drawn.tokens) == 8 and drawn.chosen is None and drawn.top == ()
        line = _one_line(runner.invoke(app, ["mismatch", "--engine", "http", "--url", url, "--n", "2",
                                             "--max-new-tokens", "8", "--quiet", "--out", str(tmp_path / "run")]))
    assert f"the http engine at {url} returned no log-probability for every token it drew" in line, line
    assert "without speculative decoding" in line


def test_a_processed_probability_above_one_is_refused(tokenizer):
    """llama-server's post-sampling probabilities, whose logs are taken here: one above 1 is not a probability. The
    control: the same server's 0.9 is read as log(0.9)."""
    import math

    with fake_server(tokenizer, fault="positive-logprob", fault_after=CHECKED) as (url, _):
        engine = _checked(url, tokenizer, "processed")
        with pytest.raises(StageReplayError, match=r"the probability 1\.7, which is not one"):
            engine.sample([1, 2, 3], 8, Sampling(temperature=1.0, seed=3))
    with fake_server(tokenizer) as (url, _):
        drawn = _checked(url, tokenizer, "processed").sample([1, 2, 3], 8, Sampling(temperature=1.0, seed=3))
    assert drawn.chosen == (math.log(0.9),) * 8


@pytest.mark.parametrize("fault", ["short-logprobs", "empty-top", "null-logprob"])
def test_a_scored_sequence_the_run_cannot_use_is_refused(tokenizer, fault):
    """vLLM's `echo` (mismatch's prefill arms): every token scored from the response's start needs its
    log-probability and candidates; the first echoed token has none, and needs none (the control)."""
    ids = [5, 6, 7, 8]
    with fake_server(tokenizer, api="openai", fault=fault, fault_after=CHECKED) as (url, _):
        with pytest.raises(StageReplayError) as refused:
            _checked(url, tokenizer).score(ids, 2, Sampling())
        assert "answered /v1/completions with " in str(refused.value) and "\n" not in str(refused.value)
    with fake_server(tokenizer, api="openai") as (url, _):
        scores = _checked(url, tokenizer).score(ids, 2, Sampling())
    assert scores.logprobs == (-0.2, -0.2) and scores.argmax == (7, 8)


def test_a_bad_reply_mid_run_writes_no_record_and_the_run_resumes(tokenizer, tmp_path):
    """`mismatch --engine http` against a server whose replies go bad at the second item (one log-probability
    fewer than the tokens it generated): exit 2 and one line naming the item and the server; the first item's
    record kept and nothing from the second, no results. The same command on a server that replies well resumes
    there: every item once, a chain that verifies."""
    out = tmp_path / "run"
    args = ["mismatch", "--engine", "http", "--n", "3", "--max-new-tokens", "8", "--quiet", "--out", str(out)]
    with fake_server(tokenizer, fault="short-logprobs", fault_after=CHECKED + 2) as (url, fake):  # item 1: 2 samples
        line = _one_line(runner.invoke(app, [*args, "--url", url]))
        assert "item toy-20250917-0001: " in line and "7 steps of completion_probabilities for its 8 tokens" in line
        assert _items(out) == [("toy-20250917-0000", "")] and not (out / "results.json").exists()
        fake.fault = ""
        resumed = runner.invoke(app, [*args, "--url", url])
    assert resumed.exit_code == 0, resumed.output
    done = _items(out)
    assert sorted(set(done)) == sorted(done) and {i for i, part in done if part == ""} == {
        f"toy-20250917-000{i}" for i in range(3)}
    verified = runner.invoke(app, ["audit", str(out), "--verify-only", "--quiet"])
    assert verified.exit_code == 0, verified.output


def test_attest_refuses_an_empty_step_and_never_calls_it_flagged(tokenizer, tmp_path):
    """A reply with an empty top-logprobs step at attest's first served item: exit 2 (refused), not 1 (attest's
    "flagged": a crash must not read as an accusation), and no run left behind."""
    out = tmp_path / "run"
    with fake_server(tokenizer, fault="empty-top", fault_after=CHECKED) as (url, _):
        line = _one_line(runner.invoke(app, ["attest", "--engine", "http", "--url", url, "--n", "2",
                                             "--max-new-tokens", "4", "--honest", "fp32", "--quiet", "--out",
                                             str(out)]))
    assert "answered /completion with no candidates at step 1" in line, line
    assert not (out / "ledger.jsonl").exists() or _items(out) == []


# -- a server that is not one spoken to here, and where it is -------------------------------------------------------

@pytest.mark.parametrize("command", ["attest", "mismatch", "matched"])
def test_a_server_that_speaks_neither_api_is_named_in_one_line(tmp_path, command):
    """`python3 -m http.server`: its status and the first line of its 404 page, no HTML, nothing written."""
    out = tmp_path / "run"
    with plain_server() as url:
        line = _one_line(runner.invoke(app, [command, "--engine", "http", "--url", url, "--n", "2", "--out",
                                             str(out)]))
    assert f"the server at {url} has neither /props nor /v1/models (HTTP 404: Error response)" in line, line
    assert "<" not in line and "pass --url the address llama-server or vllm serve listens on" in line
    assert not out.exists()


def test_a_reply_body_is_quoted_by_its_gist():
    """An error's body in one short line: a JSON error's message, else the first line of text without tags."""
    assert gist('{"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}') == "File Not Found"
    assert gist('{"object": "error", "message": "max_logprobs is 0", "code": 400}') == "max_logprobs is 0"
    assert gist("<!DOCTYPE HTML>\n<html>\n  <head><title>Error response</title></head>\n<body>...") == "Error response"
    assert gist("x" * 500) == "x" * 117 + "..."
    assert gist("") == ""


def test_a_path_the_server_does_not_implement_is_asked_once(tokenizer):
    """llama-server's /metrics without --metrics answers 501: a path it does not have, not a failure to retry. The
    control: a 500 is retried."""
    with fake_server(tokenizer) as (url, fake):
        assert Client(url, "K", 5, 2).text("/metrics") is None and fake.paths.count("/metrics") == 1
    with fake_server(tokenizer, "error") as (url, fake):
        with pytest.raises(StageReplayError, match="did not answer /completion: HTTP 500: the model crashed"):
            Client(url, "K", 5, 1).call("/completion", {"prompt": [1], "n_predict": 1})
        assert fake.requests == 2


@pytest.mark.parametrize("api", ["llama-server", "openai"])
@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
def test_an_openai_base_url_names_the_same_server(tokenizer, api, suffix):
    """`--url http://HOST:PORT/v1`, as an OpenAI client takes it: the server at its root, every path asked once
    (no /v1/v1/...), and recorded at its root. The control: a path in front of /v1 (a proxy's) is kept."""
    with fake_server(tokenizer, api=api) as (url, fake):
        engine = _checked(url + suffix, tokenizer)
    assert engine.api == api and engine.settings()["url"] == url
    assert fake.paths and not [p for p in fake.paths if p.startswith("/v1/v1")], fake.paths
    assert Client("http://host:8000/proxy/v1/", "K", 1, 0).url == "http://host:8000/proxy"


# -- the server asked before anything loads ----------------------------------------------------------------------

@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """What was loaded: the model's config and tokenizer, or the model; each refused as it is asked for, so a run
    that gets that far stops there."""
    import stagereplay.engine.model as model_module
    import stagereplay.execution.models as models_module

    loaded: list[str] = []

    def refuse(what: str) -> Any:
        def load(*args: Any, **kwargs: Any) -> Any:
            loaded.append(what)
            raise StageReplayError(f"the test stops at {what}")
        return load

    monkeypatch.setattr(model_module, "load_config_and_tokenizer", refuse("the tokenizer"))
    monkeypatch.setattr(models_module, "cached_lm", refuse("the model"))
    yield loaded


@pytest.mark.parametrize("command", ["attest", "mismatch", "matched"])
def test_a_wrong_url_is_refused_before_the_model_loads(tokenizer, loads, tmp_path, command):
    """A closed port, and a server that speaks neither API: refused without loading the tokenizer or the model, and
    nothing written. The control: a server that answers gets as far as the tokenizer (the loader watched is the one
    a run calls)."""
    out = tmp_path / "run"
    with fake_server(tokenizer) as (live, _):
        pass  # stopped: nothing listens there now
    with plain_server() as plain:
        for url, says in ((live, f"the server at {live} did not answer /props"),
                          (plain, f"the server at {plain} has neither /props nor /v1/models")):
            line = _one_line(runner.invoke(app, [command, "--engine", "http", "--url", url, "--retries", "0",
                                                 "--n", "2", "--out", str(out)]))
            assert says in line and loads == [], (line, loads)
    assert not out.exists()
    with fake_server(tokenizer) as (url, _):
        line = _one_line(runner.invoke(app, [command, "--engine", "http", "--url", url, "--n", "2", "--out",
                                             str(out)]))
    assert "the test stops at the tokenizer" in line and loads == ["the tokenizer"], (line, loads)
