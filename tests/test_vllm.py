"""vLLM as a second engine, on the embedded toy: the prefix cache's mechanics, exact replicas, our engine continuing
vLLM's prefixes, the audit re-executing in vLLM, and the refusals; and vLLM as mismatch's RL rollout engine (its own
sampled rollouts, its prefill of them, our engine as the trainer), in process, over `vllm serve`, and as the rollout
file bench/vllm_rollouts.py writes. Needs vLLM (its own venv, docs/how-to/vllm.md):
`python -m pytest -m vllm tests/test_vllm.py`; the main suite deselects these tests.

What holds only for these numerics (no within-vLLM divergence on this CPU) is reported by the runs, not
asserted here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mismatch_runs import audit_finds_a_forged_logprob, by_part, logprob_bits, one_set_of_tokens
from typer.testing import CliRunner

from stagereplay.cli import app

pytestmark = pytest.mark.vllm
runner = CliRunner()
N = 4
MAX_NEW = 48


def _matched(out: Path, *extra: str) -> dict:
    result = runner.invoke(app, ["matched", "--engine", "vllm", "--n", str(N), "--max-new-tokens", str(MAX_NEW),
                                 "--out", str(out), "--quiet", *extra])
    assert result.exit_code == 0, result.output
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vllm") / "fp32"
    _matched(out, "--cross", "hf", "--precision", "fp32")
    return out


def _records(run: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    return [r["payload"] for r in lines if r["kind"] == "item" and r["payload"]["status"] == "ok"]


def _arms(payload: dict) -> dict[str, dict]:
    return {a["name"]: a for a in payload["arms"]}


def _engine(precision: str = "bf16"):
    from stagereplay.engine.lm import load
    from stagereplay.serving.arms import cached_engine
    from stagereplay.serving.engines import engine_config
    from stagereplay.toy import toy_checkpoint

    lm = load(str(toy_checkpoint("primary")), precision)
    return lm, cached_engine(engine_config("vllm"), lm)


def test_prefix_cache_reuses_blocks_written_while_decoding_and_none_after_a_reset():
    """A request for prompt + generated tokens right after the generation takes whole blocks from the cache,
    blocks past the prompt (written by decode steps) included; after reset_prefix_cache() it takes none."""
    from stagereplay.tasks import DataConfig, load_items

    lm, engine = _engine()
    item = load_items(DataConfig(n=1), lm.tokenizer)[0][0]
    prompt = list(item.prompt_ids)
    live = engine.generate(prompt, 100)
    assert live.cached == 0  # generate() resets first
    prefix = [*prompt, *live.tokens[:80]]
    hit = engine.generate(prefix, 8, reuse=True)
    block = engine.settings()["block_size"]
    assert hit.cached > len(prompt) and hit.cached % block == 0, (hit.cached, len(prompt))
    assert hit.cached <= len(prefix) - 1  # at least the last token is computed
    # Negative control: the same request after a reset finds nothing cached.
    assert engine.generate(prefix, 8, reuse=False).cached == 0
    # Top-k logprobs per step, best first, the greedy pick first.
    assert len(live.top) == len(live.tokens)
    assert all(step[0][0] == t and [lp for _, lp in step] == sorted((lp for _, lp in step), reverse=True)
               for step, t in zip(live.top, live.tokens, strict=True))


def test_the_arms_record_the_cache_hits_and_the_engine(fp32_run):
    manifest = json.loads((fp32_run / "manifest.json").read_text())
    engine = manifest["environment"]["engine"]
    assert engine["engine"] == "vllm" and engine["version"] and engine["block_size"] == 32
    assert engine["dtype"] == "float32" and engine["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert manifest["stages"]["matched/primary"]["arms"] == ["oneshot", "prefix-cache", "hf-oneshot"]
    records = _records(fp32_run)
    assert records
    for p in records:
        arms = _arms(p)
        assert arms["prefix-cache"]["cached_from_decode"] > 0  # the toy's stage 1 spans whole blocks
        assert arms["prefix-cache"]["num_cached_tokens"] == len(p["prompt_ids"]) + arms["prefix-cache"][
            "cached_from_decode"]
        assert arms["oneshot"]["num_cached_tokens"] == 0 and arms["live"]["num_cached_tokens"] == 0
        assert arms["live"]["cache_fp"] is None and arms["hf-oneshot"]["cache_fp"]
        for a in p["arms"]:
            assert len(a["top_logprobs"]) == len(a["suffix_ids"])
            assert [s[0][0] for s in a["top_logprobs"]] == a["suffix_ids"]


def test_replicas_are_exact_and_the_table_counts_a_broken_one(fp32_run):
    """Every arm's replica gives the same tokens; the matched table counts them (and counts a forged miss)."""
    from stagereplay.experiments.protocol.matched_summary import summarize_matched
    from stagereplay.records.ledger import read_ledger

    results = json.loads((fp32_run / "results.json").read_text())
    columns = {m["construction"]: m for m in results["matched"]}
    assert set(columns) == {"oneshot", "prefix-cache", "hf-oneshot"}
    for name, m in columns.items():
        n = m["n_boundary"]
        assert n == N and m["engine"] == "vllm"
        assert m["replica_exact"] == {"live": {"k": n, "n": n}, name: {"k": n, "n": n}}
    # Negative control: one replica arm with another token is counted as not exact.
    records = [r for r in read_ledger(fp32_run) if r.kind == "item"]
    payload = json.loads(json.dumps(records[0].payload))
    for c in payload["comparisons"]:
        if c["b"] == "prefix-cache#replica":
            c["suffix_equal"] = False
    forged = [records[0].model_copy(update={"payload": payload}), *records[1:]]
    m = summarize_matched(forged, "prefix-cache", "primary", "fp32")
    assert m.replica_exact["prefix-cache"].k == N - 1


