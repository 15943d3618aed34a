"""The package's layout: folders that point down with no import circles, and a ledger that moving code
around cannot change."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.make_toy_golden import HERE, PINNED_KERNELS, environments, run_golden, without_environment

SRC = Path(__file__).parents[1] / "src"
CYCLES_TOOL = Path(__file__).parents[2] / "shared" / "tools" / "import_cycles.py"

# Folders (rooms) from the bottom up: a module may import only from its own room or rooms below it.
ORDER = ("errors", "tasks", "toy", "engine", "execution", "records", "report", "experiments", "serving", "audit", "plan",
         "runs", "cli")


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


def test_every_import_points_down_the_rooms():
    """Static, TYPE_CHECKING and function-local imports alike."""
    upward = []
    for path in (SRC / "stagereplay").rglob("*.py"):
        if path.name == "__init__.py" and path.parent.name == "stagereplay":
            continue  # the package's public face re-exports from every room
        rel = path.relative_to(SRC).with_suffix("")
        mine = _room(".".join(rel.parts))
        for target in _imports(path):
            theirs = _room(target)
            assert mine in ORDER and theirs in ORDER, (path, target)
            if ORDER.index(theirs) > ORDER.index(mine):
                upward.append(f"{rel}: {target}")
    assert upward == []


def test_the_rooms_check_sees_an_upward_import(tmp_path):
    """Negative control: a module of the engine importing the report is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from stagereplay.report.stats import wilson_interval\n")
    assert ORDER.index(_room(next(iter(_imports(bad))))) > ORDER.index("engine")


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


def test_no_import_circles():
    if not CYCLES_TOOL.exists():  # the shared tool lives beside the checkout; the rooms test above still runs
        return
    out = subprocess.run([sys.executable, str(CYCLES_TOOL), str(SRC), "stagereplay"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
    assert "0 import circles" in out.stdout


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
    """The rooms drawn in docs/reference/development.md, top to bottom, are ORDER from the top down."""
    import re

    page = (Path(__file__).parents[1] / "docs" / "reference" / "development.md").read_text()
    block = page.split("**Where things live.**")[1].split("```")[1]
    drawn = []
    for line in block.splitlines():
        m = re.match(r"^([a-z_]+)/?(?:, ([a-z_]+)/)?\s", line)
        if m:
            drawn += [g for g in m.groups() if g]
    assert drawn == list(reversed(ORDER)), drawn
