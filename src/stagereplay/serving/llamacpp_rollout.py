"""llama.cpp as an RL rollout engine (`serving.llamacpp.LlamaCppEngine`'s `Samples` and `ScoresPrompt`): a response
drawn by llama.cpp's own sampler, and a sequence scored teacher-forced by one prefill of its context.

    sample(ids, max_tokens, sampling)   the context cleared, `ids` processed as a batch, then one token per decode
                                        step, each drawn by a llama.cpp sampler chain: temperature, top-k, top-p and
                                        `dist` seeded with the request's seed (generate()'s order; llama-server's
                                        default order puts temperature last, so a server request names the order)
                                        applied to the step's logits (`llama_sampler_apply`), or the argmax at
                                        temperature 0 (lowest id among ties, as greedy `generate` picks)
    score(ids, start, sampling)         the context cleared, ids[:-1] processed in `n_batch` chunks with the logits
                                        of every position kept (`llama_get_logits_ith` of each row): what a trainer's
                                        forward over the sequence is, in llama.cpp

A raw log-probability is the log-softmax of the step's fp32 logits, taken in float64; a processed one the log-softmax
of the candidates the chain's temperature, top-k and top-p leave, with the logits they leave (-inf for a token they
removed). Both come from llama.cpp's own logits and its own samplers' processing: nothing is imitated.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from stagereplay.serving.seam import EngineConfig, Generation, PromptScores, Sampling

if TYPE_CHECKING:
    import numpy as np

TOKEN_DATA = [("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]
"""`llama_token_data` as a numpy record: a candidate's id, logit and probability."""


class Context(Protocol):
    """What a rollout needs of the engine (`serving.llamacpp.LlamaCppEngine`): its context and bindings."""

    lib: Any
    llm: Any
    vocab: Any
    config: EngineConfig

    @property
    def n_batch(self) -> int: ...

    def check_room(self, n: int) -> None: ...

    def clear(self) -> None: ...

    def eval(self, ids: Sequence[int], chunk: int | None = None) -> None: ...

    def logits32(self, row: int = -1) -> Any: ...


@contextmanager
def chain(lib: Any, sampling: Sampling, draw: bool) -> Iterator[Any]:
    """A llama.cpp sampler chain for `sampling`: temperature, top-k (0: none), top-p (1: none) and, where `draw`,
    `dist` seeded with the request's seed; freed on exit."""
    made = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    lib.llama_sampler_chain_add(made, lib.llama_sampler_init_temp(sampling.temperature))
    if sampling.top_k:
        lib.llama_sampler_chain_add(made, lib.llama_sampler_init_top_k(sampling.top_k))
    if sampling.top_p < 1:
        lib.llama_sampler_chain_add(made, lib.llama_sampler_init_top_p(sampling.top_p, 1))
    if draw:
        lib.llama_sampler_chain_add(made, lib.llama_sampler_init_dist(sampling.seed))
    try:
        yield made
    finally:
        lib.llama_sampler_free(made)


def apply(lib: Any, sampler: Any, logits: np.ndarray) -> tuple[np.ndarray, int]:
    """The candidates `sampler` leaves of a step's fp32 logits [V] (a record array of id, logit, p: the logits as
    its processing leaves them) and the index among them it selected (-1: none, a chain that does not draw)."""
    import numpy as np

    data = np.zeros(logits.shape[0], dtype=TOKEN_DATA)
    data["id"] = np.arange(logits.shape[0])
    data["logit"] = logits
    array = lib.llama_token_data_array(data=data.ctypes.data_as(lib.llama_token_data_p), size=data.shape[0],
                                       selected=-1, sorted=False)
    lib.llama_sampler_apply(sampler, ctypes.byref(array))
    # The samplers may point the array at a buffer of their own: read what it points at now.
    raw = ctypes.cast(array.data, ctypes.POINTER(ctypes.c_uint8))
    kept = np.ctypeslib.as_array(raw, shape=(array.size * data.itemsize,)).view(TOKEN_DATA).copy()
    return kept, int(array.selected)


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    """log p(token) under softmax(logits), in float64."""
    import numpy as np

    wide = logits.astype(np.float64)
    m = wide.max()
    return float(wide[token] - m - np.log(np.exp(wide - m).sum()))


