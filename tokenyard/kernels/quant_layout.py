"""Device-neutral layouts for weight-only quantisation, in plain torch.

Checkpoints store these layouts; each backend repacks them at load if it wants something else
(the Triton kernels in `quant_matmul_triton` read them as they are).

- int8, symmetric, one scale per output channel: w ~= w_q * scales[:, None],
  w_q int8 [N, K] in [-127, 127], scales [N].
- int4, asymmetric, one (scale, zero) per output channel and group of `group_size` inputs:
  w ~= (q - zero) * scale, q in [0, 15] packed two per byte along K (low nibble = even k,
  high nibble = odd k) into uint8 [N, K // 2]; scales [N, K // group_size] float,
  zeros [N, K // group_size] uint8 in [0, 15] (an integer zero point keeps 0.0 exact).
- int4 with float minimums (`Int4Weight.mins` set, `zeros` None): w = q * scale + min, the form
  of GGUF's Q4_1 (groups of 32, fp16 scale and minimum). An integer zero point cannot express an
  arbitrary float offset, so this second form exists to take such weights as stored, with no
  requantisation. The two forms share the packing and the scales; each backend reads either.
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
    packed: torch.Tensor         # uint8 [N, K // 2]
    scales: torch.Tensor         # [N, K // group_size]
    zeros: torch.Tensor | None   # uint8 [N, K // group_size]; None when `mins` is set
    group_size: int
    mins: torch.Tensor | None = None  # float [N, K // group_size]: w = q * scale + min

    def __post_init__(self) -> None:
        if (self.zeros is None) == (self.mins is None):
            raise ValueError("Int4Weight needs exactly one of zeros (integer zero points) or mins (float minimums)")

    def with_mins(self) -> "Int4Weight":
        """The same weight in the float-minimum form (a no-op if it already is), so that parts of a
        fused projection stored in different forms can be concatenated."""
        if self.mins is not None:
            return self
        return Int4Weight(self.packed, self.scales, None, self.group_size, mins=zeros_to_mins(self.scales, self.zeros))


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
    return Int4Weight(pack_int4(q), scales.to(scale_dtype), zeros.to(torch.uint8), group_size)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of values in [0, 15] -> uint8 [N, K // 2] (low nibble = even k)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def zeros_to_mins(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """(q - z) * s == q * s + (-z * s). In float32 this is exact when s has at most 20
    significant bits (fp16 scales, e.g. GGUF Q4_0): z * s then needs at most 24, and q * s - z * s
    = (q - z) * s is exactly representable too. Wider scales may differ by an ulp of w."""
    return -zeros.float() * scales.float()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 [N, K] of values in [0, 15]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                    dtype: torch.dtype = torch.float32, mins: torch.Tensor | None = None) -> torch.Tensor:
    """w = (q - zero) * scale, or q * scale + min when `mins` is given (then `zeros` is ignored)."""
    q = unpack_int4(packed).float()
    n, k = q.shape
    g = q.reshape(n, k // group_size, group_size)
    if mins is not None:
        # Multiply, round, then add, round: the same two fp32 operations as gguf's Q4_1
        # dequantisation (d * q + m), so the values agree bit for bit (no fused multiply-add).
        w = g * scales.float()[..., None] + mins.float()[..., None]
    else:
        w = (g - zeros.float()[..., None]) * scales.float()[..., None]
    return w.reshape(n, k).to(dtype)


def dequantize_int4_weight(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_int4(w.packed, w.scales, w.zeros, w.group_size, dtype, mins=w.mins)
