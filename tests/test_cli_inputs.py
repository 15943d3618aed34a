"""Every malformed or out-of-range value of every command's options: one `error: <problem>; <fix>` line on
stderr, exit code 2, and no run directory (or an existing one left byte for byte as it was).

The table sweeps each option of each command; a row names the value and a part of the message that must
name the problem. A new option gets its rows here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagereplay.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_dir, items_file) -> Path:
    """A small real run (matched only) for the commands that extend one."""
    out = tmp_path_factory.mktemp("inputs") / "run"
    result = runner.invoke(app, ["matched", "--model", str(tiny_dir("qwen2")), "--data", str(items_file), "--n", "2",
                                 "--boundary-after", "4", "--max-new-tokens", "4", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("files")
    out = {"good": root / "good.jsonl", "latin1": root / "latin1.jsonl", "binary": root / "binary.jsonl",
           "dir": root / "a-dir"}
    out["good"].write_text('{"prompt": "a", "answer": "1"}\n')
    out["latin1"].write_bytes('{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    out["binary"].write_bytes(bytes(range(256)))
    out["dir"].mkdir()
    return out


# matched: each row is (extra arguments, expected part of the message). `MODEL` and `DATA` stand for the tiny
# model and the items; a row that gives its own --data or --model uses it.
MATCHED = [
    (["--data", "{latin1}"], "is not UTF-8 text"),
    (["--data", "{binary}"], "is not valid JSON"),
    (["--data", "{dir}"], "data file not found"),
    (["--data", "hf:a:b:c:d"], "invalid --data 'hf:a:b:c:d'"),
    (["--columns", "query=prompt"], "invalid --columns entry 'query=prompt'"),
    (["--columns", "prompt"], "invalid --columns entry 'prompt'"),
    (["--columns", "prompt=nope"], "has no column 'nope'"),
    (["--scorer", "nope"], "unknown --scorer 'nope'"),
    (["--scorer", "regex:("], "invalid --scorer 'regex:('"),
    (["--n", "0"], "--n must be at least 1"),
    (["--n", "-1"], "--n must be at least 1"),
    (["--n", "abc"], "Invalid value for '--n'"),
    (["--n", "1.5"], "Invalid value for '--n'"),
    (["--construction", "chunked:0"], "unknown construction 'chunked:0'"),
    (["--construction", "chunked:x"], "unknown construction 'chunked:x'"),
    (["--construction", "twoshot"], "unknown construction 'twoshot'"),
    (["--construction", "live"], "drop live from --construction"),
    (["--boundary-marker", ""], "empty boundary marker"),
    (["--boundary-regex", "("], "invalid --boundary-regex '('"),
    (["--boundary-regex", ""], "matches the empty text"),
    (["--boundary-regex", "x*"], "matches the empty text"),
    (["--boundary-after", "0"], "--boundary-after must be at least 1"),
    (["--boundary-after", "-3"], "--boundary-after must be at least 1"),
    (["--boundary-after", "3", "--boundary-marker", "x"], "more than one boundary rule"),
    (["--precision", "fp8"], "unknown precision 'fp8'"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--device", "cuda:x"], "cuda:x"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--threads", "-1"], "--threads must be at least 1"),
    (["--attn-impl", "flash"], "unknown attention implementation 'flash'"),
    (["--kernels", "fast"], "unknown --kernels 'fast'"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--kernels", "portable", "--device", "cuda"], "--kernels portable holds x86-64 CPU kernels"),
    (["--max-new-tokens", "0"], "token limits must be at least 1"),
    (["--max-new-tokens", "-5"], "token limits must be at least 1"),
    (["--max-stage1-tokens", "0"], "token limits must be at least 1"),
    (["--sample", "--temperature", "0"], "--temperature must be positive"),
    (["--sample", "--temperature", "-1"], "--temperature must be positive"),
    (["--sample", "--temperature", "nan"], "--temperature must be positive"),
    (["--sample", "--temperature", "inf"], "--temperature must be positive"),
    (["--temperature", "warm"], "Invalid value for '--temperature'"),
    (["--top-k", "-1"], "--top-k must be 0"),
    (["--workers", "0"], "--workers must be at least 1"),
    (["--workers", "-2"], "--workers must be at least 1"),
    (["--executor", "dask"], "unknown executor 'dask'"),
    (["--shard", "2/2"], "bad --shard '2/2'"),
    (["--shard", "a/b"], "bad --shard 'a/b'"),
    (["--shard", "0/0"], "bad --shard '0/0'"),
    (["--shard", "1"], "bad --shard '1'"),
    (["--model", "{good}"], "model directory not found"),
    (["--bogus", "1"], "No such option: --bogus"),
]


def _fill(args: list[str], files: dict[str, Path]) -> list[str]:
    return [a.format(**{k: str(v) for k, v in files.items()}) for a in args]


def _one_error_line(result, expect: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.exception)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expect in lines[0], lines[0]
    assert "; " in lines[0], "the line names the problem, then the fix"


@pytest.mark.parametrize(("extra", "expect"), MATCHED, ids=[" ".join(a) for a, _ in MATCHED])
def test_matched_refuses_bad_values(tmp_path, tiny_dir, items_file, files, extra, expect):
    extra = _fill(extra, files)
    args = ["matched", "--out", str(tmp_path / "out"), "--quiet", "--n", "2"]
    if "--model" not in extra:
        args += ["--model", str(tiny_dir("qwen2"))]
    if "--data" not in extra:
        args += ["--data", str(items_file)]
    if not any(a.startswith("--boundary-") for a in extra):
        args += ["--boundary-after", "4"]
    result = runner.invoke(app, [*args, *extra])
    _one_error_line(result, expect)
    assert not (tmp_path / "out").exists(), "a refused start leaves no run directory"


def test_an_attention_the_model_lacks_is_refused_naming_the_one_it_has(tmp_path, tiny_dir, items_file):
    """Gemma 2 has no SDPA attention (its softcapping): the default takes eager; asking for sdpa is refused."""
    args = ["matched", "--out", str(tmp_path / "out"), "--quiet", "--n", "2", "--model", str(tiny_dir("gemma2")),
            "--data", str(items_file), "--boundary-after", "4"]
    result = runner.invoke(app, [*args, "--attn-impl", "sdpa"])
    _one_error_line(result, "transformers has no sdpa attention for Gemma2 models; pass --attn-impl eager")
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, [*args, "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output + result.stderr
    manifest = (tmp_path / "out" / "manifest.json").read_text()
    assert '"attn_impl": "eager"' in manifest


# Commands that extend a run or read one: `RUN` is a copy of a real matched run, which must stay as it was.
ON_A_RUN = [
    (["precision-2x2", "RUN", "--constructions", "bogus"], "unknown construction 'bogus'"),
    (["precision-2x2", "RUN", "--constructions", "live,oneshot"], "live is not a fixed-prefix construction"),
    (["precision-2x2", "RUN", "--constructions", ""], "unknown construction ''"),
    (["precision-2x2", "RUN", "--precisions", "fp8"], "unknown precision 'fp8'"),
    (["precision-2x2", "RUN", "--precisions", ""], "unknown precision ''"),
    (["precision-2x2", "RUN", "--checkpoint", "later"], "the run has no stage at checkpoint 'later' to extend"),
    (["precision-2x2", "RUN", "--workers", "0"], "--workers must be at least 1"),
    (["precision-2x2", "NOWHERE"], "manifest.json missing"),
    (["bridge", "RUN", "--rows", "0"], "--rows must be at least 1"),
    (["bridge", "RUN", "--rows", "-1"], "--rows must be at least 1"),
    (["bridge", "RUN", "--rows", "many"], "Invalid value for '--rows'"),
    (["bridge", "RUN", "--checkpoint", "x"], "the run has no stage at checkpoint 'x' to extend"),
    (["transplant", "RUN", "--layers", "x"], "bad --layers 'x'"),
    (["transplant", "RUN", "--layers", "3-1"], "bad --layers '3-1'"),
    (["transplant", "RUN", "--layers", "99"], "--layers '99' out of range for 4 layers"),
    (["transplant", "RUN", "--kv", "q"], "unknown --kv 'q'"),
    (["transplant", "RUN", "--positions", "a:b"], "bad --positions 'a:b'"),
    (["transplant", "RUN", "--positions", "5"], "bad --positions '5'"),
    (["transplant", "RUN", "--positions", "9:2"], "--positions '9:2' selects no position"),
    (["transplant", "RUN", "--select", "some"], "unknown --select 'some'"),
    (["transplant", "RUN", "--select", "first:x"], "unknown --select 'first:x'"),
    (["transplant", "RUN", "--select", "first:0"], "unknown --select 'first:0'"),
    (["transplant", "RUN", "--select", "random:1"], "unknown --select 'random:1'"),
    (["transplant", "RUN", "--sweep", "x"], "Got unexpected extra argument"),
    (["transplant", "RUN", "--checkpoint", "x"], "the run has no stage at checkpoint 'x' to extend"),
    (["audit", "NOWHERE"], "manifest.json missing"),
    (["audit", "RUN", "--workers", "0"], "--workers must be at least 1"),
    (["audit", "RUN", "--executor", "x"], "unknown executor 'x'"),
    (["report", "NOWHERE"], "no results.json"),
    (["export", "RUN", "--format", "xlsx"], "unknown export format 'xlsx'"),
    (["export", "RUN", "--output", "RUN"], "is a directory"),
    (["export", "NOWHERE"], "no ledger.jsonl"),
    (["merge", "--out", "NEW"], "Missing argument 'shards'"),
    (["merge", "NOWHERE", "--out", "NEW"], "no manifest.json"),
    (["merge", "RUN", "--out", "NEW"], "is not a shard"),
    (["paper", "--n", "0", "--out", "NEW"], "--n must be at least 1"),
    (["paper", "--select", "x", "--out", "NEW"], "unknown --select 'x'"),
    (["paper", "--rows", "0", "--out", "NEW"], "--rows must be at least 1"),
    (["paper", "--later-model", "NOWHERE", "--out", "NEW"], "model directory not found"),
    (["paper", "--workers", "-1", "--out", "NEW"], "--workers must be at least 1"),
    (["paper", "--max-new-tokens", "0", "--out", "NEW"], "token limits must be at least 1"),
    (["paper", "--kernels", "fast", "--out", "NEW"], "unknown --kernels 'fast'"),
    (["plan", "--kernels", "fast"], "unknown --kernels 'fast'"),
    (["toy", "train", "--out", "NEW", "--steps", "0"], "--steps must be at least 1"),
    (["toy", "train", "--out", "NEW", "--threads", "0"], "--threads must be at least 1"),
    (["toy", "train"], "Missing option '--out'"),
    (["bogus"], "No such command 'bogus'"),
]


def _snapshot(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize(("args", "expect"), ON_A_RUN, ids=[" ".join(a) for a, _ in ON_A_RUN])
def test_commands_refuse_bad_values_and_leave_the_run_alone(tmp_path, base, args, expect):
    run = tmp_path / "run"
    shutil.copytree(base, run)
    before = _snapshot(run)
    places = {"RUN": run, "NOWHERE": tmp_path / "nowhere", "NEW": tmp_path / "new"}
    result = runner.invoke(app, [str(places.get(a, a)) for a in args])
    _one_error_line(result, expect)
    assert _snapshot(run) == before
    assert not (tmp_path / "new").exists() and not (tmp_path / "nowhere").exists()
