"""A cache moved by one unit in the last place of one element: the negative controls' plant."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stagereplay.engine.cache import bits, clone_cache, held, layer_span


def nudged(cache: Any, layer: int = 0, tensor: str = "k", index: Sequence[int] = (0, 0, 0, 0)) -> Any:
    """A clone of `cache` with one element moved by one unit in the last place.

    `index` is (batch, head, absolute position, dim); a position outside a sliding window's rows is refused.
    """
    out = clone_cache(cache)
    with torch.inference_mode():
        keys, values, start = held(out.layers[layer])
        b, h, pos, d = index
        row = pos - start
        if not 0 <= row < keys.shape[-2]:
            raise ValueError(f"position {pos} is not in layer {layer}'s span {layer_span(out.layers[layer])}")
        bits(keys if tensor == "k" else values)[b, h, row, d] += 1  # in place: the clone's own tensors
    return out
