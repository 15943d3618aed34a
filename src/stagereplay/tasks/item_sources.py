"""Where a run's items come from, by name: a small registry of sources, each of which reads its items (with a
tokenizer, for a run) and finds them again where the run recorded them (without one, for verify and relocation).

    prompts    the embedded toy task's held-out items (no path), or a data file, folder or hf: dataset of prompts
               and answers (`tasks.sources`)
    unlabelled the same prompts, their answers not read (a run that labels nothing: mismatch's, attest's)
    rollouts   a rollout file: prompts with the responses an engine sampled and their log-probabilities
               (`tasks.rollouts`)
    served     a file of served outputs: a rollout file whose log-probabilities are optional

An experiment names the source its run reads (`Experiment.data`); the manifest records it (`DataSection.source`) and
every reader of the data asks the source by that name. A name the registry does not know is refused in one line.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from stagereplay.errors import StageReplayError
from stagereplay.tasks.rollout_fields import ROLLOUTS, SERVED, FileKind


class Source(ABC):
    """One kind of item source."""

    name: ClassVar[str]

    @abstractmethod
    def check_columns(self, columns: str | None) -> None:
        """Refuse in one line a `--columns` mapping this source cannot map."""

    @abstractmethod
    def load(self, path: str | None, n: int | None, columns: str | None, tokenizer: Any, context: int | None
             ) -> tuple[list[Any], str]:
        """The first `n` items at `path` (tokenized, checked against `context`) and the dataset's hash."""

    @abstractmethod
    def at(self, spec: str, columns: str | None) -> tuple[list[Any], str] | None:
        """The rows (each with its `id`) and hash of the dataset at `spec`, read without a tokenizer; None where it
        is not at hand there (a location only)."""


class Prompts(Source):
    """Prompts and answers: the toy task's held-out items, or a data file, folder or hf: dataset."""

    name: ClassVar[str] = "prompts"
    answers: ClassVar[bool] = True
    """Whether the rows' answers are read (and must be there)."""

    def check_columns(self, columns: str | None) -> None:
        from stagereplay.tasks.sources import parse_columns

        parse_columns(columns)

    def load(self, path: str | None, n: int | None, columns: str | None, tokenizer: Any, context: int | None
             ) -> tuple[list[Any], str]:
        from stagereplay.tasks.jsonl import tokenize_row
        from stagereplay.tasks.sources import read_rows

        if path is None:
            from stagereplay.tasks.toy import HELDOUT_SEED, toy_data_hash, toy_items

            count = n or 200
            return toy_items(count, HELDOUT_SEED, tokenizer), toy_data_hash(count, HELDOUT_SEED)
        rows, data_hash = read_rows(path, columns, self.answers)
        if n is not None and n > len(rows):
            raise StageReplayError(f"--n {n} is larger than the {len(rows)} items in {path}",
                                   f"pass --n {len(rows)} or fewer")
        rows = rows[:n] if n else rows
        return [tokenize_row(r, tokenizer) for r in rows], data_hash

    def at(self, spec: str, columns: str | None) -> tuple[list[Any], str] | None:
        from stagereplay.tasks.sources import dataset_at

        return dataset_at(spec, columns, self.answers)


class Unlabelled(Prompts):
    """Prompts whose answers are not read: a run that labels nothing reads any row with a prompt, whatever answer
    it holds, or none."""

    name: ClassVar[str] = "unlabelled"
    answers: ClassVar[bool] = False


class RolloutFile(Source):
    """A rollout file: each row a prompt, the response an engine sampled and its log-probabilities."""

    name: ClassVar[str] = "rollouts"
    kind: ClassVar[FileKind] = ROLLOUTS
    """What its command calls the file, and whether every row must give its log-probabilities."""

    def check_columns(self, columns: str | None) -> None:
        from stagereplay.tasks.rollouts import mapping

        mapping(columns, self.kind)

    def load(self, path: str | None, n: int | None, columns: str | None, tokenizer: Any, context: int | None
             ) -> tuple[list[Any], str]:
        from stagereplay.tasks.rollouts import scan

        if path is None:
            raise StageReplayError(f"this run's {self.kind.name} is not named", f"pass {self.kind.option} FILE")
        vocab = max(len(tokenizer), int(getattr(tokenizer, "vocab_size", 0) or 0))
        found, data_hash = scan(path, columns, vocab, context or 1 << 31, n, self.kind)
        return list(found), data_hash

    def at(self, spec: str, columns: str | None) -> tuple[list[Any], str] | None:
        from stagereplay.tasks.rollouts import scan

        return scan(spec, columns, 1 << 31, 1 << 31, kind=self.kind) if Path(spec).is_file() else None


class ServedFile(RolloutFile):
    """A file of served outputs (`stagereplay attest --served`): a rollout file whose rows may leave out their
    log-probabilities."""

    name: ClassVar[str] = "served"
    kind: ClassVar[FileKind] = SERVED


SOURCES: dict[str, Source] = {s.name: s for s in (Prompts(), Unlabelled(), RolloutFile(), ServedFile())}


def source(name: str) -> Source:
    """The source called `name`; refused in one line when the registry does not know it."""
    try:
        return SOURCES[name]
    except KeyError:
        raise StageReplayError(f"unknown item source {name!r} (this stagereplay knows {', '.join(SOURCES)})",
                               "upgrade stagereplay to read this run's data") from None
