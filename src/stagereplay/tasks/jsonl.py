"""Item sources from JSONL files: `prompt` or `messages` rows, and GSM8K rows (`question`, `answer` ... `#### N`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.tasks.base import Item


@dataclass(frozen=True)
class Row:
    """One parsed line, before tokenisation."""

    id: str
    answer: str
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


def _gsm8k_answer(answer: str, where: str) -> str:
    if "####" not in answer:
        raise StageReplayError(f"{where}: GSM8K answer has no '#### N' line", "end the answer with '#### <number>'")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def parse_row(raw: Any, index: int, where: str) -> Row:
    if not isinstance(raw, dict):
        raise StageReplayError(f"{where}: expected a JSON object, got {type(raw).__name__}",
                               "write one object per line")
    item_id = str(raw.get("id", f"item-{index:05d}"))
    if "question" in raw and "prompt" not in raw and "messages" not in raw:
        if not isinstance(raw.get("answer"), str):
            raise StageReplayError(f"{where}: GSM8K row needs a string 'answer'", "add the answer text")
        return Row(item_id, _gsm8k_answer(raw["answer"], where), prompt=str(raw["question"]))
    if "answer" not in raw:
        raise StageReplayError(f"{where}: missing 'answer'", "give every row an 'answer'")
    answer = str(raw["answer"])
    if "messages" in raw:
        msgs = raw["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise StageReplayError(f"{where}: 'messages' must be a list of {{role, content}} objects",
                                   "fix the messages field")
        return Row(item_id, answer, messages=tuple({"role": m["role"], "content": m["content"]} for m in msgs))
    if isinstance(raw.get("prompt"), str):
        return Row(item_id, answer, prompt=raw["prompt"])
    raise StageReplayError(f"{where}: needs 'prompt' (text), 'messages' or 'question'", "add one of them")


def read_rows(path: Path) -> list[Row]:
    """Parse the whole file before anything runs, so a bad line fails fast with its line number."""
    if not path.is_file():
        raise StageReplayError(f"data file not found: {path}", "pass --data a JSONL file")
    rows: list[Row] = []
    seen: set[str] = set()
    with open(path, "rb") as f:
        for lineno, raw_line in enumerate(f, start=1):
            where = f"{path} line {lineno}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError:
                raise StageReplayError(f"{where} is not UTF-8 text", "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise StageReplayError(f"{where} is not valid JSON ({exc.msg})", "fix or remove that line") from None
            row = parse_row(raw, len(rows), where)
            if row.id in seen:
                raise StageReplayError(f"{where}: duplicate id {row.id!r}", "give every item a unique id")
            seen.add(row.id)
            rows.append(row)
    if not rows:
        raise StageReplayError(f"data file {path} holds no items", "add at least one JSON line")
    return rows


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenize_row(row: Row, tokenizer: Any) -> Item:
    if row.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise StageReplayError(f"item {row.id} has 'messages' but the tokenizer has no chat template",
                                   "use 'prompt' rows or a tokenizer with a chat template")
        out = tokenizer.apply_chat_template(list(row.messages), add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        text = tokenizer.decode(ids)
    else:
        text = row.prompt or ""
        ids = tokenizer.encode(text, add_special_tokens=True)
    return Item(id=row.id, prompt_ids=tuple(int(t) for t in ids), answer=row.answer, prompt_text=text)
