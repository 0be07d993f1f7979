"""Which tensor of a Hugging Face checkpoint fills which parameter of `CausalLM`, with its shape.

Shared by the safetensors loader (checkpoint.py) and the GGUF loader (gguf_loader.py): both map
names to the same targets, so a missing, unexpected or mis-shaped tensor is the same error whatever
the file format.
"""
from __future__ import annotations

from tokenyard.engines.model.model_config import ModelConfig

# Show a progress bar only when loading takes long enough to wonder about.
PROGRESS_MIN_BYTES = 256 * 1024 * 1024


def parameter_targets(cfg: ModelConfig) -> dict[str, tuple[str, slice | None, tuple[int, ...]]]:
    """HF tensor name -> (our parameter name, row slice into a fused parameter, expected shape)."""
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    out: dict[str, tuple[str, slice | None, tuple[int, ...]]] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", None, (cfg.vocab_size, d)),
        "model.norm.weight": ("norm.weight", None, (d,)),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ("lm_head.weight", None, (cfg.vocab_size, d))
    for i in range(cfg.num_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        out[hf + "input_layernorm.weight"] = (us + "input_layernorm.weight", None, (d,))
        out[hf + "post_attention_layernorm.weight"] = (us + "post_attention_layernorm.weight", None, (d,))
        parts = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
        for name, rows in parts.items():
            n = rows.stop - rows.start
            out[f"{hf}self_attn.{name}.weight"] = (us + "qkv_proj.weight", rows, (n, d))
            if cfg.qkv_bias:
                out[f"{hf}self_attn.{name}.bias"] = (us + "qkv_proj.bias", rows, (n,))
        out[hf + "self_attn.o_proj.weight"] = (us + "o_proj.weight", None, (d, q))
        if cfg.o_bias:
            out[hf + "self_attn.o_proj.bias"] = (us + "o_proj.bias", None, (d,))
        for name, rows in {"gate_proj": slice(0, f), "up_proj": slice(f, 2 * f)}.items():
            out[f"{hf}mlp.{name}.weight"] = (us + "gate_up_proj.weight", rows, (f, d))
            if cfg.mlp_bias:
                out[f"{hf}mlp.{name}.bias"] = (us + "gate_up_proj.bias", rows, (f,))
        out[hf + "mlp.down_proj.weight"] = (us + "down_proj.weight", None, (d, f))
        if cfg.mlp_bias:
            out[hf + "mlp.down_proj.bias"] = (us + "down_proj.bias", None, (d,))
    return out
