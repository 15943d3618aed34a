"""The public face of the engine: a loaded model that runs live, builds boundary states and continues them.

    lm = load("path/to/model", precision="bf16")
    state = lm.live(item, Marker("</think>"))      # generate; snapshot the cache when the marker is emitted
    fresh = lm.construct(state, "oneshot")           # same token IDs, one fresh prefill
    a, b = lm.continue_from(state), lm.continue_from(fresh)

A boundary state is the cache over P[0:T-1] plus the pending token P[T-1]; continuing feeds P[T-1] as a
decode step, so the cache is the whole state and swapping it is a clean causal test.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

from stagereplay.engine.boundary import BoundaryMatch, BoundaryRule
from stagereplay.engine.cache import cache_fingerprint, clone_cache, new_cache
from stagereplay.engine.constructions import Construction, parse_construction
from stagereplay.engine.decode import (
    DecodeConfig,
    Sampler,
    Stepper,
    captures_steps,
    decode,
    derive_seed,
    eos_ids,
    graphs_steps,
)
from stagereplay.engine.generated import Generated, GeneratedLive
from stagereplay.engine.limits import model_context, stage1_budget, static_cache_len
from stagereplay.engine.model import (
    DeterminismSettings,
    ModelConfig,
    generation_config,
    load_config_and_tokenizer,
    load_model_and_tokenizer,
    resolve_attn_impl,
    set_determinism,
)
from stagereplay.engine.proof import BatchCheck, BatchProof, Proof, ProofOutcome
from stagereplay.engine.proof_stores import IN_PROCESS, ProofStore
from stagereplay.engine.prover import Prover
from stagereplay.engine.steps import StepRecord
from stagereplay.errors import StageReplayError
from stagereplay.tasks.base import Item

log = logging.getLogger(__name__)

def ids_fingerprint(ids: Sequence[int]) -> str:
    """sha256 of token IDs as little-endian int64."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()


@dataclass(frozen=True)
class Continuation:
    """The suffix a continuation emitted (EOS included when it stopped on EOS)."""

    suffix: tuple[int, ...]
    stop: str  # "eos" | "length"
    record: StepRecord | None = field(default=None, repr=False, compare=False)
    """Per-step top-k and margins, and the full logits of the steps diagnostics need (engine.steps); None
    where the caller reports nothing per step."""

    @property
    def fingerprint(self) -> str:
        return ids_fingerprint(self.suffix)


@dataclass(frozen=True)
class BoundaryState:
    """Cache over prefix[0:T-1] (not to be mutated: continue from a clone) and the pending token prefix[T-1]."""

    prefix: tuple[int, ...]
    prompt_len: int
    construction: str
    cache: Any = field(repr=False)
    seed: int = 0  # the continuation's sampling seed, shared by every construction of one item
    live_suffix: Continuation | None = None  # for `live`: what the uninterrupted original loop went on to emit
    roundtrip: bool | None = None  # for `retokenized`: did decode -> encode return the same IDs?
    match: BoundaryMatch | None = None  # for `live`: how the boundary rule matched, when there is more to say
    cache_len: int | None = None
    """With a static cache: the positions L it is allocated for (`LM.cache_len`), which every construction of
    this item shares, since a static forward attends over all L rows. None for a dynamic cache."""
    generated: GeneratedLive | None = None
    """For live built by transformers' generate() (`engine.generated`): the option, and the tokens each of its steps
    added (more than one where speculation was accepted)."""
    stage1_steps: StepRecord | None = field(default=None, repr=False, compare=False)
    """For `live`: stage 1's steps reduced as they were made (top-k and log-sum-exp per step), the steps that chose
    each stage-1 token: what another run's divergence in stage 1 is read against (`stage1_top`)."""

    def stage1_top(self, k: int = 2) -> list[list[tuple[int, float | None]]] | None:
        """Per stage-1 step, the top-k (token id, logprob), best first (None: not recorded)."""
        if self.stage1_steps is None:
            return None
        return [[(int(t), float(v)) for t, v in step] for step in self.stage1_steps.top_logprobs(k)]

    @property
    def stage1(self) -> tuple[int, ...]:
        return self.prefix[self.prompt_len :]

    def fingerprint(self) -> str:
        return cache_fingerprint(self.cache)


