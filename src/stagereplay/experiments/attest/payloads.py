"""What an attest record's payload holds (`experiments.attest`): the served response and the claimed model's honest
responses to the same prompt, and the reference's per-token scores of each (`engine.reference`), every array encoded
(`records.arrays`).

    part ""           the served response: read from a file of served outputs, asked of a running server (with the
                      server's log-probabilities where it gives them), or decoded here by a stated served setting (a
                      simulation of a server)
    part <variant>    an honest variant (experiments.attest.variants): the claimed model decoded at a precision
                      (bf16, fp16, fp32) from a live cache (the part is the precision), a chunked prefill
                      (bf16/chunked:16), a reused prefix (bf16/prefix:16), or as one of concurrent requests
                      (bf16/batched:4)
    part reference    the claimed model's one-shot reference, scoring the served response and every honest one
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stagereplay.records.payloads import PayloadModel, optional

Kind = Literal["served", "honest", "reference"]
Source = Literal["generated", "file", "server"]


class AttestSide(PayloadModel):
    """One response (the served one, or an honest variant's) scored by the claimed model's reference, per token."""

    name: str = Field(description="served, or honest@<variant> (bf16, bf16/chunked:16, ...)")
    engine: str = Field(description="who produced the response: hf (ours), file (a file of served outputs), or the "
                              "serving engine that served it (http: a running server)")
    construction: str = Field(description="live (decoded from a retained cache) | chunked:<n> | prefix:<b> | "
                                          "batched:<r> (an honest variant's) | file")
    precision: str = Field(description="the precision it was decoded at ('file' for a file's; a server's: its model's "
                                       "type as it says it)")
    response_ids: list[int] = Field(description="the response's token IDs")
    tokens_fp: str = Field(description="sha256 of prompt + response token IDs")
    seed: int | None = Field(description="the per-request seed the claimed sampler drew with (null: greedy claim)")
    logprobs: str = Field(description="per token, the reference's log-softmax of it: f32:<base64>")
    margin: str = Field(description="per token, the reference's max logit minus the token's (0 on a match): f32")
    match: str = Field(description="per token, 1 where it is the reference's argmax: i32")
    logit_rank: str = Field(description="per token, how many tokens have a larger reference logit: i32")
    prob: str = Field(description="per token, its probability under the claimed sampler: f32")
    gumbel_match: str | None = optional("a seeded sampled claim: per token, 1 where vLLM's sampler replayed picks it")
    gumbel_margin: str | None = optional("a seeded sampled claim: per token, the Gumbel-max margin (inf: removed)")
    argmax: str | None = optional("per token, the reference's own greedy pick (its argmax): i32")
    scores_fp: str = Field(description="sha256 over the encoded score arrays, in field order")


class AttestPayload(PayloadModel):
    """Attest, one item and part."""

    status: Literal["ok"] = Field(description="done")
    kind: Kind = Field(description="served (part ''), honest (part <variant>) or reference (part reference)")
    source: Source = Field(description="where the served response came from: generated (a simulated server), file, "
                                       "or server (asked of a running server)")
    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    response_ids: list[int] | None = optional("served and honest parts: the response's token IDs")
    tokens_fp: str | None = optional("served and honest parts: sha256 of prompt + response token IDs")
    precision: str | None = optional("served and honest parts: the precision it was decoded at ('file' for a file; "
                                     "a server's model type as it says it)")
    seed: int | None = optional("served and honest parts: the per-request seed of a sampled claim")
    stop: str | None = optional("a decoded or server's response: eos or length")
    prompt_roundtrip: bool | None = optional("a file's served part: whether the claimed tokenizer encodes the "
                                             "prompt's text back to the same IDs (false: a prompt it would not make)")
    logprobs: str | None = optional("a decoded or server's response: per token, the log-probability its decoder gave "
                                    "it (its raw distribution, log-softmax of its logits): f32; a server's where it "
                                    "gave one for every token")
    arms: list[AttestSide] = Field(default_factory=list, description="part reference: the served response and each "
                                   "honest one, scored (absent elsewhere)")


MODELS = (AttestPayload, AttestSide)
"""The attest payload's models, in the order docs/ledger-schema.md shows them."""
