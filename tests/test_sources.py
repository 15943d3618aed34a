"""`--data` as benchmarks are stored (JSONL, JSON, CSV, Parquet, `save_to_disk` folders, `hf:` datasets) and
`--columns`: one dataset in every format gives the same hash and the same items."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest

from stagereplay.errors import StageReplayError
from stagereplay.tasks.jsonl import Row
from stagereplay.tasks.sources import dataset_at, parse_columns, parse_hub, read_rows, rows_sha256

# MATH-style rows (string values only, so that a CSV copy, whose values are all text, is the same rows too).
MATH_ROWS = [
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "answer": "\\frac{3}{4}", "unique_id": "test/algebra/1.json"},
    {"problem": "Solve $x + 2 = 7$.", "answer": "5", "unique_id": "test/algebra/2.json"},
    {"problem": "Which is prime? (A) 4 (B) 7", "answer": "B", "unique_id": "test/number_theory/3.json"},
]


def write_all_formats(rows: list[dict], folder: Path) -> dict[str, str]:
    """The rows as JSONL (one json.dumps per line), JSON, CSV, Parquet, a save_to_disk folder and an hf: folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    specs = {}
    (folder / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    specs["jsonl"] = str(folder / "items.jsonl")
    (folder / "items.json").write_text(json.dumps(rows, indent=2))
    specs["json"] = str(folder / "items.json")
    with open(folder / "items.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    specs["csv"] = str(folder / "items.csv")
    pq.write_table(pa.Table.from_pylist(rows), folder / "items.parquet")
    specs["parquet"] = str(folder / "items.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(folder / "saved"))
    specs["save_to_disk"] = str(folder / "saved")
    hub = folder / "hub" / "data"
    hub.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), hub / "test-00000-of-00001.parquet")
    specs["hf"] = f"hf:{folder / 'hub'}"  # load_dataset on a local folder: what a cached Hub dataset gives
    return specs


def test_one_dataset_in_every_format_has_one_hash_and_the_same_rows(tmp_path):
    specs = write_all_formats(MATH_ROWS, tmp_path)
    read = {kind: read_rows(spec) for kind, spec in specs.items()}
    jsonl_bytes = hashlib.sha256((tmp_path / "items.jsonl").read_bytes()).hexdigest()
    assert {h for _, h in read.values()} == {jsonl_bytes} == {rows_sha256(MATH_ROWS)}
    rows = read["jsonl"][0]
    assert all(r == rows for r, _ in read.values())
    assert rows[0] == Row("test/algebra/1.json", "\\frac{3}{4}", prompt=MATH_ROWS[0]["problem"])  # no mapping


def test_another_dataset_has_another_hash(tmp_path):
    """Negative control: one answer changed changes the hash of every format."""
    changed = [dict(r) for r in MATH_ROWS]
    changed[1]["answer"] = "6"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = write_all_formats(MATH_ROWS, tmp_path / "a"), write_all_formats(changed, tmp_path / "b")
    for kind in first:
        assert read_rows(first[kind])[1] != read_rows(second[kind])[1], kind


def test_jsonl_is_hashed_by_its_bytes():
    """A JSONL file keeps its file hash (existing runs verify); written other than one json.dumps per line, its
    bytes are not its rows' canonical text, so the hash differs from a Parquet copy's: the documented caveat."""
    compact = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in MATH_ROWS)
    assert hashlib.sha256(compact.encode()).hexdigest() != rows_sha256(MATH_ROWS)


def test_columns_map_fields(tmp_path):
    rows = [{"q": "What is 2+2?", "gold": 4, "key": "k1", "extra": 1}]
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mapped, _ = read_rows(path, "prompt=q,answer=gold,id=key")
    assert mapped == [Row("k1", "4", prompt="What is 2+2?")]
    chat, _ = read_rows(path, "user=q,answer=gold,id=key")
    assert chat == [Row("k1", "4", messages=({"role": "user", "content": "What is 2+2?"},))]
    with pytest.raises(StageReplayError, match="no column 'nope'"):
        read_rows(path, "prompt=nope,answer=gold")
    with pytest.raises(StageReplayError, match="missing 'answer'"):  # negative control: unmapped, no answer
        read_rows(path)
    for bad in ("prompt", "query=q", "prompt=q,prompt=key"):
        with pytest.raises(StageReplayError, match="--columns"):
            parse_columns(bad)


def test_gsm8k_rows_need_no_mapping(tmp_path):
    path = tmp_path / "gsm8k.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "2+3?", "answer": "2+3=5\n#### 5"}]), path)
    assert read_rows(path)[0] == [Row("item-00000", "5", prompt="2+3?")]
    chat = read_rows(path, "user=question")[0]  # as a chat, the answer is still the number after ####
    assert chat == [Row("item-00000", "5", messages=({"role": "user", "content": "2+3?"},))]


def test_hub_specs_parse():
    assert parse_hub("hf:HuggingFaceH4/MATH-500") == ("HuggingFaceH4/MATH-500", None, None)
    assert parse_hub("hf:openai/gsm8k:main:test") == ("openai/gsm8k", "main", "test")
    assert parse_hub("hf:org/name::test") == ("org/name", None, "test")
    with pytest.raises(StageReplayError, match="invalid --data"):
        parse_hub("hf:a:b:c:d")


