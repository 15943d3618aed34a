"""Mismatch: rollout vs trainer log-probabilities on the same tokens, each property with a negative control.

- the rollout's tokens are generate()'s for the same settings and seed, and its log-probabilities are the drawing
  logits' (control: another seed draws other tokens);
- our engine against itself: the rollout, its teacher-forced incremental score and the replicas are the same bits
  (in fp32 too), and the one-shot prefill is the trainer's at the same precision (control: a perturbation planted
  in one logit at one position is found at that position and nowhere else);
- every side scores the same token IDs (control: a record whose arm scored other tokens is a finding of verify);
- the transplant moves the log-probabilities after it to the donor, and the zero-layer control does not;
- processed log-probabilities are the sampler's warped distribution (control: raw ones are not);
- a rollout file is audited against the trainer with no engine, and a malformed file is refused in one line;
- the run verifies, re-executes clean in the audit, and plan prices it;
- `compare` of two rollout files finds a planted log-probability and nothing else (control: the same file twice);
- with --micro-batch the trainer also scores each sequence inside a micro-batch: the row "batch composition"
  appears (fp32 within 1e-4 of alone), its record re-executes in the audit (control: a run without it has no such
  row or arm).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import load
from stagereplay.engine.scoring import chosen, rollout, score_incremental, score_oneshot
from stagereplay.experiments.mismatch.stats import Pair, metrics
from stagereplay.experiments.mismatch.summary import MismatchSummary
from stagereplay.records import arrays
from stagereplay.records.ledger import items, read_ledger

runner = CliRunner()
PROMPT = "Q: what is 12+7? Think.\n"
SAMPLED = DecodeConfig(max_new_tokens=20, sample=True, temperature=1.0)


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """A mismatch run of the toy: 3 sampled rollouts of 20 tokens, trainers at bf16 and fp32."""
    out = tmp_path_factory.mktemp("mismatch") / "run"
    result = runner.invoke(app, ["mismatch", "--n", "3", "--max-new-tokens", "20", "--sample", "--quiet",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _arms(run, part=""):
    return {r.item_id: {a["name"]: arrays.decode(a["logprobs"]) for a in r.payload["arms"]}
            for r in items(read_ledger(run)) if r.experiment == "mismatch" and r.part == part}


def _section(run) -> MismatchSummary:
    return MismatchSummary.model_validate(json.loads((run / "results.json").read_text())["mismatch"][0])


def _row(run, label):
    return _section(run).row(label)


def test_a_rollout_is_generates_draw_and_its_logprobs_are_the_drawing_logits(tiny_dir):
    lm = load(str(tiny_dir("qwen2")), precision="bf16")
    prompt = lm.tokenizer.encode(PROMPT)
    tokens, scored = rollout(lm, prompt, 20, SAMPLED, seed=3, mode="raw")
    assert tokens == lm.generate(prompt, 20, SAMPLED, seed=3)
    assert rollout(lm, prompt, 20, SAMPLED, seed=4, mode="raw")[0] != tokens  # control: another seed
    # Each recorded log-probability is the log_softmax of the logits that drew the token (teacher-forced here).
    again = score_incremental(lm, prompt, tokens, SAMPLED, "raw")
    assert np.array_equal(again.logprobs.view(np.uint32), scored.logprobs.view(np.uint32))


def test_processed_logprobs_are_the_samplers_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    dc = DecodeConfig(sample=True, temperature=0.5, top_k=2)
    processed, _ = chosen(logits, torch.tensor([1]), "processed", dc)
    expected = torch.log_softmax(torch.tensor([[4.0, 2.0, -float("inf"), -float("inf")]]), dim=-1)[0, 1]
    assert torch.equal(processed[0], expected)
    raw, _ = chosen(logits, torch.tensor([1]), "raw", dc)
    assert not torch.equal(raw[0], expected)  # control: the raw distribution is another one
    removed, _ = chosen(logits, torch.tensor([3]), "processed", dc)
    assert removed[0] == -float("inf")  # a token top-k removes has no probability under the processed one


def test_our_engine_against_itself_is_bitwise_zero_in_fp32_and_a_planted_logit_is_found_where_planted(tiny_dir):
    lm = load(str(tiny_dir("qwen2")), precision="fp32")
    prompt = lm.tokenizer.encode(PROMPT)
    tokens, live = rollout(lm, prompt, 24, SAMPLED, seed=1, mode="raw")
    incremental = score_incremental(lm, prompt, tokens, SAMPLED, "raw")
    oneshot, again = (score_oneshot(lm, prompt, tokens, SAMPLED, "raw") for _ in range(2))
    for a, b in ((live, incremental), (oneshot, again)):
        summary = metrics([Pair(a.logprobs, b.logprobs)])
        assert summary["bitwise_equal"] == 1.0 and summary["abs_max"] == 0.0 and summary["k3_kl"] == 0.0
    # The control: one logit moved at one position of the teacher-forced score moves that token's log-probability,
    # and no other (teacher-forced, a position's log-probability reads the tokens, never the logits before it).
    planted = 7
    original = lm.stepper.forward
    calls = {"n": 0}

    def nudged(ids, cache, past, device_token=None, prompt=()):
        logits = original(ids, cache, past, device_token=device_token, prompt=prompt)
        calls["n"] += 1
        if calls["n"] == planted + 1:  # the forward whose logits score response token `planted`
            logits = logits.clone()
            logits[tokens[planted]] += 0.25
        return logits

    lm.stepper.forward = nudged
    moved = score_incremental(lm, prompt, tokens, SAMPLED, "raw")
    lm.stepper.forward = original
    differs = np.flatnonzero(moved.logprobs.view(np.uint32) != live.logprobs.view(np.uint32))
    assert differs.tolist() == [planted]


def test_the_run_attributes_the_gap_on_one_set_of_tokens(toy_run):
    main = [r for r in items(read_ledger(toy_run)) if r.experiment == "mismatch"]
    by_item: dict[str, set[str]] = {}
    for r in main:
        for arm in r.payload["arms"]:
            if not arm["name"].endswith("#replica"):
                by_item.setdefault(r.item_id, set()).add(arm["tokens_fp"])
    assert len(by_item) == 3 and all(len(fps) == 1 for fps in by_item.values())  # every side, the same tokens
    for label in ("bridge", "engine", "replica: rollout", "replica: prefill", "replica: trainer@bf16",
                  "replica: trainer@fp32"):
        row = _row(toy_run, label).metrics
        assert row.bitwise_equal == 1.0 and row.abs_max == 0.0, label
    assert _row(toy_run, "precision bf16 -> fp32").metrics.bitwise_equal < 1.0  # bf16 and fp32 trainers differ
    section = _section(toy_run)
    replicas = section.replica_tokens_equal
    assert replicas is not None and (replicas.k, replicas.n) == (3, 3) and section.tokens == 60
    total = _row(toy_run, "total")
    assert total.metrics.tokens == 60 and total.ci.k3_kl is not None and total.metrics.sequence_is_mean is not None


def test_micro_batches_add_the_batch_composition_row_and_re_execute(toy_run, tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["mismatch", "--n", "2", "--max-new-tokens", "12", "--sample", "--transplant-at", "0",
                                 "--micro-batch", "3", "--micro-batch-layout", "packed", "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    for precision in ("bf16", "fp32"):
        arms = _arms(out, precision)
        assert len(arms) == 2 and all(f"trainer@{precision}#batch" in a for a in arms.values())
        row = _row(out, f"batch composition @ {precision}")
        assert row is not None and row.metrics.tokens == sum(a[f"trainer@{precision}"].size for a in arms.values())
    fp32 = _row(out, "batch composition @ fp32")
    assert fp32 is not None and fp32.metrics.abs_max is not None and fp32.metrics.abs_max < 1e-4
    audited = runner.invoke(app, ["audit", str(out), "--quiet"])
    assert audited.exit_code == 0 and json.loads((out / "audit.json").read_text())["reproduced"], audited.output
    # The control: a run made without --micro-batch has neither the arm nor the row.
    assert not any(p.row.startswith("batch composition") for p in _section(toy_run).pairs)
    assert not any(name.endswith("#batch") for a in _arms(toy_run, "bf16").values() for name in a)


def test_a_record_whose_arm_scored_other_tokens_is_a_finding(toy_run, tmp_path):
    import shutil

    from forge import load, save

    from stagereplay.audit.verify import verify_run
    from stagereplay.records.ledger import read_manifest

    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    assert verify_run(run, read_manifest(run)).reproduced  # the control: as made, it verifies
    chain, manifest = load(run)
    forged = next(r for r in chain if r.kind == "item" and r.experiment == "mismatch" and r.part == "fp32")
    payload = json.loads(json.dumps(forged.payload))
    payload["arms"][0]["tokens_fp"] = "0" * 64
    chain[forged.seq] = forged.model_copy(update={"payload": payload})
    save(run, chain, manifest)
    found = [m.what for m in verify_run(run, read_manifest(run)).findings]
    assert any("trainer@fp32: scored other tokens" in w for w in found), found


def test_the_transplant_moves_the_logprobs_to_the_donor_and_the_control_does_not(toy_run):
    moved = _section(toy_run).transplant
    assert moved is not None
    assert all(d.follows_donor == d.n == 3 for d in moved.directions)
    assert all(d.follows_recipient == d.n == 3 for d in moved.control)


def test_the_run_verifies_and_its_audit_re_executes_it(toy_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    audited = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert audited.exit_code == 0, audited.output
    summary = json.loads((run / "audit.json").read_text())
    assert summary["reproduced"] and summary["records"] == 3 * 3
    planned = runner.invoke(app, ["plan", str(run)])
    assert planned.exit_code == 0 and "mismatch/primary" in planned.output, planned.output


def _write_rollouts(run, path, *, edit=None, name_map=None) -> None:
    """The run's own rollouts as a rollout file (JSONL), as an RL framework dumps them."""
    rows = []
    for r in items(read_ledger(run)):
        if r.experiment != "mismatch" or r.part:
            continue
        lps = arrays.decode(next(a for a in r.payload["arms"] if a["name"] == "rollout")["logprobs"])
        row = {"id": r.item_id, "prompt_ids": r.payload["prompt_ids"], "response_ids": r.payload["response_ids"],
               "logprobs": [float(x) for x in lps]}
        if edit is not None:
            edit(row)
        rows.append({(name_map or {}).get(k, k): v for k, v in row.items()})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_rollout_file_is_audited_against_the_trainer_and_a_planted_logprob_is_found(toy_run, tmp_path):
    """The run's own rollouts written as a file and audited with no engine: the file's log-probabilities are the
    incremental score's bit for bit; one log-probability changed in the file is the one token that differs."""
    good, bad = tmp_path / "rollouts.jsonl", tmp_path / "planted.jsonl"
    _write_rollouts(toy_run, good, name_map={"prompt_ids": "q", "response_ids": "r", "logprobs": "lp"})

    def plant(row):
        row["logprobs"][5] = row["logprobs"][5] - 0.5

    _write_rollouts(toy_run, bad, edit=plant)
    common = ["--precisions", "bf16", "--transplant-at", "0", "--quiet"]
    ran = runner.invoke(app, ["mismatch", "--rollouts", str(good), "--columns",
                              "prompt_ids=q,response_ids=r,logprobs=lp", *common, "--out", str(tmp_path / "a")])
    assert ran.exit_code == 0, ran.output
    assert _row(tmp_path / "a", "bridge").metrics.bitwise_equal == 1.0
    ran = runner.invoke(app, ["mismatch", "--rollouts", str(bad), *common, "--out", str(tmp_path / "b")])
    assert ran.exit_code == 0, ran.output
    file_arms = _arms(tmp_path / "b")
    for arms in file_arms.values():
        differs = np.flatnonzero(arms["rollout"].view(np.uint32) != arms["incremental"].view(np.uint32))
        assert differs.tolist() == [5]
    verified = runner.invoke(app, ["audit", str(tmp_path / "b"), "--verify-only"])
    assert verified.exit_code == 0, verified.output


