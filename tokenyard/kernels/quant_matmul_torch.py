"""Weight-only quantised matmuls in plain torch: the CPU paths and the reference for the Triton ones.

Reference (`int8_matmul`, `int4_matmul`): y = x @ dequantize(w).T, computed in fp32 and returned
in x's dtype. Dequantising the whole weight per call is the simple, exact definition; the Triton
kernels dequantise tile by tile.

Dense prefill on the CPU (`int8_dense_mm`, `int4pack_dense_mm`): torch's packed weight-only CPU
ops (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`) cost about the same per row
at any M, so for many rows it is faster to dequantise the weight to bf16 and run bf16 GEMMs. These
functions read the very tensors the packed ops read (no second copy of the weight is kept), and
dequantise them tile by tile along N: at most `tile_cols` output columns of bf16 weight exist at a
time. The bf16 weight they build equals, bit for bit, the weight the packed op uses rounded to
bf16 (the packed ops compute w in fp32 and multiply it by the bf16 activations in fp32); the GEMM
then accumulates in fp32 like the packed op. So the two paths differ by the bf16 rounding of each
weight (relative 2^-9) and by summation order; tests/engines/test_quant_prefill.py checks both the exact
weights and the output bounds.
"""
from __future__ import annotations

import functools

import torch

from .quant_layout import dequantize_int4


