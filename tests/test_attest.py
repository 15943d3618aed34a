"""`stagereplay attest` end to end on the toy: an honest server is not flagged, whether it is simulated here or its
outputs come from a file; a substitution (the toy's later checkpoint) is flagged, the decision flipping on the same
prompts; bad served files and too few responses are refused in one line before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from stagereplay.cli import app
from stagereplay.experiments.attest.experiment import calibration_split
from stagereplay.records import arrays
from stagereplay.records.ledger import items, read_ledger

runner = CliRunner()
SMALL = ["attest", "--n", "4", "--max-new-tokens", "6", "--honest", "bf16,fp32", "--quiet"]
ENOUGH = ["attest", "--n", "20", "--max-new-tokens", "6", "--honest", "bf16,fp32", "--quiet"]
"""The fewest prompts a decision at the default alpha rests on (`attest_decision.prompts_needed`): fewer read
inconclusive where a statistic exceeds its null."""


def _invoke(args: list[str]) -> Result:
    return runner.invoke(app, args, env={"COLUMNS": "120"})


def _section(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())["attest"][0]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attest")


@pytest.fixture(scope="module")
def honest_run(root: Path) -> Path:
    """A simulated server running the claimed model in bf16: the claimed model's own honest outputs."""
    run = root / "honest"
    result = _invoke([*SMALL, "--out", str(run)])
    assert result.exit_code == 0, result.output
    return run


@pytest.fixture(scope="module")
def served_file(root: Path, honest_run: Path) -> Path:
    """The honest run's served responses as a file of served outputs (the reference's log-probabilities of them)."""
    rows = []
    for r in items(read_ledger(honest_run)):
        if r.experiment == "attest" and r.part == "reference":
            served = next(a for a in r.payload["arms"] if a["name"] == "served")
            rows.append({"id": r.item_id, "prompt_ids": r.payload["prompt_ids"], "response_ids": served["response_ids"],
                         "logprobs": [float(x) for x in arrays.decode(served["logprobs"])]})
    path = root / "served.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_an_honest_server_is_not_flagged(honest_run: Path):
    s = _section(honest_run)
    assert not s["flagged"] and s["p_value"] > s["alpha"] and s["tokens_needed"] is None, s
    assert s["honest_fpr"][0] == 0 and s["nearest"][0][0].startswith("honest@"), s
    assert 0 < len(s["calibration"]) < s["items"]


def test_an_honest_served_file_is_not_flagged(root: Path, served_file: Path, honest_run: Path):
    """The same served tokens from a file decide as the simulated server's did."""
    run = root / "file"
    result = _invoke(["attest", "--served", str(served_file), "--honest", "bf16,fp32", "--quiet", "--out", str(run)])
    assert result.exit_code == 0, result.output
    s, t = _section(run), _section(honest_run)
    assert not s["flagged"] and s["source"] == "file" and s["tokens"] == t["tokens"], s
    assert s["statistic"] == t["statistic"] and s["difr"] == t["difr"]
    assert s["prompts_not_reencoded"] == [] and t["prompts_not_reencoded"] is None  # the toy's prompts, as it makes them


def test_a_served_file_without_logprobs_decides_as_with_them(root: Path, served_file: Path, honest_run: Path):
    """Log-probabilities are optional in a file of served outputs (a server may not return them), and the audit
    reads the file the same way; the control: a rollout file without them is refused by mismatch."""
    bare = root / "bare.jsonl"
    rows = [json.loads(line) for line in served_file.read_text().splitlines()]
    bare.write_text("".join(json.dumps({k: v for k, v in row.items() if k != "logprobs"}) + "\n" for row in rows))
    run = root / "bare"
    result = _invoke(["attest", "--served", str(bare), "--honest", "bf16,fp32", "--quiet", "--out", str(run)])
    assert result.exit_code == 0, result.output
    assert _section(run)["statistic"] == _section(honest_run)["statistic"]
    assert _invoke(["audit", str(run), "--sample", "1", "--quiet"]).exit_code == 0
    refused = _invoke(["mismatch", "--rollouts", str(bare), "--precisions", "bf16", "--out", str(root / "never-lp")])
    assert refused.exit_code == 2 and "logprobs" in refused.output, refused.output


