"""One attest job's work: an item's served response, an honest variant's, or the reference's scores of them all.

    serve(lm, prompt, max_new, decode, seed)   what a server running `lm` serves: live decode from a retained cache
                                               (or the cache an honest variant's server builds, `attest_variants`),
                                               greedy, or the claimed seeded sampler's pick (`engine.seeded`: vLLM's,
                                               or its CPU build's) with the request's seed
    attest_item(lm, job)                       the job's part: served (''), honest (a variant's name) or reference
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from stagereplay.engine.constructions import reencoded
from stagereplay.engine.decode import DecodeConfig, Sampler, derive_seed
from stagereplay.engine.lm import ids_fingerprint
from stagereplay.engine.seeded import DEFAULT
from stagereplay.errors import StageReplayError
from stagereplay.experiments.attest.payloads import AttestPayload, AttestSide, Kind, Source
from stagereplay.experiments.attest.variants import EngineVariant, HonestVariant, variant_of
from stagereplay.experiments.core.jobs import Job, Params
from stagereplay.records import arrays
from stagereplay.serving.http_honest import FAMILY as DEPLOYMENT
from stagereplay.serving.http_honest import index as deployment_index

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM
    from stagereplay.engine.reference import TokenScores

LIVE = HonestVariant("bf16")
"""The live construction (its precision is the model's own: a variant's precision picks the unit's model)."""
REFERENCE = "reference"
"""The part of an item's reference scores."""
SCORES = ("logprobs", "margin", "match", "logit_rank", "prob", "gumbel_match", "gumbel_margin")
"""The encoded score arrays of a side, in the order `scores_fp` hashes them."""
EXTRA_SCORES = ("argmax",)
"""Score arrays a side may hold beyond `SCORES`, hashed after them by name where present."""


@dataclass(frozen=True)
class AttestParams(Params):
    """An attest job: its part ('' the served response, an honest variant's name, `reference` the scores), where
    the served response comes from, the file's column mapping, for the reference part the responses to score
    ((name, engine, construction, precision, response) each), for a simulated server its checkpoint folder and
    precision (the served part loads them itself: a unit's model is the claimed one's), where the requests' seeds
    must fit a server's span (`seed_span`), that span: every part's seed is then folded below it, as the server's,
    the claimed seeded sampler (`engine.seeded.SAMPLERS`; a sampled claim only), and the addresses of the trusted
    deployments honest variants `url`, `url/N` ask (`--honest-url`)."""

    which: str
    source: Source
    columns: str | None = None
    sides: tuple[tuple[str, str, str, str, tuple[int, ...]], ...] = ()
    served_model: str | None = None
    served_precision: str | None = None
    seed_span: int | None = None
    seeded: str = DEFAULT
    deployments: tuple[str, ...] = ()

    @property
    def part(self) -> str:
        return self.which


def deployment(variant: EngineVariant, deployments: Sequence[str]) -> str | None:
    """The address of the trusted deployment a variant asks (`--honest-url`); None for an in-process engine's."""
    if variant.engine != DEPLOYMENT:
        return None
    i = deployment_index(variant.settings)
    return deployments[i] if i < len(deployments) else None


def item_seed(item: Any, decode: DecodeConfig, columns: str | None, span: int | None = None) -> int | None:
    """The per-request seed of a sampled claim for `item`: a served file's row's own `seed` where it has one, else
    derived from the run's seed and the item (below `span` where a server takes seeds of that span); None for a
    greedy claim."""
    if not decode.sample:
        return None
    from stagereplay.tasks.rollouts import RolloutItem, read

    if isinstance(item, RolloutItem):
        seed = read(item, columns).sampling.get("seed")
        if seed is not None:
            return int(seed)
    seed = derive_seed(decode.seed, item.id, "served")
    return seed if span is None else seed % span


def max_new(item: Any, decode: DecodeConfig) -> int:
    """How many tokens a response to `item` may have: a served file's response length, else the run's limit."""
    return int(getattr(item, "response_len", 0) or decode.max_new_tokens)


def serve(lm: LM, prompt: Sequence[int], limit: int, decode: DecodeConfig, seed: int | None,
          variant: HonestVariant = LIVE, seeded: str = DEFAULT) -> tuple[list[int], str, list[float]]:
    """What an honest server running `lm` serves for `prompt` (module docstring), its prompt's cache built and its
    steps run as `variant` says (`experiments.attest.variants`; live by default), a sampled claim drawn by the seeded
    sampler `seeded` (`engine.seeded`): the tokens, why it stopped (eos or length), and the log-probability its own
    decode gave each token (log-softmax of its raw logits: what a server returns as the token's log-probability)."""
    import torch

    from stagereplay.engine.seeded import seeded_sampler

    prompt = list(prompt)
    cache, logits = variant.prefill(lm, prompt, limit)  # [V]
    sampler = seeded_sampler(seeded, seed, lm.config.device) if decode.sample and seed is not None else None
    warp = Sampler(replace(decode, sample=False), 0, lm.config.device).warp
    tokens: list[int] = []
    logprobs: list[float] = []
    past = len(prompt)
    while True:
        x = logits.float()[None]  # [1, V]
        token = int(x.argmax()) if sampler is None else int(sampler.draw(warp(x)).pick[0])
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(x[0], dim=-1)[token]))
        if token in lm.eos or len(tokens) >= limit:
            return tokens, "eos" if token in lm.eos else "length", logprobs
        logits = variant.step(lm, cache, token, past, prompt)
        past += 1


