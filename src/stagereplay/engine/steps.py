"""What a continuation keeps of its steps' logits: a few numbers per step, and the full logits of a few steps.

Memory scales with the caches, never with steps x vocabulary: at V = 152k a suffix of 4,096 steps would hold
1.2 GB of bf16 logits per arm. So each step is reduced on its device as it is made, into preallocated buffers
(no allocation of ours per step, no host sync: the sampler's pick is the loop's one sync):

- the top-k token ids and fp32 logits (k = 5), `values` / `ids` [S, k]; the margin (top-1 minus top-2 fp32
  logit, LayerCast's quantity) is `values[:, 0] - values[:, 1]`, the same fp32 numbers a top-2 of the stacked
  [S, V] logits gives;
- the log-sum-exp of each step's fp32 logits, `lse` [S], so that the top-k logprobs (`values - lse`) compare
  with a serving engine's, which reports logprobs;
- the full logits [V] (the forward's own tensor, no copy) of step 0, which every pair compares, and of the first
  step where the pick leaves each `watch`ed suffix (an earlier arm's): that is the pair's first divergent step.

The other arm of a divergent pair has already finished when the divergence is seen, so its logits at that step
are recomputed by `replay_logits`: the boundary state's cache (cloned), the pending token and the recorded
suffix fed back one forward each (teacher forcing, so greedy and sampled suffixes alike), the very calls the
loop made, so the logits are the loop's bit for bit; the replay checks its top-k against the one recorded at
that step and refuses a mismatch. That costs d + 1 forwards for a pair diverging at step d, and only for
divergent pairs; the alternatives cost memory (keeping [S, V] per arm) or a bound on d (a look-back window).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    import torch

TOP_K = 5
"""Tokens recorded per step (and per arm at the first divergent step)."""


def widened(logits: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    """`logits.float()` without a new tensor per step: fp32 logits as they are, others copied into `buffer` ([V] fp32,
    made here when None). The copy widens exactly as `.float()` does (every bf16 or fp16 value is an fp32 value),
    so the numbers are generate()'s."""
    import torch

    if logits.dtype == torch.float32:
        return logits
    if buffer is None or buffer.shape != logits.shape or buffer.device != logits.device:
        buffer = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    return buffer.copy_(logits)


