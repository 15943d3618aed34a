"""What an item record's payload holds: the arm, the comparison, the diagnostics block and each experiment's
payload, as frozen models with a description on every field (`records.record.Record` is the envelope).

A record's payload is read back as a dict (`Record.payload`); the experiments build these models and turn each into
that dict in one place, `PayloadModel.as_payload`. A field left unset is absent from the record (an arm that is not
`retokenized` has no `roundtrip`); a field set to None is written as null (a serving arm's `cache_fp`). So a model
writes the bytes the dict it replaced wrote, and reads every older record back: the fields records of an earlier
version lack are optional. A record is read back as its model: by its experiment's `PAYLOAD`, or as
`records.payload_readers` reads any record.

docs/ledger-schema.md's tables of these models are generated from them (`experiments.core.payload_doc`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

TopEntry = Annotated[tuple[int, float | None], Strict(False)]
"""One candidate of a step: [token id, logit or logprob], as a JSON pair (the pair is read from a list)."""


def optional(description: str) -> Any:
    """A field only some records have: absent from the record unless set (`PayloadModel.as_payload`)."""
    return Field(default=None, description=description)


class PayloadModel(BaseModel):
    """A part of an item record's payload: frozen, no field it does not declare, no type coerced."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    def as_payload(self) -> dict[str, Any]:
        """The dict the record holds: JSON types, the fields that were set (None included), nothing else."""
        return self.model_dump(mode="json", exclude_unset=True)


# -- an arm and a comparison ---------------------------------------------------------------------------------


class LiveRequest(PayloadModel):
    """What a serving engine's live request asked for (`serving.live`)."""

    max_tokens: int = Field(description="tokens the request that reached the boundary asked for")
    tries: int = Field(description="requests it took, each asking for more stage-1 tokens")


class SlotRestore(PayloadModel):
    """A server's slot saved after live and restored into another slot (llama-server's `/slots`)."""

    slots: list[int] = Field(description="the slot saved from, then the slot restored into")
    saved: int | None = Field(description="positions the server says it saved (null: it did not say)")
    restored: int | None = Field(description="positions the server says it restored (null: it did not say)")
    live_equal: bool = Field(description="whether live, run again to fill the saved slot, gave live's tokens")
    live_max_tokens: int = Field(description="tokens that live request asked for")


class Load(PayloadModel):
    """What an under-load arm's request met: the server's other traffic while it ran (`serving.http`)."""

    concurrency: int = Field(description="other requests kept in flight around it")
    in_flight_at_send: int = Field(description="other requests in flight when it was sent")
    returned_meanwhile: int = Field(description="other requests that returned while it ran")
    prefix_equal: bool | None = optional("live@load only: whether its stage 1 is live's")


class Drafted(PayloadModel):
    """What a serving engine's speculative decoding did in an arm's request, as the engine counted it
    (llama-server's `timings.draft_n` and `draft_n_accepted`; vLLM's speculation counters over the request)."""

    drafted: int = Field(description="tokens the drafter proposed over the whole request (a live request's stage 1 "
                                     "included)")
    accepted: int = Field(description="tokens of those the model accepted")


class GeneratedBy(PayloadModel):
    """How transformers' generate() built a live arm (`engine.generated`)."""

    speculate: str | None = optional("the speculation method: prompt-lookup:N, draft:PATH or self")
    cache: str | None = optional("the quantized cache: quanto:BITS, hqq:BITS or fp8")
    added: list[int] = Field(description="tokens each generate() step added: more than one where candidates were "
                                         "accepted (each step is one forward of the model)")


class _Continued(PayloadModel):
    """What every continuation from a boundary state records."""

    name: str = Field(description="the arm's name in its record: its construction, `#replica` for a replica, "
                                  "`@<precision>` in a 2x2, `<donor>-><recipient>` for a transplant")
    construction: str = Field(description="how its boundary state was built: live | incremental | oneshot | "
                                          "chunked:<n> | retokenized | transplant | a serving engine's arm")
    precision: str = Field(description="the precision it ran at")
    suffix_ids: list[int] = Field(description="the token IDs decoded after the boundary (the suffix)")
    suffix_fp: str = Field(description="sha256 of the suffix IDs as little-endian int64")
    cache_fp: str | None = Field(description="sha256 of the boundary state's K/V cache (null: the engine exposes "
                                             "no cache)")
    stop: str = Field(description="why decoding stopped: eos (an EOS token) or length (max_new_tokens)")
    correct: bool = Field(description="the scorer's label of stage 1 + suffix against the gold answer")


class Arm(_Continued):
    """One arm of an item: a boundary state and its continuation, on our engine or a serving engine."""

    text: str = Field(description="stage 1 + suffix decoded: what the scorer read")
    roundtrip: bool | None = optional("retokenized only: whether decode then encode gave the prefix's IDs back")
    same_as: str | None = optional("`<stage>:<arm>` of the recorded arm this one carries over, not decoded again: "
                                   "every field but name and construction is that arm's")
    engine: str | None = optional("serving run: the engine that built it (vllm, llama.cpp, http; hf for ours)")
    top_logprobs: list[list[TopEntry]] | None = optional(
        "serving run: per suffix step, the top-k [token id, logprob], best first, ties by id")
    num_cached_tokens: int | None = optional("serving run: prompt positions the engine's prefix cache supplied "
                                             "(null: the engine does not say)")
    cached_from_decode: int | None = optional("prefix-cache arm: cached positions past the prompt, written by "
                                              "live's decode steps")
    took_place: bool | None = optional("serving run: whether the engine's counts say the state was built as the "
                                       "construction says (null: nothing says)")
    request: LiveRequest | None = optional("live arms of a serving run: what the request asked for")
    slot: SlotRestore | None = optional("slot-restore arms: the slot saved and restored")
    load: Load | None = optional("under-load arms: the traffic the request met")
    restored_positions: int | None = optional("restore arms (llama.cpp): positions the restored state holds")
    draft: Drafted | None = optional("serving run: what the engine's speculative decoding drafted and accepted in "
                                     "the arm's request (absent: it did not speculate, or does not say)")
    generated: GeneratedBy | None = optional("a live arm built by transformers' generate() with an option (a "
                                             "speculation method, a quantized cache): which, and what each step added")
    live_prefix_equal: bool | None = optional("a serving 2x2's prefix-cache arm: whether live at this precision "
                                              "generated the fixed prefix's stage 1")


