"""GGUF files the tests write themselves (no network, no llama.cpp converter): the embedded toy reasoning model
(Qwen2, byte-level BPE, `</think>` as stage 1's end) in llama.cpp's `qwen2` layout, with the `gguf` package.

Qwen2 runs NEOX-style RoPE in llama.cpp, so its Q/K weights are written as transformers holds them (llama.cpp's
converter permutes only LLaMA-style models); the tied output matrix is the token embedding, as the converter writes
a model with `tie_word_embeddings`. The toy's BPE has no merges: the list is written empty (llama.cpp refuses a
BPE vocabulary without the key).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _tensors(folder: Path, dtype: str) -> dict[str, object]:
    import numpy as np
    import torch
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))  # bf16: read through torch, which has the dtype
    np_dtype = {"f32": np.float32, "f16": np.float16}[dtype]
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
                 "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
                 "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    out: dict[str, object] = {}
    for name, t in state.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gguf_name = f"blk.{i}.{per_layer[rest]}"
        else:
            gguf_name = names[name]
        # Norms and biases stay f32 (llama.cpp's converter keeps 1-D tensors in f32).
        keep32 = t.dim() == 1
        out[gguf_name] = t.to(torch.float32).numpy().astype(np.float32 if keep32 else np_dtype)
    return out


def _writer(path: Path, arch: str) -> object:
    """gguf's writer, able to write an empty string array (its own refuses one; the format allows it)."""
    import gguf

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):  # type: ignore[no-untyped-def]
            if vtype == gguf.GGUFValueType.ARRAY and len(val) == 0 and sub_type is not None:
                head = self._pack("I", vtype) if add_vtype else b""
                return head + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer(str(path), arch)


def write_toy_gguf(path: Path, checkpoint: str = "primary", dtype: str = "f32", seed_noise: float = 0.0) -> Path:
    """The toy checkpoint as a GGUF file at `path` (weights in f32 or f16). `seed_noise` > 0 perturbs one weight
    by that much: another model with another hash, for the negative controls."""
    import gguf

    from stagereplay.toy import toy_checkpoint
    from stagereplay.toy.tokenizer import ADDED_TOKENS, CHAT_TEMPLATE, SPECIAL_TOKENS, vocabulary

    folder = toy_checkpoint(checkpoint)
    config = json.loads((folder / "config.json").read_text())
    tensors = _tensors(folder, dtype)
    if seed_noise:
        tensors["output_norm.weight"][0] += seed_noise  # type: ignore[index]
    w: Any = _writer(path, "qwen2")
    w.add_name(f"stagereplay toy {checkpoint}")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    vocab = vocabulary()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    # transformers builds a GGUF's byte-level tokenizer with GPT-2's `<|endoftext|>` as its default special token, and
    # adds it past the model's vocabulary when the file lacks it (real Qwen and SmolLM files have it). The toy's pad
    # token, which no prompt or output holds, takes that name.
    tokens[config["pad_token_id"]] = "<|endoftext|>"
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for t in ADDED_TOKENS:
        types[vocab[t]] = gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.USER_DEFINED
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    # No merges (the toy's BPE has none), written as the empty string array llama.cpp requires to find.
    w.add_key_value(gguf.Keys.Tokenizer.MERGES, [], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_pad_token_id(config["pad_token_id"])
    w.add_add_bos_token(False)  # the chat template writes <|bos|>
    w.add_chat_template(CHAT_TEMPLATE)
    for name, array in tensors.items():
        w.add_tensor(name, array)  # type: ignore[arg-type]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
