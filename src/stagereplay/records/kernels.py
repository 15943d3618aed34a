"""Which fields of a recorded environment choose the kernels, and how two environments differ in them.

Two machines with the same code and inputs compute the same bits only when they run the same kernels. On a
CPU the kernels follow the instruction set (ATen's capability, and the AVX-512 bf16 and AMX extensions that
route bf16 matmuls elsewhere), the MKL / oneDNN / ATen caps set in the environment, the torch version and the
thread count; on a GPU, the GPU, CUDA and cuDNN, and the attention backends and reduced-precision switches.
Versions of transformers choose the operations themselves. The git commit, Python and the platform string
do not choose kernels and are left out: a different commit that changes the numbers is what the golden
ledger test (tests/test_layout.py) exists to catch.

The audit uses this to sort a unit whose re-execution differs: under the recorded kernels it is an integrity
finding (tampering or a broken run); under other kernels it is "not reproduced here".
"""

from __future__ import annotations

from collections.abc import Mapping

NOT_RECORDED = "not recorded"

_COMMON: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("machine", ("machine",)),
    ("torch", ("packages", "torch")),
    ("transformers", ("packages", "transformers")),
    ("threads", ("determinism", "threads")),
    ("deterministic algorithms", ("determinism", "deterministic_algorithms")),
    ("engine build", ("engine", "build")),  # a serving engine's own kernels (llama.cpp: version, CPU features)
)
_CPU: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ISA", ("kernels", "cpu", "capability")),
    ("CPU features", ("kernels", "cpu", "features")),
    ("CPU vendor", ("kernels", "cpu", "vendor")),
    ("kernel caps", ("kernels", "cpu", "env")),
    ("MKL branch", ("kernels", "cpu", "mkl_branch")),
    ("oneDNN", ("kernels", "cpu", "mkldnn_enabled")),
)
_GPU: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GPU", ("gpu",)),
    ("compute capability", ("capability",)),
    ("CUDA", ("cuda",)),
    ("cuDNN", ("cudnn",)),
    ("attention backends", ("kernels", "sdpa")),
    ("reduced precision", ("kernels", "reduced_precision")),
)


def _get(env: Mapping[str, object], path: tuple[str, ...]) -> object:
    value: object = env
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return NOT_RECORDED
        value = value[key]
    return value


def device_kind(env: Mapping[str, object]) -> str:
    device = env.get("device")
    return str(device).split(":")[0] if device else NOT_RECORDED


def kernel_fields(env: Mapping[str, object]) -> dict[str, object]:
    """The fields of `env` (a recorded environment, `records.provenance.environment`: JSON as it was read) that
    choose kernels, by name: the device kind, then the common ones, then the CPU's or the GPU's, each value as
    recorded (`NOT_RECORDED` where it was not)."""
    kind = device_kind(env)
    fields: dict[str, object] = {"device": kind}
    for name, path in _COMMON + (_GPU if kind == "cuda" else _CPU):
        value = _get(env, path)
        # An unset variable is no cap, whether or not the recording stagereplay listed it.
        fields[name] = {k: v for k, v in value.items() if v is not None} if name == "kernel caps" and isinstance(
            value, dict) else value
    return fields


def kernel_differences(recorded: Mapping[str, object], here: Mapping[str, object]
                       ) -> list[tuple[str, object, object]]:
    """(field, recorded value, value here) for each kernel-choosing field that differs. A field the run did
    not record (an older run) counts as differing: nothing says its kernels were these."""
    a, b = kernel_fields(recorded), kernel_fields(here)
    return [(name, a.get(name, NOT_RECORDED), b.get(name, NOT_RECORDED)) for name in dict.fromkeys([*a, *b])
            if a.get(name, NOT_RECORDED) != b.get(name, NOT_RECORDED)]


def _show(value: object) -> str:
    if isinstance(value, dict):
        parts = [k if v is True else f"{k}={v}" for k, v in value.items() if v not in (None, False)]
        return "+".join(parts) or "none"
    return str(value)


def describe(differences: list[tuple[str, object, object]]) -> str:
    """`ISA AVX512 (run) vs AVX2 (here); threads 1 (run) vs 2 (here)`."""
    return "; ".join(f"{name} {_show(a)} (run) vs {_show(b)} (here)" for name, a, b in differences)
