"""Live built by transformers' own `generate()` with an option users turn on, instead of our loop: speculative
decoding (assisted generation) and a quantized K/V cache. What people run, not an imitation of it.

    speculate prompt-lookup:N   candidates from n-grams of the sequence itself (`prompt_lookup_num_tokens=N`)
    speculate draft:PATH        candidates from a draft model with the same tokenizer (`assistant_model`)
    speculate self              the model as its own draft: every candidate is accepted, and the cache is still
                                written in verification chunks of several tokens
    cache quanto:BITS | hqq:BITS | fp8    transformers' QuantizedCache (`cache_implementation="quantized"`): the
                                prefix quantized, the most recent tokens kept in full precision

One `generate()` call runs greedy from the prompt to stage 1 and the suffix, uninterrupted: a stopping criterion
watches the new tokens of each step for the boundary and stops `max_new_tokens` after it. A logits processor, which
assisted generation calls for every candidate position it verifies, reduces each position's fp32 logits to its
top-k and log-sum-exp (the last call for a position is the one its token came from), so margins are recorded as our
loop records them, and no [S, V] tensor exists. The lengths each verification step added are recorded: a run shows
that speculation happened, and how much.

The boundary state is the cache `generate()` ended with, cropped to the positions before the pending token (positions
written earlier are never rewritten: rejected candidates are cropped as they are found). A quantized cache holds no
plain K/V: its state has no cache to fingerprint, compare or continue from (`cache` None), which the arm records.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict

from stagereplay.engine.boundary import BoundaryMatch, BoundaryRule, stage1_end
from stagereplay.engine.steps import TOP_K, StepRecord
from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    import torch

BACKENDS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8), "fp8": ()}
"""transformers' quantized-cache backends and the bit widths each takes (fp8: per tensor, no width)."""
NEEDS = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}


class GeneratedOption(TypedDict):
    """The option as records keep it: each part only where it is set."""

    speculate: NotRequired[str]  # prompt-lookup:N | draft:PATH | self
    cache: NotRequired[str]  # quanto:BITS | hqq:BITS | fp8


class GeneratedLive(GeneratedOption):
    """How generate() built an item's live: the option, and the tokens each of its steps added (more than one where
    speculation was accepted)."""

    added: list[int]


class QuantizedCacheConfig(TypedDict):
    """transformers' `cache_config` for a QuantizedCache."""

    backend: str
    nbits: NotRequired[int]


class GenerationSettings(TypedDict, total=False):
    """The generation-config settings an option sets (transformers' GenerationConfig keywords)."""

    prompt_lookup_num_tokens: int
    cache_implementation: Literal["quantized"]
    cache_config: QuantizedCacheConfig


class DraftArgument(TypedDict, total=False):
    """generate()'s draft model argument: absent where the option has no draft."""

    assistant_model: Any  # a transformers model


@dataclass(frozen=True)
class Generated:
    """How transformers' generate() builds live: a speculation method and/or a quantized cache ('' for none)."""

    speculate: str = field(default="", metadata={"help": "prompt-lookup:N | draft:PATH | self"})
    cache: str = field(default="", metadata={"help": "quanto:BITS | hqq:BITS | fp8 (transformers' QuantizedCache)"})

    def __post_init__(self) -> None:
        kind, _, arg = self.speculate.partition(":")
        if self.speculate and not ((kind == "prompt-lookup" and arg.isdigit() and int(arg) > 0)
                                   or (kind == "draft" and arg) or self.speculate == "self"):
            raise StageReplayError(f"unknown --speculate {self.speculate!r}",
                                   "use prompt-lookup:N (N > 0), draft:PATH or self")
        backend, _, bits = self.cache.partition(":")
        if self.cache and (backend not in BACKENDS or (str(bits) != "" and not bits.isdigit())
                           or (BACKENDS[backend] and (not bits or int(bits) not in BACKENDS[backend]))
                           or (not BACKENDS[backend] and bits)):
            widths = "; ".join(f"{b}:{'|'.join(map(str, w))}" if w else b for b, w in BACKENDS.items())
            raise StageReplayError(f"unknown --quantized-cache {self.cache!r}", f"use {widths}")

    def __bool__(self) -> bool:
        return bool(self.speculate or self.cache)

    def as_dict(self) -> GeneratedOption:
        out: GeneratedOption = {}
        if self.speculate:
            out["speculate"] = self.speculate
        if self.cache:
            out["cache"] = self.cache
        return out

    def check(self, cache: str, batch: int) -> None:
        """Refuse in one line, before anything loads, what cannot run here: a backend's package missing, a draft
        model that is not there, a static cache (assisted generation crops the cache), items stepping together
        (generate() runs its own forwards, one item at a time)."""
        import importlib.util

        backend = self.cache.partition(":")[0]
        if backend in NEEDS and importlib.util.find_spec(NEEDS[backend][0]) is None:
            raise StageReplayError(f"transformers' quantized cache with the {backend} backend needs "
                                   f"{NEEDS[backend][1]}, not installed here",
                                   f"pip install {NEEDS[backend][1]} (or 'stagereplay[quantized]')")
        if cache != "dynamic":
            raise StageReplayError(f"live through generate() ({self.describe()}) runs on a dynamic cache",
                                   "drop --cache static")
        if batch > 1:
            raise StageReplayError(f"live through generate() ({self.describe()}) runs one item at a time",
                                   "pass --batch 1")
        if self.speculate.startswith("draft:"):
            draft = Path(self.speculate.partition(":")[2])
            if not (draft / "config.json").is_file():
                raise StageReplayError(f"no draft model at {draft}", "pass --speculate draft:PATH of a model folder")

    def describe(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.as_dict().items())

    def settings(self) -> GenerationSettings:
        """generate()'s generation-config settings for this option."""
        out: GenerationSettings = {}
        kind, _, arg = self.speculate.partition(":")
        if kind == "prompt-lookup":
            out["prompt_lookup_num_tokens"] = int(arg)
        if self.cache:
            backend, _, bits = self.cache.partition(":")
            out["cache_implementation"] = "quantized"
            config: QuantizedCacheConfig = {"backend": backend}
            if bits:
                config["nbits"] = int(bits)
            out["cache_config"] = config
        return out

    def assistant(self, lm: Any) -> DraftArgument:
        """generate()'s draft model argument for this option, if it has one."""
        kind, _, arg = self.speculate.partition(":")
        if kind == "draft":
            return {"assistant_model": _draft(arg, lm)}
        return {"assistant_model": lm.model} if kind == "self" else {}


