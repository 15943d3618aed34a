"""The check before a server audit's first item (`serving.http.HttpEngine.check`) and its faults, on a fake of
llama-server's API that misbehaves on purpose (tests/servers.py): each refusal in one line with its fix, each with
the well-behaved fake passing as its negative control. The real servers are tested in tests/test_server.py."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from fake_server import fake_server
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.model import load_config_and_tokenizer
from stagereplay.errors import StageReplayError
from stagereplay.serving import http
from stagereplay.serving.engines import engine_config
from stagereplay.toy import toy_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def tokenizer():
    return load_config_and_tokenizer(str(toy_checkpoint("primary")))[1]


def _check(url: str, tokenizer, **config) -> http.HttpEngine:
    engine = http.load(engine_config("http", dict(url=url, **config)), "", "fp32", 1, "cpu")
    engine.check(tokenizer)
    return engine


def test_a_well_behaved_server_passes_the_check_and_is_identified(tokenizer):
    with fake_server(tokenizer) as (url, fake):
        engine = _check(url, tokenizer)
    settings = engine.settings()
    assert settings["api"] == "llama-server" and settings["build"]["build"] == "fake-1"
    assert settings["checked"]["verbatim_ids"] and settings["checked"]["tokenizer"] == "compared"
    assert fake.requests == 4  # the probe, its replica, reused and bypassed


def test_the_servers_identity_is_what_it_said_in_the_order_the_manifest_writes(tokenizer):
    """The identity (`ServerIdentity`): each field of llama-server's dialect as the server said it (null where its
    endpoint did not say: the weight type), the speculative types read again once a request ran, in the manifest's
    order. The control: a value of another type than the field's is refused in one line, not converted."""
    with fake_server(tokenizer) as (url, _):
        engine = _check(url, tokenizer)
    said = [("server", "llama-server"), ("build", "fake-1"), ("model", "toy"), ("model_path", "toy.gguf"),
            ("total_slots", 1), ("n_ctx", 4096), ("model_ftype", None), ("speculative", False),
            ("speculative_types", "none")]
    assert list(engine.settings()["server"].items()) == said
    assert engine.settings()["build"] == {"server": "llama-server", "build": "fake-1", "model": "toy",
                                          "model_path": "toy.gguf"}
    with fake_server(tokenizer, slots="2") as (url, _), pytest.raises(StageReplayError) as refused:
        http.load(engine_config("http", {"url": url}), "", "fp32", 1, "cpu")
    assert "does not read (total_slots: " in str(refused.value) and "\n" not in str(refused.value)


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
        http.load(engine_config("http", dict(url=url, retries=0)), "", "fp32", 1, "cpu")
    with fake_server(tokenizer, "error") as (url, fake), pytest.raises(StageReplayError) as failed:
        _check(url, tokenizer, retries=1)
    assert "HTTP 500" in str(failed.value) and fake.requests == 2  # the request and its one retry


def test_a_stalled_server_is_given_up_on_at_the_timeout(tokenizer):
    with fake_server(tokenizer, "stall", stall=3.0) as (url, _):
        engine = http.load(engine_config("http", dict(url=url, timeout=0.5, retries=0)), "", "fp32", 1, "cpu")
        start = time.monotonic()
        with pytest.raises(StageReplayError, match="did not answer /completion"):
            engine.generate([1, 2, 3], 4)
        assert time.monotonic() - start < 2.5  # the timeout, not the stall
        # Negative control: with time enough, the same request is answered.
        slow = http.load(engine_config("http", dict(url=url, timeout=10, retries=0)), "", "fp32", 1, "cpu")
        assert len(slow.generate([1, 2, 3], 4).tokens) == 4


