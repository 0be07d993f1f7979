"""The engine's one attention interface.

Every forward pass, whatever mix of prefill chunks, decode tokens and speculative verify chunks
it holds, is described by one `AttentionMetadata`: the flat batch's query lengths, each
sequence's context length, block tables and the slot of each new token. Layers call `attend`,
which writes the new K/V by slot mapping and attends over the paged prefix.

Backends: "torch" (tokenyard/kernels/paged_attention_torch.py: the CPU path and the reference) and
"triton" (tokenyard/kernels/paged_attention_triton.py: the CUDA path; also runs on CPU under
TRITON_INTERPRET=1, which the tests use). "auto" picks triton on CUDA and torch elsewhere.
The metadata is built once per step and shared by every layer.

A layer's caches are tensors in the model's dtype, or `tokenyard.kernels.kv_quant.QuantizedCache` (int8 /
fp8 codes with per-(token, kv head) scales, EngineConfig.kv_cache_dtype): both backends quantise
on write and dequantise on read, so nothing above this interface changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenyard.kernels import paged_attention_torch as torch_path
from tokenyard.kernels.paged_attention_torch import Cache

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(name: str, device: torch.device) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor    # [T] cache slot of each new token
    query_lens: list[int]         # per sequence, tokens in this pass
    seq_lens: list[int]           # per sequence, context length after this pass
    block_tables: list[list[int]]
    block_size: int
    backend: str
    sliding_window: int | None = None
    plan: torch_path.TorchAttentionPlan | None = None      # torch backend
    query_start_loc_t: torch.Tensor | None = None           # triton backend: int32 tensors
    seq_lens_t: torch.Tensor | None = None
    block_tables_t: torch.Tensor | None = None

    @classmethod
    def build(cls, slot_mapping: list[int], query_lens: list[int], seq_lens: list[int],
              block_tables: list[list[int]], block_size: int, sliding_window: int | None,
              device: torch.device, backend: str = "torch") -> "AttentionMetadata":
        backend = resolve_backend(backend, device)
        meta = cls(torch.tensor(slot_mapping, dtype=torch.long, device=device), query_lens, seq_lens,
                   block_tables, block_size, backend, sliding_window)
        if backend == "torch":
            meta.plan = torch_path.TorchAttentionPlan.build(query_lens, seq_lens, block_tables, block_size,
                                                            sliding_window, device)
        else:
            starts = [0]
            for n in query_lens:
                starts.append(starts[-1] + n)
            width = max(len(t) for t in block_tables)
            meta.query_start_loc_t = torch.tensor(starts, dtype=torch.int32, device=device)
            meta.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
            meta.block_tables_t = torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                                               dtype=torch.int32, device=device)
        return meta


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: Cache, v_cache: Cache,
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [KVH, slots, D]. Returns [T, H, D]."""
    if meta.backend == "torch":
        torch_path.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return torch_path.paged_attention(q, k_cache, v_cache, meta.plan, scale)
    from tokenyard.kernels import paged_attention_triton as triton_path  # imported only when used

    triton_path.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return triton_path.paged_attention(q, k_cache, v_cache, meta.query_start_loc_t, meta.seq_lens_t,
                                       meta.block_tables_t, meta.block_size, scale, meta.sliding_window,
                                       max_query_len=max(meta.query_lens))