def test_the_later_checkpoint_served_is_flagged(root: Path, honest_run: Path):
    """A real substitution on the same prompts: the decision flips from the honest run's, with the tokens it took."""
    run = root / "later"
    result = _invoke([*ENOUGH, "--served-checkpoint", "later", "--out", str(run)])
    s = _section(run)
    assert result.exit_code == 1 and s["outcome"] == "flagged" and s["flagged"], (result.output, s)
    assert any(t["flagged"] and not t["point_mass"] for t in s["tests"]), s["tests"]
    assert s["tokens_needed"] is not None and s["tokens_needed"] <= s["tokens"]
    assert s["statistic"] > s["threshold"] and s["difr"]["exact_match_rate"] < 1.0 and s["evidence"]
    assert not _section(honest_run)["flagged"]  # the control: the claimed checkpoint served, not flagged
    assert "No, not as claimed" in (run / "report.md").read_text()
    assert 'id="fig-attest-primary"' in (run / "report.html").read_text()


def _refused(args: list[str], out: Path, words: str) -> None:
    result = _invoke([*args, "--out", str(out)])
    assert result.exit_code == 2 and words in result.output, result.output
    assert result.output.strip().count("\n") == 0, result.output
    assert not out.exists()


def test_a_served_token_outside_the_vocabulary_is_refused_before_anything_is_written(root: Path, served_file: Path):
    rows = [json.loads(line) for line in served_file.read_text().splitlines()]
    rows[1]["response_ids"][0] = 10**7
    bad = root / "bad.jsonl"
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _refused(["attest", "--served", str(bad), "--quiet"], root / "never-vocab", "not a token ID of this tokenizer")


def test_too_few_served_responses_are_refused_before_anything_is_written(root: Path, served_file: Path):
    one = root / "one.jsonl"
    one.write_text(served_file.read_text().splitlines()[0] + "\n")
    _refused(["attest", "--served", str(one), "--quiet"], root / "never-one", "too few to decide on")
    _refused(["attest", "--n", "1", "--quiet"], root / "never-n", "too few responses to decide on")


def test_a_file_refuses_the_options_that_simulate_a_server(root: Path, served_file: Path):
    _refused(["attest", "--served", str(served_file), "--served-checkpoint", "later", "--quiet"],
             root / "never-sim", "--served-checkpoint simulate a server")


def test_the_calibration_split_is_seeded_and_leaves_both_sides_items():
    ids = [f"i{k}" for k in range(10)]
    a = calibration_split(ids, 0)
    assert a == calibration_split(ids, 0) and len(a) == 5
    assert any(calibration_split(ids, seed) != a for seed in range(1, 5))
    assert all(0 < len(calibration_split(ids[:n], 0)) < n for n in range(2, 6))


def test_a_seeded_claim_replays_the_sampler_and_an_honest_server_is_not_flagged(root: Path):
    run = root / "seeded"
    result = _invoke(["attest", "--n", "3", "--max-new-tokens", "4", "--sample", "--temperature", "1", "--seed", "3",
                      "--honest", "bf16", "--quiet", "--out", str(run)])
    assert result.exit_code == 0, result.output
    s = _section(run)
    assert s["score"] == "gumbel mismatch" and not s["flagged"]
    assert s["claim"] == "seeded sampling at temperature 1, vLLM's sampler"
    reference = next(r for r in items(read_ledger(run)) if r.part == "reference")
    assert all(a["seed"] is not None and "gumbel_match" in a for a in reference.payload["arms"])


def test_a_claim_of_vllms_cpu_sampler_is_told_from_one_of_its_native_sampler(root: Path):
    """Served outputs drawn with vLLM's CPU build's sampler (simulated here, fp32 live decode), as a file with each
    row's seed: claimed with that sampler every served token is the replayed draw (an fp32 reference parts from an
    fp32 decode only on a near tie) and the server is consistent; the control, the same file claimed with vLLM's
    native sampler, misses draws and is flagged."""
    run = root / "seeded-cpu"
    sampled = ["--sample", "--temperature", "1", "--seed", "3", "--precision", "fp32", "--honest", "bf16,fp32", "--quiet"]
    result = _invoke(["attest", "--n", "20", "--max-new-tokens", "8", "--served-precision", "fp32", *sampled,
                      "--seeded-sampler", "vllm-cpu", "--out", str(run)])
    assert result.exit_code == 0, result.output
    s = _section(run)
    assert s["statistic"] == 0 and s["claim"] == "seeded sampling at temperature 1, vLLM's CPU sampler", s
    rows = [{"id": r.item_id, "prompt_ids": r.payload["prompt_ids"], "response_ids": a["response_ids"], "seed": a["seed"]}
            for r in items(read_ledger(run)) if r.part == "reference" for a in r.payload["arms"] if a["name"] == "served"]
    path = root / "served-cpu.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cpu = _invoke(["attest", "--served", str(path), *sampled, "--seeded-sampler", "vllm-cpu", "--out",
                   str(root / "file-cpu")])
    native = _invoke(["attest", "--served", str(path), *sampled, "--out", str(root / "file-native")])
    right, wrong = _section(root / "file-cpu"), _section(root / "file-native")
    assert cpu.exit_code == 0 and right["statistic"] == 0 and not right["flagged"], cpu.output
    assert native.exit_code == 1 and wrong["flagged"] and wrong["statistic"] > 0.1, native.output