def test_the_api_key_is_sent_and_never_kept(tokenizer, monkeypatch):
    monkeypatch.setenv("STAGEREPLAY_TEST_KEY", "sk-test-0123456789")
    with fake_server(tokenizer) as (url, fake):
        client = http.Client(url, "STAGEREPLAY_TEST_KEY", 5, 0)
        engine = http.HttpEngine(engine_config("http", dict(url=url, api_key_env="STAGEREPLAY_TEST_KEY")), client,
                                 *http.identify(client, "auto"))
        engine.check(tokenizer)
    assert fake.authorization and all(h == "Bearer sk-test-0123456789" for h in fake.authorization)
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
    from stagereplay.engine import prover
    from stagereplay.engine.proof_stores import IN_PROCESS
    from stagereplay.execution import models

    models._LMS.clear()
    IN_PROCESS.clear()
    proofs = []
    real = prover.prove_steps
    monkeypatch.setattr(prover, "prove_steps", lambda *a, **k: proofs.append(1) or real(*a, **k))
    loaded = []
    full, bare = lm_module.load, lm_module.load_without_weights
    monkeypatch.setattr(lm_module, "load", lambda *a, **k: loaded.append("weights") or full(*a, **k))
    monkeypatch.setattr(lm_module, "load_without_weights", lambda *a: loaded.append("tokenizer") or bare(*a))
    with fake_server(tokenizer) as (url, _):
        result = runner.invoke(app, ["matched", "--engine", "http", "--url", url, "--n", "2", "--boundary-after",
                                     "4", "--max-stage1-tokens", "4", "--max-new-tokens", "4", "--out",
                                     str(tmp_path / "run"), "--quiet", *(["--cross", "hf"] if cross else [])])
        assert result.exit_code == 0, result.output
        assert bool(proofs) == cross, proofs
        # Our engine's model is loaded without its weights unless it steps, by the run and by its audit.
        assert loaded == ["weights" if cross else "tokenizer"], loaded
        models._LMS.clear()
        audited = runner.invoke(app, ["audit", str(tmp_path / "run"), "--quiet"])
        assert audited.exit_code == 0, audited.output
        assert loaded[1:] == ["weights" if cross else "tokenizer"], loaded


def test_a_model_without_its_weights_keeps_its_eos_and_context(tmp_path):
    """What a serving run reads from our engine is the same with and without the weights: EOS ids from the
    generation config (here two, where the tokenizer names one), the context, the tokenizer."""
    import shutil

    from stagereplay.engine.lm import load, load_without_weights
    from stagereplay.toy import toy_checkpoint

    folder = tmp_path / "toy"
    shutil.copytree(toy_checkpoint("primary"), folder)
    full = load(str(folder), "fp32")
    eos = sorted({*full.eos, 5})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    full = load(str(folder), "fp32")
    bare = load_without_weights(full.config)
    assert bare.model is None and sorted(full.eos) == sorted(bare.eos) == eos
    assert bare.context == full.context and bare.n_layers == full.n_layers
    assert bare.tokenizer.encode("12+7") == full.tokenizer.encode("12+7")
    # Negative control: the tokenizer's own EOS is not the generation config's.
    assert {full.tokenizer.eos_token_id} != set(eos)


@pytest.mark.parametrize("restart", [True, False])
def test_a_resumed_run_says_whether_the_server_restarted(tokenizer, tmp_path, restart):
    """A server that fails mid-run keeps the items before it; the same command resumes, and the records it adds
    say whether the server restarted since the last record (its caches then cold): surely, where its task counter
    is below where the first process left it; the negative control resumes on the same server, whose counter
    went on, and cannot be called restarted."""
    out = tmp_path / "run"

    def matched(url: str) -> Any:
        return runner.invoke(app, ["matched", "--engine", "http", "--url", url, "--n", "4", "--boundary-after", "4",
                                   "--max-stage1-tokens", "4", "--max-new-tokens", "4", "--retries", "0", "--out",
                                   str(out)])

    with fake_server(tokenizer) as (url, fake):
        fake.fail_after = 4 + 2 * 6  # the check's probes and two items
        died = matched(url)
        assert died.exit_code != 0 and "item toy-" in died.output, died.output
        fake.fail_after = None
        if not restart:
            resumed = matched(url)
    if restart:
        with fake_server(tokenizer, port=int(url.rsplit(":", 1)[1])) as (again, _):
            resumed = matched(again)
    assert resumed.exit_code == 0, resumed.output
    assert ("restarted since item" in resumed.output) == restart, resumed.output
    lines = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in lines].count("item") == 4
    notes = [r["payload"]["engine"].get("resumed") for r in lines if r["kind"] == "environment"]
    assert notes[0] is None and notes[-1]["after"] == lines[[r["kind"] for r in lines].index("item") + 1]["item_id"]
    assert notes[-1]["restarted"] is (True if restart else None), notes[-1]


