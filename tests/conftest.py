from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from tiny import save_r1_model, save_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    """Folder factory: tiny_dir("qwen2") -> a saved random model of that architecture (built once a session)."""
    root = tmp_path_factory.mktemp("tiny-models")
    made: dict[str, Path] = {}

    def get(arch: str = "qwen2") -> Path:
        if arch not in made:
            made[arch] = save_tiny_model(root / arch, arch)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def r1_dir(tmp_path_factory: pytest.TempPathFactory):
    """Folder factory: r1_dir("merged" | "added") -> an R1-shaped tiny model (tiny.save_r1_model), built once."""
    root = tmp_path_factory.mktemp("r1-models")
    made: dict[str, Path] = {}

    def get(kind: str = "merged") -> Path:
        if kind not in made:
            made[kind] = save_r1_model(root / kind, kind)
        return made[kind]

    return get


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
    return "eager" if arch.startswith("gemma") else "sdpa"
