"""The package's layout: folders that point down with no import circles, and a ledger that moving code
around cannot change."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.make_toy_golden import HERE, PINNED_KERNELS, environments, run_golden, without_environment

ROOT = Path(__file__).parents[1]
SRC = ROOT / "src"
CONTRACTS = ROOT / "pyproject.toml"  # [tool.importlinter]: the rooms' import rules


def _lint_imports(src: Path, cwd: Path) -> tuple[dict[str, str], str]:
    """Runs import-linter's contracts from pyproject.toml on the package under `src` (first on the path, ahead of
    any installed copy): each contract's name -> KEPT or BROKEN, and the report. A fresh process, since grimp finds the package
    through the import system and this one has imported the installed package already."""
    run = ("import sys; from importlinter.cli import lint_imports_command; "
           "sys.exit(lint_imports_command())")
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", run, "--no-cache", "--no-logo", str(CONTRACTS)], cwd=cwd, env=env,
                         capture_output=True, text=True)
    verdicts = dict(m.groups() for m in re.finditer(r"^(.+) (KEPT|BROKEN)$", out.stdout, re.MULTILINE))
    assert verdicts, out.stdout + out.stderr
    assert (out.returncode == 0) == all(v == "KEPT" for v in verdicts.values()), out.stdout
    return verdicts, out.stdout


def _contract_names() -> dict[str, str]:
    from importlinter.api import read_configuration

    return {c["id"]: c["name"] for c in read_configuration(str(CONTRACTS))["contracts_options"]}


def test_the_import_contracts_are_kept():
    """Every import of the package, static, TYPE_CHECKING and function-local alike, keeps the contracts."""
    verdicts, report = _lint_imports(SRC, ROOT)
    assert verdicts == dict.fromkeys(_contract_names().values(), "KEPT"), report


def _not_source(folder: str, names: list[str]) -> list[str]:
    """What the copy leaves out: all but the modules and their folders (the toy's weights, caches)."""
    return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or (Path(folder) / n).is_dir())]


UP_FROM_ENGINE = "\n\ndef _planted():\n    from stagereplay.cli import app\n    return app\n"
TYPE_CHECKING_UP = "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import stagereplay.report\n"
CIRCLE_IN_ENGINE = "\n\ndef _planted():\n    from stagereplay.engine.lm import LM\n    return LM\n"
ENGINE_IN_REPORT = "\n\ndef _planted():\n    from stagereplay.engine.model import load_config_and_tokenizer\n"
TOY_IN_ENGINE = "\n\ndef _planted():\n    from stagereplay.toy import toy_checkpoint\n    return toy_checkpoint\n"
FAMILY_IN_FAMILY = "\n\ndef _planted():\n    from stagereplay.experiments.attest.stats import ALPHA\n    return ALPHA\n"
EXPERIMENT_IN_SERVING = "\n\ndef _planted():\n    from stagereplay.experiments.core.jobs import Job\n    return Job\n"


@pytest.mark.parametrize(("module", "planted", "broken"), [
    ("engine/cache.py", UP_FROM_ENGINE, {"rooms", "circles"}),  # the engine reaching the CLI, inside a function
    ("engine/cache.py", TYPE_CHECKING_UP, {"rooms", "circles"}),  # and under TYPE_CHECKING
    ("newroom/__init__.py", "", {"rooms"}),  # a room not given its place
    ("engine/cache.py", CIRCLE_IN_ENGINE, {"circles"}),  # engine.lm imports engine.cache already
    ("report/__init__.py", ENGINE_IN_REPORT, {"report"}),
    ("engine/cache.py", TOY_IN_ENGINE, {"toy"}),
    ("experiments/mismatch/stats.py", FAMILY_IN_FAMILY, {"families"}),  # one family naming another's module
    ("serving/seam.py", EXPERIMENT_IN_SERVING, {"rooms", "circles"}),  # the engines reaching up to the experiments
], ids=["upward", "upward-type-checking", "unplaced-room", "circle", "report-engine", "engine-toy", "family-family",
        "serving-experiments"])