def test_fp32_our_engine_continues_vllms_prefix_as_vllm_did(fp32_run):
    """hf-oneshot (transformers prefills vLLM's prefix and continues) equals vLLM's live suffix in fp32."""
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.lm import load
    from stagereplay.experiments.protocol.matched_stage import fixed_state
    from stagereplay.tasks.base import Item
    from stagereplay.toy import toy_checkpoint

    records = _records(fp32_run)
    for p in records:
        arms = _arms(p)
        assert arms["hf-oneshot"]["suffix_ids"] == arms["live"]["suffix_ids"]
    # Negative control: the same comparison tells a continuation of another prefix (stage 1 one token short) apart.
    lm = load(str(toy_checkpoint("primary")), "fp32")
    p = records[0]
    item = Item("x", tuple(p["prompt_ids"]), p["answer"])
    settings_ = json.loads((fp32_run / "manifest.json").read_text())["config"]["settings"]
    from stagereplay.experiments.core.jobs import ReplaySettings

    s = ReplaySettings(settings_["boundary"], DecodeConfig(**settings_["decode"]), settings_["scorer"])
    short = lm.continue_from(lm.construct(fixed_state(item, p["prefix_ids"][:-1], s, lm), "oneshot"), s.decode)
    assert list(short.suffix) != _arms(p)["live"]["suffix_ids"]


def test_audit_reexecutes_in_vllm_and_catches_a_forged_arm(fp32_run, tmp_path):
    import shutil

    import forge

    result = runner.invoke(app, ["audit", str(fp32_run), "--quiet"])
    assert result.exit_code == 0, result.output
    audit = json.loads((fp32_run / "audit.json").read_text())
    assert audit["reproduced"] and audit["trajectories"]["k"] == audit["trajectories"]["n"] > 0
    # A forger edits the prefix-cache arm's last token and recomputes every checksum: only re-execution tells.
    run = tmp_path / "forged"
    shutil.copytree(fp32_run, run)
    (run / "audit.json").unlink()
    chain, manifest = forge.load(run)
    i = next(k for k, r in enumerate(chain) if r.kind == "item" and r.payload["status"] == "ok")
    payload = forge.edit(chain[i])
    arm = _arms(payload)["prefix-cache"]
    arm["suffix_ids"][-1] = (arm["suffix_ids"][-1] + 1) % 256
    arm["top_logprobs"][-1][0][0] = arm["suffix_ids"][-1]
    chain[i] = forge.with_payload(chain[i], payload)
    forge.save(run, chain, manifest)
    verify = runner.invoke(app, ["audit", str(run), "--verify-only"])
    assert verify.exit_code == 0, verify.output  # consistent forgery: the model-free checks cannot tell
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 1
    found = json.loads((run / "audit.json").read_text())["mismatches"]
    assert any("arm prefix-cache" in m["what"] for m in found), found


@pytest.mark.parametrize("command", ["bridge", "transplant", "resample"])
def test_experiments_that_need_the_cache_are_refused_on_a_vllm_run(fp32_run, command):
    result = runner.invoke(app, [command, str(fp32_run), "--quiet"])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "vllm engine does not expose" in line and "; " in line


