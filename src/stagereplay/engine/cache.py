"""K/V caches as data: snapshot, fingerprint and bitwise comparison (transplants: `engine.transplant`).

Per-layer tensors follow transformers 5.x: `cache.layers[i].keys` / `.values`, shape [B, H_kv, T, D].
A sliding-window layer holds only its last `window - 1` positions, so row 0 of its tensors is not position 0:
`layer_start` gives the absolute position of row 0, and every position this module reports is absolute.

Two kinds of cache (`new_cache`): `dynamic` (transformers' DynamicCache, grown by concatenation: the reference,
what generate() uses) and `static` (StaticCache: [B, H_kv, L, D] tensors preallocated for L positions and
written in place, what generate(cache_implementation="static") uses). Everything here reads a layer through
`held`, the rows of the positions it holds, so a static cache's unwritten rows (and the one row a full static
sliding-window layer keeps past its window, which no later step reads) are never hashed, compared or moved:
a static cache and a dynamic one holding the same values have the same fingerprints (tests/test_static_cache.py).

Costs are kept at what a long trace allows: comparisons run on the caches' device (`torch.equal` per tensor,
locating the first difference only in an unequal one) and fingerprints stream bounded chunks to the host,
never a whole cache at once.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    import torch

KV = ("k", "v")
CHUNK_BYTES = 16 << 20
"""Largest piece of a tensor copied to the host at once while fingerprinting."""


def new_cache(model: Any, kind: str = "dynamic", length: int | None = None) -> Any:
    """The cache `generate()` would build for this model (sliding-window layers included).

    `kind="static"`: the StaticCache that generate(cache_implementation="static") builds for `length` positions
    (its max_cache_len, which a static forward's numbers depend on: attention runs over all L rows, masked).
    Each sliding-window layer is told its window, which `held` needs and StaticSlidingWindowLayer forgets.
    """
    from transformers import DynamicCache, StaticCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind != "static" or length is None or length < 1:
        raise ValueError(f"cache kind {kind!r} with length {length}")
    cache = StaticCache(config=model.config, max_cache_len=length)
    for layer, window in zip(cache.layers, layer_windows(model.config), strict=True):
        if window is not None:
            setattr(layer, "sliding_window", window)  # noqa: B010  # an attribute StaticSlidingWindowLayer lacks
    return cache


def is_static(cache: Any) -> bool:
    """Whether `cache` is preallocated (its layers hold `max_cache_len` rows) rather than grown."""
    return any(hasattr(layer, "max_cache_len") for layer in cache.layers)


def allocated(cache: Any) -> int | None:
    """A static cache's allocated positions L (its full-attention layers' `max_cache_len`; a sliding-window layer
    holds min(W, L) rows), which a static forward's shapes follow; None for a dynamic cache."""
    lengths = [int(layer.max_cache_len) for layer in cache.layers if hasattr(layer, "max_cache_len")]
    return max(lengths) if lengths else None


