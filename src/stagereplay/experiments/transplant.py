"""Transplant: swap K/V between the live and the fresh boundary states of a divergent item, both directions.

Direction names read `<donor>-><recipient>`. An outcome is `donor` when the transplanted continuation equals the
donor's own suffix, `recipient` when it equals the recipient's, `neither` otherwise. The selection rule and the
selected items are frozen in the manifest before the first transplant runs: that keeps a replication outcome-blind.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from stagereplay.engine.forwards import Lengths, construct_forwards, continuation_forwards, live_forwards
from stagereplay.engine.lm import LM, BoundaryState, Continuation, NoBoundary
from stagereplay.engine.model import ModelConfig
from stagereplay.engine.transplant import TransplantSpec, parse_layers, parse_positions, transplant
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.arms import arm_record, carried_arm, matched_arms
from stagereplay.experiments.jobs import Job, ReplaySettings, execute
from stagereplay.records.ledger import Record, Run
from stagereplay.records.payloads import (
    Arm,
    BandKind,
    Followed,
    Outcome,
    PrefixNotReproducedPayload,
    SweepRow,
    TransplantPayload,
)
from stagereplay.report.stats import first_divergence
from stagereplay.tasks.base import Item

EXPERIMENT = "transplant"
PAYLOAD: TypeAdapter[TransplantPayload | PrefixNotReproducedPayload] = TypeAdapter(
    Annotated[TransplantPayload | PrefixNotReproducedPayload, Field(discriminator="status")])
"""A transplant record's payload (`records.payloads`): live reached the matched prefix again, or not."""


@dataclass(frozen=True)
class TransplantConfig:
    """What to swap and for which items."""

    construction: str = field(default="oneshot", metadata={"help": "the fresh arm (as in the matched run)"})
    layers: str = field(default="all", metadata={"help": "all | none | A-B,C,..."})
    kv: str = field(default="kv", metadata={"help": "k | v | kv"})
    positions: str | None = field(default=None, metadata={"help": "A:B sequence positions (half-open)"})
    select: str = field(default="all-divergent", metadata={"help": "all-divergent | first:K | random:K:SEED"})
    sweep: bool = field(default=False, metadata={"help": "also every single layer and bottom/top band"})

    def __post_init__(self) -> None:
        if self.kv not in ("k", "v", "kv"):
            raise StageReplayError(f"unknown --kv {self.kv!r}", "use k, v or kv")
        parse_selection(self.select)
        try:  # the syntax here (any layer count will do); the range against the model in `check_layers`
            parse_layers(self.layers if self.layers not in ("all", "none") else "0", 1 << 30)
        except StageReplayError:
            raise StageReplayError(f"bad --layers {self.layers!r}", "use all, none, or low-high bands, e.g. 0-3,10") from None
        if self.positions is not None:
            start, stop = parse_positions(self.positions, 1 << 30)  # a slice's bounds, nothing allocated
            if start >= stop:
                raise StageReplayError(f"--positions {self.positions!r} selects no position",
                                       "use A:B with A < B, e.g. 0:64")

    def check_layers(self, n_layers: int) -> None:
        """The layers exist in a model of `n_layers` layers (checked before any run directory changes)."""
        parse_layers(self.layers, n_layers)


def parse_selection(rule: str) -> tuple[str, int, int]:
    parts = rule.split(":")
    if parts == ["all-divergent"]:
        return "all", 0, 0
    if parts[0] == "first" and len(parts) == 2 and parts[1].isdigit() and int(parts[1]) > 0:
        return "first", int(parts[1]), 0
    if (parts[0] == "random" and len(parts) == 3 and parts[1].isdigit() and int(parts[1]) > 0
            and parts[2].lstrip("-").isdigit()):
        return "random", int(parts[1]), int(parts[2])
    raise StageReplayError(f"unknown --select {rule!r}", "use all-divergent, first:K or random:K:SEED with K >= 1")


def select(divergent: list[str], rule: str) -> list[str]:
    """Apply a selection rule to divergent item ids (in ledger order); seeded, so it can be frozen up front."""
    kind, k, seed = parse_selection(rule)
    if kind == "all":
        return list(divergent)
    if kind == "first":
        return divergent[:k]
    chosen = set(random.Random(seed).sample(divergent, min(k, len(divergent))))
    return [i for i in divergent if i in chosen]


def sweep_bands(n_layers: int) -> list[tuple[BandKind, tuple[int, ...]]]:
    """Every single layer, every band from the bottom (0..k) and every band from the top (k..L-1)."""
    bands: list[tuple[BandKind, tuple[int, ...]]] = [("single", (i,)) for i in range(n_layers)]
    bands += [("bottom", tuple(range(k + 1))) for k in range(n_layers)]
    bands += [("top", tuple(range(k, n_layers))) for k in range(n_layers)]
    return bands