@pytest.mark.parametrize(("extra", "says"), [
    (["--sample"], "runs greedy"),
    (["--construction", "incremental"], "--construction incremental is our engine's"),
    (["--workers", "2"], "runs in this process"),
    (["--precision", "fp32-compute"], "does not run precision fp32-compute"),
    (["--cross", "llama"], "unknown --cross"),
])
def test_what_a_vllm_run_cannot_do_is_refused_before_anything_runs(tmp_path, extra, says):
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--engine", "vllm", "--n", "1", "--out", str(out), *extra])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert says in line and line.startswith("error: ")
    assert not out.exists()


def test_precision_2x2_crosses_the_arms_with_precision_and_audits(fp32_run, tmp_path):
    """On the run's prefixes at its own precision: the fresh request reproduces the matched oneshot arm, live
    at that precision rewrites the stage-1 blocks the prefix-cache arm reuses, and the audit re-executes it all."""
    import shutil

    run = tmp_path / "grid"
    shutil.copytree(fp32_run, run)
    result = runner.invoke(app, ["precision-2x2", str(run), "--precisions", "fp32", "--quiet"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    grid = [r["payload"] for r in lines if r["kind"] == "item" and r["experiment"] == "precision_2x2"]
    matched = {tuple(p["prefix_ids"]): _arms(p) for p in _records(fp32_run)}
    assert len(grid) == len(matched)
    for p in grid:
        arms = _arms(p)
        assert set(arms) == {"oneshot@fp32", "prefix-cache@fp32", "hf-oneshot@fp32"}
        assert arms["oneshot@fp32"]["suffix_ids"] == matched[tuple(p["prefix_ids"])]["oneshot"]["suffix_ids"]
        assert arms["prefix-cache@fp32"]["live_prefix_equal"] and arms["prefix-cache@fp32"]["cached_from_decode"] > 0
    results = json.loads((run / "results.json").read_text())["precision_2x2"]
    assert results["constructions"] == ["oneshot", "prefix-cache", "hf-oneshot"]
    assert [(x["a"], x["b"]) for x in results["disagreements"][0]["pairs"]] == [
        ("oneshot@fp32", "hf-oneshot@fp32"), ("prefix-cache@fp32", "hf-oneshot@fp32")]
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 0, result.output
    # Negative control: a construction that is not an arm of the run is refused.
    result = runner.invoke(app, ["precision-2x2", str(run), "--constructions", "incremental", "--quiet"])
    assert result.exit_code == 2 and "is not an arm of this vllm run" in result.stderr


def test_vllm_serve_audited_over_http_reuses_live_blocks_and_reproduces(tmp_path):
    """`vllm serve` (its OpenAI server) on the toy, audited as a deployment is (`--engine http`): the dialect is
    found, each bypassing request gets a fresh cache salt and the prefix-cache request live's, so it hits the
    blocks live wrote (decode-written ones included) and no others; replicas are exact; the audit reproduces."""
    from servers import start_vllm_server

    from stagereplay.toy import toy_checkpoint

    server = start_vllm_server(toy_checkpoint("primary"), tmp_path / "log.txt")
    out = tmp_path / "run"
    try:
        result = runner.invoke(app, ["matched", "--engine", "http", "--url", server.url, "--precision", "fp32",
                                     "--n", str(N), "--max-new-tokens", "16", "--concurrency", "2", "--out", str(out),
                                     "--quiet"])
        assert result.exit_code == 0, result.output
        audit = runner.invoke(app, ["audit", str(out), "--quiet"])
    finally:
        server.stop()
    assert audit.exit_code == 0, audit.output
    engine = json.loads((out / "manifest.json").read_text())["environment"]["engine"]
    assert engine["api"] == "openai" and engine["build"]["server"] == "vllm"
    results = {m["construction"]: m for m in json.loads((out / "results.json").read_text())["matched"]}
    hits = results["prefix-cache"]["prefix_cache"]
    assert hits["hits"] == hits["n"] == N and hits["hits_with_decode_blocks"] == N
    assert results["oneshot"]["prefix_cache"]["hits"] == 0  # a fresh salt: nothing cached
    for arm in ("oneshot", "prefix-cache"):
        assert results[arm]["replica_exact"][arm] == {"k": N, "n": N}
    assert all(sum(counts.values()) == N for counts in results["live@load"]["load"].values())


# -- mismatch: vLLM as the RL rollout engine -------------------------------------------------------------------------

ROLLOUT = 24


@pytest.fixture(scope="module")
def mismatch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM samples 3 rollouts of the toy at temperature 1 (fp32, a seed derived per item); our engine scores them
    (teacher-forced, and as the trainer at fp32 and bf16)."""
    out = tmp_path_factory.mktemp("vllm") / "mismatch"
    result = runner.invoke(app, ["mismatch", "--engine", "vllm", "--n", "3", "--max-new-tokens", str(ROLLOUT),
                                 "--sample", "--precision", "fp32", "--precisions", "fp32,bf16", "--out", str(out),
                                 "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def test_vllm_rollouts_are_its_own_draws_replicate_and_every_arm_scores_their_tokens(mismatch_run):
    """vLLM's rollout, its replica and its prefill of the same tokens (and that prefill's replica) are in the record
    beside our engine's scores; each replica is bit for bit its arm, every arm scored the rollout's tokens, and the
    rollout is what vLLM itself draws for the recorded seed (`LLM.generate`, `SamplingParams(logprobs=0)`), with
    vLLM's log-probabilities. The control: another seed draws other tokens."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from stagereplay.records import arrays

    _, engine = _engine("fp32")  # the run's engine, still loaded in this process (the same settings)
    parts = by_part(mismatch_run)
    assert len(parts) == 3
    others = []
    for item_parts in parts.values():
        assert set(item_parts) == {"", "fp32", "bf16"}
        one_set_of_tokens(item_parts)
        main = item_parts[""]
        arms = _arms(main)
        assert set(arms) == {"rollout", "rollout#replica", "incremental", "prefill", "prefill#replica"}
        assert {(a["engine"], a["precision"]) for n, a in arms.items() if n != "incremental"} == {("vllm", "float32")}
        assert main["replica_tokens_equal"] and main["sampling"]["sample"] and main["sampling"]["temperature"] == 1.0
        seed = main["sampling"]["seed"]

        def draw(seed: int, prompt: list[int] = main["prompt_ids"]) -> tuple[list[int], list[float]]:
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=ROLLOUT, logprobs=0, detokenize=False)
            (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            (choice,) = out.outputs
            return list(choice.token_ids), [step[t].logprob for step, t in zip(choice.logprobs, choice.token_ids,
                                                                                strict=True)]

        tokens, logprobs = draw(seed)
        assert tokens == main["response_ids"]
        assert arrays.decode(arms["rollout"]["logprobs"]).tolist() == np.float32(logprobs).tolist()
        others.append(draw(seed + 1)[0] != tokens)
    assert any(others)  # the control: the seed decides the draw
    stage = json.loads((mismatch_run / "manifest.json").read_text())["stages"]["mismatch/primary"]
    assert stage["prefill"] == "built" and stage["transplant"].startswith("none") and stage["cross"] == "hf"


def test_the_audit_reexecutes_vllms_rollouts_and_catches_a_forged_logprob(mismatch_run, tmp_path):
    """The audit samples again in vLLM with the recorded seeds and scores again in ours: every record reproduces. A
    forger who moves one rollout log-probability and recomputes every checksum passes --verify-only and fails the
    re-execution, on that arm."""
    audit_finds_a_forged_logprob(mismatch_run, tmp_path, "rollout", 3, units=3 * (5 + 2 + 2))


def test_a_tiny_qwen2_samples_in_vllm_with_exact_replicas_on_one_set_of_tokens(tmp_path):
    """On a random Qwen2 of head size 32 (not the toy), vLLM's rollouts replicate and every side scores their tokens;
    with --logprobs-mode processed (top-k 8) vLLM gives processed log-probabilities, and its prefill is not built
    (vLLM's prompt logprobs are raw): one line says so, and the stage. The control: the raw run's rollout
    log-probabilities are not the processed run's."""
    model = _narrow_toy(tmp_path / "narrow")
    common = ["mismatch", "--engine", "vllm", "--model", str(model), "--n", "2", "--max-new-tokens", "12", "--sample",
              "--top-k", "8", "--precision", "fp32", "--precisions", "fp32"]
    runs = {}
    for mode in ("raw", "processed"):
        out = runs[mode] = tmp_path / mode
        result = runner.invoke(app, [*common, "--logprobs-mode", mode, "--out", str(out)])
        assert result.exit_code == 0, result.output
        notes = [line for line in result.stderr.splitlines() if line.startswith("note: no prefill rows")]
        assert len(notes) == (mode == "processed"), result.stderr
    for mode, out in runs.items():
        for item_parts in by_part(out).values():
            one_set_of_tokens(item_parts)
            assert item_parts[""]["replica_tokens_equal"]
            assert ("prefill" in _arms(item_parts[""])) is (mode == "raw")
    stage = json.loads((runs["processed"] / "manifest.json").read_text())["stages"]["mismatch/primary"]
    assert stage["prefill"].startswith("not built: vLLM's prompt logprobs skip its sampler")
    assert stage["engine"]["logprobs_mode"] == "processed" and "logprobs_mode" not in json.loads(
        (runs["raw"] / "manifest.json").read_text())["stages"]["mismatch/primary"]["engine"]
    raw, processed = (by_part(runs[m]) for m in ("raw", "processed"))
    for item, item_parts in raw.items():
        assert item_parts[""]["response_ids"] == processed[item][""]["response_ids"]  # the same seed, the same draw
        assert logprob_bits(_arms(item_parts[""])["rollout"]) != logprob_bits(_arms(processed[item][""])["rollout"])


@pytest.mark.parametrize(("extra", "says"), [
    (["--rollouts", "{file}", "--logprobs-mode", "processed"],
     "--rollouts with --engine vllm measures nothing of the engine: vLLM's prompt logprobs skip its sampler"),
    (["--batch", "2"], "No such option: --batch"),
])
def test_what_a_vllm_mismatch_cannot_do_is_refused_before_anything_loads(tmp_path, extra, says):
    file = tmp_path / "rollouts.jsonl"
    file.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-0.5]}) + "\n")
    out = tmp_path / "run"
    result = runner.invoke(app, ["mismatch", "--engine", "vllm", "--out", str(out),
                                 *(a.replace("{file}", str(file)) for a in extra)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and says in line, line
    assert not out.exists()


def test_vllm_serve_samples_rollouts_and_scores_them_with_echo(tmp_path):
    """`vllm serve` as the rollout engine over HTTP: its sampled rollouts (a fresh cache salt each) replicate, its
    prefill is its prompt logprobs (`echo`), every side scores one set of tokens, the audit reproduces. A mode the
    server was not started with is refused in one line (the control: the same server runs raw)."""
    from servers import start_vllm_server

    from stagereplay.toy import toy_checkpoint

    server = start_vllm_server(toy_checkpoint("primary"), tmp_path / "log.txt")
    common = ["mismatch", "--engine", "http", "--url", server.url, "--precision", "fp32", "--precisions", "fp32",
              "--n", "2", "--max-new-tokens", "12", "--sample", "--quiet"]
    try:
        refused = runner.invoke(app, [*common, "--logprobs-mode", "processed", "--out", str(tmp_path / "refused")])
        result = runner.invoke(app, [*common, "--out", str(tmp_path / "run")])
        audit = runner.invoke(app, ["audit", str(tmp_path / "run"), "--quiet"])
    finally:
        server.stop()
    assert refused.exit_code == 2 and "gives no processed log-probabilities" in refused.stderr
    assert not (tmp_path / "refused").exists()
    assert result.exit_code == 0, result.output
    for item_parts in by_part(tmp_path / "run").values():
        one_set_of_tokens(item_parts)
        arms = _arms(item_parts[""])
        assert set(arms) == {"rollout", "rollout#replica", "incremental", "prefill", "prefill#replica"}
        assert arms["prefill"]["engine"] == "http" and item_parts[""]["replica_tokens_equal"]
    assert audit.exit_code == 0, audit.output


def test_the_rollout_benchmark_writes_a_file_our_engine_audits(tmp_path):
    """bench/vllm_rollouts.py writes vLLM's own sampled rollouts as a rollout file (the script is code: it rots
    unless something runs it), a seed per row, a log-probability per token; `stagereplay mismatch --rollouts`
    audits it with our engine alone, every token of it, and with vLLM's prefill beside ours (`--engine vllm`). (A
    planted log-probability in such a file is found where it was planted: tests/test_mismatch.py.)"""
    import subprocess
    import sys

    bench = Path(__file__).resolve().parent.parent / "bench" / "vllm_rollouts.py"
    file = tmp_path / "rollouts.jsonl"
    out = subprocess.run([sys.executable, str(bench), str(file), "--n", "3", "--max-new-tokens", "8", "--dtype",
                          "float32"], check=True, capture_output=True, text=True).stdout
    assert out.splitlines()[-1].startswith("wrote 3 rollouts (") and str(file) in out
    rows = [json.loads(x) for x in file.read_text().splitlines()]
    assert [r["seed"] for r in rows] == [0, 1, 2] and all(len(r["logprobs"]) == len(r["response_ids"]) for r in rows)
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        result = runner.invoke(app, ["mismatch", "--rollouts", str(file), "--engine", engine, "--precisions", "fp32",
                                     "--precision", "fp32", "--transplant-at", "0", "--out", str(out), "--quiet"])
        assert result.exit_code == 0, result.output
        section = json.loads((out / "results.json").read_text())["mismatch"][0]
        total = next(p for p in section["pairs"] if p["row"] == "total")
        assert section["source"] == "file" and total["metrics"]["tokens"] == sum(len(r["response_ids"]) for r in rows)
        # On vLLM, its own prefill of the file's tokens is measured too (the construction row: batched rollouts
        # against one prefill each).
        assert any(p["row"] == "construction" for p in section["pairs"]) is (engine == "vllm")


# -- the knobs that change how vLLM builds the cache ---------------------------------------------------------------


@pytest.mark.parametrize(("extra", "says"), [
    (["--kv-cache-dtype", "int8"], "unknown --kv-cache-dtype 'int8'"),
    (["--speculative-config", "ngram"], "--speculative-config 'ngram' is not a JSON object"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 1"),
])
def test_a_cache_knob_out_of_range_is_refused_before_vllm_loads(tmp_path, extra, says):
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--engine", "vllm", "--n", "1", "--out", str(out), *extra])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert says in line and line.startswith("error: ") and not out.exists()


def test_an_fp8_cache_the_cpu_build_cannot_run_on_this_model_is_refused_naming_the_option(tmp_path):
    """The CPU build's fp8 K/V cache needs a head size divisible by 32; the toy's is 48, so vLLM raises at load: one
    line names the option and says what vLLM said. (The control, `auto`, is every other run of this module.)"""
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--engine", "vllm", "--n", "1", "--precision", "fp32", "--kv-cache-dtype",
                                 "fp8", "--out", str(out), "--quiet"])
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error: ")]  # vLLM logs on stderr too
    assert line.startswith("error: vLLM cannot run --kv-cache-dtype fp8 here (NotImplementedError: ")
    assert "head_size divisible by 32" in line


def test_a_block_size_the_cpu_attention_cannot_take_is_refused_naming_the_option(tmp_path):
    """The CPU build's attention takes blocks of a multiple of 32: `--block-size 16` fails in vLLM's K/V set-up, and
    one line names the option and what vLLM said (the control, 32, is every other run of this module)."""
    result = runner.invoke(app, ["matched", "--engine", "vllm", "--n", "1", "--precision", "fp32", "--block-size", "16",
                                 "--out", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: vLLM cannot run --block-size 16 here (ValueError: No common block size for 16")


def _narrow_toy(folder: Path) -> Path:
    """The toy's tokenizer on a random Qwen2 of head size 32 (2 layers, hidden 64, 2 heads): a model the CPU build's
    fp8 cache takes."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from stagereplay.toy import toy_checkpoint

    shutil.copytree(toy_checkpoint("primary"), folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    config = AutoConfig.from_pretrained(folder)
    config.update({"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                   "intermediate_size": 128, "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2,
                   "torch_dtype": "float32"})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def test_an_fp8_cache_runs_where_the_head_size_and_the_cpu_allow_and_is_recorded(tmp_path):
    """On a model of head size 32 the CPU build runs every fp8 cache type it names where the CPU has AVX-512 or AMX
    (vLLM's CPU kernels for it); the runs record the type. Whether it changed the tokens against the model's own dtype
    is reported by `compare`, not asserted (random weights). On a CPU without them (AVX2 only), each fp8 type is
    refused in one line that names what vLLM said, and no run is left; the model's own dtype runs on every CPU."""
    model = _narrow_toy(tmp_path / "narrow")
    common = ["matched", "--engine", "vllm", "--model", str(model), "--n", "2", "--precision", "fp32",
              "--boundary-after", "8", "--max-stage1-tokens", "8", "--max-new-tokens", "8", "--quiet"]
    fp8_here = bool(_cpu_flags() & {"avx512f", "amx_tile"})
    for dtype in ("auto", "fp8", "fp8_e5m2"):
        result = runner.invoke(app, [*common, "--kv-cache-dtype", dtype, "--out", str(tmp_path / dtype)])
        if dtype != "auto" and not fp8_here:
            assert result.exit_code == 2, result.output
            (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]  # (vLLM's loading bar aside)
            assert line.startswith(f"error: vLLM cannot run --kv-cache-dtype {dtype} here") and "AVX-512" in line
            assert not (tmp_path / dtype).exists()
            continue
        assert result.exit_code == 0, result.output
        engine = json.loads((tmp_path / dtype / "manifest.json").read_text())["environment"]["engine"]
        assert engine["kv_cache_dtype"] == dtype
    if not fp8_here:
        return
    compared = runner.invoke(app, ["compare", str(tmp_path / "auto"), str(tmp_path / "fp8"), "--out",
                                   str(tmp_path / "compare"), "--quiet"])
    assert compared.exit_code == 0, compared.output
    differ = json.loads((tmp_path / "compare" / "compare.json").read_text())["differences"]
    assert "config.engine.kv_cache_dtype" in {d["field"] for d in differ["settings"]}


NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def test_a_small_step_budget_prefills_in_chunks_and_is_recorded(tmp_path):
    """`max_num_batched_tokens` below the toy's prompts (vLLM then prefills them in chunks): the run completes with
    exact replicas and records the budget."""
    out = tmp_path / "chunked"
    result = runner.invoke(app, ["matched", "--engine", "vllm", "--n", "2", "--precision", "fp32", "--max-new-tokens",
                                 "16", "--max-num-batched-tokens", "16", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["environment"]["engine"]["max_num_batched_tokens"] == 16
    for p in _records(out):
        pairs = {(c["a"], c["b"]): c for c in p["comparisons"]}
        assert pairs[("oneshot", "oneshot#replica")]["suffix_equal"]


def test_attest_on_vllm_in_process_is_replayed_with_the_cpu_sampler(tmp_path):
    """`attest --engine vllm`: vLLM in this process serves each prompt with the request's seed at temperature 1; the
    claim of its CPU sampler replays every served token and is consistent; the control, the claim of vLLM's native
    sampler on the same engine and seeds, is flagged. 20 prompts: what a decision at 1% needs (10 calibrate), below
    which a run that exceeds its null reads inconclusive."""
    common = ["attest", "--engine", "vllm", "--precision", "fp32", "--n", "20", "--max-new-tokens", "8", "--sample",
              "--temperature", "1", "--seed", "3", "--quiet"]
    cpu = runner.invoke(app, [*common, "--seeded-sampler", "vllm-cpu", "--out", str(tmp_path / "cpu")])
    native = runner.invoke(app, [*common, "--out", str(tmp_path / "native")])
    right = json.loads((tmp_path / "cpu" / "results.json").read_text())["attest"][0]
    assert cpu.exit_code == 0 and right["statistic"] == 0 and not right["flagged"], cpu.output
    wrong = json.loads((tmp_path / "native" / "results.json").read_text())["attest"][0]
    assert native.exit_code == 1 and wrong["flagged"], native.output


# The ngram test comes last: in vLLM 0.32.0's CPU build, an LLM made in a process where a speculating one was made
# fails in its Triton kernel overrides (AttributeError: '_lib_fn_wrapper' object has no attribute 'get'); the CLI
# makes one LLM per process.
def test_ngram_speculation_records_each_requests_drafts(fp32_run, tmp_path):
    """vLLM's n-gram speculation (`speculative_config`) on the CPU build: each arm records what its request drafted
    and accepted (the engine's counters, read around it), live's more than nothing. The control, the run without
    speculation: no arm has a draft."""
    out = tmp_path / "spec"
    result = runner.invoke(app, ["matched", "--engine", "vllm", "--n", "2", "--precision", "fp32", "--max-new-tokens",
                                 "16", "--speculative-config", NGRAM, "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    arms = [a for p in _records(out) for a in p["arms"]]
    assert all(0 <= a["draft"]["accepted"] <= a["draft"]["drafted"] for a in arms)
    assert sum(a["draft"]["drafted"] for a in arms if a["name"] == "live") > 0
    assert json.loads((out / "manifest.json").read_text())["environment"]["engine"]["speculative_config"] == NGRAM
    assert not [a for p in _records(fp32_run) for a in p["arms"] if "draft" in a]


# -- attest: is `vllm serve` running the claimed model? ------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory: pytest.TempPathFactory):
    """`vllm serve` running the toy's primary checkpoint (fp32), for attest's checks."""
    from servers import start_vllm_server

    from stagereplay.toy import toy_checkpoint

    server = start_vllm_server(toy_checkpoint("primary"), tmp_path_factory.mktemp("vllm-serve") / "log.txt")
    yield server
    server.stop()


def _attested(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())["attest"][0]


def test_attest_asks_vllm_serve_and_flags_a_claim_it_does_not_serve(toy_server, tmp_path):
    """`vllm serve` running the toy's primary checkpoint, asked by attest for greedy responses: claimed as the primary
    checkpoint it is consistent (exit 0) and its identity is recorded; the control, the same server claimed as the
    later checkpoint, is flagged (exit 1)."""
    from stagereplay.toy import toy_checkpoint

    common = ["attest", "--engine", "http", "--url", toy_server.url, "--precision", "fp32", "--n", "20",
              "--max-new-tokens", "16", "--quiet"]
    claimed = runner.invoke(app, [*common, "--out", str(tmp_path / "claimed")])
    other = runner.invoke(app, [*common, "--model", str(toy_checkpoint("later")), "--out", str(tmp_path / "other")])
    assert claimed.exit_code == 0 and not _attested(tmp_path / "claimed")["flagged"], claimed.output
    engine = json.loads((tmp_path / "claimed" / "manifest.json").read_text())["environment"]["engine"]
    assert engine["api"] == "openai" and engine["build"]["server"] == "vllm", engine
    assert other.exit_code == 1 and _attested(tmp_path / "other")["flagged"], other.output


def test_the_cpu_sampler_replays_vllms_own_kernel_draw_for_draw():
    """`engine.seeded.VllmCpu` against the CPU build's `fused_gumbel_argmax` itself, with the step seeds a request's
    generator gives: the same token on every row, over vocabularies of 7 to 151,936, half the rows holding a near tie
    (two tokens whose noised scores differ by fp32's grain) that the kernel's running best settles."""
    import torch
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    from stagereplay.engine.seeded import VllmCpu, splitmix_gumbel

    gen = torch.Generator().manual_seed(0)
    tied = 0
    for vocab in (7, 49152, 151936):
        for seed in range(4):
            logits = torch.randn(32, vocab, generator=gen) * 3  # [32, V]
            request = torch.Generator().manual_seed(seed)
            steps = [int(torch.randint(0, 2**31, (1,), generator=request, dtype=torch.long)) for _ in range(32)]
            g = splitmix_gumbel(steps, vocab, "cpu")  # [32, V]
            for r in range(0, 32, 2):
                top = float(logits[r].max()) + 40
                logits[r, 0] = top
                logits[r, vocab - 1] = float(torch.tensor(top + float(g[r, 0] - g[r, vocab - 1]), dtype=torch.float32))
            kernel = torch.ops._C.fused_gumbel_argmax(logits, torch.tensor(steps))
            assert torch.equal(VllmCpu(seed, "cpu").draw(logits).pick, kernel), (vocab, seed)
            tied += int(((kernel == 0) | (kernel == vocab - 1))[::2].sum())
    assert tied == 3 * 4 * 16  # every planted near tie went to one of its pair


def test_a_seeded_claim_on_vllms_cpu_build_is_replayed_with_its_cpu_sampler(toy_server, tmp_path):
    """`vllm serve` (the CPU build) sampling at temperature 1 with each request's seed: claimed with its own sampler
    (`--seeded-sampler vllm-cpu`) every served token is the replayed draw and the server is consistent; the control,
    the same server claimed with vLLM's native sampler (what a GPU server runs), misses draws and is flagged."""
    common = ["attest", "--engine", "http", "--url", toy_server.url, "--precision", "fp32", "--n", "20",
              "--max-new-tokens", "16", "--sample", "--temperature", "1", "--seed", "3", "--quiet"]
    cpu = runner.invoke(app, [*common, "--seeded-sampler", "vllm-cpu", "--out", str(tmp_path / "cpu")])
    native = runner.invoke(app, [*common, "--out", str(tmp_path / "native")])
    s = _attested(tmp_path / "cpu")
    assert cpu.exit_code == 0 and not s["flagged"] and s["claim"].endswith("vLLM's CPU sampler"), cpu.output
    assert s["statistic"] == 0 and s["score"] == "gumbel mismatch", s  # every served token the replayed draw
    assert native.exit_code == 1 and _attested(tmp_path / "native")["flagged"], native.output
