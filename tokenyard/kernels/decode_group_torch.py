"""Attention of one decode group on CPU: sequences whose query chunks share a short length n
(decode tokens, speculative verify chunks), each over its whole paged context.

Four forms: the C kernel when it is built, else three torch forms chosen per group by
`choose_form` from measurements at W2's shapes (8 heads, 2 kv heads, head_dim 64, block 16, 1
thread on the 2-core VM; see the thresholds below):

- "sdpa": gather the group's blocks into [B, kvh, L, hd] (dequantised when the cache is
  quantised: codes widened, then times their scales) and call SDPA's fused CPU kernel.
- "batched": the same gather, then two batched matmuls and a softmax written out. GQA is one
  matmul per kv head: a kv head's query heads are stacked as rows [kvh, n * group, hd], so each
  gathered key is read once for all of them.
- "per_sequence": like "batched", one sequence at a time through one buffer [2, kvh, L, hd] that
  every sequence and layer of the step reuses. A whole-batch gather at 4k keys writes megabytes
  of fresh memory per layer (page faults, then cache misses in the matmuls); a reused buffer
  stays warm.
- "native": the C kernel of tokenyard/kernels/cpu_decode_native.py, reading the blocks in place (no
  gather) and, over an int8 cache, widening the codes inside its dot products. Chosen whenever it
  is built and takes the group (fp32 queries, an fp32 or int8 CPU cache): at W2's shapes, 1
  thread, it beat the best torch form at every size measured (per layer, fp32 / int8 cache: batch
  1 at 64 keys 0.07 / 0.05 vs 0.12 / 0.13 ms; batch 1 at 4k 0.53 / 0.46 vs 0.64 / 0.66; batch 4 at
  4k 2.8 / 1.7 vs 3.1 / 2.8; batch 96 at 300 6.5 / 4.7 vs 29.5 / 26.9; scratch benchmark
  tokenyard/bench/kv_quant_bench.py --only decode4k for whole steps). The three torch forms serve otherwise
  (bf16, fp8, no compiler, TOKENYARD_CPU_ATTENTION=torch).

Over a quantised cache the hand-written forms fold the per-(token, kv head) scales into the small
side instead of dequantising the tiles: scores = (q . codes_k) * (s_k * scale), and
out = (probs * s_v) . codes_v. The gathered codes are widened once and never multiplied; the
scales touch [n * group, L] scores, not [L, head_dim] tiles. Numerically this is the same fp32
arithmetic as dequantise-then-attend up to summation order (tests/engines/test_kv_quant_folded.py).

Thread use: none of its own; the plan's buffers belong to the one step that built the plan.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenyard.kernels import cpu_decode_native
from tokenyard.kernels.kv_quant import QuantizedCache, dequantize

Cache = torch.Tensor | QuantizedCache

FORMS = ("sdpa", "batched", "per_sequence", "native")


@dataclass(slots=True)
class DecodeGroup:
    """Sequences whose chunks have the same short query length n, attended together."""

    rows: torch.Tensor       # [B * n] rows of the group's queries in the flat batch, sequence-major
    blocks: torch.Tensor     # [B, nb] block tables, padded with block 0
    mask: torch.Tensor       # [B, 1, n, nb * block_size] additive (0 or -inf)
    gather: torch.Tensor | None = None   # row indices into the 2-D cache view; set by the first layer
    scratch: torch.Tensor | None = None  # per_sequence form: one sequence's K/V, reused by every layer
    codes: torch.Tensor | None = None    # and its gathered codes, when the cache is quantised
    work: torch.Tensor | None = None     # native form: the C kernel's scores buffer, reused by every layer


# Padded keys per sequence from which a group goes one sequence at a time, whatever the cache.
# Measured with a scratch micro-benchmark (not committed): 8 layers' KV write + decode attention
# of one step, distinct caches per layer, a fresh plan per step, 1 thread, median ms under the
# shared CPU lock, load 1-2.5; fp32 cache sdpa / batched /
# per_sequence: batch 1 at 4k 9.1 / 7.9 / 8.0, batch 4 at 4k 55.2 / 47.3 / 33.1, batch 4 at 2k
# 25.0 / 24.2 / 20.8, batch 8 at 1k 24.9 / 22.5 / 22.3; int8 batch 4 at 4k 54.4 / 47.7 / 28.9.
# Below it a loop of B sequences pays its ops B times: batch 8 at 300 keys 7.5 / 6.6 / 11.4.
_PER_SEQUENCE_KEYS = 1024
# Below this many gathered keys in all (batch * padded length) a quantised group dequantises and
# calls SDPA: the folded form's extra small ops (scale gathers) cost more than the scale passes
# they save there (int8 batch 1 at 50 keys 2.8 / 3.1 ms, at 500 keys 3.7 / 3.7).
_FOLD_KEYS = 2048


def choose_form(quantised: bool, batch: int, length: int) -> str:
    """The form for a group of `batch` sequences padded to `length` keys. Short fp32 groups keep
    SDPA: batch 1 at 50-500 keys it is faster (1.4 vs 1.8 ms at 50), and at batch 8-96 the
    hand-written form's lead was within the run-to-run noise (3-12%, one way or the other)."""
    if length >= _PER_SEQUENCE_KEYS:
        return "per_sequence"
    if quantised and batch * length >= _FOLD_KEYS:
        return "batched"
    return "sdpa"