def side_of(name: str, engine: str, construction: str, precision: str, prompt: Sequence[int],
            response: Sequence[int], seed: int | None, scores: TokenScores) -> AttestSide:
    """One scored response as the record holds it."""
    import numpy as np

    enc: dict[str, str | None] = {
        "logprobs": arrays.encode(scores.logprob, "f32"), "margin": arrays.encode(scores.margin, "f32"),
        "match": arrays.encode(scores.match.astype(np.int32), "i32"),
        "logit_rank": arrays.encode(scores.logit_rank.astype(np.int32), "i32"),
        "prob": arrays.encode(scores.prob, "f32"),
        "gumbel_match": None if scores.gumbel_match is None else arrays.encode(scores.gumbel_match.astype(np.int32),
                                                                               "i32"),
        "gumbel_margin": None if scores.gumbel_margin is None else arrays.encode(scores.gumbel_margin, "f32"),
        "argmax": None if scores.argmax is None else arrays.encode(scores.argmax.astype(np.int32), "i32")}
    return AttestSide.model_validate({
        "name": name, "engine": engine, "construction": construction, "precision": precision,
        "response_ids": list(response), "tokens_fp": ids_fingerprint([*prompt, *response]), "seed": seed,
        **{k: v for k, v in enc.items() if v is not None}, "scores_fp": scores_fingerprint(enc)})


def scores_fingerprint(encoded: dict[str, str | None]) -> str:
    """sha256 over a side's encoded score arrays in `SCORES` order (an absent one as the empty string), then each of
    `EXTRA_SCORES` that is present."""
    text = "\n".join(encoded.get(k) or "" for k in SCORES)
    text += "".join(f"\n{k}:{encoded[k]}" for k in EXTRA_SCORES if encoded.get(k))
    return hashlib.sha256(text.encode()).hexdigest()


def served_lm(lm: LM, path: str, precision: str) -> LM:
    """The simulated server's model: the claimed model's settings with its folder and precision (loaded once per
    process, in place of the claimed one, `execution.models.cached_lm`)."""
    if lm.config.path == path and lm.config.precision == precision:
        return lm
    from stagereplay.execution.models import cached_lm
    from stagereplay.records.proofs import machine_store

    return cached_lm(replace(lm.config.with_precision(precision), path=path), machine_store=machine_store)


def decoded_part(lm: LM, job: Job[AttestParams]) -> AttestPayload:
    """The served response ('') or an honest variant's (a precision): read from the file, or decoded live."""
    p, dc, item = job.params, job.settings.decode, job.item
    prompt = list(item.prompt_ids)
    seed = item_seed(item, dc, p.columns, p.seed_span)
    kind: Kind = "honest" if p.which else "served"
    assert not (kind == "served" and p.source == "server"), "a server's response is asked of it (experiments.attest.served)"
    roundtrip = None
    if kind == "served" and p.source == "file":
        from stagereplay.tasks.rollouts import RolloutItem, read

        assert isinstance(item, RolloutItem)
        row = read(item, p.columns)
        response, stop, precision = list(row.response_ids), None, "file"
        import numpy as np

        logprobs = arrays.encode(np.asarray(row.logprobs, dtype=np.float32), "f32") if row.logprobs else None
        roundtrip = reencoded(lm.tokenizer, prompt) == tuple(prompt)
    else:
        if kind == "served" and p.served_model is not None:
            lm = served_lm(lm, p.served_model, p.served_precision or lm.config.precision)
        variant = variant_of(p.which) if kind == "honest" else LIVE
        if isinstance(variant, EngineVariant):
            if dc.sample:
                raise StageReplayError(f"honest variant {variant.name} serves greedy claims only",
                                       "drop it from --honest for a seeded claim")
            response, stop, decoded, precision = variant.honesty().serve(
                lm, variant.settings, prompt, max_new(item, dc), True, where=deployment(variant, p.deployments))
        else:
            response, stop, decoded = serve(lm, prompt, max_new(item, dc), dc, seed, variant, p.seeded)
            precision = lm.config.precision
        import numpy as np

        logprobs = arrays.encode(np.asarray(decoded, dtype=np.float32), "f32")
    return AttestPayload(status="ok", kind=kind, source=p.source, prompt_ids=prompt, response_ids=response,
                         tokens_fp=ids_fingerprint([*prompt, *response]), precision=precision, seed=seed,
                         stop=stop, prompt_roundtrip=roundtrip, logprobs=logprobs)


def reference_part(lm: LM, job: Job[AttestParams]) -> AttestPayload:
    """The claimed model's reference scores of the served response and every honest one (`reference_scores`)."""
    from stagereplay.engine.reference import reference_scores

    p, dc, item = job.params, job.settings.decode, job.item
    prompt = list(item.prompt_ids)
    seed = item_seed(item, dc, p.columns, p.seed_span)
    arms = [side_of(name, engine, construction, precision, prompt, response, seed,
                    reference_scores(lm, prompt, response, dc, seed=seed, seeded=p.seeded))
            for name, engine, construction, precision, response in p.sides]
    return AttestPayload(status="ok", kind="reference", source=p.source, prompt_ids=prompt, arms=arms)


def attest_item(lm: LM, job: Job[AttestParams]) -> AttestPayload:
    """One item's part (module docstring)."""
    return reference_part(lm, job) if job.params.which == REFERENCE else decoded_part(lm, job)
