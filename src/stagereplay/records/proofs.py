"""Where a machine keeps the proofs of its fast steps (engine.proof), so that a model setting is proven once per
machine, not once per process: the workers of a run, its later stages and later commands reuse the proof.

A proof holds for what chose the bits it compared: the machine and its kernels (CPU or GPU, the variables that
pin ATen, oneDNN and MKL, the thread count), the code (torch, transformers, and this package's own source, hashed
file by file, so an edit of the engine is a new key), the model setting (`ModelConfig`: path, precision,
device, attention, cache kind, rows) and the model files as they are now (name, size and modification time of
each), and the fast step itself (its kind, the static length it runs at, and whether library switches are held at
their eager values). All of it is hashed into the entry's key (`proof_key`); anything else is a new entry, proven
afresh.

    ~/.cache/stagereplay/proofs/<key>.json     the proof as the last process to extend it left it
    ~/.cache/stagereplay/proofs/<key>.lock     held while one process proves (the others wait, then reuse)

`STAGEREPLAY_PROOFS` names another folder, or `off` for none (each process then proves its own). Whoever loads a
model passes `machine_store()` on (execution.models.cached_lm layers this process's memory before it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields, replace
from pathlib import Path

from stagereplay.engine.proof import Proof
from stagereplay.engine.proof_stores import FastStep
from stagereplay.records.provenance import environment

ENV = "STAGEREPLAY_PROOFS"


def proofs_dir() -> Path | None:
    """The folder proofs are kept in on this machine, None where `STAGEREPLAY_PROOFS=off`."""
    where = os.environ.get(ENV, "")
    if where.lower() == "off":
        return None
    if where:
        return Path(where)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "stagereplay" / "proofs"


@functools.cache
def source_digest() -> str:
    """sha256 over this package's Python source, file by file: the code a proof ran."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def model_stamp(path: str) -> list[tuple[str, int, int]]:
    """Each model file's name, size and modification time (a GGUF is one file): a re-saved model is a new one."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else []
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def proof_key(step: FastStep) -> str:
    """The key of the proofs of `step` on this machine (see the module docstring)."""
    from stagereplay.engine.decode import EAGER_BRANCHES

    env = environment(step.model.device, dict(step.settings))
    env.pop("git", None)  # the source digest says more: an uncommitted edit is another key
    return hashlib.sha256(json.dumps({
        "environment": env, "source": source_digest(), "model": step.model.as_dict(),
        "files": model_stamp(step.model.path), "step": step.name, "eager_branches": step.eager_branches,
        "switches": EAGER_BRANCHES,
    }, sort_keys=True, default=str).encode()).hexdigest()


class DirectoryStore:
    """engine.proof_stores.ProofStore over one folder: a JSON file per key, written whole (a temporary file
    renamed), and a lock file per key held with flock while a process proves. Plain data, so that a run hands it
    to its worker processes and Ray actors."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._keys: dict[FastStep, str] = {}

    def key(self, step: FastStep) -> str:
        if step not in self._keys:
            self._keys[step] = proof_key(step)
        return self._keys[step]

    def where(self, step: FastStep) -> str:
        return str(self.folder / f"{self.key(step)}.json")

    @contextmanager
    def lock(self, step: FastStep) -> Iterator[None]:
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"{self.key(step)}.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def get(self, step: FastStep) -> Proof | None:
        """The entry's proof, taken as made by another process (`reused`): a process finds its own in its memory,
        the layer before this one."""
        try:
            raw = json.loads(Path(self.where(step)).read_text())
            names = {f.name for f in fields(Proof)}
            proof = Proof(**{k: v for k, v in raw.items() if k in names})
        except (OSError, ValueError, TypeError):
            return None  # none yet, or unreadable: prove afresh (and overwrite it)
        return replace(proof, reused=True) if proof.key == self.key(step) else None

    def put(self, step: FastStep, proof: Proof) -> Proof:
        proof = replace(proof, key=self.key(step))
        target = Path(self.where(step))
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**proof.stored(), "reused": False, "pid": os.getpid()}, sort_keys=True))
        os.replace(tmp, target)
        return proof


def machine_store() -> DirectoryStore | None:
    """This machine's proof store, None where `STAGEREPLAY_PROOFS=off`."""
    folder = proofs_dir()
    return DirectoryStore(folder) if folder is not None else None
