"""The payloads of the paper's experiments (matched, the 2x2, bridge, transplant, resample), as frozen models with a
description on every field, built from the protocol's parts every payload with arms shares (`records.payloads`:
the arm, the comparison, the diagnostics block). docs/ledger-schema.md's tables of them are generated
(`experiments.core.payload_doc`)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from stagereplay.records.payloads import (
    Arm,
    BandDiff,
    CacheDiff,
    Comparison,
    Diagnostics,
    DiffStats,
    Divergence,
    DivergenceSide,
    Drafted,
    Draw,
    Followed,
    LayerDiff,
    LiveRequest,
    Load,
    PairDiagnostics,
    PayloadModel,
    SlotRestore,
    TopEntry,
    optional,
)

BandKind = Literal["single", "bottom", "top"]
"""A sweep band: one layer, the layers from the bottom up to one, or from one up to the top."""


class Outcome(PayloadModel):
    """What a transplanted continuation followed."""

    outcome: Followed = Field(description="whose own suffix it equals")
    divergence_from_donor: int | None = Field(description="first step it differs from the donor's suffix")
    divergence_from_recipient: int | None = Field(description="first step it differs from the recipient's suffix")


class SweepRow(PayloadModel):
    """One band of a transplant sweep: its layers, and per direction `<donor>-><recipient>`, the outcome."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, Followed] = Field(init=False)

    kind: BandKind = Field(description="one layer, a band from the bottom or from the top")
    layers: list[int] = Field(description="the layers swapped")


class LayerFingerprints(PayloadModel):
    """One layer's K and V fingerprints."""

    k: str = Field(description="sha256 of its keys (with a dtype and shape header)")
    v: str = Field(description="sha256 of its values")


class BitDifference(PayloadModel):
    """The first place two caches differ bitwise (`engine.cache.CacheDifference`)."""

    layer: int = Field(description="layer index")
    tensor: Literal["k", "v"] = Field(description="keys or values")
    position: int | None = Field(description="absolute position (null: the shapes or dtypes differ)")
    reason: str = Field(description="value, or what else differs")


LoadFinding = Literal["invariant", "batch-variant", "not self-consistent", "unknown"]
"""What a request's replicas say of a server under load (`experiments.protocol.served_matched.load_finding`)."""


class MatchedPayload(PayloadModel):
    """Matched, an item that reached its boundary: live and the fresh construction, each with a replica."""

    status: Literal["ok"] = Field(description="the item reached its stage boundary")
    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    prefix_ids: list[int] = Field(description="prompt + stage 1 through the boundary token: P")
    boundary: int = Field(description="len(P): T")
    boundary_match: Literal["text"] | None = optional("a marker matched on decoded text only")
    marker_inside_token: bool | None = optional("a marker matched on text: whether it ended inside the "
                                                "boundary token")
    answer: str = Field(description="the gold answer")
    replica_prefix_equal: bool = Field(description="whether live's replica reached the same P")
    arms: list[Arm] = Field(description="live, the construction and the replicas (a serving run: its arms)")
    comparisons: list[Comparison] = Field(description="live vs the construction, then each replica pair")
    diagnostics: Diagnostics | None = optional("why the arms diverged (records before it have none)")
    token_texts: dict[str, str] | None = optional("each token id the record shows, decoded alone (records "
                                                  "made before it have none)")
    load_finding: dict[str, LoadFinding] | None = optional("a server under load: per request (live, oneshot), "
                                                           "what its replicas say")
    stage1_top: list[list[TopEntry]] | None = optional(
        "live's stage 1: per step (the step that chose each stage-1 token), the top-2 [token id, logprob], best "
        "first, ties by id; what a divergence in stage 1 between two runs is read against (`stagereplay compare`; "
        "records made before it have none)")


class NoBoundaryPayload(PayloadModel):
    """An item whose output never reached the boundary: recorded, never dropped."""

    status: Literal["no_boundary"] = Field(description="stage 1 did not end within its budget")
    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    prefix_ids: None = optional("no prefix (null; a bridge record has no such field)")
    boundary: None = optional("no boundary (null; a bridge record has no such field)")
    generated_ids: list[int] = Field(description="what the model generated instead")
    answer: str = Field(description="the gold answer")
    arms: list[Arm] = Field(description="none")
    comparisons: list[Comparison] = Field(description="none")


