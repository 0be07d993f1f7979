"""Weight-only quantised matmuls in Triton, dequantising inside the kernel.

Both read the device-neutral layouts of `quant_layout` as stored, so no repack is needed:
- int8: y = (x @ w_q.T) * scales. The int8 tile converts exactly to the activation dtype, the
  product accumulates in fp32 on tl.dot, and the per-channel scale is applied once at the end.
- int4: a K tile is exactly one quantisation group, so (q - zero) is a small exact integer in the
  activation dtype and the group's scale multiplies the tile's fp32 partial product. The two
  nibbles of a byte hold k and k+1; rather than interleave the weights, the kernel splits the
  x tile (much smaller than the weight tile at decode sizes) into its even and odd columns and
  runs two half-width products, so every nibble is used where it lies.
- int4 with float minimums (w = q * scale + min, GGUF Q4_1): the min is constant over a group,
  so sum_k x_k (q_k s + m) = s * (x . q) + m * sum_k x_k. The products use the raw nibbles
  (exact small integers) and the tile's row sums of x, in fp32, carry the minimums: one extra
  reduction per tile instead of a float add per weight.

Grid: (M tiles, N tiles, K splits). Decode-sized batches (M <= 16) give few (M, N) tiles, so on
a GPU the K range is split across programs into an fp32 workspace that a sum then reduces:
deterministic, unlike atomics. Uses only Triton APIs present in 3.6 and 3.9.
"""
# No `from __future__ import annotations` here: @triton.jit reads the tl.constexpr
# annotations of kernel parameters, which should stay objects rather than strings.
import torch
import triton
import triton.language as tl

from .device_info import sm_count


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr,
                         M, N, tiles_per_split, num_k_tiles,
                         stride_xm, stride_xk, stride_wn, stride_sn, stride_zn,
                         stride_os, stride_om, stride_on,
                         INT4: tl.constexpr, MINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # weights are read as [K, N] tiles
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    t_lo = split * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, num_k_tiles)
    for t in range(t_lo, t_hi):
        k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        xt = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None], other=0.0)
        if INT4:
            j = tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_cols + (t * (BLOCK_K // 2) + j)[:, None], mask=n_ok[None, :], other=0)
            # zero_ptr holds the integer zero points, or the float minimums when MINS.
            zero = tl.load(zero_ptr + offs_n * stride_zn + t, mask=n_ok, other=0).to(tl.float32)
            scale = tl.load(scale_ptr + offs_n * stride_sn + t, mask=n_ok, other=0).to(tl.float32)
            if MINS:
                w_even = (packed & 0xF).to(x_ptr.dtype.element_ty)
                w_odd = (packed >> 4).to(x_ptr.dtype.element_ty)
            else:
                w_even = ((packed & 0xF).to(tl.float32) - zero[None, :]).to(x_ptr.dtype.element_ty)
                w_odd = ((packed >> 4).to(tl.float32) - zero[None, :]).to(x_ptr.dtype.element_ty)
            # x was loaded contiguous (vectorised, pipelined); its even and odd columns are
            # split apart in registers.
            x_even, x_odd = tl.split(tl.reshape(xt, [BLOCK_M, BLOCK_K // 2, 2]))
            part = tl.dot(x_even, w_even, input_precision="ieee")
            part = tl.dot(x_odd, w_odd, acc=part, input_precision="ieee")
            acc += part * scale[None, :]
            if MINS:
                acc += tl.sum(xt.to(tl.float32), axis=1)[:, None] * zero[None, :]
        else:
            w = tl.load(w_cols + k[:, None], mask=n_ok[None, :], other=0)
            acc = tl.dot(xt, w.to(x_ptr.dtype.element_ty), acc=acc, input_precision="ieee")
    if not INT4:
        scale = tl.load(scale_ptr + offs_n * stride_sn, mask=n_ok, other=0).to(tl.float32)
        acc = acc * scale[None, :]
    dst = (out_ptr + split.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
           + offs_n[None, :] * stride_on)
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_MAX_SPLIT_K = 16


def _tiles(m: int) -> tuple[int, int]:
    # BLOCK_M follows the batch (tl.dot needs >= 16 rows; padding rows are masked); small
    # batches take narrower N tiles so that more programs stream the weight.
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    return block_m, 64 if m <= 64 else 128


def _auto_split_k(programs: int, k_tiles: int, device: torch.device) -> int:
    # Fill about two waves of SMs, keeping >= 4 K tiles per split. Shape-based: no sync.
    if device.type != "cuda":
        return 1
    want = -(-2 * sm_count(device) // programs)
    return max(1, min(want, k_tiles // 4, _MAX_SPLIT_K))


def _launch(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            n: int, block_k: int, int4: bool, split_k: int | None, out: torch.Tensor | None,
            mins: bool = False) -> torch.Tensor:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if out is None:
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    if m == 0:
        return out
    block_m, block_n = _tiles(m)
    grid_mn = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    k_tiles = k // block_k
    if split_k is None:
        split_k = _auto_split_k(grid_mn[0] * grid_mn[1], k_tiles, x.device)
    split_k = max(1, min(split_k, k_tiles))
    per_split = triton.cdiv(k_tiles, split_k)
    split_k = triton.cdiv(k_tiles, per_split)  # no empty splits
    dst = out2 if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    os_, om, on = (0, *out2.stride()) if split_k == 1 else dst.stride()
    z = zeros if zeros is not None else scales
    _quant_matmul_kernel[(grid_mn[0], grid_mn[1], split_k)](
        x2, w, scales, z, dst, m, n, per_split, k_tiles,
        x2.stride(0), x2.stride(1), w.stride(0), scales.stride(0), z.stride(0),
        os_, om, on,
        INT4=int4, MINS=mins, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=8 if block_m * block_n >= 128 * 128 else 4)
    if split_k > 1:
        out2.copy_(dst.sum(dim=0))
    return out


def int8_matmul(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, split_k: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) @ (w_q int8 [N, K] * scales [N, 1]).T -> [..., N] in x's dtype.

    K must be a multiple of 32 (128 in practice). split_k defaults to a shape-based choice.
    """
    n, k = w_q.shape
    assert x.shape[-1] == k and w_q.dtype == torch.int8 and w_q.stride(1) == 1 and scales.shape == (n,)
    block_k = next((b for b in (128, 64, 32) if k % b == 0), None)
    if block_k is None:
        raise ValueError(f"int8_matmul needs K a multiple of 32, got {k}")
    return _launch(x, w_q, scales, None, n, block_k, False, split_k, out)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group_size: int, split_k: int | None = None, out: torch.Tensor | None = None,
                mins: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_int4(packed uint8 [N, K // 2], scales, zeros or mins, group_size).T -> [..., N].

    With `mins` (float [N, K / group_size]) the weight is q * scale + min and `zeros` is ignored.
    """
    n, half_k = packed.shape
    k = half_k * 2
    groups = k // group_size
    assert x.shape[-1] == k and packed.dtype == torch.uint8 and packed.stride(1) == 1
    assert group_size in (32, 64, 128) and k % group_size == 0
    offsets = zeros if mins is None else mins
    assert scales.shape == (n, groups) and offsets.shape == (n, groups)
    assert scales.stride(1) == 1 and offsets.stride(1) == 1
    return _launch(x, packed, scales, offsets, n, group_size, True, split_k, out, mins=mins is not None)
