"""Item sources (the embedded toy task; JSONL, JSON, CSV, Parquet, datasets folders and hf: datasets) and scorers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.tasks.base import Item, Scorer, exact_match, last_number, regex_scorer
from stagereplay.tasks.jsonl import tokenize_row
from stagereplay.tasks.rollouts import mapping as rollout_columns
from stagereplay.tasks.rollouts import scan
from stagereplay.tasks.scoring import scorer_by_name
from stagereplay.tasks.sources import parse_columns, read_rows

__all__ = ["DataConfig", "Item", "Scorer", "exact_match", "last_number", "load_items", "regex_scorer",
           "scorer_by_name"]


@dataclass(frozen=True)
class DataConfig:
    """Where items come from. `path=None` means the embedded toy task's held-out items."""

    path: str | None = field(default=None, metadata={"help": "JSONL, JSON, CSV or Parquet file, a save_to_disk "
                                                             "folder, or hf:NAME[:CONFIG][:SPLIT]; none = the toy"})
    n: int | None = field(default=None, metadata={"help": "first n items (all when None)"})
    columns: str | None = field(default=None, metadata={"help": "TARGET=COLUMN,... (prompt, messages, user, "
                                                                "answer, id)"})
    rollouts: bool = field(default=False, metadata={"help": "the file holds rollouts (tasks.rollouts), not prompts"})

    def __post_init__(self) -> None:
        if self.n is not None and self.n < 1:
            raise StageReplayError(f"--n must be at least 1, got {self.n}", "pass a positive --n")
        if self.columns is not None and self.path is None:
            raise StageReplayError("--columns maps the columns of --data, and no --data is given",
                                   "pass --data, or drop --columns")
        if self.rollouts:
            rollout_columns(self.columns)
        else:
            parse_columns(self.columns)

    def as_dict(self) -> dict[str, Any]:
        """As the manifest records it: `columns` and `rollouts` only when given, so that runs without them keep
        their identity."""
        out: dict[str, Any] = {"path": self.path, "n": self.n}
        if self.columns is not None:
            out["columns"] = self.columns
        return {**out, "rollouts": True} if self.rollouts else out


def load_items(config: DataConfig, tokenizer: Any, context: int | None = None) -> tuple[list[Item], str]:
    """The items to run and the dataset hash: a JSONL file's bytes' SHA-256, the rows' as JSONL for any other
    source (`tasks.sources`), or the toy rows' (`toy_jsonl`); a rollout file's items (`tasks.rollouts`: checked
    against the tokenizer's vocabulary and `context`, read as a stream) and its bytes' SHA-256."""
    if config.rollouts and config.path is not None:
        vocab = max(len(tokenizer), int(getattr(tokenizer, "vocab_size", 0) or 0))
        found, data_hash = scan(config.path, config.columns, vocab, context or 1 << 31, config.n)
        return list(found), data_hash
    if config.path is None:
        from stagereplay.tasks.toy import HELDOUT_SEED, toy_data_hash, toy_items

        n = config.n or 200
        return toy_items(n, HELDOUT_SEED, tokenizer), toy_data_hash(n, HELDOUT_SEED)
    rows, data_hash = read_rows(config.path, config.columns)
    if config.n is not None and config.n > len(rows):
        raise StageReplayError(f"--n {config.n} is larger than the {len(rows)} items in {config.path}",
                               f"pass --n {len(rows)} or fewer")
    rows = rows[: config.n] if config.n else rows
    return [tokenize_row(r, tokenizer) for r in rows], data_hash
