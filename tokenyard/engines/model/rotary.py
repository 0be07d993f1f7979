"""Rotary position embeddings (half-rotation layout, as Llama/Mistral/Qwen2 checkpoints use)."""
from __future__ import annotations

import torch

from tokenyard.engines.model.model_config import ModelConfig, llama3_inv_freq


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        dim = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = cfg.rope_scaling or {}
        if scaling.get("rope_type") == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        elif scaling.get("rope_type") == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        # Same fp32 arithmetic as the reference implementation, tabulated once per position.
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D], positions: [T]."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(q.dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
