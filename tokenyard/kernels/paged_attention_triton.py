"""Paged attention in Triton: the CUDA path. `paged_attention_torch` is its reference.

Same cache layout and the same one-call contract as the torch path: K and V caches of a layer are
[num_kv_heads, num_slots, head_dim], token t of a sequence lives in slot
block_table[t // block_size] * block_size + t % block_size, and the queries are a flat batch of
per-sequence chunks (a decode token is a chunk of one), each row attending to its sequence's
cached prefix plus causally within its chunk, optionally within a sliding window.

One kernel, two launch shapes:
- decode (every chunk is one token): one program per (sequence, kv head, split); its rows are
  the group's query heads, so each K/V tile is loaded once for the whole GQA group.
- prefill / extend / verify: one program per (sequence, tile of query tokens, kv head, split);
  its rows are tokens x group heads, so a tile reuses each K/V load for TOKENS * GROUP rows.
  A batch mixing chunks with decode tokens takes this shape for all of them (a decode token
  then fills one token of its tile).
Rows are padded to at least 16 so both products run on tl.dot (tensor cores on a GPU).

Keys are gathered per token through the block table rather than per block, so any block_size
works and a tile may span blocks. Split-KV: when there are too few (sequence, head) programs to
fill the GPU, each program's key range is cut into `num_splits` pieces whose partial
(max, sum, unnormalised output) are combined by a second, small kernel.

Quantised caches (tokenyard/kernels/kv_quant.py: int8 or fp8 e4m3 codes, one fp32 scale per kv head and
slot): the write kernel computes each (token, kv head)'s scale from its max |x| and stores codes
and scale; the attention kernel loads codes and scales of a key tile and dequantises them in
registers (codes are widened to fp32, then to the query's dtype for tl.dot). K's scale multiplies
the scores column (q . (c * s) = (q . c) * s), V's the probabilities' column (p . (c * s) =
(p * s) . c), so neither is applied to a whole [BLOCK_N, head_dim] tile.

Uses only Triton APIs present in 3.6 (the GPU machine) and 3.9 (this machine's interpreter).
"""
# No `from __future__ import annotations` here: @triton.jit reads the tl.constexpr
# annotations of kernel parameters, which should stay objects rather than strings.
import torch
import triton
import triton.language as tl

from .device_info import sm_count
from .kv_quant import QMAX, QuantizedCache

