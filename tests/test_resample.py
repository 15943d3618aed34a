"""Sampled replay: sampling as generate() samples, K draws from one snapshot, the coupled and independent
designs on the toy, the audit of draws, and the statistics of answer distributions."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import attn_for, tables_text
from tiny import tiered
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.decode import DecodeConfig, Sampler
from stagereplay.engine.lm import load
from stagereplay.experiments.core.stats import benjamini_hochberg, total_variation, two_sample_answer_test
from stagereplay.records.ledger import Record, canonical_json

runner = CliRunner()
K = 2  # draws per state in the shared run
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 0}  # Thought Anchors' settings


def _hf_generate(lm, prompt, n, seed, **sampling):
    ids = torch.tensor([prompt])
    torch.manual_seed(seed)
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=n, **sampling)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("sampling", [SAMPLING, {"temperature": 1.3, "top_p": 1.0, "top_k": 20},
                                      {"temperature": 0.8, "top_p": 0.7, "top_k": 40}])
@pytest.mark.parametrize("arch", tiered(("qwen2", "llama", "gemma2"), quick=("gemma2",)))
def test_one_sampled_continuation_equals_generate_do_sample(tiny_dir, arch, sampling):
    """Our loop with a generator seeded s emits what generate(do_sample=True) emits after manual_seed(s)."""
    lm = load(str(tiny_dir(arch)), precision="bf16", attn_impl=attn_for(arch))
    prompt = lm.tokenizer.encode("Q: what is 12+7? Think.\n")
    dc = DecodeConfig(sample=True, **sampling)
    for seed in (0, 1, 2):
        assert lm.generate(prompt, 40, dc, seed=seed) == _hf_generate(lm, prompt, 40, seed, **sampling)


def test_generate_parity_negative_controls(tiny_dir):
    """Another seed, or a missing top-p cut, gives another continuation: the parity above is not vacuous."""
    lm = load(str(tiny_dir("qwen2")), precision="bf16")
    prompt = lm.tokenizer.encode("Q: what is 12+7? Think.\n")
    reference = _hf_generate(lm, prompt, 40, 0, **SAMPLING)
    assert lm.generate(prompt, 40, DecodeConfig(sample=True, **SAMPLING), seed=1) != reference
    no_top_p = DecodeConfig(sample=True, temperature=0.6, top_p=1.0)
    assert lm.generate(prompt, 40, no_top_p, seed=0) != reference


def test_warpers_match_generate_bitwise_and_their_order_matters():
    """temperature -> top-k -> top-p, as generate() applies them, bit for bit on random fp32 scores."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 300, generator=g) * 3
    ids = torch.zeros(1, 1, dtype=torch.long)
    ours = Sampler(DecodeConfig(sample=True, temperature=0.7, top_k=50, top_p=0.9), 0, "cpu").warp(scores)
    theirs = TopPLogitsWarper(0.9)(ids, TopKLogitsWarper(50)(ids, TemperatureLogitsWarper(0.7)(ids, scores)))
    assert torch.equal(ours, theirs)
    swapped = TemperatureLogitsWarper(0.7)(ids, TopPLogitsWarper(0.9)(ids, TopKLogitsWarper(50)(ids, scores)))
    assert not torch.equal(torch.isinf(ours), torch.isinf(swapped))  # negative control: order changes the cut


def test_draws_start_from_one_snapshot_without_touching_it(tiny_dir):
    """K draws from one state: the state's cache is unchanged, and draw j is the same whenever it is taken."""
    from stagereplay.engine.boundary import After
    from stagereplay.engine.cache import cache_fingerprint

    lm = load(str(tiny_dir("qwen2")), precision="bf16")
    state = lm.live(lm.tokenizer.encode("Hello, world! 3*4="), After(10), DecodeConfig(max_new_tokens=20))
    before = cache_fingerprint(state.cache)
    dc = DecodeConfig(max_new_tokens=20, sample=True, **SAMPLING)
    first = [lm.continue_from(state, dc, seed=j).suffix for j in range(6)]
    again = [lm.continue_from(state, dc, seed=j).suffix for j in reversed(range(6))][::-1]
    assert first == again
    assert cache_fingerprint(state.cache) == before
    assert len(set(first)) > 1  # negative control: the seeds do draw different continuations


