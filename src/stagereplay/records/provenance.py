"""Where and how a run was made: versions, commit, input hashes, and the numerics of each writing process.

`environment` is what the manifest records for the command's process and what each ledger item records (by
hash, in full once) for the process that computed it: a worker of a pool, a Ray actor on another machine,
a shard made elsewhere. Beside versions and device it holds what picks kernels, since two machines with
the same versions can still compute different bits: CUDA, cuDNN and driver versions and the GPU, the SDPA
backends enabled, the reduced-precision-reduction flags, and the CPU ISA and oneDNN settings.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from stagereplay.execution.kernels import KERNEL_ENV

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


@functools.cache
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


def model_hashes(path: str | Path) -> dict[str, Any]:
    """What identifies a model directory: config, weights, tokenizer files (together and each), and the
    generation config (where EOS comes from). A GGUF file holds all of these: its bytes are its identity."""
    from stagereplay.engine.gguf import file_hashes, is_gguf

    p = Path(path)
    if is_gguf(p) and p.is_file():
        return file_hashes(p)
    weights = [*p.glob("*.safetensors"), *p.glob("*.bin")]
    tokenizer = [p / n for n in TOKENIZER_FILES if (p / n).exists()]
    generation = p / "generation_config.json"
    return {
        "config": _hash_files([p / "config.json"]),
        "weights": _hash_files(weights),
        "tokenizer": _hash_files(tokenizer),
        "tokenizer_files": {f.name: _hash_files([f]) for f in tokenizer},
        "generation_config": _hash_files([generation]) if generation.exists() else None,
    }


def _cuda(device: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"cuda": torch.version.cuda, "cudnn": None, "driver": None, "gpu": None,
                           "capability": None}
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        out["cudnn"] = torch.backends.cudnn.version()
        out["gpu"] = torch.cuda.get_device_name(dev)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
        out["driver"] = _nvidia_driver()
    return out


def _nvidia_driver() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        return None




def _cpu_features() -> dict[str, bool] | None:
    """The instruction-set extensions torch's CPU kernels choose by: AVX-512 with or without bf16 and AMX
    tiles route bf16 matmuls to other kernels than AVX2 does, with other bits."""
    import torch

    probes = {name: getattr(torch.cpu, f"_is_{name}_supported", None)
              for name in ("avx2", "avx512", "avx512_bf16", "vnni", "amx_tile", "amx_fp16")}
    found = {name: p for name, p in probes.items() if p is not None}
    if len(found) < len(probes):
        return None  # an older torch: the capability string alone
    return {name: bool(p()) for name, p in found.items()}


MKL_BRANCHES = {0: "off", 1: "off", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2",
                9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}
"""MKL's conditional-numerical-reproducibility branches by their code (mkl_cbwr.h); "off": CNR not set."""


def _cpu_vendor() -> str | None:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD): MKL picks its code paths by it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mkl_branch() -> str | None:
    """The MKL code branch in force, as MKL itself reports it (None where torch's MKL cannot be asked).

    It may differ from what `MKL_CBWR` asked: MKL runs a vendor's branch only on that vendor's CPUs and falls
    back to its own dispatch (AUTO) without a word, so the variable alone does not say which code ran."""
    import ctypes

    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get  # what mkl_cbwr_get(MKL_CBWR_BRANCH) returns; torch exports only this name
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    code = int(get(1)) & 0xFFFF  # MKL_CBWR_BRANCH; the STRICT flag (0x10000) is part of the variable
    return MKL_BRANCHES.get(code, f"code {code}")


def _kernels(device: str) -> dict[str, Any]:
    """The global switches that choose this device's kernels: SDPA backends, reduced-precision reductions and
    TF32 (CUDA only: on a CPU they choose nothing, so a CPU run does not depend on them), the float32 matmul
    precision, the CPU ISA and oneDNN."""
    import torch

    cuda, cpu = torch.backends.cuda, torch.backends.cpu
    out: dict[str, Any] = {
        "sdpa": {"flash": cuda.flash_sdp_enabled(), "mem_efficient": cuda.mem_efficient_sdp_enabled(),
                 "math": cuda.math_sdp_enabled(), "cudnn": cuda.cudnn_sdp_enabled()},
        "reduced_precision": {"float32_matmul_precision": torch.get_float32_matmul_precision()},
        "cpu": {
            "capability": cpu.get_cpu_capability(),
            "features": _cpu_features(),
            "vendor": _cpu_vendor(),
            "mkl_branch": _mkl_branch(),
            "mkldnn_enabled": torch.backends.mkldnn.enabled,
            "mkldnn_available": torch.backends.mkldnn.is_available(),
            "env": {k: os.environ.get(k) for k in KERNEL_ENV},
        },
    }
    if device.startswith("cuda"):
        out["reduced_precision"].update({
            "bf16_reduction": cuda.matmul.allow_bf16_reduced_precision_reduction,
            "fp16_reduction": cuda.matmul.allow_fp16_reduced_precision_reduction,
            "tf32_matmul": cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        })
    return out


def environment(device: str, determinism: Mapping[str, object]) -> dict[str, Any]:
    """This process's environment for work on `device` under `determinism` (what `set_determinism` set)."""
    return json.loads(_environment(device, json.dumps(determinism, sort_keys=True)))


@functools.cache
def _environment(device: str, determinism: str) -> str:
    """Cached per process (git and nvidia-smi run once); JSON so that callers cannot mutate the cache."""
    return json.dumps({
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "device": device,
        "packages": package_versions(),
        "git": git_revision(),
        "determinism": json.loads(determinism),
        **_cuda(device),
        "kernels": _kernels(device),
    })
