"""A boundary state's K/V sent through a lower-precision format and back: the precision a quantized K/V cache
keeps, applied once at the boundary (`roundtrip:<format>` constructions).

    fp8-e4m3   cast to float8 e4m3 and back, saturating at its largest finite value (448): what an fp8 cache with
               the default scale of 1.0 stores (vLLM's `kv_cache_dtype=fp8` without calibrated scales)
    fp8-e5m2   the same in float8 e5m2 (largest finite 57344)
    int8       blocks of 32 values along the head dimension, each scaled by its largest magnitude / 127 and rounded
               to an integer: llama.cpp's q8_0 layout

The continuation then runs in the cache's own precision from dequantized values: the question is whether the
precision lost at the boundary moves the continuation, set against what a one-shot prefill moves. The values are
changed on a clone; the source state is not touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    import torch

FORMATS = ("fp8-e4m3", "fp8-e5m2", "int8")
Q8_BLOCK = 32
"""Values per int8 block (llama.cpp's QK8_0)."""


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise StageReplayError(f"unknown round-trip format {fmt!r}", f"use roundtrip:{' or roundtrip:'.join(FORMATS)}")
    return fmt


def roundtrip_tensor(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """`x` [..., D] through `fmt` and back, in `x`'s dtype."""
    import torch

    wide = x.float()
    if fmt.startswith("fp8"):
        low = torch.float8_e4m3fn if fmt == "fp8-e4m3" else torch.float8_e5m2
        edge = torch.finfo(low).max
        return wide.clamp(-edge, edge).to(low).to(x.dtype)
    d = wide.shape[-1]
    pad = (-d) % Q8_BLOCK
    blocks = torch.nn.functional.pad(wide, (0, pad)).reshape(*wide.shape[:-1], -1, Q8_BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(blocks / scale.clamp_min(torch.finfo(torch.float32).tiny)), 0.0)
    back = (q.clamp(-127, 127) * scale).reshape(*wide.shape[:-1], d + pad)[..., :d]
    return back.to(x.dtype)


def roundtrip_cache(cache: Any, fmt: str) -> None:
    """Every layer's K and V of `cache` (a clone: it is changed in place) through `fmt` and back."""
    import torch

    check_format(fmt)
    with torch.inference_mode():
        for layer in cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
                    continue
                t.copy_(roundtrip_tensor(t, fmt))
