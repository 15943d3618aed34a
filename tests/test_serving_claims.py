"""What a serving engine's run claims, held to what the engine did (on a fake of llama-server's API, tests/servers.py;
the real server in tests/test_server.py): live's request asks for what the run uses, an arm the server did not build
as named is counted apart, and a server that refuses our request is told apart from one that does not answer."""

from __future__ import annotations

import json

import pytest
from servers import fake_server, free_port
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.boundary import After, Marker
from stagereplay.engine.model import load_config_and_tokenizer
from stagereplay.errors import StageReplayError
from stagereplay.records.payloads import Arm, Load
from stagereplay.serving import live as live_module
from stagereplay.serving.evidence import took_place
from stagereplay.serving.live import FIRST_STAGE1, request_live, stage1_sizes
from stagereplay.serving.seam import Generation
from stagereplay.toy import toy_checkpoint

runner = CliRunner()
MARKER = 262  # the toy tokenizer's `</think>`


@pytest.fixture(scope="module")
def tokenizer():
    return load_config_and_tokenizer(str(toy_checkpoint("primary")))[1]


def _records(run):
    return [json.loads(line)["payload"] for line in (run / "ledger.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "item"]


def _matched(url, out, *extra):
    return runner.invoke(app, ["matched", "--engine", "http", "--url", url, "--n", "2", "--precision", "fp32",
                               "--max-new-tokens", "8", "--out", str(out), "--quiet", *extra])


# -- live's request is sized by the boundary rule ------------------------------------------------------------------


def test_a_count_boundary_asks_for_its_count_a_marker_grows_from_a_first_allowance():
    assert stage1_sizes(After(32), 8192) == [32]
    assert stage1_sizes(After(32), 20) == [20]  # never past the budget
    assert stage1_sizes(Marker("</think>"), 8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert stage1_sizes(Marker("</think>"), 700) == [256, 512, 700]
    assert stage1_sizes(Marker("</think>"), 100) == [100]


class _Rule:
    """A bound rule whose watch accepts token 9."""

    def watch(self):
        class W:
            def step(self, token):
                return token == 9

            def detail(self):
                return None
        return W()


def _send(tokens, asked):
    def send(max_tokens, saver):
        asked.append(max_tokens)
        out = tuple(tokens[:max_tokens])
        return Generation(out, tuple(() for _ in out), 0, "length"), None
    return send


def test_live_grows_only_while_the_output_runs_on_past_its_allowance():
    asked: list[int] = []
    past_first = [1] * 300 + [9] + [1] * 50  # the boundary at step 300: past the first allowance
    live = request_live(_send(past_first, asked), _Rule(), {2}, 8192, 8, saves=False)
    assert live.end == 300 and asked == [FIRST_STAGE1 + 8, 2 * FIRST_STAGE1 + 8] and live.tries == 2
    assert live.request == {"max_tokens": 2 * FIRST_STAGE1 + 8, "tries": 2}
    asked.clear()  # control: an EOS before the boundary ends the search at once (no boundary, no growth)
    stops = [1] * 10 + [2] + [1] * 500
    assert request_live(_send(stops, asked), _Rule(), {2}, 8192, 8, saves=False).end is None and len(asked) == 1
    asked.clear()  # a replica asks for the size live found
    again = request_live(_send(past_first, asked), _Rule(), {2}, 8192, 8, saves=False, sizes=[512])
    assert again.end == 300 and asked == [520]


def test_a_servers_live_request_asks_for_stage_one_and_the_suffix_not_the_budget(tokenizer, tmp_path, monkeypatch):
    """The stage-1 budget defaults to what the context leaves after the prompt and the suffix (hundreds of tokens
    for the toy, thousands for a real model): sized to it, live's request would ask for all of it where 4 + 8
    are all the run uses."""
    with fake_server(tokenizer) as (url, fake):
        assert _matched(url, tmp_path / "count", "--boundary-after", "4").exit_code == 0
    lives = [n for prompt, n in fake.asked if prompt < 100 and n > 8]  # the requests from the prompt alone
    assert lives and set(lives) == {4 + 8}, fake.asked
    record = _records(tmp_path / "count")[0]
    assert {a["name"]: a["request"]["max_tokens"] for a in record["arms"] if "request" in a} == {
        "live": 12, "live#replica": 12}
    # Control: with live sized to the stage-1 budget (as before), the same measurement sees the budget.
    monkeypatch.setattr(live_module, "stage1_sizes", lambda rule, budget: [budget])
    with fake_server(tokenizer) as (url, fake):
        assert _matched(url, tmp_path / "budget", "--boundary-after", "4").exit_code == 0
    budget = json.loads((tmp_path / "budget" / "manifest.json").read_text())["config"]["stage1"]["budget"]
    assert budget > 400 and max(n for _, n in fake.asked) == budget + 8


def test_a_marker_boundary_grows_live_until_the_marker_is_reached(tokenizer, tmp_path):
    from transformers import GenerationConfig

    from stagereplay.engine.decode import eos_ids

    eos = tuple(eos_ids(GenerationConfig.from_pretrained(toy_checkpoint("primary")), tokenizer))
    with fake_server(tokenizer, marker=(300, MARKER), avoid=eos) as (url, fake):
        result = _matched(url, tmp_path / "run", "--boundary-marker", "</think>")
        assert result.exit_code == 0, result.output
    record = _records(tmp_path / "run")[0]
    assert record["status"] == "ok" and record["boundary"] - len(record["prompt_ids"]) == 301
    budget = json.loads((tmp_path / "run" / "manifest.json").read_text())["config"]["stage1"]["budget"]
    assert FIRST_STAGE1 < 300 < budget < 2 * FIRST_STAGE1  # the toy's context caps the second allowance
    live = next(a for a in record["arms"] if a["name"] == "live")
    assert live["request"] == {"max_tokens": budget + 8, "tries": 2}
    assert max(n for _, n in fake.asked) == budget + 8


def test_the_stage_one_budget_fits_the_servers_context_and_a_given_one_that_does_not_is_refused(tokenizer, tmp_path):
    with fake_server(tokenizer, n_ctx=128) as (url, _):
        refused = _matched(url, tmp_path / "big", "--boundary-after", "4", "--max-stage1-tokens", "200")
        assert refused.exit_code != 0 and "exceed the server's per-slot context of 128" in refused.output
        assert not (tmp_path / "big").exists()
        assert _matched(url, tmp_path / "fits", "--boundary-after", "4").exit_code == 0
    manifest = json.loads((tmp_path / "fits" / "manifest.json").read_text())
    stage1 = manifest["config"]["stage1"]
    assert stage1["context"] == 128 and stage1["budget"] == 128 - stage1["longest_prompt"] - 8


# -- an arm the server did not build as named ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["", "no-reuse"])
def test_a_restore_the_server_did_not_use_is_reported_as_not_restored(tokenizer, tmp_path, mode):
    """A server that reports no cached position after a slot restore prefilled afresh: the arm says so, the matched
    table counts it apart, and the column's statistics leave it out. The control: a server that continued from the
    restored slot (every position but the pending token cached) restored."""
    run = tmp_path / "run"
    with fake_server(tokenizer, mode, slots=2) as (url, _):
        result = _matched(url, run, "--boundary-after", "4", "--slot-restore")
        assert result.exit_code == 0, result.output
    arms = {a["name"]: a for a in _records(run)[0]["arms"]}
    restored = mode == ""
    assert arms["slot-restore"]["took_place"] is restored
    assert arms["prefix-cache"]["took_place"] is restored and arms["oneshot"]["took_place"] is True
    results = json.loads((run / "results.json").read_text())
    column = next(m for m in results["matched"] if m["construction"] == "slot-restore")
    assert column["built"]["k"] == (2 if restored else 0) and column["built"]["not_built"] == (0 if restored else 2)
    assert column["suffix_disagreements"]["n"] == (2 if restored else 0)
    report = (run / "report.md").read_text()
    assert ("slot-restore @ the server's own types (it does not say which) was not built as named on 2 of 2 items"
            in report) is not restored


def test_took_place_reads_the_engines_counts():
    def arm(construction, cached, in_flight=None):
        load = None if in_flight is None else Load(concurrency=1, in_flight_at_send=in_flight, returned_meanwhile=0)
        return Arm(name=construction, construction=construction, precision="fp32", suffix_ids=[], suffix_fp="",
                   cache_fp=None, stop="length", text="", correct=False, num_cached_tokens=cached, load=load)

    assert took_place(arm("slot-restore", 20), prompt_len=10, boundary=21) is True
    assert took_place(arm("slot-restore", 0), 10, 21) is False
    assert took_place(arm("slot-restore", 10), 10, 21) is False  # the prompt alone: not the restored state
    assert took_place(arm("prefix-cache", 12), 10, 21) is True
    assert took_place(arm("prefix-cache", 10), 10, 21) is False
    assert took_place(arm("oneshot", 0), 10, 21) is True and took_place(arm("oneshot", 5), 10, 21) is False
    assert took_place(arm("oneshot", None), 10, 21) is None  # an engine that does not say
    assert took_place(arm("oneshot", 0, in_flight=0), 10, 21) is False
    assert took_place(arm("oneshot", 0, in_flight=3), 10, 21) is True


# -- a server that refuses our request ------------------------------------------------------------------------------


def test_a_server_refusing_token_id_prompts_is_named_as_refusing_not_as_silent(tokenizer, tmp_path):
    with fake_server(tokenizer, "refuse-ids") as (url, _):
        refused = _matched(url, tmp_path / "run", "--boundary-after", "4")
    assert refused.exit_code != 0 and "refused our request to /completion (HTTP 422" in refused.output
    assert "cannot be audited" in refused.output and "llama-server" in refused.output
    assert "did not answer" not in refused.output
    # Control: nothing listening at the address still "did not answer".
    gone = _matched(f"http://127.0.0.1:{free_port()}", tmp_path / "gone", "--boundary-after", "4", "--retries", "0")
    assert gone.exit_code != 0 and "did not answer" in gone.output and "refused our request" not in gone.output


def test_a_refusal_names_what_was_refused_in_one_line(tokenizer):
    from stagereplay.serving import http
    from stagereplay.serving.engines import engine_config

    with fake_server(tokenizer, "refuse-ids") as (url, _), pytest.raises(StageReplayError) as refused:
        http.load(engine_config("http", dict(url=url)), "", "fp32", 1, "cpu").check(tokenizer)
    assert "\n" not in str(refused.value) and "HTTP 422" in refused.value.problem
    assert "transformers serve" in refused.value.fix


# -- what the server's speculation did -----------------------------------------------------------------------------


@pytest.mark.parametrize("draft", [(6, 2), None])
def test_a_speculating_servers_drafts_are_recorded_on_each_served_arm(tokenizer, tmp_path, draft):
    """A server whose replies count drafted and accepted tokens (llama-server's `timings.draft_n`,
    `draft_n_accepted`): each served arm records its request's counts, and the server's identity says it
    speculates and with which types. The control, a server that does not speculate: no arm has a draft, and the
    identity says it does not."""
    run = tmp_path / "run"
    with fake_server(tokenizer, draft=draft) as (url, _):
        result = _matched(url, run, "--boundary-after", "4", "--concurrency", "1")
        assert result.exit_code == 0, result.output
    for record in _records(run):
        for arm in record["arms"]:
            if draft is None:
                assert "draft" not in arm, arm["name"]
            else:  # the fake drafts `draft` per 8 generated tokens: live's request generates 4 + 8, the others 8
                n = 12 if arm["name"].startswith("live") else 8
                assert arm["draft"] == {"drafted": draft[0] * n // 8, "accepted": draft[1] * n // 8}, arm["name"]
    server = json.loads((run / "manifest.json").read_text())["environment"]["engine"]["server"]
    assert server["speculative"] is (draft is not None)
    assert server["speculative_types"] == ("none,ngram-simple" if draft else "none")


def test_a_speculating_server_that_drafted_nothing_records_zero_and_one_that_does_not_speculate_none():
    from stagereplay.serving.seam import Draft
    from stagereplay.serving.server_identity import llama_server_draft

    assert llama_server_draft({"cache_n": 0, "draft_n": 10, "draft_n_accepted": 3}, True) == Draft(10, 3)
    assert llama_server_draft({"cache_n": 0}, True) == Draft(0, 0)  # llama-server leaves out a zero count
    assert llama_server_draft({"cache_n": 0}, False) is None


METRICS = """# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="toy"} 7.0
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="toy"} 1.79e+09
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="toy"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="toy",position="0"} 2.0
vllm:cache_config_info{block_size="32",cache_dtype="fp8",enable_prefix_caching="True",num_gpu_blocks="10922"} 1.0
process_start_time_seconds 1.79e+09
"""


def test_vllms_metrics_say_its_cache_configuration_and_its_speculation():
    """vllm serve's /metrics: the cache configuration's labels that say how the cache is built (not the memory it
    was given), and its speculation counters, whose change over a request sent alone is that request's drafts. The
    control: a server without speculation counters is not called speculative, and reads zero."""
    from stagereplay.serving.seam import Draft
    from stagereplay.serving.server_identity import SpecCounters, metrics_identity

    identity = metrics_identity(METRICS)
    assert identity.as_json() == {"speculative": True, "cache_config": {"cache_dtype": "fp8", "block_size": "32",
                                                                        "enable_prefix_caching": "True"}}
    assert list(identity.as_json()) == ["speculative", "cache_config"]  # the manifest's order, as the server says

    class Metrics:
        def __init__(self, text):
            self.body = text

        def text(self, path):
            return self.body

    before = SpecCounters.read(Metrics(METRICS))
    after = SpecCounters.read(Metrics(METRICS.replace("} 7.0", "} 19.0").replace("model_name=\"toy\"} 2.0",
                                                                                  "model_name=\"toy\"} 5.0")))
    assert (before.drafted, before.accepted) == (7.0, 2.0)  # per-position counters and `_created` not summed in
    assert after.since(before) == Draft(12, 3)
    plain = "\n".join(line for line in METRICS.splitlines() if "spec_decode" not in line)
    assert "speculative" not in metrics_identity(plain).as_json()
    assert SpecCounters.read(Metrics(plain)) == SpecCounters(0.0, 0.0)


# -- what a served arm ran at -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ftype", ["Q4_K_M", None])
def test_a_servers_arms_are_labelled_with_what_the_server_runs_and_ours_with_our_precision(tokenizer, tmp_path, ftype):
    """A server computes in its own types: its arms are labelled with the type its /props say (or that it does not
    say), never with our --precision, which labels only the arm our engine builds (--cross hf)."""
    run = tmp_path / "run"
    with fake_server(tokenizer, ftype=ftype) as (url, _):
        result = _matched(url, run, "--boundary-after", "4", "--cross", "hf")
        assert result.exit_code == 0, result.output
    said = f"the server's {ftype}" if ftype else "the server's own types (it does not say which)"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["matched/primary"]["runs_at"] == said
    sections = {m["construction"]: m for m in json.loads((run / "results.json").read_text())["matched"]}
    assert sections["oneshot"]["precision"] == sections["prefix-cache"]["precision"] == said
    assert sections["hf-oneshot"]["precision"] == "fp32"
    report = (run / "report.md").read_text()
    assert f"live vs oneshot @ {said}" in report and f"Is replay faithful in {said}?" in report
    assert "live vs oneshot @ fp32" not in report and "live vs hf-oneshot @ fp32" in report
    item = next(json.loads(line)["item_id"] for line in (run / "ledger.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "item")
    shown = runner.invoke(app, ["show", str(run), item], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and f"live vs oneshot @ {said}" in shown.output, shown.output