def test_the_audit_follows_a_moved_server_with_url(tokenizer, tmp_path):
    """A run audited where its server moved: `--url` names where it is now, the records are re-executed there and
    the move is noted; the negative control, without --url, finds no server at the recorded address."""
    out = tmp_path / "run"
    with fake_server(tokenizer) as (url, _):
        made = runner.invoke(app, ["matched", "--engine", "http", "--url", url, "--n", "2", "--boundary-after", "4",
                                   "--max-stage1-tokens", "4", "--max-new-tokens", "4", "--out", str(out), "--quiet"])
        assert made.exit_code == 0, made.output
    with fake_server(tokenizer) as (moved, _):
        lost = runner.invoke(app, ["audit", str(out), "--quiet"])
        assert lost.exit_code != 0 and f"the server at {url} did not answer" in lost.output, lost.output
        found = runner.invoke(app, ["audit", str(out), "--quiet", "--url", moved])
    assert found.exit_code == 0, found.output
    assert f"matched/primary server found at {moved}" in found.output, found.output
    assert "trajectories reproduced" in found.output


def test_url_is_refused_for_a_run_of_another_engine(tmp_path):
    out = tmp_path / "run"
    made = runner.invoke(app, ["matched", "--n", "1", "--max-new-tokens", "4", "--out", str(out), "--quiet"])
    assert made.exit_code == 0, made.output
    refused = runner.invoke(app, ["audit", str(out), "--url", "http://127.0.0.1:1"])
    assert refused.exit_code != 0 and "no stage of this run ran on one" in refused.output, refused.output


# -- what the server does not report: --server-args -----------------------------------------------------------------


def _run_with(url: str, out, *extra: str):
    return runner.invoke(app, ["matched", "--engine", "http", "--url", url, "--n", "2", "--boundary-after", "4",
                               "--max-stage1-tokens", "4", "--max-new-tokens", "4", "--out", str(out), "--quiet",
                               *extra])


def test_server_args_are_recorded_verbatim_and_compare_names_two_that_differ(tokenizer, tmp_path):
    """Two runs of one server that differ only in the flags declared for it: each manifest records its flags as
    given, and `compare` lists the difference (as a setting and in the server's settings). The control: two runs
    declaring the same flags, where `compare` lists no setting of the server."""
    from stagereplay.runs.compare import compare

    flags = {"a": "-ctk f16 -ctv f16", "b": "-ctk q8_0 -ctv q8_0 -fa on", "c": "-ctk f16 -ctv f16"}
    with fake_server(tokenizer) as (url, _):
        for name, args in flags.items():
            made = _run_with(url, tmp_path / name, "--server-args", args)
            assert made.exit_code == 0, made.output
    for name, args in flags.items():
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["stages"]["matched/primary"]["engine"]["server_args"] == args
        assert manifest["environment"]["engine"]["server_args"] == args
    differ = compare(tmp_path / "a", tmp_path / "b", tmp_path / "ab").document.differences
    fields = {d.field: (d.a, d.b) for group in ("settings", "server") for d in differ.group(group)}
    assert fields["config.engine.server_args"] == (flags["a"], flags["b"])
    assert fields["environment.engine.server_args"] == (flags["a"], flags["b"])
    same = compare(tmp_path / "a", tmp_path / "c", tmp_path / "ac").document.differences
    assert not [d for group in ("settings", "server") for d in same.group(group) if "server_args" in d.field], same


@pytest.mark.parametrize("args", ["--api-key sk-secret-123 -ctk q8_0", "-fa on --api-key=sk-secret-123",
                                  "--api-key-file /run/key", "-hft hf_secret"])
def test_server_args_holding_a_secret_are_refused_in_one_line_before_anything_runs(tokenizer, tmp_path, args):
    out = tmp_path / "run"
    with fake_server(tokenizer) as (url, fake):
        refused = _run_with(url, out, "--server-args", args)
        assert refused.exit_code == 2, refused.output
        (line,) = refused.stderr.strip().splitlines()
        assert line.startswith("error: --server-args holds ") and "never recorded" in line
        assert "secret-123" not in refused.output and fake.requests == 0 and not out.exists()
        # Negative control: the same flags without the secret run.
        kept = " ".join(w for w in args.split() if "secret" not in w and "key" not in w and w != "-hft")
        assert _run_with(url, tmp_path / "kept", "--server-args", kept).exit_code == 0