_DRAFTS: dict[tuple[str, str, str], Any] = {}


def _draft(path: str, lm: Any) -> Any:
    """The draft model at `path`, at the run's precision and device, once per process; its tokenizer must be the
    model's (candidates are token IDs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = (str(Path(path).resolve()), lm.config.precision, lm.config.device)
    if key not in _DRAFTS:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.get_vocab() != lm.tokenizer.get_vocab():
            raise StageReplayError(f"the draft model at {path} has another tokenizer than the model's",
                                   "pass a draft model of the same family (the same vocabulary)")
        _DRAFTS.clear()
        _DRAFTS[key] = AutoModelForCausalLM.from_pretrained(path, dtype=lm.model.dtype).to(lm.config.device).eval()
    return _DRAFTS[key]


class _Positions:
    """A logits processor that keeps, per sequence position, the top-k ids, fp32 logits and log-sum-exp of the
    logits that chose the token at that position (the last call for it), and changes nothing."""

    def __init__(self) -> None:
        self.at: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        with torch.inference_mode():
            wide = scores[0].float()
            top = torch.topk(wide, min(TOP_K, wide.shape[-1]))
            self.at[int(input_ids.shape[1])] = (top.values, top.indices, torch.logsumexp(wide, dim=-1))
        return scores

    def record(self, start: int, n: int) -> StepRecord:
        """The steps that chose the tokens at positions start .. start + n - 1, as a record without full logits."""
        return StepRecord.reduced([self.at[p] for p in range(start, start + n)])


class _Until:
    """A stopping criterion over the new tokens of each generate() step: stops `after` tokens past the boundary, at
    an EOS, or at the stage-1 budget without a boundary; records the tokens each step added."""

    def __init__(self, rule: BoundaryRule, eos: Collection[int], budget: int, after: int, prompt_len: int) -> None:
        self.watch, self.eos, self.budget, self.after = rule.watch(), set(eos), budget, after
        self.seen, self.end = prompt_len, -1
        self.added: list[int] = []
        self.count = 0  # tokens generated so far

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        import torch

        new = input_ids[0, self.seen :].tolist()
        self.seen = int(input_ids.shape[1])
        self.added.append(len(new))
        stop = False
        for token in new:
            self.count += 1
            if self.end < 0:
                if self.watch.step(token):
                    self.end = self.count - 1
                elif token in self.eos or self.count >= self.budget:
                    stop = True
            elif self.count - 1 - self.end >= self.after or token in self.eos:
                stop = True
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


@dataclass(frozen=True)
class Built:
    """What generate() made of an item: the tokens, the boundary (None: never reached), the cache it ended with,
    the per-position reductions, and the tokens each step added."""

    tokens: tuple[int, ...]
    end: int | None
    match: BoundaryMatch | None
    cache: Any
    positions: _Positions
    added: tuple[int, ...]


def generate_live(lm: Any, prompt: Sequence[int], rule: BoundaryRule, budget: int, max_new: int,
                  via: Generated) -> Built:
    """One greedy generate() call from `prompt` (module docstring)."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    positions, until = _Positions(), _Until(rule.bind(lm.tokenizer), lm.eos, budget, max_new, len(prompt))
    config = GenerationConfig(do_sample=False, max_new_tokens=budget + max_new, eos_token_id=sorted(lm.eos),
                              pad_token_id=sorted(lm.eos)[0], return_dict_in_generate=True, **via.settings())
    ids = torch.tensor([list(prompt)], device=lm.config.device)
    try:
        with torch.inference_mode():
            out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                    logits_processor=LogitsProcessorList([positions]),
                                    stopping_criteria=StoppingCriteriaList([until]), **via.assistant(lm))
    except (ValueError, ImportError) as e:
        raise StageReplayError(f"transformers' generate() with {via.describe()} cannot run this model here "
                               f"({str(e).splitlines()[0][:160]})", "drop the option, or run another model") from e
    tokens = tuple(int(t) for t in out.sequences[0, len(prompt) :].tolist())
    watch = rule.bind(lm.tokenizer).watch()
    end = stage1_end(tokens, watch, lm.eos, budget)
    cache = getattr(out, "cache", None) or out.past_key_values
    return Built(tokens, end, watch.detail() if end is not None else None, cache, positions, tuple(until.added))
