"""The decode loop: one forward per token on a K/V cache, greedy or seeded sampling, EOS and length stops.

This loop *is* live generation, so it must emit exactly what `model.generate(do_sample=False)` emits:
it passes the same inputs generate() passes (ids, their positions, the cache, logits for the last position
only; no attention mask, which generate() drops when it is all ones) and picks the argmax of the fp32-cast
logits, as generate() does.
"""

from __future__ import annotations

import hashlib
import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stagereplay.engine.cache import allocated
from stagereplay.engine.steps import widened
from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    import torch

    from stagereplay.engine.steps import StepRecord


@dataclass(frozen=True)
class DecodeConfig:
    """How continuations are decoded."""

    max_new_tokens: int = field(default=128, metadata={"help": "suffix length limit after the boundary"})
    max_stage1_tokens: int | None = field(default=None, metadata={
        "help": "tokens allowed to reach the boundary (none: 8192 or what the context leaves, engine.limits)"})
    sample: bool = field(default=False, metadata={"help": "seeded sampling instead of greedy"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    top_k: int = field(default=0, metadata={"help": "sample from the top k tokens only (0 = all)"})
    seed: int = field(default=0, metadata={"help": "base seed; each item and stage derives its own"})
    top_p: float = field(default=1.0, metadata={"help": "sample from the smallest set with this mass (1 = all)"})

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or (self.max_stage1_tokens is not None and self.max_stage1_tokens < 1):
            raise StageReplayError("token limits must be at least 1", "pass positive --max-new-tokens")
        if self.sample and not 0 < self.temperature < float("inf"):  # also refuses nan
            raise StageReplayError(
                "--temperature must be positive when sampling", "pass e.g. --temperature 1.0"
            )
        if self.top_k < 0:
            raise StageReplayError(f"--top-k must be 0 (off) or positive, got {self.top_k}", "pass e.g. --top-k 50")
        if not 0 < self.top_p <= 1:
            raise StageReplayError(f"--top-p must lie in (0, 1], got {self.top_p}", "pass e.g. --top-p 0.95")


def derive_seed(base: int, *parts: str) -> int:
    """A seed for one item and stage, independent of run order: sha256(base, parts) truncated to 63 bits."""
    digest = hashlib.sha256("\x1f".join([str(base), *parts]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Sampler:
    """Greedy argmax, or sampling from a `torch.Generator` seeded once per continuation.

    Sampling applies what generate(do_sample=True) applies, in its order and with its arithmetic: fp32
    logits, then temperature (when not 1), top-k (when not 0), top-p (when below 1), softmax, and one
    `torch.multinomial` draw on a (1, V) row. A generator seeded with s draws what the global generator
    draws after `torch.manual_seed(s)`, so one continuation equals generate()'s under that seed
    (tests/test_resample.py checks it token for token).
    """

    def __init__(self, config: DecodeConfig, seed: int, device: str) -> None:
        self.config = config
        self.generator = None
        if config.sample:
            import torch

            self.generator = torch.Generator(device=device).manual_seed(seed)
        self._scores: torch.Tensor | None = None  # [V] fp32, the step's logits widened, rewritten every step
        self._picked: torch.Tensor | None = None  # [] int64, the greedy pick, rewritten every step

    def __call__(self, logits: torch.Tensor) -> int:
        return int(self.pick(logits))  # the step's one host read

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The pick as a one-element tensor on the logits' device (a graphed step takes it from there).

        A greedy pick allocates nothing: the fp32 scores and the pick go into two buffers made on the first step
        and rewritten by each later one, so a pick is good until the next `pick` (the loop reads it, or a graphed
        step copies it on the device, before that)."""
        import torch

        scores = widened(logits, self._scores)  # [V]; generate() also casts to fp32 before choosing
        if scores is not logits:
            self._scores = scores
        if self.generator is not None:
            return torch.multinomial(torch.softmax(self.warp(scores[None]), dim=-1), 1, generator=self.generator)
        if self._picked is None:
            self._picked = torch.empty((), dtype=torch.long, device=logits.device)
        return torch.argmax(scores, out=self._picked)

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """generate()'s sampling warpers on (1, V) fp32 scores: temperature, top-k, top-p."""
        import torch

        c = self.config
        if c.temperature != 1.0:
            scores = scores / c.temperature
        if c.top_k:
            kth = torch.topk(scores, min(c.top_k, scores.size(-1)))[0][..., -1, None]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if c.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=False)
            remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - c.top_p)
            remove[..., -1:] = 0  # keep at least the most likely token
            scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
        return scores


class Stepper:
    """Forward passes on a cache, with the inputs generate() gives at batch 1: ids, positions, cache, last logits.

    generate() computes `position_ids` from the mask and, in recent transformers (5.24 here; earlier 5.x
    releases passed it on), drops an all-ones mask before its first forward, since an unpadded batch needs
    none. So each of its forwards gets input_ids, position_ids, the cache, use_cache and logits_to_keep=1:
    this passes the same, value for value (tests/test_decode_speed_invariance.py compares the two step by
    step, and logits and caches bit for bit). `past` must be the number of positions the cache holds.

    Per step it allocates nothing but what the model makes: positions are a view of one arange buffer, and a
    single token goes in through one reused (1, 1) tensor. The cache keeps the K/V computed from them, never
    the tensors themselves, so reusing them cannot change a snapshot.

    With `capture`, single-token steps (all of decoding, and the incremental construction) run through
    `torch.compile(backend="eager")`: dynamo records the forward's tensor operations once and replays them
    without the Python of the module stack, which at batch 1 costs more than the arithmetic on small models.
    Multi-token prefills stay eager. A frame dynamo cannot compile runs eagerly; `TORCHDYNAMO_DISABLE=1`
    turns capture off. After a step that compiled, the cycle collector runs once (`release_capture_garbage`):
    tracing leaves the step's cache in reference cycles, which would otherwise keep it alive after its owner
    dropped it.

    The rule a captured step lives by: it may remove Python, never change an operation. It must call the
    operations the eager step calls, in its order, on tensors of the same shapes, strides and dtypes, with the
    same scalar arguments; the eager backend then runs the same kernels on the same inputs and every bit is the
    eager forward's. Tracing alone does not guarantee it: a library may branch on "am I being compiled", and
    then the traced step is another computation. transformers' SDPA attention does, for a single query token
    with a mask and grouped K/V heads (a sliding-window layer once its window is full, every static-cache
    step): eagerly it packs the query's heads into the query axis, (B, H, 1, D) -> (B, H_kv, H/H_kv, D); traced,
    it repeats the K/V heads instead. The two calls reach different SDPA kernels, whose bits differ (always in
    fp32, at near-ties in bf16 on an AVX-512 CPU), so a captured Gemma 3 or Mistral with a window shorter than
    the sequence left generate()'s trajectory. `EAGER_BRANCHES` lists such switches, and a captured step runs
    with each held at its eager value (`_eager_branches`). Since any new switch breaks the rule the same way,
    a run proves its captured step equal to the eager step on its own model before it uses it
    (engine.proof), and runs eagerly where they differ.

    A static cache's steps are never given to dynamo: transformers builds their attention differently while
    dynamo traces (it repeats K/V heads where the eager step packs the query's), which moves fp32 bits. They run
    eagerly on the CPU, and with `graphs` (CUDA) through one CUDA graph per cache (engine.graphs), which
    replays the eager step's kernels, the token written into the graph by the device (`device_token`).

    `guard(position, allocated, prompt)`, where set (an LM sets its prover's: engine.prover.Prover.guard), is asked
    before every fast single-token step and answers whether that position is proven (engine.proof) on a cache of
    that allocation (a graphed step's static length L, which its shapes follow; None for a captured step, whose
    cache is dynamic), proving it first where it can, from `prompt` (the prompt of the sequence the step is in,
    which its caller passes) where no proof has a prompt yet; a step it refuses runs eagerly. Within `proving()` (a
    proof running this very stepper beside its anchor) it is not asked.
    """

    MIN_POSITIONS = 1024  # initial length of the positions buffer; it doubles when a sequence outgrows it

    def __init__(self, model: Any, device: str, capture: bool = False, graphs: bool = False) -> None:
        self.model = model
        self.device = device
        self.capture = capture and capture_available()
        self.eager_branches = True  # hold library switches at their eager values while tracing (EAGER_BRANCHES)
        self._captured: Any = None  # the compiled single-token step, made on first use
        self.guard: Callable[[int, int | None, Sequence[int]], bool] | None = None  # may a fast step run here?
        self._proving = False
        self.graphs: Any = None  # engine.graphs.CudaGraphs: static-cache steps replayed as CUDA graphs
        if graphs and device.startswith("cuda"):
            from stagereplay.engine.graphs import CudaGraphs

            self.graphs = CudaGraphs(self._step)
        # generate() passes position_ids only to a forward that takes them; so does this.
        forward = getattr(model, "forward", None)
        params = inspect.signature(forward).parameters if forward is not None else {}
        self.takes_positions = "position_ids" in params
        # transformers 5.x renamed the forward's `past_key_values` to `cache`; a model taking **kwargs would
        # silently swallow the wrong name and run without a cache, so ask the signature which one it is.
        self.cache_kw = "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"
        self._positions: torch.Tensor | None = None  # (1, L) int64 0..L-1
        self._token: torch.Tensor | None = None  # (1, 1) int64, rewritten for each single-token step

    def positions(self, past: int, n: int) -> torch.Tensor:
        """(1, n) int64 positions past..past+n-1, as generate() derives them: a view of a shared buffer."""
        buf = self._positions
        if buf is None or buf.shape[1] < past + n:
            import torch

            size = max(past + n, self.MIN_POSITIONS, 2 * buf.shape[1] if buf is not None else 0)
            buf = self._positions = torch.arange(size, dtype=torch.long, device=self.device).unsqueeze(0)
        return buf[:, past : past + n]

    @contextmanager
    def proving(self) -> Iterator[None]:
        """Within: fast steps run unasked, as a proof of them must (engine.proof.prove_steps)."""
        saved, self._proving = self._proving, True
        try:
            yield
        finally:
            self._proving = saved

    def fast_at(self, past: int, cache: Any = None, prompt: Sequence[int] = ()) -> bool:
        """Whether the single-token step at `past` on `cache`, in a sequence that began with `prompt`, may take the
        fast path (captured or graphed)."""
        if not self.capture and self.graphs is None:
            return False
        if self._proving or self.guard is None:
            return True
        return self.guard(past, allocated(cache) if self.graphs is not None and cache is not None else None, prompt)

    def forward(self, ids: Sequence[int], cache: Any, past: int, device_token: torch.Tensor | None = None,
                prompt: Sequence[int] = ()) -> torch.Tensor:
        """Feed `ids` at positions past..past+len(ids)-1; return the last position's logits [V].

        `device_token`: the single token of `ids` as a one-element tensor on the device (the sampler's pick), which
        a graphed step copies into its input on the device. `prompt`: the prompt of the sequence `ids` continue,
        for the guard (a proof this step needs first prefills it); the forward itself never reads it."""
        import torch

        n = len(ids)
        with torch.inference_mode():
            if n > 1:
                input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)  # (1, n)
                return self._step(input_ids, self.positions(past, n), cache)
            if self._token is None:
                self._token = torch.empty((1, 1), dtype=torch.long, device=self.device)
            fast = self.fast_at(past, cache, prompt)  # may prove further first, or turn the fast path off
            if self.graphs is not None and fast:
                token = self._token.fill_(ids[0]) if device_token is None else device_token.view(1, 1)
                logits = self.graphs.forward(cache, token, past)
                if logits is not None:
                    return logits
            # In place is safe: the previous step's forward has consumed it (in stream order on CUDA).
            input_ids = self._token.fill_(ids[0])  # (1, 1)
            if not self.capture or not fast:
                return self._step(input_ids, self.positions(past, 1), cache)
            if self._captured is None:
                self._captured = torch.compile(_own_code(self._step), backend="eager", dynamic=True)
            # A frame dynamo fails on runs eagerly rather than raising. Floats (the model's epsilons and
            # scalings, constants of its config) are traced as the constants they are, not as graph inputs that
            # each step would box into a tensor and read back: the ops get the same Python floats either way.
            # Set by hand, not with config.patch(), which costs 5% of a toy step.
            config = torch._dynamo.config
            saved = config.suppress_errors, config.specialize_float
            config.suppress_errors = config.specialize_float = True
            frames = _compiled_frames()
            try:
                with _eager_branches(self.eager_branches):
                    return self._captured(input_ids, self.positions(past, 1), cache)
            finally:
                config.suppress_errors, config.specialize_float = saved
                if _compiled_frames() != frames:
                    release_capture_garbage()

    def forward_rows(self, ids: Sequence[int], cache: Any, past: int, rows: int) -> torch.Tensor:
        """`forward` as `rows` identical requests in one batch, eagerly: row 0's last logits [V]. What a server
        decoding a request beside `rows - 1` others runs (`cache` holds `rows` rows); the kernels see a batch of
        `rows`, so the bits may differ from batch 1's."""
        import torch

        with torch.inference_mode():
            input_ids = torch.tensor([list(ids)] * rows, dtype=torch.long, device=self.device)  # (rows, n)
            return self._step(input_ids, self.positions(past, len(ids)).expand(rows, -1), cache)

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """One forward with generate()'s inputs; the last position's logits [V]."""
        extra = {"position_ids": positions} if self.takes_positions else {}
        extra[self.cache_kw] = cache
        out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **extra)
        return out.logits[0, -1]


