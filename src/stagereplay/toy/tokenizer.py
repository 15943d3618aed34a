"""The toy model's character-level tokenizer, saved so that `AutoTokenizer.from_pretrained` loads it.

One token per character of the task's alphabet, plus `<|bos|>`, `<|eos|>`, `<|pad|>` and `<|unk|>`.
Encoding prepends BOS (as Llama-style tokenizers do), and the decoder concatenates tokens with no
separator, so `decode(ids, skip_special_tokens=True)` returns the original text and re-encoding that
text returns the same ids: the `retokenized` construction round-trips on this model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
"""Ids 0..3, in this order."""
ALPHABET = "0123456789+=,|:?\nAQ"
"""Every character the toy task writes; anything else encodes as `<|unk|>`."""


def vocabulary() -> dict[str, int]:
    return {token: index for index, token in enumerate((*SPECIAL_TOKENS, *ALPHABET))}


def build_tokenizer() -> Any:
    """A `tokenizers.Tokenizer`: BPE with no merges, so each character is its own token."""
    from tokenizers import Tokenizer, decoders, models, processors

    vocab = vocabulary()
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    # Without a decoder, `decode` joins tokens with spaces; Fuse concatenates them as written.
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    """`tokenizer_config.json`: names the special tokens so `transformers` sets bos/eos/pad ids."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "padding_side": "left",
    }


def save_tokenizer(directory: Path) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def special_token_ids() -> dict[str, int]:
    """`{"pad": 0, "bos": 1, "eos": 2, "unk": 3}`: what `config.json` and `generation_config.json` record."""
    vocab = vocabulary()
    return {"pad": vocab[PAD], "bos": vocab[BOS], "eos": vocab[EOS], "unk": vocab[UNK]}
