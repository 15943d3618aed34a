"""The seam to a serving engine: what `matched --engine NAME` (and the 2x2, and mismatch) needs from an engine other
than ours.

Our engine (`engine.lm`) owns its K/V cache, so every experiment runs on it. A serving engine gives token IDs in and
out. What every engine does is `ServingEngine`:

    generate(ids, max_tokens, reuse=False)   greedy tokens after `ids`, with the prefix cache emptied first
    generate(ids, max_tokens, reuse=True)    the same request, reusing whatever the prefix cache holds
    Generation.top                           the top-k (token id, logprob) of every step, best first
    Generation.chosen                        the log-probability of the token each step emitted (None: not asked)
    Generation.cached                        the prompt positions taken from a cache (None: the engine does not say)
    Generation.draft                         tokens drafted and accepted where the engine speculated (None: it did not)
    version() / settings() / close()         what fixes its numbers, for the manifest and the environment

What only some engines do is a capability, a mixin its class declares, and each capability contributes its arms:

    SavesState        a sequence's K/V saved while decoding and restored into a cleared context: `state-restore`,
                      `oneshot-restore` (llama.cpp's state save/load)
    PrefillsInChunks  a prompt processed n tokens per batch: the 2x2's `chunked:<n>`
    RestoresSlot      a server slot saved and restored into another slot: `slot-restore`
    ServesUnderLoad   a request sent while other requests are in flight: `live@load`, `oneshot@load`
    ChecksFirst       checked against the run's tokenizer before any item (a server)
    Restarts          a process whose restart a resumed run can tell (a server)
    Samples           a response drawn as an RL rollout engine draws it (temperature, top-k, top-p, a seed), each
                      emitted token's log-probability said: `mismatch --engine NAME`'s rollout
    ScoresPrompt      a sequence's tokens scored teacher-forced in one request (one prefill, nothing cached): the
                      engine's own one-shot score of a rollout, mismatch's `prefill`

A log-probability comes from one of two distributions (`LOGPROBS_MODES`, as vLLM's `logprobs_mode` names them): raw,
log_softmax of the model's logits, or processed, after the sampler's temperature, top-k and top-p. An engine is asked
for the one a run names (`EngineConfig.logprobs_mode`), and says which it can give (`EngineKind.logprobs_modes`,
`EngineKind.prompt_scoring`).

An engine is a module with an `EngineKind` (its name, its options, how it loads, what it checks up front) and an
engine class; one line of `serving.engines.ENGINES` registers the kind. No code outside an engine's module names it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Protocol, TypedDict, TypeVar

from stagereplay.errors import StageReplayError

TOP_LOGPROBS = 5
"""Top-k logprobs recorded per step: enough for the margin (top-1 minus top-2) and a look at the near-ties."""
LOGPROBS_MODES = ("raw", "processed")
"""The distributions a log-probability may be taken from (module docstring; `engine.scoring.MODES` for ours)."""
SEED_SPAN = 0xFFFFFFFF
"""Seeds sent to an engine lie below this: llama.cpp's samplers take 32 bits and read 0xFFFFFFFF as "random"."""


@dataclass(frozen=True)
class Generation:
    """What one request returned."""

    tokens: tuple[int, ...]
    top: tuple[tuple[tuple[int, float], ...], ...] = field(repr=False)
    """Per generated token, the top-k (token id, logprob) of that step, best first: [S][k]."""
    cached: int | None
    """Prompt tokens whose K/V the engine took from its prefix cache instead of computing them (None: the engine
    does not say)."""
    finish: str  # the engine's own reason: "stop" (an EOS or stop token) | "length"
    draft: Draft | None = None
    """What speculative decoding did in this request, where the engine speculated and says so (None: it did not
    speculate, or does not say)."""
    chosen: tuple[float, ...] | None = field(default=None, repr=False)
    """Per generated token, the engine's own log-probability of the token it emitted, from the distribution its
    `logprobs_mode` names [S] (None: not asked, `Samples.sample` asks)."""


@dataclass(frozen=True)
class Sampling:
    """How a request draws its tokens: greedy (temperature 0: the argmax) or sampled as an RL rollout is, with
    temperature, top-k (0: all), top-p (1: all) and a seed. The same seed draws the same tokens again where the
    engine is deterministic, so a rollout's replica is exact there. Applied in the order generate() applies them
    (temperature, top-k, top-p), where the engine lets the order be chosen."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.seed < SEED_SPAN:
            raise StageReplayError(f"no engine samples with {self}", "pass --temperature >= 0, --top-k >= 0 and "
                                                                      "--top-p in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def of(cls, sample: bool, temperature: float, top_k: int, top_p: float, seed: int) -> Sampling:
        """A run's decoding as an engine takes it: greedy unless `sample`; `seed` (any size) folded below
        `SEED_SPAN`."""
        if not sample:
            return cls()
        return cls(temperature, top_k, top_p, seed % SEED_SPAN)

    def as_dict(self) -> dict[str, float | int | bool]:
        """What a record says of it: as our engine's rollouts say it (`sample`, temperature, top_k, top_p, seed)."""
        return {"sample": not self.greedy, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "seed": self.seed}


