"""The check before a server audit's first item (`serving.http.HttpEngine.check`) and its faults, on a fake of
llama-server's API that misbehaves on purpose (tests/servers.py): each refusal in one line with its fix, each with
the well-behaved fake passing as its negative control. The real servers are tested in tests/test_server.py."""

from __future__ import annotations

import time

import pytest
from servers import fake_server
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.model import load_config_and_tokenizer
from stagereplay.errors import StageReplayError
from stagereplay.serving import http
from stagereplay.serving.seam import EngineConfig
from stagereplay.toy import toy_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def tokenizer():
    return load_config_and_tokenizer(str(toy_checkpoint("primary")))[1]


def _check(url: str, tokenizer, **config) -> http.HttpEngine:
    engine = http.load(EngineConfig("http", url=url, **config), "", "fp32", 1, "cpu")
    engine.check(tokenizer)
    return engine


def test_a_well_behaved_server_passes_the_check_and_is_identified(tokenizer):
    with fake_server(tokenizer) as (url, fake):
        engine = _check(url, tokenizer)
    settings = engine.settings()
    assert settings["api"] == "llama-server" and settings["build"]["build"] == "fake-1"
    assert settings["checked"]["verbatim_ids"] and settings["checked"]["tokenizer"] == "compared"
    assert fake.requests == 4  # the probe, its replica, reused and bypassed


@pytest.mark.parametrize(("mode", "says"), [
    ("as-text", "does not take token IDs verbatim"),
    ("no-logprobs", "returned no top-5 logprobs"),
    ("sampling", "is not greedy at temperature 0"),
    ("tokenizer", "tokenizes 'Hello world' as"),
])
def test_a_server_the_run_could_not_compare_is_refused_in_one_line(tokenizer, mode, says):
    with fake_server(tokenizer, mode) as (url, _), pytest.raises(StageReplayError) as refused:
        _check(url, tokenizer)
    assert says in str(refused.value) and "\n" not in str(refused.value) and refused.value.fix


def test_the_matched_command_refuses_before_any_item_and_writes_nothing(tokenizer, tmp_path):
    out = tmp_path / "run"
    with fake_server(tokenizer, "as-text") as (url, _):
        result = runner.invoke(app, ["matched", "--engine", "http", "--url", url, "--precision", "fp32", "--n", "2",
                                     "--out", str(out), "--quiet"])
    assert result.exit_code != 0
    assert "does not take token IDs verbatim" in result.output
    assert not (out / "ledger.jsonl").exists()


def test_an_unreachable_server_and_a_failing_one_are_named_with_the_fix(tokenizer):
    with fake_server(tokenizer) as (url, _):
        pass  # stopped: nothing listens there now
    with pytest.raises(StageReplayError, match=r"the server at http://127\.0\.0\.1:\d+ did not answer /props"):
        http.load(EngineConfig("http", url=url, retries=0), "", "fp32", 1, "cpu")
    with fake_server(tokenizer, "error") as (url, fake), pytest.raises(StageReplayError) as failed:
        _check(url, tokenizer, retries=1)
    assert "HTTP 500" in str(failed.value) and fake.requests == 2  # the request and its one retry


def test_a_stalled_server_is_given_up_on_at_the_timeout(tokenizer):
    with fake_server(tokenizer, "stall", stall=3.0) as (url, _):
        engine = http.load(EngineConfig("http", url=url, timeout=0.5, retries=0), "", "fp32", 1, "cpu")
        start = time.monotonic()
        with pytest.raises(StageReplayError, match="did not answer /completion"):
            engine.generate([1, 2, 3], 4)
        assert time.monotonic() - start < 2.5  # the timeout, not the stall
        # Negative control: with time enough, the same request is answered.
        slow = http.load(EngineConfig("http", url=url, timeout=10, retries=0), "", "fp32", 1, "cpu")
        assert len(slow.generate([1, 2, 3], 4).tokens) == 4


def test_the_api_key_is_sent_and_never_kept(tokenizer, monkeypatch):
    monkeypatch.setenv("STAGEREPLAY_TEST_KEY", "sk-test-0123456789")
    seen = []
    with fake_server(tokenizer) as (url, _):
        client = http.Client(url, "STAGEREPLAY_TEST_KEY", 5, 0)
        real = http.request.urlopen

        def spy(req, timeout):
            seen.append(req.get_header("Authorization"))
            return real(req, timeout=timeout)

        monkeypatch.setattr(http.request, "urlopen", spy)
        engine = http.HttpEngine(EngineConfig("http", url=url, api_key_env="STAGEREPLAY_TEST_KEY"), client,
                                 *http.identify(client, "auto"))
        engine.check(tokenizer)
    assert seen and all(h == "Bearer sk-test-0123456789" for h in seen)
    assert "sk-test-0123456789" not in repr(engine.settings())


def test_credentials_in_the_url_are_not_recorded():
    assert http.public_url("http://user:secret@host:8080/v1/") == "http://host:8080/v1"
    with pytest.raises(StageReplayError, match="not an http"):
        http.Client("ftp://host", "K", 1, 0)


@pytest.mark.parametrize("cross", [False, True])
def test_a_server_run_proves_our_step_only_when_our_engine_steps(tokenizer, tmp_path, monkeypatch, cross):
    """Without --cross our engine only tokenizes and scores, so nothing is proven before the items (on a 14B model
    the proof would be minutes of nothing); with --cross hf it continues the server's prefixes, and is proven."""
    from stagereplay.engine import lm as lm_module
    from stagereplay.engine import proof
    from stagereplay.execution import models

    models._LMS.clear()
    proof._PROVEN.clear()
    proofs = []
    real = lm_module.prove_steps
    monkeypatch.setattr(lm_module, "prove_steps", lambda *a, **k: proofs.append(1) or real(*a, **k))
    with fake_server(tokenizer) as (url, _):
        result = runner.invoke(app, ["matched", "--engine", "http", "--url", url, "--n", "2", "--boundary-after",
                                     "4", "--max-stage1-tokens", "4", "--max-new-tokens", "4", "--out",
                                     str(tmp_path / "run"), "--quiet", *(["--cross", "hf"] if cross else [])])
    assert result.exit_code == 0, result.output
    assert bool(proofs) == cross, proofs
