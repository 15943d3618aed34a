"""Why two arms diverged: logit margins per step, the logits at the first divergent step, and how far apart
two boundary caches are, per layer and per position band.

Everything here reduces on the tensors' device and moves only the summaries to the host, once per call: two
arms' logits [V] at a step become a few numbers, two caches of [B, H_kv, T, D] per layer become a few numbers
per layer and band. Nothing per element is stored; per-step margins are reduced as the steps are made
(engine.steps), so no [S, V] tensor ever exists.

Margins are LayerCast's quantity (arXiv 2506.09501): the fp32 gap between the top-1 and the top-2 logit of a
step. A greedy pick flips between two numerically different states only where that gap is smaller than the
states' logit difference, so the margin at the first divergent step is read against the margins of all steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from stagereplay.engine.cache import bits
from stagereplay.engine.steps import TOP_K

if TYPE_CHECKING:
    import torch

LAST_BAND = 16  # the last positions before the boundary get their own band


class ArmLogits(TypedDict):
    """One arm's logits at the first divergent step."""

    margin: float | None  # top-1 minus top-2 logit (None: one candidate, or not finite)
    top: list[tuple[int, float | None]]  # the top-5 (token id, logit), best first, ties by id


class DivergenceLogits(TypedDict):
    """Both arms at the first step where their tokens differ."""

    step: int
    logit_maxabs: float | None
    a: ArmLogits
    b: ArmLogits


class LogitComparison(TypedDict):
    """What two arms' logits say (`logit_comparison`)."""

    first_step_logit_maxabs: float | None
    divergence: DivergenceLogits | None


class TensorDistance(TypedDict):
    """How far one tensor is from its reference: max |a - b|, ||a - b|| / ||a|| (None: not finite), and the
    elements whose bits differ."""

    maxabs: float | None
    rel_l2: float | None
    n_diff: int


class LayerDistance(TypedDict):
    layer: int
    k: TensorDistance
    v: TensorDistance


class BandDistance(TypedDict):
    """One position band, over every layer: [start, end) in absolute positions."""

    band: str
    start: int
    end: int
    k: TensorDistance
    v: TensorDistance


class CacheDistance(TypedDict):
    """How far one cache is from another, per layer and per position band (`cache_difference`)."""

    layers: list[LayerDistance]
    bands: list[BandDistance]


def _finite(x: float) -> float | None:
    """JSON has no NaN or infinity: a non-finite summary is stored as null."""
    return x if math.isfinite(x) else None


def logit_comparison(first_a: torch.Tensor | None, first_b: torch.Tensor | None, divergence: int | None,
                     at_a: torch.Tensor | None = None, at_b: torch.Tensor | None = None) -> LogitComparison:
    """What two arms' logits say, given each arm's logits [V] at its first step and at the first divergent step.

    `first_step_logit_maxabs` is the fp32 max-abs difference at the first suffix step: both arms see the same
    token there, so it measures how far apart the two states are even when no pick changes. `divergence` holds,
    at the first step whose picks differ (`divergence`, with `at_a` / `at_b` the arms' logits there), each arm's
    margin and top-5 (token id, fp32 logit) and the max-abs difference of the two logit vectors; it is null when
    the suffixes agree or one arm has no logits at that step (it stopped before it: None is passed).
    """
    import torch

    out: LogitComparison = {"first_step_logit_maxabs": None, "divergence": None}
    if first_a is not None and first_b is not None and first_a.shape == first_b.shape:
        out["first_step_logit_maxabs"] = _finite(float((first_a.float() - first_b.float()).abs().max()))
    d = divergence
    if d is None or at_a is None or at_b is None or at_a.shape != at_b.shape:
        return out
    pair = torch.stack([at_a.float(), at_b.float()])  # [2, V]; the cast from 16 bits is exact
    k = min(TOP_K, pair.shape[1])
    # A stable sort lists tied logits by token id, as greedy argmax picks them; topk's order among ties is not
    # specified, and in bf16 ties are common exactly where arms diverge.
    top = torch.sort(pair, dim=-1, descending=True, stable=True)  # values, indices [2, V]
    maxabs = (pair[0] - pair[1]).abs().max()
    values, ids, gap = top.values[:, :k].tolist(), top.indices[:, :k].tolist(), float(maxabs)
    arms: list[ArmLogits] = []
    for v, i in zip(values, ids, strict=True):
        arms.append({"margin": _finite(v[0] - v[1]) if k > 1 else None,
                     "top": [(int(t), _finite(float(x))) for t, x in zip(i, v, strict=True)]})
    out["divergence"] = {"step": d, "logit_maxabs": _finite(gap), "a": arms[0], "b": arms[1]}
    return out


