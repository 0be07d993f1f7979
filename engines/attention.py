"""The engine's one attention interface.

Every forward pass, whatever mix of prefill chunks, decode tokens and speculative verify chunks
it holds, is described by one `AttentionMetadata`: the flat batch's query lengths, each
sequence's context length, block tables and the slot of each new token. Layers call `attend`,
which writes the new K/V by slot mapping and attends over the paged prefix.

Backends: "torch" (CPU, and the reference); "triton" arrives with the GPU kernels (issue 6).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention_torch import TorchAttentionPlan, paged_attention, write_kv

BACKENDS = ("torch",)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor    # [T] cache slot of each new token
    query_lens: list[int]         # per sequence, tokens in this pass
    seq_lens: list[int]           # per sequence, context length after this pass
    block_tables: list[list[int]]
    block_size: int
    backend: str
    plan: TorchAttentionPlan | None = None

    @classmethod
    def build(cls, slot_mapping: list[int], query_lens: list[int], seq_lens: list[int],
              block_tables: list[list[int]], block_size: int, sliding_window: int | None,
              device: torch.device, backend: str = "torch") -> "AttentionMetadata":
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; available: {', '.join(BACKENDS)}")
        plan = TorchAttentionPlan.build(query_lens, seq_lens, block_tables, block_size, sliding_window, device)
        return cls(torch.tensor(slot_mapping, dtype=torch.long, device=device), query_lens, seq_lens,
                   block_tables, block_size, backend, plan)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [KVH, slots, D]. Returns [T, H, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return paged_attention(q, k_cache, v_cache, meta.plan, scale)