def test_server_args_are_the_http_engines_and_vllms_knobs_are_vllms(tmp_path):
    """A server's settings are declared (--server-args), vLLM's in-process knobs are its options: each refused under
    the other engine in one line that names what that engine takes."""
    out = str(tmp_path / "r")
    refused = runner.invoke(app, ["matched", "--engine", "vllm", "--n", "1", "--server-args", "-ub 16", "--out", out])
    assert refused.exit_code == 2 and "--server-args is not an option of --engine vllm" in refused.output
    assert "--kv-cache-dtype" in refused.output  # what vllm takes instead
    refused = runner.invoke(app, ["matched", "--engine", "http", "--url", "http://127.0.0.1:1", "--n", "1",
                                  "--kv-cache-dtype", "fp8", "--out", out])
    assert refused.exit_code == 2 and "--kv-cache-dtype is not an option of --engine http" in refused.output
    assert "--server-args" in refused.output
    assert not (tmp_path / "r").exists()


# The two shapes of an OpenAI-style `choices[0].logprobs`: vLLM's (`token_id:N` strings, each step's top as a JSON
# object, the emitted token first though another ranks above it) and llama-server's chat shape (ids). The second
# step has no logprob of its own (as an echoed first token has none).
_VLLM_STEPS = {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.9, None],
               "top_logprobs": [{"token_id:7": -0.9, "token_id:9": -0.5, "token_id:5": -0.5}, {"token_id:8": -0.1}]}
_CHAT_STEPS = {"content": [
    {"id": 7, "logprob": -0.9, "top_logprobs": [{"id": 7, "logprob": -0.9}, {"id": 9, "logprob": -0.5},
                                                {"id": 5, "logprob": -0.5}]},
    {"id": 8, "logprob": None, "top_logprobs": [{"id": 8, "logprob": -0.1}]}]}
_BEST_FIRST = [((5, -0.5), (9, -0.5), (7, -0.9)), ((8, -0.1),)]


@pytest.mark.parametrize("steps", [_VLLM_STEPS, _CHAT_STEPS], ids=["vllm", "chat"])
def test_openai_steps_read_either_shape_with_each_steps_top_best_first(steps):
    from stagereplay.serving.replies import OpenAILogprobs, Where, openai_steps

    read = openai_steps(OpenAILogprobs.model_validate(steps), Where("http://canned", "/v1/completions"))
    assert read.tokens == (7, 8) and list(read.top or ()) == _BEST_FIRST
    assert read.chosen == (-0.9, None)
    # Negative control: the server's own order is not best first, so the order above is the parser's.
    assert [int(t.split(":")[1]) for t in _VLLM_STEPS["top_logprobs"][0]] != [5, 9, 7]
    assert [t["id"] for t in _CHAT_STEPS["content"][0]["top_logprobs"]] != [5, 9, 7]


class _Canned:
    """A client whose every request gets one reply, as a `vllm serve` gives it."""

    url = "http://canned"

    def __init__(self, reply: dict[str, Any]):
        self.reply = reply

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert path == "/v1/completions"
        return self.reply


def test_a_greedy_request_and_a_rollout_read_the_same_steps():
    """The greedy request's top-k (`Generation.top`, best first) and a rollout's own logprobs come from the one
    reader of the OpenAI shape (`serving.replies`)."""
    from stagereplay.serving.replies import OpenAILogprobs, Where, openai_steps
    from stagereplay.serving.seam import Sampling
    from stagereplay.serving.server_identity import ServerIdentity

    steps = {**_VLLM_STEPS, "token_logprobs": [-0.9, -0.1]}  # a rollout's every token has its log-probability
    reply = {"choices": [{"logprobs": steps, "finish_reason": "length"}], "usage": {"prompt_tokens": 3}}
    engine = http.HttpEngine(engine_config("http", {"url": "http://canned"}), _Canned(reply), "openai",
                             ServerIdentity(server="vllm", model="toy"))
    greedy = engine.generate([1, 2, 3], 2)
    read = openai_steps(OpenAILogprobs.model_validate(steps), Where("http://canned", "/v1/completions"))
    assert greedy.tokens == read.tokens and list(greedy.top) == _BEST_FIRST
    drawn = engine.sample([1, 2, 3], 2, Sampling(temperature=1.0, seed=1))
    assert drawn.tokens == greedy.tokens and [s[0] for s in drawn.top] == [(5, -0.5), (8, -0.1)]
    assert drawn.chosen == (-0.9, -0.1)
