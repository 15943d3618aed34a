"""llama.cpp as an honest variant of a claim it serves (`serving.engines.HONEST_VARIANTS`): the claimed GGUF
decoded greedily in this process by llama.cpp's own kernels (Q4_K dot products against activations quantized to 8
bits, and the rest of what llama-server runs), with the settings a deployment varies:

    llama.cpp             the context as `--engine llama.cpp` makes it: n_batch = n_ubatch = 512, no repacking,
                          no flash attention, K/V f16 (llama-server's default cache type)
    llama.cpp/repack      weights repacked into the CPU's wider layouts (llama-server's default: other kernels)
    llama.cpp/flash       flash attention (-fa)
    llama.cpp/ubatch:N    the prompt computed N tokens at a time (-b N -ub N)
    llama.cpp/threads:N   N threads (-t N): the kernels split their rows another way

Settings combine (`llama.cpp/repack/flash`). One context lives at a time, made again when the settings change; a
response is `LlamaCppEngine.sample` at temperature 0 (its pick and its raw log-probability of each token).
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from stagereplay.errors import StageReplayError
from stagereplay.serving.llamacpp import LlamaCppOptions, check_model, require
from stagereplay.serving.seam import EngineConfig, Sampling

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM
    from stagereplay.serving.llamacpp import LlamaCppEngine

FAMILY = "llama.cpp"
FLAGS = ("repack", "flash")
SIZES = ("ubatch", "threads")
USAGE = "llama.cpp[/repack][/flash][/ubatch:N][/threads:N]"
KV = "fp16"
"""The K/V cache type of every variant: llama.cpp's default f16, as llama-server keeps it."""


@dataclass(frozen=True)
class Setting:
    """A variant's settings as llama.cpp takes them."""

    options: LlamaCppOptions
    threads: int | None


def parse(settings: tuple[str, ...]) -> Setting:
    """The settings a variant's name spells (module docstring); refused in one line otherwise."""
    options, threads = LlamaCppOptions(), None
    seen: set[str] = set()
    for s in settings:
        key, _, arg = s.partition(":")
        if key in seen or key not in (*FLAGS, *SIZES) or (key in FLAGS) != (arg == ""):
            raise StageReplayError(f"unknown or repeated llama.cpp setting {s!r} in an honest variant", f"use {USAGE}")
        seen.add(key)
        if key in SIZES and not (arg.isascii() and arg.isdigit() and 0 < int(arg) <= 4096):
            raise StageReplayError(f"llama.cpp setting {s!r}: {key} must be a whole number from 1 to 4096",
                                   f"use {USAGE}")
        if key == "repack":
            options = replace(options, repack=True)
        elif key == "flash":
            options = replace(options, flash_attn=True)
        elif key == "ubatch":
            options = replace(options, n_batch=int(arg), n_ubatch=int(arg))
        else:
            threads = int(arg)
    return Setting(options, threads)


_LOADED: dict[tuple[Any, ...], LlamaCppEngine] = {}


def close() -> None:
    """The live context closed: at exit, before the interpreter tears down what llama-cpp-python's own finalizer
    needs (else it prints a traceback)."""
    for key in list(_LOADED):
        _LOADED.pop(key).close()


atexit.register(close)


def _engine(setting: Setting, path: str, threads: int) -> LlamaCppEngine:
    """The context of these settings on `path`; the one before it closed (one context at a time)."""
    from stagereplay.serving.llamacpp import load

    key = (setting, path, threads)
    if key not in _LOADED:
        close()
        _LOADED[key] = load(EngineConfig(FAMILY, setting.options), path, KV, threads, "cpu")
    return _LOADED[key]


class LlamaCppHonesty:
    """llama.cpp's honest variants (module docstring)."""

    defaults: tuple[str, ...] = ("llama.cpp", "llama.cpp/repack", "llama.cpp/flash", "llama.cpp/ubatch:32")

    def check(self, settings: tuple[str, ...]) -> None:
        parse(settings)
        try:
            require()
        except StageReplayError:
            raise StageReplayError(
                "the null of a GGUF claim holds llama.cpp's own honest variants, and llama-cpp-python is not installed",
                "pip install 'stagereplay[llamacpp]' (docs/how-to/llamacpp.md), or put your own llama-server of the "
                "file in the null instead (--honest fp32 --honest-url URL)") from None

    def serve(self, lm: LM, settings: tuple[str, ...], prompt: Sequence[int], limit: int, greedy: bool,
              where: str | None = None) -> tuple[list[int], str, list[float], str]:
        if not greedy:
            raise StageReplayError("llama.cpp's honest variants serve greedy claims only",
                                   "drop them from --honest for a seeded claim")
        check_model(lm.config.path)
        setting = parse(settings)
        engine = _engine(setting, lm.config.path, setting.threads or lm.config.threads)
        g = engine.sample(list(prompt), limit, Sampling.of(False, 1.0, 0, 1.0, 0))
        chosen = list(g.chosen or ())
        if len(chosen) != len(g.tokens):
            raise RuntimeError(f"llama.cpp gave {len(chosen)} log-probabilities for {len(g.tokens)} tokens")
        return list(g.tokens), "eos" if g.finish == "stop" else "length", chosen, engine.precision_name()


__all__ = ["FAMILY", "LlamaCppHonesty", "parse"]