@pytest.fixture(scope="module")
def resampled(tmp_path_factory):
    """A toy matched run of 3 items with K = 2 draws at bf16 (the run's precision) and fp32 (fixed prefixes), each
    suffix and draw 16 tokens long at most (the properties read are counts, seeds and equalities, not lengths)."""
    out = tmp_path_factory.mktemp("resample") / "run"
    r = runner.invoke(app, ["matched", "--n", "3", "--max-new-tokens", "16", "--out", str(out), "--quiet",
                            "--workers", "1"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["resample", str(out), "--k", str(K), "--precisions", "bf16,fp32", "--quiet"])
    assert r.exit_code == 0, r.output
    return out


def test_resample_records_draws_seeds_and_results(resampled):
    manifest = json.loads((resampled / "manifest.json").read_text())
    stage = manifest["stages"]["resample/primary"]
    assert stage["seeds"]["base"] == 0 and set(stage["seeds"]["streams"]) == {"A", "B", "C"}
    assert stage["config"]["k"] == K and stage["precisions"] == ["bf16", "fp32"]
    records = [json.loads(x) for x in (resampled / "ledger.jsonl").read_text().splitlines()]
    draws = [r for r in records if r["kind"] == "item" and r["experiment"] == "resample"]
    assert len(draws) == 2 * 3
    for r in draws:
        arms = r["payload"]["arms"]
        assert len(arms) == 5 * K  # live, fresh, replica on seeds A; fresh on B; live on C
        assert len({a["seed"] for a in arms}) == 3 * K  # one seed per stream and draw, shared within A
        assert {a["seed"] for a in arms if a["stream"] == "A" and a["draw"] == 0} == {arms[0]["seed"]}
    results = json.loads((resampled / "results.json").read_text())
    by_precision = {e["precision"]: e for e in results["resample"]}
    assert by_precision["bf16"]["live_source"] == "live"
    assert by_precision["fp32"]["live_source"] == "incremental"
    for e in results["resample"]:
        assert e["n_items"] == 3 and e["coupled"]["draws"] == 3 * K
        assert e["coupled"]["replica_differ"] == 0  # the negative control: live vs live replica, same seeds
        assert len(e["independent"]["tv_fresh"]) == len(e["independent"]["p_values"]) == 3
    assert by_precision["fp32"]["coupled"]["fresh_differ"] == 0


@pytest.mark.slow  # re-executes 60+ draws: the slow tier
def test_the_audit_re_executes_every_draw(resampled, tmp_path):
    import shutil

    r = runner.invoke(app, ["audit", str(resampled), "--quiet"])
    assert r.exit_code == 0, r.output
    audit = json.loads((resampled / "audit.json").read_text())
    assert audit["reproduced"] and audit["trajectories"]["n"] >= 2 * 3 * 5 * K

    # A forged draw whose fingerprint and hash chain are recomputed still fails: the model does not emit it.
    forged = tmp_path / "forged"
    shutil.copytree(resampled, forged)
    lines = (forged / "ledger.jsonl").read_text().splitlines()
    records = [Record(**json.loads(x)) for x in lines]
    target = next(i for i, r in enumerate(records) if r.kind == "item" and r.experiment == "resample")
    arm = records[target].payload["arms"][7]
    arm["suffix_ids"] = [arm["suffix_ids"][0], *arm["suffix_ids"]]
    from stagereplay.engine.lm import ids_fingerprint

    arm["suffix_fp"] = ids_fingerprint(arm["suffix_ids"])
    prev = records[0].prev_hash
    out = []
    for r in records:
        r = r.model_copy(update={"prev_hash": prev})
        r = r.model_copy(update={"hash": r.computed_hash()})
        prev = r.hash
        out.append(canonical_json(r.model_dump()).decode())
    (forged / "ledger.jsonl").write_text("\n".join(out) + "\n")
    r = runner.invoke(app, ["audit", str(forged), "--quiet"])
    assert r.exit_code != 0
    mismatches = json.loads((forged / "audit.json").read_text())["mismatches"]
    assert any(arm["name"] in m["what"] for m in mismatches)


@pytest.mark.slow  # many draws: the slow tier
def test_the_independent_test_has_power_on_states_built_to_differ():
    """Draws from another item's state (another prefix) are rejected at p < 0.01; equal samples are not."""
    from stagereplay.engine.boundary import Marker
    from stagereplay.tasks import DataConfig, load_items
    from stagereplay.tasks.scoring import answer_extractor
    from stagereplay.toy import toy_checkpoint

    lm = load(str(toy_checkpoint("primary")), precision="bf16")
    items = load_items(DataConfig(n=8), lm.tokenizer)[0]
    a, b = next((x, y) for x in items for y in items if x.answer != y.answer)
    answer_of = answer_extractor("last-number")
    dc = DecodeConfig(max_new_tokens=128, sample=True, **SAMPLING)

    def answers(item):
        state = lm.live(item, Marker("</think>"), DecodeConfig(max_new_tokens=128), keep_going=False)
        return [answer_of(lm.text([*state.stage1, *lm.continue_from(state, dc, seed=j).suffix])) for j in range(12)]

    live_a, other = answers(a), answers(b)
    assert two_sample_answer_test(live_a, other) < 0.01
    assert two_sample_answer_test(live_a, live_a) == 1.0


def test_total_variation_and_the_two_sample_test():
    assert total_variation(["1", "1", "2", "2"], ["1", "1", "2", "2"]) == 0.0
    assert total_variation(["1"] * 4, ["2"] * 4) == 1.0
    assert total_variation(["1", "1", "1", None], ["1", "1", None, None]) == pytest.approx(0.25)
    from scipy.stats import fisher_exact

    # Two answers: Fisher's exact test itself.
    a, b = ["1"] * 9 + ["2"] * 3, ["1"] * 3 + ["2"] * 9
    assert two_sample_answer_test(a, b) == pytest.approx(fisher_exact([[9, 3], [3, 9]]).pvalue)
    # More answers: seeded Monte Carlo, reproducible for a seed.
    c = ["1"] * 6 + ["2"] * 3 + ["3"] * 3
    assert two_sample_answer_test(a, c, seed=5) == two_sample_answer_test(a, c, seed=5)
    assert two_sample_answer_test(["1"] * 12, ["2"] * 6 + ["3"] * 6) < 0.001
    # A table for which scipy returns p as a (1,) array, not a scalar: still one float.
    p = two_sample_answer_test(["358", "422", "348", "348"], ["291", "352", "348", "348"], seed=1506673553)
    assert isinstance(p, float) and 0 < p <= 1


def test_benjamini_hochberg():
    """Against a hand-written step-up rule (an independent computation from scipy's adjusted p-values, which
    the function uses), plus hand-checked cases and a step-down negative control."""
    import numpy as np

    def by_rank(p, alpha, step_up):
        # Rank k passes when p_(k) <= alpha * k / m. Step-up rejects up to the largest passing rank;
        # step-down stops at the first rank that fails.
        m = len(p)
        order = sorted(range(m), key=lambda i: p[i])
        passes = [p[i] <= alpha * rank / m for rank, i in enumerate(order, start=1)]
        if step_up:
            cutoff = max((k for k, ok in enumerate(passes, start=1) if ok), default=0)
        else:
            cutoff = passes.index(False) if False in passes else m
        rejected = set(order[:cutoff])
        return [i in rejected for i in range(m)]

    rng = np.random.default_rng(0)
    for _ in range(50):
        p = np.concatenate([rng.uniform(0, 0.02, rng.integers(0, 6)), rng.uniform(0, 1, rng.integers(1, 30))])
        assert benjamini_hochberg(p.tolist(), 0.05) == by_rank(p.tolist(), 0.05, step_up=True)
    # Step-up: rank 3 passes (0.03 <= 3 * 0.05 / 5) although rank 2 alone would not (0.025 > 2 * 0.05 / 5).
    step_up_example = [0.001, 0.025, 0.03, 0.5, 0.2]
    assert benjamini_hochberg(step_up_example, 0.05) == [True, True, True, False, False]
    # Negative control: the step-down rule stops at rank 2 and rejects only the first.
    assert by_rank(step_up_example, 0.05, step_up=False) == [True, False, False, False, False]
    assert benjamini_hochberg([0.04, 0.9], 0.05) == [False, False]  # 0.04 > 1 * 0.05 / 2
    assert benjamini_hochberg([], 0.05) == []


def test_resample_tables_and_figure_read_in_the_report(resampled):
    """Both resample tables print at 80 columns without cut cells; the HTML report carries the figure."""
    text = tables_text(json.loads((resampled / "results.json").read_text()), width=80)
    assert "Resample, coupled" in text and "Resample, independent" in text
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert 'id="fig-resample"' in (resampled / "report.html").read_text()
