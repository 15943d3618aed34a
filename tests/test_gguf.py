"""GGUF files in our engine (`--model PATH.gguf`, engine.gguf): the embedded toy written as a GGUF by the test
(tests/gguf_files.py) loads, dequantized, into the model the folder loads, bit for bit in fp32; its hash is bound
in the manifest, a moved copy audits and a GGUF with another hash is refused; what cannot load is refused in one
line. Needs `gguf` and `accelerate` (the `llamacpp` extra, hence the marker), not llama.cpp itself:
`python -m pytest -m llamacpp tests/test_gguf.py`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagereplay.cli import app

pytestmark = pytest.mark.llamacpp
runner = CliRunner()


@pytest.fixture(scope="module")
def toy_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf_files import write_toy_gguf

    return write_toy_gguf(tmp_path_factory.mktemp("gguf") / "toy-f32.gguf")


def test_a_gguf_loads_into_the_model_its_folder_loads(toy_gguf, tmp_path):
    """Property: the toy's bf16 weights written as f32 GGUF and dequantized are the folder's weights upcast, so
    in fp32 the two models give the same logits bit for bit, and the GGUF's tokenizer the same prompt IDs.
    Negative control: a GGUF with one norm weight moved gives other logits."""
    import torch
    from gguf_files import write_toy_gguf

    from stagereplay.engine.lm import load
    from stagereplay.tasks import DataConfig, load_items
    from stagereplay.toy import toy_checkpoint

    folder, gguf = load(str(toy_checkpoint("primary")), "fp32"), load(str(toy_gguf), "fp32")
    items, _ = load_items(DataConfig(n=2), gguf.tokenizer)
    assert [i.prompt_ids for i in items] == [i.prompt_ids for i in load_items(DataConfig(n=2), folder.tokenizer)[0]]
    ids = torch.tensor([items[0].prompt_ids])
    with torch.no_grad():
        a, b = folder.model(ids).logits, gguf.model(ids).logits
    assert torch.equal(a, b)
    assert gguf.eos == folder.eos
    other = load(str(write_toy_gguf(tmp_path / "other.gguf", seed_noise=0.5)), "fp32")
    with torch.no_grad():
        assert not torch.equal(other.model(ids).logits, a)


def _matched(out: Path, model: Path) -> None:
    result = runner.invoke(app, ["matched", "--model", str(model), "--n", "2", "--max-new-tokens", "16",
                                 "--precision", "fp32", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output


def test_the_gguf_hash_is_bound_and_a_moved_file_is_checked_against_it(toy_gguf, tmp_path):
    """The manifest binds the file's sha256; an audit finds a renamed copy by `--model` (the name is not part of
    the hash) and re-executes there. Negative control: a GGUF with another hash is refused in one line naming the
    hash, before anything runs, and so is a model directory; both tell the user to pass the .gguf file (a folder
    run's refusal, which asks for the directory, is tests/test_other_machines.py's)."""
    from gguf_files import write_toy_gguf

    from stagereplay.engine.gguf import file_sha256

    model = tmp_path / "model.gguf"
    shutil.copy(toy_gguf, model)
    run = tmp_path / "run"
    _matched(run, model)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["config"]["model_hashes"]["primary"] == {"gguf": file_sha256(toy_gguf)}
    moved = tmp_path / "elsewhere" / "renamed.gguf"
    moved.parent.mkdir()
    model.rename(moved)
    result = runner.invoke(app, ["audit", str(run), "--model", str(moved), "--quiet"])
    assert result.exit_code == 0, result.output
    assert json.loads((run / "audit.json").read_text())["relocated"][0]["here"] == str(moved)
    wrong = write_toy_gguf(tmp_path / "wrong.gguf", seed_noise=0.5)
    result = runner.invoke(app, ["audit", str(run), "--model", str(wrong), "--quiet"])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "is not the run's primary model: its gguf hash differs" in line
    assert line.endswith("; pass the .gguf file the run was made with") and "directory" not in line
    from stagereplay.toy import toy_checkpoint

    result = runner.invoke(app, ["audit", str(run), "--model", str(toy_checkpoint("primary")), "--quiet"])
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "is not a .gguf file, and the run's primary model was one" in line
    assert line.endswith("; pass the .gguf file the run was made with")


def _header_only_gguf(path: Path, arch: str) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(("make", "says"), [
    (lambda d: d / "missing.gguf", "GGUF file not found"),
    (lambda d: (d / "text.gguf").write_text("not a model") and d / "text.gguf", "is not a GGUF file"),
    (lambda d: _header_only_gguf(d / "rwkv.gguf", "rwkv6"), "cannot load GGUF architecture 'rwkv6'"),
])
def test_what_cannot_load_is_refused_in_one_line_before_a_run_exists(tmp_path, make, says):
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--model", str(make(tmp_path)), "--n", "1", "--out", str(out)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and says in line and "; " in line
    assert not out.exists()


def test_missing_gguf_packages_are_named_with_the_fix(toy_gguf, monkeypatch):
    import importlib.util

    from stagereplay.engine import gguf
    from stagereplay.errors import StageReplayError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(StageReplayError) as err:
        gguf.check_gguf(toy_gguf)
    assert "needs accelerate" in str(err.value) and "stagereplay[gguf]" in str(err.value)
