"""K/V transplantation: a clone of one boundary state's cache with chosen layers, K or V, and positions taken
from another's. Used by the transplant experiment to test whether the cache carries a divergent trajectory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stagereplay.engine.cache import clone_cache, held, layer_span
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
    """`A:B` (half-open absolute positions, either side optional) -> (start, stop) clipped to the cache length."""
    if spec is None:
        return 0, length
    lo, sep, hi = spec.partition(":")
    if not sep or (lo and not lo.lstrip("-").isdigit()) or (hi and not hi.lstrip("-").isdigit()):
        raise StageReplayError(f"bad --positions {spec!r}", "use A:B, e.g. 0:64 or 10:")
    start, stop, _ = slice(int(lo) if lo else None, int(hi) if hi else None).indices(length)
    return start, stop


def held_spans(windows: Sequence[int | None], length: int) -> list[tuple[int, int]]:
    """Per layer, the absolute positions [start, stop) a cache of `length` positions holds: all of them, or a
    sliding window's last `window - 1` (`engine.cache.layer_windows` gives the windows)."""
    return [(0, length) if w is None else (max(0, length - (w - 1)), length) for w in windows]


def check_positions(positions: tuple[int, int], layers: Sequence[int], spans: Sequence[tuple[int, int]]) -> None:
    """Refuse a position range that no selected layer holds: a transplant of it would silently move nothing."""
    a, b = positions
    chosen = [spans[i] for i in layers]
    if chosen and all(min(b, stop) <= max(a, start) for start, stop in chosen):
        held = ", ".join(sorted({f"{start}:{stop}" for start, stop in chosen}))
        raise StageReplayError(
            f"--positions {a}:{b} lie outside every selected layer's cache (they hold positions {held})",
            "choose positions the layers still hold: a sliding-window layer keeps only its last window - 1",
        )


@dataclass(frozen=True)
class TransplantSpec:
    """Which parts of the donor's cache replace the recipient's."""

    layers: tuple[int, ...]
    kv: str = "kv"  # "k", "v" or "kv"
    positions: tuple[int, int] | None = None  # half-open absolute positions; None = every position


def transplant(recipient: Any, donor: Any, spec: TransplantSpec) -> Any:
    """A new cache: a clone of `recipient` with the selected K/V slices copied from `donor`.

    Neither input is modified. Both caches must cover the same positions (same shapes per layer). Positions
    are absolute: on a sliding-window layer only those of `spec.positions` still inside its window move, and a
    range outside every selected layer's span is refused rather than silently moving nothing.
    """
    import torch

    if spec.positions is not None:
        check_positions(spec.positions, spec.layers, [layer_span(layer) for layer in recipient.layers])
    out = clone_cache(recipient)
    with torch.inference_mode():
        for i in spec.layers:
            # Views of the positions each layer holds (engine.cache.held): a static cache's unwritten rows never
            # move, and writing into the clone's views keeps a static cache's tensors where they are.
            mine_k, mine_v, start = held(out.layers[i])
            theirs_k, theirs_v, their_start = held(donor.layers[i])
            stop = start + int(mine_k.shape[-2])
            if (their_start, their_start + int(theirs_k.shape[-2])) != (start, stop):
                raise StageReplayError(
                    f"cannot transplant layer {i}: positions {layer_span(donor.layers[i])} vs {(start, stop)}",
                    "transplant only between boundary states of the same prefix",
                )
            for name in spec.kv:
                theirs, mine = (theirs_k, mine_k) if name == "k" else (theirs_v, mine_v)
                if theirs.shape != mine.shape:
                    raise StageReplayError(
                        f"cannot transplant layer {i} {name.upper()}: shapes {tuple(theirs.shape)} vs {tuple(mine.shape)}",
                        "transplant only between boundary states of the same prefix",
                    )
                # Absolute [a, b) to this layer's rows: a sliding window's row 0 is position `start`.
                a, b = spec.positions if spec.positions is not None else (start, stop)
                lo, hi = max(a, start) - start, min(b, stop) - start
                if lo < hi:
                    mine[:, :, lo:hi] = theirs[:, :, lo:hi].to(mine.device)
    return out
