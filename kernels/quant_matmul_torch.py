"""Weight-only quantised matmuls in plain torch: the CPU path and the reference for the Triton ones.

y = x @ dequantize(w).T, computed in fp32 and returned in x's dtype. Dequantising the whole
weight per call is the simple, exact definition; the Triton kernels dequantise tile by tile.
"""
from __future__ import annotations

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
