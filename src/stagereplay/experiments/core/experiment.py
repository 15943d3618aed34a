"""What an experiment is, for everything that makes, checks, prices or reports a run: one typed object per experiment,
found by name in the registry (`experiments.core.registry`).

An author declares fifteen members, in DESIGN's words (the plugin experiment of tests/plugin declares these, and
`claims` and `smallest_run` besides):

    name                      its name: the ledger's `experiment` field, its entry point's and its command's
    Options                   its config: a frozen dataclass whose fields are its command's options
    Stage                     its frozen section of the manifest (a `StageSection` with its own fields)
    payload                   its payload: `read(record)` gives a record's payload as this model
    Summary                   its section of results.json, a model
    shape                     what its runs and records are like (`core.shape.Shape`: a run of its own or a stage of
                              one, a stage boundary, protocol arms, parts per precision, its report label)
    section(prepared, opts)   the section it freezes before its first item, from the prepared run and its options
    batches(prepared, stage)  its jobs, one batch per model setting (a precision), from the frozen section
    work(lm, job)             its item function: one item's record payload, pure in (model, job)
    units(...)                its expected units: the (item id, part) units a declared stage names (`verify`)
    replay_job(replay)        its re-execution: the job that runs one recorded unit again (`audit`)
    unit_forwards(...)        its forward counts: the forwards a recorded unit made (`plan`)
    peak_caches(stage)        its peak caches: the most K/V caches an item holds at once (`plan`)
    summarize(...)            its summary: its section(s) of results.json from its records
    tables(sections)          its verdict lines' tables: the report's tables of those sections

Everything else has a default that fits most experiments, overridden where it does not:

    claims, stage_findings            what its records claim beyond the arms every record has (`verify`)
    served                            how a serving engine runs it (`core.served.Served`; None: refused there)
    data, sequence_end                where its items come from (`tasks.item_sources`), how far a sequence reaches
    check, check_inputs               what it refuses before anything loads
    ignores, helps, defaults          the run inputs its command does not offer, describes its own way, or defaults
    planned_forwards, planned_stage,  what a plan prices before the run (on lengths it assumes, `Assumed`)
    plan_notes
    verdict_facts, verdict_questions, the report's verdict, figures and per-pair diagnostics
    figures, series, diagnosed
    told, compare_runs,               one item's story (`show`), two of its runs side by side (`compare`)
    check_other_data
    payload_models, smallest_run,     its payload models on the schema page, its smallest run (the test of every
    exit_code, identity, ...          reading command), its exit code, what makes two of its stages the same

and `run(run, prepared, options)` makes its stage of a run the same way for every experiment and engine: the engine
of the prepared run (`experiments.core.prepared.RunEngine`: ours, or a serving engine) gives the section, the batches and
the item function, and the loop appends a record per job not yet in the ledger. Nothing outside an experiment's
package names the experiment: a stage of the manifest (`<experiment>/<checkpoint>`) finds its experiment in the
registry, and a name the registry does not know is refused in one line.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast

from pydantic import BaseModel, TypeAdapter

from stagereplay.engine.forwards import Lengths, continuation_forwards
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import Work
from stagereplay.execution.executors import run_jobs
from stagereplay.experiments.core.diagnostics_summary import Diagnosed
from stagereplay.experiments.core.figures import ReportFigure, SharedFigure
from stagereplay.experiments.core.format import Table
from stagereplay.experiments.core.jobs import Batch, Job, JobResult, Replay, with_environment
from stagereplay.experiments.core.prepared import PreparedRun
from stagereplay.experiments.core.served import Served
from stagereplay.experiments.core.shape import Shape
from stagereplay.experiments.core.small_run import SmallRun
from stagereplay.experiments.core.verdict import Fact, Question
from stagereplay.records.findings import Finding
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import RunConfig, StageSection
from stagereplay.records.payload_readers import ItemHead
from stagereplay.records.payloads import PayloadModel
from stagereplay.records.proofs import machine_store
from stagereplay.records.summary import Count, Untyped

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.lm import LM
    from stagereplay.experiments.core.compared import RunComparison
    from stagereplay.experiments.core.run_side import RunSide
    from stagereplay.tasks import DataConfig, Item

__all__ = ["Assumed", "Batch", "Experiment", "NoOptions", "Planned", "Replay", "SmallRun", "append_jobs"]

Planned = dict[str, list[tuple[Lengths, list[int]]]]
"""The forwards a stage would make, per part of its units ('' or a precision), unit by unit: (its assumed lengths,
the token count of each forward)."""


@dataclass(frozen=True)
class NoOptions:
    """An experiment without options of its own."""


@dataclass(frozen=True)
class Assumed:
    """What a plan assumes of a run before it runs (`plan.paper`): each item's lengths, the items that diverge, and
    what the stage that starts the run makes, from which later stages carry arms over."""

    items: tuple[Lengths, ...]
    """Per item: its prompt, stage 1 and every suffix."""
    divergent: int
    """The first `divergent` items' live and fresh suffixes differ (they are transplanted, their pairs replayed)."""
    dedup: bool
    """Whether a stage carries over the arms the matched stage decoded, rather than decoding them again."""
    layers: int
    """The model's layers (a transplant's layer sweep)."""
    precision: str = "bf16"
    """The run's precision: a stage's part at it may carry arms over."""
    construction: str = "oneshot"
    """The matched stage's fresh construction (`paper`'s: oneshot): the arm later stages carry over."""
    served_by: str | None = None
    """The serving engine a run asks for what it serves (`--engine`), whose forwards are not ours (None: ours)."""

    def replay(self, i: int) -> list[int]:
        """The diagnostics decode the first-run arm of a divergent pair again to its first divergent step d (d + 1
        steps, d < the suffix): a bound of one suffix per divergent item (`plan.recorded.replay_forwards`)."""
        return continuation_forwards(self.items[i].suffix) if i < self.divergent else []


