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

Quantised caches (kernels/kv_quant.py, EngineConfig.kv_cache_dtype int8 / fp8_e4m3): a cache is
then a `QuantizedCache` (codes plus one scale per kv head and slot). Writes quantise the new
tokens; reads gather the codes and their scales with the same indices, so only the keys a step
attends to are ever widened. Prefill chunks dequantise the gathered tiles; decode groups fold the
scales into the scores and probabilities instead (`_quantized_decode`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_quant import QuantizedCache, dequantize, quantize

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
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows = x.transpose(0, 1)                                    # [kv_heads, T, head_dim]
        if isinstance(cache, QuantizedCache):
            codes, scale = quantize(rows, cache.data.dtype)
            cache.bytes_view.view(-1, hd).index_copy_(0, idx, codes.view(torch.uint8).reshape(-1, hd))
            cache.scale.view(-1).index_copy_(0, idx, scale.reshape(-1))
        else:
            cache.view(-1, hd).index_copy_(0, idx, rows.reshape(-1, hd))


def _gather(cache: Cache, idx: torch.Tensor, row: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows `idx` of the cache viewed as [-1, row * head_dim] (row = tokens per gathered row: a
    block, or one token), as [len(idx), row, head_dim] in dtype (dequantised when quantised)."""
    hd = cache.shape[2]
    if not isinstance(cache, QuantizedCache):
        return cache.view(-1, row * hd).index_select(0, idx).view(-1, row, hd)
    codes = cache.bytes_view.view(-1, row * hd).index_select(0, idx).view(cache.data.dtype).view(-1, row, hd)
    return dequantize(codes, cache.scale.view(-1, row).index_select(0, idx), dtype)


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
class _DecodeGroup:
    """Sequences whose chunks have the same short query length n, attended in one SDPA call."""

    rows: torch.Tensor       # [B * n] rows of the group's queries in the flat batch, sequence-major
    blocks: torch.Tensor     # [B, nb] block tables, padded with block 0
    mask: torch.Tensor       # [B, 1, n, nb * block_size] additive (0 or -inf)
    gather: torch.Tensor | None = None  # row indices into the 2-D cache view; set by the first layer
    scratch: torch.Tensor | None = None  # quantised caches, long contexts: widened K/V of one sequence


@dataclass(slots=True)
class TorchAttentionPlan:
    # Decode rows and other short chunks are batched: a padded gather of whole blocks and one
    # SDPA per group of equal query length. Rows are grouped by context length so short contexts
    # are not padded to the longest one (padding is gathered and multiplied for nothing).
    decode_groups: list[_DecodeGroup]
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
                  block_size: int, sliding_window: int | None, device) -> _DecodeGroup:
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
    return _DecodeGroup(rows, table, mask[:, None])


def paged_attention(q: torch.Tensor, k_cache: Cache, v_cache: Cache,
                    plan: TorchAttentionPlan, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]. K/V of the new tokens must be written first."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for g in plan.decode_groups:
        batch, width = g.blocks.shape
        n = g.mask.shape[2]
        block_size = g.mask.shape[-1] // width
        # Gather whole blocks straight into [B, kvh, L, hd] and let SDPA's fused CPU kernel do
        # GQA and the masked softmax: ~1.6x faster than two batched matmuls at batch 32.
        if g.gather is None:  # same for every layer: computed once per step
            heads = torch.arange(num_kv_heads, device=q.device)[None, :, None] * (k_cache.shape[1] // block_size)
            g.gather = (heads + g.blocks[:, None, :]).reshape(-1)
        idx = g.gather
        if isinstance(k_cache, QuantizedCache) and batch * width * block_size >= _FOLD_KEYS:
            out.index_copy_(0, g.rows, _quantized_decode(q, k_cache, v_cache, g, block_size, scale))
            continue
        k = _gather(k_cache, idx, block_size, q.dtype).view(batch, num_kv_heads, -1, head_dim)
        v = _gather(v_cache, idx, block_size, q.dtype).view(batch, num_kv_heads, -1, head_dim)
        qd = q.index_select(0, g.rows).view(batch, n, num_heads, head_dim).transpose(1, 2)  # [B, H, n, hd]
        od = torch.nn.functional.scaled_dot_product_attention(
            qd, k, v, attn_mask=g.mask.to(q.dtype), scale=scale, enable_gqa=group > 1)
        out.index_copy_(0, g.rows, od.transpose(1, 2).reshape(batch * n, num_heads, head_dim))
    for c in plan.chunks:
        n = c.q_end - c.q_start
        if c.gather is None:  # same for every layer: computed once per step
            c.gather = _head_rows(c.slots, num_kv_heads, k_cache.shape[1])
        idx = c.gather
        kc = _gather(k_cache, idx, 1, q.dtype).view(num_kv_heads, -1, head_dim)  # [kvh, L, hd]
        vc = _gather(v_cache, idx, 1, q.dtype).view(num_kv_heads, -1, head_dim)
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


# Decode groups over a quantised cache with fewer gathered keys than this (batch * padded
# length) dequantise and call SDPA instead: the folded path's extra small ops (scale gathers,
# separate matmuls and softmax) cost more than the scale passes they save. Measured per layer at
# W2's shapes, 1 thread: batch 1 at 50 keys 0.12 ms dequantised vs 0.16 ms folded, 500 keys
# 0.21 vs 0.22; batch 8 at 300 keys 0.58 vs 0.42 (fp32 cache 0.46).
_FOLD_KEYS = 2048

# A decode group over a quantised cache whose padded context is at least this many keys is
# attended one sequence at a time through one reused buffer (see _quantized_decode).
_PER_SEQUENCE_KEYS = 1024


def _quantized_decode(q: torch.Tensor, k_cache: QuantizedCache, v_cache: QuantizedCache,
                      g: _DecodeGroup, block_size: int, scale: float) -> torch.Tensor:
    """A decode group over a quantised cache -> [B * n, heads, head_dim].

    The per-(token, kv head) scales are folded into the small side instead of dequantising the
    tiles: scores = (q . codes_k) * s_k, and out = (probs * s_v) . codes_v, so the gathered codes
    are only widened (one pass) and never multiplied; the scales touch [group * n, L] scores,
    not [L, head_dim] tiles. GQA is one batched matmul per kv head: the group's query heads of a
    kv head are stacked as rows [kvh, n * group, hd].

    Long contexts go one sequence at a time, widening into a buffer that every sequence and layer
    of the step reuses: at W2's shapes and 4k keys, a whole-batch widening writes MBs of fresh
    memory per layer (page faults, then cache misses in the matmuls), which made the int8 decode
    slower than the fp32 one (bench/results/kv_quant_decode4k.json); short contexts stay batched,
    where a per-sequence loop would pay its few ops B times.
    """
    batch, width = g.blocks.shape
    n = g.mask.shape[2]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kvh = k_cache.shape[0]
    group = num_heads // kvh
    rows = n * group
    codes_dtype = k_cache.data.dtype
    qd = (q.index_select(0, g.rows).view(batch, n, kvh, group, head_dim)
          .permute(0, 2, 1, 3, 4).reshape(batch, kvh, rows, head_dim))
    s_k = k_cache.scale.view(-1, block_size).index_select(0, g.gather).view(batch, kvh, 1, -1).mul_(scale)
    s_v = v_cache.scale.view(-1, block_size).index_select(0, g.gather).view(batch, kvh, 1, -1)
    mask = g.mask.view(batch, 1, n, 1, -1)
    k_rows = k_cache.bytes_view.view(-1, block_size * head_dim)
    v_rows = v_cache.bytes_view.view(-1, block_size * head_dim)

    def attend(qb, codes_k, codes_v, sk, sv, mb):   # leading dims: [B, kvh] or [kvh]
        lead = qb.shape[:-2]
        scores = torch.matmul(qb, codes_k.transpose(-1, -2)).mul_(sk)
        scores = scores.view(*lead[:-1], kvh, n, group, -1).add_(mb.to(scores.dtype)).view(*lead, rows, -1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).mul_(sv).to(q.dtype)
        return torch.matmul(probs, codes_v)

    length = width * block_size
    if length < _PER_SEQUENCE_KEYS:
        codes_k = k_rows.index_select(0, g.gather).view(codes_dtype).view(batch, kvh, -1, head_dim).to(q.dtype)
        codes_v = v_rows.index_select(0, g.gather).view(codes_dtype).view(batch, kvh, -1, head_dim).to(q.dtype)
        od = attend(qd, codes_k, codes_v, s_k, s_v, mask)
    else:
        if g.scratch is None or g.scratch.dtype != q.dtype:  # once per step, shared by all layers
            g.scratch = torch.empty(2, kvh, length, head_dim, dtype=q.dtype, device=q.device)
        wide_k, wide_v = g.scratch[0], g.scratch[1]
        idx = g.gather.view(batch, -1)
        od = torch.empty(batch, kvh, rows, head_dim, dtype=q.dtype, device=q.device)
        for b in range(batch):
            wide_k.copy_(k_rows.index_select(0, idx[b]).view(codes_dtype).view(kvh, -1, head_dim))
            wide_v.copy_(v_rows.index_select(0, idx[b]).view(codes_dtype).view(kvh, -1, head_dim))
            od[b] = attend(qd[b], wide_k, wide_v, s_k[b], s_v[b], mask[b])
    return od.view(batch, kvh, n, group, head_dim).permute(0, 2, 1, 3, 4).reshape(batch * n, num_heads, head_dim)


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
    softmax. Measured per layer at W2's shapes, 1 thread (`python -m bench.decode_speed --only
    attention`, bench/results/decode_speed_t1.json), against the eager path (gather whole blocks,
    then SDPA's fused CPU kernel) and a compiled form that reads K/V in place (the gather folded
    into the loads of two reductions, so no gathered copy exists):
    batch 1 (100 / 500 keys) 0.10 / 0.10 ms here, 0.09 / 0.14 ms in place, eager 0.06 / 0.08 ms;
    batch 32 4.4 ms here, 8.3 ms in place, eager 2.1 ms; batch 96 13.7 / 26.0 / 11.3 ms.
    Reading in place loses: inductor vectorises the P.V reduction along the keys, with gathered
    scalar loads of V, instead of along head_dim. A block allocator that keeps each sequence's
    blocks in contiguous runs (so attention reads views) needs the block manager
    (engines/core) and is not measured here. What the compiled step gains is the per-op overhead
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