class Draw(_Continued):
    """One seeded draw of resample: an arm sampled from one boundary state with one seed."""

    state: str = Field(description="the boundary state drawn from: live, live#replica or the fresh construction")
    stream: str = Field(description="seed stream: A (seeds shared across states: coupled), B or C (independent)")
    draw: int = Field(description="index j of the draw within its state and stream")
    seed: int = Field(description="the draw's sampling seed (`resample.draw_seed`)")
    answer: str | None = Field(description="the answer the scorer reads in stage 1 + suffix (null: none found)")


class Comparison(PayloadModel):
    """Two arms of an item side by side (`experiments.protocol.arms.comparison`)."""

    a: str = Field(description="the first arm's name")
    b: str = Field(description="the second arm's name")
    suffix_equal: bool = Field(description="whether the two suffixes are the same tokens")
    cache_equal: bool | None = Field(description="whether the two boundary caches are the same bytes (null: an arm "
                                                 "has no cache fingerprint, or the arms are two engines')")
    label_equal: bool = Field(description="whether the two correctness labels agree")
    first_divergence: int | None = Field(description="the first suffix step where the tokens differ (null: none)")
    fp: str = Field(description="sha256 over the item, both arms' names, suffix and cache fingerprints and labels, "
                                "and the fields above")


# -- the diagnostics block -------------------------------------------------------------------------------------


class DiffStats(PayloadModel):
    """How far one tensor is from its reference (`engine.diagnostics.cache_difference`)."""

    maxabs: float | None = Field(description="max |a - b| (null: not finite)")
    rel_l2: float | None = Field(description="||a - b|| / ||a|| (null: not finite)")
    n_diff: int = Field(description="elements whose bits differ")


class LayerDiff(PayloadModel):
    """One layer's cache difference."""

    layer: int = Field(description="layer index")
    k: DiffStats = Field(description="its keys")
    v: DiffStats = Field(description="its values")


class BandDiff(PayloadModel):
    """One position band's cache difference, over every layer."""

    band: str = Field(description="prompt, s1.q1 .. s1.q4 (stage 1 in quartiles) or last16")
    start: int = Field(description="first absolute position of the band")
    end: int = Field(description="absolute position after its last")
    k: DiffStats = Field(description="the keys of its positions")
    v: DiffStats = Field(description="the values of its positions")


class CacheDiff(PayloadModel):
    """How far the second arm's boundary cache is from the first's."""

    layers: list[LayerDiff] = Field(description="per layer")
    bands: list[BandDiff] = Field(description="per position band (empty bands left out)")


class DivergenceSide(PayloadModel):
    """One arm's logits at the first divergent step."""

    margin: float | None = Field(description="top-1 minus top-2 logit (null: one candidate, or not finite)")
    top: list[TopEntry] = Field(description="the top-5 [token id, logit], best first, ties by id")


class Divergence(PayloadModel):
    """Both arms at the first step where their tokens differ."""

    step: int = Field(description="the first divergent suffix step")
    logit_maxabs: float | None = Field(description="max |logit a - logit b| there (null: a serving engine's arms)")
    a: DivergenceSide = Field(description="the first arm there")
    b: DivergenceSide = Field(description="the second arm there")


class PairDiagnostics(PayloadModel):
    """Why two compared arms diverged, or how close they stayed."""

    first_step_logit_maxabs: float | None = Field(
        description="max |logit a - logit b| at the first suffix step (null: no logits, or a serving engine's)")
    divergence: Divergence | None = Field(description="the first divergent step (null: none, or an arm stopped "
                                                      "before it)")
    cache: CacheDiff | None = Field(description="the boundary caches' difference (null: not computed for this pair, "
                                                "or the caches differ in shape)")


class Diagnostics(PayloadModel):
    """The diagnostics block (`experiments.protocol.diagnose`): re-derived field by field by the audit."""

    margins: dict[str, list[float | None]] = Field(description="per arm, top-1 minus top-2 logit at each step")
    pairs: dict[str, PairDiagnostics] = Field(description="per compared pair, keyed `<a> vs <b>`")


# -- each experiment's payload -------------------------------------------------------------------------------


Followed = Literal["donor", "recipient", "neither"]
"""Whose own suffix a transplanted continuation equals: the donor's, the recipient's, neither."""
def read_arm(raw: Mapping[str, Any]) -> Arm | Draw:
    """A recorded arm as its model: a draw when it names the state it was drawn from, else an arm. Raises
    pydantic's ValidationError when it is neither (`first_error` says where)."""
    return Draw.model_validate(raw) if "state" in raw else Arm.model_validate(raw)


def first_error(exc: ValidationError) -> str:
    """`field.path: message` of a validation error's first problem."""
    first = exc.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"

