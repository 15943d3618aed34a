"""`stagereplay plan` counts the forwards a run makes with the code that runs them, and sizes caches and weights
from a config alone; the 2x2 carries the matched run's arm over instead of computing it again."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine import decode
from stagereplay.engine.boundary import After
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.forwards import construct_forwards
from stagereplay.experiments.core.lengths import lengths_of
from stagereplay.experiments.protocol import precision_2x2
from stagereplay.experiments.protocol.precision_2x2 import grid_lengths
from stagereplay.plan.recorded import plan_run
from stagereplay.records.ledger import items, read_ledger

pytestmark = pytest.mark.capture  # a plan counts the forwards of the captured step's proofs

# DeepSeek-R1-Distill-Qwen-14B's shape, as its config.json states it (no weights, no tokenizer).
R1_14B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
          "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
          "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 131072,
          "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
          "bos_token_id": 151646, "eos_token_id": 151643}


@pytest.fixture(scope="module")
def counted_run(tmp_path_factory, tiny_dir, items_file):
    """A tiny `paper` run (both checkpoints, 2 sampled draws per state on 2 items; an audit of a seeded sample of
    2 units per stage) with every model forward counted by its token count. Stage 1 and the suffixes are long
    enough that bf16 live and one-shot suffixes diverge on some items on every CPU tried (AVX2, AVX-512, AMX;
    with 6 + 8 tokens none did on an AVX-512-BF16 EPYC), which the transplant and carry-over tests need."""
    from stagereplay.engine import proof, prover
    from stagereplay.engine.proof_stores import IN_PROCESS
    from stagereplay.execution import models
    from stagereplay.runs import Inputs, PaperConfig, paper

    sizes: Counter[int] = Counter()
    proving: list[Counter[int]] = []  # the forwards of each proof of the captured step, counted apart
    forward = decode.Stepper.forward
    prove = proof.prove_steps

    def counting(self, ids, cache, past, **kwargs):
        (proving[-1] if proving and proving[-1]["open"] else sizes)[len(ids)] += 1
        return forward(self, ids, cache, past, **kwargs)

    def counted_proof(*args, **kwargs):
        proving.append(Counter(open=1))
        try:
            return prove(*args, **kwargs)
        finally:
            proving[-1]["open"] = 0

    out = tmp_path_factory.mktemp("plan") / "run"
    # As a fresh process starts: no model loaded (an earlier test's, proven to its own reach, would be reused) and
    # no proof made.
    models._LMS.clear()
    IN_PROCESS.clear()
    mp = pytest.MonkeyPatch()
    mp.setattr(decode.Stepper, "forward", counting)
    mp.setattr(prover, "prove_steps", counted_proof)
    try:
        results = paper(out, Inputs.of(model=str(tiny_dir("qwen2")), data=str(items_file), n=4, boundary=After(16),
                                    decode=DecodeConfig(max_new_tokens=48)),
                        PaperConfig(later_model=str(tiny_dir("qwen2")), audit_sample=2, resample=2, resample_items=2),
                        workers=1, quiet=True)
    finally:
        mp.undo()
    assert results.audit is not None and results.audit.reproduced
    # Proofs are a process's set-up, once per model setting (plan_paper's proof rows), not a unit's work: the plan
    # of the run as it ran counts its units' forwards.
    # bf16 proven once before the first item, to the reach after:16 fixes; fp32 (no prepare: its stage's first
    # step asks) first to 64 positions, then once more to 128 when a step passes 64 (engine.proof.next_reach).
    assert len(proving) == 3 and all(sum(c.values()) > 60 for c in proving), proving
    return out, sizes


def test_plan_of_a_run_counts_exactly_the_forwards_it_made(counted_run):
    out, sizes = counted_run
    planned: Counter[int] = Counter()
    for stage in plan_run(out):
        planned.update(stage.sizes)
    assert +planned == +sizes
    assert sum(sizes.values()) > 100  # the run did real work: every stage, both checkpoints, the audit
    rows = {stage.name: stage for stage in plan_run(out)}
    assert rows["resample/primary@bf16"].units == rows["resample/primary@fp32"].units == 2
    # The audit's units are the ones its seeded sample picked: counting every unit instead differs.
    assert json.loads((out / "audit.json").read_text())["sample"]["per_stage"] == 2
    full: Counter[int] = Counter()
    for stage in plan_run(out, audit_sample=0):
        full.update(stage.sizes)
    assert sum(full.values()) > sum(sizes.values())


def test_the_plan_before_a_run_has_the_stages_the_run_made(counted_run):
    """`paper` runs its steps and `plan` prices the same steps (`experiments.protocol.paper.paper_steps`): given the run's own
    divergence, the plan made before it has the run's stages, in the run's order, with as many units each."""
    from stagereplay.plan.paper import plan_paper
    from stagereplay.plan.stages import PlanConfig, model_shape
    from stagereplay.records.ledger import read_manifest
    from stagereplay.runs import PaperConfig

    out, _ = counted_run
    results = json.loads((out / "results.json").read_text())
    assert all(m["n_no_boundary"] == 0 for m in results["matched"])  # every item reaches the boundary After(16)
    divergent = results["matched"][0]["suffix_disagreements"]["k"]
    prompts = [len(r.payload["prompt_ids"]) for r in items(read_ledger(out))
               if r.experiment == "matched" and r.checkpoint == "primary"]
    cfg = PlanConfig(n=4, divergent=divergent, protocol=PaperConfig(resample=2, resample_items=2), later=True)
    planned = plan_paper(cfg, model_shape(read_manifest(out).config.model.path), prompts, 16)
    made = plan_run(out, audited=False)
    assert [(s.name, s.units) for s in planned if s.units and not s.name.startswith(("audit@", "proof@"))] == [
        (s.name, s.units) for s in made]


class Scored:
    """A step `paper` does not take: what `plan` asks of its experiment (its rows at fp32: each item's prompt, then a
    step per suffix token, on its first `options` items)."""

    name = "scored"

    def planned_stage(self, options):
        return None

    def peak_caches(self, stage):
        return 2

    def planned_forwards(self, assumed, options):
        return {"fp32": [(u, [u.prompt, *[1] * u.suffix]) for u in assumed.items[:options]]}


def test_a_step_of_paper_is_a_row_its_experiment_prices(monkeypatch):
    """The plan names no experiment: a step added to `paper` is a row priced by its own experiment, and the audit
    re-executes its units too; every other row stays as it was."""
    from stagereplay.experiments.protocol.paper import Step, paper_steps
    from stagereplay.plan import paper as plan_module
    from stagereplay.plan.stages import PlanConfig, Shape

    shape = Shape(layers=2, kv_heads=1, head_dim=8, params=1000, context=4096)
    cfg = PlanConfig(n=3, suffix_tokens=5, later=False)
    before = {s.name: s for s in plan_module.plan_paper(cfg, shape, [10, 11, 12], 20)}
    monkeypatch.setattr(plan_module, "paper_steps",
                        lambda protocol, later: [*paper_steps(protocol, later), Step(Scored(), 2)])
    after = {s.name: s for s in plan_module.plan_paper(cfg, shape, [10, 11, 12], 20)}
    assert "scored/primary@fp32" not in before
    row = after.pop("scored/primary@fp32")
    assert (row.units, row.caches, row.precision, row.sizes) == (2, 2, "fp32", Counter({10: 1, 11: 1, 1: 10}))
    audit = after.pop("audit@fp32")
    assert audit.units == before.pop("audit@fp32").units + 2
    assert after == before


def test_negative_control_the_count_misses_a_carried_arm_decoded_in_full(counted_run):
    """Were the 2x2's carried-over arms decoded in full (no dedup), the count would not be the run's."""
    out, sizes = counted_run
    records = [r for r in items(read_ledger(out)) if r.experiment == "precision_2x2" and r.part == "bf16"]
    assert records and all(any(a.get("same_as") for a in r.payload["arms"]) for r in records)
    planned: Counter[int] = Counter()
    for stage in plan_run(out):
        planned.update(stage.sizes)
    for r in records:  # swap the counted looks for the whole suffixes
        n = grid_lengths(r)
        assert {c for c, _ in n.looks} == {"incremental", "oneshot"}
        looked = precision_2x2.forwards(n, ("incremental", "oneshot"), "bf16")
        full = precision_2x2.forwards(replace(n, looks=()), ("incremental", "oneshot"), "bf16")
        if looked != full:
            planned.subtract(Counter(looked))
            planned.update(Counter(full))
    # The audit repeats each 2x2 unit once more: the difference shows twice, so the counts differ.
    assert +planned != +sizes


def test_the_2x2_arms_are_the_matched_arms_and_verify_checks_it(counted_run, tmp_path):
    """At the run's precision the 2x2's one-shot arm is the matched record's one-shot arm and its incremental arm
    the matched live arm (`same_as`), field for field but the construction, the cache fingerprint included: the
    incremental cache rebuilt from the fixed prefix is live's bit for bit. At fp32 nothing is carried over; the
    verify-only audit checks the claim, and a forged copy fails it."""
    import shutil

    from forge import edit, load, save, with_payload

    from stagereplay.runs import audit

    out, _ = counted_run
    records = items(read_ledger(out))
    matched = {r.item_id: r.payload for r in records if r.experiment == "matched" and r.checkpoint == "primary"}
    for r in records:
        if r.experiment != "precision_2x2":
            continue
        carried = [a for a in r.payload["arms"] if a.get("same_as")]
        if r.part == "fp32":
            assert not carried
            continue
        assert [(a["name"], a["construction"], a["same_as"]) for a in carried] == [
            ("incremental@bf16", "incremental", "matched/primary:live"),
            ("oneshot@bf16", "oneshot", "matched/primary:oneshot")]
        for arm in carried:
            name = arm["same_as"].rpartition(":")[2]
            source = next(a for a in matched[r.item_id]["arms"] if a["name"] == name)
            assert {k: v for k, v in arm.items() if k not in ("name", "construction", "same_as")} == {
                k: v for k, v in source.items() if k not in ("name", "construction")}
            assert r.payload["diagnostics"]["margins"][arm["name"]] == matched[r.item_id]["diagnostics"]["margins"][
                name]
    assert audit(out, verify_only=True).reproduced
    # Negative control: a carried arm whose cache fingerprint is not the matched arm's (chain recomputed).
    forged = tmp_path / "forged"
    shutil.copytree(out, forged)
    chain, manifest = load(forged)
    k = next(i for i, r in enumerate(chain) if r.kind == "item" and r.experiment == "precision_2x2" and r.part == "bf16")
    payload = edit(chain[k])
    arm = next(a for a in payload["arms"] if a.get("same_as") == "matched/primary:oneshot")
    arm["cache_fp"] = "0" * 64
    chain[k] = with_payload(chain[k], payload)
    save(forged, chain, manifest)
    found = audit(forged, verify_only=True)
    assert not found.reproduced
    assert any("cache_fp is not the one of matched/primary:oneshot" in m.what for m in found.findings)


def test_the_transplants_own_arms_are_the_matched_arms_and_verify_checks_it(counted_run, tmp_path):
    """A transplant's live and one-shot arms are the matched record's (`same_as`): their boundary caches, rebuilt
    here, have the recorded fingerprints, so their own suffixes are not decoded again. A forged fingerprint on one
    of them fails the verify-only audit."""
    import shutil

    from forge import edit, load, save, with_payload

    from stagereplay.runs import audit

    out, _ = counted_run
    records = items(read_ledger(out))
    matched = {(r.checkpoint, r.item_id): r.payload for r in records if r.experiment == "matched"}
    transplants = [r for r in records if r.experiment == "transplant" and r.payload["status"] == "ok"]
    assert transplants
    for r in transplants:
        own = {a["name"]: a for a in r.payload["arms"] if a.get("same_as")}
        assert {n: a["same_as"] for n, a in own.items()} == {
            "live": f"matched/{r.checkpoint}:live", "oneshot": f"matched/{r.checkpoint}:oneshot"}
        source = {a["name"]: a for a in matched[(r.checkpoint, r.item_id)]["arms"]}
        for name, arm in own.items():
            assert {k: v for k, v in arm.items() if k != "same_as"} == source[name]
    forged = tmp_path / "forged"
    shutil.copytree(out, forged)
    chain, manifest = load(forged)
    k = next(i for i, r in enumerate(chain) if r.kind == "item" and r.experiment == "transplant"
             and r.payload["status"] == "ok")
    payload = edit(chain[k])
    next(a for a in payload["arms"] if a["name"] == "live")["cache_fp"] = "0" * 64
    chain[k] = with_payload(chain[k], payload, recompare=False)
    save(forged, chain, manifest)
    found = audit(forged, verify_only=True)
    assert any("cache_fp is not the one of matched/" in m.what for m in found.findings)


def test_an_arm_is_carried_over_only_from_a_cache_with_the_recorded_fingerprint(counted_run, tiny_dir):
    """The gate on carrying an arm over is the rebuilt cache's fingerprint. Given a recorded arm whose cache_fp is
    not the cache's (negative control), the 2x2 and the transplant decode that arm in full and record it as their
    own, and what they decode is the recorded computation: the same suffix, the true fingerprint."""
    from stagereplay.engine.lm import load
    from stagereplay.experiments.core.experiment import Replay
    from stagereplay.experiments.core.registry import experiment as experiment_of
    from stagereplay.experiments.protocol.precision_2x2 import grid_item
    from stagereplay.experiments.protocol.transplant import transplant_item
    from stagereplay.records.ledger import read_manifest
    from stagereplay.tasks.base import Item

    out, _ = counted_run
    records = items(read_ledger(out))
    stages = read_manifest(out).stages
    matched = {(r.checkpoint, r.item_id): r.payload for r in records if r.experiment == "matched"}
    lm = load(str(tiny_dir("qwen2")))
    for experiment, work in (("precision_2x2", grid_item), ("transplant", transplant_item)):
        r = next(r for r in records if r.experiment == experiment and r.checkpoint == "primary"
                 and r.part in ("", "bf16") and r.payload["status"] == "ok")
        stage = stages[f"{experiment}/primary"]
        item = Item(r.item_id, tuple(r.payload["prompt_ids"]), r.payload["answer"])
        job = experiment_of(experiment).replay_job(Replay(r, stage, item, stages["matched/primary"],
                                                          matched[("primary", r.item_id)]))
        reuse = job.params.reuse
        assert reuse
        assert work(lm, job).as_payload()["arms"] == r.payload["arms"]  # as recorded: carried over
        wrong = tuple((*x[:-2], x[-2].model_copy(update={"cache_fp": "0" * 64}), x[-1])
                      if experiment == "precision_2x2" else (*x[:-1], x[-1].model_copy(update={"cache_fp": "0" * 64}))
                      for x in reuse)
        again = work(lm, replace(job, params=replace(job.params, reuse=wrong))).as_payload()
        assert not any(a.get("same_as") for a in again["arms"])
        for a, b in zip(again["arms"], r.payload["arms"], strict=True):
            assert (a["name"], a["suffix_ids"], a["cache_fp"]) == (b["name"], b["suffix_ids"], b["cache_fp"])


def test_diagnostic_steps_reach_the_last_first_divergence():
    assert precision_2x2.diagnostic_steps([1, 2, 3, 4], [(1, 2, 3, 4)]) == 1  # no divergence: the first step
    assert precision_2x2.diagnostic_steps([1, 2, 3, 4], [(1, 9, 3, 4), (1, 2, 9)]) == 3
    assert precision_2x2.diagnostic_steps([1, 2], [(1, 2, 3)]) == 2  # a prefix diverges at its end: all of it


def test_construction_spans_are_the_forwards_construct_makes(tiny_dir, monkeypatch):
    """`LM.construct` feeds exactly the spans engine.forwards lists, for every construction."""
    from stagereplay.engine.lm import load

    lm = load(str(tiny_dir("qwen2")))
    state = lm.live(lm.tokenizer.encode("Q: 1+2? Think.\n"), After(9), keep_going=False)
    seen: list[int] = []
    forward = decode.Stepper.forward
    monkeypatch.setattr(decode.Stepper, "forward", lambda self, ids, c, p, **k: seen.append(len(ids)) or forward(
        self, ids, c, p, **k))
    for c in ("oneshot", "incremental", "chunked:4", "retokenized"):
        seen.clear()
        built = lm.construct(state, c)  # retokenized: of the re-encoded prefix's length (the plan assumes a round trip)
        assert seen == construct_forwards(c, state.prompt_len, len(built.prefix)), c
    assert construct_forwards("chunked:4", 3, 12) == [4, 4, 3]  # 11 cached positions, 4 at a time


def test_plan_sizes_a_14b_checkpoint_from_its_config_alone(tmp_path):
    """A directory holding only config.json: caches, weights and forwards from the shape and the lengths."""
    model = tmp_path / "r1-14b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(R1_14B))
    args = ["plan", "--model", str(model), "--n", "200", "--prompt-tokens", "64", "--stage1-tokens", "2048",
            "--suffix-tokens", "512", "--tokens-per-second", "40", "--workers", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "48 layers, 8 KV heads of 128, 14.770B parameters; a cache holds 192 KiB per position" in lines[0]
    row = next(line.split() for line in lines if line.startswith("matched/primary"))
    p, s, n = 64, 2048, 512
    # Per item (README): two prefills of the prompt, two of P + S - 1, 2(S - 1 + N) + 2N single-token forwards,
    # and on a divergent item (all, by default) at most N more: the diagnostics' replay to the divergent step.
    assert int(row[3]) == 200 * (4 + 2 * (s - 1 + n) + 2 * n + n)
    assert int(row[4]) == 200 * (2 * p + 2 * (p + s - 1))
    assert int(row[6]) == 4 and float(row[7]) == pytest.approx(192 * (p + s + n) / 1024, abs=0.05)  # one, MiB
    assert float(row[8]) == pytest.approx(14.770e9 * 2 / 2**20, rel=1e-3)  # bf16 weights, MiB
    # With 166 of 200 items divergent (the reference paper's count), the carried-over arms are decoded in full
    # only on those; with all divergent (the default, a bound) dedup saves only the pair's replay (both arms
    # carried over watch each other). `--audit-sample 0`: the full re-executing audit; by default the plan
    # counts paper's sample.
    runs = [CliRunner().invoke(app, [*args, *extra]) for extra in (
        ["--divergent", "166", "--audit-sample", "0", "--no-dedup"], ["--divergent", "166", "--audit-sample", "0"],
        ["--divergent", "166"], ["--audit-sample", "0", "--no-dedup"], ["--audit-sample", "0"])]
    hours = [float(r.output.splitlines()[-1].split(", ")[3].split()[0]) for r in runs]
    assert hours[0] > hours[1] > hours[2]  # each saving shows; negative control: the full audit costs more
    assert hours[3] > hours[4]
    # `--resample K` adds a stage per precision on the first --resample-items items: two live states (or two
    # incremental ones at fp32), a one-shot prefill, and 5K draws of N steps each.
    k = 3
    drawn = CliRunner().invoke(app, [*args, "--resample", str(k), "--resample-items", "7"])
    rows = {line.split()[0]: line.split() for line in drawn.output.splitlines() if line.startswith("resample/")}
    assert set(rows) == {"resample/primary@bf16", "resample/primary@fp32"}
    for row in rows.values():
        assert int(row[2]) == 7 and int(row[3]) == 7 * (2 * s + 1 + 5 * k * n)
    # `--cache static` prices each cache at its allocation, prompt + stage-1 budget + max new - 1 (LM.cache_len):
    # the default budget of 8192 here, the given one with --max-stage1-tokens; a dynamic cache at P + S + N.
    for extra, positions in (([], p + 8192 + n - 1), (["--max-stage1-tokens", str(s)], p + s + n - 1)):
        static = CliRunner().invoke(app, [*args, "--cache", "static", *extra])
        assert static.exit_code == 0, static.output
        assert f"max new tokens - 1 positions, {positions} at the longest prompt" in static.output
        cached = next(line.split() for line in static.output.splitlines() if line.startswith("matched/primary"))
        assert float(cached[7]) == pytest.approx(192 * positions / 1024, abs=0.05)
    refused = CliRunner().invoke(app, [*args, "--cache", "paged"])
    assert refused.exit_code == 2 and "unknown cache 'paged'" in refused.output
    # Negative control of the shape: 4 KV heads halve the cache.
    (model / "config.json").write_text(json.dumps({**R1_14B, "num_key_value_heads": 4}))
    half = CliRunner().invoke(app, args)
    assert "96 KiB per position" in half.output.splitlines()[0]


@pytest.mark.parametrize(("extra", "message"), [
    (["--audit-sample", "-1"], "--audit-sample must be 0 or more"),
    (["--tokens-per-second", "0"], "--tokens-per-second must be positive"),
    (["--divergent", "500"], "--divergent must lie in 0..--n"),
    (["--select", "first:0"], "unknown --select"),
])
def test_plan_refuses_bad_options_in_one_line(tmp_path, extra, message):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(R1_14B))
    result = CliRunner().invoke(app, ["plan", "--model", str(model), "--prompt-tokens", "64", *extra])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and message in result.output and result.output.count("\n") == 1


def test_plan_without_a_tokenizer_asks_for_the_prompt_length(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(R1_14B))
    result = CliRunner().invoke(app, ["plan", "--model", str(model)])
    assert result.exit_code == 2 and "pass --prompt-tokens N" in result.output


def test_calibrate_measures_positive_rates(tiny_dir):
    from stagereplay.plan.rates import calibrate

    rates = calibrate(str(tiny_dir("qwen2")), ["bf16"], prompt=32, steps=4)
    assert rates.steps["bf16"] > 0 and "calibrated" in rates.source and "dynamic cache" in rates.source
    both = calibrate(str(tiny_dir("qwen2")), ["bf16", "fp32"], prompt=32, steps=4, cache="static")
    assert set(both.steps) == {"bf16", "fp32"} and min(both.steps.values()) > 0 and "static cache" in both.source


@pytest.mark.slow  # a whole run or several: the slow tier (CI runs it)
def test_calibrating_together_times_as_many_fresh_processes(tiny_dir):
    """Workers share the CPU and each steps slower than one alone: `together` measures in that many processes."""
    import os

    from stagereplay.plan.rates import calibrate_each

    each = calibrate_each(2, str(tiny_dir("qwen2")), ["bf16"], prompt=32, steps=4, rounds=1)
    pids = {pid for pid, _ in each}
    assert len(pids) == 2 and os.getpid() not in pids
    assert all(r.steps["bf16"] > 0 and "calibrated" in r.source for _, r in each)


def test_rates_measured_together_are_their_mean():
    from stagereplay.plan.rates import Rates, mean_rates

    a = Rates({"bf16": 100.0, "fp32": 50.0}, {"bf16": 1000.0}, "calibrated on m")
    b = Rates({"bf16": 300.0, "fp32": 150.0}, {"bf16": 3000.0, "fp32": 10.0}, "calibrated on m")
    m = mean_rates([a, b], "2 processes at once")
    assert m.steps == {"bf16": 200.0, "fp32": 100.0}
    assert m.prefill_tokens == {"bf16": 2000.0}  # fp32's prefill rate: measured by one process only
    assert m.source == "calibrated on m, 2 processes at once"


def test_plan_calibrates_as_many_processes_as_cpu_workers(monkeypatch):
    from stagereplay.plan import paper as plan_module

    seen = []

    def measured(model, precisions, device, threads, cache, together, batch=1):
        seen.append((device, together))
        return plan_module.Rates({p: 100.0 for p in precisions})

    monkeypatch.setattr(plan_module, "calibrate", measured)
    for workers in ("1", "2"):
        result = CliRunner().invoke(app, ["plan", "--n", "4", "--calibrate", "--workers", workers])
        assert result.exit_code == 0, result.output
    assert seen == [("cpu", 1), ("cpu", 2)]


def test_plan_of_a_directory_without_a_run_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["plan", str(tmp_path)])
    assert result.exit_code == 2 and "no run in" in result.output


def test_lengths_of_a_record(counted_run):
    out, _ = counted_run
    r = next(r for r in items(read_ledger(out)) if r.experiment == "matched" and r.payload["status"] == "ok")
    n = lengths_of(r)
    assert n.prefix == r.payload["boundary"] and n.stage1 == r.payload["boundary"] - len(r.payload["prompt_ids"])
    assert Path(out).is_dir()


def test_paper_command_and_plan_share_the_audit_sample_default():
    """`paper`'s --audit-sample default is the library's, which `plan` counts by default."""
    from typer.main import get_command

    from stagereplay.cli import app
    from stagereplay.runs import protocol as paper

    command = get_command(app).get_command(None, "paper")
    assert next(p.default for p in command.params if "--audit-sample" in p.opts) == paper.AUDIT_SAMPLE
    assert paper.PaperConfig().audit_sample == paper.AUDIT_SAMPLE


def test_plan_takes_papers_options_with_papers_defaults():
    """`plan` prices what `paper` would run: every option of `paper`'s protocol and of the inputs a plan reads is
    one of `plan`'s, with `paper`'s default (the audit's sample aside: `plan` counts paper's unless told, or what
    RUN's audit did)."""
    from typer.main import get_command

    from stagereplay.cli import app
    from stagereplay.cli.groups import flags_of
    from stagereplay.runs import PaperConfig

    def defaults(name):
        command = get_command(app).get_command(None, name)
        return {o: p.default for p in command.params for o in [*p.opts, *getattr(p, "secondary_opts", [])]}

    paper, plan = defaults("paper"), defaults("plan")
    shared = [f.split("/")[0] for f in flags_of(PaperConfig) if f != "--audit-sample"]
    shared += ["--model", "--data", "--n", "--max-new-tokens", "--max-stage1-tokens", "--device", "--threads",
               "--cache", "--kernels", "--workers"]
    assert {f: plan.get(f, "missing") for f in shared} == {f: paper[f] for f in shared}
    assert plan["--batch"] == 1 and paper["--batch"] == 0  # paper's 0 is "auto"; a plan prices a given C


def test_paper_on_a_gpu_batches_as_many_items_as_their_caches_fit_beside_the_weights(monkeypatch):
    """The default C on a GPU: items whose peak caches (4 per item, fp32, at the longest sequence the context
    allows) fit in 90% of the free memory left after the fp32 weights; at least 1, at most MAX_GPU_BATCH."""
    import torch

    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.plan.stages import model_shape
    from stagereplay.runs.protocol import MAX_GPU_BATCH, gpu_batch
    from stagereplay.toy import toy_checkpoint

    config = json.loads((toy_checkpoint("primary") / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    # The toy's context (512) is shorter than stage-1 budget + suffix: every cache is priced at 512 positions.
    per_item = 4 * 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4 * 512
    weights = model_shape(toy_checkpoint("primary")).weight_bytes("fp32")
    for free, expected in [((weights + 3.5 * per_item) / 0.9, 3), (weights / 2, 1), (1e15, MAX_GPU_BATCH)]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (int(free), int(free)))
        assert gpu_batch(None, "cuda", DecodeConfig(max_new_tokens=128)) == expected


def test_an_experiments_plan_gives_its_time_at_the_rates_given():
    """`attest --plan` (any experiment's) prices its forwards at the rates given, as `plan` prices paper's: each
    stage's hours, and the total in seconds, from the same counts; without rates it counts forwards and gives no time
    (the control). Rates given to a command that runs are refused: they price a plan."""
    args = ["attest", "--n", "20", "--max-new-tokens", "16", "--honest", "bf16,fp32", "--plan"]
    bare = CliRunner().invoke(app, args)
    priced = CliRunner().invoke(app, [*args, "--tokens-per-second", "40", "--prefill-tokens-per-second", "400"])
    assert bare.exit_code == 0 and priced.exit_code == 0, (bare.output, priced.output)
    assert "hours" not in bare.output and "hours" in priced.output, priced.output
    total = next(line for line in priced.output.splitlines() if line.startswith("total:"))
    forwards, prefill = (int(x) for x in re.findall(r"(\d+) forwards, (\d+) prefill tokens", total)[0])
    seconds = float(re.findall(r"\((\d+) s; rates 40 steps/s, 400 prefill tokens/s\)", total)[0])
    assert abs(seconds - (forwards / 40 + prefill / 400)) <= 1, total
    assert next(line for line in bare.output.splitlines() if line.startswith("total:")) in total
    refused = CliRunner().invoke(app, ["attest", "--n", "2", "--tokens-per-second", "40", "--out", "never"])
    assert refused.exit_code == 2 and "price a plan" in refused.output and not Path("never").exists()
