"""Which dtype the dense CPU GEMMs of quantised prefill run in: bf16 where this CPU multiplies bf16
fast, else fp32.

The quantised prefill paths (tokenyard.kernels.quant_matmul_torch `int8_dense_mm`, `int4pack_dense_mm`)
dequantise weight tiles and run dense GEMMs. On CPUs with AVX512-BF16 or AMX, torch's bf16 GEMM
runs at 2-3x the fp32 rate, so the tiles are bf16. Without those units (an AVX2-only CPU) torch
falls back to a scalar bf16 loop: on such a VM of this project's machine kind, a 512 x 576 x 1536
bf16 GEMM ran at 1.2 GFLOP/s against 79 for fp32 (2026-12-02), which made SmolLM2 int4 prefill
35x slower than on the AVX512 VMs. So the choice is measured once per process: the same GEMM in
both dtypes, fastest of three; bf16 wins only when it is at least as fast as fp32. The gap either
way is large (>2x), so the probe's noise does not decide it. Either dtype multiplies the same
weights (the packed op's, rounded to bf16); fp32 only accumulates more exactly.
"""
from __future__ import annotations

import time

import torch

_choice: dict[str, torch.dtype] = {}


def _best_seconds(a: torch.Tensor, b: torch.Tensor, reps: int = 3) -> float:
    torch.mm(a, b)                       # first call: allocation and dispatch set-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return best


def dense_dtype() -> torch.dtype:
    """torch.bfloat16 where bf16 GEMMs are at least as fast as fp32 on this CPU, else torch.float32
    (measured on first use, ~0.1 s at worst, then cached for the process)."""
    hit = _choice.get("cpu")
    if hit is None:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(128, 512, generator=g)
        b = torch.randn(512, 256, generator=g)
        fp32 = _best_seconds(a, b)
        bf16 = _best_seconds(a.to(torch.bfloat16), b.to(torch.bfloat16))
        hit = torch.bfloat16 if bf16 <= fp32 else torch.float32
        _choice["cpu"] = hit
    return hit


def set_dense_dtype(dtype: torch.dtype | None) -> None:
    """Fix the choice (torch.bfloat16 or torch.float32), or None to measure again on next use."""
    if dtype is None:
        _choice.pop("cpu", None)
    elif dtype in (torch.bfloat16, torch.float32):
        _choice["cpu"] = dtype
    else:
        raise ValueError(f"dense CPU GEMM dtype must be bfloat16 or float32, got {dtype}")
