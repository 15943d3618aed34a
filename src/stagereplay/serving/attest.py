"""Attest on a running server (`attest --engine http --url URL`): each item's served response (part '') asked of the
server itself, token IDs in and out; every other part (the claimed model's honest variants and its reference scores)
is `experiments.attest.experiment`'s own, in our engine, exactly as for a file of served outputs.

    served    one request for the item's prompt IDs (`Samples.sample`: llama-server's /completion, vLLM's
              /v1/completions), nothing cached, at most --max-new-tokens, greedy (temperature 0) or, for a seeded
              claim, with the run's temperature, top-k, top-p and the item's seed; the reply's token IDs, and the
              log-probability the server gave each (its raw distribution) where it gave one for every token

Every part's seed is folded below the span a server takes (`SEED_SPAN`), so the seed the reference replays is the
one the server drew with. The server was checked against the claimed model's tokenizer before the first item
(`ChecksFirst`: token IDs taken verbatim, greedy at temperature 0, the same tokenizer); every reply is read and checked
where it arrives (`serving.replies`), and one that is not token IDs of that tokenizer is refused in one line, naming
the item: exit 2, never read as a verdict, and no record made from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from stagereplay.engine.lm import LM, ids_fingerprint
from stagereplay.errors import StageReplayError
from stagereplay.experiments.attest.item import AttestParams, attest_item, item_seed, max_new
from stagereplay.experiments.attest.payloads import AttestPayload
from stagereplay.experiments.core.jobs import Job, Params
from stagereplay.records import arrays
from stagereplay.serving.matched import ServingArms, cached_engine
from stagereplay.serving.seam import SEED_SPAN, Generation, Samples, Sampling


@dataclass(frozen=True)
class ServedAttestParams(Params):
    """Part '' of an attest job on a server: the experiment's parameters and the engine that serves it."""

    attest: AttestParams
    arms: ServingArms

    @property
    def part(self) -> str:
        return self.attest.part


def served_params(params: AttestParams, arms: ServingArms) -> Params:
    """A job's parameters on a server: every part's seeds folded to the server's span; part '' asked of the server,
    the others as they are (ours)."""
    params = replace(params, seed_span=SEED_SPAN)
    return params if params.part else ServedAttestParams(params, arms)


def token_ids(g: Generation, vocab: int, where: str) -> list[int]:
    """The reply's tokens, each a token ID of the claimed model's tokenizer; else refused in one line."""
    bad = next((t for t in g.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise StageReplayError(f"{where} returned {bad}, not a token ID of the claimed model's tokenizer "
                               f"(0..{vocab - 1})", "serve the claimed model (--model names the model the server "
                                                    "should be running)")
    if not g.tokens:
        raise StageReplayError(f"{where} returned no token IDs (a text completion only)",
                               "serve with an API that returns token IDs: llama-server's /completion, vLLM's "
                               "/v1/completions (return_tokens_as_token_ids)")
    return list(g.tokens)


def served_logprobs(g: Generation) -> str | None:
    """The server's log-probability of each served token, encoded; None where it did not give one for each."""
    import numpy as np

    chosen = g.chosen
    if chosen is None or len(chosen) != len(g.tokens) or any(math.isnan(x) for x in chosen):
        return None
    return arrays.encode(np.asarray(chosen, dtype=np.float32), "f32")


def served_part(lm: LM, job: Job[ServedAttestParams]) -> AttestPayload:
    """The item's response as the server serves it (module docstring)."""
    p, dc, item = job.params, job.settings.decode, job.item
    engine = cached_engine(p.arms.engine, lm)
    if not isinstance(engine, Samples):
        raise StageReplayError(f"the {engine.name} engine does not serve a response as asked",
                               "attest a running server (--engine http --url URL), or a file of its outputs")
    prompt = list(item.prompt_ids)
    seed = item_seed(item, dc, p.attest.columns, p.attest.seed_span)
    sampling = Sampling.of(dc.sample, dc.temperature, dc.top_k, dc.top_p, seed or 0)
    g = engine.sample(prompt, max_new(item, dc), sampling)
    response = token_ids(g, len(lm.tokenizer), f"the {engine.name} engine, asked for item {item.id},")
    return AttestPayload(status="ok", kind="served", source="server", prompt_ids=prompt, response_ids=response,
                         tokens_fp=ids_fingerprint([*prompt, *response]), precision=engine.precision_name(),
                         seed=seed, stop="eos" if g.finish == "stop" else "length", logprobs=served_logprobs(g))


def served_attest_item(lm: LM, job: Job[Any]) -> AttestPayload:
    """One item's part: part '' asked of the server; an honest or reference part, ours (`attest_item`)."""
    return served_part(lm, job) if isinstance(job.params, ServedAttestParams) else attest_item(lm, job)