_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kch, stride_kcs, stride_vch, stride_vcs, stride_sh,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                     QUANT: tl.constexpr, QMAX: tl.constexpr, INT_CODES: tl.constexpr):
    # One program per new token, all its kv heads at once: [HEADS_PAD, BLOCK_D] tiles.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token (e.g. a CUDA-graph batch padded to a captured size)
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, BLOCK_D)
    ok = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    src_k = k_ptr + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :]
    src_v = v_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :]
    dst_k = kc_ptr + h[:, None].to(tl.int64) * stride_kch + slot * stride_kcs + d[None, :]
    dst_v = vc_ptr + h[:, None].to(tl.int64) * stride_vch + slot * stride_vcs + d[None, :]
    k = tl.load(src_k, mask=ok, other=0.0)
    v = tl.load(src_v, mask=ok, other=0.0)
    if QUANT:
        s_ok = h < NUM_KV_HEADS
        s_off = h.to(tl.int64) * stride_sh + slot
        _store_quantized(k.to(tl.float32), dst_k, ks_ptr + s_off, ok, s_ok, QMAX, INT_CODES)
        _store_quantized(v.to(tl.float32), dst_v, vs_ptr + s_off, ok, s_ok, QMAX, INT_CODES)
    else:
        tl.store(dst_k, k.to(kc_ptr.dtype.element_ty), mask=ok)
        tl.store(dst_v, v.to(vc_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_quantized(x, dst, scale_dst, ok, s_ok, QMAX: tl.constexpr, INT_CODES: tl.constexpr):
    # Per row (kv head): scale = max |x| / QMAX; codes = x / scale (int8: halves away from zero,
    # as tokenyard.kernels.kv_quant.quantize does).
    scale = tl.maximum(tl.max(tl.abs(x), 1) / QMAX, 1e-12)
    y = tl.minimum(tl.maximum(x / scale[:, None], -QMAX), QMAX)
    if INT_CODES:
        y = tl.where(y >= 0, y + 0.5, y - 0.5)
    tl.store(dst, y.to(dst.dtype.element_ty), mask=ok)
    tl.store(scale_dst, scale, mask=s_ok)


def write_kv(k_cache, v_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, kv_heads, head_dim] into their slots; a slot < 0 is skipped.
    Caches are tensors, or QuantizedCache (codes and scales written by the kernel)."""
    num_tokens, kvh, hd = k.shape
    if num_tokens == 0:
        return
    quant = isinstance(k_cache, QuantizedCache)
    kc, vc = (k_cache.data, v_cache.data) if quant else (k_cache, v_cache)
    ks, vs = (k_cache.scale, v_cache.scale) if quant else (kc, vc)   # unused unless quantised
    assert kc.shape[0] == kvh and kc.shape[2] == hd and v.shape == k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and kc.stride(2) == 1 and vc.stride(2) == 1
    _write_kv_kernel[(num_tokens,)](
        k, v, kc, vc, ks, vs, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), ks.stride(0) if quant else 0,
        NUM_KV_HEADS=kvh, HEAD_DIM=hd,
        HEADS_PAD=max(2, triton.next_power_of_2(kvh)), BLOCK_D=triton.next_power_of_2(hd),
        QUANT=quant, QMAX=QMAX[kc.dtype] if quant else 0.0, INT_CODES=kc.dtype == torch.int8)


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                      qsl_ptr, seq_lens_ptr, bt_ptr,
                      scale_log2, window, num_splits,
                      stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_kh, stride_ks, stride_vh, stride_vs, stride_bt, stride_sh,
                      num_heads,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr,
                      ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * TOKENS >= q_len:  # the grid is sized for the longest chunk of the batch
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first = seq_len - q_len  # absolute position of the chunk's first query

    # Row r of the tile is query token r // GROUP_PAD, head r % GROUP_PAD of this kv head's group.
    r = tl.arange(0, ROWS)
    tok = tile * TOKENS + r // GROUP_PAD
    head = kv_head * GROUP + r % GROUP_PAD
    row_ok = (r // GROUP_PAD < TOKENS) & (tok < q_len) & (r % GROUP_PAD < GROUP)
    q_pos = first + tok
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys any row of the tile may see: [kv_lo, kv_hi), kv_lo aligned down to a multiple of
    # BLOCK_N so that a key tile covers whole cache blocks (block_size 16 into BLOCK_N 64).
    tile_first = first + tile * TOKENS
    kv_hi = tl.minimum(tile_first + TOKENS, seq_len)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(tile_first - window + 1, 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    n_tiles = tl.cdiv(kv_hi - kv_lo, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)

    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    ks_base = ks_ptr + kv_head.to(tl.int64) * stride_sh
    vs_base = vs_ptr + kv_head.to(tl.int64) * stride_sh
    # The running max starts finite: from -inf, a row whose first tile is fully masked (window,
    # causality) would compute exp2(-inf - -inf) = NaN. Masked scores are -inf, so their
    # exp2(-inf - m) is still exactly 0.
    m = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        k_pos = kv_lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_hi
        block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
        # K is loaded transposed, [BLOCK_D, BLOCK_N], so the product needs no tl.trans.
        k = tl.load(k_base + slot[None, :] * stride_ks + d[:, None],
                    mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        if QUANT:
            # Codes widen exactly to fp32 (then to q's dtype: int8 and e4m3 fit bf16/fp16 exactly);
            # the key's scale is applied to its score column.
            k_scale = tl.load(ks_base + slot, mask=k_ok, other=0.0)
            s = tl.dot(q, k.to(tl.float32).to(q.dtype), input_precision="ieee") * (k_scale * scale_log2)[None, :]
        else:
            s = tl.dot(q, k, input_precision="ieee") * scale_log2
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if QUANT:
            v_scale = tl.load(vs_base + slot, mask=k_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(q.dtype), v.to(tl.float32).to(q.dtype),
                                                input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # Partials are [T, H, splits] (+ head_dim); a split that saw no key leaves m=-1e30, l=0.
        part = (q_row * num_heads + head) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
        tl.store(part_m_ptr + part, m, mask=row_ok)
        tl.store(part_l_ptr + part, l, mask=row_ok)
    else:
        # Every real row sees at least its own key, so l > 0; padding rows (l = 0) are not
        # stored, and the guard only keeps them from computing 0/0.
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_splits_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr,
                           num_splits, stride_ot, stride_oh, num_heads,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr):
    # One program per (query row, head): rescale each split's partial to the common max.
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    base = (t.to(tl.int64) * num_heads + h) * num_splits
    m = tl.load(part_m_ptr + base + s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + base + s, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    m_all = tl.max(m, 0)
    w = tl.exp2(m - m_all)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d,
             o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# Query rows per prefill tile (tokens x group heads) and keys per key tile. Decode tiles are
# one token's group, padded to 16 rows. Chosen for 64-128 head dims on Hopper-class GPUs (head
# dims above 128 halve the key tile to keep pipelined K/V stages within shared memory); the
# interpreter runs the same shapes.
_PREFILL_ROWS = 64
_BLOCK_N = 64
_MAX_SPLITS = 32


def _auto_splits(programs: int, max_key_tiles: int, device: torch.device) -> int:
    # Split only to fill the GPU (two waves of programs), and never below ~4 key tiles per
    # split: a split's fixed cost (Q load, partial store, its share of the combine) must pay off.
    # Derived from shapes alone, so no device sync and the choice is stable under CUDA graphs.
    if device.type != "cuda":
        return 1
    want = -(-2 * sm_count(device) // max(programs, 1))
    return max(1, min(want, max_key_tiles // 4, _MAX_SPLITS))


def paged_attention(q: torch.Tensor, k_cache, v_cache, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, block_size: int, scale: float, sliding_window: int | None = None,
                    max_query_len: int | None = None, num_splits: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads, head_dim]. K/V of the new tokens must be written first.

    query_start_loc int32 [num_seqs + 1]; seq_lens int32 [num_seqs] (context including the
    chunk); block_tables int32 [num_seqs, max_blocks], padded with 0. Every chunk has at least
    one token. max_query_len is read from query_start_loc (a device sync) when not given and
    the batch is not pure decode (T == num_seqs). num_splits defaults to a shape-based choice.
    The caches are tensors or QuantizedCache (dequantised in the kernel).
    """
    quant = isinstance(k_cache, QuantizedCache)
    k_scale, v_scale = (k_cache.scale, v_cache.scale) if quant else (q, q)   # unused unless quantised
    if quant:
        k_cache, v_cache = k_cache.data, v_cache.data
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0 and head_dim >= 16
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert block_tables.stride(1) == 1
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if max_query_len is None:
        max_query_len = 1 if num_tokens == num_seqs else int((query_start_loc[1:] - query_start_loc[:-1]).max())
    tokens = 1 if max_query_len == 1 else max(1, _PREFILL_ROWS // group_pad)
    rows = max(16, tokens * group_pad)
    q_tiles = triton.cdiv(max_query_len, tokens)
    block_n = _BLOCK_N if head_dim <= 128 else _BLOCK_N // 2
    if num_splits is None:
        max_key_tiles = triton.cdiv(block_tables.shape[1] * block_size, block_n)
        num_splits = _auto_splits(num_seqs * q_tiles * num_kv_heads, max_key_tiles, q.device)
    split = num_splits > 1
    if split:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused: the SPLIT=False variant never touches them
    _attention_kernel[(num_seqs, q_tiles, num_kv_heads * num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, out, part_acc, part_m, part_l,
        query_start_loc, seq_lens, block_tables,
        scale * _LOG2E, sliding_window or 0, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        k_scale.stride(0) if quant else 0, num_heads,
        GROUP=group, GROUP_PAD=group_pad, TOKENS=tokens, ROWS=rows,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n, BLOCK_SIZE=block_size,
        HAS_WINDOW=sliding_window is not None, SPLIT=split, QUANT=quant,
        num_warps=4 if rows * head_dim <= 64 * 128 else 8)
    if split:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_m, part_l, out, num_splits, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)))
    return out
