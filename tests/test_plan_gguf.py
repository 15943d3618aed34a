"""`plan` takes a GGUF file wherever it takes a model folder (docs/how-to/llamacpp.md): `plan --model FILE.gguf`, an
experiment's `--plan --model FILE.gguf` and `plan RUN` of a run made from one. The shape comes from the file's
metadata as transformers maps it and the parameters from its tensor table, no weight read: the toy written as a GGUF
(tests/gguf_files.py) is priced exactly as its folder is, row for row. Needs `gguf` and `accelerate` (the dev
extras)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from stagereplay.cli import app
from stagereplay.errors import OK, REFUSED
from stagereplay.toy import toy_checkpoint

runner = CliRunner()
ATTEST = ["attest", "--n", "3", "--max-new-tokens", "4", "--honest", "bf16"]


def _invoke(args: list[str]) -> Result:
    result = runner.invoke(app, args, env={"COLUMNS": "160"})
    assert result.exit_code == OK, result.output
    return result


def _table(result: Result, model: str) -> str:
    """The plan without the model's name, which is all that may differ between a folder and its GGUF."""
    return result.output.replace(model, "MODEL", 1)


@pytest.fixture(scope="module")
def toy_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf_files import write_toy_gguf

    return write_toy_gguf(tmp_path_factory.mktemp("gguf") / "toy-f32.gguf")


@pytest.mark.parametrize("command", [["plan", "--n", "3"], [*ATTEST, "--plan"]], ids=["plan", "attest --plan"])
def test_a_gguf_is_priced_as_its_folder(toy_gguf: Path, command: list[str]):
    folder = toy_checkpoint("primary")
    from_file = _invoke([*command, "--model", str(toy_gguf)])
    from_folder = _invoke([*command, "--model", str(folder)])
    assert f"model {toy_gguf.name}: 4 layers, 2 KV heads of 48, 0.002B parameters" in from_file.output
    assert _table(from_file, toy_gguf.name) == _table(from_folder, folder.name)


def test_plan_of_a_run_made_from_a_gguf(toy_gguf: Path, tmp_path: Path):
    """The run records the file as its model; `plan RUN` prices it from the file, as the folder's run is priced."""
    runs = {}
    for name, model in (("file", toy_gguf), ("folder", toy_checkpoint("primary"))):
        runs[name] = tmp_path / name
        _invoke([*ATTEST, "--model", str(model), "--quiet", "--out", str(runs[name])])
    from_file, from_folder = _invoke(["plan", str(runs["file"])]), _invoke(["plan", str(runs["folder"])])
    assert from_file.output.startswith(f"model {toy_gguf.name}: 4 layers"), from_file.output
    rows = [line for line in from_file.output.splitlines() if line.startswith(("attest/", "audit@"))]
    assert len(rows) == 5 and rows == [line for line in from_folder.output.splitlines()
                                       if line.startswith(("attest/", "audit@"))], from_file.output


def test_a_file_that_is_not_a_gguf_is_refused_in_one_line(tmp_path: Path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file")
    result = runner.invoke(app, ["plan", "--model", str(bad)])
    assert result.exit_code == REFUSED and result.output.count("\n") == 1, result.output
    assert "is not a GGUF file" in result.output