def test_a_dataset_not_in_the_cache_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(StageReplayError) as err:
        read_rows("hf:stagereplay-tests/no-such-dataset:main:test")
    assert "cannot load hf:stagereplay-tests/no-such-dataset" in str(err.value)
    assert "local cache" in str(err.value) and "\n" not in str(err.value)
    assert dataset_at("hf:stagereplay-tests/no-such-dataset") is None  # verify-only: a location, not a finding


def test_a_missing_datasets_package_is_one_clear_error(tmp_path, monkeypatch):
    import sys

    specs = write_all_formats(MATH_ROWS, tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(StageReplayError, match="pip install 'stagereplay\\[datasets\\]'"):
        read_rows(specs["save_to_disk"])
    assert read_rows(specs["parquet"])[0]  # files need no datasets package


def test_bad_files_are_one_line_errors(tmp_path):
    (tmp_path / "obj.json").write_text('{"a": 1}')
    (tmp_path / "bad.parquet").write_text("not parquet")
    (tmp_path / "folder").mkdir()
    for name, message in (("obj.json", "not an array of rows"), ("bad.parquet", "cannot read"),
                          ("folder", "not written by datasets.save_to_disk"), ("missing.csv", "data file not found")):
        with pytest.raises(StageReplayError, match=message):
            read_rows(tmp_path / name)
    lines = tmp_path / "lines.json"  # JSONL named .json
    lines.write_text("".join(json.dumps(r) + "\n" for r in MATH_ROWS))
    assert read_rows(lines)[0] == read_rows(write_all_formats(MATH_ROWS, tmp_path)["jsonl"])[0]


@pytest.mark.slow  # a whole run or several: the slow tier (CI runs it)
def test_toy_items_as_parquet_and_save_to_disk_run_as_the_jsonl_does(tmp_path):
    """The same records (less the environment) and the same dataset hash from the toy's items as JSONL, Parquet
    and a save_to_disk folder; `audit --verify-only` checks the Parquet run's dataset, and sees it changed."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from fixtures.make_toy_golden import without_environment
    from typer.testing import CliRunner

    from stagereplay.cli import app
    from stagereplay.tasks.toy import HELDOUT_SEED, toy_rows

    runner = CliRunner()
    rows = toy_rows(2, HELDOUT_SEED)
    assert runner.invoke(app, ["toy", "items", "--n", "2", "--out", str(tmp_path / "toy.jsonl")]).exit_code == 0
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "toy.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "toy-saved"))
    ledgers, hashes = {}, {}
    for name in ("toy.jsonl", "toy.parquet", "toy-saved"):
        out = tmp_path / f"run-{name}"
        result = runner.invoke(app, ["matched", "--data", str(tmp_path / name), "--max-new-tokens", "48",
                                     "--out", str(out), "--quiet"])
        assert result.exit_code == 0, result.output
        ledgers[name] = without_environment((out / "ledger.jsonl").read_bytes())
        hashes[name] = json.loads((out / "manifest.json").read_text())["config"]["dataset_hash"]
    assert len(set(hashes.values())) == 1 and len(set(ledgers.values())) == 1
    verify = runner.invoke(app, ["audit", str(tmp_path / "run-toy.parquet"), "--verify-only"])
    assert verify.exit_code == 0, verify.output
    rows[0]["answer"] = "1"  # negative control: the Parquet file is no longer the run's dataset
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "toy.parquet")
    verify = runner.invoke(app, ["audit", str(tmp_path / "run-toy.parquet"), "--verify-only"])
    assert verify.exit_code == 1 and "dataset_hash differs" in verify.output


def test_a_run_that_labels_nothing_reads_prompts_whatever_their_answers(tmp_path):
    """mismatch and attest label no response, so their prompts' answers are not read (`unlabelled`): a plain
    `answer` beside a `question`, or none, is a prompt all the same. The control: the protocol's source, which
    labels, refuses the first row (its question makes it a GSM8K row) and the second (no answer)."""
    from typer.testing import CliRunner

    from stagereplay.cli import app
    from stagereplay.tasks.item_sources import source

    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps({"id": "a", "question": "What is 2 + 2?", "answer": "4"}) + "\n"
                    + json.dumps({"id": "b", "prompt": "Say hi."}) + "\n")
    rows, _ = read_rows(data, answers=False)
    assert [(r.id, r.prompt, r.answer) for r in rows] == [("a", "What is 2 + 2?", ""), ("b", "Say hi.", "")]
    with pytest.raises(StageReplayError, match="GSM8K answer has no '#### N' line"):
        read_rows(data)
    (tmp_path / "b.jsonl").write_text(json.dumps({"id": "b", "prompt": "Say hi."}) + "\n")
    with pytest.raises(StageReplayError, match="missing 'answer'"):
        read_rows(tmp_path / "b.jsonl")
    assert source("unlabelled").at(str(data), None) is not None
    runner = CliRunner()
    for command in (["attest", "--honest", "bf16,fp32"], ["mismatch"]):
        planned = runner.invoke(app, [*command, "--data", str(data), "--n", "2", "--max-new-tokens", "4", "--plan"])
        assert planned.exit_code == 0, planned.output
    refused = runner.invoke(app, ["matched", "--data", str(data), "--n", "2", "--plan"])
    assert refused.exit_code == 2 and "GSM8K answer has no '#### N' line" in refused.output, refused.output
