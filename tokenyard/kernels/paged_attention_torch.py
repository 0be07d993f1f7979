"""Paged attention in plain torch: the CPU path and the reference for the Triton kernels.

One call covers every case the engine has: a flat batch of query chunks, each attending to its
sequence's whole cached prefix plus causally within the chunk. A decode token is a chunk of one,
a prefill chunk is a chunk of many, a speculative verify pass is a chunk of k+1.

Layout: the K and V caches of a layer are [num_kv_heads, num_slots, head_dim] with
num_slots = num_blocks * block_size; token t of a sequence lives in slot
block_table[t // block_size] * block_size + t % block_size. Heads outermost makes one block of
one head a contiguous [block_size, head_dim] tile: a gather copies whole tiles, and the gathered
keys come out as [kv_heads, batch, length, head_dim], ready for batched matmuls with no
further transpose copies.

The gather indices depend only on the batch, not on the layer, so they are built once per step
(`TorchAttentionPlan.build`) and reused by every layer.

Quantised caches (tokenyard/kernels/kv_quant.py, EngineConfig.kv_cache_dtype int8 / fp8_e4m3): a cache is
then a `QuantizedCache` (codes plus one scale per kv head and slot). Writes quantise the new
tokens; reads gather the codes and their scales with the same indices, so only the keys a step
attends to are ever widened. Prefill chunks dequantise the gathered tiles; decode groups
(tokenyard/kernels/decode_group_torch.py) fold the scales into the scores and probabilities instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenyard.kernels.decode_group_torch import DecodeGroup, attend_group, gather_rows
from tokenyard.kernels.kv_quant import QuantizedCache, dequantize, quantize

Cache = torch.Tensor | QuantizedCache   # one layer's K (or V) cache

# Gathers and scatters go through a 2-D view [kv_heads * rows, row_width] with per-head row
# indices: torch's dim-0 index_select/index_copy are several times faster on CPU than the same
# operation along dim 1.


def _head_rows(rows: torch.Tensor, num_kv_heads: int, rows_per_head: int) -> torch.Tensor:
    heads = torch.arange(num_kv_heads, device=rows.device)[:, None] * rows_per_head
    return (heads + rows.reshape(1, -1)).reshape(-1)


def write_kv(k_cache: Cache, v_cache: Cache, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, kv_heads, head_dim] into their slots (quantised when the cache is)."""
    kvh, num_slots, hd = k_cache.shape
    idx = _head_rows(slot_mapping, kvh, num_slots)
    if isinstance(k_cache, QuantizedCache):
        # K and V quantised in one call: a decode step writes one token per layer, so the dozen
        # small ops of quantize, not the data, are the cost (0.19 -> 0.09 ms a layer at W2's
        # shapes, 1 thread; the whole write was most of why int8 lagged fp32 at batch 1).
        codes, scale = quantize(torch.stack((k, v)).transpose(1, 2), k_cache.data.dtype)  # [2, kvh, T, hd]
        for i, cache in enumerate((k_cache, v_cache)):
            cache.bytes_view.view(-1, hd).index_copy_(0, idx, codes[i].view(torch.uint8).reshape(-1, hd))
            cache.scale.view(-1).index_copy_(0, idx, scale[i].reshape(-1))
        return
    for cache, x in ((k_cache, k), (v_cache, v)):
        cache.view(-1, hd).index_copy_(0, idx, x.transpose(0, 1).reshape(-1, hd))   # [kvh * T, hd]


@dataclass(slots=True)
class _Tile:
    q_lo: int                    # query rows [q_lo, q_hi) within the chunk
    q_hi: int
    k_lo: int                    # key positions [k_lo, k_hi) any of those queries may see
    k_hi: int
    bias: torch.Tensor           # [q_hi - q_lo, k_hi - k_lo] additive mask (0 or -inf)


@dataclass(slots=True)
class _Chunk:
    q_start: int
    q_end: int
    slots: torch.Tensor          # [L] cache slots of positions 0..L-1
    tiles: list[_Tile]
    gather: torch.Tensor | None = None  # row indices into the 2-D cache view; set by the first layer


# Query rows per tile of a chunk. Tiling keeps the [tile, keys] score matrix in cache and lets
# each tile skip the keys that causality hides from it; on two CPU cores this is ~4x faster
# than one SDPA call over a 512-token chunk.
_Q_TILE = 128


# Chunks of at most this many queries (decode tokens, speculative verify chunks) are batched
# like decodes; a per-chunk loop would pay a handful of small ops per chunk and per layer.
_SHORT_QUERY = 16


