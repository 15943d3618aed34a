"""Tiny randomly initialised Hugging Face models of several architectures, saved to a folder like a real checkpoint."""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list(string.ascii_letters + string.digits + string.punctuation + " \n")
ARCHS = ("qwen2", "llama", "qwen3", "mistral", "gemma2")


def save_char_tokenizer(path: Path) -> None:
    """A character-level fast tokenizer that AutoTokenizer loads, with bos/eos/pad."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(path)


def vocab_size() -> int:
    return len(SPECIALS) + len(CHARS)


def make_config(arch: str, layers: int = 4, hidden: int = 64, sliding_window: int = 8):
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size(),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=16)
    if arch == "mistral":
        return MistralConfig(**common)
    if arch == "gemma2":  # alternating sliding-window and global layers
        return Gemma2Config(**common, head_dim=16, sliding_window=sliding_window)
    raise ValueError(arch)


def save_tiny_model(
    path: Path, arch: str = "qwen2", seed: int = 0, layers: int = 4, hidden: int = 64
) -> Path:
    """Random weights in bf16 safetensors (so fp32 is an exact upcast), plus a char tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, layers, hidden), dtype=torch.float32)
    with (
        torch.no_grad()
    ):  # a larger init spread makes near-ties (and so bf16 divergence) likelier in few layers
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(path)
    save_char_tokenizer(path)
    (path / "tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}))
    return path
