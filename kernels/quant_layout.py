"""Device-neutral layouts for weight-only quantisation, in plain torch.

Checkpoints store these layouts; each backend repacks them at load if it wants something else
(the Triton kernels in `quant_matmul_triton` read them as they are).

- int8, symmetric, one scale per output channel: w ~= w_q * scales[:, None],
  w_q int8 [N, K] in [-127, 127], scales [N].
- int4, asymmetric, one (scale, zero) per output channel and group of `group_size` inputs:
  w ~= (q - zero) * scale, q in [0, 15] packed two per byte along K (low nibble = even k,
  high nibble = odd k) into uint8 [N, K // 2]; scales [N, K // group_size] float,
  zeros [N, K // group_size] uint8 in [0, 15] (an integer zero point keeps 0.0 exact).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(slots=True)
class Int8Weight:
    w_q: torch.Tensor      # int8 [N, K]
    scales: torch.Tensor   # [N]


@dataclass(slots=True)
class Int4Weight:
    packed: torch.Tensor   # uint8 [N, K // 2]
    scales: torch.Tensor   # [N, K // group_size]
    zeros: torch.Tensor    # uint8 [N, K // group_size]
    group_size: int


# Floor for scales: an all-zero channel or group would otherwise divide by zero.
_MIN_SCALE = 1e-10


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> Int8Weight:
    """w [N, K] float -> symmetric int8 per output channel (round to nearest)."""
    w32 = w.float()
    scales = (w32.abs().amax(dim=1) / 127.0).clamp_min(_MIN_SCALE)
    w_q = torch.round(w32 / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(w_q, scales.to(scale_dtype))


def dequantize_int8(w_q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (w_q.float() * scales.float()[:, None]).to(dtype)


def quantize_int4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float32) -> Int4Weight:
    """w [N, K] float -> asymmetric int4 per (output channel, group of group_size along K)."""
    n, k = w.shape
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES} and divide K={k}, got {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    # The range always contains 0 so that the zero point is an integer in [0, 15].
    lo = g.amin(dim=2).clamp_max(0.0)
    hi = g.amax(dim=2).clamp_min(0.0)
    scales = ((hi - lo) / 15.0).clamp_min(_MIN_SCALE)
    zeros = torch.round(-lo / scales).clamp_(0, 15)
    q = (torch.round(g / scales[..., None]) + zeros[..., None]).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return Int4Weight(packed.contiguous(), scales.to(scale_dtype), zeros.to(torch.uint8), group_size)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 [N, K] of values in [0, 15]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q = unpack_int4(packed).float()
    n, k = q.shape
    g = q.reshape(n, k // group_size, group_size)
    w = (g - zeros.float()[..., None]) * scales.float()[..., None]
    return w.reshape(n, k).to(dtype)