@pytest.mark.parametrize(("extra", "says"), [
    (["--seeded-sampler", "vllm-cpu"], "--seeded-sampler names the sampler of a seeded claim, and this claim is greedy"),
    (["--sample", "--seeded-sampler", "sglang"], "unknown seeded sampler 'sglang'"),
])
def test_a_seeded_sampler_that_cannot_apply_is_refused_in_one_line(root: Path, extra: list[str], says: str):
    out = root / "refused-sampler"
    result = _invoke(["attest", "--n", "4", *extra, "--out", str(out)])
    assert result.exit_code == 2 and says in result.output and not out.exists(), result.output


def test_verify_finds_a_score_that_is_not_its_fingerprints(root: Path, honest_run: Path):
    """A served side's margins changed, its fingerprint kept, is found by `--verify-only`; the control: the run as
    made verifies."""
    import shutil

    import forge
    import numpy as np

    assert _invoke(["audit", str(honest_run), "--verify-only"]).exit_code == 0
    forged = root / "forged"
    shutil.copytree(honest_run, forged)
    chain, manifest = forge.load(forged)
    i = next(k for k, r in enumerate(chain) if r.kind == "item" and r.part == "reference")
    payload = forge.edit(chain[i])
    served = payload["arms"][0]
    served["margin"] = arrays.encode(arrays.decode(served["margin"]) + np.float32(1.0), "f32")
    chain[i] = forge.with_payload(chain[i], payload, recompare=False)
    forge.save(forged, chain, manifest, results=False)
    found = _invoke(["audit", str(forged), "--verify-only"])
    assert found.exit_code == 1 and "side served: scores_fp is not the fingerprint of its scores" in found.output, \
        found.output


def test_a_served_prompt_the_claimed_tokenizer_would_not_make_is_reported(root: Path, r1_dir):
    """A served file's prompt whose text the claimed tokenizer encodes otherwise ("an" as its two letters, where the
    tokenizer merges them) is named in the report, and only that one: the server tokenizes otherwise."""
    from transformers import AutoTokenizer

    model = r1_dir("merged")
    tok = AutoTokenizer.from_pretrained(model)
    merged, a, n = (tok.convert_tokens_to_ids(t) for t in ("an", "a", "n"))
    rows = []
    for k, text in enumerate(["an ant ran", "tea and rain", "a tan hat", "nine ants"]):
        prompt = tok.encode(text, add_special_tokens=False)
        assert merged in prompt, prompt
        if k == 2:
            at = prompt.index(merged)
            prompt = [*prompt[:at], a, n, *prompt[at + 1:]]
        rows.append({"id": f"p{k}", "prompt_ids": prompt, "response_ids": tok.encode("at the end", add_special_tokens=False)})
    served = root / "split.jsonl"
    served.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = root / "split"
    result = _invoke(["attest", "--model", str(model), "--served", str(served), "--honest", "bf16", "--quiet",
                      "--out", str(run)])
    # four responses the model did not make, on two calibration prompts: a statistic exceeds its null, and the null
    # is too small to support the level, so the run is inconclusive (exit 3), never flagged
    assert result.exit_code == 3 and _section(run)["outcome"] == "inconclusive", result.output
    assert _section(run)["prompts_not_reencoded"] == ["p2"]
    assert "1/4" in (run / "report.md").read_text() and "not what the claimed model's tokenizer makes" in (
        run / "report.md").read_text()
