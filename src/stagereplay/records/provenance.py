"""What a manifest records about where and how a run was made: versions, commit, hashes, device."""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("stagereplay", "torch", "transformers", "tokenizers", "safetensors", "numpy", "scipy", "pydantic")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja")


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision() -> dict[str, Any]:
    """The commit of the stagereplay source tree and whether it had uncommitted changes (None outside git)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip() != ""
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _hash_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def model_hashes(path: str | Path) -> dict[str, str]:
    p = Path(path)
    weights = [*p.glob("*.safetensors"), *p.glob("*.bin")]
    return {
        "config": _hash_files([p / "config.json"]),
        "weights": _hash_files(weights),
        "tokenizer": _hash_files([p / n for n in TOKENIZER_FILES if (p / n).exists()]),
    }


def environment(device: str, determinism: dict[str, Any]) -> dict[str, Any]:
    import torch

    device_name = "cpu"
    if device.startswith("cuda") and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(torch.device(device))
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "device": device,
        "device_name": device_name,
        "packages": package_versions(),
        "git": git_revision(),
        "determinism": determinism,
    }
