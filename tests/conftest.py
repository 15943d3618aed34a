from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A test session keeps its proofs of fast steps (records.proofs) in a folder of its own, shared by its workers and
# the commands they start, never the home folder's: a model setting is proven once a session, as once a machine
# for a user. The proofs' own tests, and those that count a run's forwards, give the store a folder of their own or
# switch it off. The session's first process makes the folder; workers inherit it.
if "STAGEREPLAY_PROOFS" not in os.environ:
    import tempfile

    os.environ["STAGEREPLAY_PROOFS"] = tempfile.mkdtemp(prefix="stagereplay-test-proofs-")
    _SESSION_PROOFS = os.environ["STAGEREPLAY_PROOFS"]
sys.path.insert(0, str(Path(__file__).parent))

# Tests compute on this machine's own kernels: torch loads here, before any command could choose portable ones
# (`--kernels auto` keeps a process's kernels once torch has loaded; tests/test_kernels.py runs the choice in
# fresh processes).
import torch  # noqa: F401
from tiny import save_r1_model, save_tiny_model


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


def attn_for(arch: str) -> str:
    """The attention a user gets by default: what transformers picks (SDPA, eager for Gemma 2's softcapping)."""
    return "auto"


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's folder of proofs goes with the process that made it (the controller, under xdist)."""
    made = globals().get("_SESSION_PROOFS")
    if made and not hasattr(config, "workerinput"):
        import shutil

        shutil.rmtree(made, ignore_errors=True)
