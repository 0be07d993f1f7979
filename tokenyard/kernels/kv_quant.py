"""Quantised KV-cache storage: int8 or fp8 (e4m3) values with one fp32 scale per (token, kv head).

A quantised cache of one layer is a pair of `QuantizedCache` (K and V), each holding the values
[num_kv_heads, num_slots, head_dim] in the storage dtype and their scales [num_kv_heads,
num_slots] in fp32, addressed by the same slot as the values: a slot's scale is written with its
values, so everything that moves or shares blocks (prefix caching, rollback, preemption) carries
the scales along without knowing they exist.

Symmetric quantisation: scale = max |x| over the head_dim values of one token and head, divided by
the largest code (127 for int8, 448 for e4m3); int8 codes are round(x / scale) (halves away from
zero, the same rule the Triton write kernel uses), e4m3 codes are x / scale rounded by the cast.
Attention dequantises (code * scale) in the model's dtype.

Why per (token, kv head) and not per (block, kv head): `python -m tokenyard.bench.kv_quant_bench --only nll`
measured both on SmolLM2-135M and demo-large (bench/RESULTS.md, "KV-cache quantisation"), the
per-block scale taken over the whole block (the best a per-block scheme could do): per-token
scales changed the per-token NLL less, for int8 and fp8 alike. They are also the only choice that
keeps writes append-only: a block's tokens arrive one decode step at a time, so a per-block
scale would have to grow, and re-quantise the block's earlier tokens, each time a larger value
arrived; a rolled-back draft token would leave its scale behind, and a recomputed last block of
a cached prefix could change the scale under a reader. The cost is 4 bytes per 64-128 bytes of
codes (3-6%).

CPU note: torch widens int8 to fp32 with a vectorised conversion; its fp8 -> fp32 conversion is
several times slower on this machine's CPU (bench/RESULTS.md), so int8 is the CPU choice and
fp8_e4m3 is for GPUs, where the Triton kernel converts in registers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenyard.kernels.kv_cache_dtypes import KV_CACHE_DTYPES

STORAGE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32
# A token whose values are all zero gets this scale (its codes are 0 whatever the scale).
MIN_SCALE = 1e-12


@dataclass(frozen=True, slots=True)
class QuantizedCache:
    """One layer's K (or V) cache in a quantised dtype, with its per-(kv head, slot) scales."""

    data: torch.Tensor    # [num_kv_heads, num_slots, head_dim], int8 or float8_e4m3fn
    scale: torch.Tensor   # [num_kv_heads, num_slots], fp32

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def bytes_view(self) -> torch.Tensor:
        """The values as uint8 (same bytes): CPU index_copy/index_select have no fp8 kernels."""
        return self.data.view(torch.uint8)


def storage_dtype(name: str) -> torch.dtype | None:
    """The storage dtype of a kv_cache_dtype name; None for "auto" (the model's dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return STORAGE_DTYPES.get(name)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes [..., head_dim] in dtype, scales [...] fp32)."""
    qmax = QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(-1).div_(qmax).clamp_min_(MIN_SCALE)
    y = (xf / scale[..., None]).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        # Round halves away from zero (the Triton kernel's rule): add sign(y) / 2, then truncate
        # into int8. Same values as adding where(y >= 0, 0.5, -0.5) (y = 0 truncates to 0 either
        # way), in two small ops instead of three: a decode step writes one token per layer, where
        # the op count, not the data, is the cost (bench/RESULTS.md, issue 27).
        codes = y.add_(y.sign(), alpha=0.5).to(torch.int8)
    else:
        codes = y.to(dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., head_dim], scale [...] -> values [..., head_dim] in dtype."""
    # Widen, then scale in place: on this CPU 1.8x faster than one promoting int8 x fp32 multiply
    # (whose loop converts element by element); float8 has no implicit promotion anyway.
    return codes.to(dtype).mul_(scale[..., None].to(dtype))


def allocate(num_kv_heads: int, num_slots: int, head_dim: int, dtype: torch.dtype,
             device: torch.device) -> QuantizedCache:
    return QuantizedCache(torch.zeros(num_kv_heads, num_slots, head_dim, dtype=dtype, device=device),
                          torch.ones(num_kv_heads, num_slots, dtype=SCALE_DTYPE, device=device))


def bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token of one kv head takes in K (or V): its codes plus its scale."""
    elem = torch.empty((), dtype=dtype).element_size()
    return head_dim * elem + (torch.empty((), dtype=SCALE_DTYPE).element_size() if dtype in QMAX else 0)


def check_device(name: str, device: torch.device) -> None:
    """Raise ValueError when `device` cannot store or convert this kv_cache_dtype: found at
    start-up rather than at the first request."""
    dtype = storage_dtype(name)
    if dtype is None:
        return
    try:
        x = torch.linspace(-1.0, 1.0, 16, device=device).view(2, 8)
        codes, scale = quantize(x, dtype)
        back = dequantize(codes, scale, torch.float32)
        err = float((back - x).abs().max())
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise ValueError(f"kv_cache_dtype {name} cannot be stored on device {device}: {exc}") from exc
    if not err < 0.1:
        raise ValueError(f"kv_cache_dtype {name} does not round-trip on device {device} (error {err:.3g})")