EAGER_BRANCHES: tuple[tuple[str, str], ...] = (
    ("transformers.integrations.sdpa_attention", "is_torchdynamo_compiling"),
)
"""(module, function) pairs through which a library asks whether it is being compiled and computes otherwise
when it is: held at their eager answer (False) while a step is traced. Each must be a module global that the
library calls at trace time (so dynamo reads the held value and guards on it)."""


def _not_compiling() -> bool:
    return False


@contextmanager
def _eager_branches(on: bool = True) -> Iterator[None]:
    """Within: every `EAGER_BRANCHES` switch answers as in an eager step. Set around every call of the captured
    step, not only its first: dynamo guards on the functions it read, and a restored original would recompile."""
    import sys

    saved = []
    if on:
        for name, attr in EAGER_BRANCHES:
            module = sys.modules.get(name)
            if module is not None and hasattr(module, attr):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, _not_compiling)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def _compiled_frames() -> int:
    """How many frames dynamo has tried to compile in this process (a dict lookup: cheap enough per step)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def release_capture_garbage() -> None:
    """Free what a capture left in reference cycles, right after it, while the step's caller holds the cache.

    Tracing a step leaves dynamo's variable trackers in reference cycles that hold the step's inputs, the K/V
    cache among them; only the cycle collector frees them, and a process that allocates few Python objects
    may not run it for a long time: the first captured cache (a boundary state's size) would stay alive long
    after its owner dropped it. Collecting once after each compile (once per model, or per new shape) breaks the
    cycles; the cache then lives exactly as long as its owner holds it (tests/test_cache_count.py).
    """
    import gc

    gc.collect()


def captures_steps(precision: str, cache: str = "dynamic") -> bool:
    """Whether a model at `precision` gets captured steps: not fp32-compute, whose hooks recast weights, and not
    on a static cache (see Stepper)."""
    return precision != "fp32-compute" and cache == "dynamic" and capture_available()


def graphs_steps(precision: str, cache: str, device: str) -> bool:
    """Whether single-token steps are replayed as CUDA graphs: a static cache on CUDA, not fp32-compute."""
    return cache == "static" and device.startswith("cuda") and precision != "fp32-compute"


def capture_available() -> bool:
    """Whether torch.compile can capture steps here (dynamo supports this Python and is not disabled)."""
    import torch._dynamo

    return bool(torch._dynamo.is_dynamo_supported() and not torch._dynamo.config.disable)


def _own_code(method: Any) -> Any:
    """`method` on a private copy of its code object.

    Dynamo keeps its compiled variants per code object, at most 8 of them. A copy per Stepper keeps each
    model's variants (its shapes, its sliding windows) apart from other models' in a process that loads many,
    and lets them go with the Stepper.
    """
    fn = method.__func__
    code = fn.__code__.replace()  # an equal but distinct code object
    return types.MethodType(
        types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__), method.__self__
    )


def eos_ids(generation_config: Any, tokenizer: Any) -> frozenset[int]:
    """EOS from the generation config (an int or a list), else from the tokenizer."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def decode(
    stepper: Stepper,
    cache: Any,
    logits: torch.Tensor,
    past: int,
    sampler: Sampler,
    max_new_tokens: int,
    eos: frozenset[int],
    record: StepRecord | None = None,
    prompt: Sequence[int] = (),
) -> list[int]:
    """Pick from `logits`, feed the pick, repeat; stop after EOS or `max_new_tokens` picks. Grows `cache`, of the
    sequence that began with `prompt` (for the stepper's guard).

    With `record`, each step's logits [V] are reduced on their device after the pick (top-k into preallocated
    rows; the full tensor only for the steps the record keeps, engine.steps): no copy of ours and no host sync,
    so the loop's pace and its numbers do not change (tests/test_decode_speed_invariance.py).
    """
    out: list[int] = []
    while True:
        picked = sampler.pick(logits)  # on the device; a graphed step reads it from there
        token = int(picked)
        out.append(token)
        if record is not None:
            record.add(logits, token)
        if token in eos or len(out) >= max_new_tokens:
            return out
        if stepper.graphs is None:
            logits = stepper.forward([token], cache, past, prompt=prompt)
        else:  # a CUDA graph copies the pick into its input on the device
            logits = stepper.forward([token], cache, past, device_token=picked, prompt=prompt)
        past += 1
