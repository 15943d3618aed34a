from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Each test proves its own fast steps: a store of proofs (records.proofs) shared by the tests would let one test's
# proof reach decide what another run records (a ledger's environment names how far its proof went), and would
# write into the home folder. The store's own tests give it a folder of their own.
os.environ["STAGEREPLAY_PROOFS"] = "off"
sys.path.insert(0, str(Path(__file__).parent))

# Tests compute on this machine's own kernels: torch loads here, before any command could choose portable ones
# (`--kernels auto` keeps a process's kernels once torch has loaded; tests/test_kernels.py runs the choice in
# fresh processes).
import torch  # noqa: F401
from tiny import save_r1_model, save_tiny_model

# Captured steps (engine.decode.Stepper: torch.compile, eager backend) are traced once per model a process loads, about
# a second, more than a tiny model's whole run costs; they pay off on real traces of thousands of tokens. Outside the
# modules and tests marked `capture` (the captured step's own tests, its proofs, the whole protocol run) steps run
# eagerly, in this process and the ones it starts: torch reads `TORCHDYNAMO_DISABLE` when a step would be compiled. A
# captured step gives the eager step's bits (engine.proof), so what a test asserts of a run holds either way.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
CAPTURE_OFF = os.environ["TORCHDYNAMO_DISABLE"] == "1"


COMPILING = ("capture", "vllm")
"""Marks under which torch.compile is left on: a captured step's tests, and vLLM's (which compiles its own model)."""


def _capture_on(node: pytest.Item | pytest.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps captured for `node` where it is marked so (a model loaded with capture off would step eagerly: this
    process's models are dropped)."""
    from stagereplay.execution.models import release_models

    marked = any(node.get_closest_marker(m) is not None for m in COMPILING)
    if CAPTURE_OFF and marked and os.environ.get("TORCHDYNAMO_DISABLE"):
        monkeypatch.delenv("TORCHDYNAMO_DISABLE")
        release_models()


@pytest.fixture(scope="module", autouse=True)
def _module_captured_where_marked(request: pytest.FixtureRequest):
    """Before the module's own fixtures, which may make runs."""
    with pytest.MonkeyPatch.context() as mp:
        _capture_on(request.node, mp)
        yield


@pytest.fixture(autouse=True)
def _test_captured_where_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    _capture_on(request.node, monkeypatch)
    yield


def _built_once(root: Path, build: Callable[[Path, str], Path]) -> Callable[[str], Path]:
    """`get(key)` -> `build(root / key, key)`, made on the first call for that key and kept for the session."""
    made: dict[str, Path] = {}

    def get(key: str) -> Path:
        if key not in made:
            made[key] = build(root / key, key)
        return made[key]

    return get


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    """Folder factory: tiny_dir("qwen2") -> a saved random model of that architecture (built once a session)."""
    get = _built_once(tmp_path_factory.mktemp("tiny-models"), save_tiny_model)
    return lambda arch="qwen2": get(arch)


@pytest.fixture(scope="session")
def r1_dir(tmp_path_factory: pytest.TempPathFactory):
    """Folder factory: r1_dir("merged" | "added") -> an R1-shaped tiny model (tiny.save_r1_model), built once."""
    get = _built_once(tmp_path_factory.mktemp("r1-models"), save_r1_model)
    return lambda kind="merged": get(kind)


@pytest.fixture(scope="session")
def items_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """50 arithmetic prompts as JSONL."""
    import json
    import random

    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "items.jsonl"
    with open(path, "w") as f:
        for i in range(50):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            f.write(
                json.dumps(
                    {
                        "id": f"q{i:03d}",
                        "prompt": f"Q: what is {a}+{b}? Think, then answer.\n",
                        "answer": str(a + b),
                    }
                )
                + "\n"
            )
    return path


@pytest.fixture(scope="session")
def bf16_run(tmp_path_factory: pytest.TempPathFactory, tiny_dir, items_file) -> Path:
    """matched on the tiny Qwen2 in bf16: 20 items, the boundary after 16 tokens, 48 suffix tokens, where some
    live and one-shot suffixes diverge on the CPUs this suite runs on. Made once a session (read only: a test
    that writes into it takes a copy)."""
    from typer.testing import CliRunner

    from stagereplay.cli import app

    out = tmp_path_factory.mktemp("bf16") / "run"
    result = CliRunner().invoke(app, ["matched", "--model", str(tiny_dir("qwen2")), "--data", str(items_file),
                                      "--n", "20", "--boundary-after", "16", "--max-new-tokens", "48",
                                      "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def attn_for(arch: str) -> str:
    """The attention a user gets by default: what transformers picks (SDPA, eager for Gemma 2's softcapping)."""
    return "auto"



def generated_cache(out):
    """The cache a generate() call returned: `cache` since transformers 5.2x, `past_key_values` before."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def tables_text(results: dict[str, Any], width: int = 120) -> str:
    """`print_tables` on a plain console of `width` columns (no colour codes): what a terminal or a log shows, of
    results.json's object."""
    import io

    from rich.console import Console

    from stagereplay.report.render import print_tables
    from stagereplay.report.results import Results

    buffer = io.StringIO()
    print_tables(Results.model_validate(results), Console(file=buffer, width=width, color_system=None, force_terminal=False))
    return buffer.getvalue()