def processed_at(kept: np.ndarray, token: int) -> float:
    """log p(token) among the candidates a chain left, in float64 (-inf where it removed the token)."""
    import numpy as np

    where = np.flatnonzero(kept["id"] == token)
    if where.size == 0:
        return float("-inf")
    return log_softmax_at(kept["logit"], int(where[0]))


def argmax(logits: np.ndarray) -> int:
    """The most likely token, lowest id among ties (llama.cpp's greedy pick)."""
    import numpy as np

    return int(np.flatnonzero(logits == logits.max())[0])


def sample(engine: Context, ids: Sequence[int], max_tokens: int, sampling: Sampling) -> Generation:
    """`Samples.sample` on one llama.cpp context (module docstring)."""
    lib, mode = engine.lib, engine.config.logprobs_mode
    ids = list(ids)
    engine.check_room(len(ids) + max_tokens)
    engine.clear()
    engine.eval(ids)
    tokens: list[int] = []
    chosen: list[float] = []
    top: list[tuple[tuple[int, float], ...]] = []
    with chain(lib, sampling, draw=True) as sampler:
        while True:
            logits = engine.logits32()
            best = argmax(logits)
            if sampling.greedy:
                token = best
                lp, best_lp = log_softmax_at(logits, token), log_softmax_at(logits, best)
            else:
                kept, selected = apply(lib, sampler, logits)
                token = int(kept["id"][selected])
                lib.llama_sampler_accept(sampler, token)
                if mode == "processed":
                    lp, best_lp = processed_at(kept, token), processed_at(kept, best)
                else:
                    lp, best_lp = log_softmax_at(logits, token), log_softmax_at(logits, best)
            tokens.append(token)
            chosen.append(lp)
            top.append(((best, best_lp),))
            if lib.llama_vocab_is_eog(engine.vocab, token):
                finish = "stop"
                break
            if len(tokens) >= max_tokens:
                finish = "length"
                break
            engine.eval([token], 1)
    return Generation(tuple(tokens), tuple(top), 0, finish, None, tuple(chosen))


def score(engine: Context, ids: Sequence[int], start: int, sampling: Sampling) -> PromptScores:
    """`ScoresPrompt.score` on one llama.cpp context (module docstring): ids[:-1] decoded in chunks of `n_batch`
    with every row's logits asked for; row p scores ids[p + 1]."""
    lib, mode = engine.lib, engine.config.logprobs_mode
    ids = [int(t) for t in ids]
    feed = ids[:-1]
    engine.check_room(len(feed))
    engine.clear()
    logprobs: list[float] = []
    best: list[int] = []
    size = engine.n_batch
    batch = engine.llm._batch  # llama-cpp-python's batch of n_batch tokens, filled with every row's logits asked for
    try:
        with chain(lib, sampling, draw=False) as sampler:
            for begin in range(0, len(feed), size):
                part = feed[begin : begin + size]
                batch.set_batch(batch=part, n_past=begin, logits_all=True)
                engine.llm._ctx.decode(batch)
                for row in range(len(part)):
                    position = begin + row
                    if position + 1 < start:
                        continue
                    logits = engine.logits32(row)
                    target = ids[position + 1]
                    best.append(argmax(logits))
                    if mode == "processed" and not sampling.greedy:
                        logprobs.append(processed_at(apply(lib, sampler, logits)[0], target))
                    else:
                        logprobs.append(log_softmax_at(logits, target))
    finally:
        engine.clear()
    return PromptScores(tuple(logprobs), tuple(best))