@dataclass(frozen=True)
class PromptScores:
    """A sequence's tokens scored teacher-forced (`ScoresPrompt.score`): per scored token, its log-probability [N]
    and the argmax of the logits that scored it [N] (None: the engine does not say)."""

    logprobs: tuple[float, ...]
    argmax: tuple[int, ...] | None


@dataclass(frozen=True)
class Draft:
    """A request's speculation, as the engine counts it over the whole request (all the tokens it generated, a
    live request's stage 1 included): tokens its drafter proposed and tokens of those the model accepted. Each
    verification forward writes the K/V of the proposed tokens and crops the rejected ones: another construction
    of the state than one token per step."""

    drafted: int
    accepted: int


@dataclass(frozen=True)
class EngineOptions:
    """An engine's own settings: each engine has its frozen subclass, each field with its `help`."""

    def check(self) -> None:
        """Refuse, in one line, a setting out of range."""


OptionsT = TypeVar("OptionsT", bound=EngineOptions)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides which numbers a serving engine produces (the model's path and precision are the
    run's `ModelConfig`): which engine, its seed, and its own options."""

    name: str = field(metadata={"help": "the engine (serving.engines.ENGINES)"})
    options: EngineOptions = field(default_factory=EngineOptions, metadata={"help": "the engine's own settings"})
    seed: int = field(default=0, metadata={"help": "engine seed (greedy decoding does not read it)"})
    logprobs_mode: str = field(default="raw", metadata={
        "help": "the distribution its log-probabilities are taken from: raw | processed (`LOGPROBS_MODES`); set by a "
                "run that reads them (mismatch's --logprobs-mode), recorded where it is not raw"})

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise StageReplayError(f"unknown logprobs mode {self.logprobs_mode!r}", f"use {' or '.join(LOGPROBS_MODES)}")

    def own(self, kind: type[OptionsT]) -> OptionsT:
        """The options, as the engine module that reads them types them."""
        if not isinstance(self.options, kind):
            raise TypeError(f"engine {self.name} holds {type(self.options).__name__}, not {kind.__name__}")
        return self.options

    def as_dict(self) -> dict[str, Any]:
        """What the manifest records: the name, the seed and each option, flat; the logprobs mode where it is not
        raw (so a run that reads no log-probabilities records what it always recorded)."""
        mode = {"logprobs_mode": self.logprobs_mode} if self.logprobs_mode != "raw" else {}
        return {"name": self.name, "seed": self.seed, **mode, **asdict(self.options)}


class ServingEngine(Protocol):
    """A loaded serving engine. Batch size 1, greedy: one request at a time, as our engine runs one item."""

    name: str

    def generate(self, ids: Sequence[int], max_tokens: int, reuse: bool = False) -> Generation:
        """Greedy tokens after `ids` until EOS or `max_tokens`. `reuse=False` empties the prefix cache first
        (nothing cached: a fresh prefill); `reuse=True` lets the request reuse the blocks earlier requests
        left, those filled while decoding included."""
        ...

    def version(self) -> str: ...

    def settings(self) -> dict[str, Any]:
        """The engine's settings and the environment variables that change its numbers, as it runs them."""
        ...

    def close(self) -> None: ...


# -- capabilities -------------------------------------------------------------------------------------------------


class SavedState(Protocol):
    """A sequence's K/V as an engine saved it: the positions it holds and its fingerprint."""

    @property
    def ids(self) -> tuple[int, ...]: ...

    @property
    def fingerprint(self) -> str: ...


class SavesState(ABC):
    """Saves a sequence's K/V the moment a token is emitted, and restores a saved one into a cleared context."""

    ARMS: ClassVar[tuple[str, ...]] = ("state-restore", "oneshot-restore")
    """live's saved state restored and continued; a one-shot prefill's, the whole-cache transplant."""
    GRID: ClassVar[tuple[str, ...]] = ("oneshot-restore",)
    """What the 2x2 builds on a fixed prefix (live's state needs live at each precision)."""

    @abstractmethod
    def run(self, ids: Sequence[int], max_tokens: int, reuse: bool = False, chunk: int | None = None,
            save: Callable[[int], bool] | None = None) -> tuple[Generation, SavedState | None]:
        """`generate`, the prompt processed `chunk` tokens per batch, and the K/V saved before the first emitted
        token that `save` accepts (None: never)."""

    @abstractmethod
    def build_state(self, ids: Sequence[int], chunk: int | None = None) -> SavedState:
        """A fresh prefill of `ids`, saved."""

    @abstractmethod
    def restore(self, state: SavedState, pending: int, max_tokens: int) -> tuple[Generation, str]:
        """`state` loaded into a cleared context, `pending` fed as a decode step, continued; and the fingerprint of
        the cache as re-read after the load."""


class PrefillsInChunks(ABC):
    """Processes a prompt n tokens per batch (`chunked:<n>` in the 2x2)."""

    @abstractmethod
    def chunked(self, ids: Sequence[int], max_tokens: int, chunk: int) -> Generation:
        """`generate(ids)` from nothing, the prompt processed `chunk` tokens per batch."""


class SlotSaveRestore(TypedDict):
    """What a server said of a slot saved and restored: the slot saved from, then the slot restored into, and the
    positions it says it saved and restored (None: it did not say)."""

    slots: list[int]
    saved: int | None
    restored: int | None


class RestoresSlot(ABC):
    """A server slot saved, restored into another slot and continued there."""

    ARMS: ClassVar[tuple[str, ...]] = ("slot-restore",)

    @property
    @abstractmethod
    def restores_slots(self) -> bool:
        """Whether this run asked for the slot-restore arms."""

    @abstractmethod
    def slot_restore(self, prompt: Sequence[int], live_tokens: int, prefix: Sequence[int], max_new: int
                     ) -> tuple[Generation, Generation, SlotSaveRestore]:
        """live's request again in one slot, that slot saved and restored into another, the prefix continued
        there: (the live request, the continuation, what the server said of the save and the restore)."""


class LoadSeen(TypedDict):
    """What a request under load met: the other requests kept in flight around it, those in flight when it was
    sent, and those that returned while it ran."""

    concurrency: int
    in_flight_at_send: int
    returned_meanwhile: int


class ServesUnderLoad(ABC):
    """Serves a request while other requests are in flight."""

    ARMS: ClassVar[tuple[str, ...]] = ("live@load", "oneshot@load")
    """live's and oneshot's request again, with other items' requests in flight."""

    @abstractmethod
    def generate_loaded(self, ids: Sequence[int], max_tokens: int, others: Sequence[Sequence[int]]
                        ) -> tuple[Generation, LoadSeen]:
        """`generate(ids, reuse=False)` while requests for `others` are in flight; and what was seen of them."""


class Samples(ABC):
    """Draws a response as an RL rollout engine does, and says the log-probability of each token it emitted."""

    @abstractmethod
    def sample(self, ids: Sequence[int], max_tokens: int, sampling: Sampling) -> Generation:
        """Tokens after `ids` until EOS or `max_tokens`, drawn as `sampling` says by the engine's own sampler, from
        nothing cached (a fresh prefill); `chosen` holds each emitted token's log-probability under the engine's
        `logprobs_mode`, and `top` at least each step's most likely token (the argmax), best first."""

    @abstractmethod
    def precision_name(self) -> str:
        """The precision its numbers are made at, in its own words (vLLM's dtype; a GGUF's weight type and the K/V
        cache's type; a server's model type): what a record's arm says of the engine's precision."""


class ScoresPrompt(ABC):
    """Scores a sequence's tokens teacher-forced in one request: one prefill of the sequence, nothing cached (the
    engine's own one-shot computation, as a trainer's forward is ours)."""

    @abstractmethod
    def score(self, ids: Sequence[int], start: int, sampling: Sampling) -> PromptScores:
        """Per token of ids[start:], the log-probability the logits at the position before it give it, under the
        engine's `logprobs_mode` (processed: after `sampling`'s temperature, top-k and top-p); `start` >= 1."""


class ChecksFirst(ABC):
    """Checked against the run's tokenizer before any item: refused in one line where its numbers could not be
    compared with ours."""

    @abstractmethod
    def check(self, tokenizer: Any) -> None: ...


class Instance(TypedDict, total=False):
    """What tells one life of a process from another's, as far as it says (neither: it says nothing)."""

    started: float  # when the process started (vLLM's `process_start_time_seconds`)
    tasks: int  # a counter that only grows while the process runs (llama-server's highest task id)


class Restarts(ABC):
    """A process that may restart between a run's items (its caches then cold), which a resumed run can tell."""

    @property
    @abstractmethod
    def address(self) -> str:
        """Where it is, for a note."""

    @abstractmethod
    def instance(self) -> Instance:
        """What tells this process's life from another's."""

    @abstractmethod
    def note_resume(self, before: Instance, requests: int, after: str) -> bool | None:
        """Whether it restarted since a record made when it was `before` and `requests` requests ago (None: it
        cannot tell)."""


# -- what an engine is before it loads ----------------------------------------------------------------------------


class EngineKind(ABC):
    """An engine before it is loaded: its name, its options, what it checks before anything loads, how it loads,
    and the arms its capabilities add to a matched run."""

    name: ClassVar[str]
    title: ClassVar[str] = ""
    """How the command line's help names its panel of options ('' : its name)."""
    options: ClassVar[type[EngineOptions]]
    engine: ClassVar[type]
    """The class `load` returns: its capability mixins say which arms it runs."""
    isolated: ClassVar[bool] = False
    """Its items run in a worker process: native code that crashes takes the worker down, not the run."""
    own_types: ClassVar[bool] = False
    """It computes in types of its own, not at the precision it is asked for (a GGUF's weights, a server's model):
    its matched arms are labelled with what it says it runs at (`Samples.precision_name`)."""

    def require(self) -> None:  # noqa: B027  # an engine with nothing to install keeps this
        """Refuse in one line, before anything loads, an engine not installed here."""

    def check_model(self, model: str | None) -> None:  # noqa: B027  # an engine that runs any model keeps this
        """Refuse in one line a model it cannot run (None: the embedded toy's folder)."""

    def context(self, config: EngineConfig) -> tuple[int, str] | None:
        """The positions one request may hold, and their name for an error, where the engine's settings bound
        them below the model's context; None where only the model's context does."""
        return None

    @abstractmethod
    def load(self, config: EngineConfig, model_path: str, precision: str, threads: int, device: str
             ) -> ServingEngine: ...

    def logprobs_modes(self, config: EngineConfig) -> tuple[str, ...]:
        """The distributions the log-probabilities of its drawn tokens can be taken from (`Samples`), as this run's
        options and the engine's settings allow; () where it does not sample."""
        return ("raw",) if issubclass(self.engine, Samples) else ()

    def prompt_scoring(self, config: EngineConfig) -> str | None:
        """None where it scores a sequence's tokens in one request (`ScoresPrompt`) under the config's logprobs
        mode; else the one line that says why it cannot."""
        if not issubclass(self.engine, ScoresPrompt):
            return f"the {self.name} engine cannot score a sequence's tokens in one request"
        if config.logprobs_mode != "raw":
            return f"the {self.name} engine scores a sequence's tokens under raw log-probabilities only"
        return None

    def seeded_draws(self, config: EngineConfig) -> str | None:
        """None where its seeded draws are vLLM's sampler's (the pick argmax(probs / E), E ~ Exp(1) from a generator
        seeded with the request's seed), which a seeded claim is replayed with (`engine.reference`); else the one
        line that says why not."""
        return f"the {self.name} engine draws with a sampler of its own, not vLLM's seeded one a seeded claim replays"

    def arms(self, config: EngineConfig) -> tuple[str, ...]:
        """The arms its capabilities add beside oneshot and prefix-cache, as this run's options switch them on."""
        return SavesState.ARMS if issubclass(self.engine, SavesState) else ()

    def grid_arms(self) -> tuple[str, ...]:
        """The arms of its own the 2x2 may build on a fixed prefix."""
        return SavesState.GRID if issubclass(self.engine, SavesState) else ()

    def concurrency(self, config: EngineConfig) -> int:
        """Other requests in flight around each under-load arm (0: none)."""
        return 0

    def build(self, config: EngineConfig) -> Mapping[str, object] | None:
        """What fixes its kernels, as installed here, for the audit to compare with the recorded one (each engine's
        own fields, compared field by field with the recorded JSON; None: the engine records none)."""
        return None

    def at_address(self, config: EngineConfig, url: str) -> EngineConfig | None:
        """Its config with the engine found at `url` instead (a server that moved); None: it has no address."""
        return None

    def crashed(self, config: EngineConfig, problem: str) -> StageReplayError:
        """The one line for a worker whose native code died running an item."""
        return StageReplayError(f"{problem}: the {self.name} engine's native code crashed",
                                "run the same command again: the run resumes from this item")


def options_of(kind: type[OptionsT], given: dict[str, Any], engine: str) -> OptionsT:
    """`kind` from the options given for `engine`, an option it does not take refused in one line."""
    names = {f.name for f in fields(kind)}
    unknown = sorted(set(given) - names)
    if unknown:
        flag = "--" + unknown[0].replace("_", "-")
        takes = ", ".join("--" + n.replace("_", "-") for n in sorted(names)) or "no options"
        raise StageReplayError(f"{flag} is not an option of --engine {engine}", f"--engine {engine} takes {takes}")
    options = kind(**given)
    options.check()
    return options


def refuse_cache_access(engine: str, what: str) -> StageReplayError:
    """The one line for an experiment that needs the K/V cache itself, which a serving engine does not expose."""
    return StageReplayError(
        f"{what} needs boundary K/V caches (to fingerprint, compare or transplant), which the {engine} engine "
        "does not expose",
        "run it on a matched run of our engine (`stagereplay matched` without --engine)")
