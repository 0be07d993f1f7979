"""Eager fp32 linear layers on oneDNN's packed weights, for the CPU steps torch runs (prefill, mixed).

    n = pack_linears(model)            # every fp32 CPU nn.Linear of the decoder and its LM head
    speedup = measured_speedup(k, n, m) # packed over plain F.linear, one thread count, this machine

Why: torch's F.linear on a CPU calls MKL's sgemm, which on AMD CPUs is not known to take its
AVX-512 path, while oneDNN (also inside torch) picks its kernels by ISA on any vendor. On the Zen 4
VM of 2026-12-04 the packed oneDNN product was 1.1-1.2x faster than F.linear at 512 rows of W2's
shapes and 1.2-2.7x at 8-96 rows (bench/RESULTS.md). AVX2-only machines are unmeasured, so the
engine's "auto" times both on the decoder's largest projection before it packs anything, and
keeps MKL where oneDNN is not faster.

The packed weight is a second copy in oneDNN's blocked layout (an opaque mkldnn tensor), kept beside
the original: the C decode step and anything reading `weight` (quantisation, tensor-parallel
slicing, state dicts) see the plain tensor, unchanged. Results agree with F.linear to fp32 rounding,
not bit for bit (a different summation order). Under torch.compile the layer traces as F.linear, so
the compiled decoder packs its own weights as before.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn


def available() -> bool:
    """True when this torch build has oneDNN's linear ops (CPU builds with mkldnn)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight"))


def _pack(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=rows_hint)


class OneDNNLinear(nn.Linear):
    """An nn.Linear whose eager forward multiplies by a packed copy of its weight.

    It shares `weight` and `bias` with the layer it replaces (the same Parameter objects)."""

    def __init__(self, linear: nn.Linear, rows_hint: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = _pack(linear.weight, rows_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def eligible(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module) is nn.Linear and isinstance(w, torch.Tensor) and w.dtype == torch.float32
            and w.device.type == "cpu" and w.dim() == 2)


def pack_linears(model: nn.Module, rows_hint: int = 512) -> int:
    """Replace every plain fp32 CPU nn.Linear in `model` by a OneDNNLinear; returns how many.

    Quantised layers and other Linear subclasses are left alone."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if eligible(child)]
    for parent, name, child in targets:
        setattr(parent, name, OneDNNLinear(child, rows_hint))
    return len(targets)


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed copies (the second copy of each packed weight)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, OneDNNLinear))


def measured_speedup(in_features: int, out_features: int, rows: int, repeats: int = 5) -> float:
    """Time of F.linear over the packed oneDNN product for one [rows, in] x [in, out] fp32 product on
    this machine at torch's current thread count (best of `repeats`, after a warm-up call each)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    packed = _pack(w, rows)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    with torch.inference_mode():
        plain = best(lambda: F.linear(x, w))
        onednn = best(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    return plain / max(onednn, 1e-9)
