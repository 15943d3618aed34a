"""GGUF files in our engine: `--model PATH.gguf` loads through transformers' GGUF support, dequantized.

A GGUF file is one file holding the weights (quantized or not), the config and the tokenizer, as llama.cpp and the
apps built on it run them. transformers reads all three from it (it needs the `gguf` package, and `accelerate` for
its loading path). Its default keeps quantized weights packed and computes every matmul in float32 whatever dtype
is asked for, so `--precision` would not mean what it means for a folder; here every weight is dequantized at load
(`GgufConfig(dequantize=True)`) into a plain dense model and cast to the run's dtype: the same arithmetic as a
folder checkpoint at that precision, on the weights the file holds (for a Q4_1 file, its 4-bit values times their
block scales, exact in fp32; rounded again in bf16).

What identifies the model is the file's bytes: `file_hashes` hashes them (config and tokenizer are inside), and
relocation and the audit check a moved file against that hash, as they check a folder's.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Any, TypedDict

from stagereplay.errors import StageReplayError

SUFFIX = ".gguf"
MAGIC = b"GGUF"
NEEDS = ("gguf", "accelerate")
"""What transformers' GGUF loading imports, beside transformers and torch."""


def is_gguf(path: str | Path) -> bool:
    """A path names a GGUF file by its suffix (what llama.cpp and every GGUF app go by)."""
    return str(path).lower().endswith(SUFFIX)


def require_gguf_packages() -> None:
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise StageReplayError(f"loading a GGUF file needs {' and '.join(missing)}, not installed here",
                               "pip install 'stagereplay[gguf]' (what reading a GGUF takes; the `llamacpp` extra "
                               "adds llama.cpp itself)")


_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF value type -> byte size (uint8 ... bool, uint64, int64, float64); 8 is a string, 9 an array."""


def _skip(f: Any, kind: int) -> None:
    import struct

    if kind in _SCALARS:
        f.seek(_SCALARS[kind], 1)
    elif kind == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif kind == 9:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            f.seek(_SCALARS[item] * count, 1)
        else:
            for _ in range(count):
                _skip(f, item)
    else:
        raise ValueError(f"GGUF value type {kind}")


def architecture(path: str | Path) -> str:
    """`general.architecture` from the file's header, reading the metadata up to that key and no tensor (gguf's
    reader parses every key first, a 49k-token vocabulary included: seconds for a check)."""
    import struct

    try:
        with open(path, "rb") as f:
            _magic, _version, _tensors, keys = struct.unpack("<4sIQQ", f.read(24))
            for _ in range(keys):
                (n,) = struct.unpack("<Q", f.read(8))
                key = f.read(n).decode()
                (kind,) = struct.unpack("<I", f.read(4))
                if key == "general.architecture" and kind == 8:
                    (m,) = struct.unpack("<Q", f.read(8))
                    return f.read(m).decode()
                _skip(f, kind)
    except (OSError, ValueError, UnicodeDecodeError, struct.error):
        pass
    raise StageReplayError(f"cannot read general.architecture from the GGUF metadata of {path}",
                           "pass a complete .gguf file (llama.cpp's convert_hf_to_gguf.py writes one)")


def supported_architectures() -> tuple[str, ...]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return tuple(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def check_gguf(path: str | Path) -> Path:
    """Fail fast, before any run directory exists, on a GGUF path our engine cannot load."""
    p = Path(path)
    if not p.is_file():
        raise StageReplayError(f"GGUF file not found: {p}", "pass --model an existing .gguf file or a model directory")
    with open(p, "rb") as f:
        if f.read(4) != MAGIC:
            raise StageReplayError(f"{p} is not a GGUF file (it does not start with GGUF)",
                                   "pass a .gguf file written by llama.cpp's converter, or a model directory")
    require_gguf_packages()
    arch = architecture(p)
    supported = supported_architectures()
    if arch not in supported:
        raise StageReplayError(f"transformers {_transformers_version()} cannot load GGUF architecture {arch!r} "
                               f"({p.name})", f"use a model of one of {', '.join(supported)}, or its "
                               "Hugging Face folder")
    return p


def _transformers_version() -> str:
    from importlib import metadata

    return metadata.version("transformers")


class GgufArguments(TypedDict, total=False):
    """`from_pretrained` keywords for a GGUF file (none for a folder)."""

    gguf_file: str  # the file's name, in the folder passed as the path
    quantization_config: Any  # transformers' GgufConfig(dequantize=True), when the weights load


def from_pretrained_args(path: str | Path, weights: bool = False) -> tuple[Path, GgufArguments]:
    """What `from_pretrained` takes for this path: a folder as is; a GGUF file as its folder and `gguf_file`,
    dequantized when the weights load."""
    p = Path(path)
    if not is_gguf(p):
        return p, {}
    kwargs: GgufArguments = {"gguf_file": p.name}
    if weights:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    return p.parent, kwargs


def file_sha256(path: str | Path) -> str:
    """sha256 of the file's bytes (its name is not part of what it is: a renamed copy is the same model)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_hashes(path: str | Path) -> dict[str, Any]:
    """A GGUF model's identity for the manifest: the file (weights, config and tokenizer are all inside it)."""
    return {"gguf": file_sha256(path)}