def held(layer: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(K, V, start): the layer's rows for the positions it holds, each [B, H_kv, T, D], and the absolute position
    of their row 0. Views, not copies: writing into them writes the cache.

    A dynamic layer's tensors are exactly that. A static layer has written rows [0, n) of its L (n positions
    so far). A static sliding-window layer of window W keeps the last min(n, W) positions in its rows, one more
    than the W - 1 a dynamic one keeps: the oldest is never read again (the next step rolls it out), so `held`
    leaves it out, and both kinds hold the same positions.
    """
    if not hasattr(layer, "max_cache_len"):
        k, v = layer.keys, layer.values
        return k, v, int(layer.get_seq_length()) - int(k.shape[-2])
    if not layer.is_initialized:
        raise ValueError("an empty static cache layer holds no positions")
    if hasattr(layer, "cumulative_length_int"):  # StaticSlidingWindowLayer: a Python int, no device sync
        n = int(layer.cumulative_length_int)
        window = getattr(layer, "sliding_window", None)
        if window is None:  # not made by new_cache: a window below L is the layer's size, else no row drops out
            window = layer.max_cache_len if not layer.is_croppable else n + 1
        rows = min(n, int(layer.max_cache_len))  # rows [0, rows) hold positions [n - rows, n)
        keep = min(n, window - 1)
        return layer.keys[:, :, rows - keep : rows], layer.values[:, :, rows - keep : rows], n - keep
    n = int(layer.cumulative_length)
    return layer.keys[:, :, :n], layer.values[:, :, :n], 0


def _layer_kind(layer: Any) -> str:
    name = type(layer).__name__
    if "Linear" in name and "Attention" in name and ("Full" in name or "Sliding" in name):
        return f"hybrid layer ({name}: recurrent state beside K/V)"
    if "Linear" in name:
        return f"recurrent or linear-attention state ({name})"
    if name == "DummyLayer":
        return "layer without K/V of its own (DummyLayer: shared KV or no attention)"
    return f"non-K/V cache layer ({name})"


def check_cache_kinds(config: Any, cache_implementation: str | None = None) -> None:
    """Refuse, in one line, a model whose cache is not plain per-layer K/V.

    Replay is audited on the K/V cache: it is fingerprinted, compared and transplanted as the whole boundary
    state. A recurrent or linear-attention state (Mamba, and the hybrids Jamba, Bamba, Falcon-H1, LFM2,
    Qwen3-Next), a layer reading another layer's K/V, or a static, quantized or offloaded cache chosen by
    `cache_implementation` would be part of the state yet not fingerprinted, compared or transplanted.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    text = config.get_text_config()
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", "unknown")
    if cache_implementation:
        raise StageReplayError(
            f"model type {model_type} asks for cache_implementation={cache_implementation!r} in its "
            "generation_config, a cache that is not plain per-layer K/V",
            "remove cache_implementation from generation_config.json to run on a dynamic K/V cache",
        )
    try:
        layers = DynamicCache(config=config).layers
    except Exception as exc:
        raise StageReplayError(f"model type {model_type}: cannot lay out its cache ({type(exc).__name__})",
                               "use a model whose layers hold plain K/V") from None
    for i, layer in enumerate(layers):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise StageReplayError(
                f"model type {model_type} has a {_layer_kind(layer)} in layer {i}, which stagereplay cannot "
                "fingerprint, compare or transplant",
                "use a model whose every layer holds plain K/V (full or sliding-window attention)",
            )


def layer_windows(config: Any) -> list[int | None]:
    """Per layer, the sliding window of its cache (None for a full-attention layer), read from the config."""
    from transformers import DynamicCache

    return [getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
            for layer in DynamicCache(config=config).layers]


def clone_cache(cache: Any) -> Any:
    """A deep copy that later forwards on either side cannot touch.

    `DynamicLayer.update` rebinds `keys`/`values` on the same layer object, so a shallow copy would follow the
    original as it grows; only fresh layer objects with fresh tensors make a snapshot.
    """
    import torch

    with torch.inference_mode():
        return copy.deepcopy(cache)