def test_compare_of_two_rollout_files_finds_the_one_planted_logprob_and_nothing_else(toy_run, tmp_path):
    """Two rollout files of the same prompts and tokens, one with a log-probability moved per item: `compare` finds
    the tokens equal, exactly one rollout log-probability per item differing (by what was planted) and the
    trainer's unmoved. Control: a file against a run of the same file finds nothing. The generated run against a file
    of its own tokens compares on those tokens (every rollout the same); runs of other prompts are refused in one
    line."""
    good, bad, other = tmp_path / "rollouts.jsonl", tmp_path / "planted.jsonl", tmp_path / "other.jsonl"
    _write_rollouts(toy_run, good)
    _write_rollouts(toy_run, bad, edit=lambda row: row["logprobs"].__setitem__(5, row["logprobs"][5] - 0.5))
    _write_rollouts(toy_run, other, edit=lambda row: row.update(prompt_ids=row["prompt_ids"][1:]))
    for name, path in (("a", good), ("b", bad), ("c", good), ("d", other)):
        ran = runner.invoke(app, ["mismatch", "--rollouts", str(path), "--precisions", "bf16", "--transplant-at",
                                  "0", "--quiet", "--out", str(tmp_path / name)])
        assert ran.exit_code == 0, ran.output

    def sides(a, b):
        done = runner.invoke(app, ["compare", str(tmp_path / a), str(tmp_path / b), "--out", str(tmp_path / f"{a}{b}")])
        assert done.exit_code == 0, done.output
        doc = json.loads((tmp_path / f"{a}{b}" / "compare.json").read_text())
        assert doc["kind"] == "mismatch" and doc["items"] == doc["tokens_equal"] == 3
        return doc, {p["side"]: p["metrics"] for p in doc["pairs"]}

    doc, planted = sides("a", "b")
    assert planted["rollout"]["bitwise_equal"] == 1 - 3 / planted["rollout"]["tokens"]
    assert planted["rollout"]["abs_max"] == pytest.approx(0.5, abs=1e-3)
    assert planted["trainer@bf16"]["bitwise_equal"] == 1.0  # the trainer scored the same tokens: unmoved
    assert [d["field"] for d in doc["differences"]["settings"]] == ["config.dataset_hash"]
    assert "rollout" in (tmp_path / "ab" / "compare.md").read_text()
    _, same = sides("a", "c")
    assert same["rollout"]["bitwise_equal"] == same["trainer@bf16"]["bitwise_equal"] == 1.0  # control
    own = runner.invoke(app, ["compare", str(toy_run), str(tmp_path / "a"), "--out", str(tmp_path / "ta")])
    assert own.exit_code == 0, own.output
    assert json.loads((tmp_path / "ta" / "compare.json").read_text())["tokens_equal"] == 3
    refused = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "d"), "--out", str(tmp_path / "ad")])
    lines = refused.stderr.strip().splitlines()
    assert refused.exit_code == 2 and len(lines) == 1 and "hold other prompts" in lines[0], refused.stderr