def followed(suffix: tuple[int, ...], donor: tuple[int, ...], recipient: tuple[int, ...]) -> Outcome:
    """Whose own suffix a transplanted continuation `suffix` equals, and where it leaves each."""
    which: Followed = "donor" if suffix == donor else "recipient" if suffix == recipient else "neither"
    return Outcome(outcome=which, divergence_from_donor=first_divergence(suffix, donor),
                   divergence_from_recipient=first_divergence(suffix, recipient))


def outcome(suffix: tuple[int, ...], donor: tuple[int, ...], recipient: tuple[int, ...]) -> dict[str, Any]:
    """`followed`, as the record holds it."""
    return followed(suffix, donor, recipient).as_payload()


def _swap(lm: LM, recipient: BoundaryState, donor: BoundaryState, spec: TransplantSpec, job: Job
          ) -> tuple[BoundaryState, Continuation]:
    cache = transplant(recipient.cache, donor.cache, spec)
    state = BoundaryState(recipient.prefix, recipient.prompt_len, "transplant", cache, recipient.seed)
    return state, lm.continue_from(state, job.settings.decode, keep_steps=False)  # no diagnostics read steps


def transplant_item(lm: LM, job: Job) -> dict[str, Any]:
    """Live and the fresh construction with their own suffixes, then the transplants both ways (and the
    zero-layer control). With `reuse` (`reused_arms`), an own suffix the matched run already decoded from the same
    cache is not decoded again: the boundary cache built here must be the recorded arm's bit for bit (its
    fingerprint), and the arm is then the matched record's, marked `same_as`."""
    item, s = job.item, job.settings
    cfg = TransplantConfig(**dict(job.get("config")))
    reuse = {name: (source, arm) for name, source, arm in job.get("reuse") or ()}
    try:
        live = lm.live(item, s.rule(), s.decode, keep_going="live" not in reuse, keep_steps=False)
    except NoBoundary:
        live = None
    if live is None or list(live.prefix) != list(job.get("prefix")):
        # The live run no longer reaches the recorded prefix: transplant between the recorded token states instead.
        live = None
    if live is None:
        return PrefixNotReproducedPayload(status="prefix_not_reproduced", prompt_ids=list(item.prompt_ids),
                                          answer=item.answer, arms=[], comparisons=[]).as_payload()
    fresh = lm.construct(live, cfg.construction)
    states = {"live": live, cfg.construction: fresh}
    own: dict[str, Continuation] = {}
    arms: list[Arm] = []
    for name, state in states.items():
        fp = state.fingerprint()
        if name in reuse and reuse[name][1]["cache_fp"] == fp:
            source, recorded = reuse[name]
            own[name] = Continuation(tuple(recorded["suffix_ids"]), recorded["stop"])
            arms.append(carried_arm(recorded, name, state.construction, source))
            continue
        if name == "live":  # the uninterrupted loop's own suffix (its cache was the snapshot's, bit for bit)
            suffix = live.live_suffix if live.live_suffix is not None else lm.continue_from(live, s.decode,
                                                                                              keep_steps=False)
        else:
            suffix = lm.continue_from(state, s.decode, keep_steps=False)
        own[name] = suffix
        arms.append(arm_record(lm, name, state, suffix, live.stage1, item, s.scorer, cache_fp=fp))
    positions = parse_positions(cfg.positions, len(live.prefix) - 1) if cfg.positions else None
    pairs = [("live", cfg.construction), (cfg.construction, "live")]  # (donor, recipient)

    def run_spec(layers: tuple[int, ...], arm_prefix: str | None) -> dict[str, Outcome]:
        """Outcome per direction; the continuations become arms when `arm_prefix` is given (not for sweeps)."""
        out = {}
        for d, r in pairs:
            state, cont = _swap(lm, states[r], states[d], TransplantSpec(layers, cfg.kv, positions), job)
            out[f"{d}->{r}"] = followed(cont.suffix, own[d].suffix, own[r].suffix)
            if arm_prefix is not None:
                arms.append(arm_record(lm, f"{arm_prefix}{d}->{r}", state, cont, live.stage1, item, s.scorer))
            del state  # before the next direction's transplant: at most four caches alive (README)
        return out

    directions, control = run_spec(parse_layers(cfg.layers, lm.n_layers), ""), run_spec((), "control:")
    sweep = [SweepRow(kind=kind, layers=list(layers), **{k: v.outcome for k, v in run_spec(layers, None).items()})
             for kind, layers in sweep_bands(lm.n_layers)] if cfg.sweep else None
    return TransplantPayload(
        status="ok", prompt_ids=list(item.prompt_ids), prefix_ids=list(live.prefix), boundary=len(live.prefix),
        answer=item.answer, baseline_diverges=own["live"].suffix != own[cfg.construction].suffix,
        directions=directions, control=control, arms=arms, comparisons=[],
        **({"sweep": sweep} if sweep is not None else {}),  # absent without --sweep
    ).as_payload()


