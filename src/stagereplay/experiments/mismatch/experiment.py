"""Mismatch: the training-inference mismatch of reinforcement learning, measured the paper's way.

An RL framework samples a response with an inference engine (decoding from a retained cache) and recomputes each
token's log-probability in the trainer (one forward over prompt + response: a one-shot prefill of the same token
IDs). Per item, on the same tokens:

    rollout           the response generated here (greedy, or sampled with the run's settings and a derived seed),
                      each token's log-probability recorded as it was drawn; or read from a rollout file
    rollout#replica   generated again from scratch: the same tokens and bits, or the engine is not deterministic
    incremental       ours, teacher-forced one token per forward: the live loop's operations (the bridge)
    prefill           the rollout engine's own one-shot prefill of prompt + response (ours: one forward, no cache);
    prefill#replica   none for a rollout file audited on ours: its engine is not here, and ours is the trainer
    trainer@<p>       ours, one-shot, at each trainer precision p (bf16, fp32, fp16, bf16-fp32-head: bf16 with the
                      LM head in fp32), each with its replica: one record part per precision
    trainer@<p>#batch with --micro-batch N: the same tokens scored inside a trainer's micro-batch of N sequences,
                      padded or packed (`experiments.mismatch.item.MicroBatch`), in the precision's part

and on our engine, the paper's causal test: at position t the two caches (built as decoding builds it, and by one
forward) swap their K/V, both directions, and each continues teacher-forced; a continuation follows the donor when
its log-probabilities are the donor's own, bit for bit (the zero-layer control must follow the recipient).

The summary splits the gap: total (rollout vs trainer), construction (rollout vs the engine's own prefill), engine
(the engine's prefill vs the trainer's, both one-shot), precision (trainer bf16 vs fp32 and the rest), batch
composition (the trainer's sequence alone vs in a micro-batch), and each side's replica, with the metrics RL
frameworks read (`experiments.mismatch.stats`, under verl's names).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, TypeAdapter

from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import ids_fingerprint
from stagereplay.engine.model import ModelConfig
from stagereplay.engine.scoring import Scored
from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.experiment import (
    Assumed,
    Batch,
    Planned,
    Replay,
    SmallRun,
)
from stagereplay.experiments.core.figures import ReportFigure
from stagereplay.experiments.core.format import Table
from stagereplay.experiments.core.jobs import Job, ReplaySettings
from stagereplay.experiments.core.response import ResponseExperiment
from stagereplay.experiments.core.served import Served
from stagereplay.experiments.core.shape import RESPONSES, Shape
from stagereplay.experiments.core.verdict import Fact
from stagereplay.experiments.mismatch.item import MismatchParams, mismatch_item, outcome, row_decode
from stagereplay.experiments.mismatch.payloads import MODELS, MismatchPayload
from stagereplay.experiments.mismatch.served import ServedMismatch
from stagereplay.experiments.mismatch.stage import EXPERIMENT, MismatchOptions, MismatchStage
from stagereplay.experiments.mismatch.summary import MismatchSummary
from stagereplay.records import arrays
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import ModelSection, RunConfig, StageSection
from stagereplay.records.payloads import PayloadModel

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM
    from stagereplay.experiments.core.compared import RunComparison
    from stagereplay.experiments.core.prepared import PreparedRun
    from stagereplay.records.differences import Differences

PAYLOAD: TypeAdapter[MismatchPayload] = TypeAdapter(MismatchPayload)


def trainer_model(model: ModelConfig, precision: str) -> ModelConfig:
    """The model a trainer precision loads: bf16's for bf16 with an fp32 head."""
    return model.with_precision("bf16" if precision == "bf16-fp32-head" else precision)


def _micro_batch(options: MismatchOptions) -> dict[str, Any]:
    """The micro-batch fields of the stage and the run's identity: none unless asked for."""
    return ({"micro_batch": options.micro_batch, "micro_batch_layout": options.micro_batch_layout}
            if options.micro_batch else {})


def main_records(run: Run, checkpoint: str) -> dict[str, MismatchPayload]:
    """The part-'' records at `checkpoint`, by item id: the tokens the trainer parts score."""
    return {r.item_id: PAYLOAD.validate_python(r.payload) for r in run.find(EXPERIMENT, checkpoint) if not r.part}