def int8_matmul(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (w_q int8 [N, K] * scales [N, 1]).T -> [..., N]."""
    # The per-channel scale factors out of the sum: scale after the product, as the kernel does.
    y = torch.matmul(x.float(), w_q.float().t()) * scales.float()
    return y.to(x.dtype)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group_size: int, mins: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_int4(packed [N, K // 2], scales, zeros or mins).T -> [..., N]."""
    w = dequantize_int4(packed, scales, zeros, group_size, torch.float32, mins=mins)
    return torch.matmul(x.float(), w.t()).to(x.dtype)


# -- dense prefill on the CPU -------------------------------------------------------------------

def int8_dense_mm(xb: torch.Tensor, w_q: torch.Tensor, scales_bf16: torch.Tensor, tile_cols: int) -> torch.Tensor:
    """xb [M, K] @ (w_q int8 [N, K] * scales bf16 [N]).T -> [M, N] in xb's dtype (bf16, or fp32
    where bf16 GEMMs are slow: tokenyard.kernels.cpu_gemm), in even tiles of at most `tile_cols` rows of w.

    w_q * scale is exact in fp32 (7 x 8 significant bits), so the weight is round_bf16(w_q * scale):
    what the packed op multiplies by, rounded once. In fp32 and in place: 1.3x faster here than
    torch's bf16 multiply, and one intermediate (see int4pack_dequant_t on page faults)."""
    n = w_q.shape[0]
    scales = scales_bf16.float()
    count = max(1, -(-n // tile_cols))
    step = -(-n // count)
    outs = []
    for n0 in range(0, n, step):  # static trip count: n and tile_cols are Python ints
        n1 = min(n, n0 + step)
        w = w_q[n0:n1].float().mul_(scales[n0:n1, None]).to(torch.bfloat16)
        outs.append(torch.nn.functional.linear(xb, w if xb.dtype == torch.bfloat16 else w.to(xb.dtype)))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


# torch's CPU int4 packing (`aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1)`, uint8
# [N, K/2]) stores N in blocks of BLOCK_N rows (64 with AVX512, 32 with AVX2 or without vector
# units): block b holds K * BLOCK_N / 2 bytes, k-major. With AVX512 or AVX2, byte j of row k holds
# row j of the block in its low nibble and row j + BLOCK_N/2 in its high nibble ("halves");
# without, neighbours share a byte: rows 2j (low) and 2j + 1 (high) ("pairs"). A last, narrower
# block (N % BLOCK_N rows, a multiple of 16) is always in pairs. The layout depends on the CPU
# capability torch dispatched to, so it is probed once per process (`int4pack_cpu_layout`); if no
# known layout reproduces the probe, the dense path is off and the packed op runs at any M.
Int4PackLayout = tuple[int, bool]   # (BLOCK_N, halves)
_LAYOUT_CANDIDATES: tuple[Int4PackLayout, ...] = ((64, True), (32, True), (32, False), (64, False))


def _nibbles_t(b: torch.Tensor, halves: bool, k: int, cols: int) -> torch.Tensor:
    """bytes [K, blocks, width] -> their nibbles minus 8 as rows of the weight, transposed: int8 [K, cols].

    q - 8 is q's low 4 bits read as a signed 4-bit number with bit 3 flipped: XOR 0x88 flips both
    nibbles' top bits, and arithmetic shifts of the int8 view sign-extend each nibble."""
    bx = (b ^ 0x88).view(torch.int8)
    return torch.stack([(bx << 4) >> 4, bx >> 4], dim=2 if halves else 3).reshape(k, cols)


def _decode_int4pack(packed: torch.Tensor, n: int, k: int, layout: Int4PackLayout, n0: int, n1: int) -> torch.Tensor:
    """q - 8 (int8 in [-8, 7]) of rows n0:n1 of the packed weight, transposed: [K, n1 - n0].
    n0 is a multiple of BLOCK_N; n1 is too, or n (the narrower last block is decoded whole)."""
    block_n, halves = layout
    flat = packed.reshape(-1)
    full = n // block_n * block_n
    parts = []
    f1 = min(n1, full)
    if f1 > n0:
        nb = (f1 - n0) // block_n
        blk = flat[n0 * k // 2: f1 * k // 2].view(nb, k, block_n // 2).permute(1, 0, 2)   # [K, nb, BLOCK_N/2]
        parts.append(_nibbles_t(blk, halves, k, f1 - n0))
    if n1 > full:
        tail = flat[full * k // 2:].view(k, 1, (n - full) // 2)
        parts.append(_nibbles_t(tail, False, k, n - full))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def int4pack_codes(packed: torch.Tensor, n: int, k: int, layout: Int4PackLayout) -> torch.Tensor:
    """The 4-bit codes q in [0, 15] of all n rows (padding included) of torch's packed CPU weight:
    uint8 [n, K] (w = (q - 8) * scale + zero'; readers such as the C decode step repack them)."""
    return (_decode_int4pack(packed, n, k, layout, 0, n).t() + 8).to(torch.uint8)


@functools.cache
def int4pack_cpu_layout() -> Int4PackLayout | None:
    """The layout of torch's CPU int4 packing in this process, or None if it is not one this
    module can read (then callers keep the packed op)."""
    try:
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    except (AttributeError, RuntimeError):
        return None
    g = torch.Generator().manual_seed(0)
    # 2 full blocks of 64 (4 of 32) plus a 48-row last block (16 after blocks of 32); K = 64
    n, k = 176, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    try:
        packed = pack(q, 1)
    except RuntimeError:
        return None
    if packed.dtype != torch.uint8 or packed.numel() * 2 != q.numel():
        return None
    for layout in _LAYOUT_CANDIDATES:
        if torch.equal(_decode_int4pack(packed, n, k, layout, 0, n).t().to(torch.int32), q - 8):
            return layout
    return None


def int4pack_dense_tiles(n: int, layout: Int4PackLayout, tile_cols: int) -> list[tuple[int, int]]:
    """Column tiles [n0, n1) for `int4pack_dense_mm`: as few as keep each within `tile_cols` (or
    one BLOCK_N), of even widths rounded up to multiples of BLOCK_N, the last one ending at n."""
    block_n = layout[0]
    full = n // block_n * block_n
    count = -(-n // max(tile_cols, block_n))
    width = -(-n // count)
    step = -(-width // block_n) * block_n
    tiles = [(n0, min(n0 + step, full)) for n0 in range(0, full, step)]
    if n > full:
        if tiles:
            tiles[-1] = (tiles[-1][0], n)
        else:
            tiles = [(0, n)]
    return tiles


def int4pack_dequant_t(packed: torch.Tensor, scale_zero: torch.Tensor, n: int, k: int, group_size: int,
                       layout: Int4PackLayout, n0: int, n1: int) -> torch.Tensor:
    """Rows n0:n1 of the weight the packed op computes, transposed and rounded to bf16: [K, n1 - n0].

    The op's weight is w = (q - 8) * scale + zero' in fp32, scale and zero' from `scale_zero`
    (bf16 [K / group_size, N, 2]). Here q - 8 (exact in bf16) goes into torch's bf16 addcmul,
    which computes zero' + (q - 8) * scale in fp32 and rounds once to bf16: (q - 8) * scale is
    exact in fp32 (4 x 8 significant bits), so the fp32 sum is the op's fused multiply-add, and
    the result is that weight rounded to bf16. Scale and zero' are split into contiguous rows
    first: broadcasting the interleaved [K/g, N, 2] (stride 2) defeats the vectorised loop
    (5-10x slower). One bf16 intermediate per tile and no fp32 one: fp32 arithmetic took 2.3x as
    long, and each extra intermediate of a few MiB that is freed and allocated again per call
    costs page faults once glibc returns it to the system."""
    cols = n1 - n0
    q = _decode_int4pack(packed, n, k, layout, n0, n1).view(k // group_size, group_size, cols)
    scale = scale_zero[:, n0:n1, 0].contiguous()[:, None, :]             # bf16 [K/g, 1, cols]
    zero = scale_zero[:, n0:n1, 1].contiguous()[:, None, :]
    return torch.addcmul(zero, q.to(torch.bfloat16), scale).view(k, cols)


def int4pack_dense_mm(xb: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, n: int, k: int,
                      group_size: int, layout: Int4PackLayout, tiles: list[tuple[int, int]]) -> torch.Tensor:
    """xb [M, K] @ W.T -> [M, n] in xb's dtype for the packed int4 weight of n rows (`packed`'s rows,
    padding included: the layout's blocks count them), one GEMM per column tile of `tiles`
    (`int4pack_dense_tiles`): bf16, or fp32 on the bf16-rounded weight where bf16 GEMMs are slow
    (tokenyard.kernels.cpu_gemm)."""
    outs = [torch.mm(xb, int4pack_dequant_t(packed, scale_zero, n, k, group_size, layout, n0, n1).to(xb.dtype))
            for n0, n1 in tiles]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