@pytest.mark.parametrize(("edit", "says"), [
    (lambda row: row.update(response_ids=[*row["response_ids"], 10**9]), "not a token ID of this tokenizer"),
    (lambda row: row.update(logprobs=row["logprobs"][:-1]), "logprobs for"),
    (lambda row: row.pop("logprobs"), "has no column 'logprobs'"),
    (lambda row: row["logprobs"].__setitem__(0, float("nan")), "not a finite log-probability"),
    (lambda row: row["logprobs"].__setitem__(0, 0.5), "not a finite log-probability"),
    (lambda row: row.update(prompt_ids=[]), "prompt_ids is not a non-empty list"),
    (lambda row: row.update(id="dup"), "duplicate id 'dup'"),
])
def test_a_malformed_rollout_file_is_refused_in_one_line_naming_the_row(toy_run, tmp_path, edit, says):
    path = tmp_path / "rollouts.jsonl"
    _write_rollouts(toy_run, path, edit=edit)
    result = runner.invoke(app, ["mismatch", "--rollouts", str(path), "--quiet", "--out", str(tmp_path / "run")])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and says in lines[0] and "; " in lines[0], result.stderr
    assert "line " in lines[0]  # the row is named
    assert not (tmp_path / "run").exists()


def test_part_one_on_a_serving_engine_is_the_same_skeleton_as_on_ours(tiny_dir):
    """A serving engine that samples and scores with our own engine's functions gives part '' the arms ours gives,
    bit for bit and in the same order, with its name on the arms it computed (control: another seed draws another
    rollout)."""
    from stagereplay.engine.decode import derive_seed
    from stagereplay.experiments.core.jobs import Job, ReplaySettings
    from stagereplay.experiments.mismatch.item import MismatchParams, mismatch_item, rollout_part
    from stagereplay.experiments.mismatch.served import ServedEngine
    from stagereplay.serving.seam import Generation, PromptScores, Samples, Sampling, ScoresPrompt
    from stagereplay.tasks.base import Item

    lm = load(str(tiny_dir("qwen2")), precision="bf16")
    dc = DecodeConfig(max_new_tokens=12, sample=True, temperature=1.0, seed=4)

    class Ours(Samples, ScoresPrompt):
        name = "ours-served"

        def __init__(self, seed_offset: int = 0):
            self.offset = seed_offset

        def sample(self, ids, max_tokens, sampling):
            tokens, scored = rollout(lm, ids, max_tokens, dc, derive_seed(dc.seed, "q", "rollout") + self.offset,
                                     "raw")
            return Generation(tuple(tokens), (), None, "stop" if tokens[-1] in lm.eos else "length",
                              chosen=tuple(float(x) for x in scored.logprobs))

        def score(self, ids, start, sampling):
            scored = score_oneshot(lm, ids[:start], ids[start:], dc, "raw")
            return PromptScores(tuple(float(x) for x in scored.logprobs), tuple(int(x) for x in scored.argmax))

        def precision_name(self):
            return "bf16"

    job = Job(Item("q", tuple(lm.tokenizer.encode(PROMPT)), ""), ReplaySettings("after:1", dc),
              MismatchParams("", "raw", "generated"))
    ours = mismatch_item(lm, job).as_payload()
    sampling = Sampling.of(True, 1.0, 0, 1.0, 0)
    served = rollout_part(lm, job, job.params, ServedEngine(Ours(), sampling, "raw", True, dc.max_new_tokens)
                          ).as_payload()
    assert [a["name"] for a in served["arms"]] == [a["name"] for a in ours["arms"]]
    for a, b in zip(served["arms"], ours["arms"], strict=True):
        assert a["logprobs"] == b["logprobs"] and a["tokens_fp"] == b["tokens_fp"], a["name"]
        assert a["engine"] == ("hf" if a["name"] == "incremental" else "ours-served")
    assert served["response_ids"] == ours["response_ids"] and served["sampling"] == sampling.as_dict()
    other = rollout_part(lm, job, job.params, ServedEngine(Ours(1), sampling, "raw", False, dc.max_new_tokens)
                         ).as_payload()
    assert other["response_ids"] != ours["response_ids"]  # control
    assert [a["name"] for a in other["arms"]] == ["rollout", "rollout#replica", "incremental"]  # no prefill asked