class NoBoundary(Exception):
    """The output ended (EOS or the stage-1 budget) without reaching the boundary: an outcome, not an error."""

    def __init__(self, generated: Sequence[int]) -> None:
        super().__init__(f"no boundary in {len(generated)} generated tokens")
        self.generated = tuple(generated)


class Determinism(TypedDict, total=False):
    """What every record's environment says of a model's numbers (`LM.determinism`): the settings it was loaded
    with (engine.model.set_determinism; none for a model made without them), the rows of a batched step (only when
    above 1), and the proofs' outcomes once they exist (engine.prover)."""

    threads: int
    deterministic_algorithms: bool
    cublas_workspace_config: str | None
    allow_tf32: bool
    batch: int
    fast_steps: ProofOutcome
    batch_check: BatchCheck


class LM:
    """A model, its tokenizer and the settings that fix its numbers."""

    def __init__(self, model: Any, tokenizer: Any, config: ModelConfig, settings: DeterminismSettings | None = None,
                 model_config: Any = None, generation_config: Any = None, proofs: ProofStore | None = None):
        """`model` None (with its `model_config` and `generation_config`): the tokenizer, EOS ids and context of
        the model and none of its weights (`ModelConfig.weights` False), all a run reads from our engine when a
        serving engine takes every step; any step asked of it fails on the missing model. `settings`: what
        engine.model.set_determinism set. `proofs`: where its fast step's proofs are kept (engine.proof_stores;
        None: this process's memory only)."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.settings = settings  # as loaded, never changed: `determinism` adds what happened since
        self.stepper = Stepper(model, config.device, capture=captures_steps(config.precision, config.cache),
                               graphs=graphs_steps(config.precision, config.cache, config.device))
        if model is not None:
            model_config, generation_config = model.config, getattr(model, "generation_config", None)
        self.eos = eos_ids(generation_config, tokenizer)
        self.n_layers = int(model_config.get_text_config().num_hidden_layers)
        self.context = model_context(model_config)
        self.prover = Prover(self.stepper, config, self.settings or {}, self.context,
                             IN_PROCESS if proofs is None else proofs)
        # Asked before every fast step with the prompt of the sequence stepped, which each method below passes with
        # its steps: a proof that step needs first prefills it. Passed, not left on the LM by the last call, so no
        # call's prompt leaks into another's proof (items step in threads under --batch).
        self.stepper.guard = self.prover.guard

    @property
    def determinism(self) -> Determinism:
        """What every record's environment says of this model's numbers, made afresh at each read: the settings it
        was loaded with, the rows of a batched step (a row's bits may depend on the row count), and the outcomes
        of the proofs made so far (engine.prover: `fast_steps`, `batch_check`)."""
        out: Determinism = {}
        if self.settings is not None:
            out.update(self.settings)
        if self.config.batch > 1:
            out["batch"] = self.config.batch
        out.update(self.prover.recorded())
        return out

    def prove(self, prompt: Sequence[int], reach: int, allocated: int | None = None) -> Proof | None:
        """Prove the fast step from `prompt` to `reach` now (engine.prover.Prover.prove)."""
        return self.prover.prove(prompt, reach, allocated)

    def prove_batch(self, prompts: Sequence[Sequence[int]]) -> BatchProof:
        """Check the batched step on these prompts before items share it (engine.prover.Prover.prove_batch)."""
        return self.prover.prove_batch(prompts)

    # -- caches -----------------------------------------------------------------------------------------

    def cache_len(self, prompt_len: int, decode_config: DecodeConfig | None = None) -> int | None:
        """The positions a static cache for an item of `prompt_len` prompt tokens holds (None when dynamic).

        generate(cache_implementation="static", max_new_tokens=N) allocates prompt + N - 1 positions (the last
        token emitted is never fed back). The live loop emits at most the stage-1 budget and then
        `max_new_tokens`, so its cache gets what generate() would allocate for that many: live equals
        generate(cache_implementation="static", max_new_tokens=budget + max_new_tokens) token for token and
        bit for bit (tests/test_static_cache.py). Every construction of the item is allocated the same L, so
        the arms of a comparison differ only in how their caches were filled.
        """
        if self.config.cache != "static":
            return None
        dc = decode_config or DecodeConfig()
        needed = static_cache_len(prompt_len, dc.max_stage1_tokens, dc.max_new_tokens, self.context)
        return max(needed, self.config.static_len or 0)  # `--static-len`: more positions, never fewer

    def new_cache(self, length: int | None) -> Any:
        """An empty cache of this LM's kind; a static one for `length` positions (a dynamic one ignores it)."""
        if self.config.cache == "static" and length is None:
            raise StageReplayError("a static cache needs its length", "build boundary states with LM.cache_len")
        return new_cache(self.model, self.config.cache, length)

    # -- live generation ------------------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, decode_config: DecodeConfig | None = None,
                 seed: int = 0) -> list[int]:
        """Plain decoding with the live loop (no boundary): the tokens generate() would give, greedy by default;
        with a sampling `decode_config`, those of generate(do_sample=True) after `torch.manual_seed(seed)`."""
        cache = self.new_cache(len(prompt_ids) + max_new_tokens - 1)  # generate()'s static max_cache_len
        logits = self.stepper.forward(prompt_ids, cache, 0)
        sampler = Sampler(decode_config or DecodeConfig(), seed, self.config.device)
        return decode(self.stepper, cache, logits, len(prompt_ids), sampler, max_new_tokens, self.eos,
                      prompt=prompt_ids)

    def live(
        self,
        item: Item | Sequence[int],
        boundary: BoundaryRule,
        decode_config: DecodeConfig | None = None,
        keep_going: bool = True,
        keep_steps: bool = True,
        watch: Sequence[Sequence[int]] = (),
    ) -> BoundaryState:
        """Generate until `boundary` says stage 1 ended; snapshot the cache at that moment.

        With `keep_going`, the original loop then goes on from its own (unsnapshotted) cache, and what it emits
        is kept as `live_suffix`: the retained live continuation (`keep_steps` and `watch` as in `continue_from`).
        Raises `NoBoundary` if stage 1 never ends.
        """
        dc = decode_config or DecodeConfig()
        prompt, item_id = self.check_prompt(item)
        ended = boundary.bind(self.tokenizer).watch()
        budget = dc.max_stage1_tokens or stage1_budget(self.context, len(prompt), dc.max_new_tokens)
        cache_len = self.cache_len(len(prompt), replace(dc, max_stage1_tokens=budget))
        cache = self.new_cache(cache_len)
        logits = self.stepper.forward(prompt, cache, 0)
        past = len(prompt)
        pick = Sampler(dc, derive_seed(dc.seed, item_id, "stage1"), self.config.device)
        steps = StepRecord(budget, keep_full=False)  # reduced on the device as they are made: no sync of ours
        generated: list[int] = []
        while True:
            token = pick(logits)
            steps.add(logits, token)
            generated.append(token)
            if ended.step(token):
                break
            if token in self.eos or len(generated) >= budget:
                raise NoBoundary(generated)
            logits = self.stepper.forward([token], cache, past, prompt=prompt)
            past += 1
        # `cache` now covers prompt + generated[:-1]; generated[-1] is the pending token P[T-1].
        state = BoundaryState(
            prefix=(*prompt, *generated), prompt_len=len(prompt), construction="live",
            cache=clone_cache(cache), seed=derive_seed(dc.seed, item_id, "suffix"), match=ended.detail(),
            cache_len=cache_len, stage1_steps=steps,
        )
        if not keep_going:
            return state
        return replace(state, live_suffix=self._continue(cache, state, dc, None, keep_steps, watch))

    def live_generated(self, item: Item | Sequence[int], boundary: BoundaryRule, decode_config: DecodeConfig,
                       via: Generated) -> BoundaryState:
        """`live` as transformers' generate() builds it with `via` (speculation, a quantized cache): the tokens, the
        boundary state (its cache cropped to P[0:T-1]; None for a quantized cache, which holds no plain K/V) and
        the uninterrupted suffix, with per-step reductions for the margins. Raises `NoBoundary` as `live` does."""
        from stagereplay.engine.generated import generate_live

        dc = decode_config
        if dc.sample:
            raise StageReplayError("live through generate() runs greedy", "drop --sample")
        prompt, item_id = self.check_prompt(item)
        budget = dc.max_stage1_tokens or stage1_budget(self.context, len(prompt), dc.max_new_tokens)
        built = generate_live(self, prompt, boundary, budget, dc.max_new_tokens, via)
        if built.end is None:
            raise NoBoundary(list(built.tokens[:budget]))
        end, n = built.end, len(prompt)
        suffix = built.tokens[end + 1 : end + 1 + dc.max_new_tokens]
        cache = None
        if not via.cache:  # plain K/V: what it held at the boundary, the positions before the pending token
            cache = clone_cache(built.cache)
            extra = cache.get_seq_length() - (n + end)  # positions past P[0:T-1]: the boundary token's and after
            if extra > 0:
                cache.crop(-extra)
        stop = "eos" if suffix and suffix[-1] in self.eos else "length"
        state = BoundaryState(
            prefix=(*prompt, *built.tokens[: end + 1]), prompt_len=n, construction="live", cache=cache,
            seed=derive_seed(dc.seed, item_id, "suffix"), match=built.match,
            generated={**via.as_dict(), "added": list(built.added)},
            stage1_steps=built.positions.record(n, end + 1))
        record = built.positions.record(n + end + 1, len(suffix))
        return replace(state, live_suffix=Continuation(tuple(suffix), stop, record))

    # -- constructions --------------------------------------------------------------------------------

    def construct(self, state: BoundaryState, construction: str | Construction) -> BoundaryState:
        """Build the boundary state for `state.prefix` afresh by `construction`, a name ("chunked:16") or its object
        (engine.constructions), with the same seed and prompt split."""
        made = parse_construction(construction) if isinstance(construction, str) else construction
        built = made.build(self, state)
        return BoundaryState(prefix=built.prefix, prompt_len=state.prompt_len, construction=made.name,
                             cache=built.cache, seed=state.seed, roundtrip=built.roundtrip, cache_len=built.cache_len)

    def prefill(self, body: Sequence[int], prompt_len: int, spans: Sequence[tuple[int, int]], length: int | None
                ) -> Any:
        """A new cache (a static one of `length` positions) with body[start:stop] fed at position `start`, one
        forward per span: what a construction builds with (engine.constructions.Builder)."""
        cache = self.new_cache(length)
        for start, stop in spans:
            self.stepper.forward(body[start:stop], cache, start, prompt=body[:prompt_len])
        return cache

    # -- continuation ---------------------------------------------------------------------------------

    def continue_from(self, state: BoundaryState, decode_config: DecodeConfig | None = None,
                      seed: int | None = None, keep_steps: bool = True, watch: Sequence[Sequence[int]] = ()
                      ) -> Continuation:
        """Feed the pending token on a clone of the state's cache and decode to EOS or the length limit.

        The state is never touched, so many continuations (K sampled draws) can start from one snapshot: each
        costs a cache copy and its decode steps, never a prefill. `seed` overrides the state's sampling seed.
        The continuation's `record` holds each step's top-k and margin, the full logits of step 0 and of the
        first step whose pick leaves each `watch`ed suffix (an earlier arm's: the pair's first divergent step);
        `keep_steps=False` keeps no record at all, where nothing per step is reported (engine.steps).
        """
        return self._continue(clone_cache(state.cache), state, decode_config or DecodeConfig(), seed, keep_steps,
                              watch)

    def _continue(self, cache: Any, state: BoundaryState, dc: DecodeConfig, seed: int | None = None,
                  keep_steps: bool = True, watch: Sequence[Sequence[int]] = ()) -> Continuation:
        past = len(state.prefix) - 1
        if state.cache_len is not None and past + dc.max_new_tokens > state.cache_len:
            raise StageReplayError(
                f"a static cache of {state.cache_len} positions cannot hold {past} + {dc.max_new_tokens} new tokens",
                "continue with the --max-new-tokens the boundary state was built for",
            )
        prompt = state.prefix[: state.prompt_len]
        logits = self.stepper.forward([state.prefix[-1]], cache, past, prompt=prompt)
        pick = Sampler(dc, state.seed if seed is None else seed, self.config.device)
        record = StepRecord(dc.max_new_tokens, watch, self.stepper) if keep_steps else None
        suffix = decode(self.stepper, cache, logits, past + 1, pick, dc.max_new_tokens, self.eos, record, prompt)
        return Continuation(tuple(suffix), "eos" if suffix[-1] in self.eos else "length", record)

    # -- helpers --------------------------------------------------------------------------------------

    def check_prompt(self, item: Item | Sequence[int]) -> tuple[tuple[int, ...], str]:
        return check_prompt(item, self.context)

    def text(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


def check_prompt(item: Item | Sequence[int], context: int) -> tuple[tuple[int, ...], str]:
    """The prompt's IDs and id; a one-line error if it is empty or does not fit the model's context."""
    if isinstance(item, Item):
        prompt, item_id = item.prompt_ids, item.id
    else:
        prompt = tuple(int(t) for t in item)
        item_id = ids_fingerprint(prompt)[:16]
    if not prompt:
        raise StageReplayError(f"item {item_id} has an empty prompt", "give every item a non-empty prompt")
    if len(prompt) >= context:
        raise StageReplayError(
            f"item {item_id}: prompt of {len(prompt)} tokens does not fit the model's context of {context}",
            "shorten the prompt or drop the item",
        )
    return tuple(prompt), item_id


def load(
    path: str,
    precision: str = "bf16",
    device: str = "cpu",
    threads: int = 1,
    attn_impl: str = "auto",
    cache: str = "dynamic",
    batch: int = 1,
    proofs: ProofStore | None = None,
) -> LM:
    """Load a local Hugging Face causal LM for replay (no network), with determinism settings applied.
    `attn_impl="auto"`: the attention transformers picks for the model (engine.model.resolve_attn_impl).
    `proofs`: where its fast step's proofs are kept (engine.proof_stores; None: this process's memory only)."""
    config = ModelConfig(path=str(path), precision=precision, device=device, threads=threads,
                         attn_impl=resolve_attn_impl(path, attn_impl), cache=cache, batch=batch)
    settings = set_determinism(config.threads, config.device)
    model, tokenizer = load_model_and_tokenizer(config)
    return LM(model, tokenizer, config, settings, proofs=proofs)


def load_without_weights(config: ModelConfig, proofs: ProofStore | None = None) -> LM:
    """`config`'s tokenizer, EOS ids and context, and none of its weights (`ModelConfig.weights` False)."""
    settings = set_determinism(config.threads, config.device)
    model_config, tokenizer = load_config_and_tokenizer(config.path)
    return LM(None, tokenizer, config, settings, model_config, generation_config(config.path, model_config), proofs)
