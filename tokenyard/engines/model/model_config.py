"""The subset of a Hugging Face config.json that the decoder needs, validated once at load."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.formats import gguf_reader

# Llama, Mistral and Qwen2 share one decoder shape; they differ only in the flags below
# (q/k/v bias for Qwen2, sliding window for Mistral), so one model class serves all three.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    torch_dtype: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        if Path(model_dir).suffix.lower() == ".gguf" and not Path(model_dir).is_dir():
            # a single-file checkpoint: its metadata is the config
            return cls.from_dict(gguf_reader.config_dict(model_dir))
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no config.json (is this a Hugging Face checkpoint folder?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: invalid JSON: {exc}") from exc
        cfg = cls.from_dict(raw)
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text())
            if gen.get("eos_token_id") is not None:
                cfg.eos_token_ids = _as_id_list(gen["eos_token_id"])
            if gen.get("bos_token_id") is not None:
                cfg.bos_token_id = int(gen["bos_token_id"])
        return cfg

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {raw.get('hidden_act')!r}; only 'silu' is implemented")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                o_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                sliding_window=_sliding_window(arch, raw),
                rope_scaling=_rope_scaling(raw),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                eos_token_ids=_as_id_list(raw.get("eos_token_id")),
                bos_token_id=raw.get("bos_token_id"),
            )
        except KeyError as exc:
            raise CheckpointError(f"config.json is missing required key {exc.args[0]!r}") from exc
        if cfg.num_heads % cfg.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({cfg.num_heads}) is not a multiple of num_key_value_heads ({cfg.num_kv_heads})")
        return cfg

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d
        layer = attn + 3 * d * f + 2 * d
        return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + d


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _sliding_window(arch: str, raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        return None  # Qwen2 configs carry a window value even when it is switched off.
    return int(window) if window else None


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return None
    return {**scaling, "rope_type": rope_type}


def llama3_inv_freq(inv_freq: "Any", scaling: dict[str, Any]) -> "Any":
    """Llama-3.1 frequency remapping: long wavelengths are divided by `factor`, short ones kept,
    and the band in between interpolated smoothly (the published llama3 rope_scaling rule)."""
    import torch

    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