def attend_group(q: torch.Tensor, k_cache: Cache, v_cache: Cache, g: DecodeGroup, scale: float,
                 form: str | None = None) -> torch.Tensor:
    """q: [T, heads, hd] (the whole flat batch) -> [B * n, heads, hd], the group's rows in g.rows
    order. K/V of the new tokens must be written first."""
    batch, width = g.blocks.shape
    n = g.mask.shape[2]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kvh = k_cache.shape[0]
    group = num_heads // kvh
    block_size = g.mask.shape[-1] // width
    length = width * block_size
    quantised = isinstance(k_cache, QuantizedCache)
    if form is None:
        native = cpu_decode_native.load()
        form = ("native" if native is not None and native.supports(k_cache, q, n * group)
                else choose_form(quantised, batch, length))
    if g.gather is None:  # same for every layer: computed once per step
        heads = torch.arange(kvh, device=q.device)[None, :, None] * (k_cache.shape[1] // block_size)
        g.gather = (heads + g.blocks[:, None, :]).reshape(-1)
    if form == "sdpa":
        k = gather_rows(k_cache, g.gather, block_size, q.dtype).view(batch, kvh, -1, head_dim)
        v = gather_rows(v_cache, g.gather, block_size, q.dtype).view(batch, kvh, -1, head_dim)
        qd = q.index_select(0, g.rows).view(batch, n, num_heads, head_dim).transpose(1, 2)  # [B, H, n, hd]
        od = torch.nn.functional.scaled_dot_product_attention(
            qd, k, v, attn_mask=g.mask.to(q.dtype), scale=scale, enable_gqa=group > 1)
        return od.transpose(1, 2).reshape(batch * n, num_heads, head_dim)
    if form not in FORMS:
        raise ValueError(f"unknown decode attention form {form!r}; one of {', '.join(FORMS)}")
    rows = n * group
    qd = (q.index_select(0, g.rows).view(batch, n, kvh, group, head_dim)
          .permute(0, 2, 1, 3, 4).reshape(batch, kvh, rows, head_dim))
    if form == "native":
        kernel = cpu_decode_native.load()
        if kernel is None or not kernel.supports(k_cache, q, rows):
            raise ValueError("decode attention form 'native': the C kernel is unavailable or does not take this "
                             "cache (fp32 queries over an fp32 or int8 CPU cache)")
        od, g.work = kernel.attend(qd, k_cache, v_cache, g.blocks, g.mask.view(batch, n, -1).to(q.dtype), scale,
                                   g.work)
        return od.view(batch, kvh, n, group, head_dim).permute(0, 2, 1, 3, 4).reshape(batch * n, num_heads, head_dim)
    mask = g.mask.view(batch, 1, n, 1, -1).to(q.dtype)
    if quantised:  # scales [B, kvh, 1, 1, L], the softmax scale folded into s_k
        s_k = k_cache.scale.view(-1, block_size).index_select(0, g.gather).view(batch, kvh, 1, 1, -1).mul_(scale)
        s_v = v_cache.scale.view(-1, block_size).index_select(0, g.gather).view(batch, kvh, 1, -1)
    else:
        s_k = s_v = None

    def attend(qb, k, v, mb, sk, sv):   # leading dims [B, kvh] or [kvh]; k, v widened, unscaled
        lead = qb.shape[:-2]
        # bmm on 3-D views, not matmul: at 4k keys matmul's batched path took 1.4x as long for
        # q . K^T (175 vs 126 us for [2, 4, 64] x [2, 64, 4096], 1 thread).
        scores = torch.bmm(qb.reshape(-1, rows, head_dim), k.reshape(-1, k.shape[-2], head_dim).transpose(1, 2))
        scores = scores.view(*lead, n, group, -1)
        # One op for scale (or folded key scales) and mask: scores are [n * group, L] per kv head.
        scores = torch.add(mb, scores, alpha=scale) if sk is None else torch.addcmul(mb, scores, sk)
        probs = torch.softmax(scores.view(-1, rows, scores.shape[-1]), dim=-1, dtype=torch.float32)
        if sv is not None:
            probs = probs.view(*lead, rows, -1).mul_(sv).view(-1, rows, probs.shape[-1])
        return torch.bmm(probs.to(q.dtype), v.reshape(-1, v.shape[-2], head_dim)).view(*lead, rows, head_dim)

    if form == "batched":
        k = _widened(k_cache, g.gather, block_size, q.dtype).view(batch, kvh, -1, head_dim)
        v = _widened(v_cache, g.gather, block_size, q.dtype).view(batch, kvh, -1, head_dim)
        od = attend(qd, k, v, mask, s_k, s_v)
    else:
        if g.scratch is None or g.scratch.dtype != q.dtype:  # once per step, shared by all layers
            g.scratch = torch.empty(2, kvh * width, block_size * head_dim, dtype=q.dtype, device=q.device)
            if quantised:
                g.codes = torch.empty(g.scratch.shape, dtype=torch.uint8, device=q.device)
        idx = g.gather.view(batch, -1)
        od = torch.empty(batch, kvh, rows, head_dim, dtype=q.dtype, device=q.device)
        codes = (None, None) if g.codes is None else (g.codes[0], g.codes[1])
        for b in range(batch):
            k = _widened(k_cache, idx[b], block_size, g.scratch[0], codes[0]).view(kvh, -1, head_dim)
            v = _widened(v_cache, idx[b], block_size, g.scratch[1], codes[1]).view(kvh, -1, head_dim)
            od[b] = attend(qd[b], k, v, mask[b], None if s_k is None else s_k[b], None if s_v is None else s_v[b])
    return od.view(batch, kvh, n, group, head_dim).permute(0, 2, 1, 3, 4).reshape(batch * n, num_heads, head_dim)


def gather_rows(cache: Cache, idx: torch.Tensor, row: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows `idx` of the cache viewed as [-1, row * head_dim] (row = tokens per gathered row: a
    block, or one token), as [len(idx), row, head_dim] in dtype (dequantised when quantised)."""
    hd = cache.shape[2]
    if not isinstance(cache, QuantizedCache):
        return cache.view(-1, row * hd).index_select(0, idx).view(-1, row, hd)
    codes = cache.bytes_view.view(-1, row * hd).index_select(0, idx).view(cache.data.dtype).view(-1, row, hd)
    return dequantize(codes, cache.scale.view(-1, row).index_select(0, idx), dtype)


def _widened(cache: Cache, idx: torch.Tensor, block_size: int, into: torch.Tensor | torch.dtype,
             codes: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks `idx` as [len(idx), block_size * head_dim], codes widened but not scaled: a new
    tensor of dtype `into`, or written into the tensor `into` (a float cache is gathered straight
    into it; a quantised one through `codes`, a uint8 buffer of the same shape, when given)."""
    rows = cache.bytes_view if isinstance(cache, QuantizedCache) else cache
    rows = rows.view(-1, block_size * cache.shape[2])
    if isinstance(into, torch.dtype):
        got = rows.index_select(0, idx)
        return got.view(cache.data.dtype).to(into) if isinstance(cache, QuantizedCache) else got
    if not isinstance(cache, QuantizedCache):
        return torch.index_select(rows, 0, idx, out=into)
    got = rows.index_select(0, idx) if codes is None else torch.index_select(rows, 0, idx, out=codes)
    return into.copy_(got.view(cache.data.dtype))
