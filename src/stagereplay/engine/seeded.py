"""vLLM's seeded samplers, replayed: the token one seeded request draws at each step, from the request's seed alone.

    SAMPLERS, DEFAULT                 name -> class: `vllm` (vLLM's native sampler, the one GPU servers run and
                                      Token-DiFR replays; the default) and `vllm-cpu` (vLLM's CPU build)
    seeded_sampler(name, seed, device)  one request's sampler, its generator seeded with the request's seed
    sampler.draw(warped, probs)       `Drawn` for rows of warped logits [C, V] (fp32 after temperature, top-k and
                                      top-p, -inf where removed; `probs` their softmax where the caller has it),
                                      one row per step: each row advances the request's generator as the server's
                                      step does

What each replays (vLLM 0.32):

- `vllm` (`TopKTopPSampler.forward_native`, `random_sample`): E ~ Exp(1) [V] per step, `q[i].exponential_(generator)`
  on the server's device; the pick is argmax(softmax(warped) / E). Its Gumbel noise is G = -log E.
- `vllm-cpu` (`TopKTopPSampler.forward_cpu`, the `fused_gumbel_argmax` kernel): per step one seed
  s = randint(0, 2**31) from the request's CPU generator; per token i, SplitMix64 bits
  b_i = splitmix64(splitmix64(s) + (i + 1) * 0x9E3779B97F4A7C15) >> 11, u_i = (b_i + 0.5) / 2**53 and
  G_i = -log(-log u_i), all in float64; the pick is argmax(warped + G). The kernel keeps a running best and skips
  tokens by two exact bounds; within a hair of the row's maximum (`TIE`) the pick is settled by that same rule in
  Python's libm, so a near tie goes the kernel's way, not only float64's (tests/test_vllm.py checks the picks
  against the kernel itself).

`Drawn.order` ranks the tokens as the sampler does (its argmax is the pick), for the served token's rank; `gumbel`
is G, for the margin in logit units (Token-DiFR's `_verify_vllm_gumbel_max`: logits + T * G).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    import torch

GAMMA = 0x9E3779B97F4A7C15
"""SplitMix64's increment: token i's stream position is (i + 1) * GAMMA past the step's key."""
MASK = (1 << 64) - 1
GUMBEL_MAX = 37.5
"""No 53-bit u gives a Gumbel draw above this: the kernel's bound for skipping a token."""
TIE = 1e-6
"""Tokens whose float64 score lies this close to the row's maximum are settled by the kernel's own comparisons: far
above the float64 error of a score (about 1e-14), far below any gap that sampling noise leaves between tokens."""


@dataclass(frozen=True)
class Drawn:
    """What a seeded sampler does with rows of warped logits [C, V]."""

    pick: torch.Tensor  # [C] int64: the token drawn at each step
    order: torch.Tensor  # [C, V]: each row ranks the tokens as the sampler does (argmax = pick)
    gumbel: torch.Tensor  # [C, V]: the Gumbel noise G added to the warped logits


class SeededSampler:
    """One seeded request's sampler: `draw` consumes one step of its generator per row."""

    name: ClassVar[str]
    label: ClassVar[str]

    def __init__(self, seed: int, device: str) -> None:
        self.seed = seed
        self.device = device

    def draw(self, warped: torch.Tensor, probs: torch.Tensor | None = None) -> Drawn:
        """`probs`: softmax(warped), where the caller has it already (made here where a sampler needs it)."""
        raise NotImplementedError


class VllmNative(SeededSampler):
    """vLLM's native sampler (module docstring): exponential noise from a generator on the server's device."""

    name = "vllm"
    label = "vLLM's sampler"

    def __init__(self, seed: int, device: str) -> None:
        import torch

        super().__init__(seed, device)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def draw(self, warped: torch.Tensor, probs: torch.Tensor | None = None) -> Drawn:
        import torch

        noise = gumbel_noise(warped.shape[0], warped.shape[1], self.generator)  # [C, V]
        probs = torch.softmax(warped, dim=-1) if probs is None else probs
        order = probs / noise  # vLLM's pick is this row's argmax
        return Drawn(order.argmax(dim=-1), order, -torch.log(noise))


