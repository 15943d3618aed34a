"""K/V caches as data: snapshot, fingerprint and bitwise comparison (transplants: `engine.transplant`).

Per-layer tensors follow transformers 5.x: `cache.layers[i].keys` / `.values`, shape [B, H_kv, T, D]
(a sliding-window layer holds only its last `window - 1` positions).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KV = ("k", "v")


def new_cache(model: Any) -> Any:
    """The cache `generate()` would build for this model (sliding-window layers included)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def clone_cache(cache: Any) -> Any:
    """A deep copy that later forwards on either side cannot touch.

    `DynamicLayer.update` rebinds `keys`/`values` on the same layer object, so a shallow copy would follow the
    original as it grows; only fresh layer objects with fresh tensors make a snapshot.
    """
    import torch

    with torch.inference_mode():
        return copy.deepcopy(cache)


def layer_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(K, V)] per layer, each [B, H_kv, T, D]."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    import torch

    t = t.detach().contiguous().cpu()
    # A uint8 view sees the exact bits, whatever the dtype (numpy has no bf16).
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def tensor_digest(t: torch.Tensor) -> str:
    header = f"{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}\n".encode()
    return hashlib.sha256(header + _tensor_bytes(t)).hexdigest()


def layer_fingerprints(cache: Any) -> list[dict[str, str]]:
    """Per layer, the sha256 of K and of V (dtype and shape in the header)."""
    return [{"k": tensor_digest(k), "v": tensor_digest(v)} for k, v in layer_tensors(cache)]


def cache_fingerprint(cache: Any) -> str:
    """sha256 over every layer's K then V, each with a dtype/shape header."""
    h = hashlib.sha256()
    for k, v in layer_tensors(cache):
        for t in (k, v):
            h.update(f"{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}\n".encode())
            h.update(_tensor_bytes(t))
    return h.hexdigest()


@dataclass(frozen=True)
class CacheDifference:
    """The first place two caches differ bitwise."""

    layer: int
    tensor: str  # "k" or "v"
    position: int | None  # sequence position; None when the shapes or dtypes differ
    reason: str = "value"

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "tensor": self.tensor, "position": self.position, "reason": self.reason}


def _bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    # Compare bit patterns, not values: -0.0 == 0.0 and NaN != NaN would both hide or invent differences.
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(view)


def compare_caches(a: Any, b: Any) -> list[CacheDifference]:
    """Every (layer, K|V) whose bits differ, with the first differing sequence position. Empty = bit-exact."""
    ta, tb = layer_tensors(a), layer_tensors(b)
    if len(ta) != len(tb):
        return [CacheDifference(min(len(ta), len(tb)), "k", None, "layer count")]
    out = []
    for i, (pa, pb) in enumerate(zip(ta, tb, strict=True)):
        for name, x, y in zip(KV, pa, pb, strict=True):
            if x.shape != y.shape or x.dtype != y.dtype:
                out.append(CacheDifference(i, name, None, "shape or dtype"))
                continue
            differs = (_bits(x) != _bits(y).to(x.device)).flatten(0, 1).any(dim=(0, 2))  # [T]
            if bool(differs.any()):
                out.append(CacheDifference(i, name, int(differs.nonzero()[0, 0]), "value"))
    return out


def nudged(cache: Any, layer: int = 0, tensor: str = "k", index: Sequence[int] = (0, 0, 0, 0)) -> Any:
    """A clone of `cache` with one element moved by one unit in the last place (for negative controls)."""
    import torch

    out = clone_cache(cache)
    with torch.inference_mode():
        t = out.layers[layer].keys if tensor == "k" else out.layers[layer].values
        t = t.clone()
        bits = _bits(t)
        bits[tuple(index)] += 1
        if tensor == "k":
            out.layers[layer].keys = t
        else:
            out.layers[layer].values = t
    return out
