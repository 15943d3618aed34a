"""The serving engines, by name: one line each in `ENGINES` (and in `HONEST_VARIANTS` an engine that decodes a claimed
model as an honest variant); an extension (or a test) adds one with `register`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.serving import http, http_honest, llamacpp, llamacpp_honest, vllm
from stagereplay.serving.seam import EngineConfig, EngineKind, options_of

ENGINES: dict[str, EngineKind] = {k.name: k for k in (vllm.VllmKind(), llamacpp.LlamaCppKind(), http.HttpKind())}
HONEST_VARIANTS: dict[str, Any] = {llamacpp_honest.FAMILY: llamacpp_honest.LlamaCppHonesty(),
                                   http_honest.FAMILY: http_honest.HttpHonesty()}
"""The engines that decode a claimed model as an honest variant of a claim they serve (llama.cpp's kernels for a
GGUF, in this process; a trusted deployment of it, `url`), by the family name their variants start with: each
satisfies the claim's `EngineHonesty`."""
OURS = "hf"
"""Our engine's name where an engine is chosen (`--engine`, `--cross`)."""


def kind_of(name: str) -> EngineKind:
    """The engine called `name`; refused in one line when none is."""
    try:
        return ENGINES[name]
    except KeyError:
        raise StageReplayError(f"unknown engine {name!r}", f"use {OURS} (ours) or one of {', '.join(ENGINES)}") from None


def register(kind: EngineKind) -> None:
    ENGINES[kind.name] = kind


def unregister(name: str) -> None:
    ENGINES.pop(name, None)


def engine_config(name: str, options: Mapping[str, Any] | None = None, seed: int = 0, logprobs_mode: str = "raw"
                  ) -> EngineConfig:
    """The config of engine `name` with the options given for it; an option it does not take is refused."""
    kind = kind_of(name)
    return EngineConfig(name, options_of(kind.options, dict(options or {}), name), seed, logprobs_mode)


def config_from_dict(d: Mapping[str, Any]) -> EngineConfig:
    """An engine config as a manifest recorded it (`EngineConfig.as_dict`); options a recorded engine no longer
    takes are refused in one line."""
    rest = {k: v for k, v in d.items() if k not in ("name", "seed", "logprobs_mode")}
    return engine_config(str(d["name"]), rest, int(d.get("seed", 0)), str(d.get("logprobs_mode", "raw")))