class Mismatch(ResponseExperiment[MismatchOptions, MismatchStage, MismatchPayload, MismatchSummary]):
    """Rollout vs trainer: the log-probability each side gives the same response tokens, where the gap comes from,
    and whether the cache carries it."""

    payload: ClassVar[TypeAdapter[Any]] = PAYLOAD
    payload_models: ClassVar[tuple[type[BaseModel], ...]] = MODELS
    served: ClassVar[type[Served] | None] = ServedMismatch
    name: ClassVar[str] = EXPERIMENT
    Stage: ClassVar[type[StageSection]] = MismatchStage
    Summary: ClassVar[type[BaseModel]] = MismatchSummary
    Options: ClassVar[type] = MismatchOptions
    shape: ClassVar[Shape] = RESPONSES.labelled("mismatch")
    responses: ClassVar[str] = "rollouts"
    smallest_run: ClassVar[SmallRun | None] = SmallRun(("--n", "2", "--max-new-tokens", "6", "--precisions",
                                                        "bf16,fp32"))
    helps: ClassVar[dict[str, str]] = {
        "decode.max_new_tokens": "response length limit: tokens each rollout generates after its prompt",
        "decode.sample": "sample each rollout (seeded) instead of decoding it greedily",
        "decode.seed": "base seed; each item's rollout derives its own",
        "input.data": ("prompts to roll out: a JSONL, JSON, CSV or Parquet file, a datasets.save_to_disk folder, or "
                       "hf:NAME[:CONFIG][:SPLIT] (default: the toy task's held-out items); a rollout file: --rollouts"),
        "input.columns": ("map the data's fields: TARGET=COLUMN,... With --rollouts, TARGET prompt_ids, response_ids, "
                          "logprobs, id, temperature, top_p, top_k or seed; with --data, prompt, messages, user (a "
                          "one-message chat) or id"),
        "input.n": "roll out (or read) the first N items",
    }
    """What a mismatch run does with the inputs it takes: rollouts of a response, or a file of them."""

    def check_inputs(self, inputs: Any, options: MismatchOptions) -> None:
        """A rollout file holds its responses and says how they were sampled: decoding options are refused with it,
        not ignored; processed log-probabilities of a greedy row (temperature 0) are refused, as it has no warped
        distribution to take them from."""
        if options.rollouts is None:
            return
        given = [f"--{f.replace('_', '-')}" for f in ("max_new_tokens", "sample", "temperature", "top_k", "top_p", "seed")
                 if getattr(inputs.decode, f) != getattr(DecodeConfig(), f)]
        if given:
            raise StageReplayError(f"{', '.join(given)} decode nothing with --rollouts: the file holds the responses "
                                   "and how they were sampled", f"drop {', '.join(given)}, or generate the rollouts "
                                   "without --rollouts")
        if options.mode == "processed":
            from stagereplay.tasks.rollouts import scan

            rows, _ = scan(options.rollouts, inputs.input.columns, 1 << 31, 1 << 31, inputs.input.n)
            greedy = next((r for r in rows if r.sampling.get("temperature") == 0), None)
            if greedy is not None:
                raise StageReplayError(f"{greedy.where}: temperature is 0 (greedy), which has no processed "
                                       "distribution to score the row under",
                                       "score the file with --logprobs-mode raw, or drop its greedy rows")

    def check(self, model: ModelConfig, options: MismatchOptions) -> None:
        super().check(model, options)
        for p in options.precisions:
            trainer_model(model, p)  # validates the name before anything runs

    def identity(self, options: MismatchOptions) -> dict[str, Any]:
        return {"source": "file" if options.rollouts else "generated", "precisions": list(options.precisions),
                "mode": options.mode, "transplant_at": options.transplant_at, **_micro_batch(options)}

    def section(self, prepared: PreparedRun, options: MismatchOptions, run: Run) -> StageSection:
        return MismatchStage(model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
                             source="file" if options.rollouts else "generated", precisions=list(options.precisions),
                             mode=options.mode, transplant_at=options.transplant_at, **_micro_batch(options))

    def batches(self, prepared: PreparedRun, stage: StageSection, run: Run) -> Any:
        """The rollouts and our engine's scores of them at the run's precision first; then, once their tokens are
        recorded, the trainer at each precision on those tokens (a generator: each batch made when it is due)."""
        own: MismatchStage = self.stage_of(stage)
        columns = prepared.data.columns
        yield Batch(prepared.model, [Job(item, prepared.settings, MismatchParams(
            "", own.mode, own.source, own.transplant_at, columns)) for item in prepared.items])
        ids = {item.id for item in prepared.items}
        for p in own.precisions:
            recorded = main_records(run, prepared.checkpoint)
            yield Batch(trainer_model(prepared.model, p), [
                Job(item, prepared.settings, MismatchParams(p, own.mode, own.source, prompt=tuple(r.prompt_ids or ()),
                                                            response=tuple(r.response_ids or ()), batch=own.batch(),
                                                            decode=self._row_decode(own, prepared.settings, r.sampling)))
                for item in prepared.items if item.id in ids and (r := recorded.get(item.id)) is not None])

    def _row_decode(self, own: MismatchStage, settings: ReplaySettings, sampling: Mapping[str, Any] | None
                    ) -> DecodeConfig | None:
        """The decode a trainer part scores a rollout file's row under: the row's sampling as its rollout part
        recorded it (`row_decode`); None for a generated rollout (the run's)."""
        return row_decode(settings.decode, sampling) if own.source == "file" else None

    def unit_positions(self, record: Record) -> int:
        arms = PAYLOAD.validate_python(record.payload).arms
        return arms[0].start + len(arrays.decode(arms[0].logprobs)) if arms else 0

    def unit_model(self, model: ModelConfig, part: str) -> ModelConfig:
        return trainer_model(model, part) if part else model

    def work(self, lm: LM, job: Job) -> PayloadModel:
        return mismatch_item(lm, job)

    def told(self, records: list[Record]) -> list[str]:
        """Where along the response each side parts from the rollout, and by how much (`mismatch_story`)."""
        from stagereplay.experiments.mismatch.story import story_lines

        ordered = sorted(records, key=lambda r: r.part != "")
        return story_lines([PAYLOAD.validate_python(r.payload) for r in ordered],
                           f"{self.name}/{records[0].checkpoint}" if records else self.name)

    def units(self, checkpoint: str, stage: StageSection, config: RunConfig, records: list[Record]
              ) -> list[tuple[str, str]]:
        """Every item, at the rollout's part and at each trainer precision."""
        own: MismatchStage = self.stage_of(stage)
        return [(i, part) for part in ("", *own.precisions) for i in config.item_ids]

    def claims(self, record: Record, stage: StageSection, matched: Record | None) -> list[str]:
        """Every arm scores the record's tokens, its fingerprints are its arrays', and the transplant's outcomes
        follow from its continuations."""
        p, bad = record.payload, []
        if p.get("prompt_ids") is not None and p.get("tokens_fp") != ids_fingerprint(
                [*p["prompt_ids"], *p.get("response_ids", [])]):
            bad.append("tokens_fp is not the fingerprint of prompt_ids + response_ids")
        for arm in p.get("arms", []):
            if arm.get("logprobs_fp") != arrays.fingerprint(arm.get("logprobs", "")):
                bad.append(f"arm {arm.get('name')}: logprobs_fp is not the fingerprint of its logprobs")
            if arm.get("tokens_fp") != p.get("tokens_fp") and not arm.get("name", "").endswith("#replica"):
                bad.append(f"arm {arm.get('name')}: scored other tokens than the record's")
        moved = p.get("transplant")
        if moved:
            by = {a["name"]: a for a in p.get("arms", [])}
            for key, prefix in (("directions", ""), ("control", "control:")):
                for direction, recorded in moved[key].items():
                    donor, _, recipient = direction.partition("->")
                    names = (f"{prefix}{direction}", f"from@{moved['at']}:{donor}", f"from@{moved['at']}:{recipient}")
                    if not all(n in by for n in names):
                        bad.append(f"transplant {direction}: its arms are missing")
                        continue
                    cont, d, r = (Scored(arrays.decode(by[n]["logprobs"]), None) for n in names)
                    if outcome(cont, d, r).as_payload() != recorded:
                        bad.append(f"transplant.{key}.{direction} does not follow from its arms")
        return bad

    def replay_job(self, replay: Replay) -> Job:
        own: MismatchStage = self.stage_of(replay.stage)
        part = replay.record.part
        params = MismatchParams(part, own.mode, own.source, own.transplant_at if not part else 0.0)
        if part:
            main = replay.matched or {}
            params = MismatchParams(part, own.mode, own.source, prompt=tuple(main.get("prompt_ids") or ()),
                                    response=tuple(main.get("response_ids") or ()), batch=own.batch(),
                                    decode=self._row_decode(own, replay.settings, main.get("sampling")))
        return Job(replay.item, replay.settings, params)

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        """The token counts of the forwards one unit made: prefills and single-token steps."""
        p = PAYLOAD.validate_python(record.payload)
        if not p.arms:
            return None
        n, prompt = len(arrays.decode(p.arms[0].logprobs)), p.arms[0].start
        if record.part:
            batch = self.stage_of(stage).batch()
            seed = self.stage_of(stage).settings.decode.seed
            return [prompt + n - 1] * 2 + ([batch.forward_tokens(record.item_id, seed, prompt + n - 1)] if batch else [])
        steps, generated = [prompt, *[1] * (n - 1)], p.source == "generated"
        out = (steps * 2 if generated else []) + steps + ([prompt + n - 1] * 2 if generated else [])
        if p.transplant:
            at = p.transplant.at
            out += [prompt, *([1] * (at - prompt)), at]  # the two caches at t
            out += [1] * (prompt + n - at - 1) * 6  # the two own and four transplanted continuations
        return out

    def planned_forwards(self, assumed: Assumed, options: MismatchOptions) -> Planned:
        """Per item, part '': the rollout and its replica (generated), our incremental score, the engine's prefill
        and its replica (generated), and the transplant where it fits; each trainer precision: a prefill and its
        replica. The forwards `unit_forwards` counts on a recorded unit."""
        generated, main = options.rollouts is None, []
        for lengths in assumed.items:
            p, n = lengths.prompt, lengths.suffix
            steps = [p, *[1] * (n - 1)]
            out = (steps * 2 if generated else []) + steps + ([p + n - 1] * 2 if generated else [])
            at = p + max(1, int(options.transplant_at * n))
            if options.transplant_at and p + n - at >= 3:
                out += [p, *([1] * (at - p)), at, *[1] * ((p + n - at - 1) * 6)]
            main.append((lengths, out))
        return {"": main, **{precision: [(u, [u.prompt + u.suffix - 1] * 2) for u in assumed.items]
                             for precision in options.precisions}}

    def peak_caches(self, stage: StageSection) -> int:
        return 4  # the two caches at t, a transplanted one and the continuation's

    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[MismatchSummary]:
        from stagereplay.experiments.mismatch.summary import summarize_mismatch

        return [summarize_mismatch(records, self.stage_of(stage), checkpoint)]

    def tables(self, results: list[MismatchSummary]) -> list[Table]:
        from stagereplay.experiments.mismatch.tables import mismatch_tables

        return [t for section in results for t in mismatch_tables(section)]

    def compared(self, records: tuple[list[Record], list[Record]], item_ids: list[str], checkpoint: str,
                 runs: tuple[str, str], sections: tuple[MismatchSummary, MismatchSummary], differences: Differences
                 ) -> RunComparison:
        from stagereplay.experiments.mismatch.compare import compared

        return compared(records, item_ids, checkpoint, runs, sections, differences)

    def check_other_data(self, runs: tuple[str, str], records: tuple[list[Record], list[Record]]) -> None:
        """Two runs on other data (a generated run and a file of rollouts, two engines' files) compare on the
        items' tokens: refused only where an item's prompt differs (its responses may: that is what differs)."""
        prompts = ({r.item_id: PAYLOAD.validate_python(r.payload).prompt_ids for r in side if not r.part}
                   for side in records)
        a, b = prompts
        for item_id, prompt in a.items():
            if item_id in b and b[item_id] != prompt:
                raise StageReplayError(f"{runs[0]} and {runs[1]} hold other prompts for item {item_id!r}: their "
                                       "rollouts answer different questions", "compare runs of the same prompts")

    def verdict_facts(self, results: list[MismatchSummary]) -> list[Fact]:
        from stagereplay.experiments.mismatch.verdict import mismatch_verdict

        return [f for section in results for f in mismatch_verdict(section)]

    def figures(self, results: list[MismatchSummary]) -> list[ReportFigure]:
        from stagereplay.experiments.mismatch.tables import mismatch_figures

        return [f for section in results for f in mismatch_figures(section)]