def position_bands(prompt_len: int, n_positions: int) -> list[tuple[str, int, int]]:
    """(name, start, end) half-open bands over the cache's absolute positions 0..n_positions-1.

    `prompt`, then stage 1 held in the cache split into quartiles `s1.q1`..`s1.q4` (the pending boundary token is
    not in the cache), then `last16`, which overlaps the quartiles on purpose: it is where a fresh prefill and a
    live decode differ most in how recently the K/V were computed. Empty bands are left out.
    """
    bands = [("prompt", 0, min(prompt_len, n_positions))]
    s1 = max(n_positions - prompt_len, 0)
    for q in range(4):
        bands.append((f"s1.q{q + 1}", prompt_len + s1 * q // 4, prompt_len + s1 * (q + 1) // 4))
    bands.append((f"last{LAST_BAND}", max(n_positions - LAST_BAND, 0), n_positions))
    return [(name, lo, hi) for name, lo, hi in bands if hi > lo]


def _per_position(x: torch.Tensor, y: torch.Tensor, n_positions: int) -> torch.Tensor:
    """[4, n_positions] fp64 rows: max |x-y|, sum (x-y)^2, sum x^2, count of differing bits; per absolute position.

    x, y are [B, H_kv, T_l, D]. A layer that holds fewer positions than the cache spans (a sliding window keeps
    only its last window-1) holds the last T_l of them; the positions it does not hold stay zero, so bands
    summarise what the layer holds.
    """
    import torch

    xf, yf = x.float(), y.float()
    diff = xf - yf
    rows = torch.stack([
        diff.abs().amax(dim=(0, 1, 3)),
        diff.pow(2).sum(dim=(0, 1, 3)),
        xf.pow(2).sum(dim=(0, 1, 3)),
        (bits(x) != bits(y)).sum(dim=(0, 1, 3)).float(),
    ]).double()  # [4, T_l]; fp64 from here, so sums over layers and positions stay exact counts
    out = torch.zeros((4, n_positions), dtype=torch.float64, device=x.device)
    t = min(rows.shape[1], n_positions)
    if t:
        out[:, n_positions - t :] = rows[:, rows.shape[1] - t :]
    return out


def _summary(s: Sequence[float]) -> TensorDistance:
    """maxabs, rel_l2 = ||a-b|| / ||a||, n_diff from the reduced [max, sum sq diff, sum sq a, count]."""
    maxabs, sq, ref, n = s
    rel = 0.0 if sq == 0 else math.sqrt(sq / ref) if ref > 0 else math.inf
    return {"maxabs": _finite(maxabs), "rel_l2": _finite(rel), "n_diff": int(n)}


def cache_difference(a: Any, b: Any, prompt_len: int, n_positions: int) -> CacheDistance | None:
    """How far cache `b` is from cache `a` (the reference), per layer and per position band, K and V apart.

    Both caches cover absolute positions 0..n_positions-1 (P[0:T-1] for a boundary state: n_positions = T-1).

    Returns {"layers": [{"layer", "k": {maxabs, rel_l2, n_diff}, "v": {...}}], "bands": [{"band", "start",
    "end", "k": {...}, "v": {...}}]}, bands over all layers, positions absolute. None when the caches do not hold
    the same shapes (a retokenized prefix of another length), where an element-wise difference means nothing.
    """
    import torch

    la = [(layer.keys, layer.values) for layer in a.layers]
    lb = [(layer.keys, layer.values) for layer in b.layers]
    if len(la) != len(lb) or not la:
        return None
    shapes = [(x.shape, x.dtype) for pair in la for x in pair]
    if shapes != [(y.shape, y.dtype) for pair in lb for y in pair]:
        return None
    with torch.inference_mode():
        per = torch.stack([torch.stack([_per_position(x, y.to(x.device), n_positions)
                                        for x, y in zip(pa, pb, strict=True)])
                           for pa, pb in zip(la, lb, strict=True)])  # [L, 2 (K, V), 4, n_positions]
        bands = position_bands(prompt_len, n_positions)
        rows = [_reduce(per)]  # [L, 2, 4]
        # Per band, over every layer: [L, 2, 4, w] -> [2, 4, L * w] -> [2, 4].
        rows += [_reduce(per[..., lo:hi].permute(1, 2, 0, 3).reshape(2, 4, -1))[None] for _, lo, hi in bands]
        both = torch.cat(rows).tolist()  # the one transfer to the host: [L + n_bands, 2, 4]
        layers, banded = both[: len(la)], both[len(la) :]
    return {
        "layers": [{"layer": i, "k": _summary(row[0]), "v": _summary(row[1])} for i, row in enumerate(layers)],
        "bands": [{"band": name, "start": lo, "end": hi, "k": _summary(row[0]), "v": _summary(row[1])}
                  for (name, lo, hi), row in zip(bands, banded, strict=True)],
    }


def _reduce(per: torch.Tensor) -> torch.Tensor:
    """[..., 4, N] -> [..., 4]: the max of the maxima, the sums of the rest."""
    import torch

    return torch.stack([per[..., 0, :].amax(dim=-1), *(per[..., i, :].sum(dim=-1) for i in (1, 2, 3))], dim=-1)
