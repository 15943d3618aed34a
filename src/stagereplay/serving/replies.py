"""A server's completion replies (`--engine http`), read into one typed shape and checked where they arrive, before
anything uses them: a reply a run cannot use is refused in one line that names the server, and no record is made
from it (a run stopped there resumes from that item).

    llama-server   /completion: `tokens`, and per emitted token a step of `completion_probabilities`: its `id` and
                   `logprob` and the step's `top_logprobs` ({id, logprob}); with `post_sampling_probs`, `prob` and
                   `top_probs` instead (after the sampler chain; their logs are taken here)
    openai         /v1/completions: `choices[0].logprobs` in vLLM's shape (`tokens` as `token_id:N` strings,
                   `token_logprobs`, `top_logprobs` as JSON objects) or llama-server's (`content` of {id, logprob,
                   top_logprobs}); `usage.prompt_tokens` and `prompt_tokens_details.cached_tokens`

The reply's JSON is read into pydantic models in strict mode (a token ID sent as a float, a string or a bool is
refused, never converted); `Steps.read` then checks what the caller reads of it:

    token IDs     an emitted token's within the run's tokenizer (0 <= id < its size); a candidate's at least 0 (it
                  may name a padded row of the model's output layer, which no tokenizer has)
    log-probs     numbers at most `LOGPROB_SLACK`; a candidate's may be -inf (null in llama-server's JSON: a token
                  the sampler masked); NaN, +inf and values above the slack (a probability or a logit sent as a
                  log-probability) are refused
    steps         every list the server gives per emitted token has one entry per token, and a step's id is the
                  token it emitted (llama-server leaves out the steps of a stop word; no request here sends one,
                  so such a reply is refused, saying so); a step list the caller reads (`Need`) holds something at
                  every step it reads: candidates, never an empty list; a log-probability, never null

One exception, an honest server's: llama-server's speculative decoding emits the tokens a verification accepts with
no candidates and a placeholder log-probability of 0 ("set later", never set). In a reply that says it drafted
(`timings.draft_n`), a step without candidates is such a token: its candidates are none, and its log-probability is
not one, so the reply's log-probabilities are not read at all (a rollout's are then unknown, never zeros).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stagereplay.errors import StageReplayError
from stagereplay.records.payloads import first_error

LOGPROB_SLACK = 1e-3
"""How far above 0 a log-probability may be and still be read as one: a sure token's probability rounded to just
above 1 (1 + 1e-3 at most). Above it the number is not a log-probability."""
SERVERS_FIX = ("check that --url names llama-server or vllm serve itself (a proxy in front must pass its replies "
               "unchanged); the same command resumes a run from the item it stopped at")
"""The fix for a reply that neither server sends."""

Top = tuple[tuple[int, float], ...]
"""One step's candidates: (token id, log-probability), best first (log-probability descending, ties by the lower
id), as `Generation.top` holds them."""
Need = Literal["every", "whole"]
"""What a caller reads of a per-step list: its entry at `every` step it reads; or the `whole` list, an entry at
every step or at none (the server did not give it)."""


class Reply(BaseModel):
    """A server's JSON as it is read: strict types, fields this stagereplay does not read ignored."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")


class NativeCandidate(Reply):
    """One of a step's top tokens in llama-server's /completion reply."""

    id: int
    logprob: float | None = None
    prob: float | None = None  # with post_sampling_probs


class NativeStep(Reply):
    """One step of llama-server's `completion_probabilities`: the token emitted, and the step's top tokens."""

    id: int
    logprob: float | None = None
    prob: float | None = None
    top_logprobs: list[NativeCandidate] | None = None
    top_probs: list[NativeCandidate] | None = None


class Timings(Reply):
    """llama-server's `timings`, the counts read here."""

    cache_n: int | None = None  # prompt positions taken from the slot's cache
    draft_n: int | None = None  # tokens drafted (present only where the request drafted one)
    draft_n_accepted: int | None = None

    def said(self) -> dict[str, int]:
        """The counts the server said, by their names in its JSON."""
        return self.model_dump(exclude_none=True)


class NativeReply(Reply):
    """llama-server's /completion reply."""

    tokens: list[int] | None = None
    completion_probabilities: list[NativeStep] | None = None
    tokens_evaluated: int | None = None
    stop_type: str | None = None
    timings: Timings | None = None


class ChatCandidate(Reply):
    """One of a step's top tokens in llama-server's OpenAI-style `logprobs.content`."""

    id: int
    logprob: float | None = None


class ChatStep(Reply):
    """One step of llama-server's OpenAI-style `logprobs.content`."""

    id: int
    logprob: float | None = None
    top_logprobs: list[ChatCandidate] | None = None


class OpenAILogprobs(Reply):
    """`choices[0].logprobs`: llama-server's shape (`content`) or vLLM's (the three lists)."""

    content: list[ChatStep] | None = None
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float | None] | None] | None = None


