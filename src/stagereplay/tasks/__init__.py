"""Item sources (the embedded toy task; JSONL, JSON, CSV, Parquet, datasets folders and hf: datasets) and scorers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

from stagereplay.errors import StageReplayError
from stagereplay.tasks.base import Item, Scorer, exact_match, last_number, regex_scorer
from stagereplay.tasks.item_sources import source
from stagereplay.tasks.scoring import scorer_by_name

__all__ = ["DataConfig", "Item", "Scorer", "exact_match", "last_number", "load_items", "regex_scorer",
           "scorer_by_name"]


class RecordedData(TypedDict):
    """A `DataConfig` as the manifest records it (`DataConfig.as_dict`)."""

    path: str | None
    n: int | None
    columns: NotRequired[str]  # only when given
    source: NotRequired[str]  # only when not `prompts`


@dataclass(frozen=True)
class DataConfig:
    """Where items come from: a source (`tasks.item_sources`) and what it reads. `path=None` means the embedded toy
    task's held-out items."""

    path: str | None = field(default=None, metadata={"help": "JSONL, JSON, CSV or Parquet file, a save_to_disk "
                                                             "folder, or hf:NAME[:CONFIG][:SPLIT]; none = the toy"})
    n: int | None = field(default=None, metadata={"help": "first n items (all when None)"})
    columns: str | None = field(default=None, metadata={"help": "TARGET=COLUMN,... (prompt, messages, user, "
                                                                "answer, id)"})
    source: str = field(default="prompts", metadata={"help": "prompts | unlabelled | rollouts | served "
                                                             "(tasks.item_sources)"})

    def __post_init__(self) -> None:
        if self.n is not None and self.n < 1:
            raise StageReplayError(f"--n must be at least 1, got {self.n}", "pass a positive --n")
        if self.columns is not None and self.path is None:
            raise StageReplayError("--columns maps the columns of --data, and no --data is given",
                                   "pass --data, or drop --columns")
        source(self.source).check_columns(self.columns)

    def as_dict(self) -> RecordedData:
        """As the manifest records it: `columns` and `source` only when given (another source than prompts), so that
        runs without them keep their identity."""
        out: RecordedData = {"path": self.path, "n": self.n}
        if self.columns is not None:
            out["columns"] = self.columns
        if self.source != "prompts":
            out["source"] = self.source
        return out


def load_items(config: DataConfig, tokenizer: Any, context: int | None = None) -> tuple[list[Item], str]:
    """The items to run and the dataset hash, as the config's source reads them (`tasks.item_sources`): a JSONL
    file's bytes' SHA-256, the rows' as JSONL for any other source of prompts (`tasks.sources`), or the toy rows'
    (`toy_jsonl`); a rollout file's items (`tasks.rollouts`: checked against the tokenizer's vocabulary and `context`,
    read as a stream) and its bytes' SHA-256."""
    return source(config.source).load(config.path, config.n, config.columns, tokenizer, context)