class VllmCpu(SeededSampler):
    """vLLM's CPU build's sampler (module docstring): a step seed from a CPU generator, SplitMix64 noise per token."""

    name = "vllm-cpu"
    label = "vLLM's CPU sampler"

    def __init__(self, seed: int, device: str) -> None:
        import torch

        super().__init__(seed, device)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)  # vLLM's CPU build draws on the host

    def draw(self, warped: torch.Tensor, probs: torch.Tensor | None = None) -> Drawn:
        import torch

        steps = [int(torch.randint(0, 2**31, (1,), generator=self.generator, dtype=torch.long).item())
                 for _ in range(warped.shape[0])]
        gumbel = splitmix_gumbel(steps, warped.shape[1], warped.device)  # [C, V] float64
        order = warped.double() + gumbel  # [C, V]
        top = order.max(dim=-1, keepdim=True).values  # [C, 1]
        near = (order >= top - TIE).nonzero()  # [K, 2] (row, token), ascending: the tokens a near tie could pick
        values = warped[near[:, 0], near[:, 1]].float().tolist()  # only these logits go to the host
        candidates: list[list[tuple[int, float]]] = [[] for _ in steps]
        for (r, i), x in zip(near.tolist(), values, strict=True):
            candidates[r].append((i, x))
        pick = [_kernel_pick(c, step) for c, step in zip(candidates, steps, strict=True)]
        return Drawn(torch.tensor(pick, device=warped.device), order, gumbel)


SAMPLERS: dict[str, type[SeededSampler]] = {s.name: s for s in (VllmNative, VllmCpu)}
DEFAULT = VllmNative.name
"""A seeded claim's sampler unless one is named: vLLM's native one, what GPU servers run and Token-DiFR replays."""


def seeded_sampler(name: str, seed: int, device: str) -> SeededSampler:
    """The sampler `name` for one request seeded with `seed` (its logits on `device`)."""
    if name not in SAMPLERS:
        raise StageReplayError(f"unknown seeded sampler {name!r}", f"use one of {', '.join(SAMPLERS)}")
    return SAMPLERS[name](seed, device)


def gumbel_noise(rows: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """E ~ Exp(1), [rows, width] fp32 on the generator's device, one row of `width` drawn after another: what vLLM's
    native sampler draws for one seeded request over `rows` steps (`q[i].exponential_(generator=...)` per step)."""
    import torch

    return torch.stack([torch.empty(width, dtype=torch.float32, device=generator.device).exponential_(
        generator=generator) for _ in range(rows)])


def _i64(x: int) -> int:
    """A uint64 constant as the int64 bit pattern a tensor holds."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """A logical right shift of int64 tensors that hold uint64 bits."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors (multiplication wraps, as uint64's does)."""
    z = (z ^ _shr(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def splitmix_gumbel(steps: list[int], width: int, device: torch.device | str) -> torch.Tensor:
    """G [len(steps), width] float64: the CPU kernel's Gumbel draw for each token at each step seed."""
    import torch

    keys = _mix(torch.tensor(steps, dtype=torch.int64, device=device))[:, None]  # [C, 1]
    i = torch.arange(1, width + 1, dtype=torch.int64, device=device)[None]  # [1, V]
    bits = _shr(_mix(keys + i * _i64(GAMMA)), 11)  # [C, V], below 2**53
    u = (bits.double() + 0.5) * 2.0**-53
    return -torch.log(-torch.log(u))


def _mix_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _kernel_pick(near: list[tuple[int, float]], step: int) -> int:
    """The kernel's running best over the tokens `near` the maximum ((token, warped logit), ascending), with its
    bounds and arithmetic: every other token lies more than `TIE` below them and cannot win against any of them."""
    key = _mix_int(step)

    def bits(i: int) -> int:
        return _mix_int((key + (i + 1) * GAMMA) & MASK) >> 11

    def gumbel(b: int) -> float:
        return -math.log(-math.log((b + 0.5) * 2.0**-53))

    best, best_x = near[0]
    best_g = gumbel(bits(best))
    for i, x in near[1:]:
        dx = x - best_x
        if dx + GUMBEL_MAX <= best_g:
            continue
        b = bits(i)
        if ((2**53 - 1 - b) + 0.5) * 2.0**-53 >= math.exp(dx - best_g):  # -log u >= 1 - u: it cannot win
            continue
        g = gumbel(b)
        if dx + g > best_g:
            best, best_x, best_g = i, x, g
    return best