class Choice(Reply):
    logprobs: OpenAILogprobs | None = None
    finish_reason: str | None = None


class PromptDetails(Reply):
    cached_tokens: int | None = None


class Usage(Reply):
    prompt_tokens: int | None = None
    prompt_tokens_details: PromptDetails | None = None  # null where the server does not count cached tokens


class OpenAIReply(Reply):
    """An OpenAI-style /v1/completions reply (`vllm serve`, llama-server's own endpoint)."""

    choices: list[Choice]
    usage: Usage | None = None
    timings: Timings | None = None  # llama-server's own field beside the OpenAI ones; vLLM has none

    def choice(self, where: Where) -> Choice:
        if not self.choices:
            raise where.refuse("no choice")
        return self.choices[0]


class Piece(Reply):
    """A token of llama-server's /tokenize with pieces."""

    id: int


class Tokenized(Reply):
    """A /tokenize reply: the IDs (llama-server's, or vLLM's), or llama-server's pieces."""

    tokens: list[int | Piece] = Field(default_factory=list)

    def ids(self) -> list[int]:
        return [t.id if isinstance(t, Piece) else t for t in self.tokens]


ReplyT = TypeVar("ReplyT", bound=Reply)


@dataclass(frozen=True)
class Where:
    """The request a reply answers, for its one-line refusal: the server's address and the path asked."""

    url: str
    path: str

    def refuse(self, what: str, fix: str = SERVERS_FIX) -> StageReplayError:
        return StageReplayError(f"the server at {self.url} answered {self.path} with {what}: a reply this run cannot "
                                "use, so nothing was recorded from it", fix)

    def read(self, kind: type[ReplyT], reply: Any) -> ReplyT:
        """`reply` (the server's JSON) as `kind`; refused in one line where a field has another type."""
        try:
            return kind.model_validate(reply)
        except ValidationError as exc:
            raise self.refuse(f"what this stagereplay does not read ({first_error(exc)})") from None


@dataclass(frozen=True)
class Steps:
    """A reply's emitted tokens and what it said per token, as it said it: each step's candidates (None: none
    given for the step) and the token's log-probability (None: none given), each list None where the reply has no
    such list."""

    tokens: tuple[int, ...]
    top: tuple[Top | None, ...] | None
    chosen: tuple[float | None, ...] | None
    speculated: bool = False
    """The server drafted tokens for this request: a step without candidates is one its verification emitted
    (module docstring)."""

    def read(self, where: Where, vocab: int | None, top: Need, chosen: Need, start: int = 0) -> Read:
        """The steps checked (module docstring) for a caller that reads `top` and `chosen` as their `Need`s say,
        from step `start` on (an echoed prompt's first token has neither); refused in one line otherwise."""
        bad = next((t for t in self.tokens if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            span = f"0..{vocab - 1}" if vocab is not None else "0 or more"
            raise where.refuse(f"the token {bad}, not a token ID of the run's tokenizer ({span})",
                               "serve the model --model names (the server must run the run's tokenizer)")
        n = len(self.tokens)
        for name, given in (("candidate lists", self.top), ("log-probabilities", self.chosen)):
            if given is not None and len(given) != n:
                raise where.refuse(f"{len(given)} {name} for its {n} tokens")
        tops = _needed(self.top, top, start, n, where, "no candidates", self.speculated)
        for step, candidates in enumerate(tops):
            for token, value in candidates or ():
                _check_logprob(value, where, f"step {step}'s candidate {token}", masked=True)
        chosen_ = _needed(self.chosen, chosen, start, n, where, "no log-probability for its token", self.speculated)
        for step, said in enumerate(chosen_):
            _check_logprob(said, where, f"step {step}'s token", masked=False)
        return Read(self.tokens, tuple(t if t is not None else () for t in tops) if tops else (),
                    None if not chosen_ else tuple(math.nan if v is None else v for v in chosen_))


@dataclass(frozen=True)
class Read:
    """What a caller reads of a reply, checked: its tokens, each step's candidates best first (() where none was
    given: before `start`, or the reply gave none and the caller reads them whole), each token's log-probability
    (NaN before `start`; None where the reply gave none and the caller reads them whole)."""

    tokens: tuple[int, ...]
    top: tuple[Top, ...]
    chosen: tuple[float, ...] | None


T = TypeVar("T")


def _needed(given: tuple[T | None, ...] | None, need: Need, start: int, n: int, where: Where, missing: str,
            speculated: bool) -> list[T | None]:
    """`given` (one entry per token) where the caller's `need` is met from step `start` on, None at the steps a
    speculating reply's verification emitted; [] where the caller reads it whole and the reply lacks it (at every
    step, or at a speculated one)."""
    if given is None:
        if need == "every" and n > start:
            raise where.refuse(f"{missing} at any step")
        return []
    lacking = [i for i in range(start, n) if given[i] is None]
    if lacking and not speculated and (need == "every" or len(lacking) < n - start):
        raise where.refuse(f"{missing} at step {lacking[0]}")
    if lacking and need == "whole":
        return []
    return [None if i < start else given[i] for i in range(n)]


def _check_logprob(value: float | None, where: Where, what: str, masked: bool) -> None:
    if value is None:
        return
    if math.isnan(value) or value > LOGPROB_SLACK or (value == -math.inf and not masked):
        raise where.refuse(f"{value} as {what}'s log-probability, which is not one (a number at most 0"
                           f"{', or -inf for a masked candidate' if masked else ''})")


def best_first(pairs: Iterable[tuple[int, float]]) -> Top:
    """`Top`'s order. vLLM's top_logprobs is a JSON object whose keys come in no promised order (the emitted token
    may lead though another ranks above it)."""
    return tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))


