"""The toy model's tokenizer and chat template: Qwen2's byte-level BPE with no merges (one token per byte),
plus the added tokens and the chat template of a DeepSeek-R1-Distill-style reasoning model.

`AutoTokenizer.from_pretrained` on a `qwen2` checkpoint always builds `Qwen2Tokenizer`, which keeps only
the vocabulary and merges of `tokenizer.json` and supplies its own normalizer (NFC), pre-tokenizer (the
Qwen2 split regex, then ByteLevel) and ByteLevel decoder. So the toy tokenizer is written in exactly
that form: the 256 byte symbols (token id = byte value) plus `<|pad|>`, `<|bos|>`, `<|eos|>`, no merges.
The toy checkpoint then loads through the same class and code path as a user's Qwen2.5 checkpoint, and
`build_tokenizer()` (the `tokenizers` object used in training) encodes every text to the same ids.

Added tokens, ids 256 on: `<|pad|>`, `<|bos|>`, `<|eos|>`, `<|user|>`, `<|assistant|>` (special: decoding
with `skip_special_tokens=True` drops them) and `<think>`, `</think>` (added but not special, as in
DeepSeek-R1-Distill's tokenizer: the decoded text keeps them, so a scorer or a regex can see the think
block). Each is one token wherever it appears in a text. The chat template (`CHAT_TEMPLATE`) renders
`messages` as `<|bos|><|user|>...<|assistant|><think>\n`: the prompt ends inside the assistant's opening
think block, as R1-Distill's does, and the model writes the rest.

Byte-level BPE is lossless: `decode(ids, skip_special_tokens=True)` returns the original text and
re-encoding it returns the same ids. Encoding prepends `<|bos|>` (Qwen2.5 itself adds no BOS; the toy
does so that every sequence starts at a fixed token).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
THINK, END_THINK = "<think>", "</think>"
SPECIAL_TOKENS = (PAD, BOS, EOS, USER, ASSISTANT)
"""Ids 256-260, after the 256 byte tokens; dropped by `decode(..., skip_special_tokens=True)`."""
THINK_TOKENS = (THINK, END_THINK)
"""Ids 261, 262: single tokens that decoding keeps (R1-Distill marks them `special: false` too)."""
ADDED_TOKENS = SPECIAL_TOKENS + THINK_TOKENS
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' + message['content'] + eos_token }}"
    "{% else %}{{ message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|><think>\\n' }}{% endif %}"
)
"""Jinja chat template: system text first as is, user turns after `<|user|>`, the generation prompt last."""
# Qwen2Tokenizer's pre-tokenizer split; without merges it changes no ids, but keeping the same pipeline
# keeps the raw `tokenizers` object and the class transformers builds in agreement by construction.
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255 (`\\n` is `Ċ`), indexed by byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def vocabulary() -> dict[str, int]:
    """Byte symbol -> byte value, then the special tokens."""
    vocab = {symbol: index for index, symbol in enumerate(byte_symbols())}
    vocab.update({token: 256 + offset for offset, token in enumerate(ADDED_TOKENS)})
    return vocab


def render_prompt(messages: list[dict[str, str]]) -> str:
    """`CHAT_TEMPLATE` with `add_generation_prompt=True`, in Python: what training encodes (a test checks
    that it equals `apply_chat_template`'s text)."""
    parts = [BOS]
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "user":
            parts.append(USER + content)
        elif role == "assistant":
            parts.append(ASSISTANT + content + EOS)
        else:
            parts.append(content)
    parts.append(f"{ASSISTANT}{THINK}\n")
    return "".join(parts)


def special_token_ids() -> dict[str, int]:
    """`{"pad": 256, "bos": 257, "eos": 258}`: what `config.json` and `generation_config.json` record."""
    vocab = vocabulary()
    return {"pad": vocab[PAD], "bos": vocab[BOS], "eos": vocab[EOS]}


def build_tokenizer() -> Any:
    """A `tokenizers.Tokenizer` with Qwen2Tokenizer's pipeline, the byte vocabulary and a BOS template."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    vocab = vocabulary()
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix="")
    )
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK_TOKENS])
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    """`tokenizer_config.json`: the class transformers builds anyway, and the special tokens by name."""
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(directory: Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