def layer_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(K, V)] per layer over the positions it holds (`held`), each [B, H_kv, T, D]."""
    return [held(layer)[:2] for layer in cache.layers]


def layer_start(layer: Any) -> int:
    """Absolute position of the first position a layer holds: 0, or how far a sliding window has moved."""
    return held(layer)[2]


def layer_span(layer: Any) -> tuple[int, int]:
    """Half-open absolute positions [start, stop) the layer holds."""
    k, _, start = held(layer)
    return start, start + int(k.shape[-2])


def _host_chunks(t: torch.Tensor) -> Iterator[Any]:
    """The bytes of `t` in row-major order, as host buffers of at most `CHUNK_BYTES` (a uint8 view: exact bits)."""
    import torch

    t = t.detach()
    if t.numel() == 0:
        return
    rows = t.reshape(-1, t.shape[-1]) if t.is_contiguous() else None
    groups = [rows] if rows is not None else [t[idx] for idx in _leading_indices(t)]  # each [T, D], contiguous
    for g in groups:
        g = g.contiguous()  # a no-op for a [T, D] slice of a [B, H, T, D] tensor
        step = max(1, CHUNK_BYTES // max(1, g.shape[-1] * g.element_size()))
        for start in range(0, g.shape[0], step):
            yield g[start : start + step].cpu().view(torch.uint8).numpy()


def _leading_indices(t: torch.Tensor) -> Iterator[tuple[int, ...]]:
    import itertools

    return itertools.product(*(range(n) for n in t.shape[:-2]))


def _header(t: torch.Tensor) -> bytes:
    return f"{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}\n".encode()


def tensor_digest(t: torch.Tensor) -> str:
    h = hashlib.sha256(_header(t))
    for chunk in _host_chunks(t):
        h.update(chunk)
    return h.hexdigest()


def layer_fingerprints(cache: Any) -> list[dict[str, str]]:
    """Per layer, the sha256 of K and of V (dtype and shape in the header)."""
    return [{"k": tensor_digest(k), "v": tensor_digest(v)} for k, v in layer_tensors(cache)]


def cache_fingerprints(cache: Any) -> tuple[str, list[dict[str, str]]]:
    """`cache_fingerprint(cache)` and `layer_fingerprints(cache)` from one pass over the cache: each chunk goes to
    the host once and into both hashes, where computing the two apart would stream every byte twice."""
    whole = hashlib.sha256()
    layers = []
    for k, v in layer_tensors(cache):
        digests = {}
        for name, t in (("k", k), ("v", v)):
            one = hashlib.sha256(_header(t))
            whole.update(_header(t))
            for chunk in _host_chunks(t):
                one.update(chunk)
                whole.update(chunk)
            digests[name] = one.hexdigest()
        layers.append(digests)
    return whole.hexdigest(), layers


def cache_fingerprint(cache: Any) -> str:
    """sha256 over every layer's K then V, each with a dtype/shape header, streamed in bounded chunks."""
    h = hashlib.sha256()
    for k, v in layer_tensors(cache):
        for t in (k, v):
            h.update(_header(t))
            for chunk in _host_chunks(t):
                h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class CacheDifference:
    """The first place two caches differ bitwise."""

    layer: int
    tensor: str  # "k" or "v"
    position: int | None  # absolute sequence position; None when the shapes or dtypes differ
    reason: str = "value"

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "tensor": self.tensor, "position": self.position, "reason": self.reason}


def bits(t: torch.Tensor) -> torch.Tensor:
    import torch

    # Compare bit patterns, not values: -0.0 == 0.0 and NaN != NaN would both hide or invent differences.
    # A same-size dtype view needs no copy, even of a sliding window's strided slice.
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().view(view)


def compare_caches(a: Any, b: Any) -> list[CacheDifference]:
    """Every (layer, K|V) whose bits differ, with the first differing absolute position. Empty = bit-exact."""
    import torch

    if len(a.layers) != len(b.layers):
        return [CacheDifference(min(len(a.layers), len(b.layers)), "k", None, "layer count")]
    out = []
    for i, (la, lb) in enumerate(zip(a.layers, b.layers, strict=True)):
        ka, va, start = held(la)
        kb, vb, start_b = held(lb)
        for name, x, y in ((KV[0], ka, kb), (KV[1], va, vb)):
            if x.shape != y.shape or x.dtype != y.dtype or start_b != start:
                out.append(CacheDifference(i, name, None, "shape or dtype"))
                continue
            bx, by = bits(x), bits(y).to(x.device)
            if torch.equal(bx, by):  # on the device, no copy: the common case costs one pass
                continue
            differs = (bx != by).flatten(0, 1).any(dim=(0, 2))  # [T]
            out.append(CacheDifference(i, name, start + int(differs.nonzero()[0, 0]), "value"))
    return out