class StepRecord:
    """Per-step top-k ids and fp32 logits of one continuation, and the full logits of the steps a number needs."""

    def __init__(self, capacity: int, watch: Sequence[Sequence[int]] = (), stepper: Any = None,
                 keep_full: bool = True) -> None:
        self.capacity = capacity
        self.keep_full = keep_full  # False: the reductions only (stage 1's steps, whose logits no number reads)
        self.n = 0  # steps recorded
        self._values: torch.Tensor | None = None  # [capacity, k] fp32, made on the first step (V known then)
        self._ids: torch.Tensor | None = None  # [capacity, k] int64
        self._lse: torch.Tensor | None = None  # [capacity] fp32 log-sum-exp: a logprob is logit - lse
        self._wide: torch.Tensor | None = None  # [V] fp32, the step's logits widened, rewritten every step
        self.full: dict[int, torch.Tensor] = {}  # step -> that step's logits [V], as the forward made them
        self._watch = [tuple(w) for w in watch]
        self.stepper = stepper  # what made the steps: `replay_logits` recomputes a step with it

    @classmethod
    def reduced(cls, steps: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> StepRecord:
        """A record of steps already reduced elsewhere (transformers' generate(): `engine.generated`), each
        (top-k fp32 logits [k], their ids [k], log-sum-exp []): no full logits, and no stepper to replay a step
        with (its forwards were generate()'s)."""
        import torch

        record = cls(len(steps), keep_full=False)
        record.n = len(steps)
        if steps:
            record._values = torch.stack([v for v, _, _ in steps])
            record._ids = torch.stack([i for _, i, _ in steps])
            record._lse = torch.stack([lse for _, _, lse in steps])
        return record

    def add(self, logits: torch.Tensor, token: int) -> None:
        """Reduce one step's logits [V] (on their device) after `token` was picked from them: into the rows made on
        the first step, through one reused fp32 buffer, so a step allocates nothing and reads nothing back."""
        import torch

        i = self.n
        with torch.inference_mode():
            if self._values is None:
                k = min(TOP_K, logits.shape[-1])
                self._values = torch.empty((self.capacity, k), dtype=torch.float32, device=logits.device)
                self._ids = torch.empty((self.capacity, k), dtype=torch.long, device=logits.device)
                self._lse = torch.empty((self.capacity,), dtype=torch.float32, device=logits.device)
            assert self._ids is not None and self._lse is not None
            wide = widened(logits, self._wide)  # what `logits.float()` holds, in the buffer
            if wide is not logits:
                self._wide = wide
            torch.topk(wide, self._values.shape[1], out=(self._values[i], self._ids[i]))
            torch.logsumexp(wide, dim=-1, out=self._lse[i])
        if i == 0 and self.keep_full:
            self.full[0] = logits
        still = []
        for w in self._watch:  # the pick (already on the host) against each watched suffix
            if i < len(w) and w[i] != token:
                self.full[i] = logits
            elif i + 1 < len(w):
                still.append(w)
        self._watch = still
        self.n += 1

    @property
    def values(self) -> torch.Tensor:
        """[S, k] fp32 top-k logits per step, descending."""
        assert self._values is not None
        return self._values[: self.n]

    @property
    def ids(self) -> torch.Tensor:
        """[S, k] int64 token ids of `values` (among equal logits in no specified order)."""
        assert self._ids is not None
        return self._ids[: self.n]

    @property
    def lse(self) -> torch.Tensor:
        """[S] fp32 log-sum-exp of each step's logits."""
        assert self._lse is not None
        return self._lse[: self.n]

    def top_logprobs(self, k: int = TOP_K) -> list[list[list[float]]]:
        """Per step, the top-k (id, logprob) best first, equal logprobs by lowest id (as greedy picks them)."""
        if self.n == 0:
            return []
        values, ids = (self.values - self.lse[:, None]).tolist(), self.ids.tolist()
        return [[[int(t), float(v)] for t, v in sorted(zip(i, x, strict=True), key=lambda p: (-p[1], p[0]))[:k]]
                for i, x in zip(ids, values, strict=True)]

    def margins(self) -> list[float]:
        """Top-1 minus top-2 fp32 logit per step (one host transfer); empty for a vocabulary of one."""
        if self.n == 0 or self.values.shape[1] < 2:
            return []
        return [float(x) for x in (self.values[:, 0] - self.values[:, 1]).tolist()]

    def kept_bytes(self) -> int:
        """Bytes of full logits held (distinct tensors)."""
        return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in self.full.values()}.values())


def replay_logits(record: StepRecord, cache: Any, prefix: Sequence[int], suffix: Sequence[int], step: int
                  ) -> torch.Tensor:
    """The logits [V] of `step` of the continuation that made `record` from the boundary state (`cache` over
    prefix[0:T-1], not touched: a clone is grown), its suffix fed back token by token; kept in `record.full`.

    Raises if the replayed step's top-k differs from the recorded one: the steps are not reproducible here.
    """
    import torch

    from stagereplay.engine.cache import clone_cache

    if step in record.full:
        return record.full[step]
    if cache is None or record.stepper is None or not 0 <= step < record.n:
        raise StageReplayError(f"the logits of step {step} were not kept and cannot be recomputed",
                               "keep the boundary cache of an arm whose divergent step is not watched")
    work = clone_cache(cache)
    past = len(prefix) - 1
    logits = record.stepper.forward([prefix[-1]], work, past)
    for j in range(step):  # the loop fed suffix[j] after step j's pick
        logits = record.stepper.forward([suffix[j]], work, past + 1 + j)
    del work
    with torch.inference_mode():
        again = torch.topk(logits.float(), record.values.shape[1])
        same = torch.equal(again.values, record.values[step])
    if not same:
        raise StageReplayError(f"replaying the suffix to step {step} did not reproduce its logits",
                               "run with deterministic settings (fixed threads, deterministic algorithms)")
    record.full[step] = logits
    return logits
