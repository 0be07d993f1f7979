"""Batched LoRA products in Triton (CUDA; the CPU interpreter in tests), segment by segment.

The same contract as tokenyard.kernels.lora_torch.lora_add, in two kernels:
- shrink: t[p, :] = scale[slot] * x[perm[p]] @ A[slot].T for every row p of every segment, into an
  fp32 workspace [R_rows, R] (rows in perm's order);
- expand: y[perm[p], n] += t[p] @ B[slot, n].T, each program owning a (rows, columns) tile of one
  segment, so no two programs write the same element: no atomics, deterministic.
Grid: (segments, row tiles of the longest segment, rank or column tiles); programs past their
segment's end exit at once. A and B are read at the pool's full rank; the pool keeps the columns
past an adapter's own rank at zero, so they add nothing. Uses only Triton APIs in 3.6 and 3.9.
"""
# No `from __future__ import annotations` here: @triton.jit reads the tl.constexpr annotations.
import torch
import triton
import triton.language as tl

from .lora_torch import LoraSegments

BLOCK_M = 16
BLOCK_R = 16
BLOCK_K = 32
BLOCK_N = 32


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, scale_ptr, t_ptr, perm_ptr, starts_ptr, slots_ptr,
                   K, R, stride_xm, stride_as, stride_ar, stride_tm,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    p = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if start + tl.program_id(1) * BLOCK_M >= end:
        return
    p_ok = p < end
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    rows = tl.load(perm_ptr + p, mask=p_ok, other=0).to(tl.int64)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=p_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                     mask=r_ok[None, :] & k_ok[:, None], other=0.0)   # [BLOCK_K, BLOCK_R]: A[slot].T
        acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc=acc, input_precision="ieee")
    scale = tl.load(scale_ptr + slot)
    tl.store(t_ptr + p.to(tl.int64)[:, None] * stride_tm + r[None, :], acc * scale, mask=p_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(t_ptr, b_ptr, y_ptr, perm_ptr, starts_ptr, slots_ptr,
                   N, R, stride_tm, stride_bs, stride_bn, stride_br, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    p = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if start + tl.program_id(1) * BLOCK_M >= end:
        return
    p_ok = p < end
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    rows = tl.load(perm_ptr + p, mask=p_ok, other=0).to(tl.int64)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R
        tt = tl.load(t_ptr + p.to(tl.int64)[:, None] * stride_tm + r[None, :], mask=p_ok[:, None] & r_ok[None, :],
                     other=0.0)
        bt = tl.load(b_ptr + slot * stride_bs + n[None, :] * stride_bn + r[:, None] * stride_br,
                     mask=n_ok[None, :] & r_ok[:, None], other=0.0)   # [BLOCK_R, BLOCK_N]: B[slot].T
        acc = tl.dot(tt, bt.to(tl.float32), acc=acc, input_precision="ieee")
    dst = y_ptr + rows[:, None] * stride_ym + n[None, :]
    mask = p_ok[:, None] & n_ok[None, :]
    old = tl.load(dst, mask=mask, other=0.0)
    tl.store(dst, (old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
             seg: LoraSegments) -> None:
    """y [T, N] += the adapters' products of x [T, K], in place (y may be a column slice: its rows'
    stride is kept). a: [slots, R, K], contiguous in its last dimension; b: [slots, N, R], any strides
    (the pool's b_of view is strided: its R runs along the pool's rows);
    scales: [slots] fp32. seg needs its tensors (build_segments(..., with_tensors=True))."""
    assert seg.starts_t is not None and seg.slots_t is not None, "segments built without their tensors"
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.stride(2) == 1
    k, r, n = x.shape[1], a.shape[1], y.shape[1]
    rows = seg.starts[-1]
    t = torch.empty(rows, r, dtype=torch.float32, device=x.device)
    m_tiles = triton.cdiv(seg.max_len, BLOCK_M)
    _shrink_kernel[(seg.num_segments, m_tiles, triton.cdiv(r, BLOCK_R))](
        x, a, scales, t, seg.perm, seg.starts_t, seg.slots_t, k, r, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    _expand_kernel[(seg.num_segments, m_tiles, triton.cdiv(n, BLOCK_N))](
        t, b, y, seg.perm, seg.starts_t, seg.slots_t, n, r, t.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R)
