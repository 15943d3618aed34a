"""The paper's protocol on tiny random Qwen2 checkpoints: 2x2, bridge, transplant (with controls), audit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from forge import carry_over, load, save, with_payload
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.experiments.core.stats import wilson_interval
from stagereplay.records.ledger import Record

runner = CliRunner()


pytestmark = [pytest.mark.slow, pytest.mark.capture]  # a whole `paper` run and four audits of it, steps captured as a
# user's are: the slow tier (CI runs it)


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory, tiny_dir, items_file) -> Path:
    from tiny import save_tiny_model

    later = save_tiny_model(tmp_path_factory.mktemp("later") / "qwen2", "qwen2", seed=1)
    out = tmp_path_factory.mktemp("paper") / "run"
    result = runner.invoke(app, ["paper", "--model", str(tiny_dir("qwen2")), "--later-model", str(later),
                                 "--data", str(items_file), "--n", "16", "--boundary-after", "16",
                                 "--max-new-tokens", "32", "--rows", "6", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output + str(result.exception)
    return out


def _results(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


def test_paper_runs_every_stage(paper_run):
    res = _results(paper_run)
    assert [m["checkpoint"] for m in res["matched"]] == ["primary", "later"]
    assert [t["checkpoint"] for t in res["transplant"]] == ["primary", "later"]
    assert res["precision_2x2"]["precisions"] == ["bf16", "fp32"]
    assert res["audit"]["reproduced"] is True
    for name in ("manifest.json", "ledger.jsonl", "results.json", "report.md", "report.html", "audit.json"):
        assert (paper_run / name).exists()


def test_bf16_disagreements_recur_in_the_2x2(paper_run):
    res = _results(paper_run)
    by = {d["precision"]: d for d in res["precision_2x2"]["disagreements"]}
    assert by["bf16"]["k"] >= 1, "needs bf16 divergence with this CPU's kernels; the equality below holds anywhere"
    # In bf16, incremental is bit-exact with live, so its disagreements with oneshot are the matched ones.
    assert by["bf16"]["k"] == res["matched"][0]["suffix_disagreements"]["k"]
    fp32 = by["fp32"]
    assert fp32["n"] == by["bf16"]["n"] == 16
    assert fp32["wilson"] == list(wilson_interval(fp32["k"], fp32["n"]))


def test_bridge_is_bit_exact_on_every_row(paper_run):
    bridge = _results(paper_run)["bridge"]
    assert bridge["rows"] == 6
    assert bridge["cache_bit_exact"] == 6 and bridge["suffix_equal"] == 6


def test_all_layer_transplant_follows_donor_and_zero_layer_control_follows_recipient(paper_run):
    for t in _results(paper_run)["transplant"]:
        assert t["n_items"] >= 1, "a random bf16 Qwen2 should diverge on some of 16 items"
        assert len(t["directions"]) == 2
        for d in t["directions"]:
            assert d["follows_donor"] == d["n"] == t["n_items"]
        for d in t["control"]["directions"]:
            assert d["follows_recipient"] == d["n"] and d["follows_donor"] == 0


def test_transplant_selection_is_frozen_in_the_manifest(paper_run):
    manifest = json.loads((paper_run / "manifest.json").read_text())
    primary = manifest["stages"]["transplant/primary"]
    later = manifest["stages"]["transplant/later"]
    assert primary["config"]["select"] == "first:24" and later["config"]["select"] == "all-divergent"
    records = [json.loads(x) for x in (paper_run / "ledger.jsonl").read_text().splitlines()]
    done = sorted(r["item_id"] for r in records if r["kind"] == "item" and r["experiment"] == "transplant"
                  and r["checkpoint"] == "later")
    assert done == later["selected"]


def test_layer_sweep_finds_a_smallest_band(paper_run, tmp_path):
    run = _copy(paper_run, tmp_path)
    result = runner.invoke(app, ["transplant", str(run), "--checkpoint", "later", "--sweep", "--quiet"])
    # The later checkpoint's all-divergent transplant already exists with another configuration: refused, named.
    assert result.exit_code == 2 and "config.sweep" in result.stderr
    fresh = tmp_path / "sweep"
    shutil.copytree(paper_run, fresh)
    manifest = json.loads((fresh / "manifest.json").read_text())
    # Drop the transplant stages to run a sweep in their place (records too, re-chained).
    for key in [k for k in manifest["stages"] if k.startswith("transplant/")]:
        del manifest["stages"][key]
    (fresh / "manifest.json").write_text(json.dumps(manifest))
    chain, _ = load(fresh)
    save(fresh, [r for r in chain if r.experiment != "transplant"], manifest)
    result = runner.invoke(app, ["transplant", str(fresh), "--sweep", "--select", "first:3", "--quiet"])
    assert result.exit_code == 0, result.output
    sweep = _results(fresh)["transplant"][0]["sweep"]
    assert sweep["n_layers"] == 4
    assert len(sweep["rows"]) == 3 * 4 * 2  # single, bottom and top bands, both directions
    for direction, layers in sweep["smallest_band"].items():
        assert layers == sorted(layers) and layers == list(range(layers[0], layers[-1] + 1)), direction
    # The whole stack is a bottom band and must carry the trajectory whenever the all-layer transplant does.
    full = [r for r in sweep["rows"] if r["kind"] == "bottom" and len(r["layers"]) == 4]
    assert all(r["follows_donor"] == r["n"] for r in full)


def test_audit_reproduces_an_untouched_run(paper_run, tmp_path):
    run = _copy(paper_run, tmp_path)
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 0, result.output
    audit = json.loads((run / "audit.json").read_text())
    assert audit["trajectories"]["k"] == audit["trajectories"]["n"] > 0
    assert audit["comparisons"]["k"] == audit["comparisons"]["n"] > 0


def test_the_audit_reexecutes_the_units_of_one_model_setting_as_one_batch_of_jobs(paper_run, tmp_path, monkeypatch):
    """Every stage's units on the same model settings go out together (at --batch C they step together), not a
    stage at a time: one call per model setting, whatever the stages."""
    import stagereplay.execution.executors as jobs

    calls: list[tuple[tuple[str, str], set[str]]] = []
    run_jobs = jobs.run_jobs

    def spy(config, work, units, ex, lm=None, machine_store=None):
        calls.append(((Path(config.path).parent.name, config.precision), {u.params.experiment for u in units}))
        return run_jobs(config, work, units, ex, lm, machine_store)

    monkeypatch.setattr(jobs, "run_jobs", spy)
    result = runner.invoke(app, ["audit", str(_copy(paper_run, tmp_path)), "--quiet"])
    assert result.exit_code == 0, result.output
    settings = [setting for setting, _ in calls]
    assert len(settings) == len(set(settings)) == 3, settings  # the primary in bf16 and fp32, the later in bf16
    experiments = sorted(calls, key=lambda c: -len(c[1]))[0][1]
    assert experiments == {"matched", "bridge", "transplant", "precision_2x2"}


def test_audit_catches_one_changed_byte(paper_run, tmp_path):
    run = _copy(paper_run, tmp_path)
    data = bytearray((run / "ledger.jsonl").read_bytes())
    at = data.index(b'"suffix_ids":[') + len(b'"suffix_ids":[')
    data[at] = ord("9") if data[at] != ord("9") else ord("8")
    (run / "ledger.jsonl").write_bytes(bytes(data))
    assert runner.invoke(app, ["audit", str(run), "--verify-only"]).exit_code == 1
    assert runner.invoke(app, ["audit", str(run), "--quiet"]).exit_code == 1


def test_audit_reexecution_catches_what_the_hash_chain_cannot(paper_run, tmp_path):
    """Change one suffix token with its fingerprint, recompute the comparisons and every hash: the chain and
    every recorded claim agree, and only re-execution can tell (tests/test_forgery.py has the whole table)."""
    run = _copy(paper_run, tmp_path)
    chain, manifest = load(run)
    # A pair that already diverges after its first token stays divergent, so the transplant selection holds.
    k, target = next((k, r) for k, r in enumerate(chain) if r.kind == "item" and r.experiment == "matched"
                     and r.payload["status"] == "ok" and (r.payload["comparisons"][0]["first_divergence"] or 0) > 0)
    payload = json.loads(json.dumps(target.payload))
    arm = payload["arms"][2]  # the oneshot arm
    arm["suffix_ids"][0] = (arm["suffix_ids"][0] + 1) % 50
    chain[k] = with_payload(target, payload)
    carry_over(chain, k)  # and the 2x2's copy of the arm (same_as)
    save(run, chain, manifest)
    verify = runner.invoke(app, ["audit", str(run), "--verify-only"])
    assert verify.exit_code == 0, verify.stderr  # the chain and every recorded claim agree
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 1
    assert f"{target.item_id}: arm oneshot: suffix_ids not reproduced" in result.stderr


def test_audit_reexecution_checks_the_diagnostics(paper_run, tmp_path):
    """A margin or a cache difference the model does not reproduce is a mismatch, even with an intact chain."""
    run = _copy(paper_run, tmp_path)
    chain, manifest = load(run)
    k, target = next((k, r) for k, r in enumerate(chain) if r.kind == "item" and r.experiment == "precision_2x2"
                     and r.payload["diagnostics"]["pairs"])
    payload = json.loads(json.dumps(target.payload))
    pair = next(iter(payload["diagnostics"]["pairs"]))
    payload["diagnostics"]["pairs"][pair]["cache"]["layers"][0]["k"]["rel_l2"] += 1e-3
    chain[k] = target.model_copy(update={"payload": payload})
    save(run, chain, manifest)
    assert runner.invoke(app, ["audit", str(run), "--verify-only"]).exit_code == 0
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 1
    assert f"{target.item_id}: diagnostics.pairs.{pair}.cache.layers.0.k.rel_l2 not reproduced" in result.stderr


def test_every_comparison_of_the_protocol_has_diagnostics(paper_run):
    """matched, 2x2 and bridge records: a step-1 logit difference per pair, cache differences for non-replicas."""
    records = [Record.model_validate_json(x) for x in (paper_run / "ledger.jsonl").read_text().splitlines()]
    for r in records:
        if r.kind != "item" or r.experiment in ("transplant", "resample") or r.payload["status"] != "ok":
            continue
        pairs = r.payload["diagnostics"]["pairs"]
        assert set(pairs) == {f"{c['a']} vs {c['b']}" for c in r.payload["comparisons"]}
        for name, diag in pairs.items():
            assert (diag["cache"] is None) == ("#replica" in name), name
        if r.experiment == "bridge":  # incremental is bit-exact with live: no difference anywhere
            cache = pairs["live vs incremental"]["cache"]
            assert all(row["k"]["n_diff"] == row["v"]["n_diff"] == 0 for row in cache["layers"])
    res = _results(paper_run)
    fp32 = next(d for d in res["precision_2x2"]["disagreements"] if d["precision"] == "fp32")
    bf16 = next(d for d in res["precision_2x2"]["disagreements"] if d["precision"] == "bf16")
    assert max(fp32["first_step_logit_maxabs"].values()) < min(v for v in bf16["first_step_logit_maxabs"].values() if v)
