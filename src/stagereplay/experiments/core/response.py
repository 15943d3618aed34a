"""The base of the experiments on whole responses (mismatch, attest): per item a response to a prompt, generated here
or read from a file of responses, with no stage boundary, no continuation and no correctness label.

What such an experiment shares is here once: the option that names its file of responses (`responses`: `--rollouts`,
`--served`), which is then the run's data; how far an item's sequence reaches (its own response, or the response
limit); one sequence scored at a time in our engine; and a unit named with its part."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.experiment import (
    RESPONSE_IGNORES,
    Experiment,
    OptionsT,
    PayloadT,
    StageT,
    SummaryT,
)
from stagereplay.experiments.core.shape import RESPONSES, Shape
from stagereplay.records.ledger import Record

if TYPE_CHECKING:
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.model import ModelConfig
    from stagereplay.experiments.core.compared import RunComparison
    from stagereplay.experiments.core.run_side import RunSide
    from stagereplay.records.differences import Differences
    from stagereplay.tasks import DataConfig


class ResponseExperiment(Experiment[OptionsT, StageT, PayloadT, SummaryT]):
    """An experiment on whole responses (module docstring)."""

    shape: ClassVar[Shape] = RESPONSES
    ignores: ClassVar[frozenset[str]] = RESPONSE_IGNORES
    responses: ClassVar[str] = ""
    """The option (a field of `Options`, and `--<it>`) that names a file of responses, and the item source that
    reads it (`tasks.item_sources`)."""

    def response_file(self, options: Any) -> str | None:
        """The file of responses the options name (None: the responses are generated here)."""
        return getattr(options, self.responses)

    def data(self, path: str | None, n: int | None, columns: str | None, options: Any) -> DataConfig:
        """A file of responses is the run's data (its hash bound, its location not); else prompts, read without their
        answers (`tasks.item_sources.Unlabelled`: a response has no label)."""
        from stagereplay.tasks import DataConfig

        file = self.response_file(options)
        if file is None:  # prompts to generate responses to: their answers, if any, are not read
            return DataConfig(path=path, n=n, columns=columns, source="unlabelled" if path is not None else "prompts")
        flag = f"--{self.responses}"
        if path is not None:
            raise StageReplayError(f"{flag} names the data; --data names other data",
                                   f"pass one of {flag} FILE or --data FILE")
        return DataConfig(path=str(Path(file).resolve()), n=n, columns=columns, source=self.responses)

    def sequence_end(self, item: Any, decode: DecodeConfig) -> int:
        """A file's response reaches its own end; a generated one `max_new_tokens` past its prompt."""
        from stagereplay.tasks.rollouts import RolloutItem

        if isinstance(item, RolloutItem):
            return len(item.prompt_ids) + item.response_len
        return len(item.prompt_ids) + decode.max_new_tokens

    def check(self, model: ModelConfig, options: Any) -> None:
        if model.batch > 1:
            raise StageReplayError(f"{self.command} scores one sequence at a time in our engine",
                                   "run it with --batch 1 (a serving engine batches its own requests)")

    def compare_runs(self, a: RunSide, b: RunSide, checkpoint: str) -> RunComparison | None:
        """Two runs of it at `checkpoint`, from their records and their sections summarized again (`compared`)."""
        from stagereplay.experiments.core.compare_manifests import check_comparable, manifest_differences

        check_comparable(a, b, checkpoint, self.name)
        name = f"{self.name}/{checkpoint}"
        records = a.matched(checkpoint, self.name), b.matched(checkpoint, self.name)
        stages = a.manifest.stage(name), b.manifest.stage(name)
        assert stages[0] is not None and stages[1] is not None  # check_comparable: both hold its records there
        sections = (self.summarize(records[0], stages[0], checkpoint)[0],
                    self.summarize(records[1], stages[1], checkpoint)[0])
        return self.compared(records, list(a.manifest.config.item_ids), checkpoint, (str(a.path), str(b.path)),
                             sections, manifest_differences(a, b, checkpoint, self.name))

    def compared(self, records: tuple[list[Record], list[Record]], item_ids: list[str], checkpoint: str,
                 runs: tuple[str, str], sections: tuple[SummaryT, SummaryT], differences: Differences
                 ) -> RunComparison | None:
        """Its comparison of two runs' records and sections, given what differs between their manifests (None:
        it compares none)."""
        return None

    def where(self, record: Record) -> str:
        """A unit's stage as findings name it, with its part (a precision, a variant) where it has one."""
        return f"{record.experiment}/{record.checkpoint}{'@' + record.part if record.part else ''}"