def _log(prob: float | None, where: Where) -> float | None:
    """A post-sampling probability's log (0: -inf, a masked token)."""
    if prob is None:
        return None
    if not 0 <= prob <= 1 + LOGPROB_SLACK:
        raise where.refuse(f"the probability {prob}, which is not one")
    return math.log(prob) if prob > 0 else -math.inf


def _masked(value: float | None) -> float:
    """A candidate's log-probability; null (llama-server's JSON for -inf) is a masked token's."""
    return -math.inf if value is None else value


def native_steps(reply: NativeReply, where: Where, processed: bool = False) -> Steps:
    """The steps of llama-server's /completion reply: the raw distribution's log-probabilities, or with
    `processed` (post_sampling_probs) the logs of the probabilities after the sampler chain."""
    steps = reply.completion_probabilities
    tokens = tuple(reply.tokens if reply.tokens is not None else [s.id for s in steps or []])
    if steps is None:
        return Steps(tokens, None, None)
    if len(steps) != len(tokens):
        if reply.stop_type == "word":  # llama-server leaves a stop word's steps out
            raise where.refuse(f"{len(steps)} steps of completion_probabilities for its {len(tokens)} tokens (it "
                               "stopped at a stop word, whose steps it leaves out)",
                               "serve without stop words (--reverse-prompt, a template's stop strings); the same "
                               "command resumes a run from the item it stopped at")
        raise where.refuse(f"{len(steps)} steps of completion_probabilities for its {len(tokens)} tokens")
    off = next((i for i, (s, t) in enumerate(zip(steps, tokens, strict=True)) if s.id != t), None)
    if off is not None:
        raise where.refuse(f"step {off} naming the token {steps[off].id} where it emitted {tokens[off]}")

    def top(s: NativeStep) -> Top | None:
        listed = s.top_probs if processed else s.top_logprobs
        if not listed:
            return None
        if processed:
            return best_first((c.id, _masked(_log(c.prob, where))) for c in listed)
        return best_first((c.id, _masked(c.logprob)) for c in listed)

    tops = [top(s) for s in steps]
    speculated = reply.timings is not None and bool(reply.timings.draft_n)
    chosen = [None if speculated and t is None else _log(s.prob, where) if processed else s.logprob
              for s, t in zip(steps, tops, strict=True)]
    return Steps(tokens, tuple(tops), tuple(chosen), speculated)


def token_id(text: str, where: Where) -> int:
    """A token's ID from vLLM's `token_id:N` (return_tokens_as_token_ids)."""
    head, _, number = text.partition(":")
    if head != "token_id" or not number.isdigit():
        raise where.refuse(f"the token {text!r}, not its ID",
                           "serve with vLLM's return_tokens_as_token_ids support, or pass --api llama-server")
    return int(number)


def openai_steps(logprobs: OpenAILogprobs | None, where: Where) -> Steps:
    """The steps of `choices[0].logprobs` in either shape (module docstring); no steps where there are none."""
    if logprobs is None:
        return Steps((), None, None)
    if logprobs.content is not None:
        content = logprobs.content
        return Steps(tuple(s.id for s in content),
                     tuple(best_first((c.id, _masked(c.logprob)) for c in s.top_logprobs) if s.top_logprobs
                           else None for s in content),
                     tuple(s.logprob for s in content))
    tokens = tuple(token_id(t, where) for t in logprobs.tokens or [])
    for name, listed in (("top_logprobs", logprobs.top_logprobs), ("token_logprobs", logprobs.token_logprobs)):
        if listed is not None and len(listed) != len(tokens):
            raise where.refuse(f"{len(listed)} {name} for its {len(tokens)} tokens")
    top = None if logprobs.top_logprobs is None else tuple(
        best_first((token_id(t, where), _masked(v)) for t, v in step.items()) if step else None
        for step in logprobs.top_logprobs)
    chosen = None if logprobs.token_logprobs is None else tuple(logprobs.token_logprobs)
    return Steps(tokens, top, chosen)