def test_the_import_contracts_see_a_planted_import(tmp_path, module, planted, broken):
    """Negative control: a copy of the package with one import planted breaks exactly the contracts it should."""
    copy = tmp_path / "src" / "stagereplay"
    shutil.copytree(SRC / "stagereplay", copy, ignore=_not_source)
    target = copy / module
    target.parent.mkdir(exist_ok=True)
    with target.open("a") as f:
        f.write(planted)
    names = _contract_names()
    verdicts, report = _lint_imports(tmp_path / "src", tmp_path)
    assert verdicts == {names[c]: "BROKEN" if c in broken else "KEPT" for c in names}, report


def _room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stagereplay."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("stagereplay."))
    return found


def _report_engine_imports(paths) -> list[str]:
    return [f"{p.name}: {t}" for p in paths for t in _imports(p) if _room(t) == "engine"]


def test_the_report_reads_records_not_models():
    """`report/` renders from records alone: nothing in it imports the engine (models, tokenizers, caches)."""
    assert _report_engine_imports((SRC / "stagereplay" / "report").rglob("*.py")) == []


def test_the_report_rule_sees_an_engine_import(tmp_path):
    """Negative control: a report module loading a tokenizer through the engine is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from stagereplay.engine.model import load_config_and_tokenizer\n")
    assert _report_engine_imports([bad]) == ["bad.py: stagereplay.engine.model"]


def test_ledger_is_byte_identical_to_the_golden_run(tmp_path):
    """A real toy run's ledger, made by `fixtures/make_toy_golden.py`; the same command must make the same bytes
    (less the environment that computed them: machine, versions, commit), on any x86-64 CPU with AVX2, since
    both runs pin the kernels to AVX2's. Another CPU cannot run those kernels: the test says so and stops
    (the same-machine byte identity of ledgers is also checked by
    `test_shards.py::test_two_local_workers_write_the_same_ledger_as_one` and the resume tests)."""
    import torch

    if not getattr(torch.cpu, "_is_avx2_supported", lambda: False)():
        pytest.skip("needs an x86-64 CPU with AVX2: the golden ledger was made under AVX2 kernels (PINNED_KERNELS)")
    again = run_golden(tmp_path / "run").read_bytes()
    for env in environments(again):  # the pins held: the kernels that ran are the golden's
        assert env["kernels"]["cpu"]["capability"] == "AVX2"
        assert {k: env["kernels"]["cpu"]["env"][k] for k in PINNED_KERNELS} == PINNED_KERNELS
    assert without_environment(again) == without_environment((HERE / "ledger.jsonl").read_bytes())


def test_the_golden_comparison_tells_another_run_apart(tmp_path):
    """Negative control: the same items in bf16 record other bytes, so the golden is not what any run makes."""
    from fixtures.make_toy_golden import GOLDEN_ARGS
    from typer.testing import CliRunner

    from stagereplay.cli import app

    args = [a if a != "fp32" else "bf16" for a in GOLDEN_ARGS]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "bf16")])
    assert result.exit_code == 0, result.output
    golden = without_environment((HERE / "ledger.jsonl").read_bytes())
    assert without_environment((tmp_path / "bf16" / "ledger.jsonl").read_bytes()) != golden


def test_the_development_page_draws_the_rooms_the_import_rule_checks():
    """The rooms drawn in docs/reference/development.md, top to bottom, are the `rooms` contract's layers."""
    from importlinter.api import read_configuration

    contracts = read_configuration(str(CONTRACTS))["contracts_options"]
    layers = next(c["layers"] for c in contracts if c["id"] == "rooms")
    page = (ROOT / "docs" / "reference" / "development.md").read_text()
    block = page.split("**Where things live.**")[1].split("```")[1]
    drawn = []
    for line in block.splitlines():
        m = re.match(r"^([a-z_]+)/?(?:, ([a-z_]+)/)?\s", line)
        if m:
            drawn += [g for g in m.groups() if g]
    assert drawn == layers, drawn