RESPONSE_IGNORES: frozenset[str] = frozenset({
    "boundary.marker", "boundary.regex", "boundary.after", "decode.max_stage1_tokens", "input.scorer",
    "numerics.batch", "choice.cross"})
"""What an experiment on whole responses does nothing with (its `ignores`): a response has no stage boundary and no
label, and is scored one sequence at a time."""

OptionsT = TypeVar("OptionsT", bound="DataclassInstance")
"""An experiment's options (`Options`)."""
StageT = TypeVar("StageT", bound=StageSection)
"""An experiment's section of the manifest (`Stage`)."""
PayloadT = TypeVar("PayloadT", bound=BaseModel)
"""An experiment's payload (`payload`: one model, or a union of models where a status has its own)."""
SummaryT = TypeVar("SummaryT")
"""An experiment's section of results.json (`Summary`)."""


class Experiment(ABC, Generic[OptionsT, StageT, PayloadT, SummaryT]):
    """One experiment of the protocol (module docstring), generic over its options, stage, payload and summary:
    `Experiment[MyOptions, MyStage, MyPayload, MySummary]`."""

    name: ClassVar[str]
    """The ledger's `experiment` field and the first half of a stage's name."""
    Stage: ClassVar[type[StageSection]] = StageSection
    """Its frozen section of the manifest."""
    payload: ClassVar[TypeAdapter[Any]] = TypeAdapter(ItemHead)
    """Its records' payload model (a union where a status has its own): what `read` validates a payload as. By
    default what every payload of the protocol's arms holds (`records.payload_readers.ItemHead`)."""
    payload_models: ClassVar[tuple[type[BaseModel], ...]] = ()
    """Its own payload models beyond the protocol's (`records.payloads`), in the order the ledger schema page shows
    them (`core.payload_doc`)."""
    Options: ClassVar[type] = NoOptions
    """Its own options: a frozen dataclass, each field with its `help` (its command's options come from them)."""
    command: ClassVar[str] = ""
    """Its command's name, by default its own with `-` for `_` ('' : it has none): `stagereplay <command>`."""
    shape: ClassVar[Shape] = Shape()
    """What its runs and records are like (`core.shape.Shape`): a run of its own or a stage of one, a boundary,
    continuations, the matched run's prefixes, parts per precision, one results section or many, its report label."""
    served: ClassVar[type[Served] | None] = None
    """How a serving engine (one that keeps its own cache) runs it: a `core.served.Served` of its own package (matched's
    arms from the prompt, the 2x2's on the matched run's prefixes, mismatch's rollouts sampled in the engine, attest's
    served responses); None: it needs the cache itself, and is refused there."""
    ignores: ClassVar[frozenset[str]] = frozenset()
    """The inputs a run it makes does nothing with, dotted as its command's groups name them (`boundary.marker`,
    `numerics.batch` of `runs.inputs.Inputs`; `choice.cross` of the engine choice): its command does not offer them."""
    helps: ClassVar[dict[str, str]] = {}
    """Its command's own help texts of inputs it reads otherwise than the protocol does (dotted as `ignores`)."""
    defaults: ClassVar[dict[str, Any]] = {}
    """Its command's own defaults of shared inputs (dotted as `ignores`): attest's reference at fp32."""
    smallest_run: ClassVar[SmallRun | None] = None
    """The smallest run of it the embedded toy allows, as its command's options (`small_run.SmallRun`): what the test
    of every reading command makes of it; None: it gives none, and that test names it."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Its command is named as it is (`precision_2x2`: `stagereplay precision-2x2`) unless it says otherwise. A fact
        of its shape declared as a flag of its own (`label = ...`) would be silently ignored: refused."""
        super().__init_subclass__(**kwargs)
        if "name" in vars(cls) and "command" not in vars(cls):
            cls.command = cls.name.replace("_", "-")
        flags = sorted(set(vars(cls)) & {f.name for f in dataclass_fields(Shape)})
        if flags:
            raise TypeError(f"{cls.__name__} declares {', '.join(flags)} as class attributes: declare them in its "
                            f"shape (shape = Shape({', '.join(f'{f}=...' for f in flags)}))")

    # -- its section of results.json ------------------------------------------------------------------------

    Summary: ClassVar[type[BaseModel]] = Untyped
    """Its section of results.json (`summarize` makes them, `results_of` reads them back); `Untyped` where it declares
    none: its sections are then JSON objects, passed through as they are."""

    def results_of(self, entry: Any) -> Any:
        """Its results.json entry (a list of sections if `many`, else one or null) as its `Summary`s: a list of them,
        one, or None."""
        if self.shape.many:
            return [self._summary(s) for s in entry or []]
        return None if entry is None else self._summary(entry)

    def _summary(self, section: dict[str, Any]) -> Any:
        return section if self.Summary is Untyped else self.Summary.model_validate(section)

    # -- making its stage of a run --------------------------------------------------------------------------

    def data(self, path: str | None, n: int | None, columns: str | None, options: OptionsT) -> DataConfig:
        """Where a run it makes reads its items, from what the input group gave (`--data`, `--n`, `--columns`) and
        its options."""
        from stagereplay.tasks import DataConfig

        return DataConfig(path=path, n=n, columns=columns)

    def sequence_end(self, item: Item, decode: DecodeConfig) -> int:
        """How far one item's sequence reaches (its prompt and what a run without a stage boundary adds to it): the
        prompt and `max_new_tokens`."""
        return len(item.prompt_ids) + decode.max_new_tokens

    def check_inputs(self, inputs: Any, options: OptionsT) -> None:  # most experiments take every input
        """Refuse in one line inputs (`runs.inputs.Inputs`) that its options make meaningless, rather than ignore
        them."""

    def check(self, model: ModelConfig, options: OptionsT) -> None:  # most experiments check nothing here
        """Refuse in one line, before anything loads, options it cannot run with `model`."""

    @abstractmethod
    def section(self, prepared: PreparedRun, options: OptionsT, run: Run) -> StageSection:
        """Its frozen section (`Stage`) from the prepared run and its options; `run` holds the records it starts
        from (a transplant's selection is made from them before any outcome exists)."""

    @abstractmethod
    def batches(self, prepared: PreparedRun, stage: StageSection, run: Run) -> Iterable[Batch]:
        """Its jobs, from its section as the manifest holds it (as the audit will read it); each batch is run before
        the next is asked for (a generator may make a batch from the records of the one before)."""

    def identity(self, options: OptionsT) -> dict[str, Any]:
        """What of its options the identity of a run it makes records (`manifest.config`): every field."""
        return json.loads(json.dumps(asdict(options)))

    def check_outcome(self, summaries: Any, prepared: PreparedRun) -> None:  # most accept any
        """Refuse in one line, once its records are kept, an outcome that says the run was set up wrong (`summaries`:
        its results.json entry as `results_of` reads it)."""

    def exit_code(self, summaries: Any) -> int:
        """Its command's exit code for its results.json entry as `results_of` reads it (0: nothing to flag)."""
        return 0

    def run(self, run: Run, prepared: PreparedRun, options: OptionsT) -> None:
        """Make (or resume) its stage at the prepared run's checkpoint: freeze the section the prepared run's engine
        gives, then append a record for every job not yet in the ledger."""
        engine = prepared.engine
        section = engine.section(self, prepared, options, run)
        stage = run.begin_stage(f"{self.name}/{prepared.checkpoint}", section)
        with engine.failures():
            for batch in engine.batches(self, prepared, stage, run):
                append_jobs(run, self.name, prepared.checkpoint, batch, engine.work(self),
                            engine.exec_config(self, prepared.ex), prepared.quiet, engine.env_work(self))

    # -- what verify, the audit, plan and the report ask of it ---------------------------------------------

    @abstractmethod
    def work(self, lm: LM, job: Job) -> PayloadModel:
        """One item's record payload, as its model."""

    @abstractmethod
    def units(self, checkpoint: str, stage: StageSection, config: RunConfig, records: list[Record]
              ) -> list[tuple[str, str]]:
        """The (item id, part) units its stage at `checkpoint` names, from the run's `config` and the records it
        starts from."""

    def read(self, record: Record) -> PayloadT:
        """One of its records' payload as its model (`payload`); raises pydantic's ValidationError (a ValueError) when
        it is not one."""
        model: PayloadT = self.payload.validate_python(record.payload)
        return model

    def told(self, records: list[Record]) -> list[str]:
        """One item's story for `stagereplay show`, as lines, from its records of this experiment at one checkpoint
        (each read as its model, `read`): by default, per record, each of its payload's own fields that is a number,
        a label or a list (token IDs counted, arms named)."""
        lines = []
        for record in records:
            lines.append(f"{self.where(record)}:")
            for name, value in self.read(record):
                if isinstance(value, (bool, int, float, str)) or value is None:
                    lines.append(f"  {name}: {value}")
                elif isinstance(value, list) and not value:
                    lines.append(f"  {name}: none")
                elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                    lines.append(f"  {name}: {len(value)} token IDs")
                elif isinstance(value, list):
                    names = [str(getattr(v, "name", "")) for v in value]
                    lines.append(f"  {name}: {', '.join(n for n in names if n) or len(value)}")
        return lines

    def claims(self, record: Record, stage: StageSection, matched: Record | None) -> list[str]:
        """What one of its records claims that follows from its other fields, checked: the problems found."""
        return []

    def stage_findings(self, name: str, stage: StageSection, records: list[Record]) -> list[Finding]:
        """What its stage's frozen section claims that follows from the records (a selection from its rule)."""
        return []

    @abstractmethod
    def replay_job(self, replay: Replay) -> Job:
        """The job that re-executes one recorded unit."""

    @abstractmethod
    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        """The token counts of the forwards one recorded unit made (None: its lengths are not recorded)."""

    @abstractmethod
    def peak_caches(self, stage: StageSection) -> int:
        """The most K/V caches one item holds at once."""

    @abstractmethod
    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[SummaryT]:
        """Its sections of results.json from one stage's records (one, or one per arm or precision): `Summary`s."""

    def planned_stage(self, options: OptionsT) -> StageSection:
        """Its section as a plan sees it before the run: what `peak_caches` reads, from its options (no model,
        settings or selection yet)."""
        return self.unmade_stage({})

    def unmade_stage(self, fields: dict[str, Any]) -> StageSection:
        """A section of its stage with only `fields` set, unvalidated: what a plan reads of a stage not yet made."""
        return self.Stage.model_construct(**fields)

    def planned_forwards(self, assumed: Assumed, options: OptionsT) -> Planned:
        """The forwards its stage would make with `options` on the lengths a plan assumes: its own `forwards(...)`
        of each unit it would run (`Planned`)."""
        raise NotImplementedError(f"{self.name} prices no assumed run (it is no stage of `paper`)")

    def plan_notes(self, options: OptionsT, items: int) -> list[str]:
        """What a plan of a run of `items` items should say besides its cost (what the run can decide at that
        size); none by default."""
        return []

    @abstractmethod
    def tables(self, results: Any) -> list[Table]:
        """The report's tables of its results.json entry as `results_of` reads it (a list of `Summary`s if `many`,
        else one or None); so the methods below."""

    def verdict_facts(self, results: Any) -> list[Fact]:
        """What its results.json entry says to the verdict's questions (`experiments.core.verdict`), in its order."""
        return []

    def verdict_questions(self, results: Any) -> list[Question]:
        """The questions its results.json entry raises, asked whether or not any experiment answers them: by default
        those its facts answer."""
        return list(dict.fromkeys(f.question for f in self.verdict_facts(results)))

    def figures(self, results: Any) -> list[ReportFigure]:
        """The report's figures of its results.json entry; an entry that is null or empty draws none."""
        return []

    def series(self, results: Any) -> dict[SharedFigure, list[Any]]:
        """Its series on the figures it draws with other experiments (`experiments.core.figures.SharedFigure`), from its
        results.json entry: none where it has nothing to draw."""
        return {}

    def diagnosed(self, results: Any) -> list[tuple[str, Diagnosed, Count]]:
        """(label, summary, its disagreement counts {k, n}) of each compared pair in its results.json entry whose
        summary carries diagnostics (margins, logits, caches): the report's diagnostics table and figures."""
        return []

    def compare_runs(self, a: RunSide, b: RunSide, checkpoint: str) -> RunComparison | None:
        """Two runs of it at `checkpoint` side by side, item by item (`stagereplay compare`), refusing in one line
        runs that do not compare (`core.compare_manifests.check_comparable`); None where it compares no runs."""
        return None

    def check_other_data(self, runs: tuple[str, str], records: tuple[list[Record], list[Record]]) -> None:
        """Refuse in one line two runs of it whose data differ (their dataset hashes; the same item ids), where
        comparing their records means nothing: by default always (its records are outcomes of the items the data
        gives, and other data gives other items)."""
        raise StageReplayError(f"{runs[0]} and {runs[1]} ran items of different datasets (config.dataset_hash "
                               "differs)", "compare runs of the same data file")

    def unit_positions(self, record: Record) -> int:
        """The longest sequence one recorded unit held (what its caches are sized by): its prefix and longest
        suffix."""
        from stagereplay.experiments.core.lengths import lengths_of

        n = lengths_of(record)
        return n.prefix + max((length for _, length in n.arms), default=n.generated)

    def unit_model(self, model: ModelConfig, part: str) -> ModelConfig:
        """The model a unit of part `part` runs on, from its stage's: at the part's precision where parts are
        precisions."""
        return model.with_precision(part) if self.shape.per_precision and part else model

    def where(self, record: Record) -> str:
        """A unit's stage as findings name it, with the precision of a per-precision unit."""
        part = record.part if self.shape.per_precision else ""
        return f"{record.experiment}/{record.checkpoint}{'@' + part if part else ''}"

    def stage_of(self, section: StageSection) -> StageT:
        """A section of its stage as its own model (`Stage`)."""
        return cast(StageT, section.as_stage(self.Stage))  # `Stage` is `StageT`'s class: a ClassVar holds no type variable


def append_jobs(run: Run, experiment: str, checkpoint: str, batch: Batch, work: Work[PayloadModel], ex: Any,
                quiet: bool, env_work: Work[JobResult] | None = None) -> None:
    """Run every job of `batch` not yet in the ledger, appending records in job order with the environment that
    computed each, under a progress bar. `env_work` returns a job's payload and environment itself (a serving
    engine adds its own to the environment); by default `work`'s payload gets `with_environment`'s."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    model, jobs = batch.model, batch.jobs
    pending = [j for j in jobs if not run.done(experiment, checkpoint, j.item.id, j.part)]
    at = batch.at or model.precision
    label = f"{experiment} [{checkpoint}]" + (f" {at}" if at else "")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=quiet, transient=False) as bar:
        # The description is rich markup: escaped, "[primary]" is shown, not taken for a style.
        task = bar.add_task(escape(label), total=len(jobs), completed=len(jobs) - len(pending))
        done = run_jobs(model, env_work or partial(with_environment, work), pending, ex, machine_store=machine_store)
        for job, out in zip(pending, done, strict=False):
            run.append(experiment, checkpoint, job.item.id, out.payload.as_payload(), job.part, out.environment)
            bar.advance(task)