@pytest.mark.parametrize(("args", "says"), [
    (["--micro-batch", "1"], "--micro-batch 1 is not a micro-batch"),
    (["--micro-batch-layout", "packed"], "none is asked for"),
    (["--micro-batch", "2", "--batch", "2"], "No such option: --batch"),
])
def test_micro_batch_options_that_mean_nothing_are_refused_in_one_line(tmp_path, args, says):
    result = runner.invoke(app, ["mismatch", *args, "--quiet", "--out", str(tmp_path / "run")])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and says in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


def test_the_verdict_tells_the_toys_gap_from_rollouts_scored_with_another_tokenizer(toy_run, tmp_path):
    """The toy's rollouts read 'not bit for bit, negligible'; the same rows with every token ID mapped to another
    valid one (another tokenizer's IDs, the file's log-probabilities kept) read 'wrong model', their sequence
    weights named as clamped."""
    from stagereplay.experiments.mismatch.verdict import mismatch_verdict

    def seen(run):
        return next(f.phrase for f in mismatch_verdict(_section(run)) if f.question.key == "trainer sees rollout")

    def remap(row):
        row.update(prompt_ids=[t * 7919 % 250 + 3 for t in row["prompt_ids"]],
                   response_ids=[t * 7919 % 250 + 3 for t in row["response_ids"]])

    path = tmp_path / "other.jsonl"
    _write_rollouts(toy_run, path, edit=remap)
    ran = runner.invoke(app, ["mismatch", "--rollouts", str(path), "--precisions", "bf16", "--transplant-at", "0",
                              "--quiet", "--out", str(tmp_path / "other")])
    assert ran.exit_code == 0, ran.output
    toy, other = seen(toy_run), seen(tmp_path / "other")
    assert "size negligible" in toy and "another tokenizer or model" not in toy and "clamp" not in toy
    assert "size wrong model" in other and "another tokenizer or model" in other
    assert "sequence weights is at the clamp" in other