def forwards(n: Lengths, cfg: TransplantConfig, n_layers: int) -> list[int]:
    """The forwards `transplant_item` makes for an item of lengths `n`: live with its suffix, the fresh
    construction with its own (neither suffix where it is carried over from matched: `n.looks`), then one
    continuation per direction (transplant and control) and, with a sweep, per direction of each of the
    3 x `n_layers` bands (sweep continuations are not recorded: `n.suffix`)."""
    c, carried = cfg.construction, dict(n.looks)
    out = live_forwards(n.prompt, n.stage1 or 0, None if "live" in carried else n.of("live"))
    out += construct_forwards(c, n.prompt, n.prefix)
    out += continuation_forwards(carried.get(c, n.of(c)))
    for arm in (f"{p}{d}->{r}" for p in ("", "control:") for d, r in (("live", c), (c, "live"))):
        out += continuation_forwards(n.of(arm))
    if cfg.sweep:
        out += continuation_forwards(n.suffix) * (2 * len(sweep_bands(n_layers)))
    return out


def reused_arms(stage: dict[str, Any], matched_stage: dict[str, Any] | None, matched: dict[str, Any] | None,
                checkpoint: str) -> tuple[tuple[str, str, dict[str, Any]], ...]:
    """(arm, `matched/<checkpoint>:<arm>`, that arm) for the transplant's own arms that the matched record of the
    item already decoded: live, and the fresh construction when it is the matched run's, on the same model at the
    same precision with the same settings. Empty when anything differs."""
    arms = matched_arms(stage, matched_stage, matched)
    if not arms:
        return ()
    assert matched_stage is not None
    names = ["live"] + ([stage["config"]["construction"]]
                        if stage["config"]["construction"] == matched_stage["construction"] else [])
    return tuple((name, f"matched/{checkpoint}:{name}", arms[name]) for name in names if name in arms)


def divergent_ids(matched: list[Record], construction: str) -> list[str]:
    """The matched records (in ledger order) whose live and fresh suffixes differ: what a selection picks from."""
    out = []
    for r in matched:
        p = r.payload
        if p["status"] != "ok":
            continue
        main = next((c for c in p["comparisons"] if c["a"] == "live" and c["b"] == construction), None)
        if main is not None and not main["suffix_equal"]:
            out.append(r.item_id)
    return out


def divergent_items(run: Run, checkpoint: str, construction: str) -> list[tuple[Item, list[int]]]:
    matched = run.find("matched", checkpoint)
    divergent = set(divergent_ids(matched, construction))
    return [(Item(r.item_id, tuple(r.payload["prompt_ids"]), r.payload["answer"]), r.payload["prefix_ids"])
            for r in matched if r.item_id in divergent]


def check_selection(model: ModelConfig, cfg: TransplantConfig, prefixes: list[list[int]]) -> None:
    """Before the stage is frozen: `--layers` is valid and `--positions` lies inside a selected layer's cache
    for every selected item (sliding-window layers hold only their last window - 1 positions)."""
    from pathlib import Path

    from stagereplay.engine.cache import layer_windows
    from stagereplay.engine.model import load_checked_config
    from stagereplay.engine.transplant import check_positions, held_spans

    windows = layer_windows(load_checked_config(Path(model.path)))
    layers = parse_layers(cfg.layers, len(windows))
    if cfg.positions is None:
        return
    for prefix in prefixes:
        length = len(prefix) - 1
        check_positions(parse_positions(cfg.positions, length), layers, held_spans(windows, length))


def run_transplant(run: Run, model: ModelConfig, settings: ReplaySettings, checkpoint: str, cfg: TransplantConfig,
                   ex: ExecConfig, quiet: bool = False) -> None:
    candidates = divergent_items(run, checkpoint, cfg.construction)
    chosen = set(select([i.id for i, _ in candidates], cfg.select))
    check_selection(model, cfg, [prefix for item, prefix in candidates if item.id in chosen])
    # Frozen before any transplant outcome exists: the rule and the items it picked.
    run.begin_stage(f"{EXPERIMENT}/{checkpoint}", {"model": model.as_dict(), "settings": settings.as_dict(),
                                                  "config": asdict(cfg), "selected": sorted(chosen)})
    stage = run.manifest["stages"][f"{EXPERIMENT}/{checkpoint}"]  # as JSON gives it back, as the audit reads it
    matched_stage = run.manifest.get("stages", {}).get(f"matched/{checkpoint}")
    matched = {r.item_id: r.payload for r in run.find("matched", checkpoint)}
    jobs = [Job(item, settings, extra=(("prefix", prefix), ("config", tuple(asdict(cfg).items())),
                                       ("reuse", reused_arms(stage, matched_stage, matched.get(item.id), checkpoint))))
            for item, prefix in candidates if item.id in chosen]
    execute(run, EXPERIMENT, checkpoint, model, transplant_item, jobs, ex, None, quiet)
