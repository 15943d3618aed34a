"""Reliability: SIGKILL and resume, torn writes, locking, tamper evidence, and one clear error per bad input."""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagereplay.audit.reexecute import verify_ledger
from stagereplay.cli import app
from stagereplay.errors import StageReplayError
from stagereplay.records.ledger import open_run
from stagereplay.records.manifest import Manifest

runner = CliRunner()
FIXTURES = Path(__file__).parent / "fixtures"


def _args(model: Path, data: Path, out: Path, n: int = 16) -> list[str]:
    return ["matched", "--model", str(model), "--data", str(data), "--n", str(n), "--boundary-after", "8",
            "--max-new-tokens", "24", "--out", str(out), "--quiet"]


def _cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "stagereplay.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(run: Path) -> list[dict]:
    """Every record of the chain: stage and environment records, then items."""
    return [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]


def _items(run: Path) -> list[dict]:
    return [r for r in _records(run) if r["kind"] == "item"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_dir, items_file) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    result = runner.invoke(app, _args(tiny_dir("qwen2"), items_file, out))
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow  # kills and resumes a run many times: the slow tier
def test_sigkill_at_random_points_then_resume_equals_an_uninterrupted_run(tmp_path, tiny_dir, items_file, reference):
    out = tmp_path / "run"
    args = _args(tiny_dir("qwen2"), items_file, out)
    rng = random.Random(2026)
    kills, progress = 0, []
    while kills < 6:
        proc = _cli(*args)
        time.sleep(rng.uniform(1.0, 6.0))
        if proc.poll() is not None:  # finished before the kill: start over from a fresh folder's copy
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        progress.append(len(_records(out)) if (out / "ledger.jsonl").exists() else 0)
        if (out / ".lock").exists():  # a dead holder's pid is left behind; the next start must recover the lock
            holder = int((out / ".lock").read_text().strip())
            with pytest.raises(ProcessLookupError):
                os.kill(holder, 0)
    assert kills >= 5, f"only {kills} kills landed before the run finished"
    final = subprocess.run([sys.executable, "-m", "stagereplay.cli", *args], capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    got, want = _records(out), _records(reference)
    assert [r["seq"] for r in got] == list(range(len(want)))  # no gaps
    assert len({r["item_id"] for r in _items(out)}) == len(_items(out)) == 16  # no duplicates
    assert [r["hash"] for r in got] == [r["hash"] for r in want]  # same content, same chain
    assert (out / "ledger.jsonl").read_bytes() == (reference / "ledger.jsonl").read_bytes()
    assert progress == sorted(progress)


def test_torn_last_line_is_set_aside_and_redone(tmp_path, tiny_dir, items_file, reference):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    lines = (out / "ledger.jsonl").read_bytes().splitlines(keepends=True)
    torn = lines[-1][: len(lines[-1]) // 2]
    (out / "ledger.jsonl").write_bytes(b"".join(lines[:-1]) + torn)
    result = runner.invoke(app, [a for a in _args(tiny_dir("qwen2"), items_file, out) if a != "--quiet"])
    assert result.exit_code == 0, result.output
    assert "warning:" in result.output and "incomplete last record" in result.output, result.output
    assert (out / "ledger.jsonl").read_bytes() == (reference / "ledger.jsonl").read_bytes()
    assert (out / "ledger.jsonl.torn").read_bytes().startswith(torn)


def test_second_writer_is_refused_with_the_holders_pid(tmp_path, tiny_dir, items_file):
    out = tmp_path / "run"
    first = _cli(*_args(tiny_dir("qwen2"), items_file, out, n=10))
    deadline = time.time() + 60
    while not ((out / ".lock").exists() and (out / ".lock").read_text().strip()) and time.time() < deadline:
        time.sleep(0.05)
    second = runner.invoke(app, _args(tiny_dir("qwen2"), items_file, out, n=10))
    assert second.exit_code == 2
    assert f"being written by process {first.pid}" in second.stderr
    assert first.wait(timeout=300) == 0, first.stderr.read()
    assert len(_items(out)) == 10 and verify_ledger(out) == []


def _manifest() -> Manifest:
    """The smallest manifest a run can hold: what the lock and the manifest's landing are tested with."""
    return Manifest.model_validate({
        "schema_version": 2, "config": {
            "model": {"path": "m", "precision": "fp32"}, "data": {"path": None, "n": 1},
            "settings": {"boundary": "after:1", "decode": {"max_new_tokens": 1}, "scorer": "exact"},
            "dataset_hash": "0" * 64, "item_ids": ["a"], "model_hashes": {}}})


def _held_lock(run: Path) -> int:
    """Hold RUN/.lock as a writer does (flock on its own open file, its pid inside) and return the fd."""
    run.mkdir(exist_ok=True)
    fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, b"4242", 0)
    return fd


def test_a_writer_between_its_lock_and_its_manifest_is_named_not_called_foreign(tmp_path):
    """The window a second writer can meet: the lock held, the manifest still a temporary file beside it."""
    out = tmp_path / "run"
    fd = _held_lock(out)
    try:
        (out / ".manifest.json.x1y2.tmp").write_text("{")
        with pytest.raises(StageReplayError, match="being written by process 4242"), open_run(out, _manifest()):
            pass
    finally:
        os.close(fd)
    assert sorted(p.name for p in out.iterdir()) == [".lock", ".manifest.json.x1y2.tmp"]


def test_a_folder_of_other_files_is_refused_and_left_as_it_was(tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("x")
    with pytest.raises(StageReplayError, match="exists and is not a stagereplay run"), open_run(foreign, _manifest()):
        pass
    assert [p.name for p in foreign.iterdir()] == ["todo.txt"]  # no lock file left in it
    (foreign / ".lock").write_text("")  # a lock file does not make other files a run's
    with pytest.raises(StageReplayError, match="exists and is not a stagereplay run"), open_run(foreign, _manifest()):
        pass


def test_a_writer_killed_before_its_manifest_landed_leaves_a_folder_that_opens_anew(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("999999")
    (out / ".manifest.json.x1y2.tmp").write_text("{")
    with open_run(out, _manifest()) as run:
        assert run.records == []
    assert json.loads((out / "manifest.json").read_text()) == _manifest().as_json()


def test_different_configuration_into_an_existing_run_names_the_fields(tmp_path, tiny_dir, items_file, reference):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = (out / "ledger.jsonl").read_bytes()
    args = _args(tiny_dir("qwen2"), items_file, out)
    args[args.index("--max-new-tokens") + 1] = "30"
    result = runner.invoke(app, [*args, "--precision", "fp32"])
    assert result.exit_code == 2
    assert "config.model.precision" in result.stderr and "config.settings.decode.max_new_tokens" in result.stderr
    assert (out / "ledger.jsonl").read_bytes() == before


def test_every_single_byte_change_is_caught_by_verify_only(tmp_path, reference):
    """Exhaustive over the bytes of the first two records; a CLI check on a seeded sample of the rest."""
    data = (reference / "ledger.jsonl").read_bytes()
    lines = data.splitlines(keepends=True)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(reference / "manifest.json", run / "manifest.json")
    head = b"".join(lines[:2])
    for i in range(len(head)):
        changed = bytearray(head)
        changed[i] = (changed[i] + 1 + (i % 254)) % 256 or 1
        (run / "ledger.jsonl").write_bytes(bytes(changed))
        assert verify_ledger(run), f"byte {i} changed without notice"
    rng = random.Random(0)
    for _ in range(5):
        i = rng.randrange(len(data))
        changed = bytearray(data)
        changed[i] ^= 0x01
        (run / "ledger.jsonl").write_bytes(bytes(changed))
        result = runner.invoke(app, ["audit", str(run), "--verify-only"])
        assert result.exit_code == 1 and "ledger record" in result.stderr


# -- the bad-input table (docs/reference/errors.md) -------------------------------------------------------------------------


def _corrupt_config(model: Path) -> None:
    (model / "config.json").write_text("{not json")


def _truncate_weights(model: Path) -> None:
    w = model / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])


def _bigger_tokenizer(model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.add_tokens([f"<extra{i}>" for i in range(50)])
    tok.save_pretrained(model)


@pytest.mark.parametrize(
    ("case", "breaks", "expect"),
    [
        ("missing model directory", None, "model directory not found"),
        ("corrupt config", _corrupt_config, "corrupt config.json"),
        ("truncated weights", _truncate_weights, "cannot load the model"),
        ("tokenizer does not match", _bigger_tokenizer, "but the model embeds only"),
    ],
)
def test_bad_model_directories(tmp_path, tiny_dir, items_file, case, breaks, expect):
    model = tmp_path / "model"
    if breaks is not None:
        shutil.copytree(tiny_dir("qwen2"), model)
        breaks(model)
    _assert_clean_failure(tmp_path, _args(model, items_file, tmp_path / "out", n=2), expect)


@pytest.mark.parametrize(
    ("case", "content", "extra", "expect"),
    [
        ("malformed JSONL", '{"prompt": "a", "answer": "1"}\n{"prompt": \n', [], "line 2 is not valid JSON"),
        ("empty dataset", "\n", [], "holds no items"),
        ("--n larger than the dataset", '{"prompt": "a", "answer": "1"}\n', ["--n", "5"], "--n 5 is larger"),
        ("prompt longer than the context", json.dumps({"prompt": "x" * 600, "answer": "1"}) + "\n", [],
         "does not fit the model's context of 512"),
        ("unknown construction", '{"prompt": "a", "answer": "1"}\n', ["--construction", "twoshot"],
         "unknown construction 'twoshot'"),
        ("precision the device lacks", '{"prompt": "a", "answer": "1"}\n', ["--device", "cuda"],
         "CUDA is not available"),
        ("unknown precision", '{"prompt": "a", "answer": "1"}\n', ["--precision", "fp8"], "unknown precision"),
    ],
)
def test_bad_data_and_options(tmp_path, tiny_dir, case, content, extra, expect):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    args = ["matched", "--model", str(tiny_dir("qwen2")), "--data", str(data), "--boundary-after", "4",
            "--out", str(tmp_path / "out"), "--quiet", *extra]
    _assert_clean_failure(tmp_path, args, expect)


def test_precision_the_gpu_lacks(tmp_path, tiny_dir, items_file, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Tesla V100")
    args = [*_args(tiny_dir("qwen2"), items_file, tmp_path / "out", n=2), "--device", "cuda"]
    _assert_clean_failure(tmp_path, args, "precision bf16 needs bf16, which Tesla V100 lacks")


def test_boundary_never_reached_keeps_the_records_and_fails(tmp_path, tiny_dir, items_file):
    out = tmp_path / "out"
    result = runner.invoke(app, ["matched", "--model", str(tiny_dir("qwen2")), "--data", str(items_file), "--n",
                                 "3", "--boundary-marker", "~~~~~", "--max-stage1-tokens", "6", "--out", str(out),
                                 "--quiet"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no item reached the boundary marker:~~~~~ within 6" in lines[0]
    assert [r["payload"]["status"] for r in _items(out)] == ["no_boundary"] * 3


def test_newer_schema_ledger_is_refused_by_name(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "newer_schema", run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    result = runner.invoke(app, ["audit", str(run), "--verify-only"])
    assert result.exit_code == 1 and "schema_version 3, newer than" in result.stderr
    resumed = runner.invoke(app, ["precision-2x2", str(run), "--quiet"])
    assert resumed.exit_code == 2 and "schema_version 3, newer than this stagereplay's 2" in resumed.stderr
    assert len(resumed.stderr.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.name in before} == before


def test_hand_edited_ledger_is_refused_on_resume(tmp_path, tiny_dir, items_file, reference):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    text = (out / "ledger.jsonl").read_text().replace('"answer":"', '"answer":"1', 1)
    (out / "ledger.jsonl").write_text(text)
    result = runner.invoke(app, _args(tiny_dir("qwen2"), items_file, out))
    assert result.exit_code == 2
    assert "was modified: record 2: content does not match its hash" in result.stderr  # after stage, environment
    assert (out / "ledger.jsonl").read_text() == text


def _assert_clean_failure(tmp_path: Path, args: list[str], expect: str) -> None:
    out = Path(args[args.index("--out") + 1])
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expect in lines[0], lines[0]
    assert not out.exists(), "a failed start must leave no run directory"