@dataclass(slots=True)
class TorchAttentionPlan:
    # Decode rows and other short chunks are batched: one group per equal query length, attended
    # over a padded gather of whole blocks (tokenyard/kernels/decode_group_torch.py). Rows are grouped by
    # context length so short contexts are not padded to the longest one (padding is gathered
    # and multiplied for nothing).
    decode_groups: list[DecodeGroup]
    chunks: list[_Chunk]                  # longer chunks, one SDPA each

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, sliding_window: int | None = None,
              device: torch.device | str = "cpu") -> "TorchAttentionPlan":
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        groups = []
        for n in sorted({n for n in query_lens if n <= _SHORT_QUERY}):
            idx = sorted((i for i, m in enumerate(query_lens) if m == n), key=lambda i: -seq_lens[i])
            groups += [_decode_group(g, n, starts, seq_lens, block_tables, block_size, sliding_window, device)
                       for g in _length_buckets(idx, seq_lens)]
        chunks = []
        for i, n in enumerate(query_lens):
            if n <= _SHORT_QUERY:
                continue
            length = seq_lens[i]
            pos = torch.arange(length, device=device)
            bt = torch.tensor(block_tables[i], dtype=torch.long, device=device)
            slots = bt[pos // block_size] * block_size + pos % block_size
            chunks.append(_Chunk(starts[i], starts[i] + n, slots,
                                 _tiles(n, length, sliding_window, device)))
        return cls(groups, chunks)


# A new group starts when a context is shorter than this share of the group's longest, unless
# the group is still small: each group costs a few extra ops, so tiny groups are not worth it.
_BUCKET_RATIO = 0.7
_MIN_GROUP = 8


def _length_buckets(order: list[int], seq_lens: list[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    for i in order:  # longest first
        if groups and (len(groups[-1]) < _MIN_GROUP or seq_lens[i] >= _BUCKET_RATIO * seq_lens[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _tiles(n: int, length: int, sliding_window: int | None, device) -> list[_Tile]:
    tiles = []
    first = length - n  # position of the chunk's first query
    for lo in range(0, n, _Q_TILE):
        hi = min(n, lo + _Q_TILE)
        q_pos = torch.arange(first + lo, first + hi, device=device)
        k_hi = first + hi
        k_lo = max(0, first + lo - sliding_window + 1) if sliding_window is not None else 0
        k_pos = torch.arange(k_lo, k_hi, device=device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            allowed &= k_pos[None, :] > (q_pos[:, None] - sliding_window)
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device).masked_fill_(~allowed, float("-inf"))
        tiles.append(_Tile(lo, hi, k_lo, k_hi, bias))
    return tiles


def _decode_group(idx: list[int], n: int, starts: list[int], seq_lens: list[int], block_tables: list[list[int]],
                  block_size: int, sliding_window: int | None, device) -> DecodeGroup:
    lens = torch.tensor([seq_lens[i] for i in idx], device=device)
    width = -(-int(lens.max()) // block_size)
    table = torch.zeros(len(idx), width, dtype=torch.long, device=device)
    for row, i in enumerate(idx):
        bt = block_tables[i][:width]
        table[row, :len(bt)] = torch.tensor(bt, dtype=torch.long)
    pos = torch.arange(width * block_size, device=device)
    # Query r of a chunk sits at position len - n + r and sees keys up to itself (causal).
    q_pos = lens[:, None] - n + torch.arange(n, device=device)[None, :]          # [B, n]
    valid = pos[None, None, :] <= q_pos[:, :, None]                               # [B, n, L]
    if sliding_window is not None:
        valid &= pos[None, None, :] > (q_pos[:, :, None] - sliding_window)
    mask = torch.zeros(valid.shape, dtype=torch.float32, device=device)
    mask.masked_fill_(~valid, float("-inf"))
    rows = torch.tensor([starts[i] + r for i in idx for r in range(n)], dtype=torch.long, device=device)
    return DecodeGroup(rows, table, mask[:, None])


def paged_attention(q: torch.Tensor, k_cache: Cache, v_cache: Cache,
                    plan: TorchAttentionPlan, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]. K/V of the new tokens must be written first."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for g in plan.decode_groups:  # tokenyard/kernels/decode_group_torch.py picks the form per group
        out.index_copy_(0, g.rows, attend_group(q, k_cache, v_cache, g, scale))
    for c in plan.chunks:
        n = c.q_end - c.q_start
        if c.gather is None:  # same for every layer: computed once per step
            c.gather = _head_rows(c.slots, num_kv_heads, k_cache.shape[1])
        idx = c.gather
        kc = gather_rows(k_cache, idx, 1, q.dtype).view(num_kv_heads, -1, head_dim)  # [kvh, L, hd]
        vc = gather_rows(v_cache, idx, 1, q.dtype).view(num_kv_heads, -1, head_dim)
        # [kvh, n, group, hd]: a tile of queries is then one contiguous [kvh, t * group, hd] slab.
        qc = q[c.q_start:c.q_end].view(n, num_kv_heads, group, head_dim).transpose(0, 1).contiguous()
        oc = out[c.q_start:c.q_end].view(n, num_kv_heads, group, head_dim)
        for t in c.tiles:
            rows = t.q_hi - t.q_lo
            qt = qc[:, t.q_lo:t.q_hi].reshape(num_kv_heads, rows * group, head_dim)
            scores = torch.bmm(qt, kc[:, t.k_lo:t.k_hi].transpose(1, 2)).mul_(scale)
            scores = scores.view(num_kv_heads, rows, group, -1).add_(t.bias[:, None, :].to(scores.dtype))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(vc.dtype)
            ot = torch.bmm(probs.view(num_kv_heads, rows * group, -1), vc[:, t.k_lo:t.k_hi])
            oc[t.q_lo:t.q_hi] = ot.view(num_kv_heads, rows, group, head_dim).transpose(0, 1)
    return out


# -- decode steps under torch.compile ---------------------------------------------------------

def write_kv_slots(k_cache: Cache, v_cache: Cache, k: torch.Tensor, v: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """write_kv as one indexed assignment per cache: the form torch.compile turns into an in-place
    scatter into the cache (no copy of the cache, whatever its size)."""
    for cache, x in ((k_cache, k), (v_cache, v)):
        if isinstance(cache, QuantizedCache):
            codes, scale = quantize(x.transpose(0, 1), cache.data.dtype)
            cache.data[:, slots] = codes
            cache.scale[:, slots] = scale
        else:
            cache[:, slots] = x.transpose(0, 1).to(cache.dtype)


def _read_slots(cache: Cache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(cache, QuantizedCache):
        return dequantize(cache.data[:, slots], cache.scale[:, slots], dtype)
    return cache[:, slots]


def decode_attention(q: torch.Tensor, k_cache: Cache, v_cache: Cache, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, block_size: int, scale: float,
                     sliding_window: int | None = None) -> torch.Tensor:
    """One query per sequence over its paged context; written for torch.compile (fixed op sequence,
    no host values, every size taken from a tensor shape, so one graph serves any batch and width).

    Inside the compiled decode graph the block-table gather is fused into the kernel that applies
    rotary and writes the new K/V, then two batched matmuls (extern BLAS) and a fused masked
    softmax. Measured per layer at W2's shapes, 1 thread (`python -m tokenyard.bench.decode_speed --only
    attention`, bench/results/decode_speed_t1.json), against the eager path (gather whole blocks,
    then SDPA's fused CPU kernel) and a compiled form that reads K/V in place (the gather folded
    into the loads of two reductions, so no gathered copy exists):
    batch 1 (100 / 500 keys) 0.10 / 0.10 ms here, 0.09 / 0.14 ms in place, eager 0.06 / 0.08 ms;
    batch 32 4.4 ms here, 8.3 ms in place, eager 2.1 ms; batch 96 13.7 / 26.0 / 11.3 ms.
    Reading in place loses: inductor vectorises the P.V reduction along the keys, with gathered
    scalar loads of V, instead of along head_dim. A block allocator that keeps each sequence's
    blocks in contiguous runs (so attention reads views) needs the block manager
    (tokenyard/engines/core) and is not measured here. What the compiled step gains is the per-op overhead
    around attention; at batch 32+ SDPA's kernel is the better core and the next step is to call
    it inside the graph.

    q: [B, heads, head_dim]; block_tables: [B, W] int64 padded with block 0; seq_lens: [B] int64
    context lengths including the new token, whose K/V must already be written. Keys at positions
    >= seq_len (the table's padding) are masked. Returns [B, heads, head_dim].
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    width = block_tables.shape[1]
    length = width * block_size
    offsets = torch.arange(block_size, device=q.device)
    slots = (block_tables[:, :, None] * block_size + offsets).reshape(batch, length)      # [B, L]
    k = _read_slots(k_cache, slots, q.dtype)                                                # [kvh, B, L, hd]
    v = _read_slots(v_cache, slots, q.dtype)
    qg = q.view(batch, num_kv_heads, group, head_dim).transpose(0, 1)                      # [kvh, B, g, hd]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale                         # [kvh, B, g, L]
    pos = torch.arange(length, device=q.device)
    last = seq_lens[:, None] - 1
    valid = pos[None, :] <= last
    if sliding_window is not None:
        valid = valid & (pos[None, :] > last - sliding_window)
    scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)                                                            # [kvh, B, g, hd]
    return out.transpose(0, 1).reshape(batch, num_heads, head_dim)
