"""Scale-out: `--shard I/N` with `stagereplay merge`, and `--workers N`: each gives the run one process makes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagereplay.cli import app

runner = CliRunner()


def _matched(model, data, out, *extra):
    args = ["matched", "--model", str(model), "--data", str(data), "--n", "6", "--boundary-after", "8",
            "--max-new-tokens", "16", "--out", str(out), "--quiet", *extra]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output + result.stderr
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dir, items_file) -> dict[str, Path]:
    """The run whole, and as its two shards (read only: a test that changes one changes a copy)."""
    root, model = tmp_path_factory.mktemp("shards"), tiny_dir("qwen2")
    return {"whole": _matched(model, items_file, root / "whole"),
            "s0": _matched(model, items_file, root / "s0", "--shard", "0/2"),
            "s1": _matched(model, items_file, root / "s1", "--shard", "1/2")}


def test_merged_shards_equal_the_unsharded_run(tmp_path, runs):
    whole, s0, s1 = runs["whole"], runs["s0"], runs["s1"]
    items = [json.loads(x) for x in (s0 / "ledger.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in items] == ["stage", "environment", "item", "item", "item"]
    result = runner.invoke(app, ["merge", str(s1), str(s0), "--out", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.stderr
    merged = tmp_path / "merged"
    assert (merged / "ledger.jsonl").read_bytes() == (whole / "ledger.jsonl").read_bytes()
    m_whole = json.loads((whole / "manifest.json").read_text())
    m_merged = json.loads((merged / "manifest.json").read_text())
    assert m_merged["config"] == m_whole["config"]
    assert json.loads((merged / "results.json").read_text())["matched"] == \
        json.loads((whole / "results.json").read_text())["matched"]


def test_merge_refuses_mismatched_or_incomplete_shards(tmp_path, tiny_dir, items_file, runs):
    model, s0 = tiny_dir("qwen2"), runs["s0"]
    other = _matched(model, items_file, tmp_path / "other", "--shard", "1/2", "--precision", "fp32")
    result = runner.invoke(app, ["merge", str(s0), str(other), "--out", str(tmp_path / "m1")])
    assert result.exit_code == 2 and "config.model.precision" in result.stderr
    assert not (tmp_path / "m1").exists()
    result = runner.invoke(app, ["merge", str(s0), "--out", str(tmp_path / "m2")])
    assert result.exit_code == 2 and "do not cover the run exactly once" in result.stderr
    twice = tmp_path / "s0-again"
    shutil.copytree(s0, twice)
    result = runner.invoke(app, ["merge", str(s0), str(twice), "--out", str(tmp_path / "m3")])
    assert result.exit_code == 2 and "exactly once" in result.stderr


def test_merge_refuses_shards_of_another_model_and_names_its_hashes(tmp_path, items_file, runs):
    from tiny import save_tiny_model

    s0 = runs["s0"]
    other = save_tiny_model(tmp_path / "other-model", "qwen2", seed=7)
    s1 = _matched(other, items_file, tmp_path / "s1", "--shard", "1/2")
    result = runner.invoke(app, ["merge", str(s0), str(s1), "--out", str(tmp_path / "m")])
    assert result.exit_code == 2 and "different model or tokenizer" in result.stderr
    assert "config.model_hashes.primary.weights" in result.stderr
    assert not (tmp_path / "m").exists()


def test_merge_keeps_each_shards_environment_and_reports_the_difference(tmp_path, runs):
    """Shards computed on two machines merge; each record keeps the environment that computed it."""
    from forge import load, save

    s0, s1 = runs["s0"], Path(shutil.copytree(runs["s1"], tmp_path / "s1"))
    chain, manifest = load(s1)  # as if shard 1 ran elsewhere: another machine's environment
    from stagereplay.records.ledger import sha256_json

    env = next(r for r in chain if r.kind == "environment")
    other = {**env.payload, "machine": f"{env.payload['machine']}-elsewhere"}
    chain = [r.model_copy(update={"env": sha256_json(other), **({"payload": other} if r is env else {})})
             if r.env == env.env else r for r in chain]
    save(s1, chain, manifest)
    assert runner.invoke(app, ["audit", str(s1), "--verify-only"]).exit_code == 0
    result = runner.invoke(app, ["merge", str(s0), str(s1), "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.stderr
    assert "note: shard 0/2 was computed in environment" in result.stderr
    assert "note: shard 1/2 was computed in environment" in result.stderr
    merged = [json.loads(x) for x in (tmp_path / "m" / "ledger.jsonl").read_text().splitlines()]
    machines = sorted(r["payload"]["machine"] for r in merged if r["kind"] == "environment")
    assert machines == [env.payload["machine"], other["machine"]]
    assert runner.invoke(app, ["audit", str(tmp_path / "m"), "--verify-only"]).exit_code == 0


@pytest.mark.slow  # a whole run or several: the slow tier (CI runs it)
def test_two_local_workers_write_the_same_ledger_as_one(tmp_path, tiny_dir, items_file):
    from stagereplay.engine.proof_stores import IN_PROCESS

    model = tiny_dir("qwen2")
    # This process proves the model afresh, as the two workers do: a proof an earlier test left here would be
    # reused, and how far it reached is in the environment record.
    IN_PROCESS.clear()
    one = _matched(model, items_file, tmp_path / "one")
    two = _matched(model, items_file, tmp_path / "two", "--workers", "2")
    assert (two / "ledger.jsonl").read_bytes() == (one / "ledger.jsonl").read_bytes()
