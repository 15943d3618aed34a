"""Tiny randomly initialised Hugging Face models of several architectures, saved to a folder like a real checkpoint."""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list(string.ascii_letters + string.digits + string.punctuation + " \n")
ARCHS = ("qwen2", "llama", "qwen3", "mistral", "gemma2", "gemma3")
SLIDING = ("mistral-sw", "gemma2", "gemma3")
"""Configurations whose sliding-window layers (window 8) are shorter than the tests' sequences."""
REFUSED = ("jamba", "bamba", "mamba")
"""Caches with recurrent state beside or instead of K/V: refused up front."""


def tiered(values, quick):
    """`values` as pytest parameters: those in `quick` run in the default tier, the others in the slow tier (CI runs
    both). A sweep keeps one case of each kind quick (a full-attention cache, a sliding-window one) and the whole
    sweep in CI."""
    import pytest

    missing = [v for v in quick if v not in values]
    assert not missing, f"quick cases {missing} are not among {values}"
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=() if v in quick else pytest.mark.slow)
            for v in values]


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
    from transformers import (
        BambaConfig,
        Gemma2Config,
        Gemma3TextConfig,
        JambaConfig,
        LlamaConfig,
        MambaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

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
    if arch == "mistral-sw":  # every layer a sliding window
        return MistralConfig(**common, sliding_window=sliding_window)
    if arch == "gemma2":  # alternating sliding-window and global layers
        return Gemma2Config(**common, head_dim=16, sliding_window=sliding_window)
    if arch == "gemma3":  # sliding-window layers with a global one after them, as Gemma 3 has (5:1 there)
        return Gemma3TextConfig(**common, head_dim=16, sliding_window=sliding_window,
                                layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
    if arch == "jamba":  # Mamba layers and attention layers
        return JambaConfig(**common, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                           expert_layer_offset=1, num_experts=2, mamba_d_state=4, mamba_expand=2)
    if arch == "bamba":  # Mamba-2 layers and attention layers
        return BambaConfig(**common, attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
                           mamba_d_state=8)
    if arch == "mamba":  # recurrent state only
        return MambaConfig(vocab_size=vocab_size(), hidden_size=hidden, num_hidden_layers=layers, state_size=4,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
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


# -- an R1-shaped model: a chat template that opens a think block, `</think>` inside a merged token or added ----

R1_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|User|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|Assistant|>{{ m['content'] }}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
)
R1_MESSAGES = [{"role": "user", "content": "What is 12+7? Think first."}]
THINK_CHAIN = ["</think>\n"[i:] for i in range(len("</think>\n") - 2, -1, -1)]
"""`>\n`, `k>\n`, ... `</think>\n`: BPE builds the merged token from the right, so `</think>` is never a token."""


def _r1_names(marker_kind: str) -> list[str]:
    names = [*SPECIALS, "<|User|>", "<|Assistant|>", *CHARS, *THINK_CHAIN, "an", "er", " t"]
    if marker_kind == "added":
        names += ["<think>", "</think>"]
    return names


def save_r1_tokenizer(path: Path, names: list[str], marker_kind: str) -> None:
    """A BPE tokenizer over `names` (index = ID) whose merges build `</think>\n` and no `</think>`.

    With `marker_kind="added"`, `<think>` and `</think>` are also added tokens, as in DeepSeek-R1-Distill.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chain = [(c[0], c[1:]) for c in THINK_CHAIN]
    merges = [*chain, ("a", "n"), ("e", "r"), (" ", "t")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(names)}, merges=merges, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    specials = [AddedToken(t, special=True, normalized=False) for t in [*SPECIALS, "<|User|>", "<|Assistant|>"]]
    tok.add_special_tokens(specials)
    if marker_kind == "added":
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = R1_TEMPLATE
    fast.save_pretrained(path)


def save_r1_model(path: Path, marker_kind: str = "merged", seed: int = 0, layers: int = 2) -> Path:
    """A random Qwen3 with an R1-shaped tokenizer whose greedy reply to `R1_MESSAGES` emits the marker token.

    The marker token (`</think>\n` when `marker_kind="merged"`, the added `</think>` when "added") is given
    the ID of a token the random model emits early in its greedy reply, by swapping two vocabulary entries
    (the model only sees IDs, and the prompt's IDs are unchanged). `r1.json` records the step at which it is
    emitted. Saved in bf16, greedy in bf16.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    names = _r1_names(marker_kind)
    marker = "</think>\n" if marker_kind == "merged" else "</think>"
    save_r1_tokenizer(path, names, marker_kind)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Qwen3 (in thinking mode, R1's template): AutoTokenizer keeps this tokenizer as built for a qwen3 config,
    # where for qwen2 it substitutes Qwen2's byte-level pre-tokenizer.
    config = make_config("qwen3", layers=layers)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model = model.to(torch.bfloat16)
    prompt = tokenizer.apply_chat_template(R1_MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40)[0, len(prompt):]
    reply = out.tolist()
    protected = set(prompt) | {names.index(t) for t in [*SPECIALS, "<|User|>", "<|Assistant|>"]}
    step = next(k for k in range(3, len(reply)) if reply[k] not in reply[:k] and reply[k] not in protected
                and 2 not in reply[:k])
    target, old = reply[step], names.index(marker)
    names[target], names[old] = names[old], names[target]
    save_r1_tokenizer(path, names, marker_kind)
    swapped = AutoTokenizer.from_pretrained(path)
    again = swapped.apply_chat_template(R1_MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert list(again) == list(prompt), "the swap changed the prompt's IDs"
    assert swapped.decode([target]) == marker
    model.save_pretrained(path)
    (path / "tiny.json").write_text(json.dumps({"arch": "qwen3", "seed": seed}))
    (path / "r1.json").write_text(json.dumps({"marker_kind": marker_kind, "boundary_step": step,
                                              "prompt_ids": list(prompt), "reply": reply}))
    return path


def save_window_model(path: Path, window: int) -> Path:
    """A Gemma 3 text model with SDPA, sliding-window layers of `window` alternating with global ones, context 512
    (the captured step's switch fires once a window has filled: tests/test_capture_sweep.py, tests/test_proof.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = make_config("gemma3", layers=4, sliding_window=window)
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(path)
    save_char_tokenizer(path)
    return path
