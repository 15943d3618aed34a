"""The engine's lines go through logging; a command says them on stderr in one line each, the batched check once
per model setting, and nothing under --quiet."""

from __future__ import annotations

import logging

import pytest
from typer.testing import CliRunner

from stagereplay.cli import app

runner = CliRunner()
CHECK = "--batch 2: "  # how the batched check's line starts (engine.proof.BatchProof.line)


def _checks(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(CHECK)]


@pytest.mark.slow  # two runs of two worker processes each: the slow tier (CI runs it)
def test_a_batched_run_says_its_check_once_and_nothing_under_quiet(tiny_dir, items_file, tmp_path):
    """Two local workers each load the model and check its batched step (the command's process loads none): their
    lines come back to the command, which says the check once; under --quiet it says nothing at all."""
    args = ["matched", "--model", str(tiny_dir("qwen2")), "--data", str(items_file), "--n", "4", "--boundary-after",
            "6", "--max-new-tokens", "6", "--batch", "2", "--workers", "2"]
    said = runner.invoke(app, [*args, "--out", str(tmp_path / "said")])
    assert said.exit_code == 0, said.output
    assert len(_checks(said.stderr)) == 1, said.stderr
    quiet = runner.invoke(app, [*args, "--out", str(tmp_path / "quiet"), "--quiet"])
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr == ""


def test_the_check_is_said_once_per_model_setting_and_not_under_quiet(tiny_dir, caplog, capsys):
    """Each load of a model setting checks its batched step again (each stage, each worker), and the engine logs
    every check; a command's handler (cli.app.say_on_stderr) says one line per setting and answer. Negative
    control: the engine did log the repeat, and another setting's check is said too."""
    from stagereplay.cli.app import say_on_stderr
    from stagereplay.engine.lm import load

    logger = logging.getLogger("stagereplay")
    ours = set(logger.handlers)
    caplog.set_level(logging.INFO, logger="stagereplay")

    def check(precision: str) -> None:
        lm = load(str(tiny_dir("qwen2")), precision=precision, batch=2)
        lm.prove_batch([lm.tokenizer.encode("Q: what is 12+7?"), lm.tokenizer.encode("abc")])

    try:
        say_on_stderr()
        for precision in ("bf16", "bf16", "fp32"):
            check(precision)
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith(CHECK)]
        assert len(logged) == 3
        assert _checks(capsys.readouterr().err) == [logged[0], logged[2]]
        say_on_stderr(quiet=True)
        check("bf16")
        assert capsys.readouterr().err == ""
    finally:
        for handler in set(logger.handlers) - ours:
            logger.removeHandler(handler)
