"""Rows into items: `prompt` or `messages` rows, GSM8K rows (`question`, `answer` ... `#### N`) and MATH-style rows
(`problem`, `answer`, `unique_id`), whatever file or dataset they were read from (`tasks.sources`)."""

from __future__ import annotations

import hashlib
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


def parse_row(raw: Any, index: int, where: str, answers: bool = True) -> Row:
    """One row as an item's text and gold answer; `answers=False` for a run that reads no answer (a row's answer,
    of any form or none, is then not read: its answer is '')."""
    if not isinstance(raw, dict):
        raise StageReplayError(f"{where}: expected a JSON object, got {type(raw).__name__}",
                               "write one object per line")
    item_id = str(raw.get("id", raw.get("unique_id", f"item-{index:05d}")))
    if not answers:
        raw = {**{k: v for k, v in raw.items() if k != "answer"}, "answer": ""}
        if "question" in raw and "prompt" not in raw and "messages" not in raw:
            raw["prompt"] = str(raw["question"])
    if "question" in raw and "prompt" not in raw and "messages" not in raw:
        if not isinstance(raw.get("answer"), str):
            raise StageReplayError(f"{where}: GSM8K row needs a string 'answer'", "add the answer text")
        return Row(item_id, _gsm8k_answer(raw["answer"], where), prompt=str(raw["question"]))
    if "answer" not in raw or raw["answer"] is None:
        raise StageReplayError(f"{where}: missing 'answer'", "give every row an 'answer' (or map one: --columns "
                                                              "answer=COLUMN)")
    answer = str(raw["answer"])
    if "question" in raw and "####" in answer:  # a GSM8K row whose question is mapped (--columns user=question)
        answer = _gsm8k_answer(answer, where)
    if "messages" in raw:
        msgs = raw["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise StageReplayError(f"{where}: 'messages' must be a list of {{role, content}} objects",
                                   "fix the messages field")
        return Row(item_id, answer, messages=tuple({"role": m["role"], "content": m["content"]} for m in msgs))
    if isinstance(raw.get("prompt"), str):
        return Row(item_id, answer, prompt=raw["prompt"])
    if isinstance(raw.get("problem"), str) and "prompt" not in raw:  # MATH-500, AIME: the problem as raw text
        return Row(item_id, answer, prompt=raw["problem"])
    raise StageReplayError(f"{where}: needs 'prompt' (text), 'messages', 'question' or 'problem'",
                           "add one of them, or map a column: --columns prompt=COLUMN (or user=COLUMN for a chat)")


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
