"""K/V transplantation: a clone of one boundary state's cache with chosen layers, K or V, and positions taken
from another's. Used by the transplant experiment to test whether the cache carries a divergent trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stagereplay.engine.cache import KV, clone_cache, layer_tensors
from stagereplay.errors import StageReplayError


def parse_layers(spec: str, n_layers: int) -> tuple[int, ...]:
    """`all`, `none`, or a comma list of layers and inclusive bands: `0-3,10,12-13`."""
    if spec == "all":
        return tuple(range(n_layers))
    if spec == "none":
        return ()
    layers: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise StageReplayError(f"bad --layers {spec!r}", "use all, none, or e.g. 0-3,10")
        first, last = int(lo), int(hi or lo)
        if first > last or last >= n_layers:
            raise StageReplayError(f"--layers {spec!r} out of range for {n_layers} layers",
                                   f"use layers 0-{n_layers - 1}")
        layers.update(range(first, last + 1))
    return tuple(sorted(layers))


def parse_positions(spec: str | None, length: int) -> tuple[int, int]:
    """`A:B` (half-open, either side optional) -> (start, stop) clipped to the cache length."""
    if spec is None:
        return 0, length
    lo, sep, hi = spec.partition(":")
    if not sep or (lo and not lo.lstrip("-").isdigit()) or (hi and not hi.lstrip("-").isdigit()):
        raise StageReplayError(f"bad --positions {spec!r}", "use A:B, e.g. 0:64 or 10:")
    start, stop, _ = slice(int(lo) if lo else None, int(hi) if hi else None).indices(length)
    return start, stop


@dataclass(frozen=True)
class TransplantSpec:
    """Which parts of the donor's cache replace the recipient's."""

    layers: tuple[int, ...]
    kv: str = "kv"  # "k", "v" or "kv"
    positions: tuple[int, int] | None = None  # half-open; None = every position


def transplant(recipient: Any, donor: Any, spec: TransplantSpec) -> Any:
    """A new cache: a clone of `recipient` with the selected K/V slices copied from `donor`.

    Neither input is modified. Both caches must cover the same positions (same shapes per layer).
    """
    import torch

    out = clone_cache(recipient)
    donors = layer_tensors(donor)
    with torch.inference_mode():
        for i in spec.layers:
            layer = out.layers[i]
            for name in spec.kv:
                theirs = donors[i][KV.index(name)]
                mine = layer.keys if name == "k" else layer.values
                if theirs.shape != mine.shape:
                    raise StageReplayError(
                        f"cannot transplant layer {i} {name.upper()}: shapes {tuple(theirs.shape)} vs {tuple(mine.shape)}",
                        "transplant only between boundary states of the same prefix",
                    )
                new = theirs.clone() if spec.positions is None else mine.clone()
                if spec.positions is not None:
                    a, b = spec.positions
                    new[:, :, a:b] = theirs[:, :, a:b]
                if name == "k":
                    layer.keys = new
                else:
                    layer.values = new
    return out
