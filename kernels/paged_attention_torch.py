"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

One call covers every case the engine has: a flat batch of query chunks, each attending to its
sequence's whole cached prefix plus causally within the chunk. A decode token is a chunk of one,
a prefill chunk is a chunk of many, a speculative verify pass is a chunk of k+1.

Layout: the K and V caches of a layer are [num_slots, num_kv_heads, head_dim] with
num_slots = num_blocks * block_size; token t of a sequence lives in slot
block_table[t // block_size] * block_size + t % block_size.

The gather indices depend only on the batch, not on the layer, so they are built once per step
(`TorchAttentionPlan.build`) and reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, kv_heads, head_dim] into their slots."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


@dataclass(slots=True)
class _Chunk:
    q_start: int
    q_end: int
    slots: torch.Tensor          # [L] cache slots of positions 0..L-1
    mask: torch.Tensor | None    # [n, L] bool, True = attend; None means plain causal (no prefix)


@dataclass(slots=True)
class TorchAttentionPlan:
    # Decode rows (query length 1) are batched: one padded gather and two matmuls for all.
    decode_rows: torch.Tensor | None     # [Bd] row of each decode token in the flat query
    decode_slots: torch.Tensor | None    # [Bd, maxL]
    decode_mask: torch.Tensor | None     # [Bd, 1, 1, maxL] additive (0 or -inf)
    chunks: list[_Chunk]                  # longer chunks, one SDPA each

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, sliding_window: int | None = None,
              device: torch.device | str = "cpu") -> "TorchAttentionPlan":
        decode_idx = [i for i, n in enumerate(query_lens) if n == 1]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        decode_rows = decode_slots = decode_mask = None
        if decode_idx:
            lens = torch.tensor([seq_lens[i] for i in decode_idx], device=device)
            max_len = int(lens.max())
            width = -(-max_len // block_size)
            table = torch.zeros(len(decode_idx), width, dtype=torch.long, device=device)
            for row, i in enumerate(decode_idx):
                bt = block_tables[i][:width]
                table[row, :len(bt)] = torch.tensor(bt, dtype=torch.long)
            pos = torch.arange(max_len, device=device)
            decode_slots = table[:, pos // block_size] * block_size + pos % block_size
            valid = pos[None, :] < lens[:, None]
            if sliding_window is not None:
                valid &= pos[None, :] > (lens[:, None] - 1 - sliding_window)
            decode_mask = torch.zeros(valid.shape, dtype=torch.float32, device=device)
            decode_mask.masked_fill_(~valid, float("-inf"))
            decode_mask = decode_mask[:, None, None, :]
            decode_rows = torch.tensor([starts[i] for i in decode_idx], dtype=torch.long, device=device)
        chunks = []
        for i, n in enumerate(query_lens):
            if n == 1:
                continue
            length = seq_lens[i]
            pos = torch.arange(length, device=device)
            bt = torch.tensor(block_tables[i], dtype=torch.long, device=device)
            slots = bt[pos // block_size] * block_size + pos % block_size
            mask = None
            if length != n or (sliding_window is not None and length > sliding_window):
                q_pos = torch.arange(length - n, length, device=device)
                allowed = pos[None, :] <= q_pos[:, None]
                if sliding_window is not None:
                    allowed &= pos[None, :] > (q_pos[:, None] - sliding_window)
                mask = allowed
            chunks.append(_Chunk(starts[i], starts[i] + n, slots, mask))
        return cls(decode_rows, decode_slots, decode_mask, chunks)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    plan: TorchAttentionPlan, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]. K/V of the new tokens must be written first."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if plan.decode_rows is not None:
        rows = plan.decode_rows
        batch = rows.numel()
        # [B, kvh, group, 1, hd] against [B, kvh, 1, L, hd]: GQA without repeating K/V.
        qd = q.index_select(0, rows).view(batch, num_kv_heads, group, head_dim).unsqueeze(3)
        k = k_cache[plan.decode_slots].permute(0, 2, 1, 3).unsqueeze(2)
        v = v_cache[plan.decode_slots].permute(0, 2, 1, 3).unsqueeze(2)
        scores = torch.matmul(qd, k.transpose(-1, -2)).mul_(scale)
        scores.add_(plan.decode_mask.unsqueeze(1).to(scores.dtype))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        od = torch.matmul(probs, v)  # [B, kvh, group, 1, hd]
        out.index_copy_(0, rows, od.reshape(batch, num_heads, head_dim))
    for c in plan.chunks:
        qc = q[c.q_start:c.q_end].transpose(0, 1)            # [H, n, hd]
        kc = k_cache[c.slots].transpose(0, 1)                 # [kvh, L, hd]
        vc = v_cache[c.slots].transpose(0, 1)
        if c.mask is None:
            oc = torch.nn.functional.scaled_dot_product_attention(
                qc, kc, vc, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            oc = torch.nn.functional.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=c.mask, scale=scale, enable_gqa=group > 1)
        out[c.q_start:c.q_end] = oc.transpose(0, 1)
    return out
