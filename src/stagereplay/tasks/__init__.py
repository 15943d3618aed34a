"""Item sources (the embedded toy task, JSONL, GSM8K-style JSONL) and scorers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.tasks.base import Item, Scorer, exact_match, last_number, regex_scorer
from stagereplay.tasks.jsonl import file_sha256, read_rows, tokenize_row
from stagereplay.tasks.scoring import scorer_by_name

__all__ = ["DataConfig", "Item", "Scorer", "exact_match", "last_number", "load_items", "regex_scorer",
           "scorer_by_name"]


@dataclass(frozen=True)
class DataConfig:
    """Where items come from. `path=None` means the embedded toy task's held-out items."""

    path: str | None = field(default=None, metadata={"help": "JSONL file; none = the toy task"})
    n: int | None = field(default=None, metadata={"help": "first n items (all when None)"})

    def __post_init__(self) -> None:
        if self.n is not None and self.n < 1:
            raise StageReplayError(f"--n must be at least 1, got {self.n}", "pass a positive --n")


def load_items(config: DataConfig, tokenizer: Any) -> tuple[list[Item], str]:
    """The items to run and the SHA-256 of their JSONL: the file's bytes, or the toy rows' (`toy_jsonl`)."""
    if config.path is None:
        from stagereplay.tasks.toy import HELDOUT_SEED, toy_data_hash, toy_items

        n = config.n or 200
        return toy_items(n, HELDOUT_SEED, tokenizer), toy_data_hash(n, HELDOUT_SEED)
    path = Path(config.path)
    rows = read_rows(path)
    if config.n is not None and config.n > len(rows):
        raise StageReplayError(f"--n {config.n} is larger than the {len(rows)} items in {path}",
                               f"pass --n {len(rows)} or fewer")
    rows = rows[: config.n] if config.n else rows
    return [tokenize_row(r, tokenizer) for r in rows], file_sha256(path)