class GridPayload(PayloadModel):
    """Fixed-prefix 2x2, one precision: every construction on the matched run's prefix, compared pairwise."""

    status: Literal["ok"] = Field(description="always ok: the prefix is given")
    precision: str = Field(description="the precision of this record (its part)")
    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    prefix_ids: list[int] = Field(description="the matched run's P")
    boundary: int = Field(description="len(P)")
    answer: str = Field(description="the gold answer")
    arms: list[Arm] = Field(description="one per construction, `<construction>@<precision>`")
    comparisons: list[Comparison] = Field(description="every pair of arms, in arm order")
    diagnostics: Diagnostics | None = optional("why the arms diverged (records before it have none)")
    token_texts: dict[str, str] | None = optional("each token id the record shows, decoded alone (records "
                                                  "made before it have none)")


class BridgePayload(PayloadModel):
    """Bridge: the incremental construction's cache against live's, bitwise, layer by layer."""

    status: Literal["ok"] = Field(description="live reached its boundary")
    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    prefix_ids: list[int] = Field(description="live's P")
    boundary: int = Field(description="len(P)")
    answer: str = Field(description="the gold answer")
    prefix_matches_matched_run: bool = Field(description="whether live reached the matched run's P again")
    cache_equal: bool = Field(description="whether the two caches are the same bytes")
    differences: list[BitDifference] = Field(description="the first bitwise difference (empty: none)")
    layers: dict[str, list[LayerFingerprints]] = Field(description="per arm (live, incremental), per layer")
    arms: list[Arm] = Field(description="live and incremental")
    comparisons: list[Comparison] = Field(description="live vs incremental")
    diagnostics: Diagnostics | None = optional("why the arms diverged (records before it have none)")


class TransplantPayload(PayloadModel):
    """Transplant: K/V swapped between live's and the fresh construction's boundary states, both ways."""

    status: Literal["ok"] = Field(description="live reached the matched run's prefix again")
    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    prefix_ids: list[int] = Field(description="P")
    boundary: int = Field(description="len(P)")
    answer: str = Field(description="the gold answer")
    baseline_diverges: bool = Field(description="whether live's and the fresh construction's own suffixes differ")
    directions: dict[str, Outcome] = Field(description="per direction `<donor>-><recipient>`, the transplant's "
                                                       "outcome")
    control: dict[str, Outcome] = Field(description="the same with no layer swapped (the control)")
    arms: list[Arm] = Field(description="live, the fresh construction, then each direction's and control's arm")
    comparisons: list[Comparison] = Field(description="none: outcomes say it")
    sweep: list[SweepRow] | None = optional("--sweep: every single layer, bottom and top band")


class PrefixNotReproducedPayload(PayloadModel):
    """Transplant, an item whose live run no longer reaches the matched run's prefix: nothing to swap."""

    status: Literal["prefix_not_reproduced"] = Field(description="live generation did not reach the recorded P")
    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    answer: str = Field(description="the gold answer")
    arms: list[Arm] = Field(description="none")
    comparisons: list[Comparison] = Field(description="none")


class ResamplePayload(PayloadModel):
    """Resample, one precision: K seeded draws per boundary state and seed stream."""

    status: Literal["ok", "not_reproduced"] = Field(description="ok, or live no longer reaches the prefix")
    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    prefix_ids: list[int] = Field(description="the matched run's P")
    boundary: int | None = Field(description="len(P) (null: not reproduced)")
    answer: str = Field(description="the gold answer")
    live_source: str = Field(description="what stands for live: live (live generation) or incremental (at another "
                                         "precision than the matched run's)")
    arms: list[Draw] = Field(description="the draws, in `resample.draw_names` order (none: not reproduced)")
    comparisons: list[Comparison] = Field(description="none: the summary compares draws")


MODELS: tuple[type[PayloadModel], ...] = (
    MatchedPayload, NoBoundaryPayload, GridPayload, BridgePayload, TransplantPayload, PrefixNotReproducedPayload,
    ResamplePayload, Arm, Draw, Comparison, Diagnostics, PairDiagnostics, Divergence, DivergenceSide, CacheDiff,
    LayerDiff, BandDiff, DiffStats, Outcome, SweepRow, BitDifference, LayerFingerprints, LiveRequest, SlotRestore,
    Load, Drafted)
"""Every model of the protocol's payloads, its parts included, in the order docs/ledger-schema.md shows them."""
